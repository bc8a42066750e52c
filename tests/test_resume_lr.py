"""A resume with another optimizer.lr keeps the checkpoint's rate (torchtitan restores the
schedule's base rate with its state) and says so, naming optimizer.lr and both rates."""

from __future__ import annotations

import torch
from torchtitan.components.lr_scheduler import LRSchedulersContainer

from titan_gdn.checkpoint import base_rate_change, base_rates


def _schedulers(lr: float) -> LRSchedulersContainer:
    """torchtitan's container over one optimizer at `lr`, with a warm-up of 2 steps."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return LRSchedulersContainer([optimizer], lambda step: min(1.0, (step + 1) / 2))


def _trained(lr: float, steps: int) -> dict:
    schedulers = _schedulers(lr)
    for _ in range(steps):
        schedulers.schedulers[0].optimizer.step()
        schedulers.step()
    return schedulers.state_dict()


def _resumed(saved: dict, lr: float) -> tuple[LRSchedulersContainer, list[float]]:
    """A fresh run at `lr` with the saved schedule state loaded, as a resume builds it; and its
    base rates before the load (the configured optimizer.lr)."""
    schedulers = _schedulers(lr)
    configured = base_rates(schedulers)
    schedulers.load_state_dict(saved)
    return schedulers, configured


def test_a_resume_with_another_lr_keeps_the_checkpoints_rate_and_says_so():
    schedulers, configured = _resumed(_trained(4e-3, steps=4), lr=4e-7)
    assert configured == [4e-7]
    # What torchtitan does: the checkpoint's base rate replaces the configured one.
    assert schedulers.schedulers[0].base_lrs == [4e-3]
    assert base_rate_change(schedulers, configured) == (
        "optimizer.lr = 4e-07 differs from the learning rate the checkpoint of step 4 was "
        "trained with, 0.004: the resumed run keeps the checkpoint's 0.004 (its schedule state "
        "holds the base rate, as torchtitan restores it), and optimizer.lr is not used. Set "
        "optimizer.lr = 0.004 to match, or, to train at 4e-07, start a new run (a new "
        "job.dump_folder) from these weights with checkpoint.initial_load_path"
    )


def test_the_same_lr_or_nothing_restored_says_nothing():
    saved = _trained(4e-3, steps=4)
    assert base_rate_change(*_resumed(saved, lr=4e-3)) is None
    fresh = _schedulers(4e-7)  # a fresh start or a model-only load: no schedule state
    assert base_rate_change(fresh, [4e-7]) is None
