"""Lift FLA 0.6.0's Hopper guard on the gated dq/dk/dw/dg backward, for 128-wide tiles only.

The guard. ``fla/ops/common/chunk_o.py::chunk_bwd_dqkwg`` begins with::

    if g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        raise RuntimeError("... incorrect results for gated chunk_bwd_dqkwg (see #640) ...")

The three flags are globals of ``fla.ops.common.chunk_o``, copied from ``fla.utils`` (which
computes them once, at import) and read each time the function runs. The gated delta rule's
backward always passes ``g``, so on Hopper with Triton in [3.4.0, 3.7.1) every backward raises.

Why 128-wide tiles are exempt. The miscompile behind fla-org/flash-linear-attention#640 follows
the tile width: the issue's sweep of ``CONST_TILING`` on Hopper found tiles of 32 and 128
correct and 64 wrong (dk, dg max errors 14.7 and 5.5). With the lift, on an H200 with Triton
3.6.0 and head dim 128, FLA's bf16 gradients are within 5e-3 (relative norm) of the fp32 torch
backend's, as close as its outputs (tests/gpu/test_delta_rule_gpu.py). With Hopper-sized shared
memory FLA picks ``BK = min(max(next_pow2(K), 16), 128)`` and ``BV`` the same way from V, so
head dims above 64 get 128-wide tiles while head dim 64 gets exactly the broken 64. The sweep
moved BK and BV together, so both must be 128 here.

How it is lifted. The gated delta rule's backward finds ``chunk_bwd_dqkwg`` in the globals of
``fla.ops.gated_delta_rule.chunk``; that one name is rebound to a wrapper. A call on a
capability-9.x device whose K and V both get 128-wide tiles runs with
``chunk_o.TRITON_ABOVE_3_7_1`` set to True, and the flag is restored when the call returns;
every other call reaches FLA's function unchanged, guard included. Other FLA ops hold their
own reference to ``chunk_bwd_dqkwg`` and keep the guard. The flag flip is not thread-safe; the
autograd engine runs one device's backward on one thread, which is what training does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

SAFE_TILE = 128


def allow_fla_hopper_bk128() -> bool:
    """Let FLA's gated backward run on Hopper + Triton [3.4, 3.7.1) when its tiles are 128 wide.

    Returns True when the scoped lift is in place (now or from an earlier call), False when
    FLA's guard cannot fire in this process, in which case nothing is changed.
    """
    from fla.ops.common import chunk_o
    from fla.ops.gated_delta_rule import chunk as gated_delta_rule_chunk

    if not _guard_can_fire(chunk_o):
        return False
    current = gated_delta_rule_chunk.chunk_bwd_dqkwg
    if not getattr(current, "lifts_fla_hopper_guard", False):
        gated_delta_rule_chunk.chunk_bwd_dqkwg = lift_guard_for_safe_tiles(current, chunk_o)
    return True


def fla_hopper_tile(head_dim: int) -> int:
    """The BK (or BV) FLA's chunk_bwd_dqkwg picks for `head_dim` on a Hopper-class GPU."""
    return min(max(1 << (head_dim - 1).bit_length(), 16), SAFE_TILE)


def guard_may_be_lifted(capability: tuple[int, int], key_dim: int, value_dim: int) -> bool:
    return (
        capability[0] == 9
        and fla_hopper_tile(key_dim) == SAFE_TILE
        and fla_hopper_tile(value_dim) == SAFE_TILE
    )


def lift_guard_for_safe_tiles(dqkwg: Callable, chunk_o) -> Callable:
    """Wrap FLA's `dqkwg` so calls that get 128-wide tiles skip the guard in module `chunk_o`."""

    @functools.wraps(dqkwg)
    def dqkwg_with_safe_tiles_unguarded(*args, **kwargs):
        k = kwargs["k"] if "k" in kwargs else args[1]
        v = kwargs["v"] if "v" in kwargs else args[2]
        if not _runs_with_safe_tiles(k, v, chunk_o):
            return dqkwg(*args, **kwargs)
        saved = chunk_o.TRITON_ABOVE_3_7_1
        chunk_o.TRITON_ABOVE_3_7_1 = True
        try:
            return dqkwg(*args, **kwargs)
        finally:
            chunk_o.TRITON_ABOVE_3_7_1 = saved

    dqkwg_with_safe_tiles_unguarded.lifts_fla_hopper_guard = True
    return dqkwg_with_safe_tiles_unguarded


def _guard_can_fire(chunk_o) -> bool:
    # The guard's own condition, minus `g is not None` (always true for the gated delta rule).
    return bool(
        chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1
    )


def _runs_with_safe_tiles(k: torch.Tensor, v: torch.Tensor, chunk_o) -> bool:
    # FLA sizes its tiles by the shared memory of k's device; below Hopper's they are smaller.
    return guard_may_be_lifted(
        _device_capability(k.device), k.shape[-1], v.shape[-1]
    ) and chunk_o.check_shared_mem("hopper", k.device.index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
