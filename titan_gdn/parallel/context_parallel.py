"""Context parallelism for the hybrid model, as head placements on the `cp` mesh dimension.

Every mixer (Gated DeltaNet and gated attention alike) runs its projections on a contiguous
sequence shard and its sequence mixing over the whole sequence for 1/N of its head groups
(see `HeadSharding`). Document boundaries are computed once on the global sequence, so
documents may cross shard boundaries freely and only seq_len % N == 0 is required.

torchtitan's CP load balancer (head-tail / PTRR reordering of tokens) is not used: each rank
mixes every token for its heads, so the work is balanced by construction, and the conv and
the recurrent state need the tokens in order. `shard_sequence` cuts contiguous shards instead.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from titan_gdn.model.args import Qwen35ModelArgs


def context_parallel_problems(args: Qwen35ModelArgs, degree: int) -> list[str]:
    """Why the heads of `args` cannot be split over context_parallel_degree = `degree`, as
    messages naming the setting and a fix; empty when they can. (The sequence length is
    checked with the rest of the job config, in `job_config_problems`.)"""
    if degree <= 1:
        return []
    setting = f"parallelism.context_parallel_degree = {degree}"
    problems = []
    per_head = {
        "linear_num_key_heads": args.linear_num_key_heads,
        "linear_num_value_heads": args.linear_num_value_heads,
        "n_heads": args.n_heads,
    }
    for name, heads in per_head.items():
        if heads % degree:
            problems.append(
                f"model {name} = {heads} is not divisible by {setting}; "
                "choose a degree that divides it"
            )
    kv = args.n_kv_heads
    # KV heads fewer than the degree are repeated, which needs whole repeats per rank.
    if kv % degree and (degree % kv or args.n_heads % degree):
        problems.append(
            f"model n_kv_heads = {kv} can neither be split nor evenly repeated over {setting}; "
            "choose a degree that divides it or a multiple of it that divides n_heads"
        )
    return problems


def shard_sequence(tensor: torch.Tensor, cp_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's contiguous slice of a [B, T, ...] tensor along the sequence."""
    return tensor.chunk(cp_mesh.size(), dim=1)[cp_mesh.get_local_rank()]
