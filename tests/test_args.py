"""Flavors, HF config import, and parameter counts of the published sizes."""

import pytest
import torch

from tests.hf_reference import tiny_hf_config
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, qwen3_5_args
from titan_gdn.model.args import FULL_ATTENTION, LINEAR_ATTENTION

# Text-model parameters of the published configs (tied embeddings counted once). The 9B and
# 27B names are the language model's size; the small checkpoints' names round the model with
# its vision encoder, so for those the transformers count is the reference that must match.
NOMINAL = {"9B": 9e9, "27B": 27e9}


def _count_on_meta(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", ["0.8B", "2B", "4B", "9B", "27B"])
def test_parameter_count_matches_transformers(hf_qwen3_5, flavor):
    from transformers import Qwen3_5TextConfig

    args = qwen3_5_args[flavor]
    hf_config = Qwen3_5TextConfig(**args.to_hf_config())
    ours = _count_on_meta(Qwen35Model, args)
    theirs = _count_on_meta(hf_qwen3_5.Qwen3_5ForCausalLM, hf_config)
    assert ours == theirs
    if flavor in NOMINAL:
        assert abs(ours - NOMINAL[flavor]) <= 0.01 * NOMINAL[flavor]


def test_flavors_follow_the_published_shapes():
    expected = {  # hidden, layers, heads, kv heads, ffn, value heads, tied
        "0.8B": (1024, 24, 8, 2, 3584, 16, True),
        "2B": (2048, 24, 8, 2, 6144, 16, True),
        "4B": (2560, 32, 16, 4, 9216, 32, True),
        "9B": (4096, 32, 16, 4, 12288, 32, False),
        "27B": (5120, 64, 24, 4, 17408, 48, False),
    }
    for flavor, shape in expected.items():
        a = qwen3_5_args[flavor]
        got = (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.hidden_dim)
        assert got + (a.linear_num_value_heads, a.enable_weight_tying) == shape
        assert (a.vocab_size, a.head_dim, a.rotary_dim, a.rope_theta) == (248320, 256, 64, 1e7)
        assert (a.linear_num_key_heads, a.linear_key_head_dim, a.linear_value_head_dim) == (
            16,
            128,
            128,
        )
        assert a.linear_conv_kernel_dim == 4 and a.norm_eps == 1e-6
        assert a.layer_types[3::4] == [FULL_ATTENTION] * (a.n_layers // 4)
        assert a.layer_types.count(LINEAR_ATTENTION) == 3 * a.n_layers // 4
    debug = qwen3_5_args["debugmodel"]
    assert debug.vocab_size == 2048 and set(debug.layer_types) == {FULL_ATTENTION, LINEAR_ATTENTION}


def test_from_hf_config_text_multimodal_and_layer_types():
    text = tiny_hf_config(tied=True)
    args = Qwen35ModelArgs.from_hf_config(text)
    assert (args.dim, args.n_layers, args.linear_value_head_dim) == (64, 4, 8)
    assert args.enable_weight_tying and args.rotary_dim == 8
    assert args.layer_types == [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION]

    layer_types = [FULL_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION]
    multimodal = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": tiny_hf_config(tied=False, layer_types=layer_types),
        "vision_config": {"depth": 2},
    }
    args = Qwen35ModelArgs.from_hf_config(multimodal)
    assert args.layer_types == layer_types and not args.enable_weight_tying


def test_bad_args_name_the_setting():
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        Qwen35ModelArgs(linear_num_key_heads=16, linear_num_value_heads=24)
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35ModelArgs(n_layers=4, layer_types=["linear_attention"] * 3)
    with pytest.raises(ValueError, match="layer_types"):
        Qwen35ModelArgs(n_layers=1, layer_types=["mamba"])
