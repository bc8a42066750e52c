"""Parity with transformers' Qwen3.5 (its pure-torch path) through the state dict adapter."""

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tests.hf_reference import random_hf_model, tiny_hf_config
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, Qwen35StateDictAdapter


def _ours_from_hf(hf_model, config: dict) -> Qwen35Model:
    args = Qwen35ModelArgs.from_hf_config(config)
    model = Qwen35Model(args)
    adapter = Qwen35StateDictAdapter(args, None)
    model.load_state_dict(adapter.from_hf(hf_model.state_dict()), strict=True)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_loss_and_gradients_match_transformers(hf_qwen3_5, tied):
    config = tiny_hf_config(tied)
    hf_model = random_hf_model(hf_qwen3_5, config, seed=11 + tied)
    ours = _ours_from_hf(hf_model, config)
    generator = torch.Generator().manual_seed(5 + tied)
    tokens = torch.randint(0, config["vocab_size"], (2, 150), generator=generator)
    labels = torch.randint(0, config["vocab_size"], (2, 150), generator=generator)

    hf_logits = hf_model(input_ids=tokens).logits
    our_logits = ours(tokens)
    assert relative_error(our_logits, hf_logits) <= 1e-5

    hf_loss = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten())
    our_loss = F.cross_entropy(our_logits.flatten(0, 1), labels.flatten())
    assert abs(our_loss.item() - hf_loss.item()) <= 1e-4 * hf_loss.item()
    hf_loss.backward()
    our_loss.backward()

    adapter = Qwen35StateDictAdapter(ours.model_args, None)
    hf_grads = adapter.from_hf({k: p.grad for k, p in hf_model.named_parameters()})
    our_grads = {k: p.grad for k, p in ours.named_parameters(remove_duplicate=False)}
    assert set(hf_grads) == set(our_grads)
    for name, grad in our_grads.items():
        assert relative_error(grad, hf_grads[name]) <= 1e-4, name


@pytest.mark.parametrize("tied", [False, True])
def test_adapter_round_trip_is_exact(hf_qwen3_5, tied):
    config = tiny_hf_config(tied)
    hf_sd = random_hf_model(hf_qwen3_5, config, seed=3).state_dict()
    if tied:  # tied checkpoints carry no lm_head
        hf_sd.pop("lm_head.weight", None)
    adapter = Qwen35StateDictAdapter(Qwen35ModelArgs.from_hf_config(config), None)
    back = adapter.to_hf(adapter.from_hf(hf_sd))
    assert set(back) == set(hf_sd)
    for key, value in hf_sd.items():
        assert torch.equal(back[key], value), key


def test_adapter_reads_the_multimodal_layout(hf_qwen3_5):
    config = tiny_hf_config(False)
    hf_sd = random_hf_model(hf_qwen3_5, config, seed=4).state_dict()
    multimodal = {k.replace("model.", "model.language_model.", 1): v for k, v in hf_sd.items()}
    multimodal["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3)
    multimodal["mtp.fc.weight"] = torch.zeros(3)
    adapter = Qwen35StateDictAdapter(Qwen35ModelArgs.from_hf_config(config), None)
    text_only = adapter.from_hf(hf_sd)
    from_multimodal = adapter.from_hf(multimodal)
    assert set(from_multimodal) == set(text_only)
    assert all(torch.equal(from_multimodal[k], text_only[k]) for k in text_only)
