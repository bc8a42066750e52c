"""torchtitan's Trainer with this model's batch preparation and a loadable HF export."""

from __future__ import annotations

import os
from typing import Any

import torch
from torchtitan.train import Trainer

from titan_gdn.model import Qwen35Model
from titan_gdn.parallel.context_parallel import shard_sequence


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
