"""TrainSpec parallelize function: context parallel, expert parallel, activation checkpointing,
compile, FSDP2.

Modelled on torchtitan 0.2.2's ``models/llama3/infra/parallelize.py`` and
``models/qwen3/infra/parallelize.py``. Only data parallelism (FSDP2, optionally HSDP), context
and expert parallelism are supported. It relies on the Transformer layout shared by
torchtitan's llama3/qwen3 models and ours: ``tok_embeddings``, ``layers`` (a ModuleDict of
blocks), ``norm``, ``output``.
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
from torch.distributed.tensor import Shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_gdn.job_config import setting
from titan_gdn.parallel.activation_checkpoint import apply_activation_checkpointing

_UNSUPPORTED = (
    ("tp", "parallelism.tensor_parallel_degree"),
    ("pp", "parallelism.pipeline_parallel_degree"),
    ("etp", "parallelism.expert_tensor_parallel_degree"),
)


def parallelize_qwen3_5(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    """Apply CP, EP, activation checkpointing, per-block compile and FSDP2 (in that order)."""
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
    if parallel_dims.ep_enabled:
        from titan_gdn.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))

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
        cudagraphs = setting(job_config, "compile", "cudagraphs")
        _compile_blocks(model, job_config.compile.backend, cudagraphs)
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
        "FSDP (data_parallel_shard_degree, optionally with data_parallel_replicate_degree), "
        "context parallelism (context_parallel_degree) and expert parallelism "
        "(expert_parallel_degree)."
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


def _compile_blocks(model: nn.Module, backend: str, cudagraphs: bool) -> None:
    # Per block: the blocks repeat, so one graph per layer type serves them all. fullgraph:
    # the kernels are custom ops and document boundaries have a fixed shape, so a graph break
    # or a recompile per batch would be a bug to surface, not a cost to absorb.
    # With cudagraphs, inductor cuts each graph at the ops tagged cudagraph_unsafe (ours, whose
    # launches follow the documents: ops/custom_op.py) and replays the parts between as CUDA
    # graphs, so a block's dozens of fused kernels cost the host one launch per part.
    options = {"triton.cudagraphs": True, "graph_partition": True} if cudagraphs else None
    if cudagraphs:
        model.block_mask_storage = {}  # the masks' static inputs at fixed addresses
    for layer_id, block in model.layers.named_children():
        if block.moe:
            compile_moe_block(block, backend)
            continue
        model.layers.register_module(
            layer_id, torch.compile(block, backend=backend, fullgraph=True, options=options)
        )
    graphs = ", replayed as CUDA graphs" if cudagraphs else ""
    logger.info(f"Compiled each decoder block with torch.compile ({backend}{graphs})")


def cudagraph_problems(job_config, world_size: int, moe: bool) -> list[str]:
    """Why `compile.cudagraphs` cannot run this job, one message per reason (empty when off
    or when it can)."""
    if not setting(job_config, "compile", "cudagraphs"):
        return []
    compile_config, problems = job_config.compile, []
    if not (compile_config.enable and "model" in compile_config.components):
        problems.append(
            "compile.cudagraphs replays the compiled blocks: set compile.enable = true with "
            '"model" in compile.components, or leave compile.cudagraphs off'
        )
    elif compile_config.backend != "inductor":
        problems.append(
            f'compile.cudagraphs needs compile.backend = "inductor" (got '
            f'"{compile_config.backend}"), or leave it off'
        )
    if world_size > 1:
        problems.append(
            f"compile.cudagraphs runs on one GPU only ({world_size} processes): FSDP's, context "
            "and expert parallel's parameters and collectives are not captured; leave it off"
        )
    if moe:
        problems.append(
            "compile.cudagraphs is for dense flavors: an MoE block routes its tokens on the host; "
            "leave it off"
        )
    training = job_config.training
    if training.global_batch_size > 0 and training.global_batch_size != training.local_batch_size:
        # torch's CUDA graph trees give AccumulateGrad the graph's own output buffer, which the
        # next micro-batch's replay overwrites (pytorch/pytorch#169545).
        problems.append(
            f"compile.cudagraphs needs one micro-batch per step: training.global_batch_size = "
            f"{training.global_batch_size} accumulates gradients over micro-batches of "
            f"{training.local_batch_size}; set it to -1 or leave compile.cudagraphs off"
        )
    if setting(job_config, "sample", "prompt"):
        problems.append(
            "compile.cudagraphs with [sample] prompt: sampling would record graphs for every "
            'length; set sample.prompt = "" and sample the checkpoint with '
            "python -m titan_gdn.generate"
        )
    if not torch.cuda.is_available():
        problems.append("compile.cudagraphs needs a CUDA GPU; leave it off on CPU")
    return problems


def compile_moe_block(block: nn.Module, backend: str) -> None:
    """Compile an MoE block's parts but its routed experts, as torchtitan's MoE models do: the
    experts' token dispatch reads the group sizes on the host (expert parallel, the CPU loop)
    and FSDP's hooks on them would break a block-wide graph."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    for name, child in inner.named_children():
        if name != "mlp":
            setattr(inner, name, torch.compile(child, backend=backend, fullgraph=True))
    for name, child in inner.mlp.named_children():
        if name != "experts":
            setattr(inner.mlp, name, torch.compile(child, backend=backend, fullgraph=True))


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
        if parallel_dims.ep_enabled and block.moe:
            _shard_experts(block.mlp.experts, parallel_dims, config, reshard)
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


def _shard_experts(experts: nn.Module, parallel_dims: ParallelDims, config, reshard) -> None:
    """Expert-parallel experts are FSDP units of their own, over the ranks that hold the same
    experts (torchtitan's `efsdp`); the rest of the block is sharded over `fsdp`. Where the
    ranks outnumber the experts, they shard each expert's rows (dim 1), as torchtitan does."""
    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    mesh = parallel_dims.get_mesh(names)
    efsdp, ep = parallel_dims.get_mesh("efsdp").size(), parallel_dims.ep
    placement = (lambda param: Shard(1)) if efsdp * ep > experts.num_experts else None
    fully_shard(
        experts,
        **{**config, "mesh": mesh},
        reshard_after_forward=reshard,
        shard_placement_fn=placement,
    )


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
