"""Gated DeltaNet: the linear-attention mixer of Qwen3.5."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from titan_gdn.layers.norms import GatedRMSNorm
from titan_gdn.parallel.head_sharding import NO_SHARDING
from titan_gdn.parallel.state_passing import NO_STATE_PASSING

if TYPE_CHECKING:  # layers take boundaries; the model package imports layers
    from titan_gdn.model.documents import DocumentBoundaries


class GatedDeltaNet(nn.Module):
    """Projections run per token; the conv and the delta rule run per head over whole documents.

    Heads are handled in groups of one key head with the value heads that read it; a group is
    the unit that `self.heads` places on a rank (all of them unless context parallel is on).
    """

    def __init__(self, args):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.conv_backend = args.conv_backend
        self.delta_rule_backend = args.delta_rule_backend
        self.heads = NO_SHARDING
        self.states = NO_STATE_PASSING  # context parallel over sequence chunks: state passing
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        self.in_proj_qkv = nn.Linear(args.dim, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.dim, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(args.dim, self.num_v_heads, bias=False)
        # Depthwise conv over the q | k | v channels, one [K] filter per channel.
        conv_dim, kernel = 2 * key_dim + value_dim, args.linear_conv_kernel_dim
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, kernel))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=args.norm_eps)
        self.out_proj = nn.Linear(value_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, docs: DocumentBoundaries) -> torch.Tensor:
        # a and b in buffers of their own: the gate backward reads them after the delta rule's.
        q, k, v, a, b = self.heads.to_heads(*self.project(x), own_buffers=2)
        (o,) = self.heads.to_tokens(self.mix(q, k, v, a, b, docs))
        return self.output(o, x)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-token projections, per key-head group: q, k [B,T,Hk,Dk]; v [B,T,Hk,r*Dv];
        a, b [B,T,Hk,r], where r = Hv / Hk value heads read each key head."""
        key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        q, k, v = self.in_proj_qkv(x).split([key_dim, key_dim, value_dim], dim=-1)
        groups = self.num_k_heads
        return tuple(
            t.unflatten(-1, (groups, -1)) for t in (q, k, v, self.in_proj_a(x), self.in_proj_b(x))
        )

    def mix(self, q, k, v, a, b, docs: DocumentBoundaries) -> torch.Tensor:
        """Conv + delta rule over the packed sequence (the whole rows, or with `self.states` this
        rank's chunk of them) for the groups given, output in
        group layout [B, T, G, r*Dv]. The per-head parameters used are this rank's slices, so a
        head meets its own filters, decay and step size."""
        batch, seq_len, groups, _ = q.shape
        v_heads = a.shape[2] * a.shape[3]
        # Packed layout for the varlen kernels: rows end to end, [1, B*T, channels].
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        qkv = self.states.causal_conv1d_silu(
            qkv.view(1, batch * seq_len, -1), self._local_conv_weight(), docs, self.conv_backend
        )
        q, k, v = qkv.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], dim=-1)
        A_log, dt_bias = self.heads.local(self.A_log), self.heads.local(self.dt_bias)
        g = -A_log.float().exp() * F.softplus(a.flatten(2).float() + dt_bias)
        o = self.states.gated_delta_rule(
            q.view(1, -1, groups, self.head_k_dim),
            k.view(1, -1, groups, self.head_k_dim),
            v.view(1, -1, v_heads, self.head_v_dim),
            g.view(1, -1, v_heads),
            b.flatten(2).sigmoid().view(1, -1, v_heads),
            docs,
            self.delta_rule_backend,
        )
        return o.view(batch, seq_len, groups, -1)

    def _local_conv_weight(self) -> torch.Tensor:
        key_dim = self.num_k_heads * self.head_k_dim
        sections = self.conv_weight.split([key_dim, key_dim, self.num_v_heads * self.head_v_dim])
        return torch.cat([self.heads.local(w) for w in sections])

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gated norm with silu(z) per head, then the output projection (per token)."""
        o = o.unflatten(-1, (-1, self.head_v_dim)).flatten(2, 3)
        z = self.in_proj_z(x).view_as(o)
        return self.out_proj(self.norm(o, z).flatten(2))

    def init_weights(self, std: float) -> None:
        linears = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.out_proj)
        for linear in linears:
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.normal_(self.conv_weight, mean=0.0, std=std)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            # A = U(0.01, 16): the lower bound keeps log(A) finite.
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.reset_parameters()
