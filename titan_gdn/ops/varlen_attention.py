"""Document-causal attention on torch's own flash kernels, over each batch's documents.

All documents of a batch are one varlen call (FlashAttention-2 inside torch, `cu_seqlens`, GQA
with the K/V heads as they are): no mask is built and no pair across documents is computed.
A batch whose rows are each one document takes cuDNN's causal kernel instead, 1.6x faster at
head dim 256 on an H200 (`python -m benchmarks.attention`). flex attention, the other CUDA
backend, computes its blocks at a third of these kernels' rate at head dim 256.

Queries of a chunk of each row (context parallel over sequence chunks) against the keys of
all chunks up to it are the same varlen call, with each document's queries and keys given
apart: the kernels align a causal mask at the bottom right, so a query sees the keys of its
document up to its own position.

The kernels take the documents as host integers (how many, the longest): they are read once
per step from the padded boundaries (`documents.host_boundaries`, the step's one host sync,
shared with FLA's chunk indices) and turned into the kernels' boundaries once per chunk
layout. On CPU (tests) the same op runs a per-document reference instead of the kernels.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_gdn.boundaries import boundaries_memo, host_boundaries
from titan_gdn.ops.custom_op import OUTSIDE_CUDA_GRAPHS, recording_autograd


class Segments(NamedTuple):
    """The kernels' view of one attention call: per document, its queries and its keys."""

    cu_q: Tensor  # int32 [documents + 1], offsets into the flattened queries [B * Tq]
    cu_k: Tensor  # int32 [documents + 1], offsets into the flattened keys [B * Tk]
    max_q: int
    max_k: int
    whole_rows: bool  # every row one document, queries = keys: the dense causal kernel serves


def segments(
    cu_seqlens: Tensor, rows: int, row_len: int, query_start: int, query_len: int
) -> Segments:
    """The segments of the queries at positions query_start..query_start+query_len-1 of each
    row against the keys before query_start+query_len, from the batch's padded boundaries
    (rows of `row_len` tokens laid end to end); memoized per boundaries tensor and layout."""
    memo = boundaries_memo(cu_seqlens)
    key = ("attention", rows, row_len, query_start, query_len)
    if key not in memo:
        memo[key] = _segments(
            host_boundaries(cu_seqlens), rows, row_len, query_start, query_len, cu_seqlens.device
        )
    return memo[key]


def _segments(bounds, rows, row_len, query_start, query_len, device) -> Segments:
    starts, ends = bounds[:-1], bounds[1:]
    row_start = starts.div(row_len, rounding_mode="floor") * row_len
    first, last = starts - row_start, ends - row_start  # inside the row: a row end ends a document
    key_end = query_start + query_len
    seen = first < key_end  # documents with keys before the chunk's end
    first, last = first[seen], last[seen].clamp(max=key_end)
    queries = (last - first.clamp(min=query_start)).clamp(min=0)  # 0: all before the chunk
    keys = last - first
    cu_q, cu_k = (F.pad(n.cumsum(0), (1, 0)).to(device, torch.int32) for n in (queries, keys))
    return Segments(
        cu_q,
        cu_k,
        int(queries.max()),
        int(keys.max()),
        whole_rows=query_start == 0 and query_len == row_len and len(starts) == rows,
    )


# ---------------------------------------------------------------------------------------------
# The ops: q [B, Tq, H, D], k and v [B, Tk, Hkv, D] (tokens first, as the projections give them);
# output [B, Tq, H, D] and the softmax log-sum-exp [H, B * Tq] (fp32) that the backward reads.


@torch.library.custom_op("titan_gdn::varlen_attention", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, row_len: int, query_start: int
) -> tuple[Tensor, Tensor]:
    rows, query_len = q.shape[:2]
    seg = segments(cu_seqlens, rows, row_len, query_start, query_len)
    if q.device.type != "cuda":
        return _reference_forward(q, k, v, seg)
    if seg.whole_rows:
        return _cudnn_forward(q, k, v)
    return _flash_forward(q, k, v, seg)


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens, row_len, query_start):
    rows, query_len, heads = q.shape[:3]
    return q.new_empty(q.shape), q.new_empty((heads, rows * query_len), dtype=torch.float32)


