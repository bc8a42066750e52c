"""Partial rotary embedding: only the first `rotary_dim` channels of each head rotate."""

from __future__ import annotations

import torch


def rope_cos_sin(
    position_ids: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, rotary_dim] for integer positions [B, T] (computed in fp32)."""
    exponents = torch.arange(0, rotary_dim, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
    freqs = position_ids.float()[..., None] * inv_freq
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] on its first cos.shape[-1] channels; cos, sin are [B, T, R]."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat([rotated, passed], dim=-1)
