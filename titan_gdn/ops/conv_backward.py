"""The backward of silu(depthwise causal conv) over packed documents, in one Triton kernel,
for the width the Qwen3.5 models use (K = 4 taps).

FLA's conv backward first recomputes the conv's pre-activation into a tensor of the input's
size (a forward kernel), then reads it and the output gradient once per tap. This kernel
reads x and dy and writes dx once, and keeps every intermediate in registers.

A program owns a strip of channels and a chunk of rows, and walks the chunk backwards in
time, one row at a time: dx[t] needs g of the K - 1 rows after t (already computed) and the
pre-activation needs x of the K - 1 rows before t (a sliding window). Both windows are
carried from row to row, so nothing is recomputed or shifted, and dw accumulates per thread
with no reduction until the chunk ends. (Tiles of rows, as FLA and a first version of ours
did, cannot shift a register tile: they recompute or reduce across threads, and ran 5-8x
slower than reading the inputs.) A chunk first walks the K - 1 rows after it to fill the g
window.

Notation, as in `titan_gdn.ops.conv._causal_conv1d_torch`: y[t] = sum_j w[K-1-j] x[t-j] over
the lags j that stay inside t's document, out = silu(y), and g = dy * silu'(y); then
dx[t] = sum_s w[K-1-s] g[t+s] over the s with t+s in t's document, and
dw[K-1-j] = sum_t g[t] x[t-j] over the same pairs as the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from titan_gdn.boundaries import cached_token_document_starts

TAPS = 4  # the windows are written out for this width
# Rows per chunk, channels per program and warps (`python -m benchmarks.conv_backends --tilings`).
CHUNK = 128
BLOCK_D = 512
NUM_WARPS = 4


def causal_conv1d_silu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk: int = CHUNK,
    block_d: int = BLOCK_D,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [1, L, C] (x's dtype) and dw [C, 4] (weight's dtype) of silu(conv(x, weight))."""
    _, length, channels = x.shape
    if weight.shape[1] != TAPS:
        raise ValueError(f"this conv backward is for {TAPS} taps, got weight {tuple(weight.shape)}")
    x, grad, weight = x.contiguous(), grad.contiguous(), weight.contiguous()
    block_d = min(block_d, triton.next_power_of_2(channels))
    chunks = triton.cdiv(length, chunk)
    dx = torch.empty_like(x)
    # One partial dw per chunk, summed after: no atomics, the same sum on every run. They
    # take 1/16 of x's bf16 bytes (0.6 GB at 786k tokens x 6144 channels), where FLA's
    # backward recomputed the pre-activation into a copy of x. Fewer, longer programs (each
    # walking several chunks) were slower: 1.17 against 0.76 ms at 6144 x 32k.
    dw_partial = torch.empty(chunks, TAPS, channels, device=x.device, dtype=torch.float32)
    _conv_silu_backward_kernel[(triton.cdiv(channels, block_d), chunks)](
        x, weight, grad, cached_token_document_starts(cu_seqlens, length), dx, dw_partial, length,
        D=channels, CHUNK=chunk, BD=block_d, num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).t().to(weight.dtype)


