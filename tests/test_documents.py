"""The per-token document lookup the ops share (titan_gdn.boundaries)."""

import torch

from titan_gdn.boundaries import cached_token_document_starts, token_documents


def _random_boundaries(generator):
    """cu_seqlens with 1-token and empty documents, then fixed-capacity padding."""
    count = int(torch.randint(1, 12, (1,), generator=generator))
    lengths = torch.randint(0, 9, (count,), generator=generator)
    lengths[torch.rand(lengths.shape, generator=generator) < 0.2] = 1
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    padding = cu_seqlens[-1:].expand(int(torch.randint(0, 4, (1,), generator=generator)))
    return torch.cat([cu_seqlens, padding]).int()


def test_each_token_gets_the_non_empty_document_that_holds_it():
    generator = torch.Generator().manual_seed(torch.seed())
    for _ in range(50):
        cu_seqlens = _random_boundaries(generator)
        bounds = cu_seqlens.tolist()
        expected = [d for d in range(len(bounds) - 1) for _ in range(bounds[d], bounds[d + 1])]
        assert token_documents(cu_seqlens, bounds[-1]).tolist() == expected


def test_document_starts_are_computed_once_per_boundaries_tensor():
    generator = torch.Generator().manual_seed(torch.seed())
    cu_seqlens = _random_boundaries(generator)
    tokens = int(cu_seqlens[-1])
    starts = cached_token_document_starts(cu_seqlens, tokens)
    bounds = cu_seqlens.tolist()
    expected = [bounds[d] for d in range(len(bounds) - 1) for _ in range(bounds[d], bounds[d + 1])]
    assert starts.dtype == torch.int32 and starts.tolist() == expected
    assert cached_token_document_starts(cu_seqlens, int(cu_seqlens[-1])) is starts
    # A new step's boundaries (a new tensor, even if equal) are looked up again.
    fresh = cu_seqlens.clone()
    again = cached_token_document_starts(fresh, tokens)
    assert again is not starts and torch.equal(again, starts)
