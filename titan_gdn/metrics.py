"""torchtitan's training metrics plus the packed documents per step, and an MFU that follows them.

torchtitan 0.2.2's Trainer shows its metrics processor only token counts, never the batches
(``Trainer.batch_generator``), so the training data loader counts documents (and the causal
pairs that attention computes within them) into :data:`TRAINING_DOCUMENTS` as it hands out
batches, and :class:`Qwen35MetricsProcessor` reads that tally at each log.

Its step line keeps torchtitan's head, which log readers parse (scripts/summarize_runs.py), and
ends with the run's progress; tflops and MFU appear only where the device's peak is known:

    step: 10  loss:  5.83489  grad_norm:  1.2331  memory:  0.92GiB(3.91%)  tps: 385  docs: 13.6
    progress: 10/60  elapsed: 0:14  eta: 1:08          (one line)
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    WandBLogger,
)
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from titan_gdn.loss import ROUTER_AUX_LOSS
from titan_gdn.model.flops import attention_flops_per_token, one_document_pairs_per_token

DOCUMENTS_METRIC = "documents_per_step"
# MoE models: transformers' load-balancing loss, averaged over the micro-batches since the last
# log (the loss above includes it, times router_aux_loss_coef).
AUX_LOSS_METRIC = "loss_metrics/router_aux_loss"


class DocumentTally:
    """What this rank's training loader handed out since the last log: documents, batches,
    tokens, and the causal (query, key) pairs within documents, which attention's cost follows."""

    def __init__(self) -> None:
        self.documents = self.batches = self.tokens = self.causal_pairs = 0

    def add(self, documents: int, tokens: int = 0, causal_pairs: int = 0) -> None:
        self.documents += documents
        self.batches += 1
        self.tokens += tokens
        self.causal_pairs += causal_pairs

    def take(self) -> tuple[int, int]:
        """(documents, batches); the pairs per token are read before, with `pairs_per_token`."""
        taken = self.documents, self.batches
        self.documents = self.batches = self.tokens = self.causal_pairs = 0
        return taken

    def pairs_per_token(self) -> float | None:
        return self.causal_pairs / self.tokens if self.tokens else None


# One trainer per process; the training loader (titan_gdn.data.loader) adds, the processor takes.
TRAINING_DOCUMENTS = DocumentTally()


