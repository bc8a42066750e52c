"""The backward of silu(depthwise causal conv) over packed documents, in one Triton kernel.

FLA's conv backward first recomputes the conv's pre-activation into a tensor of the input's
size (a forward kernel), then reads it and the output gradient once per tap. This kernel
recomputes the pre-activation in registers from the input (a tile reads its (K - 1)-token
halo from cache) and reads x and dy and writes dx once from memory.

dx[t] needs g at t..t+K-1, i.e. g of the next K - 1 rows too, and a register tile cannot be
shifted: recomputing g at every shift costs K times the instructions (a first version did
that and ran no faster than FLA). Here each tile computes g once, puts it in a small scratch
slot of its own (cache-resident: each program reuses one slot for all its tiles) and reads it
back shifted. Tiles overlap by K - 1 rows, so the shifted reads stay inside the tile; a tile
writes dx only for its first BT - K + 1 rows.

Notation, as in `titan_gdn.ops.conv._causal_conv1d_torch`: y[t] = sum_j w[K-1-j] x[t-j] over
the lags j that stay inside t's document, out = silu(y), and g = dy * silu'(y); then
dx[t] = sum_s w[K-1-s] g[t+s] over the s with t+s in t's document, and
dw[K-1-j] = sum_t g[t] x[t-j] over the same pairs as the forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Rows and channels per tile, warps, and programs per streaming multiprocessor
# (`scripts/conv_backends.py --tilings` times others).
BLOCK_T = 64
BLOCK_D = 64
NUM_WARPS = 4
PROGRAMS_PER_SM = 8


def causal_conv1d_silu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_t: int = BLOCK_T,
    block_d: int = BLOCK_D,
    num_warps: int = NUM_WARPS,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [1, L, C] (x's dtype) and dw [C, K] (weight's dtype) of silu(conv(x, weight))."""
    _, length, channels = x.shape
    kernel = weight.shape[1]
    if block_t < 2 * kernel:
        raise ValueError(f"block_t = {block_t} must be at least twice the conv width {kernel}")
    x, grad, weight = x.contiguous(), grad.contiguous(), weight.contiguous()
    block_d = min(block_d, triton.next_power_of_2(channels))
    columns = triton.cdiv(channels, block_d)
    tiles = triton.cdiv(length, block_t - kernel + 1)
    # Each program streams over tiles, so the scratch is one slot per program, not per tile.
    programs = min(tiles, triton.cdiv(programs_per_sm * _multiprocessors(x.device), columns))
    dx = torch.empty_like(x)
    scratch = torch.empty(columns * programs, block_t, block_d, device=x.device)
    # One partial dw per program, summed after: no atomics, the same sum on every run.
    dw_partial = torch.empty(programs, kernel, channels, device=x.device, dtype=torch.float32)
    _conv_silu_backward_kernel[(columns, programs)](
        x, weight, grad, document_starts(cu_seqlens, length), dx, dw_partial, scratch, length,
        tiles, D=channels, K=kernel, KP=triton.next_power_of_2(kernel), BT=block_t, BD=block_d,
        num_warps=num_warps,
    )  # fmt: skip
    return dx, dw_partial.sum(0).t().to(weight.dtype)


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter, in the CPU tests
        return 2
    return torch.cuda.get_device_properties(device).multi_processor_count


def document_starts(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """For each token of the packed row, the index where its document starts (int32)."""
    index = torch.arange(length, device=cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:].long(), index, right=True)
    return cu_seqlens.long()[document].to(torch.int32)


@triton.jit
def _conv_silu_backward_kernel(
    x, w, dy, starts, dx, dw_partial, scratch, L, tiles,
    D: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    i_d, i_p = tl.program_id(0), tl.program_id(1)
    programs = tl.num_programs(1)
    STEP: tl.constexpr = BT - K + 1  # rows a tile writes; the last K - 1 only feed them
    r = tl.arange(0, BT)
    cols = i_d * BD + tl.arange(0, BD)
    in_cols = (cols < D)[None, :]
    # Offsets inside a tile; a shift by s rows is + s * D (+ s * BD in the slot), a constant.
    offsets = r[:, None] * D + cols[None, :]
    slot_index = (i_d * programs + i_p).to(tl.int64) * BT * BD
    slot = scratch + slot_index + r[:, None] * BD + tl.arange(0, BD)[None, :]
    taps = tl.arange(0, KP)[:, None]
    dw = tl.zeros([KP, BD], dtype=tl.float32)
    for i in range(i_p, tiles, programs):
        rows = i * STEP + r
        tile = (i * STEP + tl.zeros([], tl.int64)) * D  # int64: a row may start past 2**31
        in_rows = rows < L
        own_starts = tl.load(starts + rows, mask=in_rows, other=0)
        y = tl.zeros([BT, BD], dtype=tl.float32)
        for j in tl.static_range(K):
            valid = (in_rows & (rows - j >= own_starts))[:, None] & in_cols
            b_x = tl.load(x + tile + offsets - j * D, mask=valid, other=0.0)
            y += b_x.to(tl.float32) * _tap(w, cols, D, K, K - 1 - j)[None, :]
        b_dy = tl.load(dy + tile + offsets, mask=in_rows[:, None] & in_cols, other=0.0)
        sig = 1.0 / (1.0 + tl.exp(-y))
        g = b_dy.to(tl.float32) * sig * (1.0 + y * (1.0 - sig))
        owned = in_rows & (r < STEP)
        g_owned = tl.where(owned[:, None], g, 0.0)
        for j in tl.static_range(K):
            # This tile's share of dw: its own rows' g against the inputs they read (the same
            # loads as above, which the compiler merges).
            valid = (in_rows & (rows - j >= own_starts))[:, None] & in_cols
            b_x = tl.load(x + tile + offsets - j * D, mask=valid, other=0.0)
            part = tl.sum(g_owned * b_x.to(tl.float32), axis=0)
            dw += tl.where(taps == K - 1 - j, part[None, :], 0.0)
        tl.store(slot, g)
        tl.debug_barrier()  # g of every row is in the slot before any thread reads it shifted
        b_dx = tl.zeros([BT, BD], dtype=tl.float32)
        for s in tl.static_range(K):
            # g at rows t+s reaches dx[t] through tap K-1-s, within t's document.
            later = rows + s
            later_starts = tl.load(starts + later, mask=later < L, other=0)
            same_document = (r + s < BT) & (later < L) & (later_starts <= rows)
            g_later = tl.load(slot + s * BD, mask=same_document[:, None], other=0.0)
            b_dx += g_later * _tap(w, cols, D, K, K - 1 - s)[None, :]
        out = dx + tile + offsets
        tl.store(out, b_dx.to(dx.dtype.element_ty), mask=owned[:, None] & in_cols)
        tl.debug_barrier()  # every thread has read the slot before the next tile writes it
    partial = dw_partial + i_p * K * D + taps * D + cols[None, :]
    tl.store(partial, dw, mask=(taps < K) & in_cols)


@triton.jit
def _tap(w, cols, D: tl.constexpr, K: tl.constexpr, tap: tl.constexpr):
    """Tap `tap` of every channel in `cols`, in fp32."""
    return tl.load(w + cols * K + tap, mask=cols < D, other=0.0).to(tl.float32)
