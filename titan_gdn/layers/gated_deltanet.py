"""Gated DeltaNet: the linear-attention mixer of Qwen3.5."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.layers.norms import GatedRMSNorm
from titan_gdn.placements.head_sharding import NO_SHARDING
from titan_gdn.placements.state_passing import NO_STATE_PASSING


class GatedDeltaNet(nn.Module):
    """Projections run per token; the conv and the delta rule run per head over whole documents.

    Heads are handled in groups of one key head with the value heads that read it; a group is
    the unit that `self.heads` places on a rank (all of them unless context parallel is on).
    What a group's mixing reads comes from one GEMM, `in_proj_qkvba`, whose output rows are
    group-major: per group its q, k, v, b, a, so that a group's channels are one contiguous
    block and the exchange moves one tensor. The gate z is only read per token, after the
    mixing: it has a GEMM of its own, run then, so that it is not held through the mixing.
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
        groups, value_dim = self.num_k_heads, self.num_v_heads * self.head_v_dim
        self.in_proj_qkvba = nn.Linear(args.dim, groups * sum(self.group_channels), bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_dim, bias=False)
        # Depthwise conv over each group's q | k | v channels, one [K] filter per channel,
        # stored group-major as the projection is, so that a rank's groups are one slice.
        conv_dim = groups * sum(self.group_channels[:3])
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, args.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=args.norm_eps)
        self.out_proj = nn.Linear(value_dim, args.dim, bias=False)

    @property
    def group_channels(self) -> list[int]:
        """Channels of one group in `in_proj_qkvba`'s output: q, k, v, b, a."""
        per_group = self.num_v_heads // self.num_k_heads  # value heads reading one key head
        return [self.head_k_dim, self.head_k_dim, per_group * self.head_v_dim, per_group, per_group]

    def forward(self, x: torch.Tensor, docs: DocumentBoundaries) -> torch.Tensor:
        groups = self.in_proj_qkvba(x).unflatten(-1, (self.num_k_heads, -1))
        o = self.heads.to_tokens(self.mix(self.heads.to_heads(groups), docs))
        return self.output(o, x)

    def mix(self, groups: torch.Tensor, docs: DocumentBoundaries) -> torch.Tensor:
        """Conv + delta rule over the packed sequence (the whole rows, or with `self.states`
        this rank's chunk of them) for the groups given ([B, T, G, group channels]), output in
        group layout [B, T, G, r*Dv]. The per-head parameters used are this rank's slices, so
        a head meets its own filters, decay and step size."""
        batch, seq_len, local_groups, _ = groups.shape
        q, k, v, b, a = groups.split(self.group_channels, dim=-1)
        # b and a in buffers of their own: the gate backward reads them after the delta rule's
        # backward, and a view would hold the whole projection until then (9 GiB of a 0.8B
        # layer at 786k tokens); q, k, v are copied into the conv's input below anyway.
        b, a = b.contiguous(), a.contiguous()
        v_heads = local_groups * self.group_channels[3]
        # The kernels' layout, q | k | v per token: packed rows end to end, [1, B*T, channels].
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
        qkv = self.states.causal_conv1d_silu(
            qkv.view(1, batch * seq_len, -1),
            self._conv_weight_in_kernel_layout(local_groups),
            docs,
            self.conv_backend,
        )
        q, k, v = qkv.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], dim=-1)
        A_log, dt_bias = self.heads.local(self.A_log), self.heads.local(self.dt_bias)
        g = -A_log.float().exp() * F.softplus(a.flatten(2).float() + dt_bias)
        o = self.states.gated_delta_rule(
            q.view(1, -1, local_groups, self.head_k_dim),
            k.view(1, -1, local_groups, self.head_k_dim),
            v.view(1, -1, v_heads, self.head_v_dim),
            g.view(1, -1, v_heads),
            b.flatten(2).sigmoid().view(1, -1, v_heads),
            docs,
            self.delta_rule_backend,
        )
        return o.view(batch, seq_len, local_groups, -1)

    def _conv_weight_in_kernel_layout(self, local_groups: int) -> torch.Tensor:
        """This rank's groups of the (group-major) conv weight, as q | k | v sections."""
        per_group = self.heads.local(self.conv_weight).unflatten(0, (local_groups, -1))
        sections = per_group.split(self.group_channels[:3], dim=1)
        return torch.cat([w.flatten(0, 1) for w in sections])

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gated norm with silu(z) per head, then the output projection (per token)."""
        o = o.unflatten(-1, (-1, self.head_v_dim)).flatten(2, 3)
        z = self.in_proj_z(x).view_as(o)
        return self.out_proj(self.norm(o, z).flatten(2))

    def init_weights(self, std: float) -> None:
        for linear in (self.in_proj_qkvba, self.in_proj_z, self.out_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.normal_(self.conv_weight, mean=0.0, std=std)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            # A = U(0.01, 16): the lower bound keeps log(A) finite.
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.reset_parameters()
