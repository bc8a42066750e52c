"""Document boundaries as the ops receive them: cu_seqlens of a fixed capacity.

A batch's boundaries are padded to one entry per token plus one by repeating the last value
(empty trailing documents), so their shape never changes and compiled code never
recompiles for a new document count. The torch backends take that form as it is.
"""

from __future__ import annotations

import functools

import torch


def without_empty_tail(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`cu_seqlens` without its padding: the boundaries of the non-empty documents.

    For kernels that launch work per document (FLA's): thousands of empty documents would
    cost launches and were never exercised there. One host sync.
    """
    num_documents = int(torch.searchsorted(cu_seqlens, cu_seqlens[-1:]))
    return cu_seqlens[: num_documents + 1]


@functools.cache
def cached_without_empty_tail():
    """`without_empty_tail` memoized on the tensor's identity, as FLA memoizes what it derives
    from cu_seqlens: every layer of a step then passes FLA the same trimmed tensor, so FLA's
    own caches hit, and the sync happens once per step."""
    from fla.utils import tensor_cache

    return tensor_cache(without_empty_tail)
