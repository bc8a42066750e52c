"""Document-causal attention: a token attends to earlier tokens of its own document only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titan_gdn.ops.backends import resolve_backend

ATTN_BACKENDS = ("flex", "sdpa")


def resolve_attn_backend(device: torch.device, backend: str | None) -> str:
    # flex is practical only as compiled CUDA kernels; the dense-mask SDPA path is the simple,
    # correct one everywhere else (and the reference the flex path is tested against).
    return resolve_backend(
        "attn_backend", backend, device, ("flex",), {"flex": None}, ATTN_BACKENDS
    )


def document_causal_block_mask(document_ids: torch.Tensor) -> BlockMask:
    batch, seq_len = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        same_document = document_ids[b, q_idx] == document_ids[b, kv_idx]
        return same_document & (kv_idx <= q_idx)

    return _compiled_create_block_mask(mask_mod, batch, None, seq_len, seq_len, document_ids.device)


_compiled_create_block_mask = torch.compile(create_block_mask)
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
