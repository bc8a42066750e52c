"""Packing documents into fixed-length rows, sharded across data-parallel ranks, resumable."""

from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.tools.logging import logger

from titan_gdn.data.sources import DocumentSource

Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


class PackedDocumentDataset(IterableDataset, Stateful):
    """Documents encoded as BOS + text + EOS, concatenated, and cut into rows of seq_len + 1.

    Rank r reads documents r, r + dp_world_size, ... so ranks see disjoint documents. Each row
    yields ({"input": row[:-1]}, row[1:]). With a tokenizer that has no BOS (e.g. Qwen's) a
    document is text + EOS, and the label of each EOS input is IGNORE_INDEX instead: it would be
    the next document's first token, which document masking keeps out of the EOS's context.
    The model splits documents at every EOS id in the input, so a document whose text encodes
    to EOS is split there; the first such document is logged.

    In infinite mode the tokens left at the end of an epoch carry into the next one; a finite
    pass drops its last partial row, as torchtitan does.
    Documents are tokenized one at a time, only when the buffer runs short of a row. Empty
    (blank) documents are skipped and counted in the log. A document longer than a row
    continues in the next row(s); each row starts a new attention segment.

    The state is where the first unconsumed token comes from: its document (epoch and index)
    and how many of that document's tokens the rows took. Restoring it tokenizes again from
    that document on, so the stream continues seamlessly. A few integers: the loader hands a
    state to the training process with every batch, and a buffer of tokens there (a whole
    long document) cost more host time per step than the step's kernel launches.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: BaseTokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = False,
    ):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if getattr(tokenizer, "eos_id", None) is None:
            # Without EOS, packed documents run together and document boundaries are lost.
            raise ValueError("The tokenizer has no EOS token; packed documents need one")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_world_size {dp_world_size}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self._mask_eos_labels = getattr(tokenizer, "bos_id", None) is None
        self._warned_eos_in_text = False
        self._epoch = 0
        self._documents_read = 0
        self._token_buffer: list[int] = []
        # Rows are consumed by advancing this offset; copying the list tail per row would be
        # quadratic in the length of a long document.
        self._buffer_start = 0
        # The documents with tokens in the buffer, oldest first: [epoch, index, tokens the rows
        # took, tokens left].
        self._buffered_documents: list[list[int]] = []
        self._skip = 0  # tokens of the next document tokenized that a restored state consumed

    def __iter__(self) -> Iterator[Sample]:
        first, stride = self._shard()
        while True:
            from_epoch_start = self._documents_read == 0
            start = first + self._documents_read * stride
            empty = 0
            for text in self.source.iter_documents(start, stride):
                self._documents_read += 1
                if not text.strip():
                    # BOS + EOS alone teaches nothing but "end right after the start".
                    empty += 1
                    continue
                tokens = self.tokenizer.encode(text, add_bos=True, add_eos=True)
                # One scan per document; the EOS the tokenizer appended does not count.
                if tokens.count(self.tokenizer.eos_id) > 1 and not self._warned_eos_in_text:
                    self._warn_eos_in_text(first + (self._documents_read - 1) * stride)
                tokens = tokens[self._skip :]
                document = [self._epoch, self._documents_read - 1, self._skip, len(tokens)]
                self._buffered_documents.append(document)
                self._token_buffer.extend(tokens)
                self._skip = 0
                yield from self._full_rows()
            self._check_epoch_had_text(from_epoch_start, empty, stride)
            self._epoch += 1
            self._documents_read = 0
            if not self.infinite:
                # Dropping the partial row here (not at the start of the next pass) lets a
                # finite loader, e.g. validation, replay the same rows each time it is iterated.
                self._token_buffer, self._buffered_documents = [], []
                return
            self._log_new_epoch()

    def _warn_eos_in_text(self, index: int) -> None:
        """Once per dataset: text that encodes to EOS (e.g. a literal end-of-text marker in
        scraped pages) silently cuts its document in two, since boundaries come from EOS ids."""
        self._warned_eos_in_text = True
        eos = getattr(self.tokenizer, "eos_token", None) or f"id {self.tokenizer.eos_id}"
        logger.warning(
            f"{self.source.description}: the text of document {index} encodes to the EOS token "
            f"{eos!r}, so the document is split into separate documents there: attention and "
            "the GDN state reset at that point. Remove that text from the documents, or use a "
            "tokenizer whose EOS does not occur in them (later occurrences are not logged)"
        )

    def _log_new_epoch(self) -> None:
        """The first time the data repeats, at info level; later epochs at debug level: a small
        corpus would otherwise log a line for each of many epochs per step."""
        if self._epoch == 1:
            logger.info(
                f"{self.source.description}: every document read, starting epoch 1 (later "
                "epochs are logged at debug level)"
            )
        else:
            logger.debug(f"{self.source.description}: starting epoch {self._epoch}")

    def _check_epoch_had_text(self, from_epoch_start: bool, empty: int, stride: int) -> None:
        if empty:
            logger.warning(
                f"{self.source.description}: skipped {empty} empty document(s) of dp rank "
                f"{self.dp_rank} in epoch {self._epoch}"
            )
        if not from_epoch_start:
            return  # a resumed pass sees only the rest of its epoch
        if self._documents_read == 0:
            raise ValueError(
                f"{self.source.description} has no documents for dp rank {self.dp_rank} "
                f"(fewer documents than dp_world_size x dataloader workers = {stride})"
            )
        if empty == self._documents_read:
            raise ValueError(
                f"{self.source.description} has only empty documents for dp rank "
                f"{self.dp_rank}; training.dataset_path needs documents with text"
            )

    def _shard(self) -> tuple[int, int]:
        """First document and stride of this rank's (and dataloader worker's) shard."""
        worker = get_worker_info()
        num_workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        return self.dp_rank + self.dp_world_size * worker_id, self.dp_world_size * num_workers

    def _full_rows(self) -> Iterator[Sample]:
        row_len = self.seq_len + 1
        while len(self._token_buffer) - self._buffer_start >= row_len:
            row_end = self._buffer_start + row_len
            row = torch.tensor(self._token_buffer[self._buffer_start : row_end], dtype=torch.long)
            self._buffer_start = row_end
            self._consume(row_len)
            inputs, labels = row[:-1], row[1:]
            if self._mask_eos_labels:
                labels = labels.masked_fill(inputs == self.tokenizer.eos_id, IGNORE_INDEX)
            yield {"input": inputs}, labels
        del self._token_buffer[: self._buffer_start]
        self._buffer_start = 0

    def _consume(self, count: int) -> None:
        """The rows took `count` more tokens: drop the documents they used up."""
        while count:
            document = self._buffered_documents[0]
            taken = min(count, document[3])
            document[2] += taken
            document[3] -= taken
            count -= taken
            if document[3] == 0:
                self._buffered_documents.pop(0)

    def state_dict(self) -> dict[str, Any]:
        if self._buffered_documents:  # resume inside the oldest buffered document
            epoch, index, skip, _ = self._buffered_documents[0]
        else:  # nothing buffered: the next document, less what a restored state consumed
            # A dataloader worker may checkpoint again before it reads a document after a
            # resume; reporting 0 there would replay the restored document from its start.
            epoch, index, skip = self._epoch, self._documents_read, self._skip
        return {"source": self.source.description, "epoch": epoch, "document": index, "skip": skip}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("source") != self.source.description:
            logger.warning(
                f"Resuming data from {state_dict.get('source')} state on "
                f"{self.source.description}; the document position may not line up"
            )
        self._epoch = state_dict["epoch"]
        self._documents_read = state_dict["document"]
        self._skip = state_dict["skip"]
        self._token_buffer, self._buffered_documents, self._buffer_start = [], [], 0


def documents_per_row(input_ids: torch.Tensor, eos_id: int) -> int:
    """Number of document segments in a batch of packed rows, summed over rows.

    Every row starts a segment, and so does each token that follows an EOS inside the row; a
    document cut across two rows therefore counts once in each (it is two attention segments).
    """
    rows = input_ids.reshape(-1, input_ids.shape[-1])
    return rows.shape[0] + int((rows[:, :-1] == eos_id).sum())
