"""What both pure-torch delta rules, the chunked one and the token recurrence, do to their
inputs first (the contract of `gated_delta_rule`)."""

from __future__ import annotations

import torch


def per_value_head(q, k, v, g, beta, scale: float | None) -> tuple[torch.Tensor, ...]:
    """The row's q, k, v, g, beta as [T, Hv, ...] in fp32 (fp64 for fp64 inputs): q and k
    L2-normalised over Dk and repeated for the value heads that read them, q scaled by
    `scale` (default Dk ** -0.5)."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    value_heads = v.shape[2]
    scale = k.shape[3] ** -0.5 if scale is None else scale
    q = _unit_norm(q[0].to(dtype)).repeat_interleave(value_heads // q.shape[2], dim=1) * scale
    k = _unit_norm(k[0].to(dtype)).repeat_interleave(value_heads // k.shape[2], dim=1)
    return q, k, v[0].to(dtype), g[0].to(dtype), beta[0].to(dtype)


def _unit_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
