"""Document-causal attention: a token attends to earlier tokens of its own document only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from titan_gdn.ops.backends import resolve_backend
from titan_gdn.ops.varlen_attention import varlen_attention

# sdpa: a dense document mask, the simple reference (CPU's default); varlen: torch's flash and
# cuDNN kernels over the documents (CUDA's default; on CPU a per-document reference); flex:
# flex attention with a document block mask (CUDA only, compiled).
ATTN_BACKENDS = ("sdpa", "varlen", "flex")


# What torch's flash and cuDNN kernels take.
VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def resolve_attn_backend(
    device: torch.device, backend: str | None, dtype: torch.dtype | None = None
) -> str:
    """The attention backend for inputs of `dtype` (None: not known yet, as when the step's
    masks are built before autocast) on `device`; varlen on CUDA when unset."""
    name = resolve_backend(
        "attn_backend", backend, device, ("varlen",), {"flex": None}, ATTN_BACKENDS
    )
    if name == "varlen" and device.type == "cuda" and dtype not in (None, *VARLEN_DTYPES):
        # Not flex in its place: the step's block mask is built with the boundaries, before
        # the compute dtype is known, and flex with a mask built inside a compiled block gave
        # wrong logits under compiled selective checkpointing (fp32 debug model, H200).
        raise ValueError(
            f"attention's inputs are {dtype}, but model.attn_backend = {backend or 'unset'} "
            "takes torch's flash and cuDNN kernels (varlen) on CUDA, which take bfloat16 or "
            "float16: compute in bf16 (training.mixed_precision_param, or autocast on one "
            "GPU), or set model.attn_backend = 'flex' for fp32 attention"
        )
    return name


def document_causal_block_mask(
    document_ids: torch.Tensor, queries: tuple[int, int] | None = None
) -> BlockMask:
    """flex attention's BlockMask for document-causal attention over rows `document_ids` [B, T].

    `queries` = (start, end): the mask of the queries at positions start..end-1 against the
    keys before `end` (context parallel over sequence chunks: a rank's queries see the earlier
    chunks' keys); None: the whole row against itself.

    Built from where documents start and end, in (Tq/128)(Tk/128) small integer operations,
    where `create_block_mask` evaluates the mask at every token pair: T^2 of them, on every cp
    rank (each holds the whole sequence's mask), a cost that grows 4x per doubling of the
    length. The result equals `create_block_mask`'s (tests/test_attention_mask.py).
    """
    start, end = queries or (0, document_ids.shape[1])
    partial, full = _document_causal_blocks(document_ids, BLOCK_SIZE, start, end)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=document_causal_mask_mod(document_ids, start),
        seq_lengths=(end - start, end),
    )


def document_causal_mask_mod(document_ids: torch.Tensor, query_start: int = 0):
    """flex attention's mask_mod: a query sees keys of its own document up to itself. Query i
    sits at position `query_start` + i of the row."""

    def mask_mod(b, h, q_idx, kv_idx):
        position = q_idx + query_start
        same_document = document_ids[b, position] == document_ids[b, kv_idx]
        return same_document & (kv_idx <= position)

    return mask_mod


BLOCK_SIZE = 128  # flex attention's default sparse block
# The tensors a BlockMask holds (the q_* ones are the transposed layout its backward reads).
BLOCK_MASK_TENSORS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


def block_mask_in_place(block_mask: BlockMask, storage: dict) -> BlockMask:
    """`block_mask` holding `storage`'s tensors, with its own values copied in: one tensor per
    name and shape, allocated at the first call and then reused. Compiled graphs take a
    BlockMask's tensors as static inputs, and a CUDA graph (compile.cudagraphs) replays only
    for the addresses it recorded: a new mask each step would record every graph again."""
    for name in BLOCK_MASK_TENSORS:
        tensor = getattr(block_mask, name)
        if tensor is None:
            continue
        key = (name, tuple(tensor.shape), tensor.dtype, tensor.device)
        if key not in storage:
            storage[key] = torch.empty_like(tensor)
        setattr(block_mask, name, storage[key].copy_(tensor))
    return block_mask


def _document_causal_blocks(document_ids: torch.Tensor, size: int, start: int, end: int):
    """[B, 1, Tq/size, Tk/size] int8 for the queries start..end-1 and the keys before `end`:
    blocks with some allowed pairs, blocks with all allowed.

    Document ids never decrease along a row, so a block holds a run of ids from its first
    token's to its last's. A key block that ends before a query block starts has some pair in
    one document iff it ends in the document the query block starts in, and all iff it starts
    in the document the query block ends in. Blocks that share a token always have allowed
    pairs (a token sees itself), and all of them only if that token is the key block's last
    and the query block's first; a block cut short by the row end is never full (its padding
    is masked).
    """
    device = document_ids.device
    q_starts = torch.arange(start, end, size, device=device)
    q_ends = (q_starts + size).clamp(max=end)
    k_starts = torch.arange(0, end, size, device=device)
    k_ends = (k_starts + size).clamp(max=end)
    q_first, q_last = document_ids[:, q_starts], document_ids[:, q_ends - 1]
    k_first, k_last = document_ids[:, k_starts], document_ids[:, k_ends - 1]
    # [query block, key block]
    keys_before = (k_ends - 1)[None, :] < q_starts[:, None]
    keys_not_after = (k_ends - 1)[None, :] <= q_starts[:, None]
    shared = (k_starts[None, :] <= (q_ends - 1)[:, None]) & ~keys_before
    some = keys_before & (k_last[:, None, :] == q_first[:, :, None])
    some |= shared[None]
    complete_q, complete_k = q_ends - q_starts == size, k_ends - k_starts == size
    full = keys_not_after & (k_first[:, None, :] == q_last[:, :, None])
    full &= (complete_k[None, :] & complete_q[:, None])[None]
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
    query_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, Tq, D] over k, v [B, Hkv, Tk, D] (GQA when Hkv < H), scale
    D**-0.5. The keys are the row's first Tk tokens and the queries its Tq tokens from
    `query_start` (Tk = query_start + Tq: context parallel over sequence chunks); by default
    both are the whole row. `block_mask`, for flex, must be that range's
    (`document_causal_block_mask(document_ids, queries)`); None builds it. `cu_seqlens`, for
    varlen: the batch's padded boundaries (`DocumentBoundaries.padded_cu_seqlens`)."""
    backend = resolve_attn_backend(q.device, backend, q.dtype)
    query_len, key_len = q.shape[2], k.shape[2]
    if backend == "varlen":
        if cu_seqlens is None:
            raise ValueError("the varlen attention backend needs the batch's cu_seqlens")
        tokens_first = (x.transpose(1, 2) for x in (q, k, v))
        row_len = document_ids.shape[1]
        out, _ = varlen_attention(*tokens_first, cu_seqlens, row_len, query_start)
        return out.transpose(1, 2)
    if backend == "flex":
        if block_mask is None:
            block_mask = document_causal_block_mask(
                document_ids, (query_start, query_start + query_len)
            )
        return _compiled_flex_attention(
            q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1]
        )
    query_position = torch.arange(query_start, query_start + query_len, device=q.device)
    causal = torch.arange(key_len, device=q.device)[None, :] <= query_position[:, None]
    query_documents = document_ids[:, query_start : query_start + query_len]
    same_document = query_documents[:, :, None] == document_ids[:, None, :key_len]
    mask = (same_document & causal)[:, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
    )
