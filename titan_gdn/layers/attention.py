"""Gated full attention of Qwen3.5: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

import torch
from torch import nn

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.layers.norms import ZeroCenteredRMSNorm
from titan_gdn.layers.rope import apply_partial_rope
from titan_gdn.placements.head_sharding import NO_SHARDING
from titan_gdn.placements.state_passing import NO_STATE_PASSING


class GatedAttention(nn.Module):
    """Per-token projections, attention per head group over whole documents, per-token output.

    A group is one KV head with the query heads that read it. When context parallel has more
    ranks than KV heads, each KV head is repeated so that every rank owns whole groups. What
    a group's attention reads comes from one GEMM, `qkv_proj`, whose output rows are
    group-major (per KV head: its query heads, its key, its value), so that the exchange moves
    one tensor; the output gate is read only per token, after attention, from a GEMM of its
    own (`gate_proj`).
    """

    def __init__(self, args):
        super().__init__()
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.attn_backend = args.attn_backend
        self.heads = NO_SHARDING
        self.states = NO_STATE_PASSING  # context parallel over sequence chunks: K, V gathered
        dim, head_dim = args.dim, args.head_dim
        self.qkv_proj = nn.Linear(dim, (args.n_heads + 2 * args.n_kv_heads) * head_dim, bias=False)
        self.gate_proj = nn.Linear(dim, args.n_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * head_dim, dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, docs: DocumentBoundaries, rope) -> torch.Tensor:
        groups = self.heads.to_heads(self.project(x))
        o = self.heads.to_tokens(self.mix(groups, docs, rope))
        return self.output(o, x)

    @property
    def groups(self) -> int:
        return max(self.n_kv_heads, self.heads.degree)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Per token, per group: its query heads, then its key and value, [B,T,G,(H/G+2)*D]."""
        kv_groups = self.qkv_proj(x).unflatten(-1, (self.n_kv_heads, -1))
        repeats = self.groups // self.n_kv_heads
        if repeats == 1:
            return kv_groups
        # Each KV head goes with every share of its query heads: the one copy of this layout.
        q, kv = kv_groups.split([kv_groups.shape[-1] - 2 * self.head_dim, 2 * self.head_dim], -1)
        q = q.unflatten(-1, (repeats, -1))
        kv = kv.unsqueeze(3).expand(*q.shape[:-1], -1)
        return torch.cat([q, kv], dim=-1).flatten(2, 3)

    def mix(self, groups: torch.Tensor, docs: DocumentBoundaries, rope) -> torch.Tensor:
        """q/k norms, RoPE and document-causal attention over the whole sequence (with
        `self.states`, this rank's chunk of queries) for the groups given; output per group
        [B, T, G, (H/G)*D]."""
        head_dim = self.head_dim
        q, k, v = groups.split([groups.shape[-1] - 2 * head_dim, head_dim, head_dim], dim=-1)
        q = self.q_norm(q.unflatten(-1, (-1, head_dim)).flatten(2, 3))
        cos, sin = (self.states.rows(t) for t in rope)
        q = apply_partial_rope(q.transpose(1, 2), cos, sin)
        k = apply_partial_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        o = self.states.attention(q, k, v.transpose(1, 2), docs, self.attn_backend)
        return o.transpose(1, 2).flatten(2).unflatten(2, (k.shape[1], -1))

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.flatten(2) * torch.sigmoid(self.gate_proj(x)))

    def init_weights(self, std: float) -> None:
        for linear in (self.qkv_proj, self.gate_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()
