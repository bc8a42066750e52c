"""The CP head exchange on gloo processes: `to_heads` gives each rank all tokens of its head
groups, `to_tokens` inverts it, gradients flow back exactly, and each direction is one
all-to-all (DTensor's `_dtensor.shard_dim_alltoall`, the op GPUs run), forward and backward."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.conftest import OpCounter
from tests.distributed import run_on_ranks
from titan_gdn.placements.head_sharding import HeadSharding

GROUPS, SEQ_LEN, CHANNELS = 4, 8, 5
EXCHANGE = torch.ops._dtensor.shard_dim_alltoall.default


def _check_exchange(rank, world_size):
    sharding = HeadSharding(init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)))
    shard_len, local_groups = SEQ_LEN // world_size, GROUPS // world_size
    tokens = slice(rank * shard_len, (rank + 1) * shard_len)
    groups = slice(rank * local_groups, (rank + 1) * local_groups)
    for batch in (1, 2):
        full = torch.randn(batch, SEQ_LEN, GROUPS, CHANNELS, generator=_generator(batch))
        # A slice of a wider projection output, as a mixer sends: not contiguous.
        wide = torch.cat([full, torch.ones_like(full)], dim=-1)[:, tokens]
        shard = wide.clone().requires_grad_()
        with OpCounter() as forward:
            heads = sharding.to_heads(shard[..., :CHANNELS])
            back = sharding.to_tokens(heads * 2)
        assert torch.equal(heads, full[:, :, groups]), f"batch {batch}"
        assert torch.equal(back, 2 * full[:, tokens]), f"batch {batch}"

        weight = torch.randn_like(heads)
        with OpCounter() as backward:
            (weight * heads).sum().backward()
        # d/d(shard) of sum(w * to_heads(shard)): this rank's tokens of every rank's weights.
        every_rank = [torch.empty_like(weight) for _ in range(world_size)]
        torch.distributed.all_gather(every_rank, weight)
        expected = torch.cat(every_rank, dim=2)[:, tokens]
        assert torch.equal(shard.grad[..., :CHANNELS], expected), f"batch {batch}"
        assert not shard.grad[..., CHANNELS:].any()
        # One all-to-all per direction, and nothing gathered.
        assert forward.calls[EXCHANGE] == 2 and backward.calls[EXCHANGE] == 1
        assert (
            sum(n for op, n in (forward.calls + backward.calls).items() if "c10d" in str(op)) == 0
        )


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)  # the same tensors on every rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_heads_exchange_matches_slicing_and_inverts(world_size):
    run_on_ranks(world_size, _check_exchange)
