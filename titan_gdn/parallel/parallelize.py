"""TrainSpec parallelize function: context parallel, activation checkpointing, compile, FSDP2.

Modelled on torchtitan 0.2.2's ``models/llama3/infra/parallelize.py`` and
``models/qwen3/infra/parallelize.py``. Only data parallelism (FSDP2, optionally HSDP) and
context parallelism are supported. It relies on the Transformer layout shared by torchtitan's
llama3/qwen3 models and ours: ``tok_embeddings``, ``layers`` (a ModuleDict of blocks), ``norm``,
``output``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.config.job_config import Compile as CompileConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_gdn.parallel.activation_checkpoint import apply_activation_checkpointing

_UNSUPPORTED = (
    ("tp", "parallelism.tensor_parallel_degree"),
    ("pp", "parallelism.pipeline_parallel_degree"),
    ("ep", "parallelism.expert_parallel_degree"),
    ("etp", "parallelism.expert_tensor_parallel_degree"),
)


def parallelize_qwen3_5(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply CP, activation checkpointing, per-block compile and FSDP2 (in that order)."""
    _check_supported(parallel_dims)
    if parallel_dims.cp_enabled:
        # Lazy: the CP modules are only needed (and only imported) when cp > 1.
        from titan_gdn.parallel.cp_layout import (
            apply_context_parallel_layout,
            choose_layout,
            context_parallel_split,
        )

        split = context_parallel_split(job_config)
        split.pop("seq_len")
        split["degree"] = parallel_dims.cp
        layout = choose_layout(model.model_args, **split)
        apply_context_parallel_layout(model, parallel_dims.get_mesh("cp"), layout)

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_activation_checkpointing(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            dump_folder=job_config.job.dump_folder,
        )
    # After AC wrapping and before FSDP, as torchtitan does.
    if compile_model:
        _compile_blocks(model, job_config.compile)
    if parallel_dims.fsdp_enabled:
        _apply_fsdp(model, parallel_dims, job_config)
    return model


def _check_supported(parallel_dims: ParallelDims) -> None:
    problems = unsupported_parallelism_problems(parallel_dims)
    if problems:
        raise ValueError("; ".join(problems))


def unsupported_parallelism_problems(parallel_dims: ParallelDims) -> list[str]:
    """The parallelisms in `parallel_dims` that titan_gdn does not implement, as messages
    naming the setting; empty when all are supported."""
    problems = [
        f"{setting} = {getattr(parallel_dims, dim)} is not supported: titan_gdn supports only "
        "FSDP (data_parallel_shard_degree, optionally with data_parallel_replicate_degree) "
        "and context parallelism (context_parallel_degree)."
        for dim, setting in _UNSUPPORTED
        if getattr(parallel_dims, dim) > 1
    ]
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        problems.append(
            f"parallelism.data_parallel_replicate_degree = {parallel_dims.dp_replicate} "
            "without sharding (pure DDP) is not supported: use data_parallel_shard_degree "
            "(FSDP), or both for HSDP."
        )
    return problems


def _compile_blocks(model: nn.Module, compile_config: CompileConfig) -> None:
    # Per block: the blocks repeat, so one graph per layer type serves them all. fullgraph:
    # the kernels are custom ops and document boundaries have a fixed shape, so a graph break
    # or a recompile per batch would be a bug to surface, not a cost to absorb.
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(
            layer_id, torch.compile(block, backend=compile_config.backend, fullgraph=True)
        )
    logger.info(f"Compiled each decoder block with torch.compile ({compile_config.backend})")


def _reshard_after_forward(policy: str, pp_enabled: bool) -> bool:
    match policy:
        case "always":
            return True
        case "never":
            return False
        case "default":
            return not pp_enabled
    raise ValueError(f"Invalid parallelism.fsdp_reshard_after_forward: {policy!r}")


def _fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    # "fsdp" is torchtitan 0.2.2's flattened dp_shard x cp dimension; HSDP adds dp_replicate.
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    return parallel_dims.get_mesh(names)


def _apply_fsdp(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    training = job_config.training
    config: dict[str, Any] = {
        "mesh": _fsdp_mesh(parallel_dims),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        ),
    }
    # On a CPU mesh the parameters already live in host memory: nothing to offload.
    if training.enable_cpu_offload and config["mesh"].device_type != "cpu":
        config["offload_policy"] = CPUOffloadPolicy()
    policy = job_config.parallelism.fsdp_reshard_after_forward
    reshard = _reshard_after_forward(policy, parallel_dims.pp_enabled)

    tied = _embeddings_tied(model)
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=reshard)
    # The last unit is needed right after forward (backward starts there): keep it unsharded
    # unless resharding is forced. A tied embedding joins it so that one FSDP unit owns (and
    # reduces) the shared weight once.
    tail = [m for m in (model.norm, model.output) if m is not None]
    if tied:
        tail.insert(0, model.tok_embeddings)
    if tail:
        fully_shard(tail, **config, reshard_after_forward=policy == "always")
    fully_shard(model, **config)
    _sum_gradients(model)
    logger.info(f"Applied {'HSDP' if parallel_dims.dp_replicate_enabled else 'FSDP'}")


def _embeddings_tied(model: nn.Module) -> bool:
    embeddings, output = model.tok_embeddings, model.output
    return embeddings is not None and output is not None and output.weight is embeddings.weight


def _sum_gradients(model: nn.Module) -> None:
    """Make FSDP reduce gradients with a plain SUM across data-parallel ranks.

    torchtitan's trainer already divides each rank's loss by the *global* token count
    (train.py forward_backward_step), so the correct gradient is the sum over ranks; FSDP's
    default would average (divide by the dp x cp size again). torchtitan gets the sum with
    ``set_gradient_divide_factor(1.0)``, which NCCL runs as ``ReduceOp.PREMUL_SUM(1.0)``, an
    op gloo lacks. Forcing sum-only comms keeps the factor 1.0 but issues ``ReduceOp.SUM``:
    the same result, on NCCL and on gloo (CPU) alike.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
