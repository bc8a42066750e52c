"""Stop, or skip, a training step whose loss is NaN or infinite, before the optimizer applies it.

Checked after the last micro-batch's backward and before gradient clipping, on every rank
together (one all-reduce of a flag), so all ranks take the same decision and none waits in a
collective the others skipped. A skipped step leaves the weights and the optimizer state as
they were (its gradients are dropped); its data counts as consumed and the learning-rate
schedule advances.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger


class NonFiniteLossError(RuntimeError):
    """Training stopped at a step whose loss was NaN or infinite."""


class NonFiniteLossGuard:
    def __init__(self, max_skips: int, last_checkpoint: Callable[[], Path | None]):
        """`max_skips`: consecutive bad steps skipped before stopping (0: stop at the first).
        `last_checkpoint`: the checkpoint a rerun would resume from, for the error message."""
        self.max_skips = max_skips
        self.last_checkpoint = last_checkpoint
        self.skipped_in_a_row = 0
        self._step = -1
        self._micro_batches = 0
        self._bad: torch.Tensor | None = None

    def after_backward(
        self,
        step: int,
        loss: torch.Tensor,
        micro_batches_per_step: int,
        parameters: Callable[[], Iterable[torch.nn.Parameter]],
    ) -> None:
        """Record one micro-batch's loss; after the step's last one, let the step go on, skip
        it (drop the gradients of `parameters()`) or raise `NonFiniteLossError`."""
        if step != self._step:
            self._step, self._micro_batches, self._bad = step, 0, None
        bad = ~torch.isfinite(loss.detach()).all()
        self._bad = bad if self._bad is None else self._bad | bad
        self._micro_batches += 1
        if self._micro_batches < micro_batches_per_step:
            return
        if not _on_any_rank(self._bad):
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.max_skips:
            raise NonFiniteLossError(self._stop_message(step))
        for parameter in parameters():
            parameter.grad = None  # the optimizer skips parameters without gradients
        logger.warning(
            f"Skipped step {step}: NaN or infinite loss; weights and optimizer state unchanged "
            f"({self.skipped_in_a_row} in a row, training.skip_nonfinite_loss_steps = "
            f"{self.max_skips})"
        )

    def _stop_message(self, step: int) -> str:
        checkpoint = self.last_checkpoint()
        resume = (
            f"The last complete checkpoint is {checkpoint}; rerunning the command resumes from it"
            if checkpoint is not None
            else "No checkpoint was saved yet (checkpoint.enable, checkpoint.interval)"
        )
        in_a_row = f" ({self.skipped_in_a_row} steps in a row)" if self.skipped_in_a_row > 1 else ""
        return (
            f"Training stopped at step {step}: the loss is NaN or infinite{in_a_row}, and this "
            f"step was not applied. {resume}. To get past it: lower optimizer.lr or raise "
            "lr_scheduler.warmup_steps, check this step's data, or set "
            f"training.skip_nonfinite_loss_steps = N (now {self.max_skips}) to skip up to N "
            "such steps in a row."
        )


def _on_any_rank(flag: torch.Tensor) -> bool:
    flag = flag.to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
