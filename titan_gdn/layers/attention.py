"""Gated full attention of Qwen3.5: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_gdn.layers.norms import ZeroCenteredRMSNorm
from titan_gdn.layers.rope import apply_partial_rope
from titan_gdn.parallel.head_sharding import NO_SHARDING
from titan_gdn.parallel.state_passing import NO_STATE_PASSING

if TYPE_CHECKING:  # layers take boundaries; the model package imports layers
    from titan_gdn.model.documents import DocumentBoundaries


class GatedAttention(nn.Module):
    """Per-token projections, attention per head group over whole documents, per-token output.

    A group is one KV head with the query heads that read it. When context parallel has more
    ranks than KV heads, each KV head is repeated so that every rank owns whole groups.
    """

    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.attn_backend = args.attn_backend
        self.heads = NO_SHARDING
        self.states = NO_STATE_PASSING  # context parallel over sequence chunks: K, V gathered
        # q_proj carries, per head, the query and its output gate side by side.
        self.q_proj = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, docs: DocumentBoundaries, rope) -> torch.Tensor:
        q, k, v, gate = self.project(x)
        q, k, v = self.heads.to_heads(q, k, v)
        (o,) = self.heads.to_tokens(self.mix(q, k, v, docs, rope))
        return self.output(o, gate)

    @property
    def groups(self) -> int:
        return max(self.n_kv_heads, self.heads.degree)

    def project(self, x: torch.Tensor):
        """Per token, per group: q [B,T,G,(H/G)*D], k, v [B,T,G,D], and the gate [B,T,H,D].
        q and k are normalised per head."""
        batch, seq_len, _ = x.shape
        q, gate = self.q_proj(x).view(batch, seq_len, self.n_heads, 2 * self.head_dim).chunk(2, -1)
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        repeats = self.groups // self.n_kv_heads
        k, v = (t.repeat_interleave(repeats, dim=2) if repeats > 1 else t for t in (k, v))
        return self.q_norm(q).flatten(2).unflatten(2, (self.groups, -1)), k, v, gate

    def mix(self, q, k, v, docs: DocumentBoundaries, rope) -> torch.Tensor:
        """RoPE + document-causal attention over the whole sequence (with `self.states`, this
        rank's chunk of queries) for the groups given."""
        cos, sin = (self.states.rows(t) for t in rope)
        q = apply_partial_rope(
            q.unflatten(-1, (-1, self.head_dim)).flatten(2, 3).transpose(1, 2), cos, sin
        )
        k = apply_partial_rope(k.transpose(1, 2), cos, sin)
        o = self.states.attention(q, k, v.transpose(1, 2), docs, self.attn_backend)
        return o.transpose(1, 2).flatten(2).unflatten(2, (k.shape[1], -1))

    def output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.flatten(2) * torch.sigmoid(gate.flatten(2)))

    def init_weights(self, std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()
