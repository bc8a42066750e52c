"""The public API other code relies on: registration, init, masks, forward."""

import types

import torch

import titan_gdn  # noqa: F401  (registers the TrainSpec)
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.model import Qwen35Model, qwen3_5_args


def test_import_registers_the_train_spec():
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("qwen3_5")
    assert spec.model_cls is Qwen35Model
    dense = {"debugmodel", "0.8B", "2B", "4B", "9B", "27B"}
    moe = {"debugmoe", "35B-A3B", "3.6-35B-A3B", "122B-A10B", "397B-A17B", "35B-A3B-4layers"}
    assert set(spec.model_args) == dense | moe | {"from_hf_config"}
    adapter = spec.state_dict_adapter(spec.model_args["debugmodel"], None)
    assert hasattr(adapter, "from_hf") and hasattr(adapter, "to_hf")


def test_init_weights_follows_transformers_distributions():
    torch.manual_seed(0)
    model = Qwen35Model(qwen3_5_args["debugmodel"])
    model.init_weights()
    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            assert (param.exp() >= 0.01).all() and (param.exp() <= 16).all()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif "norm" in name:  # zero-centred RMSNorms: applied as 1 + w
            assert torch.equal(param, torch.zeros_like(param)), name
        else:  # linear, conv and embedding weights: N(0, 0.02)
            assert abs(param.std().item() - 0.02) < 0.002, name
            assert abs(param.mean().item()) < 0.002, name


def test_get_attention_masks_reads_the_tokenizer_eos_and_forward_uses_them():
    torch.manual_seed(0)
    model = Qwen35Model(qwen3_5_args["debugmodel"])
    model.init_weights()
    tokenizer = types.SimpleNamespace(eos_id=7)
    tokens = torch.randint(8, 2048, (2, 64))
    tokens[0, 20] = tokens[1, 5] = tokens[1, 40] = 7
    masks = model.get_attention_masks(tokens, tokenizer, extra_inputs={})
    assert isinstance(masks, DocumentBoundaries)
    assert masks.cu_seqlens.tolist() == [0, 21, 64, 70, 105, 128]
    logits = model(tokens, attention_masks=masks)
    assert logits.shape == (2, 64, 2048) and torch.isfinite(logits).all()
    # Tokens after an EOS start a new document: they differ from the unmasked (one-document) run.
    unmasked = model(tokens)
    assert torch.equal(logits[:, :21][0], unmasked[0, :21])
    assert not torch.allclose(logits[0, 21:], unmasked[0, 21:])


def test_tied_output_survives_meta_init_as_torchtitan_builds_models():
    with torch.device("meta"):
        model = Qwen35Model(qwen3_5_args["debugmodel"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.std() > 0.01
