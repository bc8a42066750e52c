"""The trainer that `run_train.sh` runs, with its steps timed: what every benchmark measures.

`TimedTrainer` is `titan_gdn.trainer.Qwen35Trainer`, built from the same TOML config and
command-line overrides, and trained by its own `train()` loop (data loader, batch checks, loss
guard, metrics, optimizer and LR schedule as a user gets them). It adds only what measuring
needs: a stop after `warmup + steps` steps, a device synchronization around each step to time
it, the losses and rows it saw, and an optional profiled last step. The profiled step trains on
the last timed step's rows again: where rows differ in their documents (the long-tailed corpus),
its breakdown and GPU-busy time are those of a step whose time was measured, not of a new row.

Imported after `titan_gdn.cpu.use_cpu_if_no_accelerator()`: torchtitan's trainer module copies
the device type at import time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from titan_gdn.trainer import Qwen35Trainer


class TimedTrainer(Qwen35Trainer):
    def __init__(
        self,
        job_config,
        warmup: int,
        steps: int,
        synchronize: Callable[[], None],
        reset_peak_memory: Callable[[], None],
        profiled_step: Callable[[TimedTrainer], contextlib.AbstractContextManager] | None = None,
    ):
        super().__init__(job_config)
        self.warmup, self.timed_steps = warmup, steps
        self.synchronize, self.reset_peak_memory = synchronize, reset_peak_memory
        self.profiled_step = profiled_step
        self.step_seconds: list[float] = []  # each timed step, synchronized before and after
        self.host_seconds: list[float] = []  # until the step's call returned
        self.losses: list[torch.Tensor] = []  # every step's (summed over micro-batches)
        self._micro_batch_losses: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []  # every micro-batch's input ids, as the loader gave them
        self._step_batches: list[tuple[dict, torch.Tensor]] = []  # the last step's, on the host

    def should_continue_training(self) -> bool:
        last = self.warmup + self.timed_steps + (self.profiled_step is not None)
        return self.step < last

    def batch_generator(self, data_iterable):
        batches = super().batch_generator(data_iterable)
        while True:
            if self._is_profiled_step():
                yield from self._replayed(self._step_batches)
                continue  # resumed by the step after it (benchmarks.host_profile runs more)
            if len(self._step_batches) == self.gradient_accumulation_steps:
                self._step_batches = []
            input_dict, labels = next(batches)
            self.rows.append(input_dict["input"])
            # A copy of the dict: the trainer puts device copies of the tensors into its own.
            self._step_batches.append((dict(input_dict), labels))
            yield input_dict, labels

    def _is_profiled_step(self) -> bool:
        return self.profiled_step is not None and self.step - 1 == self.warmup + self.timed_steps

    @staticmethod
    def _replayed(batches):
        for input_dict, labels in batches:
            yield dict(input_dict), labels

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        self._micro_batch_losses.append(loss.detach())
        return loss

    def train_step(self, data_iterator) -> None:
        self._micro_batch_losses = []
        self._timed_train_step(data_iterator)
        self.losses.append(torch.stack(self._micro_batch_losses).sum())

    def _timed_train_step(self, data_iterator) -> None:
        index = self.step - 1  # train() counts steps from 1
        if index == self.warmup + self.timed_steps:
            with self.profiled_step(self):
                super().train_step(data_iterator)
            return
        if index == self.warmup:
            self.reset_peak_memory()
        self.synchronize()
        start = time.perf_counter()
        super().train_step(data_iterator)
        returned = time.perf_counter()
        self.synchronize()
        if index >= self.warmup:
            self.step_seconds.append(time.perf_counter() - start)
            self.host_seconds.append(returned - start)

    def tokens_per_step(self) -> int:
        """Tokens one step trains on over all ranks (every row of every micro-batch)."""
        batch = self.job_config.training
        dp = self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard
        return batch.local_batch_size * batch.seq_len * self.gradient_accumulation_steps * dp

    def measured_losses(self) -> list[torch.Tensor]:
        """The losses of the warm-up and timed steps (not the profiled one)."""
        return self.losses[: self.warmup + self.timed_steps]

    def timed_rows(self) -> list[torch.Tensor]:
        """The input ids of the timed steps' micro-batches (what the profiled step replays is
        the last of them)."""
        per_step = self.gradient_accumulation_steps
        return self.rows[self.warmup * per_step : (self.warmup + self.timed_steps) * per_step]
