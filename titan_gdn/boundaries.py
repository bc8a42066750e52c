"""Packed-document boundaries: derived once per batch (`DocumentBoundaries`) and read by every
layer and op, as cu_seqlens of a fixed capacity and FLA's chunk views of them.

A batch's boundaries are padded to one entry per token plus one by repeating the last value
(empty trailing documents), so their shape never changes and compiled code never
recompiles for a new document count. The torch backends take that form as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

# FLA's conv and delta rule both tile each document into chunks of this many tokens.
FLA_CHUNK_SIZE = 64


def padded_cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """int32 [B * T + 1] fixed-capacity boundaries of rows [B, T] laid end to end, from
    `starts` [B, T] (True where a document starts; every row's first token must be one)."""
    document_ids = starts.flatten().cumsum(0) - 1
    # Document d starts at the first token whose id reaches d; ids past the last document
    # find none and give the end. Fixed shapes throughout, so no host sync.
    slots = torch.arange(document_ids.numel() + 1, device=starts.device)
    return torch.searchsorted(document_ids, slots, out_int32=True)


def token_documents(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The document of each of the first `num_tokens` tokens (int64 [num_tokens]): the last
    one starting at or before the token, so an empty document, which holds no token, is
    never anyone's."""
    token = torch.arange(num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].long(), token, right=True)


def token_document_starts(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Where each token's document starts (int64 [num_tokens])."""
    return cu_seqlens.long()[token_documents(cu_seqlens, num_tokens)]


def host_boundaries(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The boundaries of the non-empty documents on the host (int64, CPU): the step's one host
    sync, memoized per boundaries tensor (every layer of a step, forward and backward, gets the
    same tensor). The kernels that launch work per document (FLA's conv and delta rule, the
    varlen attention) size their grids from it."""
    memo = boundaries_memo(cu_seqlens)
    if "host" not in memo:
        bounds = cu_seqlens.to("cpu", torch.int64)  # the whole padded tensor: one copy
        num_documents = int(torch.searchsorted(bounds, bounds[-1:]))
        memo["host"] = bounds[: num_documents + 1]
    return memo["host"]


def documents_and_chunks(
    cu_seqlens: torch.Tensor, chunk_size: int = FLA_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """The boundaries of the non-empty documents, and FLA's chunk indices for them: int
    [num_chunks, 2], each chunk's document and its index inside the document (the layout of
    FLA's `prepare_chunk_indices`).

    For kernels that launch work per document and per chunk (FLA's): thousands of empty
    documents would cost launches and were never exercised there. The counts that size the
    results come from `host_boundaries` (FLA's own `prepare_chunk_indices` syncs twice more:
    a `repeat_interleave` without its output size).
    """
    bounds = host_boundaries(cu_seqlens)
    num_documents = len(bounds) - 1
    trimmed = cu_seqlens[: num_documents + 1]
    counts = (trimmed.diff() + chunk_size - 1).div(chunk_size, rounding_mode="floor")
    num_chunks = int(bounds.diff().add(chunk_size - 1).div(chunk_size, rounding_mode="floor").sum())
    document = torch.arange(num_documents, device=cu_seqlens.device)
    document = document.repeat_interleave(counts, output_size=num_chunks)
    first_chunk = counts.cumsum(0) - counts
    index = torch.arange(num_chunks, device=cu_seqlens.device) - first_chunk[document]
    return trimmed, torch.stack([document, index], 1).to(trimmed)


@functools.cache
def cached_documents_and_chunks():
    """`documents_and_chunks` memoized on the tensor's identity, as FLA memoizes what it
    derives from cu_seqlens: every GDN layer of a step (forward and backward, conv and delta
    rule) gets the same tensors."""
    from fla.utils import tensor_cache

    return tensor_cache(documents_and_chunks)


def cached_token_document_starts(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """`token_document_starts` in int32, memoized on the tensor's identity like
    `cached_documents_and_chunks`: every GDN layer's conv backward asks for it with the same
    boundaries (four small kernels each, 0.1 ms at 32k tokens)."""
    memo = boundaries_memo(cu_seqlens)
    if num_tokens not in memo:
        memo[num_tokens] = token_document_starts(cu_seqlens, num_tokens).int()
    return memo[num_tokens]


def boundaries_memo(cu_seqlens: torch.Tensor) -> dict:
    """A dict per boundaries tensor, for what a step derives from it once: kept for the last
    few tensors, by identity (a dict keyed by plain values, since a token count, an int, is a
    new object at every call and would never hit an identity cache as an argument)."""
    return _identity_cache()(cu_seqlens)


@functools.cache
def _identity_cache():
    from fla.utils import tensor_cache

    return tensor_cache(lambda cu_seqlens: {})


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
    chunk: ChunkBoundaries | None = None  # this rank's chunk, with CP over sequence chunks

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

    def for_chunk(self, start: int, end: int, halo: int) -> DocumentBoundaries:
        """These boundaries with those of the chunk [start, end) of every row (`chunk`)."""
        chunk = ChunkBoundaries.of(self.document_ids, start, end, halo)
        return dataclasses.replace(self, chunk=chunk)


@dataclass
class ChunkBoundaries:
    """The boundaries as the mixers read them in one rank's chunk [start, end) of every row,
    with context parallel over sequence chunks: built once per step from the whole rows' and
    handed to every layer. Inside the chunk, a document cut by the chunk start begins at the
    chunk's first token; the conv reads `halo` tokens from the chunk before.
    """

    start: int
    end: int
    halo: int
    # int32 [B * Tc + 1]: the chunk's documents over its rows laid end to end, fixed capacity.
    padded_cu_seqlens: torch.Tensor
    # int32 [B * (halo + Tc) + 1]: the same over each row's halo and chunk, the halo opening the
    # chunk's first document.
    conv_cu_seqlens: torch.Tensor
    # bool [B, halo]: the halo tokens of the document of the chunk's first token (none on the
    # first chunk, which has no halo to read).
    halo_in_document: torch.Tensor
    # bool [N, B]: whether chunk n of each row continues the document of the chunk before.
    continues: torch.Tensor
    # int32 [B, 2]: per row, how many chunks before this one its first document started in and
    # how many after it its last document reaches into (0 and 0: both lie in this chunk), for
    # kernels that chain the state over exactly those chunks (FLA's `pre_num_ranks` and
    # `post_num_ranks`).
    shared_chunks: torch.Tensor

    @classmethod
    def of(cls, document_ids: torch.Tensor, start: int, end: int, halo: int) -> ChunkBoundaries:
        ids, batch, size = document_ids, document_ids.shape[0], end - start
        chunk = ids[:, start:end]
        first = torch.ones_like(chunk[:, :1], dtype=torch.bool)
        starts = torch.cat([first, chunk[:, 1:] != chunk[:, :-1]], dim=1)
        conv_starts = torch.cat([first, starts.new_zeros(batch, halo), starts[:, 1:]], dim=1)
        if start:
            halo_in_document = ids[:, max(start - halo, 0) : start] == ids[:, start : start + 1]
        else:
            halo_in_document = ids.new_zeros(batch, halo, dtype=torch.bool)
        continues = ids[:, size::size] == ids[:, size - 1 : -1 : size]
        continues = torch.cat([torch.zeros_like(continues[:, :1]), continues], dim=1).T
        return cls(
            start=start,
            end=end,
            halo=halo,
            padded_cu_seqlens=padded_cu_seqlens(starts),
            conv_cu_seqlens=padded_cu_seqlens(conv_starts),
            halo_in_document=halo_in_document,
            continues=continues,
            shared_chunks=_shared_chunks(ids, start, end),
        )


def _shared_chunks(document_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """`ChunkBoundaries.shared_chunks` of the chunk [start, end) of every row of equal chunks."""
    ids, size = document_ids, end - start
    # Ids grow along a row: a document starts after every token of a smaller id, and ends at
    # the last token of an id no larger. Counts over whole rows, so no host sync.
    first_start = (ids < ids[:, start : start + 1]).sum(1)
    last_end = (ids <= ids[:, end - 1 : end]).sum(1) - 1
    chunk = start // size
    return torch.stack([chunk - first_start // size, last_end // size - chunk], 1).int()


def _row_starts(after_eos: torch.Tensor) -> torch.Tensor:
    # Padding with a Python scalar: writing True into a CUDA slice would read a host tensor
    # through .item(), which the profiler counts as a sync in every step.
    return F.pad(after_eos, (1, 0), value=True)
