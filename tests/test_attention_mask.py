"""The document-causal BlockMask built from document spans equals create_block_mask's, which
evaluates the mask at every token pair."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.ops.attention import BLOCK_MASK_TENSORS as FIELDS
from titan_gdn.ops.attention import (
    block_mask_in_place,
    document_causal_block_mask,
    document_causal_mask_mod,
)

EOS = 0


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


def test_masks_kept_in_place_hold_each_batch_at_the_same_addresses():
    """compile.cudagraphs: every batch's mask in the same tensors, each with its own values."""
    gen = torch.Generator().manual_seed(7)
    storage, addresses = {}, None
    for lengths in ([1, 2, 129], [300, 700], [5000], [64]):
        docs = DocumentBoundaries.from_tokens(_rows(gen, 2, 1024, lengths), EOS)
        fresh = document_causal_block_mask(docs.document_ids)
        kept = block_mask_in_place(document_causal_block_mask(docs.document_ids), storage)
        for field in FIELDS:
            assert torch.equal(getattr(kept, field), getattr(fresh, field)), field
        assert torch.equal(kept.to_dense(), fresh.to_dense())
        now = [getattr(kept, field).data_ptr() for field in FIELDS]
        assert addresses in (None, now)
        addresses = now
    assert len(storage) == len(FIELDS)


@pytest.mark.parametrize("handed_in", ["nothing", "boundaries without a mask"])
def test_the_model_builds_flex_masks_before_its_blocks(monkeypatch, handed_in):
    """With flex attention, model(tokens) builds the block mask in its forward, before the
    blocks (which may be compiled), as `get_attention_masks` does, when none is handed in: no
    attention layer gets None. Flex needs CUDA; the attention layers here run the dense mask
    with the mask they were handed recorded."""
    from tests.conftest import NARROW_HEADS, perturbed_debug_model
    from titan_gdn.model import model as model_module
    from titan_gdn.ops.attention import document_causal_attention
    from titan_gdn.placements import state_passing

    model = perturbed_debug_model(**NARROW_HEADS)
    gen = torch.Generator().manual_seed(5)
    tokens = _rows(gen, 2, 160, [1, 7, 40, 300])
    handed = None if handed_in == "nothing" else DocumentBoundaries.from_tokens(tokens, EOS)
    want_ids = (handed or DocumentBoundaries.whole_rows(2, 160, "cpu")).document_ids
    want = document_causal_block_mask(want_ids)
    masks = []

    def dense_attention(q, k, v, document_ids, block_mask, backend, *args, **kwargs):
        masks.append(block_mask)
        return document_causal_attention(q, k, v, document_ids, None, "sdpa", *args, **kwargs)

    monkeypatch.setattr(model_module, "resolve_attn_backend", lambda *args: "flex")
    monkeypatch.setattr(state_passing, "document_causal_attention", dense_attention)
    with torch.no_grad():
        model(tokens, attention_masks=handed)
    assert len(masks) == sum(t != "linear_attention" for t in model.model_args.layer_types)
    for got in masks:
        assert got is not None and got.seq_lengths == want.seq_lengths
        assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in FIELDS)


def test_a_whole_row_mask_is_rebuilt_for_a_chunks_queries(monkeypatch):
    """Context parallel over sequence chunks: handed the whole rows' mask, the model builds the
    mask of its chunk's queries (before the blocks), and keeps a mask that is already that."""
    from tests.conftest import NARROW_HEADS, perturbed_debug_model
    from titan_gdn.model import model as model_module

    model = perturbed_debug_model(**NARROW_HEADS)
    monkeypatch.setattr(model_module, "resolve_attn_backend", lambda *args: "flex")
    tokens = _rows(torch.Generator().manual_seed(6), 2, 256, [1, 9, 70, 300])
    whole = model.get_attention_masks(tokens, type("Tokenizer", (), {"eos_id": EOS}))
    assert whole.block_mask.seq_lengths == (256, 256)
    chunk = model._with_flex_mask(whole, (128, 256))
    want = document_causal_block_mask(whole.document_ids, (128, 256))
    assert chunk.block_mask.seq_lengths == want.seq_lengths == (128, 256)
    assert all(torch.equal(getattr(chunk.block_mask, f), getattr(want, f)) for f in FIELDS)
    assert model._with_flex_mask(chunk, (128, 256)) is chunk
    assert model._with_flex_mask(whole, None) is whole
