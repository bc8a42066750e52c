"""Packed-document loader: packing, sharding, resumption, sources and config errors (CPU)."""

import itertools
import json
import logging
import pickle
from pathlib import Path

import pytest
import torch
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.config import JobConfig

from titan_gdn.data import (
    TINYSHAKESPEARE_PATH,
    build_document_source,
    build_packed_dataloader,
    build_packed_validation_dataloader,
    documents_per_row,
)

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
SEQ_LEN = 32
BATCH = 4


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = HuggingFaceTokenizer(str(TOKENIZER_DIR))
    assert tokenizer.eos_id == tokenizer.token_to_id("<|end_of_text|>")
    assert tokenizer.bos_id == tokenizer.token_to_id("<|begin_of_text|>")
    return tokenizer


def make_documents(count: int = 41) -> list[str]:
    """Documents tagged with their index, of very different lengths; the last two are longer
    than a row so that no rank's final document can vanish into the dropped partial row."""
    words = "so shaken as we are so wan with care find we a time for frighted peace".split()
    lengths = [1 + (7 * i) % 23 for i in range(count - 2)] + [60, 70]
    return [
        f"doc{i}: " + " ".join(itertools.islice(itertools.cycle(words), i, i + length))
        for i, length in enumerate(lengths)
    ]


@pytest.fixture
def documents():
    return make_documents()


@pytest.fixture
def text_file(tmp_path, documents) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return path


def make_job_config(dataset, dataset_path=None, seq_len=SEQ_LEN, batch=BATCH) -> JobConfig:
    job_config = JobConfig()
    for section in (job_config.training, job_config.validation):
        section.dataset = dataset
        section.dataset_path = None if dataset_path is None else str(dataset_path)
        section.seq_len = seq_len
        section.local_batch_size = batch
    return job_config


def token_stream(loader, max_batches=None) -> list[int]:
    """Rows are disjoint consecutive chunks of seq_len + 1 tokens; glue them back together."""
    stream = []
    for inputs, labels in itertools.islice(loader, max_batches):
        rows = torch.cat([inputs["input"], labels[:, -1:]], dim=1)
        stream.extend(rows.flatten().tolist())
    return stream


def encoded(tokenizer, documents) -> list[int]:
    return [t for doc in documents for t in tokenizer.encode(doc, add_bos=True, add_eos=True)]


