"""Where a mixer's heads live: all on this rank, or 1/N of them on each rank of a `cp` mesh.

A mixer computes per-token projections on its sequence shard (placement `Shard(seq)` on the
`cp` mesh dimension), then asks for its head groups over the whole sequence (`Shard(head)`):
one all-to-all for all its components, packed per head group, so one group's q, k, v (and
gates) always land together. The mixer then runs over every token for the groups it owns and
hands the result back to `Shard(seq)`. Without context parallelism there is one rank and every
step is the identity.

The exchange is one `all_to_all_single` on a buffer laid out destination-rank first, not
DTensor's `redistribute(Shard(seq) -> Shard(head))`: that one copies each rank's slice out,
receives into separate tensors and concatenates them, so four buffers of the mixer's whole
input are alive at once (9 GiB each for a 0.8B GDN layer at 1.5M tokens over cp=2). Here the
packing copy is the only copy of the whole input towards heads (reading the result needs
none, with one row per rank; the small parts asked for in buffers of their own are copied),
and one layout copy on the way back.

The all-to-all is an opaque custom op (`titan_gdn::all_to_all`), not a functional collective:
under compiled activation checkpointing, torch 2.11's partitioner must save the output of a
functional collective's `wait_tensor` (it escapes the checkpoint's recompute tags), so every
layer's head-sharded inputs stayed alive until backward: at cp=2 a 0.8B model used more
memory per GPU than at cp=1 on the same length. An opaque op is recomputed like any other,
and selective checkpointing can name it to keep it.

A part can come back in a buffer of its own (`own_buffers`) because a view of a small part
keeps the whole received buffer: the GDN gates' inputs (a, b: 2 of 386 channels a head group)
are read again by the gate backward, which inductor fuses with reading them straight from
the received buffer, after the delta-rule backward; so at the peak of a layer's backward the
mixer's whole input was held twice (9 GiB of a 0.8B layer at 1.5M tokens, cp=2). Copying
every part out instead would hold three buffers of that size at once, in the op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh


class HeadSharding:
    def __init__(self, mesh: DeviceMesh | None = None):
        self.mesh = mesh
        self.degree = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()

    def to_heads(self, *parts: torch.Tensor, own_buffers: int = 0) -> list[torch.Tensor]:
        """[B, T/N, G, c_i] per part -> [B, T, G/N, c_i]: all tokens, this rank's groups.

        The last `own_buffers` parts come in buffers of their own; the others are views of
        the received buffer, which lives as long as any of them is held.
        """
        if self.mesh is None:
            return list(parts)
        n = self.degree
        batch, shard_len, groups, _ = parts[0].shape
        # [N destination ranks, B, T/N, G/N, sum c_i]: packing the parts is the one copy.
        send = torch.cat([p.unflatten(2, (n, groups // n)).movedim(2, 0) for p in parts], -1)
        sizes = [p.shape[-1] for p in parts]
        viewed = len(parts) - own_buffers
        # [N source ranks = sequence shards, B, T/N, G/N, c]: read in place when B == 1.
        received, *copies = self._all_to_all(send, sizes[viewed:])
        shape = (batch, n * shard_len, groups // n, -1)
        # Narrowed before it is split: the gradient of the channels not read is then a pad,
        # computed with the rest, not zeros that inductor writes into the whole gradient
        # buffer at the start of backward (holding it through the delta-rule backward).
        viewed_channels = received[..., : sum(sizes[:viewed])]
        views = viewed_channels.movedim(0, 1).reshape(shape).split(sizes[:viewed], dim=-1)
        return [*views, *(c.movedim(0, 1).reshape(shape) for c in copies)]

    def to_tokens(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `to_heads`."""
        if self.mesh is None:
            return list(parts)
        n = self.degree
        batch, seq_len, local_groups, _ = parts[0].shape
        packed = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        # [N destination ranks = sequence shards, B, T/N, G/N, c]: a view when B == 1.
        send = packed.unflatten(1, (n, seq_len // n)).movedim(1, 0).contiguous()
        (received,) = self._all_to_all(send, [])  # [N source ranks = head groups, ...]
        heads = received.movedim(0, 2).reshape(batch, seq_len // n, n * local_groups, -1)
        return list(heads.split([p.shape[-1] for p in parts], dim=-1))

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-head parameter laid out group-major along dim 0.

        A plain slice, not a redistribution: its gradient is zero outside the slice, so the
        gradient reduction over the cp ranks (FSDP's) adds the slices into the full gradient.
        """
        per_rank = param.shape[0] // self.degree
        return param.narrow(0, self.rank * per_rank, per_rank)

    def _all_to_all(self, send: torch.Tensor, tail_sizes: list[int]) -> list[torch.Tensor]:
        return all_to_all(send, self.mesh.get_group().group_name, tail_sizes)


@torch.library.custom_op("titan_gdn::all_to_all", mutates_args=())
def all_to_all(send: torch.Tensor, group_name: str, tail_sizes: list[int]) -> list[torch.Tensor]:
    """Equal slices of dim 0, slice i to rank i of the group: the received buffer, then copies
    of its last channels split into `tail_sizes`. Its own inverse (with no tail)."""
    received = torch.empty_like(send, memory_format=torch.contiguous_format)
    # A process group cannot be an op argument; its name can (as functional collectives do).
    group = dist.distributed_c10d._resolve_process_group(group_name)
    dist.all_to_all_single(received, send.contiguous(), group=group)
    tail = received[..., received.shape[-1] - sum(tail_sizes) :]
    return [received, *(t.contiguous() for t in tail.split(tail_sizes, dim=-1))]


@all_to_all.register_fake
def _(send, group_name, tail_sizes):
    shape = send.shape[:-1]
    received = torch.empty_like(send, memory_format=torch.contiguous_format)
    return [received, *(send.new_empty((*shape, size)) for size in tail_sizes)]


def _setup_context(ctx, inputs, output):
    ctx.group_name, ctx.tail_sizes = inputs[1:]


def _backward(ctx, grads):
    grad, *tail_grads = grads
    if tail_grads:
        tail = torch.cat(tail_grads, dim=-1)
        grad = grad + F.pad(tail, (grad.shape[-1] - tail.shape[-1], 0))
    # Contiguous here, in the traced backward, not inside the opaque op: compiled, the layout
    # copy fuses into the kernel that produces the gradient (a GDN mixer's gated norm backward).
    (grad_send,) = all_to_all(grad.contiguous(), ctx.group_name, [])
    # Gradients mirror the inputs' structure, where an empty list is a container, not a leaf.
    return grad_send, None, None if ctx.tail_sizes else []


all_to_all.register_autograd(_backward, setup_context=_setup_context)


NO_SHARDING = HeadSharding()
