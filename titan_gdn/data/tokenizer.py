"""The run's tokenizer, read once: the config check and the trainer both need it."""

from __future__ import annotations

import functools
import os


def load_tokenizer(folder: str | None):
    """torchtitan's HuggingFaceTokenizer of `folder`, shared by every caller while the folder's
    files stay as they are (neither the check nor the trainer changes it)."""
    return _tokenizer(folder, _files_signature(folder))


@functools.lru_cache(maxsize=1)
def _tokenizer(folder: str | None, signature: tuple):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(folder)


def _files_signature(folder: str | None) -> tuple:
    """Name, size and modification time of each file: a tokenizer rewritten in place is read
    again."""
    if not folder:
        return ()
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        return tuple(
            (entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
            for entry in entries
            if entry.is_file()
        )
    except OSError:
        return ()
