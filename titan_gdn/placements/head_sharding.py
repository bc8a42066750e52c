"""Where a mixer's heads live: all on this rank, or 1/N of them on each rank of a `cp` mesh.

A mixer computes per-token projections on its sequence shard, laid out [B, T/N, G, C]: G head
groups of C channels each, every channel a group's mixing reads contiguous in its group (one
group-major GEMM: see the layers). On the `cp` mesh that is placement `Shard(1)`; `to_heads`
redistributes it to `Shard(2)`, so that the rank holds every token of G/N groups, and the
mixer's kernels run on that local tensor. `to_tokens` brings the mixer's output back to
`Shard(1)`. Each is one DTensor `redistribute`, one all-to-all, forward and backward; without
context parallelism there is one rank and both are the identity. A second CP mode can sit
beside this one by offering the same three methods.

What the redistribution runs (read in torch 2.11's and 2.13's source; run on both, CPU):
`Shard(1) -> Shard(2)` on one mesh dim is `torch.ops._dtensor.shard_dim_alltoall`, one op with
no separate `wait_tensor` (so selective checkpointing tags it like any op and
`OPS_TO_SAVE` names it), which compiles fullgraph. On CPU meshes torch instead gathers the
whole tensor and keeps a chunk; `titan_gdn.cpu.exchange_shards_by_all_to_all` makes CPU runs
use the op too. Peak memory of a whole cp=2 step (the debug model, 4096 tokens a row, B=1,
torch 2.13 on CPU: the least over 3 steps), against a custom all-to-all op
(`titan_gdn::all_to_all`), DTensor / op in MiB:

| compiled | AC none | AC selective op | AC full |
|---|---|---|---|
| no | 508.1 / 508.1 | 404.5 / 404.5 | 300.6 / 320.7 |
| yes (`aot_eager`) | 446.0 / 442.0 | 355.7 / 359.7 | 299.3 / 326.7 |

DTensor is within 3% of the op or below it at B=1 and B=2 in every mode, so the op is gone.
B=2, how much identical steps vary, the exchange on its own: docs/design.md.

Per-head parameters (`local`) stay plain slices of the unsharded parameter. As DTensors on
the `cp` mesh they cannot be FSDP2 parameters over the flattened dp_shard x cp mesh
(`fully_shard` raises "Cannot concatenate overlapping meshes", torch 2.11 and 2.13), and a
slice derived by redistributing the unsharded parameter (`Replicate() -> Shard(0)`) gets an
all-gathered, full gradient on every cp rank in backward, which FSDP's sum over the cp ranks
would count N times.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from titan_gdn.cpu import exchange_shards_by_all_to_all

SEQUENCE, GROUPS = Shard(1), Shard(2)


class HeadSharding:
    def __init__(self, mesh: DeviceMesh | None = None):
        self.mesh = mesh
        self.degree = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()
        if mesh is not None and mesh.device_type == "cpu":
            exchange_shards_by_all_to_all()

    def to_heads(self, groups: torch.Tensor) -> torch.Tensor:
        """[B, T/N, G, C], this rank's tokens -> [B, T, G/N, C]: all tokens, its groups."""
        return self._redistribute(groups, SEQUENCE, GROUPS)

    def to_tokens(self, groups: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_heads`."""
        return self._redistribute(groups, GROUPS, SEQUENCE)

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-head parameter laid out group-major along dim 0.

        A plain slice, not a redistribution: its gradient is zero outside the slice, so the
        gradient reduction over the cp ranks (FSDP's) adds the slices into the full gradient.
        """
        per_rank = param.shape[0] // self.degree
        return param.narrow(0, self.rank * per_rank, per_rank)

    def _redistribute(self, local: torch.Tensor, source: Shard, target: Shard) -> torch.Tensor:
        if self.mesh is None:
            return local
        # Every rank's shard has the same shape (seq_len and the groups divide by N): no check.
        placed = DTensor.from_local(local, self.mesh, [source], run_check=False)
        return placed.redistribute(self.mesh, [target]).to_local()


NO_SHARDING = HeadSharding()
