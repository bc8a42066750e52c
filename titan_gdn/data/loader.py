"""TrainSpec data loader builders, drop-in for torchtitan's build_text_(validation_)dataloader."""

from collections.abc import Iterator
from dataclasses import asdict

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.tools.logging import logger

from titan_gdn.data.packing import PackedDocumentDataset, documents_per_row
from titan_gdn.data.sources import build_document_source
from titan_gdn.metrics import TRAINING_DOCUMENTS, DocumentTally


class DocumentCountingDataloader(ParallelAwareDataloader):
    """A ParallelAwareDataloader that counts the packed documents of each batch it hands out
    (into `tally`, read by the metrics processor)."""

    def __init__(self, dataset, *, eos_id: int, tally: DocumentTally, **kwargs):
        super().__init__(dataset, **kwargs)
        self.eos_id = eos_id
        self.tally = tally

    def __iter__(self) -> Iterator:
        for batch in super().__iter__():
            input_dict, _ = batch
            tokens = input_dict["input"]
            self.tally.add(
                documents_per_row(tokens, self.eos_id),
                tokens=tokens.numel(),
                causal_pairs=causal_pairs(tokens, self.eos_id),
            )
            yield batch


def causal_pairs(input_ids: torch.Tensor, eos_id: int) -> int:
    """Causal (query, key) pairs within the documents of packed rows: a document of L tokens
    has L (L + 1) / 2. From the document lengths alone: this runs on the host for every
    batch, before the step (the per-token boundaries cost 30 ms a 32k row there)."""
    rows = input_ids.reshape(-1, input_ids.shape[-1])
    row_len = rows.shape[1]
    # A document starts at every row start and after every EOS inside a row.
    after_eos = (rows[:, :-1] == eos_id).nonzero()
    starts = torch.cat(
        [torch.arange(len(rows)) * row_len, after_eos[:, 0] * row_len + after_eos[:, 1] + 1]
    )
    lengths = torch.cat([starts.sort().values, torch.tensor([rows.numel()])]).diff()
    return int((lengths * (lengths + 1) // 2).sum())


def build_packed_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    job_config: JobConfig,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """Packed-document loader over `training.dataset` / `training.dataset_path`; it counts the
    documents it hands out for the `documents_per_step` metric."""
    counting = {"eos_id": tokenizer.eos_id, "tally": TRAINING_DOCUMENTS}
    return _build(
        dp_world_size, dp_rank, tokenizer, job_config.training, "training", infinite, counting
    )


def build_packed_validation_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    job_config: JobConfig,
    infinite: bool = False,
) -> ParallelAwareDataloader:
    """Packed-document loader over `validation.dataset` / `validation.dataset_path`."""
    return _build(dp_world_size, dp_rank, tokenizer, job_config.validation, "validation", infinite)


def _build(
    dp_world_size,
    dp_rank,
    tokenizer,
    section_config,
    section: str,
    infinite: bool,
    counting: dict | None = None,
):
    source = build_document_source(section_config.dataset, section_config.dataset_path, section)
    logger.info(f"Packed {section} data from {source.description}")
    dataset = PackedDocumentDataset(
        source,
        tokenizer,
        seq_len=section_config.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
    )
    # ParallelAwareDataloader keys the saved state by dp rank, so each rank resumes its own shard.
    loader_kwargs = dict(
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **asdict(section_config.dataloader),
        batch_size=section_config.local_batch_size,
    )
    if counting is None:
        return ParallelAwareDataloader(dataset, **loader_kwargs)
    return DocumentCountingDataloader(dataset, **counting, **loader_kwargs)
