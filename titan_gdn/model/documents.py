"""Packed-document boundaries, derived once per batch and shared by every layer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from titan_gdn.ops.documents import padded_cu_seqlens


@dataclass
class DocumentBoundaries:
    """Where the documents packed into a batch start and end.

    torchtitan packs EOS-terminated documents into rows; a document ends right after its EOS
    (as in torchtitan's document masks) and every row end closes a document too. Rows are laid
    end to end, so `cu_seqlens` indexes the flattened `[B * T]` sequence that the varlen kernels
    (delta rule, conv) consume.

    The layers read `padded_cu_seqlens`, whose shape depends on the batch shape only: a
    compiled block then sees the same input shapes whatever the documents, and never
    recompiles for them. `cu_seqlens` is the same without the padding (a host sync).
    """

    # int32 [B * T + 1]: the boundaries over the flattened batch, then the end repeated
    # (empty documents) up to one entry per token plus one.
    padded_cu_seqlens: torch.Tensor
    document_ids: torch.Tensor  # int32 [B, T], unique per document across the batch
    position_ids: torch.Tensor  # int64 [B, T], position inside its document (RoPE)
    block_mask: BlockMask | None = None  # document-causal flex mask, when flex attention runs

    @property
    def num_documents(self) -> int:
        """The real documents, without the padding."""
        return int(self.document_ids[-1, -1]) + 1

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """int32 [num_documents + 1]: the boundaries without the padding."""
        return self.padded_cu_seqlens[: self.num_documents + 1]

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, eos_id: int | None) -> DocumentBoundaries:
        if eos_id is None:
            return cls.whole_rows(*tokens.shape, device=tokens.device)
        return cls._from_starts(_row_starts(tokens[:, :-1] == eos_id))

    @classmethod
    def whole_rows(cls, batch: int, seq_len: int, device: torch.device) -> DocumentBoundaries:
        after_eos = torch.zeros(batch, seq_len - 1, dtype=torch.bool, device=device)
        return cls._from_starts(_row_starts(after_eos))

    @classmethod
    def _from_starts(cls, starts: torch.Tensor) -> DocumentBoundaries:
        flat = starts.flatten()
        index = torch.arange(flat.numel(), device=flat.device)
        document_ids = flat.cumsum(0) - 1
        # The start of each token's document, carried forward by a running max.
        doc_start = torch.where(flat, index, torch.zeros_like(index)).cummax(0).values
        return cls(
            padded_cu_seqlens=padded_cu_seqlens(starts),
            document_ids=document_ids.to(torch.int32).view_as(starts),
            position_ids=(index - doc_start).view_as(starts),
        )

    def with_block_mask(self, block_mask: BlockMask) -> DocumentBoundaries:
        return dataclasses.replace(self, block_mask=block_mask)


def _row_starts(after_eos: torch.Tensor) -> torch.Tensor:
    # Padding with a Python scalar: writing True into a CUDA slice would read a host tensor
    # through .item(), which the profiler counts as a sync in every step.
    return F.pad(after_eos, (1, 0), value=True)
