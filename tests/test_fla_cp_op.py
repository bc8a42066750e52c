"""FLA's context parallel contexts from a chunk's boundaries (`ChunkBoundaries`), on CPU: each
row's documents in the chunk and how many ranks before and after share its first and last,
against FLA's own derivation from the row's whole boundaries (`get_cp_cu_seqlens`, what
`fla.ops.cp.build_cp_context` calls). The kernels need a GPU: tests/gpu/test_state_passing_gpu.py.
"""

import pytest
import torch
from fla.ops.cp.context import get_cp_cu_seqlens
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.ops.delta_rule import fla_cp_op

EOS, SEQ_LEN = 0, 48
# What FLA's delta rule reads of a context besides its boundaries.
RANK_FIELDS = ("pre_num_ranks", "is_first_rank", "post_num_ranks", "is_last_rank")


def _rows(seed: int) -> torch.Tensor:
    """Three packed rows of input tokens [3, SEQ_LEN]: random documents; one document across
    every chunk boundary of row 1; 1-token documents on both sides of row 2's chunk
    boundaries."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (3, SEQ_LEN), generator=generator)
    tokens[0, torch.rand(SEQ_LEN, generator=generator) < 0.15] = EOS
    tokens[1, 2] = EOS
    tokens[2, 5::6] = EOS
    tokens[2, 6::6] = EOS
    return tokens


def _row_bounds(row: torch.Tensor) -> torch.Tensor:
    """A row's document boundaries read off its tokens: a document ends after each EOS and at
    the row's end."""
    ends = [i + 1 for i, token in enumerate(row[:-1].tolist()) if token == EOS]
    return torch.tensor(sorted({0, *ends, SEQ_LEN}))


@pytest.mark.parametrize("degree", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_rows_context_is_flas_own_from_the_whole_row(degree, seed):
    tokens = _rows(seed)
    docs = DocumentBoundaries.from_tokens(tokens, EOS)
    size = SEQ_LEN // degree
    for rank in range(degree):
        chunk = docs.for_chunk(rank * size, (rank + 1) * size, halo=3).chunk
        contexts = fla_cp_op.cp_contexts(chunk.padded_cu_seqlens, chunk.shared_chunks, None)
        assert len(contexts) == tokens.shape[0]
        for row, context in enumerate(contexts):
            bounds = _row_bounds(tokens[row])
            expected = get_cp_cu_seqlens.__wrapped__(bounds, bounds, world_size=degree, rank=rank)
            where = f"row {row}, rank {rank} of {degree}"
            assert context.cu_seqlens_cpu.tolist() == expected.cu_seqlens_cpu.tolist(), where
            assert context.cu_seqlens.dtype == expected.cu_seqlens.dtype == torch.int32
            assert torch.equal(context.cu_seqlens, expected.cu_seqlens), where
            for field in RANK_FIELDS:
                assert getattr(context, field) == getattr(expected, field), (where, field)


def test_the_ops_shapes_follow_the_chunks_rows():
    rows, tokens, key_heads, value_heads, key_dim, value_dim = 2, 16, 2, 4, 8, 6
    with FakeTensorMode():
        q, k = (torch.empty(1, rows * tokens, key_heads, key_dim) for _ in range(2))
        v = torch.empty(1, rows * tokens, value_heads, value_dim)
        g, beta = (torch.empty(1, rows * tokens, value_heads) for _ in range(2))
        cu_seqlens = torch.zeros(rows * tokens + 1, dtype=torch.int32)
        shared = torch.zeros(rows, 2, dtype=torch.int32)
        o, *residuals, entering = torch.ops.titan_gdn.gated_delta_rule_fla_cp(
            q, k, v, g, beta, cu_seqlens, shared, "group", 0.5
        )
        assert o.shape == v.shape
        assert entering.shape == (rows, value_heads, key_dim, value_dim)
        grads = torch.ops.titan_gdn.gated_delta_rule_fla_cp_backward(
            o, *residuals, entering, beta, cu_seqlens, shared, "group", 0.5
        )
        assert [grad.shape for grad in grads] == [x.shape for x in (q, k, v, g, beta)]
