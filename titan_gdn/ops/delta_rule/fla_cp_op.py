"""FLA's chunked gated delta rule with context parallel over sequence chunks (`fla.ops.cp`), as
two custom ops in the manner of `fla_op`: a forward that returns FLA's residuals and a backward
that consumes them.

Each rank of the group holds a contiguous chunk of every row. FLA's `build_cp_context` reads a
row's global boundaries and gives the chunk's own, with how many ranks before and after share
its first and last documents; `chunk_gated_delta_rule_fwd(..., cp_context=)` then summarises
the chunk's last document as [h_local | M] (h_out = M h_in + h_local), all-gathers the
summaries and chains those of the ranks before it into the state entering the chunk's first
document; its backward does the same for the state gradients, from the ranks after. The state
entering the chunk is a residual here (FLA's Function saves it too), so the backward needs no
exchange for it.

A row is one FLA context: with several rows per rank (local_batch_size > 1) each row runs on
its own, one exchange per row, the same on every rank. The contexts are built on the host from
the global boundaries (one sync) and memoized per boundaries tensor for every GDN layer of the
step. CUDA only: FLA's CP kernels require an NVIDIA GPU of compute capability 8.0 or more.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from titan_gdn.ops.custom_op import register_op
from titan_gdn.ops.delta_rule.fla_op import (
    CHUNK_SIZE,
    INPUTS,
    RESIDUALS,
    _on_device,
    fake_input_grads,
    fake_output_and_residuals,
    load_fla_kernels,
    register_autograd_with_residuals,
    tensors,
)
from titan_gdn.ops.local_memory import release_after_first_use

# The schemas' arguments after cu_seqlens: the rows of the chunk and the group they span.
CONSTANTS = "SymInt rows, str group_name, float scale"


def fla_gated_delta_rule_cp(q, k, v, g, beta, cu_seqlens, rows: int, group_name: str, scale=None):
    """The gated delta rule of this rank's chunk of `rows` rows ([1, rows * Tc, ...] inputs, as
    `gated_delta_rule`'s), the state carried in from the ranks before; `cu_seqlens` are the
    whole rows' fixed-capacity boundaries (`DocumentBoundaries.padded_cu_seqlens`)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return gated_delta_rule_fla_cp(q, k, v, g, beta, cu_seqlens, rows, group_name, scale)[0]


@functools.cache
def _context_memo():
    from fla.utils import tensor_cache

    return tensor_cache(lambda cu_seqlens: {})


def row_contexts(cu_seqlens: Tensor, rows: int, group_name: str) -> list:
    """FLA's CP context of each row, from the whole rows' boundaries [rows * T + 1]."""
    memo = _context_memo()(cu_seqlens)
    key = (rows, group_name)
    if key not in memo:
        from fla.ops.cp import build_cp_context

        group = dist.distributed_c10d._resolve_process_group(group_name)
        host = cu_seqlens.cpu().long()
        row_len = (host.numel() - 1) // rows
        contexts = []
        for row in range(rows):
            start, end = row * row_len, (row + 1) * row_len
            inside = host[(host >= start) & (host <= end)] - start
            bounds = inside.unique_consecutive()
            contexts.append(
                build_cp_context(
                    bounds.to(cu_seqlens.device), group, cu_seqlens_cpu=bounds, layout="contiguous"
                )
            )
        memo[key] = contexts
    return memo[key]


def _chunk_indices(context) -> Tensor:
    from fla.ops.utils.index import prepare_chunk_indices

    return prepare_chunk_indices(
        context.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=context.cu_seqlens_cpu
    )


def _per_row(x: Tensor, rows: int) -> list[Tensor]:
    return list(x.chunk(rows, dim=1))


