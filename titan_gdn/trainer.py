"""torchtitan's Trainer with this model's batch preparation and a loadable HF export, and the
guards of a long run: the whole config checked before anything is built, checkpoints verified
before they are resumed from, token ids checked against the vocabulary, NaN/inf losses stopped
(or skipped) before the optimizer step. Its console shows what a user acts on
(`QuietConsole`), and a run can end with a sample of text from the trained model
(`[sample]`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from titan_gdn import stop_signals
from titan_gdn.checkpoint import VerifiedCheckpointManager
from titan_gdn.checkpoint_folders import (
    HF_INDEX,
    latest_complete_checkpoint,
    resume_hint,
    step_folder,
)
from titan_gdn.data.vocab_check import check_token_ids
from titan_gdn.generate import encode_prompt, generate, render
from titan_gdn.job_config import setting
from titan_gdn.loss_guard import NonFiniteLossGuard
from titan_gdn.model import Qwen35Model
from titan_gdn.parallel.context_parallel import shard_sequence
from titan_gdn.train_spec import TRAIN_SPEC_NAME
from titan_gdn.validation import validate_job_config

MODEL_ARGS_FILE = "model_args.json"


class QuietConsole(logging.Filter):
    """Drops or shortens torchtitan's records that tell a user nothing to act on: the version
    line, the model arguments as 40 lines of JSON (written to `job.dump_folder`/model_args.json
    instead), the missing safetensors index that only an HF export would use, the peak FLOPS on
    CPU (there is none), torchtitan's failed `lspci` probe (it falls back to the device name,
    which names the GPU), its override of the NCCL error-handling variable (container images
    preset it; torchtitan always sets the value its flight recorder needs, and gloo does not
    read it), the duration of each garbage collection it runs (tools/utils.py: milliseconds,
    at `training.gc_freq` and around checkpoints) and, in a run of one process, its "Sleeping 2
    seconds for other ranks" (there are none). Installed on torchtitan's (root) logger by
    titan_gdn.train; the trainer tells it what the run is."""

    def __init__(self) -> None:
        super().__init__()
        self.hf_export = False
        self.model_args_path = MODEL_ARGS_FILE
        self.single_process = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("torchtitan version:"):
            return False
        if message.startswith("model.safetensors.index.json not found"):
            return self.hf_export
        if message == "Peak FLOPS used for computing MFU: nan":
            return False
        if message.startswith(("ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING]", "Error running lspci")):
            return False
        if message.startswith("[GC] "):
            return False
        if message.startswith("Sleeping 2 seconds for other ranks"):
            return not self.single_process
        if message.startswith("Building ") and "with {" in message:
            # torchtitan's `Trainer.__init__` joins the flavor and "with" without a space.
            head = message.split("with {", 1)[0]
            record.msg, record.args = f"{head} (model args: {self.model_args_path})", None
        return True


QUIET_CONSOLE = QuietConsole()


def prepare_batch(model, tokenizer, parallel_dims, input_dict, labels):
    """Document boundaries from the whole batch, then (with CP) this rank's sequence shard.

    torchtitan's own preparation would reorder tokens with its CP load balancer and shard
    only flex block masks; here the boundaries stay global and the shards contiguous.
    """
    inputs = input_dict["input"]
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    # With CP over sequence chunks, attention runs this rank's chunk of queries.
    queries = model.state_passing.queries(inputs.shape[1])
    # chunked_loss: the TrainSpec's loss (titan_gdn.loss) takes hidden states in place of
    # logits, so the model may skip the full-sequence logits.
    extra_kwargs: dict[str, Any] = {
        "attention_masks": model.get_attention_masks(
            inputs, tokenizer, extra_inputs, queries=queries
        ),
        "chunked_loss": True,
    }
    if parallel_dims.cp_enabled:
        cp_mesh = parallel_dims.get_mesh("cp")
        inputs, labels = shard_sequence(inputs, cp_mesh), shard_sequence(labels, cp_mesh)
    return inputs, labels, extra_inputs, extra_kwargs


class Qwen35Trainer(Trainer):
    def __init__(self, job_config) -> None:
        # Before torchtitan's init: no process group, data loader or model exists yet, so a
        # bad setting costs seconds, and every problem is reported at once.
        if job_config.model.name == TRAIN_SPEC_NAME:
            validate_job_config(job_config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        checkpoint = job_config.checkpoint
        QUIET_CONSOLE.hf_export = checkpoint.enable and checkpoint.last_save_in_hf
        QUIET_CONSOLE.model_args_path = os.path.join(job_config.job.dump_folder, MODEL_ARGS_FILE)
        QUIET_CONSOLE.single_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
        _warmup_within_the_run(job_config)
        super().__init__(job_config)
        # torchtitan's Trainer builds its CheckpointManager inline; ours adds behaviour only
        # (checksums at save, verified at load), so the instance takes its class.
        self.checkpointer.__class__ = VerifiedCheckpointManager
        self._write_model_args(QUIET_CONSOLE.model_args_path)
        stop_signals.report_progress_with(self._progress, close=self.metrics_processor.close)
        self._progress_started = False
        self._cudagraphs = setting(job_config, "compile", "cudagraphs")
        self._loss_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.loss_fn = self._guarded_loss_fn(self.loss_fn)
        self.loss_guard = NonFiniteLossGuard(
            max_skips=setting(job_config, "training", "skip_nonfinite_loss_steps"),
            resume_hint=self._resume_hint,
        )

    def _last_checkpoint(self):
        """The checkpoint a rerun resumes from, or None."""
        enabled = self.job_config.checkpoint.enable
        return latest_complete_checkpoint(self.job_config) if enabled else None

    def _progress(self) -> tuple[int, str]:
        """The step in progress and how a rerun resumes, for the line a Ctrl-C prints."""
        return self.step, self._resume_hint()

    def _resume_hint(self) -> str:
        return resume_hint(self.job_config.checkpoint.enable, self._last_checkpoint())

    def _write_model_args(self, path: str) -> None:
        if _rank() != 0 or not dataclasses.is_dataclass(self.model_args):
            return
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as file:
            json.dump(dataclasses.asdict(self.model_args), file, indent=2, default=str)

    def batch_generator(self, data_iterable):
        return super().batch_generator(self._checked_token_ids(data_iterable))

    def _checked_token_ids(self, data_iterable):
        vocab_size = getattr(self.model_args, "vocab_size", None)
        model = self.job_config.model
        for input_dict, labels in data_iterable:
            if vocab_size is not None:
                check_token_ids(
                    input_dict["input"], labels, vocab_size, model.flavor, model.hf_assets_path
                )
            yield input_dict, labels

    def train_step(self, data_iterator) -> None:
        start_progress = getattr(self.metrics_processor, "start_progress", None)
        if start_progress is not None and not self._progress_started:
            self._progress_started = True
            start_progress(self.step - 1)  # train() has already counted this step
        super().train_step(data_iterator)
        last_step = self.step == self.job_config.training.steps
        if last_step or self.checkpointer._should_save(self.step, last_step):
            # A step the optimizer skipped for its gradient is known here at the latest: no
            # checkpoint is written after a step that stops the run.
            self.loss_guard.settle()

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        self._global_valid_tokens = global_valid_tokens
        if self._cudagraphs:
            # A new step: the last step's graph outputs are dead, their memory may be replayed
            # into (torch's CUDA graph trees cannot tell where a training step begins).
            torch.compiler.cudagraph_mark_step_begin()
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        self._rows_max_loss(loss, labels, global_valid_tokens)
        self.loss_guard.after_backward(
            self.step,
            self.gradient_accumulation_steps,
            parameters=lambda: (p for part in self.model_parts for p in part.parameters()),
            optimizers=getattr(self.optimizers, "optimizers", ()),
        )
        return loss

    def _rows_max_loss(self, loss, labels, global_valid_tokens) -> None:
        """Under context parallel, on a step that is logged: the largest data-parallel rank's
        loss (its context-parallel ranks' parts summed, over its rows' tokens), which
        torchtitan's max loss would take per rank part (see `Qwen35MetricsProcessor`)."""
        if self.parallel_dims.cp == 1 or not self.metrics_processor.should_log(self.step):
            return
        self._loss_parts.append((loss.detach(), (labels != IGNORE_INDEX).sum()))
        if len(self._loss_parts) < self.gradient_accumulation_steps:
            return
        losses, tokens = (torch.stack(part).sum() for part in zip(*self._loss_parts, strict=True))
        self._loss_parts = []
        rows_loss = losses * global_valid_tokens / tokens  # this rank's part, over its rows
        rows_loss = funcol.all_reduce(rows_loss, "sum", group=self.parallel_dims.get_mesh("cp"))
        batch = self.parallel_dims.get_optional_mesh("batch")
        if batch is not None:
            rows_loss = funcol.all_reduce(rows_loss, "max", group=batch)
        # Read when the step is logged, after the optimizer is launched: no wait here.
        self.metrics_processor.rows_max_loss = rows_loss

    def _guarded_loss_fn(self, loss_fn):
        """`loss_fn`, handing the guard each micro-batch's loss as the trainer scales it (over
        the global token count: zero valid tokens make it NaN too) before backward starts."""

        def guarded(pred, labels):
            loss_sum = loss_fn(pred, labels)
            self.loss_guard.record(loss_sum.detach() / self._global_valid_tokens)
            return loss_sum

        return guarded

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        model = self.model_parts[0]
        if not isinstance(model, Qwen35Model):  # e.g. torchtitan's llama3 in runtime tests
            return super().post_dataloading_process(input_dict, labels)
        return prepare_batch(model, self.tokenizer, self.parallel_dims, input_dict, labels)

    def train(self) -> None:
        super().train()
        self.complete_hf_export()
        self.print_sample()

    def close(self) -> None:
        super().close()
        if sys.exc_info()[0] is None:  # torchtitan's main closes a failed run inside `except`
            self._remove_empty_trace_folder()

    def _remove_empty_trace_folder(self) -> None:
        """torchtitan creates `job.dump_folder`/`comm.save_traces_folder` at start for the flight
        recorder's dumps of a timed-out collective (distributed/utils.py:init_distributed); a
        run that ends well leaves it empty. A failed run keeps it: another rank may still dump
        there."""
        comm = self.job_config.comm
        if comm.trace_buf_size > 0:
            with contextlib.suppress(OSError):  # not empty, or another rank removed it
                os.rmdir(os.path.join(self.job_config.job.dump_folder, comm.save_traces_folder))

    def print_sample(self) -> None:
        """`[sample] prompt`'s continuation by the model as trained, printed to stdout (as
        `python -m titan_gdn.generate --ignore-eos` would print it from the last checkpoint):
        `max_new_tokens` tokens, across document ends, since a document of the training data
        may end a few tokens after the prompt."""
        if not setting(self.job_config, "sample", "prompt"):
            return
        sample = self.job_config.sample
        if len(self.model_parts) != 1 or _world_size() != 1:
            logger.info(
                "[sample] runs in a single process; sample the checkpoint with "
                "python -m titan_gdn.generate --checkpoint <step folder> --prompt ..."
            )
            return
        model = self.model_parts[0]
        prompt_ids = encode_prompt(self.tokenizer, sample.prompt)
        was_training = model.training
        model.eval()
        try:
            new_ids = generate(
                model,
                self.tokenizer,
                prompt_ids,
                sample.max_new_tokens,
                temperature=sample.temperature,
                top_k=sample.top_k,
                seed=sample.seed,
                stop_at_eos=False,
            )
        finally:
            model.train(was_training)
        mode = "greedy" if sample.temperature == 0 else f"temperature {sample.temperature}"
        logger.info(f"Sample after step {self.step} ({mode}, {len(new_ids)} new tokens):")
        print(render(self.tokenizer, sample.prompt, prompt_ids, new_ids), flush=True)

    def complete_hf_export(self) -> None:
        """Add config.json and the tokenizer to the `checkpoint.last_save_in_hf` export.

        torchtitan writes only the safetensors and their index there
        (components/checkpoint.py:_save_last_step); transformers needs the config too.
        """
        checkpoint = self.job_config.checkpoint
        if not (checkpoint.enable and checkpoint.last_save_in_hf):
            return
        if _rank() != 0:
            return
        folder = step_folder(self.checkpointer.folder, self.step)
        if (folder / HF_INDEX).is_file():
            self.checkpointer.sd_adapter.save_hf_metadata(str(folder), checkpoint.export_dtype)


def _warmup_within_the_run(job_config) -> None:
    """A warm-up longer than the schedule, shortened to the schedule: lr_scheduler.total_steps
    where set (a run continued later keeps its schedule), else training.steps. torchtitan does
    the same to its own copy (components/lr_scheduler.py, with a warning) but then logs the
    configured value ("total steps 4 (warmup 5)"); shortened here, the schedule is the same and
    the log true."""
    scheduler = job_config.lr_scheduler
    total = (
        scheduler.total_steps if scheduler.total_steps is not None else job_config.training.steps
    )
    scheduler.warmup_steps = min(scheduler.warmup_steps, total)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
