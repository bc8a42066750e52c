"""Depthwise causal conv1d + SiLU over packed documents (the GDN short convolution)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_gdn.boundaries import (
    cached_documents_and_chunks,
    token_document_starts,
    token_documents,
)
from titan_gdn.ops.backends import resolve_backend
from titan_gdn.ops.custom_op import input_saving_op

CONV_BACKENDS = ("causal_conv1d", "fla", "torch")


def resolve_conv_backend(device: torch.device, backend: str | None) -> str:
    return resolve_backend(
        "conv_backend",
        backend,
        device,
        cuda_preference=("causal_conv1d", "fla"),
        cuda_only={"causal_conv1d": "causal_conv1d", "fla": "fla"},
        choices=CONV_BACKENDS,
    )


def causal_conv1d_silu(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, backend: str | None = None
) -> torch.Tensor:
    """silu(depthwise causal conv) of `x` [1, L, C] with `weight` [C, K], restarting at documents.

    No output reads an input of an earlier document: the taps that would reach before the
    document start see zeros, as if every document were convolved alone. `cu_seqlens` may
    end in empty documents (a fixed-capacity cu_seqlens, see `titan_gdn.boundaries`).
    """
    if x.shape[0] != 1:
        raise ValueError(f"causal_conv1d_silu expects packed input [1, L, C], got {tuple(x.shape)}")
    return _causal_conv1d_silu_op(x, weight, cu_seqlens, resolve_conv_backend(x.device, backend))


def _causal_conv1d_silu(x, weight, cu_seqlens, backend):
    if backend == "fla":
        from fla.modules.causal_conv1d import causal_conv1d

        cu_seqlens, chunk_indices = cached_documents_and_chunks()(cu_seqlens)
        out, _ = causal_conv1d(
            x,
            weight=weight,
            activation="silu",
            backend="triton",
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
        )
        return out
    if backend == "causal_conv1d":
        return _causal_conv1d_cuda(x, weight, cu_seqlens)
    return _causal_conv1d_torch(x, weight, cu_seqlens)


def _causal_conv1d_silu_backward(grad, x, weight, cu_seqlens, backend):
    """With FLA's forward, our one-kernel backward (`conv_backward`), which needs only the
    inputs: no forward rerun first. None for the other backends and for filters of other
    widths than the kernel's (their forward is recomputed under autograd)."""
    from titan_gdn.ops import conv_backward

    if backend != "fla" or weight.shape[1] != conv_backward.TAPS:
        return None
    return list(conv_backward.causal_conv1d_silu_backward(grad, x, weight, cu_seqlens))


_causal_conv1d_silu_op = input_saving_op(
    "causal_conv1d_silu",
    _causal_conv1d_silu,
    "(Tensor x, Tensor weight, Tensor cu_seqlens, str backend)",
    num_differentiable=2,
    output_like=0,
    backward_fn=_causal_conv1d_silu_backward,
)


def _causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor):
    length, kernel = x.shape[1], weight.shape[1]
    positions = torch.arange(length, device=x.device) - token_document_starts(cu_seqlens, length)
    xf = F.pad(x[0].float(), (0, 0, kernel - 1, 0))
    w = weight.float()
    out = torch.zeros(length, x.shape[2], device=x.device, dtype=torch.float32)
    for tap in range(kernel):
        lag = kernel - 1 - tap
        # A tap lagging `lag` tokens is valid only `lag` tokens or more into the document.
        valid = (positions >= lag).unsqueeze(-1)
        out = out + torch.where(valid, xf[tap : tap + length], 0.0) * w[:, tap]
    return F.silu(out).to(x.dtype)[None]


def _causal_conv1d_cuda(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor):
    from causal_conv1d import causal_conv1d_fn

    # The CUDA kernel restarts at documents through `seq_idx`, which it accepts only with a
    # channel-last layout: a [1, L, C] contiguous tensor seen as [1, C, L].
    seq_idx = token_documents(cu_seqlens, x.shape[1]).to(torch.int32)[None]
    out = causal_conv1d_fn(x.transpose(1, 2), weight, bias=None, seq_idx=seq_idx, activation="silu")
    return out.transpose(1, 2)
