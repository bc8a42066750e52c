"""Activation checkpointing for the hybrid blocks, configured by torchtitan's
``[activation_checkpoint]`` section:

- ``mode = "full"``: every decoder block keeps only its input and recomputes its forward in
  backward.
- ``mode = "selective"``, ``selective_ac_option = "N"``: every N-th block as in "full", the
  others keep everything.
- ``mode = "selective"``, ``selective_ac_option = "op"``: per op, inside every block: outputs
  of the ops in `OPS_TO_SAVE` are kept, everything else (norms, gates, activations, the short
  conv, the layout changes) is recomputed. The list is torchtitan's (attention kernels, every
  second matmul, reduce-scatter) plus what only this model has: the delta-rule ops, whose
  kernels are the costliest part of a GDN block to recompute; the varlen attention op (the
  CUDA default, whose kernels torchtitan's list cannot see inside it); CPU attention; and the
  all-to-all that moves heads under context parallelism (DTensor's Shard -> Shard
  redistribution), so backward sends nothing twice.

The policy sees dispatcher ops, in eager and compiled code alike: that is why the kernels are
custom ops even in eager mode (`titan_gdn.ops.custom_op`). Saving the FLA delta-rule op keeps
its residuals, which is all its backward reads, so no delta-rule forward kernel runs again.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.config.job_config import ActivationCheckpoint as ACConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list

# Imported for their side effect too: the ops below are registered on import.
from titan_gdn.ops import delta_rule, varlen_attention  # noqa: F401
from titan_gdn.ops.delta_rule import fla_cp_op, state_passing  # noqa: F401
from titan_gdn.placements import collectives  # noqa: F401

OPS_TO_SAVE = _op_sac_save_list | {
    torch.ops.titan_gdn.gated_delta_rule_fla.default,
    torch.ops.titan_gdn.gated_delta_rule_flash_qla.default,
    torch.ops.titan_gdn.gated_delta_rule_torch.default,
    torch.ops.titan_gdn.varlen_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._dtensor.shard_dim_alltoall.default,  # context parallel moves heads
}
# Context parallel over sequence chunks: the delta rule with its carried state, and the
# exchanges (summaries, conv halo, attention's K and V), so backward sends nothing twice.
OPS_TO_SAVE |= {
    torch.ops.titan_gdn.gated_delta_rule_fla_cp.default,
    torch.ops.titan_gdn.affine_gated_delta_rule_torch.default,
    torch.ops.titan_gdn.all_gather.default,
    torch.ops.titan_gdn.from_previous_rank.default,
}


def apply_activation_checkpointing(
    model: nn.Module, ac_config: ACConfig, *, model_compile_enabled: bool, dump_folder: str
) -> None:
    """Wrap each decoder block of `model` as `ac_config` says (mode "none" is not handled here)."""
    apply_ac(
        model,
        ac_config,
        model_compile_enabled=model_compile_enabled,
        op_sac_save_list=OPS_TO_SAVE,
        base_folder=dump_folder,
    )
