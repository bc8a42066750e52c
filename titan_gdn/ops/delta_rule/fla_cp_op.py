"""FLA's chunked gated delta rule with context parallel over sequence chunks (`fla.ops.cp`), as
two custom ops in the manner of `fla_op`: a forward that returns FLA's residuals and a backward
that consumes them.

Each rank of the group holds a contiguous chunk of every row. FLA's CP context of a row holds
the chunk's own boundaries, with how many ranks before and after share its first and last
documents: both come from `ChunkBoundaries` (its `padded_cu_seqlens` and `shared_chunks`,
built once per forward); `chunk_gated_delta_rule_fwd(..., cp_context=)` then summarises
the chunk's last document as [h_local | M] (h_out = M h_in + h_local), all-gathers the
summaries and chains those of the ranks before it into the state entering the chunk's first
document; its backward does the same for the state gradients, from the ranks after. The state
entering the chunk is a residual here (FLA's Function saves it too), so the backward needs no
exchange for it.

A row is one FLA context: with several rows per rank (local_batch_size > 1) each row runs on
its own, one exchange per row, the same on every rank. The contexts are built on the host from
one copy of the chunk's boundaries (one sync) and memoized per boundaries tensor for every GDN
layer of the step. CUDA only: FLA's CP kernels require an NVIDIA GPU of compute capability 8.0
or more.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from titan_gdn.boundaries import ChunkBoundaries
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

# The schemas' arguments after cu_seqlens (the chunk's, `ChunkBoundaries.padded_cu_seqlens`):
# the chunks its rows' first and last documents share (`ChunkBoundaries.shared_chunks`, one row
# each) and the group the chunks span.
CHUNK_ARGUMENTS = "Tensor shared_chunks, str group_name, float scale"


def fla_gated_delta_rule_cp(q, k, v, g, beta, chunk: ChunkBoundaries, group_name: str, scale=None):
    """The gated delta rule of this rank's chunk of every row ([1, rows * Tc, ...] inputs, as
    `gated_delta_rule`'s), the state carried in from the ranks before; `chunk` holds the
    chunk's boundaries (`DocumentBoundaries.chunk`)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return gated_delta_rule_fla_cp(
        q, k, v, g, beta, chunk.padded_cu_seqlens, chunk.shared_chunks, group_name, scale
    )[0]


@functools.cache
def _context_memo():
    from fla.utils import tensor_cache

    return tensor_cache(lambda cu_seqlens, shared_chunks: {})


def row_contexts(cu_seqlens: Tensor, shared_chunks: Tensor, group_name: str) -> list:
    """`cp_contexts`, memoized per boundaries tensor: every GDN layer of the step, forward and
    backward, gets the same chunk boundaries."""
    memo = _context_memo()(cu_seqlens, shared_chunks)
    if group_name not in memo:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        memo[group_name] = cp_contexts(cu_seqlens, shared_chunks, group)
    return memo[group_name]


def cp_contexts(cu_seqlens: Tensor, shared_chunks: Tensor, group) -> list:
    """FLA's CP context (`FLACPContext`) of each row of the chunk whose boundaries are
    `cu_seqlens` and `shared_chunks` (`ChunkBoundaries`): the chunk's documents in the row, and
    how many ranks before and after share its first and last (`pre_num_ranks`,
    `post_num_ranks`)."""
    from fla.ops.cp.context import FLACPContext

    rows = shared_chunks.shape[0]
    # Both on the host in one copy: the step's one sync for these contexts.
    host = torch.cat([cu_seqlens, shared_chunks.flatten().to(cu_seqlens.dtype)]).cpu().long()
    bounds, shared = host[: cu_seqlens.numel()], host[cu_seqlens.numel() :].view(rows, 2)
    row_len = (bounds.numel() - 1) // rows
    contexts = []
    for row, (before, after) in enumerate(shared.tolist()):
        start, end = row * row_len, (row + 1) * row_len
        inside = bounds[(bounds >= start) & (bounds <= end)] - start
        local = inside.unique_consecutive().to(torch.int32)  # the padding's repeats dropped
        context = FLACPContext(
            group=group,
            cu_seqlens=local.to(cu_seqlens.device, non_blocking=True),
            cu_seqlens_cpu=local,
            pre_num_ranks=before,
            is_first_rank=before == 0,
            post_num_ranks=after,
            is_last_rank=after == 0,
        )
        contexts.append(context)
    return contexts


