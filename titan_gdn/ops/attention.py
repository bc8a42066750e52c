"""Document-causal attention: a token attends to earlier tokens of its own document only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from titan_gdn.ops.backends import resolve_backend

ATTN_BACKENDS = ("flex", "sdpa")


def resolve_attn_backend(device: torch.device, backend: str | None) -> str:
    # flex is practical only as compiled CUDA kernels; the dense-mask SDPA path is the simple,
    # correct one everywhere else (and the reference the flex path is tested against).
    return resolve_backend(
        "attn_backend", backend, device, ("flex",), {"flex": None}, ATTN_BACKENDS
    )


def document_causal_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """flex attention's BlockMask for document-causal attention over rows `document_ids` [B, T].

    Built from where documents start and end, in (T/128)^2 small integer operations, where
    `create_block_mask` evaluates the mask at every token pair: T^2 of them, on every cp rank
    (each holds the whole sequence's mask), a cost that grows 4x per doubling of the length.
    The result equals `create_block_mask`'s (tests/test_attention_mask.py).
    """
    seq_len = document_ids.shape[1]
    partial, full = _document_causal_blocks(document_ids, BLOCK_SIZE)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=document_causal_mask_mod(document_ids),
        seq_lengths=(seq_len, seq_len),
    )


def document_causal_mask_mod(document_ids: torch.Tensor):
    """flex attention's mask_mod: a query sees keys of its own document up to itself."""

    def mask_mod(b, h, q_idx, kv_idx):
        same_document = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return same_document & (kv_idx <= q_idx)

    return mask_mod


BLOCK_SIZE = 128  # flex attention's default sparse block


def _document_causal_blocks(document_ids: torch.Tensor, size: int):
    """[B, 1, Tq/size, Tkv/size] int8: blocks with some allowed pairs, blocks with all allowed.

    Document ids never decrease along a row, so a block holds a run of ids from its first
    token's to its last's. Below the diagonal every key precedes every query: some pair is in
    one document iff the key block ends in the document the query block starts in, and all
    are iff the key block starts in the document the query block ends in. A block on the
    diagonal always has allowed pairs (a token sees itself) and never only allowed ones; a
    block cut short by the row end is never full (its padding is masked).
    """
    seq_len = document_ids.shape[1]
    starts = torch.arange(0, seq_len, size, device=document_ids.device)
    ends = (starts + size).clamp(max=seq_len)
    first, last = document_ids[:, starts], document_ids[:, ends - 1]
    block = torch.arange(len(starts), device=document_ids.device)
    below = block[None, :] < block[:, None]  # [query block, key block]
    some = below & (last[:, None, :] == first[:, :, None])
    some |= (block[None, :] == block[:, None])[None]
    complete = ends - starts == size
    full = below & (first[:, None, :] == last[:, :, None])
    full &= (complete[None, :] & complete[:, None])[None]
    return (some & ~full).to(torch.int8)[:, None], full.to(torch.int8)[:, None]


def _ordered(dense: torch.Tensor):
    # BlockMask's layout: per query block, the count of key blocks and their indices first, in
    # increasing order (the rest after them), as create_block_mask orders them.
    count = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return count, indices


# Plain compile, not torchtitan's max-autotune wrapper: autotuning every flex config at head
# dim 256 took minutes per shape on an H200 before the first step.
_compiled_flex_attention = torch.compile(flex_attention, dynamic=False)


def document_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    block_mask: BlockMask | None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, T, D] (GQA when Hkv < H), scale D**-0.5."""
    backend = resolve_attn_backend(q.device, backend)
    if backend == "flex":
        if block_mask is None:
            block_mask = document_causal_block_mask(document_ids)
        return _compiled_flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1]
        )
    seq_len = q.shape[2]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    mask = (same_document & causal)[:, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
    )
