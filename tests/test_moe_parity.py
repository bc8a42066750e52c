"""Qwen3.5 MoE and Qwen3-Next against transformers (pure-torch path) through the public API:
`from_hf_config`, the state dict adapter, the model and the training loss with its
load-balancing term over real tokens only."""

import pytest
import torch
import torch.nn.functional as F
from torchtitan.components.loss import IGNORE_INDEX

from benchmarks.references import transformers_qwen3_5_module
from tests.conftest import relative_error
from tests.hf_reference import random_hf_moe_model, tiny_moe_hf_config
from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.loss import RoutedOutput, qwen3_5_loss
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs
from titan_gdn.model import Qwen35StateDictAdapter as Adapter

FAMILIES = ["qwen3_5_moe", "qwen3_next"]
LENGTH, PADDED = 120, 37  # the second row's last 37 tokens are padding


@pytest.fixture(scope="module")
def hf_modules():
    return {family: transformers_qwen3_5_module(True, family) for family in FAMILIES}


def _pair(hf_modules, family, seed, **overrides):
    config = tiny_moe_hf_config(family, **overrides)
    hf_model = random_hf_moe_model(hf_modules[family], family, config, seed)
    hf_dict = hf_model.config.to_dict()
    args = Qwen35ModelArgs.from_hf_config(hf_dict)
    ours = Qwen35Model(args)
    ours.load_state_dict(Adapter(args, None).from_hf(hf_model.state_dict()), strict=True)
    return hf_model, ours


def _batch(vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, LENGTH), generator=generator)
    labels = torch.randint(0, vocab, (2, LENGTH), generator=generator)
    real = torch.ones(2, LENGTH, dtype=torch.bool)
    real[1, -PADDED:] = False
    return tokens, labels, real


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(hf_modules, family):
    hf_model, ours = _pair(hf_modules, family, seed=7)
    assert ours.model_args.hf_model_type == hf_model.config.model_type
    assert len(ours.model_args.moe_layers) == (4 if family == "qwen3_5_moe" else 1)
    tokens, labels, real = _batch(hf_model.config.vocab_size, seed=8)

    # transformers: right padding through attention_mask, which its aux loss also reads.
    hf_out = hf_model(input_ids=tokens, attention_mask=real.long(), output_router_logits=True)
    ours_out = ours(tokens, chunked_loss=True)
    assert isinstance(ours_out, RoutedOutput)
    assert relative_error(ours_out.output[real], hf_out.logits[real]) <= 1e-5

    hf_labels = labels.masked_fill(~real, IGNORE_INDEX)
    coef = hf_model.config.router_aux_loss_coef
    hf_ce = F.cross_entropy(hf_out.logits.flatten(0, 1), hf_labels.flatten())
    hf_loss = hf_ce + coef * hf_out.aux_loss
    our_loss = qwen3_5_loss(ours_out, hf_labels) / real.sum()
    # The aux term is not negligible here (coef 0.05), so a wrong one shows in the total.
    assert coef * hf_out.aux_loss > 1e-3 * hf_loss
    assert abs(our_loss.item() - hf_loss.item()) <= 1e-4 * hf_loss.item()
    hf_loss.backward()
    our_loss.backward()

    adapter = Adapter(ours.model_args, None)
    hf_grads = adapter.from_hf({k: p.grad for k, p in hf_model.named_parameters()})
    our_grads = {k: p.grad for k, p in ours.named_parameters()}
    assert set(hf_grads) == set(our_grads)
    for name, grad in our_grads.items():
        assert relative_error(grad, hf_grads[name]) <= 1e-4, name


@pytest.mark.parametrize("family", FAMILIES)
def test_router_gradient_follows_the_aux_loss(hf_modules, family):
    """The load-balancing loss alone moves the routers: without it, a gradient test could pass
    with the aux term detached."""
    hf_model, ours = _pair(hf_modules, family, seed=9)
    tokens, labels, real = _batch(hf_model.config.vocab_size, seed=10)
    out = ours(tokens, chunked_loss=True)
    labels = labels.masked_fill(~real, IGNORE_INDEX)
    no_aux = RoutedOutput(out.output, out.router_probs, out.router_experts, 0.0)
    (qwen3_5_loss(out, labels) - qwen3_5_loss(no_aux, labels)).backward()
    router = next(p for n, p in ours.named_parameters() if n.endswith("mlp.gate.weight"))
    assert router.grad is not None and router.grad.abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_round_trip_is_exact(hf_modules, family, tmp_path):
    """transformers' fused experts in memory and its per-expert save_pretrained files both
    import; the export is the fused layout for Qwen3.5 MoE and transformers' files for
    Qwen3-Next, or, given a checkpoint folder, that checkpoint's layout."""
    from safetensors.torch import load_file

    hf_model, ours = _pair(hf_modules, family, seed=3)
    hf_sd = hf_model.state_dict()
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    saved = load_file(tmp_path / "model.safetensors")
    adapter = Adapter(ours.model_args, None)
    ours_sd, from_saved = adapter.from_hf(hf_sd), adapter.from_hf(saved)
    assert set(from_saved) == set(ours_sd)
    assert all(torch.equal(from_saved[key], value) for key, value in ours_sd.items())
    following = Adapter(ours.model_args, str(tmp_path))
    for back, expected in (
        (adapter.to_hf(ours_sd), saved if family == "qwen3_next" else hf_sd),
        (following.to_hf(ours_sd), saved),
    ):
        assert set(back) == set(expected)
        for key, value in expected.items():
            assert torch.equal(back[key], value), key


