"""The two RMSNorms of Qwen3.5."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as w and applied as (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # Scale before casting back, as transformers' Qwen3.5 does.
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the GDN output, gated by silu(z); weight applied as w (ones at init)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
