"""benchmarks/attention.py's own logic on CPU: its check tells a candidate that keeps the
document boundaries from one that does not, and the per-document candidate keeps them (its
CUDA kernels are timed on a GPU; here torch's math kernel stands in for them)."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from benchmarks import attention
from titan_gdn.ops import varlen_attention

SHAPE = SimpleNamespace(heads=4, kv_heads=2, head_dim=32)


def _whole_row_causal(q, k, v, rows):
    """Causal attention over the whole row: blind to the documents."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_per_document_calls_match_the_document_mask_and_the_check_can_tell():
    cpu = torch.device("cpu")
    per_document = attention.check(attention._per_document(SDPBackend.MATH), SHAPE, cpu)
    blind = attention.check(_whole_row_causal, SHAPE, cpu)
    assert per_document < 2e-2, per_document  # bf16 inputs against the fp32 reference
    assert blind > 0.1, blind


def test_a_long_document_threshold_holds_through_forward_and_backward(monkeypatch):
    """`--long-document-tokens N` times the training path with the op's LONG_DOCUMENT_TOKENS at
    N for the forward and the backward alike, then sets it back."""
    default = varlen_attention.LONG_DOCUMENT_TOKENS
    seen = []
    segments = varlen_attention.segments

    def recording(*args):
        seen.append(varlen_attention.LONG_DOCUMENT_TOKENS)
        return segments(*args)

    monkeypatch.setattr(varlen_attention, "segments", recording)
    with attention._long_documents_from(128):
        error = attention.check(attention._titan_gdn, SHAPE, torch.device("cpu"))
    assert error < 2e-2, error
    assert len(seen) >= 2 and set(seen) == {128}, seen  # forward and backward
    assert varlen_attention.LONG_DOCUMENT_TOKENS == default