@torch.library.custom_op(
    "titan_gdn::varlen_attention_backward", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS
)
def varlen_attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    row_len: int,
    query_start: int,
) -> tuple[Tensor, Tensor, Tensor]:
    rows, query_len = q.shape[:2]
    seg = segments(cu_seqlens, rows, row_len, query_start, query_len)
    if q.device.type != "cuda":
        return _reference_backward(grad, q, k, v, seg)
    if seg.whole_rows:
        return _cudnn_backward(grad, q, k, v, out, lse)
    return _flash_backward(grad, q, k, v, out, lse, seg)


@varlen_attention_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, row_len, query_start):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, row_len, query_start = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.layout = (row_len, query_start)


def _backward(ctx, grad, _grad_lse):
    dq, dk, dv = varlen_attention_backward(grad.contiguous(), *ctx.saved_tensors, *ctx.layout)
    return dq, dk, dv, None, None, None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# CUDA kernels


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, *x.shape[2:]).contiguous()


def _flash_forward(q, k, v, seg: Segments):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        _flat(q), _flat(k), _flat(v), seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, True, False
    )
    return out.view(q.shape), lse


def _flash_backward(grad, q, k, v, out, lse, seg: Segments):
    # No dropout: the RNG state the kernel would read is never used.
    no_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _flat(grad), _flat(q), _flat(k), _flat(v), _flat(out), lse, seg.cu_q, seg.cu_k,
        seg.max_q, seg.max_k, 0.0, True, no_rng, unused,
    )  # fmt: skip
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


def _heads_first(x: Tensor) -> Tensor:
    return x.transpose(1, 2)  # [B, H, T, D], a view


def _cudnn_forward(q, k, v):
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_first(q), *_grouped_kv(q, k, v), None, True, 0.0, True, False
    )
    rows, tokens, heads = q.shape[:3]
    lse = lse.reshape(rows, heads, tokens).transpose(0, 1).reshape(heads, rows * tokens)
    return _heads_first(out).contiguous(), lse


def _cudnn_backward(grad, q, k, v, out, lse):
    rows, tokens, heads = q.shape[:3]
    lse = lse.view(heads, rows, tokens).transpose(0, 1).reshape(rows, heads, tokens, 1)
    k_heads, v_heads = _grouped_kv(q, k, v)
    # None: no dropout RNG state, no bias, no varlen offsets (undefined tensors for the kernel).
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _heads_first(grad), _heads_first(q), k_heads, v_heads, _heads_first(out), lse,
        None, None, None, None, None, tokens, tokens, 0.0, True,
    )  # fmt: skip
    dk, dv = (_sum_groups(x, k.shape[2]) for x in (dk, dv))
    return _heads_first(dq).contiguous(), dk, dv


def _grouped_kv(q, k, v):
    """K and V heads first, each repeated for its query heads: torch's cuDNN attention is
    called with as many K/V heads as query heads (copies of K and V, small next to the
    attention itself, which grows with the square of the length)."""
    k, v = _heads_first(k), _heads_first(v)
    groups = q.shape[2] // k.shape[1]
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def _sum_groups(x: Tensor, kv_heads: int) -> Tensor:
    """[B, H, T, D] gradients of repeated K/V heads back to [B, T, Hkv, D]."""
    rows, heads, tokens, dim = x.shape
    x = x.view(rows, kv_heads, heads // kv_heads, tokens, dim).sum(2)
    return _heads_first(x).contiguous()


# ---------------------------------------------------------------------------------------------
# The reference (CPU): each document's queries against its keys, a causal mask aligned at the
# bottom right, in fp32.


def _reference_forward(q, k, v, seg: Segments):
    heads = q.shape[2]
    qf, kf, vf = (_flat(x).float() for x in (q, k, v))
    kf, vf = (x.repeat_interleave(heads // x.shape[1], 1) for x in (kf, vf))
    out = torch.zeros_like(qf)
    lse = torch.zeros(heads, qf.shape[0], dtype=torch.float32, device=q.device)
    cu_q, cu_k = seg.cu_q.tolist(), seg.cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(pairwise(cu_q), pairwise(cu_k), strict=True):
        if q1 == q0:
            continue
        scores = torch.einsum("qhd,khd->hqk", qf[q0:q1], kf[k0:k1]) * q.shape[-1] ** -0.5
        offset = (k1 - k0) - (q1 - q0)  # bottom-right: query i sees keys up to offset + i
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(offset)
        scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
        lse[:, q0:q1] = scores.logsumexp(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf[k0:k1])
    return out.to(q.dtype).view(q.shape), lse


def _reference_backward(grad, q, k, v, seg: Segments):
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    with recording_autograd():
        out, _ = _reference_forward(*inputs, seg)
    return torch.autograd.grad(out, inputs, grad)
