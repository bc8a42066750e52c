"""Document-causal attention on torch's own flash kernels, over each batch's documents.

A batch's documents are one varlen call (FlashAttention-2 inside torch, `cu_seqlens`, GQA with
the K/V heads as they are): no mask is built and no pair across documents is computed. cuDNN's
dense causal kernel is 1.6x faster than that one at head dim 256 on an H200 (`python -m
benchmarks.attention`) but takes no document boundaries (torch's cuDNN entry that takes
`cu_seqlens` gives outputs 2.2 relative error away from the document mask at this shape, with or
without K/V repeated per query head: `--candidates varlen_cudnn`, H100, torch 2.11): a batch whose
rows are each one document is one cuDNN call, and in other batches each document of at least
`LONG_DOCUMENT_TOKENS` is a cuDNN call of its own (zero-padded to one of a few lengths: cuDNN
plans every new shape on the host), the shorter ones one varlen call over their gathered tokens.
flex attention, the other CUDA backend, computes its blocks at a third of these kernels' rate at
head dim 256. FlashAttention-4's varlen kernel (`flash-attn-4` 4.0.0b40, CuTe DSL: `--candidates
varlen_fa4`, H100) is 1.2-1.4x faster than torch's on rows of 4 to 64 documents (32k tokens in
16: 5.5 against 7.7 ms) but slower than cuDNN on one document (32k: 39.0 against 36.3 ms; the
0.8B trainer on such rows 46.9k against 48.6k tokens/s): not used, as a few percent of a
many-document step would bring about 260 MB of compiler libraries and compiles on first use.

Queries of a chunk of each row (context parallel over sequence chunks) against the keys of
all chunks up to it are the same varlen call, with each document's queries and keys given
apart: the kernels align a causal mask at the bottom right, so a query sees the keys of its
document up to its own position.

The kernels take the documents as host integers (how many, the longest): they are read once
per step from the padded boundaries (`boundaries.host_boundaries`, the step's one host sync,
shared with FLA's chunk indices) and turned into the kernels' boundaries once per chunk
layout, copied back to the GPU from pinned memory without waiting for it. On CPU (tests) the
same op runs a per-document reference instead of the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from titan_gdn.boundaries import boundaries_memo, host_boundaries
from titan_gdn.ops.custom_op import OUTSIDE_CUDA_GRAPHS, recording_autograd

# Documents at least this long take cuDNN's dense causal kernel one at a time (where a document's
# queries are its keys); shorter ones share one varlen call. cuDNN's kernel is faster at every
# length (1.7x at 1,024 tokens, 1.9x at 8,192, head dim 256, H100), but a launch of its own per
# document takes the GPU from the varlen call's parallelism across documents: at 4,096, 32k
# tokens in 16 documents (two of them longer) ran 5-10% slower than one varlen call, at 2,048
# 32k in 64 documents 1.2-1.3x slower; at 8,192 no layout measured was slower, and 32k in 4
# documents ran 1.30x, 64k in 16 1.22x faster (`python -m benchmarks.attention`). Grouping
# documents of similar lengths as padded rows of one call was slower still in every layout.
LONG_DOCUMENT_TOKENS = 8192

# cuDNN builds an execution plan for every new shape it is given (43-48 ms of host time for the
# forward, 49-55 ms for the backward, at lengths of 9k-31k tokens on an H100 with torch 2.11;
# 0.2-0.3 ms once planned), and documents come in every length: a long document runs
# zero-padded to the next multiple of a sixteenth of its power of two (at most 6.25% more
# tokens), so that a whole training run meets at most 16 lengths per doubling.
LENGTH_STEPS_PER_DOUBLING = 16


class ShortDocuments(NamedTuple):
    """The documents below LONG_DOCUMENT_TOKENS of a call that has long ones too."""

    tokens: Tensor  # int64, their positions in the flattened queries (= keys), in order
    cu: Tensor  # int32 [documents + 1], offsets into those tokens gathered
    max_len: int


class Segments(NamedTuple):
    """The kernels' view of one attention call: per document, its queries and its keys."""

    cu_q: Tensor  # int32 [documents + 1], offsets into the flattened queries [B * Tq]
    cu_k: Tensor  # int32 [documents + 1], offsets into the flattened keys [B * Tk]
    max_q: int
    max_k: int
    whole_rows: bool  # every row one document, queries = keys: the dense causal kernel serves
    # Queries = keys of every document: the flattened token ranges of the documents of at least
    # LONG_DOCUMENT_TOKENS, and the other documents gathered (`short`); empty and None otherwise.
    long_documents: tuple[tuple[int, int], ...] = ()
    short: ShortDocuments | None = None

    @property
    def documents(self) -> tuple[Tensor, Tensor, int, int]:
        """Every document's queries and keys, as the varlen kernels take them."""
        return self.cu_q, self.cu_k, self.max_q, self.max_k


