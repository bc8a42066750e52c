"""Token-by-token gated delta rule: the slow, obviously-correct reference for the tests."""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Gated delta rule over packed documents, one token at a time; returns o [1, T, Hv, Dv].

    Same contract as :func:`titan_gdn.ops.delta_rule.gated_delta_rule`. Computes in fp32, or in
    fp64 when given fp64 inputs, so that tests can compare algorithms without rounding noise.
    """
    out_dtype, dtype = v.dtype, torch.promote_types(v.dtype, torch.float32)
    value_heads, key_dim, value_dim = v.shape[2], k.shape[3], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    q = _unit_norm(q[0].to(dtype)).repeat_interleave(value_heads // q.shape[2], dim=1) * scale
    k = _unit_norm(k[0].to(dtype)).repeat_interleave(value_heads // k.shape[2], dim=1)
    v, decay, beta = v[0].to(dtype), g[0].to(dtype).exp(), beta[0].to(dtype)
    document_starts = set(cu_seqlens.tolist()[:-1])

    state = v.new_zeros(value_heads, key_dim, value_dim)
    outputs = []
    for t in range(v.shape[0]):
        if t in document_starts:
            state = torch.zeros_like(state)
        state = state * decay[t, :, None, None]
        prediction = torch.einsum("hk,hkv->hv", k[t], state)
        correction = beta[t, :, None] * (v[t] - prediction)
        state = state + k[t, :, :, None] * correction[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs)[None].to(out_dtype)


def _unit_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)
