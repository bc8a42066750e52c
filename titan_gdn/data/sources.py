"""Document sources: turn `<section>.dataset` / `<section>.dataset_path` into a stream of texts.

Sources stream documents one at a time so that big corpora are never held in memory, and are
addressed by document index so that a data-parallel rank can read only its own shard and a
resumed loader can restart mid-corpus.
"""

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

# The repository root is titan_gdn/'s parent; the bundled corpus lives there so the default
# works from any working directory.
ASSETS_DIR = Path(__file__).resolve().parents[2] / "assets"
TINYSHAKESPEARE_PATH = ASSETS_DIR / "tinyshakespeare.txt"

TEXT_FIELD = "text"
SUPPORTED_DATASETS = {
    "tinyshakespeare": "bundled assets/tinyshakespeare.txt, or a .txt at dataset_path",
    "text": "a .txt file at dataset_path, documents separated by blank lines",
    "jsonl": f'a .jsonl file at dataset_path, one document per line in field "{TEXT_FIELD}"',
    "hf_local": f'a local HF dataset directory at dataset_path with a "{TEXT_FIELD}" column',
}


class DocumentSource(Protocol):
    description: str

    def iter_documents(self, first: int, stride: int) -> Iterator[str]:
        """Yield documents first, first + stride, first + 2 * stride, ... in corpus order."""
        ...


class TextFileSource:
    """A plain-text file whose documents are separated by blank lines."""

    def __init__(self, path: Path):
        self.path = path
        self.description = f"text:{path}"

    def iter_documents(self, first: int, stride: int) -> Iterator[str]:
        return itertools.islice(self._all_documents(), first, None, stride)

    def _all_documents(self) -> Iterator[str]:
        paragraph: list[str] = []
        for line in _utf8_lines(self.path):
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).removesuffix("\n")
                paragraph = []
        if paragraph:
            yield "".join(paragraph).removesuffix("\n")


def _utf8_lines(path: Path) -> Iterator[str]:
    """The lines of `path`; a byte that is not UTF-8 stops with the file and line, which
    Python's error (a position inside its read buffer) does not give."""
    with open(path, encoding="utf-8") as lines:
        try:
            yield from lines
        except UnicodeDecodeError:
            raise ValueError(_first_invalid_utf8(path)) from None


def _first_invalid_utf8(path: Path) -> str:
    with open(path, "rb") as raw:
        for line_number, line in enumerate(raw, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return (
                    f"{path}:{line_number} is not UTF-8 text (byte 0x{line[error.start]:02x} at "
                    f"column {error.start + 1}); save the file as UTF-8 or remove that byte"
                )
    return f"{path} is not UTF-8 text; save it as UTF-8"


class JsonlSource:
    """A JSON-lines file, one document per non-blank line."""

    def __init__(self, path: Path):
        self.path = path
        self.description = f"jsonl:{path}"

    def iter_documents(self, first: int, stride: int) -> Iterator[str]:
        # Only the lines this shard keeps are parsed; skipping a line costs a read, not a decode.
        numbered_lines = itertools.islice(self._numbered_records(), first, None, stride)
        return (self._parse(line_number, line) for line_number, line in numbered_lines)

    def _numbered_records(self) -> Iterator[tuple[int, str]]:
        for line_number, line in enumerate(_utf8_lines(self.path), start=1):
            if line.strip():
                yield line_number, line

    def _parse(self, line_number: int, line: str) -> str:
        where = f"{self.path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON ({error})") from error
        if not isinstance(record, dict) or not isinstance(record.get(TEXT_FIELD), str):
            raise ValueError(f'{where}: expected an object with a string field "{TEXT_FIELD}"')
        return record[TEXT_FIELD]