def segments(
    cu_seqlens: Tensor, rows: int, row_len: int, query_start: int, query_len: int
) -> Segments:
    """The segments of the queries at positions query_start..query_start+query_len-1 of each
    row against the keys before query_start+query_len, from the batch's padded boundaries
    (rows of `row_len` tokens laid end to end); memoized per boundaries tensor and layout."""
    memo = boundaries_memo(cu_seqlens)
    key = ("attention", rows, row_len, query_start, query_len, LONG_DOCUMENT_TOKENS)
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
    cu_q, cu_k = (_on_device(F.pad(n.cumsum(0), (1, 0)).int(), device) for n in (queries, keys))
    queries_are_keys = query_start == 0 and query_len == row_len  # whole rows, not a chunk
    seg = Segments(
        cu_q, cu_k, int(queries.max()), int(keys.max()), queries_are_keys and len(starts) == rows
    )
    if not queries_are_keys or seg.whole_rows:
        return seg
    # Whole rows laid end to end: each document's queries and keys are the same flat tokens.
    long = keys >= LONG_DOCUMENT_TOKENS
    if not long.any():
        return seg
    ranges = tuple(zip(starts[long].tolist(), ends[long].tolist(), strict=True))
    return seg._replace(long_documents=ranges, short=_short_documents(starts, keys, ~long, device))


def _short_documents(starts, lengths, short, device) -> ShortDocuments | None:
    starts, lengths = starts[short], lengths[short]
    if not len(lengths):
        return None
    cu = F.pad(lengths.cumsum(0), (1, 0))
    tokens = torch.arange(int(cu[-1])) + (starts - cu[:-1]).repeat_interleave(lengths)
    return ShortDocuments(
        _on_device(tokens, device), _on_device(cu.int(), device), int(lengths.max())
    )


