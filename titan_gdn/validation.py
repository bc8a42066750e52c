"""One check of the whole job configuration before anything is built.

`validate_job_config` runs first in the trainer, before the process group, the data loader or
the model exist, and reports every problem it finds at once (model args x parallelism x data x
checkpoint), each naming the setting and a fix. It gathers the checks that live next to what
they protect (`job_config_problems` in model/job_checks.py, `layout_problems` in cp_layout.py,
`expert_parallel_problems`, `unsupported_parallelism_problems`, `build_document_source`) and
adds the ones torchtitan would only hit later: after the model is built (parallel degrees,
checkpoint paths) or at the very last step (an HF export without `last_save_model_only`).
`python -m titan_gdn.validation` (`main`) runs the same checks before a launcher starts the
ranks.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from torchtitan.tools.logging import logger

from titan_gdn.checkpoint_folders import (
    DCP_METADATA,
    TRAINING_STATES,
    checkpoint_folder,
    checkpoint_steps,
    dcp_model_keys,
    flavors_that_fit,
    gib,
    model_difference,
    saved_data_parallel_ranks,
    saved_states,
    step_folder,
)
from titan_gdn.job_config import setting
from titan_gdn.model.hf_files import (
    UnreadableWeightsError,
    safetensors_files,
    safetensors_shapes,
)

_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


class ConfigError(ValueError):
    """Every problem found in a job config, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        listing = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(
            f"{len(self.problems)} problem(s) in the job config; nothing was built or trained:"
            f"\n{listing}"
        )


def validate_job_config(job_config, world_size: int) -> None:
    """Raise `ConfigError` listing every problem of `job_config` for a job of `world_size`
    processes; log the checkpoints a resume will skip."""
    problems = configuration_problems(job_config, world_size)
    if problems:
        raise ConfigError(problems)
    _log_incomplete_checkpoints(job_config)


def configuration_problems(job_config, world_size: int) -> list[str]:
    return [
        *_parallelism_problems(job_config.parallelism, world_size),
        *_batch_problems(job_config, world_size),
        *_gradient_clipping_problems(job_config.training),
        *_schedule_problems(job_config),
        *_optimizer_problems(job_config),
        *_activation_checkpoint_problems(job_config),
        *_compile_backend_problems(job_config.compile),
        *_model_problems(job_config, world_size),
        *_data_problems(job_config),
        *_checkpoint_problems(job_config, world_size),
        *_fault_policy_problems(job_config),
        *_sample_problems(job_config),
        *_metrics_problems(job_config.metrics),
    ]


def _metrics_problems(metrics) -> list[str]:
    """torchtitan logs an error for a W&B logger it cannot create and trains on without it:
    the run's metrics would be lost without a word at the end of the log."""
    if metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        return [
            "metrics.enable_wandb = true, but wandb is not installed: `pip install wandb` (and "
            "`wandb login`, or WANDB_MODE=offline to log to disk), or leave it off"
        ]
    return []


# Parallelism and batch


def _other_degrees(parallelism) -> int:
    """Replicate x context x tensor x pipeline degrees: every factor of the world size but
    data_parallel_shard_degree."""
    p = parallelism
    return (
        p.data_parallel_replicate_degree
        * p.context_parallel_degree
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
    )


