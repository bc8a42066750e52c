"""How context_parallel_degree = N is split: heads x states, as two dimensions of the cp mesh.

- `heads` ranks exchange head groups (Ulysses, `HeadSharding`): every token's q, k, v and gates
  cross the group twice per layer, and every head count must split over them. Fast inside one
  NVLink domain.
- `states` ranks keep contiguous sequence chunks and pass what crosses a chunk boundary
  (`StatePassing`): a few recurrent states per GDN layer, K - 1 conv tokens, attention's K and V;
  no divisibility rule. For groups beyond one node or beyond the head counts.

The cp ranks form a [states, heads] grid, heads varying fastest: the heads ranks of a chunk are
neighbours (one node), and together they hold a contiguous stretch of the row, so after their
exchange each holds its chunk of T / states tokens. `parallelism.context_parallel_mode` picks
the split ("heads", "states", "auto") and `context_parallel_heads_degree` its heads factor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.tools.logging import logger

from titan_gdn.job_config import setting
from titan_gdn.model.args import Qwen35ModelArgs
from titan_gdn.parallel.context_parallel import context_parallel_problems
from titan_gdn.placements.head_sharding import NO_SHARDING, HeadSharding
from titan_gdn.placements.state_passing import NO_STATE_PASSING, StatePassing

MODES = ("auto", "heads", "states")
MODE_SETTING = "parallelism.context_parallel_mode"
HEADS_SETTING = "parallelism.context_parallel_heads_degree"


@dataclass(frozen=True)
class ContextParallelLayout:
    heads: int
    states: int
    reason: str = ""

    @property
    def degree(self) -> int:
        return self.heads * self.states

    def __str__(self) -> str:
        if self.states == 1:
            return f"heads (cp = {self.heads} head groups)"
        if self.heads == 1:
            return f"states (cp = {self.states} sequence chunks)"
        return f"heads {self.heads} x states {self.states}"


def choose_layout(
    args: Qwen35ModelArgs,
    degree: int,
    mode: str = "auto",
    heads_degree: int = 0,
    gpus_per_node: int | None = None,
) -> ContextParallelLayout:
    """The split of context_parallel_degree = `degree` that `mode` and `heads_degree` ask for
    (0: the mode's own), with the reason for it; its problems are `layout_problems`'.

    "auto": all heads when the head counts divide `degree` and the group fits in one node of
    `gpus_per_node` (None: no limit); otherwise the most head groups that divide the head
    counts and fit in a node, times sequence chunks (states alone when none do).
    """
    if heads_degree:
        return ContextParallelLayout(heads_degree, degree // heads_degree, f"{HEADS_SETTING}")
    if mode == "heads" or degree == 1:
        return ContextParallelLayout(degree, 1, f"{MODE_SETTING} = {mode!r}")
    if mode == "states":
        return ContextParallelLayout(1, degree, f"{MODE_SETTING} = 'states'")
    node = gpus_per_node or degree
    if degree <= node and not context_parallel_problems(args, degree):
        return ContextParallelLayout(
            degree, 1, f"the head counts split {degree} ways and the group fits in one node"
        )
    heads = max(
        d
        for d in range(1, min(degree, node) + 1)
        if degree % d == 0 and not context_parallel_problems(args, d)
    )
    why = (
        "the head counts do not split over cp"
        if context_parallel_problems(args, degree)
        else f"cp = {degree} spans more than one node of {node} GPUs"
    )
    if heads == 1:
        return ContextParallelLayout(1, degree, f"{why}: state passing over all cp ranks")
    return ContextParallelLayout(
        heads,
        degree // heads,
        f"{why}: {heads} head groups (the most that split the heads "
        f"and fit in a node) x {degree // heads} sequence chunks",
    )


def layout_problems(
    args: Qwen35ModelArgs,
    degree: int,
    mode: str,
    heads_degree: int,
    seq_len: int,
    gpus_per_node: int | None = None,
) -> list[str]:
    """Why context_parallel_degree = `degree` cannot be split as asked, each naming the settings
    and a fix; empty when it can. (seq_len % degree is checked with the job config.)"""
    if mode not in MODES:
        return [f"{MODE_SETTING} = {mode!r} is not one of {MODES}"]
    if degree <= 1:
        return []
    setting = f"parallelism.context_parallel_degree = {degree}"
    if heads_degree < 0 or (heads_degree and degree % heads_degree):
        return [
            f"{HEADS_SETTING} = {heads_degree} does not divide {setting}; choose a divisor of "
            f"{degree}, or 0 to let {MODE_SETTING} decide"
        ]
    if mode == "heads" and heads_degree not in (0, degree):
        return [
            f"{HEADS_SETTING} = {heads_degree} with {MODE_SETTING} = 'heads' (all {degree} cp "
            f"ranks exchange heads); set {MODE_SETTING} = 'states' or 'auto' for "
            f"{heads_degree} head groups x {degree // heads_degree} sequence chunks"
        ]
    layout = choose_layout(args, degree, mode, heads_degree, gpus_per_node)
    problems = [
        f"{problem} (head groups of {layout}: lower {HEADS_SETTING}, or set {MODE_SETTING} "
        "= 'states' or 'auto', which need no divisibility)"
        for problem in context_parallel_problems(args, layout.heads)
    ]
    if layout.states > 1 and seq_len // layout.states < args.linear_conv_kernel_dim - 1:
        problems.append(
            f"training.seq_len = {seq_len} over {layout.states} sequence chunks ({layout}) "
            f"leaves {seq_len // layout.states} tokens per chunk, fewer than the conv needs from "
            f"the chunk before ({args.linear_conv_kernel_dim - 1}); use fewer chunks or longer rows"
        )
    return problems


def context_parallel_split(job_config) -> dict:
    """The settings that split context_parallel_degree, as `cp_layout.choose_layout` and
    `layout_problems` take them; a node holds LOCAL_WORLD_SIZE processes (torchrun's)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return {
        "degree": job_config.parallelism.context_parallel_degree,
        "mode": setting(job_config, "parallelism", "context_parallel_mode"),
        "heads_degree": setting(job_config, "parallelism", "context_parallel_heads_degree"),
        "seq_len": job_config.training.seq_len,
        "gpus_per_node": int(local) if local else None,
    }


def split_cp_mesh(cp_mesh: DeviceMesh, layout: ContextParallelLayout):
    """(heads mesh, states mesh) of `cp_mesh` cut into [states, heads], heads varying fastest;
    None for a dimension of size 1."""
    if layout.states == 1:
        return cp_mesh, None
    if layout.heads == 1:
        return None, cp_mesh
    grid = cp_mesh._unflatten(0, (layout.states, layout.heads), ("cp_states", "cp_heads"))
    return grid["cp_heads"], grid["cp_states"]


def apply_context_parallel_layout(
    model: torch.nn.Module, cp_mesh: DeviceMesh, layout: ContextParallelLayout
) -> None:
    """Place every mixer on `cp_mesh` as `layout` splits it: its head groups over the heads
    dimension (`HeadSharding`), its sequence over the states dimension (`StatePassing`)."""
    logger.info(f"Context parallel over {cp_mesh.size()} ranks: {layout} ({layout.reason})")
    problems = context_parallel_problems(model.model_args, layout.heads)
    if problems:
        raise ValueError("context parallel cannot shard this model: " + "; ".join(problems))
    heads_mesh, states_mesh = split_cp_mesh(cp_mesh, layout)
    heads = NO_SHARDING if heads_mesh is None else HeadSharding(heads_mesh)
    states = NO_STATE_PASSING if states_mesh is None else StatePassing(states_mesh)
    for layer in model.layers.values():
        layer.mixer.heads = heads
        layer.mixer.states = states
    model.state_passing = states
