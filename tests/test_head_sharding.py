"""The CP head exchange on 2 gloo processes: `to_heads` gives each rank all tokens of its head
groups, the parts asked for in buffers of their own; `to_tokens` inverts it; gradients flow
back exactly."""

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed import run_on_ranks
from titan_gdn.parallel import head_sharding
from titan_gdn.parallel.head_sharding import HeadSharding

GROUPS, SEQ_LEN = 4, 6
CHANNELS = (3, 5, 1, 2)  # e.g. q, v and two gates: parts of different widths
OWN_BUFFERS = 2


def _full_parts(batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    return [torch.randn(batch, SEQ_LEN, GROUPS, c, generator=gen) for c in CHANNELS]


def _check_exchange(rank, world_size):
    sharding = HeadSharding(init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)))
    shard_len, local_groups = SEQ_LEN // world_size, GROUPS // world_size
    tokens = slice(rank * shard_len, (rank + 1) * shard_len)
    groups = slice(rank * local_groups, (rank + 1) * local_groups)
    for batch in (1, 2):
        full = _full_parts(batch)
        shards = [p[:, tokens].clone().requires_grad_() for p in full]
        heads = sharding.to_heads(*shards, own_buffers=OWN_BUFFERS)
        for got, part in zip(heads, full, strict=True):
            assert torch.equal(got, part[:, :, groups]), f"batch {batch}"
        # Held alone, a part in its own buffer must not keep the others' memory alive.
        storages = [h.untyped_storage().data_ptr() for h in heads]
        own = storages[-OWN_BUFFERS:]
        assert len(set(own)) == OWN_BUFFERS and not set(own) & set(storages[:-OWN_BUFFERS])

        back = sharding.to_tokens(*heads)
        for got, shard in zip(back, shards, strict=True):
            assert torch.equal(got, shard)
        weights = [torch.randn_like(h) for h in heads]
        sum((w * h).sum() for w, h in zip(weights, heads, strict=True)).backward()
        # d/d(shard) of sum(w * to_heads(shard)): this rank's tokens of every rank's weights.
        for shard, w in zip(shards, weights, strict=True):
            every_rank = [torch.empty_like(w) for _ in range(world_size)]
            torch.distributed.all_gather(every_rank, w)
            expected = torch.cat(every_rank, dim=2)[:, tokens]
            assert torch.equal(shard.grad, expected), f"batch {batch}"


def test_heads_exchange_matches_slicing_and_inverts():
    run_on_ranks(2, _check_exchange)


def _check_contiguous_sends(rank, world_size):
    sent = []

    def recording_all_to_all(send, *args):
        sent.append(send.is_contiguous())
        return exchange(send, *args)

    exchange, head_sharding.all_to_all = head_sharding.all_to_all, recording_all_to_all
    sharding = HeadSharding(init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)))
    shards = [p[:, : SEQ_LEN // world_size].clone().requires_grad_() for p in _full_parts(1)]
    heads = sharding.to_heads(*shards, own_buffers=OWN_BUFFERS)
    # A consumer that reads the tokens' heads as a mixer's output does: the gradient reaching
    # the exchange is then laid out per token, not per destination rank.
    (tokens,) = sharding.to_tokens(torch.cat(heads, dim=-1))
    (tokens.flatten(2) * torch.randn_like(tokens.flatten(2))).sum().backward()
    assert sent == [True] * 4, sent


def test_exchange_sends_contiguous_buffers_in_forward_and_backward():
    """The op gets its send buffer laid out already, backward too: the layout copy is then
    code around the op, which a compiled model fuses with the work producing the buffer."""
    run_on_ranks(2, _check_contiguous_sends)
