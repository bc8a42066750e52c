"""torchtitan's training metrics plus the packed documents per step, and an MFU that follows them.

torchtitan 0.2.2's Trainer shows its metrics processor only token counts, never the batches
(train.py:403-408), so the training data loader counts documents (and the causal pairs that
attention computes within them) into :data:`TRAINING_DOCUMENTS` as it hands out batches, and
:class:`Qwen35MetricsProcessor` reads that tally at each log.
"""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils

from titan_gdn.model.flops import attention_flops_per_token, one_document_pairs_per_token

DOCUMENTS_METRIC = "documents_per_step"


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


class _ColorWithSuffix:
    """`color` whose `reset` first writes `suffix`.

    torchtitan's step log line is one f-string closed by `color.reset`
    (components/metrics.py:461-470), with no way to add a field; this appends one without
    copying `MetricsProcessor.log`.
    """

    def __init__(self, color, suffix: str):
        self._color = color
        self.reset = suffix + color.reset

    def __getattr__(self, name: str):
        return getattr(self._color, name)


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
        self.model_args = model_args
        self.seq_len = job_config.training.seq_len
        training = job_config.training
        batch_degree = parallel_dims.dp_replicate * parallel_dims.dp_shard
        global_batch = training.global_batch_size
        if global_batch < 0:
            global_batch = training.local_batch_size * batch_degree
        self.microbatches_per_step = global_batch // (training.local_batch_size * batch_degree)
        TRAINING_DOCUMENTS.take()  # nothing counted before this trainer belongs to it

    def documents_per_step(self) -> float:
        documents, batches = TRAINING_DOCUMENTS.take()
        if self.parallel_dims.dp_enabled:
            # Ranks of one data-parallel group (CP) read the same rows: sum over "batch" only.
            count = torch.tensor(documents, dtype=torch.int64, device=utils.device_type)
            documents = int(dist_utils.dist_sum(count, self.parallel_dims.get_mesh("batch")))
        steps = batches / self.microbatches_per_step
        return documents / steps if steps else 0.0

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        flops_per_token = self.num_flops_per_token
        self.num_flops_per_token = self._documents_flops_per_token(TRAINING_DOCUMENTS)
        documents = self.documents_per_step()
        extra_metrics = {**(extra_metrics or {}), DOCUMENTS_METRIC: documents}
        shown = f"{documents:,.0f}" if documents == int(documents) else f"{documents:,.1f}"
        color = self.color
        self.color = _ColorWithSuffix(color, f"  {color.yellow}docs: {shown}")
        try:
            super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        finally:
            self.color = color
            self.num_flops_per_token = flops_per_token

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


def build_qwen3_5_metrics_processor(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args=None,
    tag: str | None = None,
) -> Qwen35MetricsProcessor:
    """TrainSpec `build_metrics_processor_fn` (signature of torchtitan's own builder)."""
    return Qwen35MetricsProcessor(job_config, parallel_dims, tag, model_args)