def _shard_degree(parallelism, world_size: int) -> int:
    """data_parallel_shard_degree with -1 resolved as torchtitan does (at least 1)."""
    shard = parallelism.data_parallel_shard_degree
    others = max(1, _other_degrees(parallelism))  # a degree below 1 is reported on its own
    return max(1, world_size // others) if shard == -1 else shard


def _parallelism_problems(parallelism, world_size: int) -> list[str]:
    problems = _degree_range_problems(parallelism)
    if problems:
        return problems
    others = _other_degrees(parallelism)
    shard = _shard_degree(parallelism, world_size)
    if parallelism.data_parallel_shard_degree == -1 and world_size % others:
        problems.append(
            f"{world_size} processes (NGPU x NNODES) cannot be split into groups of "
            f"data_parallel_replicate x context_parallel x tensor x pipeline degrees = {others}; "
            f"launch a multiple of {others} processes or lower those parallelism degrees"
        )
    elif shard * others != world_size:
        problems.append(
            f"the parallelism degrees multiply to {shard * others} (data_parallel_shard_degree "
            f"{shard} x the others {others}) but the job has {world_size} processes "
            f"(NGPU x NNODES); launch {shard * others} processes or set "
            "parallelism.data_parallel_shard_degree = -1"
        )
    return problems + _unsupported_problems(parallelism, shard, shard * others)


def _degree_range_problems(parallelism) -> list[str]:
    names = (
        "data_parallel_replicate_degree",
        "context_parallel_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    )
    problems = [
        f"parallelism.{name} = {getattr(parallelism, name)} must be at least 1"
        for name in names
        if getattr(parallelism, name) < 1
    ]
    shard = parallelism.data_parallel_shard_degree
    if shard != -1 and shard < 1:
        problems.append(
            f"parallelism.data_parallel_shard_degree = {shard} must be -1 (all remaining "
            "ranks) or at least 1"
        )
    return problems


def _unsupported_problems(parallelism, shard: int, world_size: int) -> list[str]:
    from torchtitan.distributed import ParallelDims

    from titan_gdn.parallel.parallelize import unsupported_parallelism_problems

    p = parallelism
    try:
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree,
            dp_shard=shard,
            cp=p.context_parallel_degree,
            tp=p.tensor_parallel_degree,
            pp=p.pipeline_parallel_degree,
            ep=p.expert_parallel_degree,
            etp=p.expert_tensor_parallel_degree,
            world_size=world_size,
        )
    except AssertionError as error:  # torchtitan's own consistency checks (EP/ETP)
        return [f"parallelism: {error}"]
    problems = unsupported_parallelism_problems(dims)
    backend = getattr(p, "expert_parallel_comm_backend", "standard")
    if backend != "standard":
        # titan_gdn's expert parallel sends tokens with its own all-to-all: the setting would
        # be ignored.
        problems.append(
            f"parallelism.expert_parallel_comm_backend = {backend!r} is not supported: "
            'titan_gdn\'s expert parallel exchanges tokens with all-to-all ("standard")'
        )
    return problems


def _batch_problems(job_config, world_size: int) -> list[str]:
    training, problems = job_config.training, []
    if training.seq_len < 1:
        problems.append(f"training.seq_len = {training.seq_len} must be at least 1")
    local = training.local_batch_size
    if local < 1:
        return problems + [f"training.local_batch_size = {local} must be at least 1"]
    parallelism = job_config.parallelism
    data_parallel = parallelism.data_parallel_replicate_degree * _shard_degree(
        parallelism, world_size
    )
    per_micro_batch = local * data_parallel
    if training.global_batch_size > 0 and training.global_batch_size % per_micro_batch:
        problems.append(
            f"training.global_batch_size = {training.global_batch_size} is not a multiple of "
            f"training.local_batch_size x data-parallel ranks = {local} x {data_parallel}; "
            f"use a multiple of {per_micro_batch} (or -1: one micro-batch per step)"
        )
    return problems


def _gradient_clipping_problems(training) -> list[str]:
    # torchtitan scales the gradients by max_norm / norm: 0 zeroes them and a negative value
    # turns them around (gradient ascent). Other trainers read 0 as "no clipping"; torchtitan
    # has no such value, and inf is what clips nothing.
    max_norm = training.max_norm
    if max_norm > 0:
        return []
    if max_norm == 0:
        effect = "zeroes every gradient (no learning)"
    elif max_norm < 0:
        effect = "reverses every gradient (gradient ascent)"
    else:
        effect = "makes every gradient NaN"
    return [
        f"training.max_norm = {max_norm} {effect}: the gradients are scaled to at most "
        "this norm; set a positive norm (e.g. 1.0), or inf for no clipping"
    ]


def _schedule_problems(job_config) -> list[str]:
    """Lengths torchtitan takes as given: a negative step count ends in an assertion about
    decay steps, log_freq 0 in a division by zero, a negative warm-up in a negative lr."""
    training, scheduler = job_config.training, job_config.lr_scheduler
    problems = []
    if training.steps < 1:
        problems.append(f"training.steps = {training.steps} must be at least 1")
    if scheduler.warmup_steps < 0:
        problems.append(
            f"lr_scheduler.warmup_steps = {scheduler.warmup_steps} must be at least 0 "
            "(0: no warm-up)"
        )
    if scheduler.total_steps is not None and scheduler.total_steps < 1:
        problems.append(
            f"lr_scheduler.total_steps = {scheduler.total_steps} must be at least 1, or unset "
            "(the schedule then spans training.steps)"
        )
    if job_config.metrics.log_freq < 1:
        problems.append(
            f"metrics.log_freq = {job_config.metrics.log_freq} must be at least 1 (a line "
            "every N steps)"
        )
    return problems


def _optimizer_problems(job_config) -> list[str]:
    """What torch's Adam refuses inside every rank's traceback (a negative lr, eps or weight
    decay, betas outside [0, 1)), a name torchtitan does not build, and settings that would
    train other than asked without a word."""
    optimizer, scheduler = job_config.optimizer, job_config.lr_scheduler
    problems = []
    if optimizer.name not in ("AdamW", "Adam"):
        problems.append(
            f"optimizer.name = {optimizer.name!r} is not an optimizer torchtitan builds: "
            "use 'AdamW' or 'Adam'"
        )
    for name in ("lr", "eps", "weight_decay"):
        if not getattr(optimizer, name) >= 0:  # NaN too
            problems.append(f"optimizer.{name} = {getattr(optimizer, name)} must be at least 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(optimizer, name) < 1:
            problems.append(
                f"optimizer.{name} = {getattr(optimizer, name)} must be in [0, 1) (the weight "
                "of the past in the moving average)"
            )
    if optimizer.early_step_in_backward:
        # torchtitan steps each parameter from a hook in backward and frees its gradient:
        # clip_grad_norm_ then sees none (grad_norm 0 in the log) and neither does the loss
        # guard's check.
        problems.append(
            "optimizer.early_step_in_backward = true steps each parameter inside backward, "
            "before the gradients are clipped (training.max_norm) or checked for NaN/inf: "
            "clipping would be skipped and a NaN gradient would reach the weights; set it to "
            "false"
        )
    if not 0 <= scheduler.min_lr_factor <= 1:
        problems.append(
            f"lr_scheduler.min_lr_factor = {scheduler.min_lr_factor} must be in [0, 1]: the "
            "learning rate decays from optimizer.lr to optimizer.lr x min_lr_factor"
        )
    if scheduler.decay_ratio is not None and not 0 <= scheduler.decay_ratio <= 1:
        problems.append(
            f"lr_scheduler.decay_ratio = {scheduler.decay_ratio} must be in [0, 1] (the part "
            "of the schedule that decays, at its end), or unset (decay right after warm-up)"
        )
    return problems


def _activation_checkpoint_problems(job_config) -> list[str]:
    """What torchtitan's `apply_ac` would refuse after the model is built, per rank."""
    ac = job_config.activation_checkpoint
    problems = []
    if ac.mode == "selective":
        option = ac.selective_ac_option
        if option != "op" and not (option.isdigit() and int(option) >= 1):
            problems.append(
                f'activation_checkpoint.selective_ac_option = {option!r} is neither "op" '
                '(per op) nor a block interval N >= 1 (every N-th block, e.g. "2")'
            )
    elif ac.mode == "memory_budget":
        compiled = job_config.compile.enable and "model" in job_config.compile.components
        if not compiled:
            problems.append(
                'activation_checkpoint.mode = "memory_budget" is applied by the compiler: set '
                'compile.enable = true with "model" in compile.components, or choose mode '
                '"selective" or "full"'
            )
        if not 0 <= ac.memory_budget <= 1:
            problems.append(
                f"activation_checkpoint.memory_budget = {ac.memory_budget} must be in [0, 1] "
                "(0: recompute all the compiler can, 1: keep everything)"
            )
    return problems


def _compile_backend_problems(compile_config) -> list[str]:
    if not compile_config.enable or not compile_config.components:
        return []
    from torch._dynamo import list_backends

    known = list_backends(exclude_tags=())
    if compile_config.backend in known:
        return []
    return [
        f"compile.backend = {compile_config.backend!r} is not a torch.compile backend; use "
        f'"inductor" (the default) or one of {", ".join(sorted(known))}'
    ]


# Model, tokenizer, data


def _model_problems(job_config, world_size: int = 1) -> list[str]:
    from titan_gdn.model.job_checks import job_config_problems
    from titan_gdn.parallel.cp_layout import context_parallel_split, layout_problems
    from titan_gdn.parallel.expert_parallel import expert_parallel_problems
    from titan_gdn.parallel.parallelize import cudagraph_problems

    problems = []
    try:
        args = _model_args(job_config)
    except (KeyError, ValueError, FileNotFoundError) as error:
        args = None
        problems.append(str(error))
    tokenizer = None
    try:
        from titan_gdn.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(job_config.model.hf_assets_path)
    except Exception as error:  # missing files, bad JSON, or the tokenizers library's own
        problems.append(_tokenizer_problem(job_config.model.hf_assets_path, error))
    if args is not None:
        problems += job_config_problems(args, job_config, tokenizer)
        problems += _sample_length_problems(job_config, args, tokenizer)
        problems += _backend_problems(args)
        parallelism = job_config.parallelism
        problems += layout_problems(args, **context_parallel_split(job_config))
        shard_x_cp = _shard_degree(parallelism, world_size) * parallelism.context_parallel_degree
        problems += expert_parallel_problems(args, parallelism.expert_parallel_degree, shard_x_cp)
        problems += cudagraph_problems(job_config, world_size, moe=bool(args.moe_layers))
    return problems


def _tokenizer_problem(folder: str | None, error: Exception) -> str:
    if folder and not os.path.isabs(folder) and not os.path.isdir(folder):
        # torchtitan's own message then suggests a deprecated setting and a download.
        return (
            f"model.hf_assets_path = {folder!r} is not a folder of the working directory "
            f"{os.getcwd()}, from which relative paths are read: run from the checkout's "
            "root, or give an absolute path"
        )
    return (
        f"model.hf_assets_path = {folder!r} has no usable tokenizer ({error}); point it at a "
        "folder with tokenizer.json"
    )


def _sample_length_problems(job_config, args, tokenizer) -> list[str]:
    """[sample] as `generate` would refuse it: a prompt and continuation past max_seq_len."""
    prompt = setting(job_config, "sample", "prompt")
    new_tokens = setting(job_config, "sample", "max_new_tokens")
    if not prompt or tokenizer is None or new_tokens is None or new_tokens < 0:
        return []  # no sample, or a problem reported on its own
    from titan_gdn.generate import encode_prompt, length_problem

    names = {"prompt": "sample.prompt", "max_new_tokens": "sample.max_new_tokens"}
    problem = length_problem(
        len(encode_prompt(tokenizer, prompt)), new_tokens, args.max_seq_len, names
    )
    if problem is None:
        return []
    return [f"{problem}, or raise model.max_seq_len"]


def _model_args(job_config):
    """The flavor's args as the trainer will build them (config.json read for
    from_hf_config), without the job-config checks `update_from_config` adds."""
    from titan_gdn.model import qwen3_5_args
    from titan_gdn.model.flavors import Qwen35ArgsFromHFConfig

    args = copy.deepcopy(qwen3_5_args[job_config.model.flavor])
    if isinstance(args, Qwen35ArgsFromHFConfig):
        args.load_hf_config(job_config)
    args.apply_job_settings(job_config)
    return args


def _backend_problems(args) -> list[str]:
    """The kernel backends the args ask for, resolved as the model will resolve them on this
    machine's device: an unknown name, a CUDA backend on CPU, a package not installed."""
    import torch

    from titan_gdn.ops.attention import resolve_attn_backend
    from titan_gdn.ops.conv import resolve_conv_backend
    from titan_gdn.ops.delta_rule import resolve_delta_rule_backend
    from titan_gdn.ops.delta_rule.flash_qla_op import head_width_problems
    from titan_gdn.ops.experts import resolve_experts_backend

    # Not torchtitan's device_type: it says "cuda" on a machine without GPUs (titan_gdn/cpu.py).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problems = []
    for resolve, requested in (
        (resolve_attn_backend, args.attn_backend),
        (resolve_delta_rule_backend, args.delta_rule_backend),
        (resolve_conv_backend, args.conv_backend),
        (resolve_experts_backend, args.experts_backend),
    ):
        try:
            resolved = resolve(device, requested)
        except ValueError as error:
            problems.append(str(error))
            continue
        if resolve is resolve_delta_rule_backend and resolved == "flash_qla":
            problems += head_width_problems(args.linear_key_head_dim, args.linear_value_head_dim)
    return problems


def _data_problems(job_config) -> list[str]:
    from titan_gdn.data import build_document_source

    training = job_config.training
    try:
        build_document_source(training.dataset, training.dataset_path, "training")
    except (OSError, ValueError) as error:
        return [str(error)]
    return []


# Checkpoints


def _checkpoint_problems(job_config, world_size: int) -> list[str]:
    checkpoint = job_config.checkpoint
    if not checkpoint.enable:
        return _ignored_checkpoint_settings(checkpoint)
    problems = _checkpoint_policy_problems(checkpoint)
    if checkpoint.create_seed_checkpoint and world_size != 1:
        problems.append(
            f"checkpoint.create_seed_checkpoint = true runs on 1 process, not {world_size}; "
            "launch it with NGPU=1"
        )
    complete, incomplete = checkpoint_steps(checkpoint_folder(job_config))
    if checkpoint.load_step != -1 and checkpoint.load_step not in complete:
        problems.append(_missing_load_step(job_config, complete, incomplete))
    if not complete:
        problems += _initial_load_problems(job_config, incomplete)
    elif checkpoint.load_step in (-1, *complete):
        problems += _resume_problems(job_config, world_size, complete)
    return problems + _disk_space_problems(job_config)


# What a save writes: every state-dict tensor (a tied weight under each of its names) in fp32
# and AdamW's two fp32 moments of each parameter; a model-only save the tensors in
# checkpoint.export_dtype. DCP stores each item with about 1.3 KB of framing and 0.3 KB of
# metadata, and the optimizer's state is about 16 items a parameter (moments, step, and each
# value of its parameter group).
_EXPORT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_ITEM_BYTES, _OPTIMIZER_ITEMS = 2048, 16


def checkpoint_size(job_config) -> tuple[int, int, str] | None:
    """(bytes, parameters, what is saved) of the first checkpoint the run writes, or None
    when the model cannot be built (the model checks report why)."""
    from titan_gdn.model import Qwen35Model

    checkpoint, steps = job_config.checkpoint, job_config.training.steps
    try:
        with torch.device("meta"):
            model = Qwen35Model(_model_args(job_config))
    except Exception:
        return None
    state, weights = model.state_dict().values(), list(model.parameters())
    tensors = sum(value.numel() for value in state)
    parameters = sum(weight.numel() for weight in weights)
    full = checkpoint.interval < steps or checkpoint.enable_first_step_checkpoint
    if full or not checkpoint.last_save_model_only:
        items = len(state) + _OPTIMIZER_ITEMS * len(weights)
        size = 4 * tensors + 8 * parameters + _ITEM_BYTES * items
        return size, parameters, "fp32 weights and AdamW's two moments"
    export = checkpoint.export_dtype
    size = tensors * _EXPORT_BYTES[export] + _ITEM_BYTES * len(state)
    return size, parameters, f"{export} weights"


def _disk_space_problems(job_config) -> list[str]:
    """A disk without room for the run's first checkpoint: its save failed after training up
    to it, with DCP's `enforce fail at inline_container.cc ... unexpected pos` per rank."""
    size = checkpoint_size(job_config)
    if size is None:
        return []
    folder = checkpoint_folder(job_config).absolute()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free >= size[0]:
        return []
    needed, parameters, what = size
    return [
        f"job.dump_folder = {job_config.job.dump_folder!r} is on a disk with {gib(free)} free, "
        f"and a checkpoint of this run takes about {gib(needed)} ({parameters:,} parameters: "
        f"{what}): its first save would fail; free space, point job.dump_folder at a larger "
        "disk, or set checkpoint.enable = false"
    ]


def _ignored_checkpoint_settings(checkpoint) -> list[str]:
    ignored = {
        "create_seed_checkpoint": checkpoint.create_seed_checkpoint,
        "initial_load_path": checkpoint.initial_load_path,
        "initial_load_in_hf": checkpoint.initial_load_in_hf,
        "last_save_in_hf": checkpoint.last_save_in_hf,
    }
    return [
        f"checkpoint.{name} = {value!r} has no effect while checkpoint.enable = false; set "
        "checkpoint.enable = true (or drop the setting)"
        for name, value in ignored.items()
        if value
    ]


def _checkpoint_policy_problems(checkpoint) -> list[str]:
    problems = []
    if checkpoint.interval < 1:
        problems.append(f"checkpoint.interval = {checkpoint.interval} must be at least 1")
    if checkpoint.keep_latest_k == 1 or checkpoint.keep_latest_k < 0:
        problems.append(
            f"checkpoint.keep_latest_k = {checkpoint.keep_latest_k}: keep 0 (all) or at least "
            "2, since the newest may still be being written when older ones are purged"
        )
    if checkpoint.async_mode.lower() not in _ASYNC_MODES:
        problems.append(
            f"checkpoint.async_mode = {checkpoint.async_mode!r} is not one of {_ASYNC_MODES}"
        )
    if checkpoint.last_save_in_hf and not checkpoint.last_save_model_only:
        # torchtitan would only find this at the last step, after the whole run.
        problems.append(
            "checkpoint.last_save_in_hf = true exports only the model, so it needs "
            "checkpoint.last_save_model_only = true; set it, or drop last_save_in_hf"
        )
    if checkpoint.initial_load_in_hf and not checkpoint.initial_load_model_only:
        problems.append(
            "checkpoint.initial_load_in_hf = true loads only the model, so it needs "
            "checkpoint.initial_load_model_only = true"
        )
    return problems


def _missing_load_step(job_config, complete: list[int], incomplete: list[int]) -> str:
    step = job_config.checkpoint.load_step
    folder = checkpoint_folder(job_config)
    state = "was interrupted while being written" if step in incomplete else "does not exist"
    if not complete:
        return (
            f"checkpoint.load_step = {step} but {folder} holds no complete checkpoint; "
            "set checkpoint.load_step = -1"
        )
    return (
        f"checkpoint.load_step = {step} but {step_folder(folder, step)} {state}; choose one "
        f"of the complete steps {complete}, or -1 for the latest"
    )


def _initial_load_problems(job_config, incomplete: list[int]) -> list[str]:
    """A fresh run (no checkpoint to resume) loads its initial weights from here."""
    checkpoint = job_config.checkpoint
    wants_initial_load = checkpoint.initial_load_path or checkpoint.initial_load_in_hf
    if wants_initial_load and checkpoint_folder(job_config).exists():
        # torchtitan loads the initial weights only when the checkpoint folder does not exist;
        # a folder holding only an interrupted save would start from random weights instead.
        return [
            f"{checkpoint_folder(job_config)} exists but holds no complete checkpoint "
            f"(interrupted: {', '.join(f'step-{s}' for s in incomplete)}), so the initial weights "
            "(checkpoint.initial_load_path / initial_load_in_hf) would be skipped; delete that "
            "folder to start again from them"
        ]
    if checkpoint.initial_load_path:
        if not os.path.isdir(checkpoint.initial_load_path):
            return [
                f"checkpoint.initial_load_path = {checkpoint.initial_load_path!r} is not a "
                "folder; point it at a checkpoint step folder (or an HF model folder with "
                "checkpoint.initial_load_in_hf)"
            ]
        source, setting_name = checkpoint.initial_load_path, "checkpoint.initial_load_path"
    elif checkpoint.initial_load_in_hf:
        source, setting_name = job_config.model.hf_assets_path, "model.hf_assets_path"
    else:
        return []
    if checkpoint.initial_load_in_hf and not any(Path(source).glob("*.safetensors")):
        return [
            f"checkpoint.initial_load_in_hf = true but {setting_name} = {source!r} has no "
            "*.safetensors weights; point it at the HF model folder"
        ]
    if checkpoint.initial_load_in_hf:
        damage = _hf_weight_damage(Path(source))
        if damage:
            return [
                f"{setting_name} = {source!r} is a damaged Hugging Face folder ({damage}); copy "
                f"it again, or point {setting_name} at an intact one"
            ]
        return _unused_hf_weight_problems(job_config, source, setting_name)
    other_model = _other_model_problem(
        job_config, Path(source), "point checkpoint.initial_load_path at a checkpoint of this "
        "model, or set model.flavor to the one it holds",
    )  # fmt: skip
    return [other_model] if other_model else []


def _hf_weight_damage(folder: Path) -> str | None:
    """What makes the folder's weights unreadable, None when their headers all read: the import
    reads every *.safetensors there, and other tools the files the index names."""
    try:
        safetensors_shapes(sorted({*safetensors_files(folder), *folder.glob("*.safetensors")}))
    except UnreadableWeightsError as problem:
        return str(problem)
    return None


_LAYER_INDEX = re.compile(r"\blayers\.(\d+)\.")


def _unused_hf_weight_problems(job_config, source: str, setting_name: str) -> list[str]:
    """An HF import loads the tensors the model asks for and never looks at the others: a
    config.json with fewer layers (or a smaller model) than the weights would train a cut-down
    model without a word. Names from the safetensors headers; no weight is read."""
    try:
        args = _model_args(job_config)
    except (KeyError, ValueError, FileNotFoundError):
        return []  # reported by the model checks
    stored, requested = _stored_hf_names(Path(source)), _requested_hf_names(args, job_config)
    missing = sorted(requested - stored)
    if missing:
        # torchtitan would stop at the first of them only once the model is built and sharded.
        more = f", ... ({len(missing) - 3} more)" if len(missing) > 3 else ""
        return [
            f"{setting_name} = {source!r} lacks {len(missing)} tensor(s) that model.flavor = "
            f"{job_config.model.flavor!r} needs from an HF import: "
            f"{', '.join(missing[:3])}{more}; use the checkpoint's own config.json "
            '(model.flavor = "from_hf_config" with model.hf_assets_path at its folder, whose '
            "weights also set the layout the import reads)"
        ]
    if args.enable_weight_tying:
        stored.discard("lm_head.weight")  # tied: the embedding is the output projection
    unused = sorted(stored - requested)
    if not unused:
        return []
    layers = {int(match.group(1)) for name in unused if (match := _LAYER_INDEX.search(name))}
    beyond = [layer for layer in layers if layer >= args.n_layers]
    depth = (
        f"; it has layers up to {max(beyond)} and the model {args.n_layers} (n_layers, "
        "num_hidden_layers in config.json)"
        if beyond
        else ""
    )
    more = f", ... ({len(unused) - 3} more)" if len(unused) > 3 else ""
    return [
        f"{setting_name} = {source!r} holds {len(unused)} tensor(s) that model.flavor = "
        f"{job_config.model.flavor!r} does not use, which an HF import leaves out without a "
        f"word: {', '.join(unused[:3])}{more}{depth}; use the checkpoint's own config.json "
        '(model.flavor = "from_hf_config" with model.hf_assets_path at its folder)'
    ]


def _stored_hf_names(folder: Path) -> set[str]:
    from titan_gdn.model.state_dict_adapter import NOT_TEXT

    names = safetensors_shapes(folder.glob("*.safetensors"))
    return {name for name in names if not NOT_TEXT.match(name)}  # vision, MTP: not loaded


def _requested_hf_names(args, job_config) -> set[str]:
    """The HF names the import asks for: the model's state dict (built on the meta device)
    through the state-dict adapter, as torchtitan's HF load maps it."""
    import torch

    from titan_gdn.model import Qwen35Model, Qwen35StateDictAdapter

    with torch.device("meta"):
        state_dict = Qwen35Model(args).state_dict()
    adapter = Qwen35StateDictAdapter(args, job_config.model.hf_assets_path)
    return set(adapter.to_hf(state_dict))


def _resume_problems(job_config, world_size: int, complete: list[int]) -> list[str]:
    """What torchtitan would trip over once the model is built, or silently not do, when it
    resumes from the step it picks: a finished run, a checkpoint without the training state,
    a data position split over other ranks."""
    checkpoint = job_config.checkpoint
    step = complete[-1] if checkpoint.load_step == -1 else checkpoint.load_step
    if step == 0 or checkpoint.create_seed_checkpoint:
        return []  # a seed checkpoint is loaded as model only; a seed run loads nothing
    folder = step_folder(checkpoint_folder(job_config), step)
    if 1 <= job_config.training.steps <= step:
        return [_finished_run_problem(job_config, folder, step)]
    model_only = _model_only_problem(checkpoint, folder, [s for s in complete if s < step])
    if model_only:
        return [model_only]
    other_model = _other_model_problem(
        job_config, folder, "resume with the model.flavor it was trained with, or set a new "
        "job.dump_folder for a new run",
    )  # fmt: skip
    if other_model:
        return [other_model]
    return _data_parallel_rank_problems(job_config, world_size, folder)


def _other_model_problem(job_config, folder: Path, fix: str) -> str | None:
    """A DCP checkpoint of another model than the config's (another flavor, config.json or
    dump folder): torchtitan stopped each rank with `Missing key in checkpoint state_dict`,
    or a size mismatch, once the model was built and sharded. From the metadata alone."""
    if "model" in job_config.checkpoint.exclude_from_loading:
        return None
    try:
        args = _model_args(job_config)
        found = {ours: meta.size for ours, (_, meta) in dcp_model_keys(folder).items()}
    except Exception:  # the model checks, or the checkpoint's checksums, report those
        return None
    difference = model_difference(found, args)
    if difference is None:
        return None
    fits = flavors_that_fit(found)
    named = f" (model.flavor = {fits[0]!r} fits it)" if fits else ""
    return (
        f"{folder} holds another model than model.flavor = {job_config.model.flavor!r}: "
        f"{difference}{named}; {fix}"
    )


def _finished_run_problem(job_config, folder: Path, step: int) -> str:
    steps = job_config.training.steps
    return (
        f"{folder} is step {step}, at or past training.steps = {steps}: the run in "
        f"job.dump_folder = {job_config.job.dump_folder!r} is finished and would train nothing; "
        f"raise training.steps above {step} to train on, or set a new job.dump_folder for a new run"
    )


def _model_only_problem(checkpoint, folder: Path, earlier: list[int]) -> str | None:
    """A resume from a checkpoint that holds only the model (`last_save_model_only`, or an HF
    export) fails in torchtitan with a missing key or a missing .metadata."""
    wanted = [name for name in TRAINING_STATES if name not in checkpoint.exclude_from_loading]
    if (folder / DCP_METADATA).is_file():
        saved = saved_states(folder)
        if not wanted or saved is None or saved & set(TRAINING_STATES):
            return None  # unreadable metadata is for the resume's verification to report
        kind, in_hf = "checkpoint.last_save_model_only = true", ""
    else:
        kind = "a Hugging Face export, checkpoint.last_save_in_hf = true"
        in_hf = " and checkpoint.initial_load_in_hf = true"
    other_step = (
        f", or resume from an earlier step with checkpoint.load_step (complete: {earlier})"
        if earlier
        else ""
    )
    return (
        f"{folder} holds only the model ({kind}), not the optimizer, learning-rate schedule, "
        f"data position and step a resume loads; to train on from these weights, start a new "
        f"run (a new job.dump_folder) with checkpoint.initial_load_path = '{folder}'{in_hf}"
        f"{other_step}"
    )


def _data_parallel_rank_problems(job_config, world_size: int, folder: Path) -> list[str]:
    """The data loader's position is saved per data-parallel rank and cannot be resharded
    (torchtitan asserts it once the model is built); compare the rank counts now."""
    if "dataloader" in job_config.checkpoint.exclude_from_loading:
        return []  # the data position is not restored
    saved = saved_data_parallel_ranks(folder)
    parallelism = job_config.parallelism
    ranks = parallelism.data_parallel_replicate_degree * _shard_degree(parallelism, world_size)
    if saved is None or saved == ranks:
        return []
    return [
        f"resuming from {folder}, written by {saved} data-parallel ranks, with {ranks}: the "
        "data loader's position cannot be split differently; run with the same data-parallel "
        'ranks (NGPU x NNODES / parallelism degrees), or add "dataloader" to '
        "checkpoint.exclude_from_loading, or use a new job.dump_folder"
    ]


def _log_incomplete_checkpoints(job_config) -> None:
    if not job_config.checkpoint.enable:
        return
    complete, incomplete = checkpoint_steps(checkpoint_folder(job_config))
    newer = [step for step in incomplete if not complete or step > complete[-1]]
    if newer:
        latest = f"step-{complete[-1]}" if complete else "no checkpoint (a fresh start)"
        logger.warning(
            f"Ignoring checkpoint(s) {', '.join(f'step-{s}' for s in newer)} in "
            f"{checkpoint_folder(job_config)}: interrupted while being written (no .metadata); "
            f"resuming from {latest}"
        )


# Faults


def _fault_policy_problems(job_config) -> list[str]:
    skips = setting(job_config, "training", "skip_nonfinite_loss_steps")
    if skips < 0:
        return [
            f"training.skip_nonfinite_loss_steps = {skips} must be at least 0 (0: stop at the "
            "first NaN/inf loss)"
        ]
    return []


# The sample after training


def _sample_problems(job_config) -> list[str]:
    """[sample] runs after the last step: a top_k below 1 would fail there (an IndexError,
    after the whole run) and a negative temperature would draw the least likely tokens. The
    rules are generate's (`sampling_problems`); they matter only when there is a prompt."""
    if not setting(job_config, "sample", "prompt"):
        return []
    from titan_gdn.generate import sampling_problems

    fields = ("max_new_tokens", "temperature", "top_k")
    values = {name: setting(job_config, "sample", name) for name in fields}
    # sample.top_k always has a value (50 by default): a large one samples among all tokens.
    return sampling_problems(
        **values,
        names={name: f"sample.{name} =" for name in fields},
        sample_all='the vocabulary size or more samples among all tokens; sample.prompt = "" '
        "takes no sample",
    )


# Before the launcher


def _custom_import_problems(module: str) -> list[str]:
    """torchtitan imports `[experimental] custom_import` in every rank, after the process
    group is up: a typo would fail there, once per rank."""
    if not module:
        return []
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that does not exist
        found = False
    if found:
        return []
    return [
        f"experimental.custom_import = {module!r} is not an importable module; for this "
        'package use "titan_gdn" (it registers model.name = "qwen3_5")'
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m titan_gdn.validation --world-size N --job.config_file X [overrides]``: the
    trainer's checks, in one process, before a launcher starts N ranks (run_train.sh runs it
    before torchrun). Every problem is printed, one per line, without a traceback, and the exit
    status is 1; nothing is printed when there is none. In the ranks the same problems would
    arrive inside tracebacks and torchrun's failure report, from whichever rank failed first:
    one whose output the console may not show."""
    parser = argparse.ArgumentParser(prog="python -m titan_gdn.validation", allow_abbrev=False)
    parser.add_argument("--world-size", type=int, required=True, help="NGPU x NNODES")
    options, trainer_args = parser.parse_known_args(argv)
    from titan_gdn.config_check import check_config_file
    from titan_gdn.cpu import use_cpu_if_no_accelerator

    use_cpu_if_no_accelerator()  # as the trainer does, before torchtitan reads the device
    check_config_file(trainer_args)
    from torchtitan.config import ConfigManager

    from titan_gdn.train_spec import TRAIN_SPEC_NAME

    job_config = ConfigManager().parse_args(trainer_args)
    problems = _custom_import_problems(job_config.experimental.custom_import)
    if job_config.model.name != TRAIN_SPEC_NAME and not problems:
        return 0  # another model's trainer checks its own config
    problems = problems or configuration_problems(job_config, options.world_size)
    if problems:
        print(ConfigError(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
