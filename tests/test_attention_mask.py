"""The document-causal BlockMask built from document spans equals create_block_mask's, which
evaluates the mask at every token pair."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from titan_gdn.model.documents import DocumentBoundaries
from titan_gdn.ops.attention import document_causal_block_mask, document_causal_mask_mod

EOS = 0
FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def _rows(gen, batch, seq_len, lengths):
    """Rows of packed documents whose lengths are drawn from `lengths` (EOS-terminated)."""
    rows = []
    for _ in range(batch):
        tokens = []
        while len(tokens) < seq_len:
            length = lengths[torch.randint(len(lengths), (1,), generator=gen)]
            tokens += [1] * (length - 1) + [EOS]
        rows.append(tokens[:seq_len])
    return torch.tensor(rows)


def _reference(document_ids):
    batch, seq_len = document_ids.shape
    mask_mod = document_causal_mask_mod(document_ids)
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device="cpu")


@pytest.mark.parametrize("seq_len", [1024, 1000, 2048, 130])
@pytest.mark.parametrize(
    "lengths",
    [
        [1, 2, 3, 127, 128, 129],  # length-1 documents, documents at and across block edges
        [100, 300, 700],
        [5000],  # one document per row
        [128, 256],  # documents aligned with blocks
    ],
    ids=["tiny", "mixed", "whole-row", "aligned"],
)
def test_equals_create_block_mask(seq_len, lengths):
    gen = torch.Generator().manual_seed(seq_len + len(lengths))
    docs = DocumentBoundaries.from_tokens(_rows(gen, 2, seq_len, lengths), EOS)
    ours, reference = document_causal_block_mask(docs.document_ids), _reference(docs.document_ids)
    assert ours.seq_lengths == reference.seq_lengths == (seq_len, seq_len)
    assert ours.BLOCK_SIZE == reference.BLOCK_SIZE
    for field in FIELDS:
        torch.testing.assert_close(getattr(ours, field), getattr(reference, field), msg=field)
    # The dense masks agree too, token pair by token pair.
    assert torch.equal(ours.to_dense(), reference.to_dense())


@pytest.mark.parametrize(
    ("seq_len", "queries"),
    [(1024, (512, 768)), (1024, (0, 256)), (1000, (750, 1000)), (1024, (320, 512))],
    ids=["middle", "first", "last-short", "unaligned"],
)
def test_query_range_equals_create_block_mask(seq_len, queries):
    """Context parallel over sequence chunks: one chunk's queries against the keys before its
    end, also where the chunk does not start on a block edge."""
    gen = torch.Generator().manual_seed(seq_len + queries[0])
    docs = DocumentBoundaries.from_tokens(_rows(gen, 2, seq_len, [1, 2, 127, 129, 300]), EOS)
    start, end = queries
    ours = document_causal_block_mask(docs.document_ids, queries)
    mask_mod = document_causal_mask_mod(docs.document_ids, start)
    reference = create_block_mask(mask_mod, 2, None, end - start, end, device="cpu")
    assert ours.seq_lengths == reference.seq_lengths == (end - start, end)
    for field in FIELDS:
        torch.testing.assert_close(getattr(ours, field), getattr(reference, field), msg=field)
    assert torch.equal(ours.to_dense(), reference.to_dense())