def test_qwen3_next_projections_keep_each_head_group(hf_modules):
    """The fused projections split per key-head group: a permutation of rows within the fused
    weight must land in a different head, so that a wrong split cannot pass the round trip."""
    hf_model, ours = _pair(hf_modules, "qwen3_next", seed=4)
    prefix = "model.layers.0.linear_attn."
    hf_sd = hf_model.state_dict()
    fused = {k: hf_sd[prefix + k + ".weight"] for k in ("in_proj_qkvz", "in_proj_ba")}
    layer_0 = {k: w for k, w in hf_sd.items() if k.startswith(prefix)}
    ours_sd = Adapter(ours.model_args, None).from_hf(layer_0)
    args = ours.model_args
    dk, groups = args.linear_key_head_dim, args.linear_num_key_heads
    # Ours is group-major too (in_proj_qkvba: per group q, k, v, b, a): group 1's q rows.
    ours_per_group = ours.layers["0"].linear_attn.group_channels
    q_of_group_1 = ours_sd["layers.0.linear_attn.in_proj_qkvba.weight"][sum(ours_per_group) :][:dk]
    per_group = fused["in_proj_qkvz"].shape[0] // groups
    assert torch.equal(q_of_group_1, fused["in_proj_qkvz"][per_group : per_group + dk])


def test_multimodal_config_and_keys(hf_modules):
    config = tiny_moe_hf_config("qwen3_5_moe")
    hf_model = random_hf_moe_model(hf_modules["qwen3_5_moe"], "qwen3_5_moe", config, seed=5)
    text = hf_model.config.to_dict()
    wrapper = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}}
    args = Qwen35ModelArgs.from_hf_config(wrapper)
    assert args == Qwen35ModelArgs.from_hf_config(text)
    sd = hf_model.state_dict()
    multimodal = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}
    adapter = Adapter(args, None)
    text_only, from_multimodal = adapter.from_hf(sd), adapter.from_hf(multimodal)
    assert set(from_multimodal) == set(text_only)
    assert all(torch.equal(from_multimodal[k], text_only[k]) for k in text_only)


def test_config_of_another_model_type_names_it_and_the_supported_ones():
    config = tiny_moe_hf_config("qwen3_5_moe", model_type="qwen3_moe")
    with pytest.raises(ValueError, match="'qwen3_moe' is not supported.*qwen3_5_moe.*qwen3_next"):
        Qwen35ModelArgs.from_hf_config(config)


def test_hf_config_export_reads_back(hf_modules):
    for family in FAMILIES:
        hf_model, ours = _pair(hf_modules, family, seed=6)
        exported = ours.model_args.to_hf_config()
        assert Qwen35ModelArgs.from_hf_config(exported) == ours.model_args
        if family == "qwen3_next":
            from transformers import Qwen3NextConfig

            again = Qwen3NextConfig(**exported)
            assert again.mlp_only_layers == [3] and again.decoder_sparse_step == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_each_packed_document_gets_its_logits_alone(hf_modules, family):
    _, ours = _pair(hf_modules, family, seed=11)
    eos = 0
    generator = torch.Generator().manual_seed(12)
    docs = []
    for length in (1, 37, 90, 64, 23):
        body = torch.randint(1, ours.model_args.vocab_size, (length - 1,), generator=generator)
        docs.append(torch.cat([body, torch.tensor([eos])]))
    tokens = torch.cat(docs)[None]
    with torch.no_grad():
        packed = ours(tokens, attention_masks=DocumentBoundaries.from_tokens(tokens, eos))[0]
        start = 0
        for doc in docs:
            alone = ours(doc[None])[0]
            assert relative_error(packed[start : start + len(doc)], alone) <= 1e-5, start
            start += len(doc)
