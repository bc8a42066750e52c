"""PackedDocumentDataset and document sources: resume offsets, EOS inside text, labels without
BOS, and malformed hf_local rows (CPU)."""

import itertools
import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig

from titan_gdn.data import PackedDocumentDataset, build_document_source, build_packed_dataloader
from titan_gdn.data.sources import TextFileSource

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
EOS_TEXT = "<|end_of_text|>"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = HuggingFaceTokenizer(str(TOKENIZER_DIR))
    assert tokenizer.eos_id == tokenizer.token_to_id(EOS_TEXT) and tokenizer.bos_id is not None
    return tokenizer


@pytest.fixture(scope="module")
def bosless_tokenizer(tmp_path_factory):
    """The bundled tokenizer configured like Qwen's: `bos_token: null`."""
    path = tmp_path_factory.mktemp("bosless_tokenizer")
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", path)
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    config["bos_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HuggingFaceTokenizer(str(path))
    assert tokenizer.bos_id is None and tokenizer.eos_id is not None
    return tokenizer


class ListSource:
    def __init__(self, documents: list[str]):
        self.documents = documents
        self.description = "list:test"

    def iter_documents(self, first: int, stride: int):
        return iter(self.documents[first::stride])


def long_documents_file(tmp_path: Path, count: int = 12, words: int = 200) -> Path:
    """Documents of about ten 32-token rows each, so that every state lies inside one."""
    vocabulary = [f"w{i}" for i in range(10000)]
    documents = [f"doc{d} " + " ".join(vocabulary[d * 7 : d * 7 + words]) for d in range(count)]
    path = tmp_path / "long.txt"
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return path


def test_a_restored_offset_is_reported_before_the_next_document_is_read(tokenizer, tmp_path):
    dataset = PackedDocumentDataset(TextFileSource(long_documents_file(tmp_path)), tokenizer, 32)
    state = {"source": dataset.source.description, "epoch": 0, "document": 3, "skip": 264}
    dataset.load_state_dict(dict(state))
    assert dataset.state_dict() == state


def test_two_workers_resumed_twice_reproduce_the_uninterrupted_stream(tokenizer, tmp_path):
    # After a resume, a worker that has not read a document yet still owes the restored offset.
    job_config = JobConfig()
    training = job_config.training
    training.dataset, training.dataset_path = "text", str(long_documents_file(tmp_path))
    training.seq_len, training.local_batch_size = 32, 4
    training.dataloader.num_workers = 2

    def batches(loader, count):
        return [
            torch.cat([inputs["input"], labels[:, -1:]], dim=1)
            for inputs, labels in itertools.islice(loader, count)
        ]

    total = 12
    uninterrupted = batches(build_packed_dataloader(1, 0, tokenizer, job_config), total)
    loader = build_packed_dataloader(1, 0, tokenizer, job_config)
    got = batches(loader, 3)
    for resume_after in (1, total - 4):  # the second save comes one batch after a resume
        saved = pickle.loads(pickle.dumps(loader.state_dict()))
        loader = build_packed_dataloader(1, 0, tokenizer, job_config)
        loader.load_state_dict(saved)
        got += batches(loader, resume_after)
    assert len(got) == total
    for index, (want, row) in enumerate(zip(uninterrupted, got, strict=True)):
        assert torch.equal(want, row), f"batch {index} differs"


def eos_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_eos_inside_a_document_is_logged_once_naming_the_document(tokenizer, caplog):
    documents = [
        "A clean first document.",
        f"A scraped page quoting the separator {EOS_TEXT} as text.",
        "Another clean one.",
        f"A second page with {EOS_TEXT} in it.",
    ]
    dataset = PackedDocumentDataset(ListSource(documents), tokenizer, seq_len=8)
    with caplog.at_level(logging.WARNING):
        list(dataset)
    warnings = eos_warnings(caplog)
    assert len(warnings) == 1, warnings
    message = warnings[0]
    for part in ("list:test", "document 1 ", EOS_TEXT, "split", "GDN state", "Remove that text"):
        assert part in message, (part, message)


def test_documents_without_eos_in_their_text_log_nothing(tokenizer, caplog):
    dataset = PackedDocumentDataset(ListSource(["One document.", "Two."]), tokenizer, seq_len=4)
    with caplog.at_level(logging.WARNING):
        list(dataset)
    assert eos_warnings(caplog) == []


def rows_and_labels(dataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(inputs["input"], labels) for inputs, labels in dataset]


def test_without_bos_the_eos_label_is_ignored(bosless_tokenizer):
    tokenizer = bosless_tokenizer
    documents = ["Alpha beta gamma.", "Zebra yak xylophone.", "Third document here.", "Four."]
    stream = [t for d in documents for t in tokenizer.encode(d, add_bos=True, add_eos=True)]
    # A row ends on the first document's EOS, so the label crossing rows is covered too.
    seq_len = len(tokenizer.encode(documents[0], add_bos=True, add_eos=True))
    dataset = PackedDocumentDataset(ListSource(documents), tokenizer, seq_len=seq_len)
    rows = rows_and_labels(dataset)
    assert rows and rows[0][0][-1] == tokenizer.eos_id
    for row, (inputs, labels) in enumerate(rows):
        start = row * (seq_len + 1)
        assert inputs.tolist() == stream[start : start + seq_len]
        shifted = torch.tensor(stream[start + 1 : start + seq_len + 1])
        at_eos = inputs == tokenizer.eos_id
        assert (labels[at_eos] == IGNORE_INDEX).all()
        assert torch.equal(labels[~at_eos], shifted[~at_eos])
    assert sum(int((inputs == tokenizer.eos_id).sum()) for inputs, _ in rows) >= 2


def test_with_bos_the_eos_label_is_the_next_bos(tokenizer):
    dataset = PackedDocumentDataset(ListSource(["Alpha beta.", "Zebra yak."]), tokenizer, 8)
    for inputs, labels in rows_and_labels(dataset):
        assert torch.equal(inputs[1:], labels[:-1])
        assert (labels != IGNORE_INDEX).all()
        assert (labels[inputs == tokenizer.eos_id] == tokenizer.bos_id).all()


def test_hf_local_null_text_names_the_row(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    datasets.disable_progress_bars()
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["first", "second", None, "fourth"]}).save_to_disk(
        str(saved)
    )
    source = build_document_source("hf_local", str(saved))
    assert list(source.iter_documents(1, 2)) == ["second", "fourth"]
    with pytest.raises(ValueError, match=r'hf_local:.*saved row 2: "text" must be a string'):
        list(source.iter_documents(0, 2))
