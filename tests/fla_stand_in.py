"""Pure-torch stand-ins for the FLA functions the delta-rule op calls, so the op's mechanics
(residuals, autograd, fake shapes, checkpointing) run on CPU, where Triton cannot.

Each stand-in first binds its arguments to the real FLA function's signature, so a call that
FLA 0.6.0 would reject fails here too. The forward and backward compute the gated delta rule
token by token on already-normalised q and k, as FLA's do; the forward counts its calls.
The decay residual is the stand-in's own (g as given, fp32), where FLA keeps a chunk-local
cumulative sum: only the stand-in backward reads it, and both have FLA's shape and dtype.
"""

from __future__ import annotations

import inspect

import torch
from fla.modules.norm import l2norm as fla_l2norm
from fla.ops.gated_delta_rule import chunk as fla_chunk

from titan_gdn.ops.custom_op import recording_autograd
from titan_gdn.ops.delta_rule.fla_op import CHUNK_SIZE, FlaKernels


class FlaStandIn:
    def __init__(self):
        self.forward_calls = 0
        self.backward_calls = 0

    def kernels(self) -> FlaKernels:
        return FlaKernels(
            l2norm_fwd=self.l2norm_fwd,
            l2norm_bwd=self.l2norm_bwd,
            forward=self.forward,
            backward=self.backward,
        )

    def l2norm_fwd(self, *args, **kwargs):
        x, eps, _ = _bind(fla_l2norm.l2norm_fwd, args, kwargs, "x", "eps", "output_dtype")
        rstd = torch.rsqrt(x.float().square().sum(-1) + eps)
        return (x.float() * rstd[..., None]).to(x.dtype), rstd

    def l2norm_bwd(self, *args, **kwargs):
        y, rstd, dy = _bind(fla_l2norm.l2norm_bwd, args, kwargs, "y", "rstd", "dy")
        y, dy, rstd = y.float(), dy.float(), rstd[..., None]
        return (dy * rstd - (dy * y).sum(-1, keepdim=True) * y * rstd).to(y.dtype)

    def forward(self, *args, **kwargs):
        self.forward_calls += 1
        names = ("q", "k", "v", "g", "beta", "scale", "cu_seqlens", "chunk_size")
        q, k, v, g, beta, scale, cu_seqlens, chunk_size = _bind(
            fla_chunk.chunk_gated_delta_rule_fwd, args, kwargs, *names
        )
        assert chunk_size == CHUNK_SIZE
        o = unnormalised_delta_rule(q, k, v, g, beta, scale, cu_seqlens)
        A = k.new_zeros((*beta.shape, chunk_size))
        return g.float().clone(), o.to(v.dtype), A, None, None, None

    def backward(self, *args, **kwargs):
        self.backward_calls += 1
        names = ("q", "k", "v", "g", "beta", "scale", "do", "cu_seqlens")
        q, k, v, g, beta, scale, do, cu_seqlens = _bind(
            fla_chunk.chunk_gated_delta_rule_bwd, args, kwargs, *names
        )
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g, beta)]
        # It runs inside a custom op, below autograd: recording has to be switched back on.
        with recording_autograd():
            o = unnormalised_delta_rule(*leaves, scale, cu_seqlens)
            dq, dk, dv, dg, dbeta = torch.autograd.grad(o, leaves, do.float())
        return dq, dk, dv, dbeta, dg, None, None, None


def unnormalised_delta_rule(q, k, v, g, beta, scale, cu_seqlens):
    """o [1, T, Hv, Dv] of the gated delta rule with q, k used as given (fp32 recurrence)."""
    value_heads = v.shape[2]
    q, k = (x[0].float().repeat_interleave(value_heads // x.shape[2], dim=1) for x in (q, k))
    v, decay, beta = v[0].float(), g[0].float().exp(), beta[0].float()
    starts = set(cu_seqlens.tolist()[:-1])
    state = v.new_zeros(value_heads, k.shape[-1], v.shape[-1])
    outputs = []
    for t in range(v.shape[0]):
        if t in starts:
            state = torch.zeros_like(state)
        state = state * decay[t, :, None, None]
        correction = beta[t, :, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t, :, :, None] * correction[:, None, :]
        outputs.append(scale * torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outputs)[None]


def _bind(real_fn, args, kwargs, *names):
    bound = inspect.signature(inspect.unwrap(real_fn)).bind(*args, **kwargs)
    bound.apply_defaults()
    return [bound.arguments[name] for name in names]


class FlaConvStandIn:
    """FLA's public causal conv as the conv op calls it, and our Triton conv backward
    (`titan_gdn.ops.conv_backward`), computed by the torch reference (a backward through
    autograd); counts the convolutions each runs. Made before the functions are patched: it
    binds calls to FLA's signature."""

    def __init__(self):
        from fla.modules import causal_conv1d as fla_conv

        self.real_forward = fla_conv.causal_conv1d
        self.forward_calls = 0
        self.backward_calls = 0

    def causal_conv1d(self, *args, **kwargs):
        from titan_gdn.ops.conv import _causal_conv1d_torch

        names = ("x", "weight", "activation", "cu_seqlens")
        x, weight, activation, cu_seqlens = _bind(self.real_forward, args, kwargs, *names)
        assert activation == "silu"
        self.forward_calls += 1
        return _causal_conv1d_torch(x, weight, cu_seqlens), None

    def causal_conv1d_silu_backward(self, dy, x, weight, cu_seqlens):
        from titan_gdn.ops.conv import _causal_conv1d_torch

        self.backward_calls += 1
        leaves = [x.detach().requires_grad_(), weight.detach().requires_grad_()]
        with recording_autograd():
            y = _causal_conv1d_torch(*leaves, cu_seqlens)
            dx, dw = torch.autograd.grad(y, leaves, dy)
        return dx, dw
