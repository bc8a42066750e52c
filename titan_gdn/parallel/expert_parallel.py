"""Expert parallelism: each MoE layer's routed experts split over the `ep` mesh dimension.

torchtitan 0.2.2's `ExpertParallel` does the work: it shards `GroupedExperts`' two weights on
the expert dimension and wraps its forward with an all-to-all that sends each routed token to
the rank holding its expert (then pads the groups for the grouped GEMMs) and one that brings the
outputs back. The router, the shared expert and everything outside the MoE block stay
replicated (FSDP shards them as any other weight).

torchtitan's `ep` borrows ranks from data_parallel_shard x context_parallel: with context
parallel, every cp rank routes the tokens of its own sequence shard (routing is per token), and
the all-to-all over `ep` mixes tokens of several cp ranks and data ranks alike. So CP asks
nothing more of the MoE, and EP nothing of the mixers.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.distributed.expert_parallel import ExpertParallel


def expert_parallel_problems(args, degree: int, shard_x_cp: int) -> list[str]:
    """Why the model `args` cannot run with expert_parallel_degree = `degree` over
    data_parallel_shard x context_parallel = `shard_x_cp` ranks; empty when it can."""
    if degree <= 1:
        return []
    setting = f"parallelism.expert_parallel_degree = {degree}"
    if not args.moe_layers:
        return [f"{setting} needs an MoE model, but this flavor has no experts; set it to 1"]
    problems = []
    if args.num_experts % degree:
        problems.append(
            f"{setting} does not divide the model's num_experts = {args.num_experts}; choose "
            "a degree that divides it"
        )
    if shard_x_cp % degree:
        problems.append(
            f"{setting} does not divide data_parallel_shard_degree x context_parallel_degree "
            f"= {shard_x_cp} (expert parallel ranks are taken from those); choose a degree "
            "that divides it"
        )
    return problems


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's routed experts over `ep_mesh`, tokens dispatched by all-to-all."""
    problems = expert_parallel_problems(model.model_args, ep_mesh.size(), ep_mesh.size())
    if problems:
        raise ValueError("expert parallel cannot shard this model: " + "; ".join(problems))
    for block in model.layers.values():
        if block.moe:
            parallelize_module(block.mlp.experts, ep_mesh, ExpertParallel())
