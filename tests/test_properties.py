"""Property-based checks of the boundary computation and the context-parallel sharding maps."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.parallel.context_parallel import shard_sequence
from titan_gdn.placements.head_sharding import HeadSharding

EOS = 0


class _Mesh:
    """What the sharding maps read of a DeviceMesh, for one rank of a cp group."""

    device_type = "meta"  # neither CPU nor a GPU: no collective is set up

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


@st.composite
def packed_rows(draw):
    rows = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 96))
    tokens = draw(
        st.lists(st.lists(st.sampled_from([EOS, 1, 2, 3]), min_size=seq_len, max_size=seq_len),
                 min_size=rows, max_size=rows)
    )  # fmt: skip
    return torch.tensor(tokens)


@settings(max_examples=200, deadline=None)
@given(packed_rows())
def test_boundaries_follow_eos_and_row_ends(tokens):
    rows, seq_len = tokens.shape
    docs = DocumentBoundaries.from_tokens(tokens, EOS)
    flat = tokens.flatten()
    cu = docs.cu_seqlens.long()
    # A document starts at a row start or right after an EOS, nowhere else.
    index = torch.arange(flat.numel())
    starts = (index % seq_len == 0) | torch.cat([torch.tensor([True]), flat[:-1] == EOS])
    assert cu.tolist() == index[starts].tolist() + [flat.numel()]
    assert (cu[1:] > cu[:-1]).all() and docs.num_documents == cu.numel() - 1
    # The fixed-capacity form: one entry per token plus one, the end repeated.
    padded = docs.padded_cu_seqlens.long()
    assert padded.numel() == flat.numel() + 1
    assert padded[: cu.numel()].tolist() == cu.tolist()
    assert (padded[cu.numel() :] == flat.numel()).all()
    # Every token's document and position agree with the boundaries.
    document = torch.searchsorted(cu, index, right=True) - 1
    assert docs.document_ids.flatten().tolist() == document.tolist()
    assert docs.position_ids.flatten().tolist() == (index - cu[document]).tolist()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 12), st.integers(1, 3))
def test_sequence_shards_own_every_token_exactly_once(degree, per_rank, rows):
    tokens = torch.arange(rows * degree * per_rank).view(rows, degree * per_rank)
    shards = [shard_sequence(tokens, _Mesh(degree, rank)) for rank in range(degree)]
    assert all(s.shape == (rows, per_rank) for s in shards)
    assert torch.equal(torch.cat(shards, dim=1), tokens)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 4))
def test_head_slices_partition_every_per_head_parameter(degree, groups_per_rank, width):
    param = torch.randn(degree * groups_per_rank * width, 3)
    slices = [HeadSharding(_Mesh(degree, rank)).local(param) for rank in range(degree)]
    assert torch.equal(torch.cat(slices), param)
    # Without a cp mesh the maps are identities.
    unsharded = HeadSharding()
    assert torch.equal(unsharded.local(param), param)
    groups = torch.randn(2, 5, 4, 3)
    assert unsharded.to_heads(groups) is groups and unsharded.to_tokens(groups) is groups
