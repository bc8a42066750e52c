"""FLA's chunked gated delta rule as two custom ops: a forward that returns FLA's residuals
and a backward that consumes them, so no FLA forward kernel runs again in backward.

FLA's own autograd Function (``fla.ops.gated_delta_rule.chunk.ChunkGatedDeltaRuleFunction``)
L2-normalises q and k, runs ``chunk_gated_delta_rule_fwd`` and saves q, k (normalised), their
inverse norms, v, the chunk-local cumulative decay, beta and the solved WY matrix A; its
backward hands those to ``chunk_gated_delta_rule_bwd``. An opaque op cannot keep a Python
Function's saved state, so here the same tensors are outputs of the forward op, saved by its
autograd formula, and the backward op calls ``chunk_gated_delta_rule_bwd`` on them: eager and
compiled training run exactly FLA's kernels, and selective activation checkpointing can keep
the op's outputs instead of recomputing the kernel.

Only FLA's Triton path is called: importing titan_gdn turns FLA's backend dispatch off (see
`titan_gdn/__init__.py`), which would otherwise look for replacement backends (FlashQLA,
Ascend) at every call of the functions below. The Hopper guard lift (`hopper_guard`) still
applies: it rebinds the name that ``chunk_gated_delta_rule_bwd`` looks up in its own module.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from titan_gdn.boundaries import FLA_CHUNK_SIZE, cached_documents_and_chunks
from titan_gdn.ops.custom_op import register_op
from titan_gdn.ops.local_memory import release_after_first_use

# FLA's default chunk size for the gated delta rule; A is [1, T, Hv, CHUNK_SIZE].
CHUNK_SIZE = FLA_CHUNK_SIZE
# Rows longer than this have FLA's kernels tuned on their first this many tokens first.
TUNING_TOKENS = 8192
_tuned: set[tuple] = set()
# The ops' schemas: a forward op's inputs, and the residuals that FLA's forward leaves for its
# backward (outputs of the forward ops after o, inputs of the backward ops after grad_o).
INPUTS = "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor cu_seqlens"
RESIDUALS = "Tensor q, Tensor q_rstd, Tensor k, Tensor k_rstd, Tensor v, Tensor g_cumsum, Tensor A"


def tensors(count: int) -> str:
    """A schema's `count` tensor outputs."""
    return f"({', '.join(['Tensor'] * count)})"


class FlaKernels(NamedTuple):
    """The FLA functions the ops call, looked up once (tests substitute stand-ins)."""

    l2norm_fwd: Callable
    l2norm_bwd: Callable
    forward: Callable
    backward: Callable


@functools.cache
def load_fla_kernels() -> FlaKernels:
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import (
        chunk_gated_delta_rule_bwd,
        chunk_gated_delta_rule_fwd,
    )

    from titan_gdn.ops.delta_rule.hopper_guard import allow_fla_hopper_bk128

    allow_fla_hopper_bk128()
    return FlaKernels(
        l2norm_fwd,
        l2norm_bwd,
        chunk_gated_delta_rule_fwd,
        chunk_gated_delta_rule_bwd,
    )


def fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale: float | None) -> Tensor:
    """The gated delta rule on FLA's kernels; same contract as `gated_delta_rule`."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens, scale)[0]


def _gated_delta_rule_fla(q, k, v, g, beta, cu_seqlens, scale):
    """o and the residuals (q, q_rstd, k, k_rstd, v, g_cumsum, A) that the backward takes."""
    _tune_on_a_short_row_first(q, k, v, g, beta, scale)
    fla = load_fla_kernels()
    # FLA types cu_seqlens as LongTensor, but every kernel casts what it loads, and int32 is
    # what FLA's own layers pass. No .long(): the trimmed tensor is then the same object
    # across layers, so FLA's identity-keyed caches (chunk offsets) hit.
    cu_seqlens, chunk_indices = cached_documents_and_chunks()(cu_seqlens)
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    # A fresh copy even when v is contiguous: a residual must not alias an input. In the GDN
    # layer v is a slice of the conv output, which FLA's input guard copies just the same;
    # saving the slice itself would keep the whole conv output alive.
    v_saved = v.clone(memory_format=torch.contiguous_format)
    with _on_device(q):
        q_unit, q_rstd = fla.l2norm_fwd(q)
        k_unit, k_rstd = fla.l2norm_fwd(k)
        g_cumsum, o, A, _, _, _ = fla.forward(
            q=q_unit,
            k=k_unit,
            v=v_saved,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=None,
            output_final_state=False,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=CHUNK_SIZE,
        )
    release_after_first_use("gated_delta_rule_fla", q, v)
    # FLA returns o in q's dtype; the contract is v's.
    return o.to(q.dtype).to(v.dtype), q_unit, q_rstd, k_unit, k_rstd, v_saved, g_cumsum, A


def _tune_on_a_short_row_first(q, k, v, g, beta, scale) -> None:
    """The first time a process meets these head counts, widths and dtypes on a long row, run
    FLA's forward and backward on the row's first `TUNING_TOKENS` tokens (one document) before
    the row itself. FLA autotunes each kernel at its first launch, keyed by heads, widths and
    dtypes but not length, so the backward's tuning happens here, in the first layer's forward
    while little memory is held, instead of in the backward at the step's peak; and its
    local-memory reservation (6.3 GiB on an H200, see `local_memory.py`) is given back before
    the long row's activations exist. Values do not matter to the tuning."""
    if q.shape[1] <= TUNING_TOKENS:
        return
    key = (q.device, *((x.shape[2:], x.dtype) for x in (q, k, v, g, beta)))
    if key in _tuned:
        return
    _tuned.add(key)
    short = [x[:, :TUNING_TOKENS].contiguous() for x in (q, k, v, g, beta)]
    one_document = torch.tensor([0, TUNING_TOKENS], dtype=torch.int32, device=q.device)
    with torch.no_grad():
        o, *residuals = _gated_delta_rule_fla(*short, one_document, scale)
        _gated_delta_rule_fla_backward(o, *residuals, short[4], one_document, scale)


