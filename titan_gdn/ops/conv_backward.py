"""The backward of silu(depthwise causal conv) over packed documents, in one Triton kernel.

FLA's conv backward first recomputes the conv's pre-activation into a tensor of the input's
size (a forward kernel), then reads it and the output gradient once per tap. This kernel
recomputes the pre-activation in registers from the input, which a tile reads with its
(K - 1)-token halo from cache, so it reads x and dy and writes dx once from memory.

Its cost is instructions, not bytes (a tile's g is recomputed at K shifts, since a register
tile cannot be shifted), so the index work is kept out of the inner loops: every shifted
load is the tile's pointers plus a constant (the row stride is a compile-time constant), and
document masks are per row, not per element.

Notation, as in `titan_gdn.ops.conv._causal_conv1d_torch`: y[t] = sum_j w[K-1-j] x[t-j] over
the lags j that stay inside t's document, out = silu(y), and g = dy * silu'(y); then
dx[t] = sum_s w[K-1-s] g[t+s] over the s with t+s in t's document, and
dw[K-1-j] = sum_t g[t] x[t-j] over the same pairs as the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows and channels per program, and warps (`scripts/conv_backends.py --tilings` times others).
BLOCK_T = 64
BLOCK_D = 128
NUM_WARPS = 8


def causal_conv1d_silu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_t: int = BLOCK_T,
    block_d: int = BLOCK_D,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [1, L, C] (x's dtype) and dw [C, K] (weight's dtype) of silu(conv(x, weight))."""
    _, length, channels = x.shape
    kernel = weight.shape[1]
    x, grad, weight = x.contiguous(), grad.contiguous(), weight.contiguous()
    block_d = min(block_d, triton.next_power_of_2(channels))
    dx = torch.empty_like(x)
    tiles = triton.cdiv(length, block_t)
    # One partial dw per row tile, summed after: no atomics, the same sum on every run.
    dw_partial = torch.empty(tiles, kernel, channels, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(channels, block_d), tiles)
    _conv_silu_backward_kernel[grid](
        x, weight, grad, document_starts(cu_seqlens, length), dx, dw_partial, length,
        D=channels, K=kernel, BT=block_t, BD=block_d, num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).t().to(weight.dtype)


def document_starts(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """For each token of the packed row, the index where its document starts (int32)."""
    index = torch.arange(length, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)
    return cu_seqlens.long()[document].to(torch.int32)


@triton.jit
def _conv_silu_backward_kernel(
    x, w, dy, starts, dx, dw_partial, L,
    D: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    i_d, i_t = tl.program_id(0), tl.program_id(1)
    first_row = i_t * BT
    rows = first_row + tl.arange(0, BT)
    cols = i_d * BD + tl.arange(0, BD)
    in_cols = (cols < D)[None, :]
    # Offsets inside the tile; a shift by s rows is + s * D, a constant.
    tile = first_row.to(tl.int64) * D
    offsets = tl.arange(0, BT)[:, None] * D + cols[None, :]
    x_tile, dy_tile = x + tile + offsets, dy + tile + offsets
    in_rows = rows < L
    own_starts = tl.load(starts + rows, mask=in_rows, other=0)
    b_dx = tl.zeros([BT, BD], dtype=tl.float32)
    for s in tl.static_range(K):
        # g at rows t+s, which reach dx[t] through tap K-1-s.
        later = rows + s
        in_later = later < L
        later_starts = tl.load(starts + later, mask=in_later, other=0)
        y = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(K):
            valid = (in_later & (later - j >= later_starts))[:, None]
            b_x = tl.load(x_tile + (s - j) * D, mask=valid & in_cols, other=0.0)
            y += b_x.to(tl.float32) * _tap(w, cols, D, K, K - 1 - j)[None, :]
        b_dy = tl.load(dy_tile + s * D, mask=in_later[:, None] & in_cols, other=0.0)
        sig = 1.0 / (1.0 + tl.exp(-y))
        g = b_dy.to(tl.float32) * sig * (1.0 + y * (1.0 - sig))
        if s == 0:
            # This tile's share of dw: its own rows' g against the inputs they read.
            for j in tl.static_range(K):
                valid = (in_rows & (rows - j >= own_starts))[:, None]
                b_x = tl.load(x_tile - j * D, mask=valid & in_cols, other=0.0)
                part = tl.sum(g * b_x.to(tl.float32), axis=0)
                tl.store(dw_partial + (i_t * K + K - 1 - j) * D + cols, part, mask=cols < D)
        same_document = (in_rows & in_later & (later_starts <= rows))[:, None]
        b_dx += tl.where(same_document, g, 0.0) * _tap(w, cols, D, K, K - 1 - s)[None, :]
    out = dx + tile + offsets
    tl.store(out, b_dx.to(dx.dtype.element_ty), mask=in_rows[:, None] & in_cols)


@triton.jit
def _tap(w, cols, D: tl.constexpr, K: tl.constexpr, tap: tl.constexpr):
    """Tap `tap` of every channel in `cols`, in fp32."""
    return tl.load(w + cols * K + tap, mask=cols < D, other=0.0).to(tl.float32)
