"""The GPU training configs in train_configs/ parse and pass titan_gdn's pre-training checks."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# name: (flavor, cp, seq_len, activation checkpointing); each measured on GPUs (its header).
GPU_CONFIGS = {
    "qwen3_5_0.8b.toml": ("0.8B", 1, 32768, "none"),
    "qwen3_5_2b.toml": ("2B", 1, 32768, "none"),
    "qwen3_5_0.8b_cp2.toml": ("0.8B", 2, 32768, "full"),
    "qwen3_5_2b_cp2.toml": ("2B", 2, 32768, "full"),
    "qwen3_5_0.8b_448k.toml": ("0.8B", 1, 458752, "full"),
    # Not measured yet: the 2B long-row length, the 8-GPU 35B-A3B run and the one-GPU 4-layer
    # benchmark shape.
    "qwen3_5_2b_320k.toml": ("2B", 1, 327680, "full"),
    "qwen3_5_35b_a3b.toml": ("35B-A3B", 8, 131072, "full"),
    "qwen3_5_35b_a3b_4layers.toml": ("35B-A3B-4layers", 1, 32768, "none"),
}
# Expert-parallel degree and the GPUs each config is for.
EXPERT_PARALLEL = {"qwen3_5_35b_a3b.toml": (8, 8)}


def _parse(name: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(REPO / "train_configs" / name)])


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_config_parses_and_passes_the_checks(name):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    import titan_gdn  # noqa: F401  (registers the TrainSpec, as custom_import does)
    from titan_gdn.model import qwen3_5_args
    from titan_gdn.parallel.context_parallel import context_parallel_problems
    from titan_gdn.parallel.expert_parallel import expert_parallel_problems

    flavor, cp, seq_len, checkpointing = GPU_CONFIGS[name]
    job = _parse(name)
    assert (job.model.name, job.model.flavor) == ("qwen3_5", flavor)
    assert job.experimental.custom_import == "titan_gdn"
    assert (job.training.seq_len, job.parallelism.context_parallel_degree) == (seq_len, cp)
    assert job.training.mixed_precision_param == "bfloat16"
    assert job.parallelism.data_parallel_shard_degree == -1  # FSDP over the remaining ranks
    assert job.activation_checkpoint.mode == checkpointing
    assert job.compile.enable and job.compile.components == ["model", "loss"]
    assert job.training.dataloader.num_workers == 1  # rows packed ahead of the step
    assert job.checkpoint.enable and job.checkpoint.interval > 0
    assert job.training.dataset == "tinyshakespeare" and job.training.dataset_path is None
    assert Path(job.model.hf_assets_path).resolve() == REPO / "assets" / "tokenizer"

    # What the trainer checks before training (train_spec.build_qwen3_5_tokenizer).
    args = copy.deepcopy(qwen3_5_args[flavor])
    args.update_from_config(job, tokenizer=HuggingFaceTokenizer(job.model.hf_assets_path))
    assert context_parallel_problems(args, cp) == []
    assert args.max_seq_len >= seq_len  # past the published length: the config raises it
    ep, gpus = EXPERT_PARALLEL.get(name, (1, 1))
    assert job.parallelism.expert_parallel_degree == ep
    assert expert_parallel_problems(args, ep, gpus) == []
    if cp > 1:
        # "none" in the TOML (it has no null) becomes torchtitan's None: tokens keep their order.
        assert job.parallelism.context_parallel_load_balancer is None


def test_no_load_balancer_is_spelled_none_in_toml(tmp_path):
    from torchtitan.config import ConfigManager

    # TOML cannot write None, and torchtitan rejects "" (its `Parallelism.__post_init__`).
    empty = tmp_path / "empty_balancer.toml"
    empty.write_text('[parallelism]\ncontext_parallel_load_balancer = ""\n')
    with pytest.raises(ValueError, match="cannot be an empty string"):
        ConfigManager().parse_args(["--job.config_file", str(empty)])
    job = _parse("qwen3_5_0.8b_cp2.toml")
    assert job.parallelism.context_parallel_load_balancer == "none"
