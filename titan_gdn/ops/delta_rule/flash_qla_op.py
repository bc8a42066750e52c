"""FlashQLA's chunked gated delta rule (TileLang kernels for Hopper and Blackwell) as two
custom ops, in the shape of `fla_op`: a forward that returns the residuals and a backward that
consumes them.

FlashQLA splits a long document into pieces that run side by side on one GPU (its "intra-card
context parallel", chosen per call from the documents' lengths): the delta rule of few long
documents is where FLA's recurrence has little parallelism. Its low-level forward and backward
take FLA's arguments and leave FLA's residuals (the chunk-local cumulative decay and the solved
WY matrix A, same shapes and dtypes), so the residuals, the fakes and the autograd formula are
`fla_op`'s; q and k are L2-normalised by FLA's kernels, as there.

Why not FlashQLA's autograd Function: an opaque op cannot keep a Python Function's saved state
(its per-call context object), and selective activation checkpointing must see an op whose
outputs it can keep. The forward passes ``is_train=True`` so that it decides the split as the
backward does (the backward always decides for training); the backward recomputes the split's
carried states instead of keeping FlashQLA's forward cache, which is a Python object.

FlashQLA compiles each kernel variant on first use (minutes: TileLang and nvcc) and keeps it
in ``TILELANG_CACHE_DIR`` (default ``~/.tilelang/cache``), so later processes load it. The
variants depend on the head counts and on whether the split is on, not on the document
lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from titan_gdn.boundaries import FLA_CHUNK_SIZE, cached_documents_and_chunks
from titan_gdn.ops.delta_rule.fla_op import _on_device, load_fla_kernels, register_delta_rule_ops

# What FlashQLA's kernels take: both head widths (its kernels are written for 128).
HEAD_DIM = 128


class FlashQlaKernels(NamedTuple):
    forward: Callable
    backward: Callable


@functools.cache
def load_flash_qla_kernels() -> FlashQlaKernels:
    # Imported on first use: flash_qla reads the GPU's compute capability at import.
    from flash_qla.ops.gated_delta_rule import chunk

    if chunk.CHUNK_SIZE != FLA_CHUNK_SIZE:  # its SM120 kernels use 32-token chunks
        raise ValueError(
            f"model.delta_rule_backend = 'flash_qla': FlashQLA uses {chunk.CHUNK_SIZE}-token "
            f"chunks on this GPU, the residuals here are laid out for {FLA_CHUNK_SIZE}; use 'fla'"
        )
    return FlashQlaKernels(chunk.chunk_gated_delta_rule_fwd, chunk.chunk_gated_delta_rule_bwd)


def head_width_problems(key_width: int, value_width: int) -> list[str]:
    """What FlashQLA cannot run at these GDN head widths: for the config check and the op."""
    if key_width == value_width == HEAD_DIM:
        return []
    return [
        f"model.delta_rule_backend = 'flash_qla' runs head widths of {HEAD_DIM} only; this "
        f"model's are {key_width} (keys) and {value_width} (values): use 'fla'"
    ]


def flash_qla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale: float | None) -> Tensor:
    """The gated delta rule on FlashQLA's kernels; same contract as `gated_delta_rule`."""
    if problems := head_width_problems(q.shape[-1], v.shape[-1]):
        raise ValueError(problems[0])
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return gated_delta_rule_flash_qla(q, k, v, g, beta, cu_seqlens, scale)[0]


def _gated_delta_rule_flash_qla(q, k, v, g, beta, cu_seqlens, scale):
    """o and the residuals (q, q_rstd, k, k_rstd, v, g_cumsum, A) that the backward takes."""
    fla, qla = load_fla_kernels(), load_flash_qla_kernels()
    # The non-empty documents only (FlashQLA refuses empty ones), the same tensor object for
    # every layer of the step: FlashQLA memoizes what it reads from it on the host by identity.
    cu_seqlens, _ = cached_documents_and_chunks()(cu_seqlens)
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    v_saved = v.clone(memory_format=torch.contiguous_format)  # a residual aliases no input
    with _on_device(q):
        q_unit, q_rstd = fla.l2norm_fwd(q)
        k_unit, k_rstd = fla.l2norm_fwd(k)
        # FlashQLA's order: q, k, v, g, beta, scale; no initial or final state.
        g_cumsum, A, o, _, _, _ = qla.forward(
            q_unit, k_unit, v_saved, g, beta, scale, cu_seqlens=cu_seqlens,
            output_final_state=False, is_train=True,
        )  # fmt: skip
    return o.to(v.dtype), q_unit, q_rstd, k_unit, k_rstd, v_saved, g_cumsum, A


def _gated_delta_rule_flash_qla_backward(
    grad_o, q, q_rstd, k, k_rstd, v, g_cumsum, A, beta, cu_seqlens, scale
):
    """Gradients for q, k, v, g, beta from the forward's residuals, in their dtypes (dg fp32)."""
    fla, qla = load_fla_kernels(), load_flash_qla_kernels()
    cu_seqlens, _ = cached_documents_and_chunks()(cu_seqlens)
    with _on_device(q):
        # FlashQLA's order: q, k, v, g, beta, A, do; no state in or out.
        do = grad_o.to(q.dtype).contiguous()
        dq, dk, dv, dbeta, dg, _ = qla.backward(
            q, k, v, g_cumsum, beta.contiguous(), A, do, scale=scale, cu_seqlens=cu_seqlens
        )
        dq = fla.l2norm_bwd(q, q_rstd, dq)
        dk = fla.l2norm_bwd(k, k_rstd, dk)
    grads = (dq, dk, dv, dg, dbeta)
    return tuple(grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g_cumsum, beta), strict=True))


gated_delta_rule_flash_qla, gated_delta_rule_flash_qla_backward = register_delta_rule_ops(
    "gated_delta_rule_flash_qla", _gated_delta_rule_flash_qla, _gated_delta_rule_flash_qla_backward
)
