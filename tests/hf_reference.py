"""Tiny random transformers Qwen3.5 models, the independent reference for parity tests."""

from __future__ import annotations

import math

import torch

from tests.conftest import perturb_norms_and_gates
from titan_gdn.tiny_hf_checkpoint import TINY_SHAPE


def hf_import_arguments(folder) -> tuple[str, ...]:
    """The trainer's arguments that build the model from an HF folder's config.json and start
    from its weights."""
    return (
        "--model.flavor", "from_hf_config",
        "--model.hf_assets_path", str(folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", str(folder),
    )  # fmt: skip


def tiny_hf_config(tied: bool, **overrides) -> dict:
    """The tiny checkpoint's shape (`titan_gdn.tiny_hf_checkpoint`), with a small vocabulary."""
    config = dict(TINY_SHAPE, vocab_size=211, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    config.update(overrides)
    return config


def random_hf_model(modeling, config: dict, seed: int):
    """A transformers Qwen3_5ForCausalLM in fp32 with every parameter randomised.

    Norm weights start at 0 or 1 and A_log/dt_bias at fixed values; perturbing all of them makes
    a wrong (1 + w) convention or a swapped per-head parameter visible in the logits.
    """
    from transformers import Qwen3_5TextConfig

    torch.manual_seed(seed)
    hf_config = Qwen3_5TextConfig(**config)
    hf_config._attn_implementation = "eager"
    model = modeling.Qwen3_5ForCausalLM(hf_config).float()
    perturb_norms_and_gates(model)
    _moderate_decays(model)
    return model


def _moderate_decays(model) -> None:
    """A in [0.01, 2]: with A near 16, transformers' fp32 in-chunk cumsum of the decay reaches
    ~1e3 and its own dA_log is off by ~2e-4. That regime is tested against an fp64 recurrence
    in test_delta_rule.py, not against transformers."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "A_log" in name:
                param.uniform_(math.log(0.01), math.log(2.0))


def tiny_moe_hf_config(family: str, **overrides) -> dict:
    """A tiny Qwen3.5 MoE (`qwen3_5_moe`) or Qwen3-Next (`qwen3_next`) text config. Qwen3-Next's
    keeps dense layers (layer 0 by decoder_sparse_step, layer 3 in mlp_only_layers) and drops
    the top-k renormalisation, so that each of its switches is exercised."""
    config = tiny_hf_config(tied=False)
    del config["intermediate_size"]
    config.update(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        router_aux_loss_coef=0.05,
    )
    if family == "qwen3_next":
        config.update(
            intermediate_size=56, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False
        )
    config.update(overrides)
    return config


def random_hf_moe_model(modeling, family: str, config: dict, seed: int):
    """transformers' Qwen3_5MoeForCausalLM or Qwen3NextForCausalLM in fp32, every parameter
    randomised (as `random_hf_model`), its experts on transformers' own loop."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    torch.manual_seed(seed)
    config_cls, model_cls = {
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM"),
        "qwen3_next": (Qwen3NextConfig, "Qwen3NextForCausalLM"),
    }[family]
    hf_config = config_cls(**config)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"
    model = getattr(modeling, model_cls)(hf_config).float()
    perturb_norms_and_gates(model)
    _moderate_decays(model)
    return model
