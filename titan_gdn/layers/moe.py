"""The sparse MoE block of Qwen3.5 MoE and Qwen3-Next, as transformers defines it.

Per token: a softmax router in fp32 picks the top-k experts and (renormalised) weights; each
picked expert runs a SwiGLU with fused gate/up weights, the outputs are summed with their
weights; a shared SwiGLU expert, scaled by sigmoid(shared_expert_gate(x)), is added.

What comes from torchtitan 0.2.2 (models/moe/): the token grouping that its experts and its
`ExpertParallel` dispatch expect (tokens sorted by expert, counts per expert, groups padded by
`_permute`), so `ExpertParallel` shards `GroupedExperts` and moves its tokens unchanged. What is
ours, because torchtitan's `MoE` has none of it: the router without a gate bias but with
transformers' renormalisation switch, experts with transformers' fused `gate_up_proj`, weights
applied after the experts (torchtitan scales the inputs), the sigmoid-gated shared expert, and
the routing each block returns for the load-balancing loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.utils import _permute, _unpermute

from titan_gdn.layers.mlp import FeedForward
from titan_gdn.ops.experts import experts_swiglu, resolve_experts_backend


class TopKRouter(nn.Module):
    """Softmax over all experts in fp32, top-k; the k weights renormalised to sum to 1 when
    `norm_topk_prob` (always in Qwen3.5 MoE, a config switch in Qwen3-Next)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> probabilities [N, E] (fp32), top-k weights [N, k] (x's dtype), experts
        [N, k]."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(logits.dtype), experts


class GroupedExperts(nn.Module):
    """All routed experts' weights as two 3-D parameters, run over rows grouped by expert.

    Under expert parallel, torchtitan's `ExpertParallel` shards both on dim 0 and wraps
    `forward` with its all-to-all dispatch (which pads the groups) and combine.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, backend: str | None):
        super().__init__()
        self.num_experts = num_experts
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        dispatched = isinstance(gate_up, DTensor) and "ep" in gate_up.device_mesh.mesh_dim_names
        if isinstance(gate_up, DTensor):
            # The rows are plain tensors of a data-dependent shape: run on the local experts.
            gate_up, down = gate_up.to_local(), down.to_local()
        backend = resolve_experts_backend(rows.device, self.backend)
        if backend == "loop" or dispatched:
            return experts_swiglu(gate_up, down, rows, tokens_per_expert, backend)
        # Without expert parallel nobody has padded the groups for the grouped GEMMs yet.
        shape, padded, permuted, padded_counts = _permute(rows, tokens_per_expert, 1, len(gate_up))
        out = experts_swiglu(gate_up, down, padded, padded_counts, backend)
        return _unpermute(out, shape, permuted)


class SparseMoeBlock(nn.Module):
    """x [B, T, D] -> (output [B, T, D], router probabilities [B*T, E], experts [B*T, k]).

    The routing is returned, not kept on the module, so that the load-balancing loss reads this
    forward's and a recomputed forward (activation checkpointing) leaves nothing behind.
    """

    def __init__(self, args):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.gate = TopKRouter(
            args.dim, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob
        )
        self.experts = GroupedExperts(
            args.dim, args.moe_hidden_dim, args.num_experts, args.experts_backend
        )
        self.shared_expert = FeedForward(args.dim, args.shared_expert_hidden_dim)
        self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = x.flatten(0, 1)
        probs, weights, experts = self.gate(tokens)
        routed = self.route(tokens, weights, experts)
        shared = torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return (routed + shared).view_as(x), probs, experts

    def route(self, tokens, weights, experts) -> torch.Tensor:
        """Each token through its k experts, outputs summed with their weights."""
        num_experts = self.experts.num_experts
        # Counts in fixed-size bins and a sort: no host sync (histc wants floats on CPU).
        tokens_per_expert = torch.histc(
            experts.flatten().float(), bins=num_experts, min=0, max=num_experts
        ).to(torch.int64)
        order = torch.argsort(experts.flatten(), stable=True)
        out = self.experts(tokens[order // self.top_k], tokens_per_expert)
        unsorted = out.new_empty(out.shape)
        unsorted[order] = out
        per_choice = unsorted.view(-1, self.top_k, tokens.shape[-1])
        return (per_choice * weights.unsqueeze(-1)).sum(dim=1)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, mean=0.0, std=std)
        nn.init.normal_(self.experts.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.experts.down_proj, mean=0.0, std=std)
        for linear in (
            self.shared_expert.gate_proj,
            self.shared_expert.up_proj,
            self.shared_expert.down_proj,
            self.shared_expert_gate,
        ):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
