"""The `qwen3_5` TrainSpec: what torchtitan needs to train the model."""

from __future__ import annotations

import copy

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.optimizer import build_optimizers
from torchtitan.components.validate import build_validator
from torchtitan.protocols.train_spec import TrainSpec

from titan_gdn.data import build_packed_dataloader
from titan_gdn.data.tokenizer import load_tokenizer
from titan_gdn.loss import build_qwen3_5_loss
from titan_gdn.metrics import build_qwen3_5_metrics_processor
from titan_gdn.model import Qwen35Model, Qwen35StateDictAdapter, qwen3_5_args
from titan_gdn.parallel.parallelize import parallelize_qwen3_5

TRAIN_SPEC_NAME = "qwen3_5"


def build_qwen3_5_tokenizer(job_config):
    """torchtitan's HF tokenizer (the one the config check read: `load_tokenizer`), after
    checking the job config against the model flavor.

    The Trainer builds the tokenizer first (``Trainer.__init__``) and passes it to no model
    hook (``update_from_config`` gets only the job config), so the flavor, the
    sequence lengths and the tokenizer's vocabulary are checked here, before any data is read
    or weights are built.
    """
    tokenizer = load_tokenizer(job_config.model.hf_assets_path)
    model_args = copy.deepcopy(qwen3_5_args[job_config.model.flavor])
    model_args.update_from_config(job_config, tokenizer=tokenizer)
    return tokenizer


def get_train_spec() -> TrainSpec:
    return TrainSpec(
        model_cls=Qwen35Model,
        model_args=qwen3_5_args,
        parallelize_fn=parallelize_qwen3_5,
        pipelining_fn=None,
        build_optimizers_fn=build_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_packed_dataloader,
        build_tokenizer_fn=build_qwen3_5_tokenizer,
        build_loss_fn=build_qwen3_5_loss,
        build_validator_fn=build_validator,
        build_metrics_processor_fn=build_qwen3_5_metrics_processor,
        state_dict_adapter=Qwen35StateDictAdapter,
    )
