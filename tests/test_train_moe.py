"""Training the debug MoE model with run_train.sh (CPU + gloo): expert parallel over the
context-parallel ranks gives the single-process losses, and the log shows the aux loss."""

from __future__ import annotations

import pytest
import torch

from tests.test_train_qwen import (
    REPO,
    _finish_side_by_side,
    _five_steps_from_one_seed_checkpoint,
    _start,
    _tensorboard,
    _train,
)

MOE_CONFIG = REPO / "train_configs" / "debug_moe.toml"

pytestmark = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="CPU runs (gloo); GPU runs live in tests/gpu"
)


def _train_moe_ok(dump, *overrides: str, ngpu: int = 1):
    code, output, steps = _train(dump, *overrides, ngpu=ngpu, config=MOE_CONFIG)
    assert code == 0, output[-6000:]
    return output, steps


def test_expert_and_context_parallel_run_gives_the_single_process_losses(tmp_path):
    """ep = 2 x cp = 2 on 2 ranks vs 1 rank, from one seed checkpoint, same global batch."""
    common = _five_steps_from_one_seed_checkpoint(_train_moe_ok, tmp_path)
    # Started together: the one-process run leaves a core free most of the time.
    runs = _finish_side_by_side(
        [
            _start(tmp_path / "one", *common, config=MOE_CONFIG),
            _start(
                tmp_path / "ep2cp2",
                *common,
                "--parallelism.context_parallel_degree", "2",
                "--parallelism.expert_parallel_degree", "2",
                ngpu=2,
                config=MOE_CONFIG,
            ),
        ]
    )  # fmt: skip
    for code, output, _ in runs:
        assert code == 0, output[-6000:]
    (_, output, single), (_, _, sharded) = runs
    assert "aux_loss: " in output
    assert sorted(single) == sorted(sharded) == [1, 2, 3, 4, 5]
    for tag in ("loss_metrics/global_avg_loss", "loss_metrics/router_aux_loss"):
        reference = _tensorboard(tmp_path / "one")[tag]
        values = _tensorboard(tmp_path / "ep2cp2")[tag]
        for step, value in reference.items():
            assert abs(values[step] - value) <= 1e-4 * value, (tag, step, values[step], value)
    losses = _tensorboard(tmp_path / "ep2cp2")["loss_metrics/global_avg_loss"]
    assert losses[5] < losses[1]
