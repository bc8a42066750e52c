"""The backward of silu(depthwise causal conv) over packed documents, in one Triton kernel.

FLA's conv backward first recomputes the conv's pre-activation into a tensor of the input's
size (a forward kernel), then reads it and the output gradient once per tap. This kernel
recomputes the pre-activation in registers from the input, which a tile reads with its
(K - 1)-token halo from cache, so it reads x and dy and writes dx once: at 0.8B's conv width
and 32k tokens that is about 1 GB of traffic, where FLA's pair moves more than twice that.

Notation, as in `titan_gdn.ops.conv._causal_conv1d_torch`: y[t] = sum_j w[K-1-j] x[t-j] over
the lags j that stay inside t's document, out = silu(y), and g = dy * silu'(y); then
dx[t] = sum_s w[K-1-s] g[t+s] over the s with t+s in t's document, and
dw[K-1-j] = sum_t g[t] x[t-j] over the same pairs as the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows and channels per program. A [64, 64] fp32 tile is 32 registers a thread at 4 warps.
BLOCK_T = 64
BLOCK_D = 64
NUM_WARPS = 4


def causal_conv1d_silu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_t: int = BLOCK_T,
    block_d: int = BLOCK_D,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [1, L, C] (x's dtype) and dw [C, K] (weight's dtype) of silu(conv(x, weight)).
    The block sizes are the kernel's tiling (`scripts/conv_backends.py` times others)."""
    _, length, channels = x.shape
    kernel = weight.shape[1]
    x, grad, weight = x.contiguous(), grad.contiguous(), weight.contiguous()
    starts = document_starts(cu_seqlens, length)
    dx = torch.empty_like(x)
    tiles = triton.cdiv(length, block_t)
    # One partial dw per row tile, summed after: no atomics, the same sum on every run.
    dw_partial = torch.empty(tiles, channels, kernel, device=x.device, dtype=torch.float32)
    grid = (tiles, triton.cdiv(channels, block_d))
    _conv_silu_backward_kernel[grid](
        x, weight, grad, starts, dx, dw_partial, length,
        D=channels, K=kernel, BT=block_t, BD=block_d, num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).to(weight.dtype)


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
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    rows = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    cols = i_d * BD + tl.arange(0, BD)
    in_rows, in_cols = rows < L, cols < D
    own_starts = tl.load(starts + rows, mask=in_rows, other=0)
    b_dx = tl.zeros([BT, BD], dtype=tl.float32)
    for s in tl.static_range(K):
        # g at rows t+s, which reach dx[t] through tap K-1-s.
        later = rows + s
        in_later = later < L
        later_starts = tl.load(starts + later, mask=in_later, other=0)
        y = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(K):
            source = later - j
            valid = in_later & (source >= later_starts)
            b_x = tl.load(
                x + source[:, None] * D + cols[None, :],
                mask=valid[:, None] & in_cols[None, :],
                other=0.0,
            ).to(tl.float32)
            tap = tl.load(w + cols * K + (K - 1 - j), mask=in_cols, other=0.0).to(tl.float32)
            y += b_x * tap[None, :]
        b_dy = tl.load(
            dy + later[:, None] * D + cols[None, :],
            mask=in_later[:, None] & in_cols[None, :],
            other=0.0,
        ).to(tl.float32)
        sig = tl.sigmoid(y)
        g = b_dy * sig * (1.0 + y * (1.0 - sig))
        same_document = in_rows & in_later & (later_starts <= rows)
        tap = tl.load(w + cols * K + (K - 1 - s), mask=in_cols, other=0.0).to(tl.float32)
        b_dx += tl.where(same_document[:, None], g * tap[None, :], 0.0)
        if s == 0:
            # This tile's share of dw: its own rows' g against the inputs they read.
            for j in tl.static_range(K):
                source = rows - j
                valid = in_rows & (source >= own_starts)
                b_x = tl.load(
                    x + source[:, None] * D + cols[None, :],
                    mask=valid[:, None] & in_cols[None, :],
                    other=0.0,
                ).to(tl.float32)
                part = tl.sum(g * b_x, axis=0)
                tl.store(dw_partial + i_t * D * K + cols * K + (K - 1 - j), part, mask=in_cols)
    tl.store(
        dx + rows[:, None] * D + cols[None, :],
        b_dx.to(dx.dtype.element_ty),
        mask=in_rows[:, None] & in_cols[None, :],
    )
