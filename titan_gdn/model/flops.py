"""Parameter and FLOP counts for MFU, following the work the kernels do on packed documents.

Per trained token, forward + backward (backward does twice the forward's matmul work, so
every forward count is multiplied by 3):
- matmuls: 2 FLOPs per weight that multiplies every token (all parameters but the embedding
  lookup; a tied output head counted once). In MoE layers a token meets only its top-k routed
  experts (and the shared one, and the whole router): the other experts' weights are left out,
  so MFU is over the active parameters. Norm weights, `A_log` and `dt_bias` are counted as
  if they were matmul weights: < 0.01% of the total.
- attention: QK^T and PV over the causal pairs (query, key) of each document, 4 * n_heads *
  head_dim FLOPs per pair and layer. Flex attention skips the blocks the document mask
  removes, so packed short documents cost far less than a T x T square.
- delta rule, per value head, FLA's chunked form with chunk C = 64: the state read, state
  update and output read (3 x 2 * Dk * Dv) and the in-chunk products (K K^T, the WY transforms
  of k and v, Q K^T, the in-chunk output: 2 * C * (3 * Dk + 2 * Dv)). The in-chunk triangular
  solve and the element-wise work are left out.

torchtitan asks for FLOPs per token at a sequence length only (`get_nparams_and_flops`), with
no documents: that count assumes one causal document per row. The metrics processor
(`titan_gdn.metrics`) replaces its attention term at every log with the one of the documents
actually trained on.
"""

from __future__ import annotations

from torch import nn

from titan_gdn.model.layer_types import FULL_ATTENTION, LINEAR_ATTENTION

DELTA_RULE_CHUNK = 64
FORWARD_AND_BACKWARD = 3


def count_params_and_flops(args, model: nn.Module, seq_len: int) -> tuple[int, int]:
    """(parameters, training FLOPs per token) for rows that are one document of `seq_len`."""
    nparams = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    # The embedding lookup is no matmul; the output projection is one, also when it is tied
    # (then its weight is counted once in `nparams`, as the embedding).
    matmul_params = nparams if args.enable_weight_tying else nparams - embedding
    matmul_params -= inactive_expert_params(args)
    per_token = (
        FORWARD_AND_BACKWARD * 2 * matmul_params
        + delta_rule_flops_per_token(args)
        + attention_flops_per_token(args, one_document_pairs_per_token(seq_len))
    )
    return nparams, round(per_token)


def inactive_expert_params(args) -> int:
    """Routed-expert weights one token does not use: num_experts - num_experts_per_tok experts
    (gate, up and down) in every MoE layer."""
    unused = args.num_experts - args.num_experts_per_tok
    return len(args.moe_layers) * unused * 3 * args.moe_hidden_dim * args.dim


def active_params(args, model: nn.Module) -> int:
    """The parameters one token uses: all but the routed experts it is not sent to."""
    return sum(p.numel() for p in model.parameters()) - inactive_expert_params(args)


def one_document_pairs_per_token(seq_len: int) -> float:
    """Causal (query, key) pairs per token of one document of `seq_len` tokens."""
    return (seq_len + 1) / 2


def attention_flops_per_token(args, pairs_per_token: float) -> float:
    """Training FLOPs per token of all attention layers, given the causal pairs per token."""
    layers = args.layer_types.count(FULL_ATTENTION)
    return FORWARD_AND_BACKWARD * 4 * args.n_heads * args.head_dim * pairs_per_token * layers


def delta_rule_flops_per_token(args) -> float:
    """Training FLOPs per token of all Gated DeltaNet layers' chunked delta rule."""
    layers = args.layer_types.count(LINEAR_ATTENTION)
    per_head = delta_rule_forward_per_head(args.linear_key_head_dim, args.linear_value_head_dim)
    return FORWARD_AND_BACKWARD * args.linear_num_value_heads * per_head * layers


def delta_rule_forward_per_head(dk: int, dv: int, chunk: int = DELTA_RULE_CHUNK) -> int:
    """Forward FLOPs per token and value head of the chunked gated delta rule."""
    return 3 * 2 * dk * dv + 2 * chunk * (3 * dk + 2 * dv)
