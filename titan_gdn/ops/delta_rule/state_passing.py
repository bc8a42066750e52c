"""The gated delta rule over a sequence cut into chunks on consecutive ranks: the local pass,
written so that the state carried in from earlier ranks can be added afterwards, and the
combine of the ranks' carried states (pure torch; the reference of FLA's `fla.ops.cp`).

The recurrence is affine in its state: per value head, S_t = A_t S_0 + L_t, with A_t the
product of the [Dk, Dk] steps exp(g) (I - beta k k^T) since the document start and L_t the
state reached from S_0 = 0. Run once with the values widened to [v | 0] (Dv + Dk columns) and
the state [0 | I] entering each row's first document, the chunked rule returns both at once:

    state  [L_t | A_t]          the last one is the row's summary for the next rank;
    output [o_t^0 | q_t^T A_t]  so that o_t = o_t^0 + (q_t^T A_t) S_0 once S_0 is known.

A_t is zero after a document start (the state restarts there), so the correction touches the
first document only, and a summary whose last document started in the chunk passes no state
through. FLA's kernels compute the same summary (`chunk_cp_fwd_h`: [h_local | M]) and the
same chain (`chunk_cp_merge`); this form needs no second pass over the chunk.
"""

from __future__ import annotations

import torch

from titan_gdn.ops.custom_op import recording_autograd, register_op
from titan_gdn.ops.delta_rule.chunk_torch import chunk_gated_delta_rule_torch_with_states


def affine_gated_delta_rule(q, k, v, g, beta, cu_seqlens, rows: int, scale: float | None):
    """(outputs [1, T, Hv, Dv + Dk], summaries [rows, Hv, Dk, Dv + Dk] fp32) of the local pass
    over `rows` rows of T / rows tokens, each starting a document in `cu_seqlens`."""
    value_heads, key_dim = v.shape[2], k.shape[3]
    widened = torch.cat([v, v.new_zeros(*v.shape[:3], key_dim)], dim=-1)
    dtype = torch.promote_types(v.dtype, torch.float32)
    identity = torch.eye(key_dim, dtype=dtype, device=v.device)
    zeros = identity.new_zeros(key_dim, v.shape[3])
    initial = torch.cat([zeros, identity], dim=-1).expand(rows, value_heads, -1, -1)
    return _affine_op(q, k, widened, g, beta, cu_seqlens, initial, scale)


def incoming_states(summaries: torch.Tensor, carry: torch.Tensor, rank: int) -> torch.Tensor:
    """The state entering chunk `rank` [R, Hv, Dk, Dv], from every chunk's summary
    [N, R, Hv, Dk, Dv + Dk] and `carry` [N, R]: whether chunk n of row r continues the
    document that the chunk before it ends in (never for chunk 0)."""
    key_dim = summaries.shape[-2]
    value_dim = summaries.shape[-1] - key_dim
    states = [summaries.new_zeros(*summaries.shape[1:-1], value_dim)]
    # Every chunk's state, then this one's: the summaries then reach this rank's result on
    # every rank, the first included, so every rank runs the all-gather's backward (a
    # collective) and none waits for one that never comes.
    for n in range(1, summaries.shape[0]):
        local, transition = summaries[n - 1].split([value_dim, key_dim], dim=-1)
        carried = carry[n].to(local.dtype)[:, None, None, None]
        states.append(carried * (transition @ states[-1] + local))
    return torch.stack(states)[rank]


def add_incoming_state(outputs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """o [1, T, Hv, Dv] from the local pass's outputs [1, T, Hv, Dv + Dk] and the state
    entering each of the R rows [R, Hv, Dk, Dv]."""
    rows, value_dim = state.shape[0], state.shape[-1]
    local, through_state = outputs.unflatten(1, (rows, -1))[0].split(
        [value_dim, outputs.shape[-1] - value_dim], dim=-1
    )
    carried = torch.einsum("rthk,rhkv->rthv", through_state.to(state.dtype), state)
    return (local + carried.to(local.dtype)).flatten(0, 1)[None]


# The arguments of the local pass, in its op's schema and its backward op's.
_ARGUMENTS = (
    "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens, "
    "Tensor initial_state, float? scale"
)


def _affine_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    o, final = chunk_gated_delta_rule_torch_with_states(
        q, k, v, g, beta, cu_seqlens, initial_state, scale
    )
    return o.contiguous(), final.contiguous()


_affine_op = register_op(
    "affine_gated_delta_rule_torch", _affine_forward, f"({_ARGUMENTS}) -> (Tensor, Tensor)"
)


@_affine_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, initial_state, scale):
    dtype = torch.promote_types(v.dtype, torch.float32)
    return v.new_empty(v.shape), initial_state.new_empty(initial_state.shape, dtype=dtype)


# Its backward recomputes the forward under autograd, as `custom_op.input_saving_op` does for
# the one-output torch delta rule (this op has two outputs, which that helper does not make).
def _affine_backward(grad_o, grad_final, q, k, v, g, beta, cu_seqlens, initial_state, scale):
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
    with recording_autograd():
        o, final = chunk_gated_delta_rule_torch_with_states(
            *inputs, cu_seqlens, initial_state, scale
        )
    grads = torch.autograd.grad((o, final), inputs, (grad_o, grad_final), materialize_grads=True)
    return [grad.contiguous() for grad in grads]


_affine_op_backward = register_op(
    "affine_gated_delta_rule_torch_backward",
    _affine_backward,
    f"(Tensor grad_o, Tensor grad_final, {_ARGUMENTS}) -> Tensor[]",
)


@_affine_op_backward.register_fake
def _(grad_o, grad_final, q, k, v, g, beta, cu_seqlens, initial_state, scale):
    return [x.new_empty(x.shape) for x in (q, k, v, g, beta)]


def _setup_context(ctx, inputs, output):
    *tensors, scale = inputs
    ctx.save_for_backward(*tensors)
    ctx.scale = scale


def _backward(ctx, grad_o, grad_final):
    q, k, v, g, beta, cu_seqlens, initial_state = ctx.saved_tensors
    if grad_o is None:
        grad_o = v.new_zeros(v.shape)
    if grad_final is None:
        grad_final = initial_state.new_zeros(initial_state.shape)
    grads = _affine_op_backward(
        grad_o, grad_final, q, k, v, g, beta, cu_seqlens, initial_state, ctx.scale
    )
    return *grads, None, None, None


_affine_op.register_autograd(_backward, setup_context=_setup_context)