def whole_rows(tokens: list[int], seq_len=SEQ_LEN) -> list[int]:
    """What a finite loader emits: full rows only, the last batch possibly short."""
    row_len = seq_len + 1
    return tokens[: len(tokens) // row_len * row_len]


def rows_of(stream: list[int], seq_len=SEQ_LEN) -> list[tuple[int, ...]]:
    return [tuple(stream[i : i + seq_len + 1]) for i in range(0, len(stream), seq_len + 1)]


def test_rows_have_shape_and_labels_are_shifted_inputs(tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the bundled corpus must be found from any working directory
    loader = build_packed_dataloader(1, 0, tokenizer, make_job_config("tinyshakespeare"))
    batches = list(itertools.islice(loader, 3))
    for inputs, labels in batches:
        assert inputs["input"].shape == labels.shape == (BATCH, SEQ_LEN)
        assert inputs["input"].dtype == labels.dtype == torch.long
        assert torch.equal(inputs["input"][:, 1:], labels[:, :-1])
    assert batches[0][0]["input"][0, 0] == tokenizer.bos_id


def test_every_document_appears_in_order_ending_with_eos(tokenizer, text_file, documents):
    loader = build_packed_dataloader(1, 0, tokenizer, make_job_config("text", text_file), False)
    stream = token_stream(loader)
    assert stream == whole_rows(encoded(tokenizer, documents))

    starts = [i for i, token in enumerate(stream) if token == tokenizer.bos_id]
    complete = [stream[a:b] for a, b in itertools.pairwise(starts)]
    assert len(complete) == len(documents) - 1
    for document, tokens in zip(documents, complete, strict=False):
        assert tokens[-1] == tokenizer.eos_id
        assert tokens[1:-1] == tokenizer.encode(document, add_bos=False, add_eos=False)


def test_dp_ranks_read_disjoint_documents_covering_the_corpus(tokenizer, text_file, documents):
    job_config = make_job_config("text", text_file)
    seen_by_rank = []
    for rank in range(2):
        loader = build_packed_dataloader(2, rank, tokenizer, job_config, infinite=False)
        stream = token_stream(loader)
        assert stream == whole_rows(encoded(tokenizer, documents[rank::2]))
        text = tokenizer.decode(stream)
        seen_by_rank.append({i for i, doc in enumerate(documents) if f"doc{i}:" in text})
    assert seen_by_rank[0].isdisjoint(seen_by_rank[1])
    assert seen_by_rank[0] | seen_by_rank[1] == set(range(len(documents)))


def test_infinite_mode_reloops_carrying_leftover_tokens(tokenizer, text_file, documents):
    loader = build_packed_dataloader(1, 0, tokenizer, make_job_config("text", text_file))
    epoch = encoded(tokenizer, documents)
    stream = token_stream(loader, max_batches=3 * len(epoch) // (BATCH * (SEQ_LEN + 1)))
    assert stream == (epoch * 3)[: len(stream)]
    assert len(stream) > 2 * len(epoch)


def test_a_small_corpus_logs_its_first_repeat_only(tokenizer, tmp_path, caplog):
    """Three short documents in rows of 64 tokens: every row spans several epochs."""
    documents = ["First document,\nits second line.", "Second document.", "Third one."]
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(documents) + "\n")
    loader = build_packed_dataloader(1, 0, tokenizer, make_job_config("text", path, 64))
    epoch = encoded(tokenizer, documents)
    with caplog.at_level(logging.INFO):
        stream = token_stream(loader, max_batches=3)
    assert len(stream) > 10 * len(epoch)
    epoch_records = [r.getMessage() for r in caplog.records if "epoch" in r.getMessage()]
    assert len(epoch_records) == 1, epoch_records
    assert "starting epoch 1" in epoch_records[0]


def batches_per_epoch(tokenizer, documents) -> float:
    return len(encoded(tokenizer, documents)) / (BATCH * (SEQ_LEN + 1))


@pytest.mark.parametrize("dp_rank", [0, 1])
@pytest.mark.parametrize("resume_fraction", [0.0, 0.3, 0.99, 1.5])
def test_resume_reproduces_the_uninterrupted_stream(
    tokenizer, text_file, documents, dp_rank, resume_fraction
):
    job_config = make_job_config("text", text_file)
    total = 3 * int(batches_per_epoch(tokenizer, documents))
    resume_after = int(resume_fraction * batches_per_epoch(tokenizer, documents) / 2)

    def fresh_loader():
        return build_packed_dataloader(2, dp_rank, tokenizer, job_config)

    uninterrupted = list(itertools.islice(fresh_loader(), total))

    interrupted = fresh_loader()
    consumed = list(itertools.islice(interrupted, resume_after))
    # Round-trip through pickle as a torchtitan checkpoint would store it.
    saved = pickle.loads(pickle.dumps(interrupted.state_dict()))
    resumed = fresh_loader()
    resumed.load_state_dict(saved)
    continued = list(itertools.islice(resumed, total - resume_after))

    assert len(consumed) + len(continued) == total
    for (want_in, want_label), (got_in, got_label) in zip(
        uninterrupted, consumed + continued, strict=True
    ):
        assert torch.equal(want_in["input"], got_in["input"])
        assert torch.equal(want_label, got_label)
    assert resumed.dataset.state_dict()["epoch"] >= 1  # the stream did cross an epoch boundary


def test_dataloader_workers_split_the_shard_and_resume(tokenizer, text_file, documents):
    job_config = make_job_config("text", text_file)
    job_config.training.dataloader.num_workers = 2
    finite = build_packed_dataloader(1, 0, tokenizer, job_config, infinite=False)
    # Batches interleave across workers, so compare rows as a multiset; worker w reads docs w::2.
    got_rows = sorted(rows_of(token_stream(finite)))
    want_rows = sorted(
        row
        for worker in range(2)
        for row in rows_of(whole_rows(encoded(tokenizer, documents[worker::2])))
    )
    assert got_rows == want_rows

    uninterrupted = token_stream(build_packed_dataloader(1, 0, tokenizer, job_config), 20)
    interrupted = build_packed_dataloader(1, 0, tokenizer, job_config)
    consumed = token_stream(interrupted, 7)
    resumed = build_packed_dataloader(1, 0, tokenizer, job_config)
    resumed.load_state_dict(interrupted.state_dict())
    assert consumed + token_stream(resumed, 13) == uninterrupted


def test_validation_loader_replays_the_same_rows_each_pass(tokenizer, text_file):
    loader = build_packed_validation_dataloader(1, 0, tokenizer, make_job_config("text", text_file))
    first_pass = token_stream(loader)
    assert first_pass and token_stream(loader) == first_pass


def test_tinyshakespeare_splits_into_thousands_of_documents(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    documents = list(build_document_source("tinyshakespeare", None).iter_documents(0, 1))
    assert 6500 < len(documents) < 7500
    assert documents[0] == "First Citizen:\nBefore we proceed any further, hear me speak."
    assert all(document.strip() for document in documents)
    assert TINYSHAKESPEARE_PATH.is_file()


def test_text_source_splits_on_blank_lines(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("\n\nalpha\nbeta\n\n  \n\t\ngamma\r\n\r\ndelta", encoding="utf-8")
    documents = list(build_document_source("text", str(path)).iter_documents(0, 1))
    assert documents == ["alpha\nbeta", "gamma", "delta"]


def test_jsonl_source_reads_the_text_field(tokenizer, tmp_path, documents):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": doc, "id": i}) for i, doc in enumerate(documents)]
    path.write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n", encoding="utf-8")
    source = build_document_source("jsonl", str(path))
    assert list(source.iter_documents(0, 1)) == documents
    assert list(source.iter_documents(1, 3)) == documents[1::3]

    loader = build_packed_dataloader(1, 0, tokenizer, make_job_config("jsonl", path), False)
    assert token_stream(loader) == whole_rows(encoded(tokenizer, documents))


def test_hf_local_source_reads_saved_and_data_file_directories(tmp_path, monkeypatch, documents):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    datasets.disable_progress_bars()
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": documents, "n": list(range(len(documents)))}).save_to_disk(
        str(saved)
    )
    files = tmp_path / "files"
    files.mkdir()
    (files / "part.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in documents))

    for path in (saved, files):
        source = build_document_source("hf_local", str(path))
        assert list(source.iter_documents(0, 1)) == documents
        assert list(source.iter_documents(2, 2)) == documents[2::2]


def test_documents_per_row_counts_segments():
    eos = 9
    batch = torch.tensor([[1, 5, eos, 1, 6, eos], [7, 7, 7, eos, 1, 8], [1, 2, 3, 4, 5, eos]])
    assert documents_per_row(batch, eos) == 2 + 2 + 1
    assert documents_per_row(batch[2], eos) == 1


def test_unknown_dataset_name_is_rejected_listing_accepted_names(tokenizer):
    with pytest.raises(ValueError, match=r'training\.dataset = "c4_test" is not supported') as e:
        build_packed_dataloader(1, 0, tokenizer, make_job_config("c4_test"))
    for accepted in ("tinyshakespeare", "text", "jsonl", "hf_local"):
        assert f'"{accepted}"' in str(e.value)


def test_missing_file_is_rejected_naming_the_path_setting(tokenizer, tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(FileNotFoundError, match=r"training\.dataset_path = .*nowhere\.txt"):
        build_packed_dataloader(1, 0, tokenizer, make_job_config("text", missing))
    with pytest.raises(FileNotFoundError, match=r"validation\.dataset_path"):
        build_packed_validation_dataloader(1, 0, tokenizer, make_job_config("jsonl", missing))


@pytest.mark.parametrize("contents", ["", "\n\n  \n"])
@pytest.mark.parametrize("dataset", ["text", "jsonl", "tinyshakespeare"])
def test_empty_file_is_rejected(tokenizer, tmp_path, dataset, contents):
    path = tmp_path / "empty"
    path.write_text(contents)
    with pytest.raises(ValueError, match=r"training\.dataset_path = .* contains no documents"):
        build_packed_dataloader(1, 0, tokenizer, make_job_config(dataset, path))


def test_file_formats_need_a_path(tokenizer):
    with pytest.raises(ValueError, match=r'"jsonl" needs training\.dataset_path'):
        build_packed_dataloader(1, 0, tokenizer, make_job_config("jsonl"))


@pytest.mark.parametrize(
    "line, complaint", [("{not json", "not valid JSON"), ('{"body": "x"}', 'field "text"')]
)
def test_malformed_jsonl_is_rejected_before_training(tokenizer, tmp_path, line, complaint):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=complaint):
        build_packed_dataloader(1, 0, tokenizer, make_job_config("jsonl", path))


@pytest.mark.parametrize("dataset", ["text", "jsonl"])
def test_a_byte_that_is_not_utf8_is_named_by_file_and_line(tmp_path, dataset):
    """Far past the first read buffer, where Python's own error gives a position inside it."""
    lines = [json.dumps({"text": f"document {i}"}) for i in range(2000)]
    bad_line = 1500
    column = lines[bad_line - 1].index("document") + 1
    path = tmp_path / f"docs.{dataset}"
    encoded = [line.encode() for line in lines]
    encoded[bad_line - 1] = encoded[bad_line - 1].replace(b"document", b"\xffocument")
    path.write_bytes(b"\n\n".join(encoded) if dataset == "text" else b"\n".join(encoded))
    source = build_document_source(dataset, str(path))
    line_number = 2 * bad_line - 1 if dataset == "text" else bad_line
    message = (
        f"{path}:{line_number} is not UTF-8 text (byte 0xff at column {column}); save the file "
        "as UTF-8 or remove that byte"
    )
    with pytest.raises(ValueError) as error:
        list(source.iter_documents(0, 1))
    assert str(error.value) == message


def test_a_tokenizer_without_eos_is_rejected(tokenizer, text_file, monkeypatch):
    monkeypatch.setattr(tokenizer, "eos_id", None)
    with pytest.raises(ValueError, match="no EOS token"):
        build_packed_dataloader(1, 0, tokenizer, make_job_config("text", text_file))


def test_more_ranks_than_documents_fails_instead_of_spinning(tokenizer, tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("only document\n")
    loader = build_packed_dataloader(2, 1, tokenizer, make_job_config("text", path))
    with pytest.raises(ValueError, match="no documents for dp rank 1"):
        next(iter(loader))


@pytest.mark.parametrize("resume_after", [1, 7, 20])
def test_resume_inside_documents_longer_than_rows_keeps_a_small_state(
    tokenizer, tmp_path, resume_after
):
    # Documents of 10-40 rows each: a state saved inside one restarts in it, and holds
    # positions, not the document's tokens (the loader ships a state with every batch).
    words = [f"word{i} " for i in range(4000)]
    long_documents = ["".join(words[i : i + 300 * n]) for i, n in enumerate((3, 1, 4, 2))]
    path = tmp_path / "long.txt"
    path.write_text("\n\n".join(long_documents) + "\n", encoding="utf-8")
    job_config = make_job_config("text", path)
    total = 30

    uninterrupted = list(
        itertools.islice(build_packed_dataloader(1, 0, tokenizer, job_config), total)
    )
    interrupted = build_packed_dataloader(1, 0, tokenizer, job_config)
    consumed = list(itertools.islice(interrupted, resume_after))
    saved = pickle.loads(pickle.dumps(interrupted.state_dict()))
    assert len(pickle.dumps(saved)) < 2000
    resumed = build_packed_dataloader(1, 0, tokenizer, job_config)
    resumed.load_state_dict(saved)
    continued = list(itertools.islice(resumed, total - resume_after))
    for (want_in, want_label), (got_in, got_label) in zip(
        uninterrupted, consumed + continued, strict=True
    ):
        assert torch.equal(want_in["input"], got_in["input"])
        assert torch.equal(want_label, got_label)
