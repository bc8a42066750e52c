"""torchtitan's Trainer with this model's batch preparation."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.train import Trainer

from titan_gdn.parallel.context_parallel import shard_sequence


def prepare_batch(model, tokenizer, parallel_dims, input_dict, labels):
    """Document boundaries from the whole batch, then (with CP) this rank's sequence shard.

    torchtitan's own preparation would reorder tokens with its CP load balancer and shard
    only flex block masks; here the boundaries stay global and the shards contiguous.
    """
    inputs = input_dict["input"]
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    extra_kwargs: dict[str, Any] = {
        "attention_masks": model.get_attention_masks(inputs, tokenizer, extra_inputs)
    }
    if parallel_dims.cp_enabled:
        cp_mesh = parallel_dims.get_mesh("cp")
        inputs, labels = shard_sequence(inputs, cp_mesh), shard_sequence(labels, cp_mesh)
    return inputs, labels, extra_inputs, extra_kwargs


class Qwen35Trainer(Trainer):
    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        return prepare_batch(
            self.model_parts[0], self.tokenizer, self.parallel_dims, input_dict, labels
        )