def _on_device(x: Tensor, device: torch.device) -> Tensor:
    """A host tensor copied to `device` behind the queued GPU work, without waiting for it: a
    copy from pageable memory makes torch wait for the stream (a small copy behind three 8k
    matmuls took the host 63 ms, H100), and the GPU would drain in the step's first attention
    layer. From pinned memory it is queued; torch keeps the pinned block until it is done."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------
# The ops: q [B, Tq, H, D], k and v [B, Tk, Hkv, D] (tokens first, as the projections give them);
# output [B, Tq, H, D] and the softmax log-sum-exp [H, B * Tq] (fp32) that the backward reads.


@torch.library.custom_op("titan_gdn::varlen_attention", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, row_len: int, query_start: int
) -> tuple[Tensor, Tensor]:
    rows, query_len = q.shape[:2]
    seg = segments(cu_seqlens, rows, row_len, query_start, query_len)
    kernels = _KERNELS[q.device.type == "cuda"]
    if seg.whole_rows:
        return kernels.causal_forward(q, k, v)
    flat = [_flat(x) for x in (q, k, v)]
    if not seg.long_documents:
        out, lse = _varlen_call(kernels, *seg.documents).forward(*flat)
        return out.view(q.shape), lse
    out = torch.empty_like(flat[0])
    lse = out.new_empty((out.shape[1], out.shape[0]), dtype=torch.float32)
    for index, call in _calls(seg, kernels):
        out[index], lse[:, index] = call.forward(*(x[index] for x in flat))
    return out.view(q.shape), lse


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
    kernels = _KERNELS[q.device.type == "cuda"]
    if seg.whole_rows:
        return kernels.causal_backward(grad, q, k, v, out, lse)
    flat = [_flat(x) for x in (grad, q, k, v, out)]
    if not seg.long_documents:
        grads = _varlen_call(kernels, *seg.documents).backward(*flat, lse)
        return tuple(g.view(x.shape) for g, x in zip(grads, (q, k, v), strict=True))
    grads = [torch.empty_like(x) for x in flat[1:4]]
    for index, call in _calls(seg, kernels):
        parts = call.backward(*(x[index] for x in flat), lse[:, index].contiguous())
        for whole, part in zip(grads, parts, strict=True):
            whole[index] = part
    return tuple(g.view(x.shape) for g, x in zip(grads, (q, k, v), strict=True))


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
# A call with long documents: which flattened tokens each launch takes and what it runs on them.
# Flattened tensors: q [N, H, D], k and v [N, Hkv, D], lse [H, N].


class _Kernels(NamedTuple):
    varlen_forward: Callable  # (q, k, v, cu_q, cu_k, max_q, max_k) -> out, lse
    varlen_backward: Callable  # (grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k) -> dq, dk, dv
    causal_forward: Callable  # rows of one document: (q, k, v) [B, T, H, D] -> out, lse
    causal_backward: Callable  # (grad, q, k, v, out, lse) -> dq, dk, dv


class _Call(NamedTuple):
    forward: Callable  # (q, k, v) -> out, lse
    backward: Callable  # (grad, q, k, v, out, lse) -> dq, dk, dv


def _calls(seg: Segments, kernels: _Kernels):
    if seg.short is not None:
        short = seg.short
        yield short.tokens, _varlen_call(kernels, short.cu, short.cu, short.max_len, short.max_len)
    for start, end in seg.long_documents:
        yield slice(start, end), _one_document_call(kernels, end - start)


def _varlen_call(kernels, *documents) -> _Call:
    return _Call(
        lambda q, k, v: kernels.varlen_forward(q, k, v, *documents),
        lambda *tensors: kernels.varlen_backward(*tensors, *documents),
    )


def _one_document_call(kernels: _Kernels, length: int) -> _Call:
    """The rows kernel (cuDNN's dense causal one) on one document's flattened tokens, as a row
    of `padded_length(length)` whose tokens past the document are zeros. Causal: no query of
    the document sees them. Their queries get a zero gradient, so in the backward they add
    nothing to any key's or value's: their scores are all 0 (zero queries), so any finite
    log-sum-exp (0 here) gives finite probabilities, and zero times finite is zero."""
    padding = padded_length(length) - length

    def row(x):  # [tokens, heads, dim] -> [1, padded tokens, heads, dim]
        return F.pad(x, (0, 0, 0, 0, 0, padding))[None] if padding else x[None]

    def forward(q, k, v):
        out, lse = kernels.causal_forward(row(q), row(k), row(v))
        return out[0, :length], lse[:, :length]

    def backward(grad, q, k, v, out, lse):
        padded_lse = F.pad(lse, (0, padding)) if padding else lse
        grads = kernels.causal_backward(*(row(x) for x in (grad, q, k, v, out)), padded_lse)
        return tuple(g[0, :length] for g in grads)

    return _Call(forward, backward)


def padded_length(length: int) -> int:
    """`length` rounded up to a multiple of 1/LENGTH_STEPS_PER_DOUBLING of its power of two."""
    step = max(1, (1 << (length.bit_length() - 1)) // LENGTH_STEPS_PER_DOUBLING)
    return -(-length // step) * step


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1, *x.shape[2:]).contiguous()


# ---------------------------------------------------------------------------------------------
# CUDA kernels


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False
    )
    return out, lse


def _flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k):
    # No dropout: the RNG state the kernel would read is never used.
    no_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, no_rng, unused
    )


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


def _reference_forward(q, k, v, cu_q, cu_k, max_q=None, max_k=None):
    heads = q.shape[1]
    qf, kf, vf = (x.float() for x in (q, k, v))
    kf, vf = (x.repeat_interleave(heads // x.shape[1], 1) for x in (kf, vf))
    out = torch.zeros_like(qf)
    lse = torch.zeros(heads, qf.shape[0], dtype=torch.float32, device=q.device)
    for (q0, q1), (k0, k1) in zip(pairwise(cu_q.tolist()), pairwise(cu_k.tolist()), strict=True):
        if q1 == q0:
            continue
        scores = torch.einsum("qhd,khd->hqk", qf[q0:q1], kf[k0:k1]) * q.shape[-1] ** -0.5
        offset = (k1 - k0) - (q1 - q0)  # bottom-right: query i sees keys up to offset + i
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(offset)
        scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
        lse[:, q0:q1] = scores.logsumexp(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf[k0:k1])
    return out.to(q.dtype), lse


def _reference_backward(grad, q, k, v, out, lse, *documents):
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    with recording_autograd():
        out, _ = _reference_forward(*inputs, *documents)
    return torch.autograd.grad(out, inputs, grad)


def _reference_rows_forward(q, k, v):
    cu = _row_bounds(q)
    out, lse = _reference_forward(_flat(q), _flat(k), _flat(v), cu, cu)
    return out.view(q.shape), lse


def _reference_rows_backward(grad, q, k, v, out, lse):
    cu = _row_bounds(q)
    grads = _reference_backward(*(_flat(x) for x in (grad, q, k, v, out)), lse, cu, cu)
    return tuple(g.view(x.shape) for g, x in zip(grads, (q, k, v), strict=True))


def _row_bounds(x: Tensor) -> Tensor:
    rows, tokens = x.shape[:2]
    return torch.arange(0, (rows + 1) * tokens, tokens, device=x.device, dtype=torch.int32)


_KERNELS = {
    True: _Kernels(_flash_forward, _flash_backward, _cudnn_forward, _cudnn_backward),
    False: _Kernels(
        _reference_forward,
        _reference_backward,
        _reference_rows_forward,
        _reference_rows_backward,
    ),
}