class Qwen35MetricsProcessor(MetricsProcessor):
    """Adds `documents_per_step` (packed documents in a step's batches, summed over data-parallel
    ranks and averaged over the steps since the last log) to the log line and to
    TensorBoard / W&B."""

    def __init__(
        self,
        job_config: JobConfig,
        parallel_dims: ParallelDims,
        tag: str | None = None,
        model_args=None,
    ):
        super().__init__(job_config, parallel_dims, tag)
        _require_wandb_logger(job_config, self.logger)
        self.model_args = model_args
        self.seq_len = job_config.training.seq_len
        training = job_config.training
        batch_degree = parallel_dims.dp_replicate * parallel_dims.dp_shard
        global_batch = training.global_batch_size
        if global_batch < 0:
            global_batch = training.local_batch_size * batch_degree
        self.microbatches_per_step = global_batch // (training.local_batch_size * batch_degree)
        TRAINING_DOCUMENTS.take()  # nothing counted before this trainer belongs to it
        ROUTER_AUX_LOSS.take()
        # (start time, steps before it) of this process's first step: `start_progress`.
        self.progress_start: tuple[float, int] | None = None
        self.last_logged_step = 0
        # Under context parallel: the largest data-parallel rank's loss, from the trainer
        # (`Qwen35Trainer._rows_max_loss`), for this step's line.
        self.rows_max_loss: torch.Tensor | None = None

    def documents_per_step(self) -> float:
        documents, batches = TRAINING_DOCUMENTS.take()
        if self.parallel_dims.dp_enabled:
            # Ranks of one data-parallel group (CP) read the same rows: sum over "batch" only.
            count = torch.tensor(documents, dtype=torch.int64, device=utils.device_type)
            documents = int(dist_utils.dist_sum(count, self.parallel_dims.get_mesh("batch")))
        steps = batches / self.microbatches_per_step
        return documents / steps if steps else 0.0

    def should_log(self, step: int) -> bool:
        # Also this process's first step (a resumed run's too) and the last step, so that a
        # run shorter than log_freq still shows where it started and ended.
        first_step = (self.progress_start[1] if self.progress_start else 0) + 1
        return super().should_log(step) or step in (first_step, self.job_config.training.steps)

    def start_progress(self, steps_done: int) -> None:
        """Start the elapsed-time clock as the first step of this process begins (after a
        resume, `steps_done` steps precede it); the first interval then excludes start-up."""
        self.progress_start = (time.perf_counter(), steps_done)
        self.time_last_log = self.progress_start[0]
        self.last_logged_step = steps_done

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        """torchtitan's metrics (``MetricsProcessor.log``) with the documents per step and
        their FLOPs, MFU only where the device's peak is known, and a log line that also says
        how far the run is, how long it has taken and how long it still needs."""
        global_max_loss, extra_metrics = self._context_parallel_corrected(
            global_max_loss, extra_metrics
        )
        flops_per_token = self._documents_flops_per_token(TRAINING_DOCUMENTS)
        documents = self.documents_per_step()
        time_delta = time.perf_counter() - self.time_last_log
        steps_in_interval = max(step - self.last_logged_step, 1)
        tps = self.ntokens_since_last_log / (time_delta * self.parallel_dims.non_data_parallel_size)
        tflops = flops_per_token * tps / 1e12
        memory = self.device_memory_monitor.get_peak_stats()
        metrics = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "time_metrics/end_to_end(s)": time_delta / steps_in_interval,
            "time_metrics/data_loading(s)": _mean(self.data_loading_times),
            "time_metrics/data_loading(%)": 100 * sum(self.data_loading_times) / time_delta,
            "memory/max_active(GiB)": memory.max_active_gib,
            "memory/max_active(%)": memory.max_active_pct,
            "memory/max_reserved(GiB)": memory.max_reserved_gib,
            "memory/max_reserved(%)": memory.max_reserved_pct,
            "memory/num_alloc_retries": memory.num_alloc_retries,
            "memory/num_ooms": memory.num_ooms,
            **(extra_metrics or {}),
            DOCUMENTS_METRIC: documents,
        }
        if self.peak_flops_known:
            metrics["mfu(%)"] = 100 * flops_per_token * tps / self.gpu_peak_flops
        aux_loss = ROUTER_AUX_LOSS.take()
        if aux_loss is not None:
            metrics[AUX_LOSS_METRIC] = aux_loss
        self.logger.log(metrics, step)
        logger.info(self._step_line(step, metrics))
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.last_logged_step = step
        self.device_memory_monitor.reset_peak_stats()

    def _context_parallel_corrected(self, max_loss: float, extra: dict | None):
        """torchtitan counts each rank's tokens on its whole rows, before context parallel
        splits them: the ranks of one row all count it, so the summed `n_tokens_seen` is cp
        times the tokens trained, and its max loss divides each rank's part of the loss by the
        whole rows' tokens (about 1/cp of a loss). Both as the single-GPU run gives them."""
        cp = self.parallel_dims.cp
        if cp == 1 or not self.parallel_dims.dp_cp_enabled:
            return max_loss, extra
        extra = dict(extra or {})
        if "n_tokens_seen" in extra:
            extra["n_tokens_seen"] = extra["n_tokens_seen"] // cp
        if self.rows_max_loss is not None:
            max_loss, self.rows_max_loss = float(self.rows_max_loss), None
        return max_loss, extra

    @property
    def peak_flops_known(self) -> bool:
        # titan_gdn.cpu answers NaN for a CPU: no peak, so no MFU.
        return math.isfinite(self.gpu_peak_flops)

    def _step_line(self, step: int, metrics: dict[str, Any]) -> str:
        """torchtitan's step line, whose head (`step: N  loss: X ... tps: T`) log readers
        parse, then the documents and the progress."""
        color = self.color
        documents = metrics[DOCUMENTS_METRIC]
        shown = f"{documents:,.0f}" if documents == int(documents) else f"{documents:,.1f}"
        line = (
            f"{color.red}step: {step:2}  "
            f"{color.green}loss: {metrics['loss_metrics/global_avg_loss']:8.5f}  "
            f"{color.orange}grad_norm: {metrics['grad_norm']:7.4f}  "
        )
        if AUX_LOSS_METRIC in metrics:  # after the head that log readers parse
            line += f"{color.green}aux_loss: {metrics[AUX_LOSS_METRIC]:.4f}  "
        line += (
            f"{color.turquoise}memory: {metrics['memory/max_reserved(GiB)']:5.2f}GiB"
            f"({metrics['memory/max_reserved(%)']:.2f}%)  "
            f"{color.blue}tps: {round(metrics['throughput(tps)']):,}  "
        )
        if self.peak_flops_known:
            line += (
                f"{color.cyan}tflops: {metrics['tflops']:,.2f}  "
                f"{color.magenta}mfu: {metrics['mfu(%)']:.2f}%  "
            )
        return (
            line + f"{color.yellow}docs: {shown}  {color.white}{self._progress(step)}{color.reset}"
        )

    def _progress(self, step: int) -> str:
        """`progress: N/total  elapsed: m:ss  eta: m:ss`, the ETA from this process's pace."""
        total = self.job_config.training.steps
        start, steps_done = self.progress_start or (self.time_last_log, 0)
        elapsed = time.perf_counter() - start
        pace = elapsed / max(step - steps_done, 1)
        eta = pace * max(total - step, 0)
        return f"progress: {step}/{total}  elapsed: {_clock(elapsed)}  eta: {_clock(eta)}"

    def _documents_flops_per_token(self, tally: DocumentTally) -> float:
        """The trainer's FLOPs per token (one document per row) with the attention term of the
        documents trained since the last log, for tflops and MFU."""
        pairs_per_token = tally.pairs_per_token()
        if self.model_args is None or pairs_per_token is None:
            return self.num_flops_per_token
        one_document = one_document_pairs_per_token(self.seq_len)
        return (
            self.num_flops_per_token
            - attention_flops_per_token(self.model_args, one_document)
            + attention_flops_per_token(self.model_args, pairs_per_token)
        )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


class MetricsLoggerError(RuntimeError):
    """A metrics logger the config asks for could not start."""


def _require_wandb_logger(job_config: JobConfig, built: BaseLogger) -> None:
    """torchtitan logs an error for a W&B logger it could not create (not logged in, no
    network) and trains on without it; stop before training instead, the run's metrics would be
    lost. Only the logging rank builds loggers (the others hold a bare BaseLogger)."""
    if not job_config.metrics.enable_wandb or not isinstance(built, LoggerContainer):
        return
    if not any(isinstance(each, WandBLogger) for each in built._loggers):
        raise MetricsLoggerError(
            "metrics.enable_wandb = true, but W&B did not start (the `Failed to create WandB "
            "logger` line above says why): fix that (e.g. `wandb login`, or WANDB_MODE=offline "
            "to log to disk), or leave metrics.enable_wandb off. Nothing was trained."
        )


def build_qwen3_5_metrics_processor(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args=None,
    tag: str | None = None,
) -> Qwen35MetricsProcessor:
    """TrainSpec `build_metrics_processor_fn` (signature of torchtitan's own builder)."""
    return Qwen35MetricsProcessor(job_config, parallel_dims, tag, model_args)
