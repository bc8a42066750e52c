"""The differentiable collectives of context parallel over sequence chunks (the `states`
dimension): an all-gather and a shift to the next rank, as opaque custom ops.

Opaque ops for the reason `head_sharding.all_to_all` is one: compiled activation
checkpointing recomputes them like any other op (a functional collective's output escapes the
recompute tags), and selective checkpointing can name them. A process group is passed by name,
as functional collectives do. Their backward is the adjoint collective: a reduce-scatter for
the all-gather, the shift the other way for the shift.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_gdn.ops.custom_op import OUTSIDE_CUDA_GRAPHS

# torch 2.13 renamed reduce_scatter_tensor (deprecated there); 2.11 has only the old name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _group(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


@torch.library.custom_op("titan_gdn::all_gather", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """[N, *x.shape]: every rank's `x`, in rank order."""
    group = _group(group_name)
    # gloo gathers into dim 0 of the output, so the ranks' tensors are concatenated there.
    x = x.contiguous()[None]
    gathered = x.new_empty(group.size(), *x.shape[1:])
    dist.all_gather_into_tensor(gathered, x, group=group)
    return gathered


@all_gather.register_fake
def _(x, group_name):
    return x.new_empty(_group(group_name).size(), *x.shape)


def _all_gather_backward(ctx, grad):
    # Rank i's x reached every rank: its gradient is the sum of every rank's slice i.
    return reduce_scatter(grad.contiguous(), ctx.group_name)[0], None


all_gather.register_autograd(
    _all_gather_backward, setup_context=lambda ctx, inputs, output: _keep_group(ctx, inputs)
)


@torch.library.custom_op("titan_gdn::reduce_scatter", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def reduce_scatter(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over ranks of slice `rank` of `x` (dim 0 cut into N equal slices)."""
    group = _group(group_name)
    out = x.new_empty(x.shape[0] // group.size(), *x.shape[1:])
    _reduce_scatter(out, x.contiguous(), group=group)
    return out


@reduce_scatter.register_fake
def _(x, group_name):
    return x.new_empty(x.shape[0] // _group(group_name).size(), *x.shape[1:])


def _reduce_scatter_backward(ctx, grad):
    return all_gather(grad, ctx.group_name).flatten(0, 1), None


reduce_scatter.register_autograd(
    _reduce_scatter_backward, setup_context=lambda ctx, inputs, output: _keep_group(ctx, inputs)
)


@torch.library.custom_op("titan_gdn::from_previous_rank", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def from_previous_rank(x: torch.Tensor, group_name: str, step: int) -> torch.Tensor:
    """The `x` of rank `rank - step` (zeros where there is none): step 1 hands each rank's
    tail to the next rank, step -1 to the previous one.

    An all-gather of `x`, as FLA's conv exchange (`fla.ops.cp.comm.send_recv_fwd`) does: the
    tensors are a few tokens, and a collective keeps every rank in step without pairing sends
    with receives."""
    group = _group(group_name)
    rank, size = group.rank(), group.size()
    gathered = x.new_empty(size, *x.shape)
    dist.all_gather_into_tensor(gathered, x.contiguous()[None], group=group)
    source = rank - step
    if not 0 <= source < size:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    return gathered[source].clone()


@from_previous_rank.register_fake
def _(x, group_name, step):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _from_previous_rank_backward(ctx, grad):
    return from_previous_rank(grad, ctx.group_name, -ctx.step), None, None


def _keep_group(ctx, inputs):
    ctx.group_name = inputs[1]
    ctx.step = inputs[2] if len(inputs) > 2 else None


from_previous_rank.register_autograd(
    _from_previous_rank_backward, setup_context=lambda ctx, inputs, output: _keep_group(ctx, inputs)
)
