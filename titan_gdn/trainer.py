"""torchtitan's Trainer with this model's batch preparation and a loadable HF export, and the
guards of a long run: the whole config checked before anything is built, token ids checked
against the vocabulary, NaN/inf losses stopped (or skipped) before the optimizer step."""

from __future__ import annotations

import os
from typing import Any

import torch
from torchtitan.train import Trainer

from titan_gdn.data.vocab_check import check_token_ids
from titan_gdn.job_config import setting
from titan_gdn.loss_guard import NonFiniteLossGuard
from titan_gdn.model import Qwen35Model
from titan_gdn.parallel.context_parallel import shard_sequence
from titan_gdn.train_spec import TRAIN_SPEC_NAME
from titan_gdn.validation import latest_complete_checkpoint, validate_job_config


def prepare_batch(model, tokenizer, parallel_dims, input_dict, labels):
    """Document boundaries from the whole batch, then (with CP) this rank's sequence shard.

    torchtitan's own preparation would reorder tokens with its CP load balancer and shard
    only flex block masks; here the boundaries stay global and the shards contiguous.
    """
    inputs = input_dict["input"]
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    # chunked_loss: the TrainSpec's loss (titan_gdn.loss) takes hidden states in place of
    # logits, so the model may skip the full-sequence logits.
    extra_kwargs: dict[str, Any] = {
        "attention_masks": model.get_attention_masks(inputs, tokenizer, extra_inputs),
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
        super().__init__(job_config)
        self.loss_fn = self._guarded_loss_fn(self.loss_fn)
        self.loss_guard = NonFiniteLossGuard(
            max_skips=setting(job_config, "training", "skip_nonfinite_loss_steps"),
            last_checkpoint=lambda: (
                latest_complete_checkpoint(job_config) if job_config.checkpoint.enable else None
            ),
        )

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

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        self._global_valid_tokens = global_valid_tokens
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        self.loss_guard.after_backward(
            self.step,
            self.gradient_accumulation_steps,
            parameters=lambda: (p for part in self.model_parts for p in part.parameters()),
        )
        return loss

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

    def complete_hf_export(self) -> None:
        """Add config.json and the tokenizer to the `checkpoint.last_save_in_hf` export.

        torchtitan writes only the safetensors and their index there
        (components/checkpoint.py:_save_last_step); transformers needs the config too.
        """
        checkpoint = self.job_config.checkpoint
        if not (checkpoint.enable and checkpoint.last_save_in_hf):
            return
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        folder = os.path.join(self.checkpointer.folder, f"step-{self.step}")
        if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
            self.checkpointer.sd_adapter.save_hf_metadata(folder, checkpoint.export_dtype)
