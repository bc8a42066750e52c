"""transformers' `config.json` of Qwen3.5 (`qwen3_5_text`), Qwen3.5 MoE (`qwen3_5_moe_text`) and
Qwen3-Next (`qwen3_next`) against `Qwen35ModelArgs`: which model-args field each of its fields
is, both ways, and the one reader of a checkpoint folder's `config.json`."""

from __future__ import annotations

import json
import os
from typing import Any

CONFIG_JSON = "config.json"
HF_INDEX = "model.safetensors.index.json"

DENSE, MOE, NEXT = "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"
# A model type (the multimodal wrappers' too) -> the text model family it holds.
_HF_MODEL_TYPES = {
    "qwen3_5_text": DENSE,
    "qwen3_5": DENSE,
    "qwen3_5_moe_text": MOE,
    "qwen3_5_moe": MOE,
    "qwen3_next": NEXT,
}
_HF_ARCHITECTURES = {
    DENSE: "Qwen3_5ForCausalLM",
    MOE: "Qwen3_5MoeForCausalLM",
    NEXT: "Qwen3NextForCausalLM",
}

# Our field -> transformers' Qwen3.5 config field, both ways.
_HF_REQUIRED = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "vocab_size": "vocab_size",
    "hidden_dim": "intermediate_size",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "linear_num_key_heads": "linear_num_key_heads",
    "linear_num_value_heads": "linear_num_value_heads",
    "linear_key_head_dim": "linear_key_head_dim",
    "linear_value_head_dim": "linear_value_head_dim",
}
_HF_OPTIONAL = {
    "norm_eps": "rms_norm_eps",
    "head_dim": "head_dim",
    "linear_conv_kernel_dim": "linear_conv_kernel_dim",
    "full_attention_interval": "full_attention_interval",
    "max_seq_len": "max_position_embeddings",
    "initializer_range": "initializer_range",
}
_HF_MOE_REQUIRED = {
    **{ours: theirs for ours, theirs in _HF_REQUIRED.items() if ours != "hidden_dim"},
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_hidden_dim": "moe_intermediate_size",
    "shared_expert_hidden_dim": "shared_expert_intermediate_size",
}
_HF_MOE_OPTIONAL = {**_HF_OPTIONAL, "router_aux_loss_coef": "router_aux_loss_coef"}
# Qwen3-Next adds dense layers (intermediate_size) and where they are.
_HF_NEXT_OPTIONAL = {
    **_HF_MOE_OPTIONAL,
    "hidden_dim": "intermediate_size",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
    "norm_topk_prob": "norm_topk_prob",
}
# Each family's (required, optional) fields: our field -> transformers' field, both ways.
_HF_FIELDS = {
    DENSE: (_HF_REQUIRED, _HF_OPTIONAL),
    MOE: (_HF_MOE_REQUIRED, _HF_MOE_OPTIONAL),
    NEXT: (_HF_MOE_REQUIRED, _HF_NEXT_OPTIONAL),
}


def read_config_json(folder: str | os.PathLike | None) -> dict[str, Any] | None:
    """`<folder>/config.json` as a dict; None when `folder` is unset or has no config.json."""
    path = os.path.join(folder or "", CONFIG_JSON)
    if not folder or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def args_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The model-args fields of a `config.json` dict: text, or multimodal with a nested
    `text_config`; a dict without `model_type` is read as dense Qwen3.5. A missing required
    field raises KeyError naming it; another model type, ValueError naming it."""
    text = config.get("text_config", config)
    model_type = _model_family(text.get("model_type") or config.get("model_type"))
    required, optional = _HF_FIELDS[model_type]
    _check_unscaled_rope(text, "text_config." if "text_config" in config else "")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    args = {ours: text[theirs] for ours, theirs in required.items()}
    args.update({ours: text[theirs] for ours, theirs in optional.items() if theirs in text})
    for name in ("rope_theta", "partial_rotary_factor"):
        if name in rope or name in text:
            args[name] = rope.get(name, text.get(name))
    # A multimodal model ties by its top-level setting, whatever its text_config says, as
    # transformers' ForConditionalGeneration does.
    args["enable_weight_tying"] = config.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", False)
    )
    if text.get("layer_types"):
        args["layer_types"] = list(text["layer_types"])
    # transformers' defaults for what an MoE config.json may leave out.
    if model_type != DENSE:
        args.setdefault("router_aux_loss_coef", 0.001)
    return {**args, "hf_model_type": model_type}


def config_fields(args) -> dict[str, Any]:
    """The transformers config fields of model args `args`, for their `hf_model_type`."""
    required, optional = _HF_FIELDS[args.hf_model_type]
    return dict(
        model_type=args.hf_model_type,
        architectures=[_HF_ARCHITECTURES[args.hf_model_type]],
        **{theirs: getattr(args, ours) for ours, theirs in {**required, **optional}.items()},
        tie_word_embeddings=args.enable_weight_tying,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=args.rope_theta,
            partial_rotary_factor=args.partial_rotary_factor,
        ),
        layer_types=list(args.layer_types),
        hidden_act="silu",
        attention_bias=False,
    )


# transformers' rope types that rotate by the plain RoPE frequencies: "default" (Qwen3.5's
# multimodal text_config adds mrope_section / mrope_interleaved to it, for image positions;
# text positions rotate as plain RoPE).
_UNSCALED_ROPE = ("default",)


def _check_unscaled_rope(text: dict[str, Any], prefix: str) -> None:
    """The model rotates by unscaled RoPE (rope_theta, partial_rotary_factor) only: a scaled
    rope type (YaRN, linear, dynamic, ...) would be read, trained without its scaling and left
    out of the export. `rope_scaling` is the field's name before transformers 5; `type` the
    key's, as transformers still reads them."""
    for field in ("rope_parameters", "rope_scaling"):
        rope = text.get(field)
        if not isinstance(rope, dict):
            continue
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in _UNSCALED_ROPE:
            raise ValueError(
                f"config.json {prefix}{field}.rope_type = {rope_type!r}: titan_gdn supports only "
                'unscaled RoPE (rope_type "default"), and would train and export this model '
                'without its scaling; use a config.json with rope_type "default" (the model\'s '
                "pre-training RoPE)"
            )


def _model_family(model_type: str | None) -> str:
    if model_type is None:
        return DENSE
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; titan_gdn reads "
            f"{', '.join(_HF_MODEL_TYPES)}"
        )
    return _HF_MODEL_TYPES[model_type]
