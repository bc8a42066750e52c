"""The routed experts' SwiGLU over token rows grouped by expert.

Rows arrive grouped by expert: rows before `group_ends[0]` go to expert 0, those from there to
`group_ends[1]` to expert 1, and so on; a group may end with padding rows, and rows after the
last group are padding too: their outputs are not read. Weights are stored as transformers'
Qwen3.5 MoE stores them: `gate_up` [E, 2 * I, D] (gate rows, then up rows) and
`down` [E, D, I].

- `grouped_mm` (CUDA): one `torch._grouped_mm` for gate and up together, one for down, with
  no host sync (so it compiles and overlaps). Its groups must start at aligned rows; the caller
  pads them (`SparseMoeBlock.route`, or torchtitan's expert-parallel dispatch).
- `loop` (any device, the reference): one matmul pair per expert, reading the group ends on
  the host. On CPU `torch._grouped_mm` runs forward but not backward (torch 2.13), hence this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_gdn.ops.backends import resolve_backend

EXPERTS_BACKENDS = ("grouped_mm", "loop")


def resolve_experts_backend(device: torch.device, requested: str | None) -> str:
    return resolve_backend(
        "experts_backend",
        requested,
        device,
        cuda_preference=("grouped_mm",),
        cuda_only={"grouped_mm": None},
        choices=EXPERTS_BACKENDS,
    )


def experts_swiglu(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rows: torch.Tensor,
    group_ends: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    """SwiGLU of each expert over its rows: [M, D] -> [M, D]; `group_ends` int32 [E]."""
    if backend == "grouped_mm":
        return _grouped_mm_swiglu(gate_up, down, rows, group_ends)
    return looped_swiglu(gate_up, down, rows, group_ends)


def looped_swiglu(gate_up, down, rows, group_ends) -> torch.Tensor:
    ends = group_ends.tolist()
    outputs = []
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        gate, up = F.linear(rows[start:end], gate_up[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, down[expert]))
    padding = rows.new_zeros(rows.shape[0] - ends[-1], down.shape[1])
    return torch.cat([*outputs, padding])


def _grouped_mm_swiglu(gate_up, down, rows, group_ends) -> torch.Tensor:
    # Grouped GEMMs run in bf16 (as torchtitan's): the autocast dtype when it is on, else the
    # rows' dtype, which under FSDP's mixed precision is already the parameters' bf16.
    device = rows.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
    x = rows.to(dtype)
    gate_up_t = gate_up.to(dtype).transpose(-2, -1)
    gate, up = torch._grouped_mm(x, gate_up_t, offs=group_ends).chunk(2, -1)
    hidden = F.silu(gate) * up
    down_t = down.to(dtype).transpose(-2, -1)  # cast here, not beside gate_up: one at a time
    return torch._grouped_mm(hidden, down_t, offs=group_ends).type_as(rows)
