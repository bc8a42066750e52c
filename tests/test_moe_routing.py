"""The MoE block's routing without expert parallel (titan_gdn/layers/moe.py): each choice's slot
in the padded groups the grouped GEMMs read, and the block's output and gradients against
a per-token fp64 sum over its k experts written out directly."""

import copy

import pytest
import torch
import torch.nn.functional as F

from titan_gdn.layers import moe
from titan_gdn.layers.moe import SparseMoeBlock, group_alignment, padded_slots
from titan_gdn.model import qwen3_5_args
from titan_gdn.ops.experts import experts_swiglu


def _random_choices(tokens: int, top_k: int, num_experts: int, seed: int) -> torch.Tensor:
    """[tokens, k] distinct experts per token, skewed so that some experts get none."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=generator)
    scores[:, : num_experts // 4] += 0.6  # a quarter of the experts take most choices
    scores[:, -2:] = -1.0  # and two take none
    return scores.topk(top_k, dim=-1).indices


@pytest.mark.parametrize("tokens, top_k, num_experts", [(1, 1, 4), (37, 2, 8), (300, 8, 64)])
def test_slots_place_each_choice_in_its_experts_padded_group(tokens, top_k, num_experts):
    experts = _random_choices(tokens, top_k, num_experts, seed=tokens)
    slots, rows_per_group = padded_slots(experts, num_experts)
    align = group_alignment()
    group_end = rows_per_group.cumsum(0).tolist()
    group_start = [0, *group_end[:-1]]
    counts = torch.bincount(experts.flatten(), minlength=num_experts).tolist()
    for expert in range(num_experts):
        size = rows_per_group[expert].item()
        assert size % align == 0 and size >= max(counts[expert], 1)
        assert size < max(counts[expert], 1) + align  # no more padding than the alignment asks
        # its choices fill the group's first rows, in token order
        chosen = (experts.flatten() == expert).nonzero().flatten()
        want = list(range(group_start[expert], group_start[expert] + counts[expert]))
        assert slots[chosen].tolist() == want
    assert len(set(slots.tolist())) == len(slots)
    assert rows_per_group.sum() <= len(slots) + num_experts * align  # the route's static buffer


def _block(backend: str) -> SparseMoeBlock:
    args = copy.deepcopy(qwen3_5_args["debugmoe"])
    args.experts_backend = backend
    torch.manual_seed(0)
    block = SparseMoeBlock(args).double()
    block.init_weights(0.2)
    return block


def _per_token_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token through its own k experts, one at a time, summed with the router's weights."""
    tokens = x.flatten(0, 1)
    _, weights, experts = block.gate(tokens)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    rows = []
    for token, picks, picked_weights in zip(tokens, experts, weights, strict=True):
        total = 0
        for expert, weight in zip(picks.tolist(), picked_weights, strict=True):
            gate, up = F.linear(token, gate_up[expert]).chunk(2)
            total = total + weight * F.linear(F.silu(gate) * up, down[expert])
        rows.append(total)
    shared = torch.sigmoid(block.shared_expert_gate(tokens)) * block.shared_expert(tokens)
    return (torch.stack(rows) + shared).view_as(x)


def test_block_output_and_gradients_equal_the_per_token_sum():
    block = _block("loop")
    reference = copy.deepcopy(block)
    x = torch.randn(2, 23, block.gate.weight.shape[1], dtype=torch.float64)
    out, _, _ = block(x.clone().requires_grad_())
    want = _per_token_reference(reference, x)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    probe = torch.randn_like(out)
    (out * probe).sum().backward()
    (want * probe).sum().backward()
    for (name, got), expected in zip(block.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_grouped_gemm_forward_reads_the_same_groups_as_the_loop(monkeypatch):
    """torch._grouped_mm runs forward on CPU, though the backend choice keeps it for CUDA
    (its backward is CUDA-only: tests/gpu/test_moe_gpu.py): the padded groups it reads give
    the loop's output."""
    loop = _block("loop").float()
    grouped = copy.deepcopy(loop)
    monkeypatch.setattr(moe, "resolve_experts_backend", lambda device, requested: requested)
    grouped.experts.backend = "grouped_mm"
    x = torch.randn(1, 64, loop.gate.weight.shape[1])
    with torch.no_grad():
        want, _, _ = loop(x)
        got, _, _ = grouped(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_the_grouped_gemms_leave_past_the_groups_reaches_no_token(monkeypatch):
    block = _block("loop")
    reference = copy.deepcopy(block)

    def experts_leaving_the_tail_unwritten(gate_up, down, rows, group_ends, backend):
        """The loop, whose input gradient then has NaN in the rows past the last group, as a
        grouped GEMM's may (it does not write those rows)."""
        tail = torch.arange(int(group_ends[-1]), len(rows))
        rows.register_hook(lambda grad: grad.index_fill(0, tail, float("nan")))
        return experts_swiglu(gate_up, down, rows, group_ends, backend)

    monkeypatch.setattr(moe, "experts_swiglu", experts_leaving_the_tail_unwritten)
    x = torch.randn(1, 29, block.gate.weight.shape[1], dtype=torch.float64)
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    block(got)[0].sum().backward()
    _per_token_reference(reference, want).sum().backward()
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)
