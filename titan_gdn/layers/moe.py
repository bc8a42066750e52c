"""The sparse MoE block of Qwen3.5 MoE and Qwen3-Next, as transformers defines it.

Per token: a softmax router in fp32 picks the top-k experts and (renormalised) weights; each
picked expert runs a SwiGLU with fused gate/up weights, the outputs are summed with their
weights; a shared SwiGLU expert, scaled by sigmoid(shared_expert_gate(x)), is added.

What comes from torchtitan 0.2.2 (models/moe/): the token grouping that its experts and its
`ExpertParallel` dispatch expect (tokens sorted by expert, counts per expert, groups padded to
`TOKEN_GROUP_ALIGN_SIZE_M` rows), so `ExpertParallel` shards `GroupedExperts` and moves its
tokens unchanged. What is ours, because torchtitan's `MoE` has none of it: the router without a
gate bias but with transformers' renormalisation switch, experts with transformers' fused
`gate_up_proj`, weights applied after the experts (torchtitan scales the inputs), the
sigmoid-gated shared expert, the routing each block returns for the load-balancing loss, and,
without expert parallel, the tokens placed into their padded groups by one gather and read back
by one (torchtitan's path sorts, pads, unpads and unsorts: four copies of the routed tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe import utils as torchtitan_moe

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

    `forward(rows, rows_per_group)`: group e is the `rows_per_group[e]` rows after group e-1's,
    padding rows included (their outputs are not read). Under expert parallel, torchtitan's
    `ExpertParallel` shards both weights on dim 0 and wraps `forward` with its all-to-all
    dispatch (which sorts and pads the groups of the local experts) and combine.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, backend: str | None):
        super().__init__()
        self.num_experts = num_experts
        self.backend = backend
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    @property
    def expert_parallel(self) -> bool:
        weight = self.gate_up_proj
        return isinstance(weight, DTensor) and "ep" in weight.device_mesh.mesh_dim_names

    def forward(self, rows: torch.Tensor, rows_per_group: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if isinstance(gate_up, DTensor):
            # The rows are plain tensors of a data-dependent shape: run on the local experts.
            gate_up, down = gate_up.to_local(), down.to_local()
        group_ends = torch.cumsum(rows_per_group, dim=0, dtype=torch.int32)
        backend = resolve_experts_backend(rows.device, self.backend)
        return experts_swiglu(gate_up, down, rows, group_ends, backend)


class GroupDispatch(nn.Module):
    """Tokens into the rows the grouped GEMMs read, without expert parallel: each choice's
    token in its expert's padded group (`padded_slots`). A module without weights so that the
    trainer compiles it with the block's other parts (one gather, fused with its indexing).

    (tokens [N, D], experts [N, k]) -> (rows [N * k + E * alignment, D], the slot of each
    choice [N * k], the rows of each group [E])."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k

    def forward(self, tokens: torch.Tensor, experts: torch.Tensor):
        slots, rows_per_group = padded_slots(experts, self.num_experts)
        # Rows past a group's tokens, and past the last group (the buffer's size is fixed, the
        # groups' sizes are not), read an appended zero row, as in torchtitan's permutation:
        # their outputs are never read, and whatever gradient the grouped GEMMs leave in their
        # rows (the rows past the last group are not written) lands on that row, not a token.
        capacity = len(slots) + self.num_experts * group_alignment()
        token_of_slot = torch.full((capacity,), len(tokens), dtype=slots.dtype, device=slots.device)
        token_of_slot[slots] = torch.arange(len(slots), device=slots.device) // self.top_k
        with_zero_row = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[-1])])
        return with_zero_row[token_of_slot], slots, rows_per_group


class GroupCombine(nn.Module):
    """Each token's k expert outputs, read from their slots, summed with the router's weights:
    (rows [M, D], slots [N * k], weights [N, k]) -> [N, D]. A module without weights, compiled
    by the trainer with the block's other parts (gather, scale and sum in one kernel)."""

    def forward(self, rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor):
        per_choice = rows[slots].view(*weights.shape, rows.shape[-1])
        return (per_choice * weights.unsqueeze(-1)).sum(dim=1)


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
        self.dispatch = GroupDispatch(args.num_experts, args.num_experts_per_tok)
        self.experts = GroupedExperts(
            args.dim, args.moe_hidden_dim, args.num_experts, args.experts_backend
        )
        self.combine = GroupCombine()
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
        layout = self._sorted_by_expert if self.experts.expert_parallel else self.dispatch
        rows, slots, rows_per_group = layout(tokens, experts)
        return self.combine(self.experts(rows, rows_per_group), slots, weights)

    def _sorted_by_expert(self, tokens, experts):
        """The layout expert parallel's dispatch takes: rows sorted by expert, no padding (the
        dispatch pads the groups of each rank's experts after the all-to-all)."""
        order = torch.argsort(experts.flatten(), stable=True)
        slots = torch.empty_like(order)
        slots[order] = torch.arange(len(order), device=order.device)
        counts = choices_per_expert(experts, self.experts.num_experts)
        return tokens[order // self.top_k], slots, counts

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


def group_alignment() -> int:
    """Rows a group of the grouped GEMMs is padded to a multiple of: torchtitan's setting (8
    for bf16; fp8 recipes raise it), read at each call because torchtitan sets it at runtime."""
    return torchtitan_moe.TOKEN_GROUP_ALIGN_SIZE_M


def choices_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the [N, k] choices picked each expert: int64 [E], without a host sync
    (histc wants floats on CPU)."""
    counts = torch.histc(experts.flatten().float(), bins=num_experts, min=0, max=num_experts)
    return counts.to(torch.int64)


def padded_slots(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of the [N, k] choices goes in the rows the grouped GEMMs read: expert e's
    group holds its choices in token order, then padding up to a multiple of the alignment
    (at least one multiple, as torchtitan pads: no empty group); the groups follow each other.
    Returns (the slot of each choice [N * k], the rows of each group [E]); every shape is
    fixed by N, k and E, and nothing is read on the host."""
    choices = experts.flatten()
    counts = choices_per_expert(experts, num_experts)
    align = group_alignment()
    rows_per_group = (counts + align - 1).div(align, rounding_mode="floor").clamp(min=1) * align
    group_start = torch.cumsum(rows_per_group, 0) - rows_per_group
    first_choice = torch.cumsum(counts, 0) - counts  # of each expert, in expert order
    order = torch.argsort(choices, stable=True)  # choices by expert, token order kept
    expert_of_sorted = choices[order]
    rank_in_group = (
        torch.arange(len(choices), device=choices.device) - first_choice[expert_of_sorted]
    )
    slots = torch.empty_like(order)
    slots[order] = group_start[expert_of_sorted] + rank_in_group
    return slots, rows_per_group
