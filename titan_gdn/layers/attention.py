"""Gated full attention of Qwen3.5: q/k RMSNorm, partial RoPE, GQA, sigmoid output gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from titan_gdn.layers.norms import ZeroCenteredRMSNorm
from titan_gdn.layers.rope import apply_partial_rope
from titan_gdn.ops.attention import document_causal_attention

if TYPE_CHECKING:  # layers take boundaries; the model package imports layers
    from titan_gdn.model.documents import DocumentBoundaries


class GatedAttention(nn.Module):
    """Same stages as GatedDeltaNet: per-token `project`, per-head `mix`, per-token `output`."""

    def __init__(self, args):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.attn_backend = args.attn_backend
        # q_proj carries, per head, the query and its output gate side by side.
        self.q_proj = nn.Linear(args.dim, 2 * args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, docs: DocumentBoundaries, rope) -> torch.Tensor:
        q, k, v, gate = self.project(x)
        return self.output(self.mix(q, k, v, docs, rope), gate)

    def project(self, x: torch.Tensor):
        """q, k, v [B, T, heads, D] (q and k normalised per head) and the gate [B, T, H, D]."""
        batch, seq_len, _ = x.shape
        q, gate = self.q_proj(x).view(batch, seq_len, self.n_heads, 2 * self.head_dim).chunk(2, -1)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        return self.q_norm(q), self.k_norm(k), v, gate

    def mix(self, q, k, v, docs: DocumentBoundaries, rope) -> torch.Tensor:
        """RoPE + document-causal attention over the whole sequence for the heads given."""
        cos, sin = rope
        q = apply_partial_rope(q.transpose(1, 2), cos, sin)
        k = apply_partial_rope(k.transpose(1, 2), cos, sin)
        o = document_causal_attention(
            q, k, v.transpose(1, 2), docs.document_ids, docs.block_mask, self.attn_backend
        )
        return o.transpose(1, 2)

    def output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj((o * torch.sigmoid(gate)).flatten(2))

    def init_weights(self, std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()