def _row_arguments(context, q, k, v, g, beta) -> dict:
    """What FLA's chunked forward and backward both take for one row's inputs and context."""
    from fla.ops.utils.index import prepare_chunk_indices

    chunk_indices = prepare_chunk_indices(
        context.cu_seqlens, CHUNK_SIZE, cu_seqlens_cpu=context.cu_seqlens_cpu
    )
    return dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        cu_seqlens=context.cu_seqlens,
        cp_context=context,
        chunk_indices=chunk_indices,
        chunk_size=CHUNK_SIZE,
    )


def _per_row(x: Tensor, rows: int) -> list[Tensor]:
    return list(x.chunk(rows, dim=1))


def _gated_delta_rule_fla_cp(q, k, v, g, beta, cu_seqlens, shared_chunks, group_name, scale):
    """o, the residuals of `fla_op.gated_delta_rule_fla` and the states entering each row's
    chunk [rows, Hv, Dk, Dv] (fp32)."""
    fla = load_fla_kernels()
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    contexts = row_contexts(cu_seqlens, shared_chunks, group_name)
    rows = len(contexts)
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    v_saved = v.clone(memory_format=torch.contiguous_format)  # a residual must not alias v
    outputs, cumsums, solved, entering = [], [], [], []
    with _on_device(q):
        q_unit, q_rstd = fla.l2norm_fwd(q)
        k_unit, k_rstd = fla.l2norm_fwd(k)
        parts = zip(*(_per_row(x, rows) for x in (q_unit, k_unit, v_saved, g, beta)), strict=True)
        for context, row_inputs in zip(contexts, parts, strict=True):
            g_cumsum, o, A, _, h0, _ = chunk_gated_delta_rule_fwd(
                **_row_arguments(context, *row_inputs),
                scale=scale,
                initial_state=None,
                output_final_state=False,
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
    "gated_delta_rule_fla_cp",
    _gated_delta_rule_fla_cp,
    f"({INPUTS}, {CHUNK_ARGUMENTS}) -> {tensors(9)}",
)


@gated_delta_rule_fla_cp.register_fake
def _(q, k, v, g, beta, cu_seqlens, shared_chunks, group_name, scale):
    rows = shared_chunks.shape[0]
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
    shared_chunks,
    group_name,
    scale,
):
    """Gradients for q, k, v, g, beta; the state gradients cross ranks inside FLA's backward."""
    fla = load_fla_kernels()
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd

    contexts = row_contexts(cu_seqlens, shared_chunks, group_name)
    rows = len(contexts)
    grad_o = grad_o.to(q.dtype).contiguous()
    grads = []
    with _on_device(q):
        parts = zip(
            *(_per_row(x, rows) for x in (q, k, v, g_cumsum, beta.contiguous(), A, grad_o)),
            strict=True,
        )
        for row, (context, part) in enumerate(zip(contexts, parts, strict=True)):
            *row_inputs, A_row, do_row = part
            dq, dk, dv, dbeta, dg, _, _, _ = chunk_gated_delta_rule_bwd(
                **_row_arguments(context, *row_inputs),
                A=A_row,
                scale=scale,
                initial_state=entering[row : row + 1],
                do=do_row,
                dht=None,
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
    f"{CHUNK_ARGUMENTS}) -> {tensors(5)}",
)


@gated_delta_rule_fla_cp_backward.register_fake
def _(
    grad_o, q, q_rstd, k, k_rstd, v, g_cumsum, A, entering, beta, cu_seqlens, shared, group, scale
):
    return fake_input_grads(q, k, v, g_cumsum, beta)


register_autograd_with_residuals(gated_delta_rule_fla_cp, gated_delta_rule_fla_cp_backward)
