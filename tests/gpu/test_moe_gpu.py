"""The MoE block's CUDA path (grouped GEMMs over the padded groups `SparseMoeBlock.route` builds)
against its fp32 loop reference, eager and compiled; and the 35B-A3B-shaped block in bf16."""

import copy

import pytest
import torch

from tests.conftest import relative_error
from titan_gdn.layers.moe import SparseMoeBlock
from titan_gdn.model import qwen3_5_args

pytestmark = pytest.mark.gpu


def _block(flavor: str, backend: str, seed: int = 0) -> SparseMoeBlock:
    args = copy.deepcopy(qwen3_5_args[flavor])
    args.experts_backend = backend
    torch.manual_seed(seed)
    block = SparseMoeBlock(args).cuda()
    block.init_weights(0.02)
    return block


def _outputs_and_grads(block, x):
    x = x.clone().requires_grad_()
    out, probs, experts = block(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
    # torch.compile'd children name their parameters "<child>._orig_mod.<name>".
    grads = {name.replace("._orig_mod", ""): p.grad for name, p in block.named_parameters()}
    return out.detach(), experts, x.grad, grads


@pytest.mark.parametrize("flavor, tokens", [("debugmoe", 4096), ("35B-A3B", 8192)])
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_mm_experts_match_the_fp32_loop(flavor, tokens, compiled):
    reference = _block(flavor, "loop")
    grouped = copy.deepcopy(reference)
    grouped.experts.backend = "grouped_mm"
    # Under autocast the router's GEMM runs in bf16 and picks other experts at near ties; this
    # test is about the experts, so both blocks route in fp32 and pick the same ones.
    grouped.gate.forward = torch.autocast("cuda", enabled=False)(grouped.gate.forward)
    if compiled:  # as parallelize compiles an MoE block: all but the routed experts
        for name in ("gate", "dispatch", "combine", "shared_expert", "shared_expert_gate"):
            setattr(grouped, name, torch.compile(getattr(grouped, name), fullgraph=True))
    x = torch.randn(2, tokens // 2, reference.gate.weight.shape[1], device="cuda")
    want = _outputs_and_grads(reference, x)
    with torch.autocast("cuda", torch.bfloat16):
        got = _outputs_and_grads(grouped, x)
    mismatched = (got[1] != want[1]).any(-1).sum().item()
    assert mismatched == 0, f"{mismatched} of {tokens} tokens routed to other experts"
    errors = {"out": relative_error(got[0], want[0]), "x": relative_error(got[2], want[2])}
    errors |= {name: relative_error(got[3][name], want[3][name]) for name in want[3]}
    print({k: f"{v:.2e}" for k, v in errors.items()})
    # bf16 GEMMs against fp32: a few 1e-3 of relative error, as the other bf16 kernels.
    assert max(errors.values()) <= 1e-2, errors


def test_experts_left_without_tokens_get_zero_gradients():
    block = _block("debugmoe", "grouped_mm")
    x = torch.randn(1, 64, block.gate.weight.shape[1], device="cuda")
    with torch.no_grad():  # every token to experts 0 and 1
        block.gate.weight.zero_()
        block.gate.weight[:2] = 1.0
        x.abs_()
    out, _, experts = block(x)
    assert set(experts.unique().tolist()) == {0, 1}
    out.sum().backward()
    grad = block.experts.gate_up_proj.grad
    assert grad[2:].abs().max() == 0 and grad[:2].abs().max() > 0
