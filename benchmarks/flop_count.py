"""FLOPs per trained token: the count the trainer logs MFU with, and the one of the documents a
batch actually holds. Both come from `titan_gdn/model/flops.py` (see its docstring for what is
counted); the trainer's assumes one document per row, as torchtitan's interface has no
documents, and its metrics processor corrects the attention term at every log.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_gdn.model.args import LINEAR_ATTENTION
from titan_gdn.model.flops import (
    FORWARD_AND_BACKWARD,
    attention_flops_per_token,
    delta_rule_flops_per_token,
)
from titan_gdn.model.model import DecoderBlock


def trainer_flops_per_token(model_args, model: nn.Module, seq_len: int) -> int:
    """What `get_nparams_and_flops` reports, i.e. what the trainer's MFU uses."""
    return model_args.get_nparams_and_flops(model, seq_len)[1]


def documents_flops_per_token(model_args, model: nn.Module, document_lengths: list[int]) -> dict:
    """FLOPs per token of a batch whose documents have `document_lengths`, by term."""
    tokens = sum(document_lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in document_lengths)
    terms = {
        "matmul": FORWARD_AND_BACKWARD * 2 * matmul_weights(model),
        "attention": attention_flops_per_token(model_args, causal_pairs / tokens),
        "delta_rule": delta_rule_flops_per_token(model_args),
    }
    terms["total"] = sum(terms.values())
    return {name: round(value) for name, value in terms.items()}


def matmul_weights(model: nn.Module) -> int:
    """Weights that multiply every token: linear layers (a tied output head counted once, as
    the head) and the GDN conv filters. DTensor parameters count their global size."""
    seen, total = set(), 0
    for module in model.modules():
        weights = []
        if isinstance(module, nn.Linear):
            weights.append(module.weight)
        conv = getattr(module, "conv_weight", None)
        if isinstance(conv, nn.Parameter):
            weights.append(conv)
        for weight in weights:
            if id(weight) not in seen:
                seen.add(id(weight))
                total += weight.numel()
    return total


def gdn_block_linear_weights(model_args) -> tuple[int, int]:
    """Linear weights of a GDN decoder block: its GDN layer's projections, its MLP's."""
    with torch.device("meta"):
        block = DecoderBlock(model_args, LINEAR_ATTENTION)
    return _linear_weights(block.linear_attn), _linear_weights(block.mlp)


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def mfu(flops_per_token: float, tokens_per_s_per_gpu: float, peak_flops: float | None):
    if not peak_flops or not tokens_per_s_per_gpu:
        return None
    return round(flops_per_token * tokens_per_s_per_gpu / peak_flops, 4)


def peak_flops(device_name: str, cuda: bool) -> float | None:
    """bf16 dense peak per GPU (torchtitan's table); None on CPU, where MFU means nothing."""
    if not cuda:
        return None
    from torchtitan.tools.utils import get_peak_flops

    return float(get_peak_flops(device_name))
