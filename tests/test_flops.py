"""The FLOP count behind MFU: attention follows the documents actually trained on."""

import torch

from titan_gdn.data.loader import causal_pairs
from titan_gdn.metrics import DocumentTally, Qwen35MetricsProcessor
from titan_gdn.model import Qwen35Model, qwen3_5_args
from titan_gdn.model.flops import (
    attention_flops_per_token,
    count_params_and_flops,
    delta_rule_flops_per_token,
)

EOS = 0


def _document_causal_mask_pairs(tokens: torch.Tensor) -> int:
    """Allowed (query, key) pairs of the document-causal mask, built independently."""
    total = 0
    for row in tokens:
        ends = (row == EOS).nonzero().flatten() + 1
        lengths = torch.diff(torch.cat([torch.tensor([0]), ends, torch.tensor([len(row)])]))
        document = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        same = document[:, None] == document[None, :]
        total += int((same & torch.ones_like(same).tril()).sum())
    return total


def test_causal_pairs_count_the_document_causal_mask():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    tokens = torch.randint(1, 50, (3, 257), generator=gen)
    tokens[torch.rand(tokens.shape, generator=gen) < 0.05] = EOS
    tokens[1, -1] = EOS  # a row ending on EOS
    tokens[2, 0] = EOS  # a one-token document
    assert causal_pairs(tokens, EOS) == _document_causal_mask_pairs(tokens)


def test_mfu_uses_the_attention_of_the_trained_documents():
    args = qwen3_5_args["debugmodel"]
    with torch.device("meta"):
        model = Qwen35Model(args)
    seq_len = 512
    _, trainer_count = count_params_and_flops(args, model, seq_len)
    processor = Qwen35MetricsProcessor.__new__(Qwen35MetricsProcessor)
    processor.model_args, processor.seq_len = args, seq_len
    processor.num_flops_per_token = trainer_count

    whole_rows = DocumentTally()
    whole_rows.add(2, tokens=2 * seq_len, causal_pairs=2 * seq_len * (seq_len + 1) // 2)
    assert processor._documents_flops_per_token(whole_rows) == trainer_count

    lengths = [1, 100, 411]  # one row of three documents
    packed = DocumentTally()
    packed.add(3, tokens=seq_len, causal_pairs=sum(n * (n + 1) // 2 for n in lengths))
    saved = attention_flops_per_token(args, (seq_len + 1) / 2) - attention_flops_per_token(
        args, packed.causal_pairs / seq_len
    )
    assert saved > 0
    assert processor._documents_flops_per_token(packed) == trainer_count - saved


# Published totals and activated parameters of the Qwen3.5 MoE model cards. The totals include
# the vision encoder, which the text model lacks (under 1%); the activated figures are rounded
# to the billion, so the count must round to them.
PUBLISHED_MOE = {"35B-A3B": (35e9, 3e9), "122B-A10B": (122e9, 10e9), "397B-A17B": (397e9, 17e9)}


def test_moe_flavors_have_the_published_total_and_active_parameters():
    from titan_gdn.model.flops import active_params

    for flavor, (total, active) in PUBLISHED_MOE.items():
        args = qwen3_5_args[flavor]
        with torch.device("meta"):
            model = Qwen35Model(args)
        ours = sum(p.numel() for p in model.parameters())
        assert abs(ours - total) <= 0.01 * total, (flavor, ours)
        assert round(active_params(args, model) / 1e9) == active / 1e9, flavor


def test_mfu_of_an_moe_model_counts_the_active_experts_only():
    """The matmul term is 6 FLOPs per active weight: counted independently from the experts a
    token runs (top-k of E) on a model with dense and MoE layers."""
    import copy

    args = copy.deepcopy(qwen3_5_args["debugmoe"])
    args.mlp_only_layers = [0]
    with torch.device("meta"):
        model = Qwen35Model(args)
    per_expert = sum(p[0].numel() for p in model.layers["1"].mlp.experts.parameters())
    unused = (args.num_experts - args.num_experts_per_tok) * per_expert * 3  # layers 1-3
    total = sum(p.numel() for p in model.parameters())
    assert args.enable_weight_tying  # the head's weight, counted once in total, is a matmul
    matmul = total - unused
    nparams, flops = count_params_and_flops(args, model, 256)
    mixing = delta_rule_flops_per_token(args) + attention_flops_per_token(args, (256 + 1) / 2)
    assert nparams == total
    assert flops == round(6 * matmul + mixing)
