"""Parameter and FLOP counts for MFU, right for both mixer kinds."""

from __future__ import annotations

from torch import nn

from titan_gdn.model.args import LINEAR_ATTENTION


def count_params_and_flops(args, model: nn.Module, seq_len: int) -> tuple[int, int]:
    """(trainable parameters, training FLOPs per token) at `seq_len` tokens per document.

    Matmuls with weights cost 6 FLOPs per parameter per token (forward + backward). On top:
    attention scores and values, 4 * H * D * seq_len per token forward (the causal half is not
    discounted, as torchtitan counts it), and the chunked delta rule, whose work per token is
    linear in the sequence: per value head about 4 * Dk * Dv (state read/update) plus
    2 * chunk * (Dk + Dv) (intra-chunk attention), forward; backward costs about 2x forward.
    """
    nparams = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    # The embedding lookup is no matmul; the output projection is one, also when it is tied
    # (then its weight is counted once in `nparams`, as the embedding).
    matmul_params = nparams if args.enable_weight_tying else nparams - embedding
    chunk = 64
    per_token = 6 * matmul_params
    for layer_type in args.layer_types:
        if layer_type == LINEAR_ATTENTION:
            dk, dv = args.linear_key_head_dim, args.linear_value_head_dim
            forward = args.linear_num_value_heads * (4 * dk * dv + 2 * chunk * (dk + dv))
        else:
            forward = 4 * args.n_heads * args.head_dim * seq_len
        per_token += 3 * forward
    return nparams, per_token