@triton.jit
def _conv_silu_backward_kernel(
    x, w, dy, starts, dx, dw_partial, L,
    D: tl.constexpr, CHUNK: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    i_d, i_c = tl.program_id(0), tl.program_id(1)
    cols = i_d * BD + tl.arange(0, BD)
    in_cols = cols < D
    w0, w1 = _tap(w, cols, D, 0), _tap(w, cols, D, 1)
    w2, w3 = _tap(w, cols, D, 2), _tap(w, cols, D, 3)
    first = i_c * CHUNK
    end = tl.minimum(first + CHUNK, L)
    # Rows end+2 down to first; the three after the chunk only fill the g window.
    top = end + 2
    x1 = _row(x, top, cols, in_cols, L, D)
    x2 = _row(x, top - 1, cols, in_cols, L, D)
    x3 = _row(x, top - 2, cols, in_cols, L, D)
    # Each step's loads are issued a step ahead (x of t-3, dy of t, where t's document
    # starts), so they arrive while the step before does its math.
    x_next = _row(x, top - 3, cols, in_cols, L, D)
    dy_next = _row(dy, top, cols, in_cols, L, D)
    start_next = _start(starts, top, L)
    # g at t+1, t+2, t+3: three zeros of their own. Triton carries a name through the loop
    # only if its value changes in the body, so with one shared zero `g3 = g2` looked
    # unchanged and g2, g3 stayed zero (compiled only: the interpreter runs Python).
    g1 = tl.zeros([BD], dtype=tl.float32)
    g2 = tl.zeros([BD], dtype=tl.float32)
    g3 = tl.zeros([BD], dtype=tl.float32)
    # Where the documents of rows t+1, t+2, t+3 start (rows past L: 0, and their g is 0).
    start1, start2, start3 = (
        _start(starts, top + 1, L),
        _start(starts, top + 2, L),
        _start(starts, top + 3, L),
    )
    zeros = tl.zeros([BD], dtype=tl.float32)
    dw0, dw1, dw2, dw3 = zeros, zeros, zeros, zeros
    for i in range(0, top - first + 1):
        t = top - i
        x0, dy_t, start = x_next, dy_next, start_next  # x1..x3 hold x at t, t-1, t-2
        x_next = _row(x, t - 4, cols, in_cols, L, D)
        dy_next = _row(dy, t - 1, cols, in_cols, L, D)
        start_next = _start(starts, t - 1, L)
        # Lag j reads x[t-j] only inside t's document.
        in1, in2, in3 = t - 1 >= start, t - 2 >= start, t - 3 >= start
        y = w3 * x1 + tl.where(in1, w2 * x2, 0.0) + tl.where(in2, w1 * x3, 0.0)
        y += tl.where(in3, w0 * x0, 0.0)
        sig = 1.0 / (1.0 + tl.exp(-y))
        g = dy_t * sig * (1.0 + y * (1.0 - sig))
        # Row t+s reaches dx[t] only from t's document.
        b_dx = w3 * g + tl.where(start1 <= t, w2 * g1, 0.0) + tl.where(start2 <= t, w1 * g2, 0.0)
        b_dx += tl.where(start3 <= t, w0 * g3, 0.0)
        owned = t < end
        out = dx + t.to(tl.int64) * D + cols
        tl.store(out, b_dx.to(dx.dtype.element_ty), mask=in_cols & (_per_column(t, cols) < end))
        g_owned = tl.where(owned, g, 0.0)
        dw3 += g_owned * x1
        dw2 += tl.where(in1, g_owned * x2, 0.0)
        dw1 += tl.where(in2, g_owned * x3, 0.0)
        dw0 += tl.where(in3, g_owned * x0, 0.0)
        g1, g2, g3 = g, g1, g2  # the windows slide one row back
        x1, x2, x3 = x2, x3, x0
        start1, start2, start3 = start, start1, start2
    partial = dw_partial + i_c * 4 * D + cols
    tl.store(partial, dw0, mask=in_cols)
    tl.store(partial + D, dw1, mask=in_cols)
    tl.store(partial + 2 * D, dw2, mask=in_cols)
    tl.store(partial + 3 * D, dw3, mask=in_cols)


@triton.jit
def _row(x, t, cols, in_cols, L, D: tl.constexpr):
    """Row t of a [L, D] tensor at `cols`, in fp32; zeros outside the rows."""
    rows = _per_column(t, cols)
    mask = in_cols & (rows >= 0) & (rows < L)
    return tl.load(x + t.to(tl.int64) * D + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _start(starts, t, L):
    """Where row t's document starts; 0 outside the rows."""
    return tl.load(starts + t, mask=(t >= 0) & (t < L), other=0)


@triton.jit
def _per_column(t, cols):
    """Scalar t as a vector like `cols`, for masks (Triton's interpreter broadcasts no scalar
    mask)."""
    return t + tl.zeros_like(cols)


@triton.jit
def _tap(w, cols, D: tl.constexpr, tap: tl.constexpr):
    """Tap `tap` of every channel in `cols`, in fp32."""
    return tl.load(w + cols * 4 + tap, mask=cols < D, other=0.0).to(tl.float32)