def _gated_delta_rule_fla_cp(q, k, v, g, beta, cu_seqlens, rows, group_name, scale):
    """o, the residuals of `fla_op.gated_delta_rule_fla` and the states entering each row's
    chunk [rows, Hv, Dk, Dv] (fp32)."""
    fla = load_fla_kernels()
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    contexts = row_contexts(cu_seqlens, rows, group_name)
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    v_saved = v.clone(memory_format=torch.contiguous_format)  # a residual must not alias v
    outputs, cumsums, solved, entering = [], [], [], []
    with _on_device(q):
        q_unit, q_rstd = fla.l2norm_fwd(q)
        k_unit, k_rstd = fla.l2norm_fwd(k)
        parts = zip(*(_per_row(x, rows) for x in (q_unit, k_unit, v_saved, g, beta)), strict=True)
        for context, (q_row, k_row, v_row, g_row, beta_row) in zip(contexts, parts, strict=True):
            g_cumsum, o, A, _, h0, _ = chunk_gated_delta_rule_fwd(
                q=q_row,
                k=k_row,
                v=v_row,
                g=g_row,
                beta=beta_row,
                scale=scale,
                initial_state=None,
                output_final_state=False,
                cu_seqlens=context.cu_seqlens,
                cp_context=context,
                chunk_indices=_chunk_indices(context),
                chunk_size=CHUNK_SIZE,
            )
            outputs.append(o)
            cumsums.append(g_cumsum)
            solved.append(A)
            entering.append(h0[:1])
    release_after_first_use("gated_delta_rule_fla_cp", q, v)
    o = torch.cat(outputs, dim=1).to(q.dtype).to(v.dtype)
    return (
        o,
        q_unit,
        q_rstd,
        k_unit,
        k_rstd,
        v_saved,
        torch.cat(cumsums, dim=1),
        torch.cat(solved, dim=1),
        torch.cat(entering),
    )


gated_delta_rule_fla_cp = register_op(
    "gated_delta_rule_fla_cp", _gated_delta_rule_fla_cp, f"({INPUTS}, {CONSTANTS}) -> {tensors(9)}"
)


@gated_delta_rule_fla_cp.register_fake
def _(q, k, v, g, beta, cu_seqlens, rows, group_name, scale):
    value_heads, key_dim, value_dim = v.shape[2], k.shape[3], v.shape[3]
    entering = v.new_empty((rows, value_heads, key_dim, value_dim), dtype=torch.float32)
    return (*fake_output_and_residuals(q, k, v, g, beta), entering)


def _gated_delta_rule_fla_cp_backward(
    grad_o,
    q,
    q_rstd,
    k,
    k_rstd,
    v,
    g_cumsum,
    A,
    entering,
    beta,
    cu_seqlens,
    rows,
    group_name,
    scale,
):
    """Gradients for q, k, v, g, beta; the state gradients cross ranks inside FLA's backward."""
    fla = load_fla_kernels()
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    contexts = row_contexts(cu_seqlens, rows, group_name)
    grad_o = grad_o.to(q.dtype).contiguous()
    grads = []
    with _on_device(q):
        parts = zip(
            *(_per_row(x, rows) for x in (q, k, v, g_cumsum, beta.contiguous(), A, grad_o)),
            strict=True,
        )
        for row, (context, part) in enumerate(zip(contexts, parts, strict=True)):
            q_row, k_row, v_row, g_row, beta_row, A_row, do_row = part
            dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
                q=q_row,
                k=k_row,
                v=v_row,
                g=g_row,
                beta=beta_row,
                A=A_row,
                scale=scale,
                initial_state=entering[row : row + 1],
                do=do_row,
                dht=None,
                cu_seqlens=context.cu_seqlens,
                cp_context=context,
                chunk_indices=_chunk_indices(context),
                chunk_size=CHUNK_SIZE,
            )
            grads.append((dq, dk, dv, dg, dbeta))
        dq, dk, dv, dg, dbeta = (torch.cat(parts, dim=1) for parts in zip(*grads, strict=True))
        dq = fla.l2norm_bwd(q, q_rstd, dq)
        dk = fla.l2norm_bwd(k, k_rstd, dk)
    release_after_first_use("gated_delta_rule_fla_cp_backward", q, v)
    inputs = (q, k, v, g_cumsum, beta)
    return tuple(grad.to(x.dtype) for grad, x in zip((dq, dk, dv, dg, dbeta), inputs, strict=True))


gated_delta_rule_fla_cp_backward = register_op(
    "gated_delta_rule_fla_cp_backward",
    _gated_delta_rule_fla_cp_backward,
    f"(Tensor grad_o, {RESIDUALS}, Tensor entering, Tensor beta, Tensor cu_seqlens, "
    f"{CONSTANTS}) -> {tensors(5)}",
)


@gated_delta_rule_fla_cp_backward.register_fake
def _(grad_o, q, q_rstd, k, k_rstd, v, g_cumsum, A, entering, beta, cu_seqlens, rows, group, scale):
    return fake_input_grads(q, k, v, g_cumsum, beta)


register_autograd_with_residuals(gated_delta_rule_fla_cp, gated_delta_rule_fla_cp_backward)
