"""Where a mixer's heads live: all on this rank, or 1/N of them on each rank of a `cp` mesh.

A mixer computes per-token projections on its sequence shard (`Shard(seq)`), then asks for
its head groups over the whole sequence (`Shard(head)`): one redistribution of all its
components, packed per head group, so one group's q, k, v (and gates) always land together.
The mixer then runs over every token for the groups it owns and hands the result back to
`Shard(seq)`. Without context parallelism there is one rank and every step is the identity.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

SEQ_DIM, HEAD_DIM = 1, 2


class HeadSharding:
    def __init__(self, mesh: DeviceMesh | None = None):
        self.mesh = mesh
        self.degree = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()

    def to_heads(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """[B, T/N, G, c_i] per part -> [B, T, G/N, c_i]: all tokens, this rank's groups."""
        return self._redistribute(parts, Shard(SEQ_DIM), Shard(HEAD_DIM))

    def to_tokens(self, *parts: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `to_heads`."""
        return self._redistribute(parts, Shard(HEAD_DIM), Shard(SEQ_DIM))

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a per-head parameter laid out group-major along dim 0.

        A plain slice, not a redistribution: its gradient is zero outside the slice, so the
        gradient reduction over the cp ranks (FSDP's) adds the slices into the full gradient.
        """
        per_rank = param.shape[0] // self.degree
        return param.narrow(0, self.rank * per_rank, per_rank)

    def _redistribute(self, parts, source, target) -> list[torch.Tensor]:
        if self.mesh is None:
            return list(parts)
        widths = [p.shape[-1] for p in parts]
        # One collective for all parts: they share [B, T, G] and differ only in channels.
        packed = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        moved = (
            DTensor.from_local(packed, self.mesh, [source], run_check=False)
            .redistribute(self.mesh, [target])
            .to_local()
        )
        return list(moved.split(widths, dim=-1))


NO_SHARDING = HeadSharding()
