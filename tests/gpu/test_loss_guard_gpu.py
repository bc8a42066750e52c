"""The non-finite guard on a GPU: flags copied to pinned host memory and read later, and the
fused CUDA AdamW skipping a step with a NaN or infinite gradient through `found_inf`."""

import math
import random

import pytest
import torch

from titan_gdn.loss_guard import NonFiniteLossError, NonFiniteLossGuard

pytestmark = pytest.mark.gpu


def test_fused_adamw_on_the_gpu_skips_a_step_with_a_nonfinite_gradient():
    parameters = [torch.nn.Parameter(torch.randn(64, 32, device="cuda")) for _ in range(3)]
    optimizer = torch.optim.AdamW(parameters, lr=0.1, fused=True)
    guard = NonFiniteLossGuard(max_skips=1, resume_hint=lambda: "a rerun starts at step 1")

    def step(number: int, bad_loss: bool = False, bad_gradient: bool = False) -> None:
        for parameter in parameters:
            parameter.grad = torch.randn_like(parameter)
        if bad_gradient:
            grad = parameters[random.randrange(3)].grad
            grad.view(-1)[random.randrange(grad.numel())] = random.choice([math.inf, math.nan])
        guard.record(torch.tensor(math.nan if bad_loss else 2.0, device="cuda"))
        guard.after_backward(number, 1, lambda: parameters, [optimizer])
        optimizer.step()

    step(1)
    kept = [p.detach().clone() for p in parameters]
    moments = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in parameters]
    step(2, bad_gradient=True)  # skipped on the device; the host has not looked yet
    assert guard.skipped_in_a_row == 0
    guard.settle()
    assert guard.skipped_in_a_row == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, parameters, strict=True))
    for parameter, before in zip(parameters, moments, strict=True):
        assert all(torch.equal(v, optimizer.state[parameter][k]) for k, v in before.items())
    step(3)
    guard.settle()
    assert guard.skipped_in_a_row == 0
    assert all(not torch.equal(a, b) for a, b in zip(kept, parameters, strict=True))
    assert all(torch.isfinite(p).all() for p in parameters)
    step(4, bad_loss=True)  # gradients dropped, the step counted
    assert guard.skipped_in_a_row == 1
    with pytest.raises(NonFiniteLossError, match="^Training stopped at step 5: the gradient"):
        step(5, bad_gradient=True)
        guard.settle()