class HFLocalSource:
    """A local Hugging Face dataset (memory-mapped Arrow, so only touched rows are read)."""

    def __init__(self, dataset, path: Path):
        self.dataset = dataset.select_columns([TEXT_FIELD])
        self.description = f"hf_local:{path}"

    def iter_documents(self, first: int, stride: int) -> Iterator[str]:
        indices = range(first, len(self.dataset), stride)
        shard = self.dataset.select(indices)
        return (self._text(index, row) for index, row in zip(indices, shard, strict=True))

    def _text(self, index: int, row: dict) -> str:
        # Arrow columns are nullable: a null would otherwise fail later, naming no row.
        text = row[TEXT_FIELD]
        if not isinstance(text, str):
            got = "null" if text is None else type(text).__name__
            raise ValueError(
                f'{self.description} row {index}: "{TEXT_FIELD}" must be a string, got {got}'
            )
        return text


def build_document_source(
    dataset: str, dataset_path: str | None, section: str = "training"
) -> DocumentSource:
    """Resolve the config to a source, failing early on anything training could not read.

    `section` is the config table the settings came from ("training" or "validation"); it only
    shapes the error messages so they name the exact setting to fix.
    """
    name = dataset.lower()
    if name not in SUPPORTED_DATASETS:
        accepted = "; ".join(f'"{key}" ({what})' for key, what in SUPPORTED_DATASETS.items())
        raise ValueError(f'{section}.dataset = "{dataset}" is not supported. Accepted: {accepted}')
    path = _resolve_path(name, dataset_path, section)
    source = _open_source(name, path, section)
    _require_a_document(source, name, path, section)
    return source


def _resolve_path(name: str, dataset_path: str | None, section: str) -> Path:
    if dataset_path:
        path = Path(dataset_path).expanduser()
    elif name == "tinyshakespeare":
        path = TINYSHAKESPEARE_PATH
    else:
        raise ValueError(
            f'{section}.dataset = "{name}" needs {section}.dataset_path: {SUPPORTED_DATASETS[name]}'
        )
    if not path.exists():
        raise FileNotFoundError(
            f'{section}.dataset_path = "{path}" does not exist ({section}.dataset = "{name}" '
            f"expects {SUPPORTED_DATASETS[name]})"
        )
    return path


def _open_source(name: str, path: Path, section: str) -> DocumentSource:
    if name == "hf_local":
        return HFLocalSource(_load_hf_dataset(path, section), path)
    if not path.is_file():
        raise ValueError(
            f'{section}.dataset_path = "{path}" is not a file ({section}.dataset = "{name}" '
            f"expects {SUPPORTED_DATASETS[name]})"
        )
    return JsonlSource(path) if name == "jsonl" else TextFileSource(path)


def _load_hf_dataset(path: Path, section: str):
    import datasets  # imported here: slow to import and only this source needs it

    if not path.is_dir():
        raise ValueError(
            f'{section}.dataset_path = "{path}" is not a directory '
            f'({section}.dataset = "hf_local" expects {SUPPORTED_DATASETS["hf_local"]})'
        )
    # save_to_disk leaves state.json (Dataset) or dataset_dict.json (DatasetDict); any other
    # directory holds data files (jsonl, parquet, ...) that load_dataset converts to Arrow.
    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        loaded = datasets.load_from_disk(str(path))
    else:
        loaded = datasets.load_dataset(str(path))
    table = _pick_train_split(loaded, path, section)
    if TEXT_FIELD not in table.column_names:
        raise ValueError(
            f'{section}.dataset_path = "{path}" has columns {table.column_names}; '
            f'{section}.dataset = "hf_local" needs a "{TEXT_FIELD}" column'
        )
    return table


def _pick_train_split(loaded, path: Path, section: str):
    if not hasattr(loaded, "keys"):
        return loaded
    if "train" not in loaded:
        raise ValueError(
            f'{section}.dataset_path = "{path}" has splits {list(loaded.keys())}; '
            f'{section}.dataset = "hf_local" reads the "train" split'
        )
    return loaded["train"]


def _require_a_document(source: DocumentSource, name: str, path: Path, section: str) -> None:
    # Reading the first document also surfaces a malformed first record before training starts.
    if next(iter(source.iter_documents(0, 1)), None) is None:
        raise ValueError(
            f'{section}.dataset_path = "{path}" contains no documents '
            f'({section}.dataset = "{name}" expects {SUPPORTED_DATASETS[name]})'
        )
