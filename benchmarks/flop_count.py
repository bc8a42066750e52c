"""FLOPs per trained token: the count the trainer logs MFU with, and one that follows the work
the kernels do on packed documents.

`titan_gdn/model/flops.py` (`get_nparams_and_flops`, what torchtitan's MFU uses) counts
- 6 FLOPs per parameter per token: every parameter as a matmul weight, the tied embedding once
  (as the output projection), norms, `A_log`, `dt_bias` and conv filters included. Right for
  the projections, the MLP, the output head and the conv (norms and the rest are < 0.01%).
- attention: 3 x 4 * n_heads * head_dim * seq_len per token and layer, the full square with
  no causal half and no document mask. With the bundled corpus packed (~110 tokens per
  document) flex attention does ~1/600 of that at 32k; for 0.8B the term equals all matmuls
  together at 32k (4.8 GFLOP/token) and twice them at 64k, so the trainer's MFU there is
  mostly work that is never done. For one document per row it is 2x the causal work.
- delta rule: 3 x n_value_heads * (4 * Dk * Dv + 2 * 64 * (Dk + Dv)) per token and layer,
  0.55x of FLA's chunked algorithm below (0.085 vs 0.156 GFLOP/token for 0.8B and 2B).

`documents_flops_per_token` counts, per token (forward x 3 for forward + backward):
- matmuls: 2 FLOPs per weight of every linear layer (output projection included, the embedding
  lookup not) and per conv filter tap;
- attention: QK^T and PV over the causal pairs of each document, 4 * n_heads * head_dim per
  pair, summed over the documents of the batch;
- delta rule, per value head, FLA's chunked form with chunk C = 64: the state read, the state
  update and the output read (3 x 2 * Dk * Dv) and the in-chunk products K K^T, the WY
  transforms of k and v, Q K^T and the in-chunk output (2 * C * (3 * Dk + 2 * Dv)). The
  in-chunk triangular solve (~C^2 / 3 per token) and all element-wise work are left out.
"""

from __future__ import annotations

from torch import nn

from titan_gdn.model.args import FULL_ATTENTION, LINEAR_ATTENTION

DELTA_RULE_CHUNK = 64
FORWARD_AND_BACKWARD = 3  # backward is twice the forward's matmul work


def trainer_flops_per_token(model_args, model: nn.Module, seq_len: int) -> int:
    """What `get_nparams_and_flops` reports, i.e. what the trainer's MFU uses."""
    return model_args.get_nparams_and_flops(model, seq_len)[1]


def documents_flops_per_token(model_args, model: nn.Module, document_lengths: list[int]) -> dict:
    """FLOPs per token of a batch whose documents have `document_lengths`, by term."""
    tokens = sum(document_lengths)
    causal_pairs = sum(n * (n + 1) // 2 for n in document_lengths)
    layer_types = model_args.layer_types
    attention_layers = layer_types.count(FULL_ATTENTION)
    delta_rule_layers = layer_types.count(LINEAR_ATTENTION)
    attention = (
        4 * model_args.n_heads * model_args.head_dim * causal_pairs / tokens * attention_layers
    )
    delta_rule = (
        delta_rule_layers
        * model_args.linear_num_value_heads
        * delta_rule_per_head(model_args.linear_key_head_dim, model_args.linear_value_head_dim)
    )
    terms = {
        "matmul": 2 * matmul_weights(model),
        "attention": attention,
        "delta_rule": delta_rule,
    }
    terms = {name: FORWARD_AND_BACKWARD * value for name, value in terms.items()}
    terms["total"] = sum(terms.values())
    return {name: round(value) for name, value in terms.items()}


def delta_rule_per_head(dk: int, dv: int, chunk: int = DELTA_RULE_CHUNK) -> int:
    """Forward FLOPs per token and value head of the chunked gated delta rule."""
    state = 3 * 2 * dk * dv
    in_chunk = 2 * chunk * (3 * dk + 2 * dv)
    return state + in_chunk


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
