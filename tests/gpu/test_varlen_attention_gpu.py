"""The varlen attention op's CUDA kernels (torch's flash over the documents, cuDNN for rows of
one document and for long documents one at a time) against the fp32 dense-mask reference: whole
rows and a chunk's queries.

Needs a CUDA device: CI deselects it with ``-m "not gpu"``. Each comparison prints its errors.
"""

import pytest
import torch

from tests.conftest import relative_error
from tests.test_varlen_attention import EOS, packed_rows
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.ops import varlen_attention
from titan_gdn.ops.attention import document_causal_attention
from titan_gdn.ops.varlen_attention import segments

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "documents_per_row, query_start, long_document",
    [(1, 0, None), (2, 0, None), (30, 0, None), (6, 0, 256), (1, 1536, None), (30, 1536, None)],
    ids=["one-document-rows", "two", "thirty", "long-and-short", "chunk-of-one", "chunk-of-thirty"],
)
def test_varlen_kernels_match_fp32_dense_mask(
    monkeypatch, documents_per_row, query_start, long_document
):
    if long_document:  # documents of at least this many tokens take cuDNN one at a time
        monkeypatch.setattr(varlen_attention, "LONG_DOCUMENT_TOKENS", long_document)
    gen = torch.Generator().manual_seed(documents_per_row + query_start)
    rows, seq_len, heads, kv_heads, dim = 2, 2048, 8, 2, 256
    tokens = packed_rows(gen, rows, seq_len, documents_per_row).cuda()
    docs = DocumentBoundaries.from_tokens(tokens, EOS)
    query_len = seq_len - query_start
    seg = segments(docs.padded_cu_seqlens, rows, seq_len, query_start, query_len)
    assert seg.whole_rows == (documents_per_row == 1 and query_start == 0)
    assert bool(seg.long_documents) == (long_document is not None), seg.long_documents
    q = torch.randn(rows, heads, query_len, dim, generator=gen).cuda()
    k = torch.randn(rows, kv_heads, seq_len, dim, generator=gen).cuda()
    v = torch.randn(rows, kv_heads, seq_len, dim, generator=gen).cuda()
    grad = torch.randn_like(q)
    results = {}
    for backend, dtype in (("sdpa", torch.float32), ("varlen", torch.bfloat16)):
        qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out = document_causal_attention(
            qs, ks, vs, docs.document_ids, None, backend, query_start, docs.padded_cu_seqlens
        )
        out.backward(grad.to(dtype))
        results[backend] = (out, qs.grad, ks.grad, vs.grad)
    errors = [relative_error(a, b) for a, b in zip(results["varlen"], results["sdpa"], strict=True)]
    print(
        f"varlen(bf16) vs sdpa(fp32), {documents_per_row} documents, queries from "
        f"{query_start}: out, dq, dk, dv = {errors}"
    )
    assert max(errors) <= 1e-2
