"""Stop, or skip, a training step whose loss is NaN or infinite, before the optimizer applies it.

Each micro-batch's loss is checked where it is computed, before its backward (`record`): the
flag is agreed over the ranks (one all-reduce of a flag, so all ranks take the same decision and
none waits in a collective the others skipped) and copied to the host without waiting. After the
step's last backward has been launched, `after_backward` reads those flags: it waits only for the
forward passes, which the device has long finished by then, so the host keeps the device's queue
full (reading the loss after backward would wait for the whole backward each step, and leave the
device idle while the host then launches gradient clipping, the optimizer and the next batch).
A skipped step leaves the weights and the optimizer state as they were (its gradients are
dropped); its data counts as consumed and the learning-rate schedule advances.
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
        self._pending: list[_HostFlag] = []

    def record(self, loss: torch.Tensor) -> None:
        """Check one micro-batch's loss (the value backward starts from), before its backward."""
        bad = (~torch.isfinite(loss.detach()).all()).to(torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self._pending.append(_HostFlag(bad))

    def after_backward(
        self,
        step: int,
        micro_batches_per_step: int,
        parameters: Callable[[], Iterable[torch.nn.Parameter]],
    ) -> None:
        """After the step's last micro-batch: let the step go on, skip it (drop the gradients of
        `parameters()`) or raise `NonFiniteLossError`."""
        if len(self._pending) < micro_batches_per_step:
            return
        bad = any(flag.value() for flag in self._pending)
        self._pending = []
        if not bad:
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


class _HostFlag:
    """A device flag on its way to the host: copied without blocking, read when needed (then
    waiting for the copy alone, not for the work queued after it)."""

    def __init__(self, flag: torch.Tensor):
        if flag.device.type != "cuda":
            self._host, self._copied = flag, None
            return
        self._host = torch.empty_like(flag, device="cpu", pin_memory=True)
        self._host.copy_(flag, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def value(self) -> bool:
        if self._copied is not None:
            self._copied.synchronize()
        return bool(self._host.item())
