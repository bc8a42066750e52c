"""The varlen attention op (`titan_gdn::varlen_attention`) against the dense-mask reference:
whole rows and a chunk's queries against the keys before its end, packed documents of any
length, eager and compiled. On CPU the op runs its per-document reference in place of the
CUDA kernels, so this checks the documents' segments, the op's autograd and its fake; the
kernels themselves are checked on a GPU (tests/gpu/test_varlen_attention_gpu.py)."""

import pytest
import torch

from tests.conftest import relative_error
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.ops import varlen_attention
from titan_gdn.ops.attention import document_causal_attention
from titan_gdn.ops.varlen_attention import padded_length, segments

EOS = 0


def packed_rows(gen, rows, seq_len, documents_per_row):
    """Token rows with documents ending at random places (EOS), some of length 1."""
    tokens = torch.randint(1, 50, (rows, seq_len), generator=gen)
    for row in range(rows):
        ends = torch.randint(0, seq_len, (documents_per_row - 1,), generator=gen)
        tokens[row, ends] = EOS
    return tokens


def _attention(backend, q, k, v, docs, query_start=0):
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = document_causal_attention(
        qs, ks, vs, docs.document_ids, None, backend, query_start, docs.padded_cu_seqlens
    )
    return out, qs, ks, vs


def _assert_varlen_matches_dense_mask(gen, docs, heads, kv_heads, dim, query_start):
    """The varlen op's output and input gradients against the dense mask's, in fp64."""
    rows, key_len = docs.document_ids.shape
    query_len = key_len - query_start
    q = torch.randn(rows, heads, query_len, dim, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(rows, kv_heads, key_len, dim, generator=gen, dtype=torch.float64) for _ in "kv"
    )
    grad = torch.randn(rows, heads, query_len, dim, generator=gen, dtype=torch.float64)
    results = {}
    for backend in ("sdpa", "varlen"):
        out, *inputs = _attention(backend, q, k, v, docs, query_start)
        out.backward(grad)
        results[backend] = [out, *(x.grad for x in inputs)]
    for got, want in zip(results["varlen"], results["sdpa"], strict=True):
        assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("documents_per_row", [1, 3, 40])
@pytest.mark.parametrize("query_start", [0, 96])
def test_varlen_matches_dense_mask(documents_per_row, query_start):
    gen = torch.Generator().manual_seed(documents_per_row + query_start)
    rows, seq_len, heads, kv_heads, dim = 2, 160, 4, 2, 16
    docs = DocumentBoundaries.from_tokens(packed_rows(gen, rows, seq_len, documents_per_row), EOS)
    _assert_varlen_matches_dense_mask(gen, docs, heads, kv_heads, dim, query_start)


def test_whole_rows_of_one_document_are_told_apart():
    gen = torch.Generator().manual_seed(0)
    one = DocumentBoundaries.from_tokens(packed_rows(gen, 2, 64, 1), EOS)
    many = DocumentBoundaries.from_tokens(packed_rows(gen, 2, 64, 5), EOS)
    assert segments(one.padded_cu_seqlens, 2, 64, 0, 64).whole_rows
    assert not segments(one.padded_cu_seqlens, 2, 64, 32, 32).whole_rows  # a chunk's queries
    assert not segments(many.padded_cu_seqlens, 2, 64, 0, 64).whole_rows


def test_chunk_segments_give_each_document_its_queries_and_keys():
    # Row of 10 tokens, documents [0, 3), [3, 7), [7, 10); queries 5..9, keys 0..9.
    docs = DocumentBoundaries.from_tokens(torch.tensor([[1, 1, EOS, 1, 1, 1, EOS, 1, 1, 1]]), EOS)
    seg = segments(docs.padded_cu_seqlens, 1, 10, 5, 5)
    assert seg.cu_q.tolist() == [0, 0, 2, 5]  # the first document has no query in the chunk
    assert seg.cu_k.tolist() == [0, 3, 7, 10]
    assert (seg.max_q, seg.max_k) == (3, 4)


def test_compiled_op_has_no_graph_break_and_no_recompile_across_layouts():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(3)
    rows, seq_len, heads, dim = 1, 128, 2, 16

    def attention(q, k, v, document_ids, cu_seqlens):
        return document_causal_attention(q, k, v, document_ids, None, "varlen", 0, cu_seqlens)

    compiled = torch.compile(attention, fullgraph=True, dynamic=False)
    counts = torch._dynamo.utils.counters
    counts.clear()
    for documents in (1, 4, 30):
        docs = DocumentBoundaries.from_tokens(packed_rows(gen, rows, seq_len, documents), EOS)
        q, k, v = (torch.randn(rows, heads, seq_len, dim, generator=gen) for _ in range(3))
        out = compiled(q, k, v, docs.document_ids, docs.padded_cu_seqlens)
        want = document_causal_attention(q, k, v, docs.document_ids, None, "sdpa")
        assert relative_error(out, want) < 1e-5
    assert counts["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("query_start", [0, 96])
def test_long_documents_apart_from_the_short_ones_match_dense_mask(monkeypatch, query_start):
    """Documents of at least LONG_DOCUMENT_TOKENS (lowered here to fit CPU sizes) each take the
    rows kernel alone, the others one varlen call over their gathered tokens: the same
    attention as the dense mask, and a chunk's queries (no split there) as before."""
    monkeypatch.setattr(varlen_attention, "LONG_DOCUMENT_TOKENS", 24)
    monkeypatch.setattr(varlen_attention, "LENGTH_STEPS_PER_DOUBLING", 2)  # padded by up to half
    gen = torch.Generator().manual_seed(7 + query_start)
    rows, seq_len, heads, kv_heads, dim = 2, 160, 4, 2, 16
    docs = DocumentBoundaries.from_tokens(packed_rows(gen, rows, seq_len, 12), EOS)
    seg = segments(docs.padded_cu_seqlens, rows, seq_len, query_start, seq_len - query_start)
    lengths = docs.padded_cu_seqlens.diff()
    if query_start == 0:
        long_lengths = [end - start for start, end in seg.long_documents]
        assert sorted(long_lengths) == sorted(lengths[lengths >= 24].tolist())
        assert any(padded_length(n) > n for n in long_lengths)  # zero padding is exercised
        assert seg.short is not None and (lengths.lt(24) & lengths.gt(0)).any()
        ranges = (torch.arange(start, end) for start, end in seg.long_documents)
        covered = torch.cat([seg.short.tokens, *ranges])
        assert covered.sort().values.tolist() == list(range(rows * seq_len))
    else:
        assert not seg.long_documents and seg.short is None
    _assert_varlen_matches_dense_mask(gen, docs, heads, kv_heads, dim, query_start)


def test_long_documents_take_few_padded_lengths():
    """cuDNN plans every new shape anew: long documents are padded to at most 16 lengths per
    doubling, by at most a sixteenth."""
    lengths = range(8192, 4 * 8192 + 1)
    padded = [padded_length(n) for n in lengths]
    assert all(n <= p <= n * (1 + 1 / 16) for n, p in zip(lengths, padded, strict=True))
    assert len(set(padded)) == 2 * 16 + 1  # 8k..16k, 16k..32k, and 32k itself
    assert [padded_length(n) for n in (8192, 8193, 9000, 16385)] == [8192, 8704, 9216, 17408]