def fake_output_and_residuals(q, k, v, g, beta) -> tuple[Tensor, ...]:
    """Empty o, q, q_rstd, k, k_rstd, v, g_cumsum, A as FLA's forward returns them: normalised
    q and k keep their dtypes, the norms and the cumulative decay are fp32, A takes k's."""
    return (
        v.new_empty(v.shape),
        q.new_empty(q.shape),
        q.new_empty(q.shape[:-1], dtype=torch.float32),
        k.new_empty(k.shape),
        k.new_empty(k.shape[:-1], dtype=torch.float32),
        v.new_empty(v.shape),
        g.new_empty(g.shape, dtype=torch.float32),
        k.new_empty((*beta.shape, CHUNK_SIZE)),
    )


def _gated_delta_rule_fla_backward(
    grad_o, q, q_rstd, k, k_rstd, v, g_cumsum, A, beta, cu_seqlens, scale
):
    """Gradients for q, k, v, g, beta from the forward's residuals, in their dtypes (dg fp32)."""
    fla = load_fla_kernels()
    cu_seqlens, chunk_indices = cached_documents_and_chunks()(cu_seqlens)
    with _on_device(q):
        dq, dk, dv, dbeta, dg, _, _, _ = fla.backward(
            q=q,
            k=k,
            v=v,
            g=g_cumsum,
            beta=beta.contiguous(),
            A=A,
            scale=scale,
            initial_state=None,
            do=grad_o.to(q.dtype).contiguous(),
            dht=None,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
            chunk_size=CHUNK_SIZE,
        )
        dq = fla.l2norm_bwd(q, q_rstd, dq)
        dk = fla.l2norm_bwd(k, k_rstd, dk)
    release_after_first_use("gated_delta_rule_fla_backward", q, v)
    grads = (dq, dk, dv, dg, dbeta)
    return tuple(grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g_cumsum, beta), strict=True))


def fake_input_grads(q, k, v, g_cumsum, beta) -> tuple[Tensor, ...]:
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g_cumsum, beta))


def register_autograd_with_residuals(forward_op, backward_op) -> None:
    """Make `forward_op(q, k, v, g, beta, *boundaries, *constants) -> (o, *residuals)`
    differentiable by `backward_op(grad_o, *residuals, beta, *boundaries, *constants)`, which
    returns the gradients of q, k, v, g and beta: the residuals, beta and the boundaries (the
    tensors after beta: cu_seqlens, ...) are saved, the constants kept, and the gradients given
    the inputs' dtypes."""

    def setup_context(ctx, inputs, output):
        q, k, v, g, beta, *after_beta = inputs
        boundaries = [x for x in after_beta if isinstance(x, Tensor)]
        residuals = output[1:]
        ctx.mark_non_differentiable(*residuals)
        ctx.save_for_backward(*residuals, beta, *boundaries)
        ctx.constants = after_beta[len(boundaries) :]
        ctx.not_differentiated = len(after_beta)
        ctx.input_dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)

    def backward(ctx, grad_o, *residual_grads):
        grads = backward_op(grad_o, *ctx.saved_tensors, *ctx.constants)
        grads = [grad.to(dtype) for grad, dtype in zip(grads, ctx.input_dtypes, strict=True)]
        return *grads, *[None] * ctx.not_differentiated  # none for boundaries, constants

    forward_op.register_autograd(backward, setup_context=setup_context)


def register_delta_rule_ops(name: str, forward: Callable, backward: Callable):
    """The custom ops `name` and `name`_backward of a delta-rule kernel pair: `forward(q, k, v,
    g, beta, cu_seqlens, scale)` -> (o, q, q_rstd, k, k_rstd, v, g_cumsum, A) in the layout of
    FLA's residuals, `backward(grad_o, *residuals, beta, cu_seqlens, scale)` -> (dq, dk, dv, dg,
    dbeta); with their fakes, and the forward differentiable through the backward."""
    forward_op = register_op(name, forward, f"({INPUTS}, float scale) -> {tensors(8)}")
    forward_op.register_fake(
        lambda q, k, v, g, beta, cu_seqlens, scale: fake_output_and_residuals(q, k, v, g, beta)
    )
    backward_schema = f"(Tensor grad_o, {RESIDUALS}, Tensor beta, Tensor cu_seqlens, float scale)"
    backward_op = register_op(f"{name}_backward", backward, f"{backward_schema} -> {tensors(5)}")
    backward_op.register_fake(
        lambda grad_o, q, q_rstd, k, k_rstd, v, g_cumsum, A, beta, cu_seqlens, scale: (
            fake_input_grads(q, k, v, g_cumsum, beta)
        )
    )
    register_autograd_with_residuals(forward_op, backward_op)
    return forward_op, backward_op


gated_delta_rule_fla, gated_delta_rule_fla_backward = register_delta_rule_ops(
    "gated_delta_rule_fla", _gated_delta_rule_fla, _gated_delta_rule_fla_backward
)


def _on_device(x: Tensor):
    # FLA's input guard does this: Triton launches on the current CUDA device.
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
