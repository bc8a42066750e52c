"""The document-length distributions every benchmark point is measured on, made from the bundled
corpus and tokenizer (no download), the same bytes on every machine.

- `short`: the bundled corpus as it ships (documents of about 54 tokens, ~600 a 32k row).
- `one-document`: documents longer than any row (about 1.2M tokens each), so that every row
  is one document, cut from a longer one as the loader cuts it.
- `long-tail`: log-normal document lengths with a mean of 4,096 tokens (median about 2,000)
  and a tail past the row lengths (about 1% above 32k tokens), as long-context data has.

The two made corpora are JSON lines of text cut from the bundled corpus's token stream, its
blank lines removed and repeated as often as needed; each document's length is counted in
tokens of the bundled tokenizer (re-encoding a cut text gives back about as many tokens).
`trainer_settings(name)` are the run_train.sh settings that train on one.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

from benchmarks.records import REPO_ROOT

CORPORA = ("short", "one-document", "long-tail")
CORPUS_DIR = REPO_ROOT / "outputs" / "corpora"
TOKENIZER = REPO_ROOT / "assets" / "tokenizer"
SOURCE = REPO_ROOT / "assets" / "tinyshakespeare.txt"

ONE_DOCUMENT_TOKENS = 1_200_000  # longer than the longest row measured (786,432)
LONG_TAIL_MEAN, LONG_TAIL_SIGMA = 4096, 1.2
CORPUS_TOKENS = 8_000_000  # per made corpus: rows for every point of a benchmark run


def trainer_settings(name: str) -> list[str]:
    """run_train.sh arguments that train on corpus `name` (made first where needed)."""
    if name not in CORPORA:
        raise SystemExit(f"--corpus {name!r}: choose one of {CORPORA}")
    if name == "short":
        return ["--training.dataset", "tinyshakespeare"]
    return ["--training.dataset", "jsonl", "--training.dataset_path", str(corpus_path(name))]


def corpus_path(name: str) -> Path:
    path = CORPUS_DIR / f"{name}.jsonl"
    if not path.exists():
        write_corpus(name, path)
    return path


def document_lengths(name: str, total_tokens: int) -> list[int]:
    """Token counts of the corpus's documents, in order, adding up to at least `total_tokens`
    (the last one may end past it, where the loader cuts it)."""
    if name == "short":
        return _repeated(_bundled_document_lengths(), total_tokens)
    if name == "one-document":
        count = math.ceil(total_tokens / ONE_DOCUMENT_TOKENS)
        return [ONE_DOCUMENT_TOKENS] * count
    gen = torch.Generator().manual_seed(0)
    mu = math.log(LONG_TAIL_MEAN) - LONG_TAIL_SIGMA**2 / 2  # the log-normal's mean is then 4,096
    lengths, total = [], 0
    while total < total_tokens:
        draw = torch.empty(4096).log_normal_(mu, LONG_TAIL_SIGMA, generator=gen)
        for length in draw.round().clamp(min=16).long().tolist():
            lengths.append(length)
            total += length
            if total >= total_tokens:
                break
    return lengths


@functools.cache
def _bundled_document_lengths() -> tuple[int, ...]:
    """The bundled corpus's documents (blank-line separated, as the loader reads them) in
    tokens, with the BOS and EOS that the loader adds to each."""
    from titan_gdn.data.sources import TextFileSource
    from titan_gdn.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(TOKENIZER))
    special = len(tokenizer.encode("", add_bos=True, add_eos=True))
    texts = list(TextFileSource(SOURCE).iter_documents(0, 1))
    encoded = tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)
    return tuple(len(e.ids) + special for e in encoded)


def _repeated(lengths: tuple[int, ...], total_tokens: int) -> list[int]:
    """`lengths` in order, from the start again as often as needed, up to `total_tokens`."""
    out, total = [], 0
    while total < total_tokens:
        for length in lengths:
            out.append(length)
            total += length
            if total >= total_tokens:
                break
    return out


def write_corpus(name: str, path: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    text = "\n".join(line for line in SOURCE.read_text().splitlines() if line.strip())
    stream = tokenizer.encode(text, add_special_tokens=False).ids
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    offset = 0
    with open(partial, "w") as out:
        for length in document_lengths(name, CORPUS_TOKENS):
            ids = [stream[(offset + i) % len(stream)] for i in range(length)]
            offset = (offset + length) % len(stream)
            out.write(json.dumps({"text": tokenizer.decode(ids)}) + "\n")
    partial.rename(path)  # a run stopped mid-write leaves no half corpus behind
