"""Token-by-token gated delta rule: the slow, obviously-correct reference for the tests."""

from __future__ import annotations

import torch

from titan_gdn.ops.delta_rule.inputs import per_value_head


def recurrent_gated_delta_rule(
    q, k, v, g, beta, cu_seqlens, scale: float | None = None
) -> torch.Tensor:
    """Gated delta rule over packed documents, one token at a time; returns o [1, T, Hv, Dv].

    Same contract as :func:`titan_gdn.ops.delta_rule.gated_delta_rule`. Computes in fp32, or in
    fp64 when given fp64 inputs, so that tests can compare algorithms without rounding noise.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = per_value_head(q, k, v, g, beta, scale)
    (length, value_heads, key_dim), value_dim = k.shape, v.shape[2]
    decay = g.exp()
    document_starts = set(cu_seqlens.tolist()[:-1])

    state = v.new_zeros(value_heads, key_dim, value_dim)
    outputs = []
    for t in range(length):
        if t in document_starts:
            state = torch.zeros_like(state)
        state = state * decay[t, :, None, None]
        prediction = torch.einsum("hk,hkv->hv", k[t], state)
        correction = beta[t, :, None] * (v[t] - prediction)
        state = state + k[t, :, :, None] * correction[:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs)[None].to(out_dtype)
