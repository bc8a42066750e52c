"""Stop, or skip, a training step whose loss or gradient is NaN or infinite, before the
optimizer applies it.

Each micro-batch's loss is checked where it is computed, before its backward (`record`): the
flag is agreed over the ranks (one all-reduce of a flag, so all ranks take the same decision and
none waits in a collective the others skipped) and copied to the host without waiting. After the
step's last backward has been launched, `after_backward` reads those flags: it waits only for the
forward passes, which the device has long finished by then, so the host keeps the device's queue
full (reading the loss after backward would wait for the whole backward each step, and leave the
device idle while the host then launches gradient clipping, the optimizer and the next batch).

A finite loss can still have a NaN or infinite gradient (an overflow in backward). Its flag is
set on the device after the last backward, before clipping; the fused optimizer takes it as
`found_inf` (as with a gradient scaler) and leaves weights and moments untouched on the device,
so the host learns of it later without waiting: at the next step, before a checkpoint is
written, and at the end of the run. Another optimizer implementation has no `found_inf`, so
there the host waits for the flag each step.

A skipped step leaves the weights and the optimizer state as they were (its gradients are
dropped); its data counts as consumed and the learning-rate schedule advances.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

# What was NaN or infinite: (as the stop message says it, as the skip warning says it).
LOSS = ("the loss is NaN or infinite", "NaN or infinite loss")
GRADIENT = (
    "the gradient is NaN or infinite, the loss finite (an overflow in backward)",
    "NaN or infinite gradient, finite loss",
)


class NonFiniteLossError(RuntimeError):
    """Training stopped at a step whose loss or gradient was NaN or infinite."""


class NonFiniteLossGuard:
    def __init__(self, max_skips: int, resume_hint: Callable[[], str]):
        """`max_skips`: consecutive bad steps skipped before stopping (0: stop at the first).
        `resume_hint`: how a rerun goes on, for the error message (`checkpoint_folders`)."""
        self.max_skips = max_skips
        self.resume_hint = resume_hint
        self.skipped_in_a_row = 0
        self._pending: list[_HostFlag] = []
        self._gradient_flags: list[tuple[int, _HostFlag]] = []

    def record(self, loss: torch.Tensor) -> None:
        """Check one micro-batch's loss (the value backward starts from), before its backward."""
        self._pending.append(_HostFlag(_agreed(~torch.isfinite(loss.detach()).all())))

    def after_backward(
        self,
        step: int,
        micro_batches_per_step: int,
        parameters: Callable[[], Iterable[torch.nn.Parameter]],
        optimizers: Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        """After the step's last micro-batch: let the step go on, skip it (drop the gradients of
        `parameters()`, or tell `optimizers` to skip it) or raise `NonFiniteLossError`."""
        if len(self._pending) < micro_batches_per_step:
            return
        self.settle()  # earlier steps' gradient flags: long computed by now
        bad = any(flag.value() for flag in self._pending)
        self._pending = []
        optimizers = list(optimizers)
        if bad:
            _skip_in(optimizers, None)
            self._skip(step, LOSS, parameters)
            return
        bad_gradient = _agreed(_nonfinite(parameters()))
        if optimizers and all(_takes_found_inf(optimizer) for optimizer in optimizers):
            _skip_in(optimizers, bad_gradient)
            self._gradient_flags.append((step, _HostFlag(bad_gradient)))
        elif bad_gradient.item():
            self._skip(step, GRADIENT, parameters)
        else:
            self.skipped_in_a_row = 0

    def settle(self) -> None:
        """Read the gradient flags of the steps the optimizer has taken (skipping the bad ones
        on the device): count them, warn, or raise `NonFiniteLossError`."""
        flags, self._gradient_flags = self._gradient_flags, []
        for step, flag in flags:
            if flag.value():
                self._skip(step, GRADIENT)
            else:
                self.skipped_in_a_row = 0

    def _skip(self, step: int, what: tuple[str, str], parameters=None) -> None:
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row > self.max_skips:
            raise NonFiniteLossError(self._stop_message(step, what[0]))
        for parameter in parameters() if parameters is not None else ():
            parameter.grad = None  # the optimizer skips parameters without gradients
        logger.warning(
            f"Skipped step {step}: {what[1]}; weights and optimizer state unchanged "
            f"({self.skipped_in_a_row} in a row, training.skip_nonfinite_loss_steps = "
            f"{self.max_skips})"
        )

    def _stop_message(self, step: int, what: str) -> str:
        in_a_row = f" ({self.skipped_in_a_row} steps in a row)" if self.skipped_in_a_row > 1 else ""
        return (
            f"Training stopped at step {step}: {what}{in_a_row}, and this step was not "
            f"applied; {self.resume_hint()}. To get past it: lower optimizer.lr or raise "
            "lr_scheduler.warmup_steps, check this step's data, or set "
            f"training.skip_nonfinite_loss_steps = N (now {self.max_skips}) to skip up to N "
            "such steps in a row."
        )


def _agreed(flag: torch.Tensor) -> torch.Tensor:
    """A rank's flag as an int32 that every rank holds the same (the max over the ranks)."""
    flag = flag.to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def _nonfinite(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Whether this rank's gradients hold a NaN or infinity, or a norm past fp32's range (as
    clipping's would be), on the device: one fused norm per dtype over every gradient."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    device = None
    for parameter in parameters:
        device = parameter.device
        if parameter.grad is not None:
            grad = parameter.grad
            grad = grad.to_local() if isinstance(grad, DTensor) else grad
            by_dtype.setdefault(grad.dtype, []).append(grad)
    norms = [norm.float() for grads in by_dtype.values() for norm in torch._foreach_norm(grads)]
    if not norms:
        return torch.zeros((), dtype=torch.bool, device=device)
    return ~torch.isfinite(torch.stack(norms).square().sum())


def _takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    # torch's fused Adam and AdamW read `found_inf` and skip the update on the device.
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(
        optimizer.defaults.get("fused")
    )


def _skip_in(optimizers: list[torch.optim.Optimizer], flag: torch.Tensor | None) -> None:
    for optimizer in optimizers:
        if _takes_found_inf(optimizer):
            optimizer.found_inf = None if flag is None else flag.float()


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
