"""The gated delta rule (Qwen3.5 linear-attention core) over packed documents.

One entry point, :func:`gated_delta_rule`, with three backends: FLA's Triton kernels ("fla", CUDA
only), FlashQLA's TileLang kernels ("flash_qla", Hopper and Blackwell, head widths 128, chosen
by name only) and a pure-torch chunked implementation ("torch", any device). All follow
transformers' Qwen3.5 with ``use_qk_l2norm_in_kernel=True``. Each runs as a custom op, in eager
and compiled code alike: "fla" and "flash_qla" save their kernels' residuals (`fla_op`,
`flash_qla_op`), "torch" recomputes in backward (`titan_gdn.ops.custom_op`).
"""

from __future__ import annotations

import torch

from titan_gdn.ops.backends import resolve_backend
from titan_gdn.ops.custom_op import input_saving_op
from titan_gdn.ops.delta_rule.chunk_torch import chunk_gated_delta_rule_torch
from titan_gdn.ops.delta_rule.fla_op import fla_gated_delta_rule
from titan_gdn.ops.delta_rule.flash_qla_op import flash_qla_gated_delta_rule

DELTA_RULE_BACKENDS = ("fla", "flash_qla", "torch")

__all__ = [
    "DELTA_RULE_BACKENDS",
    "chunk_gated_delta_rule_torch",
    "gated_delta_rule",
    "resolve_delta_rule_backend",
]


def resolve_delta_rule_backend(device: torch.device | str, backend: str | None) -> str:
    """`backend` checked against `device`; None/"auto": "fla" on CUDA if installed, else "torch"."""
    return resolve_backend(
        "delta_rule_backend",
        backend,
        torch.device(device),
        cuda_preference=("fla",),
        cuda_only={"fla": "fla", "flash_qla": "flash_qla"},
        choices=DELTA_RULE_BACKENDS,
    )


def gated_delta_rule(
    q, k, v, g, beta, cu_seqlens, *, backend: str | None = None, scale: float | None = None
) -> torch.Tensor:
    """Gated delta rule over the packed documents of one row; returns o [1, T, Hv, Dv].

    q, k: [1, T, Hk, Dk]; v: [1, T, Hv, Dv], Hv a multiple of Hk (value head j reads key head
    j // (Hv // Hk)); g: [1, T, Hv] log-decay <= 0 (fp32); beta: [1, T, Hv] in (0, 1);
    cu_seqlens: int32 [N + 1] document boundaries from 0 to T, on q's device; documents may
    be empty, as the padding of a fixed-capacity cu_seqlens is (see `titan_gdn.boundaries`).

    q and k are L2-normalised over Dk (x * rsqrt(sum x^2 + 1e-6), fp32) and q is scaled by
    `scale` (default Dk ** -0.5). Per value head, with a [Dk, Dv] state S zeroed at every
    document start: S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.
    The output has v's dtype.
    """
    _check_shapes(q, k, v, g, beta, cu_seqlens)
    backend = resolve_delta_rule_backend(q.device, backend)
    if backend == "fla":
        return fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale)
    if backend == "flash_qla":
        return flash_qla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale)
    return _gated_delta_rule_torch(q, k, v, g, beta, cu_seqlens, scale)


_gated_delta_rule_torch = input_saving_op(
    "gated_delta_rule_torch",
    chunk_gated_delta_rule_torch,
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, float? scale)",
    num_differentiable=5,
    output_like=2,
)


def _check_shapes(q, k, v, g, beta, cu_seqlens) -> None:
    if any(x.dim() == 0 or x.shape[0] != 1 for x in (q, k, v, g, beta)):
        raise ValueError(
            "gated_delta_rule takes packed documents in one row (batch size 1, boundaries in "
            f"cu_seqlens); got q {tuple(q.shape)}, v {tuple(v.shape)}"
        )
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[1] != q.shape[1]:
        raise ValueError(
            f"expected q, k [1, T, Hk, Dk] and v [1, T, Hv, Dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if v.shape[2] % q.shape[2]:
        raise ValueError(
            f"value heads ({v.shape[2]}) must be a multiple of key heads ({q.shape[2]})"
        )
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(
            f"g and beta must be [1, T, Hv] = {tuple(v.shape[:3])}; "
            f"got g {tuple(g.shape)}, beta {tuple(beta.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "cu_seqlens must be a 1-D integer tensor; "
            f"got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
