"""Map transformers Qwen3.5 checkpoints to this model's state dict and back."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_gdn.model.args import Qwen35ModelArgs

TEXT_PREFIX = "model."
MULTIMODAL_PREFIX = "model.language_model."
# Parts of a multimodal checkpoint that the text model does not have.
_NOT_TEXT = re.compile(r"^(model\.visual\.|visual\.|mtp\.)")

# Files of an HF checkpoint folder, besides weights and config, that users of an export need.
_HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

_TOP_LEVEL = {"embed_tokens.weight": "tok_embeddings.weight", "norm.weight": "norm.weight"}
_TOP_LEVEL_HF = {ours: hf for hf, ours in _TOP_LEVEL.items()}
_CONV_HF, _CONV_OURS = ".linear_attn.conv1d.weight", ".linear_attn.conv_weight"


class Qwen35StateDictAdapter(StateDictAdapter):
    """`from_hf` takes text (`model.*`) or multimodal (`model.language_model.*`) checkpoints;
    `to_hf` writes the layout of the checkpoint in `hf_assets_path` (text when there is none)."""

    def __init__(self, model_args: Qwen35ModelArgs, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.model_args = model_args
        self.prefix = _checkpoint_prefix(hf_assets_path)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf = {}
        for key, value in state_dict.items():
            if key == "output.weight":
                if not self.model_args.enable_weight_tying:
                    hf["lm_head.weight"] = value
            elif key in _TOP_LEVEL_HF:
                hf[self.prefix + _TOP_LEVEL_HF[key]] = value
            elif key.endswith(_CONV_OURS):
                hf[self.prefix + key.replace(_CONV_OURS, _CONV_HF)] = value.unsqueeze(1)
            else:
                hf[self.prefix + key] = value
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        ours = {}
        for key, value in hf_state_dict.items():
            if _NOT_TEXT.match(key):
                continue
            if key == "lm_head.weight":
                if not self.model_args.enable_weight_tying:
                    ours["output.weight"] = value
                continue
            name = _strip_prefix(key)
            if name in _TOP_LEVEL:
                ours[_TOP_LEVEL[name]] = value
            elif name.endswith(_CONV_HF):
                ours[name.replace(_CONV_HF, _CONV_OURS)] = value.squeeze(1)
            else:
                ours[name] = value
        if self.model_args.enable_weight_tying and "tok_embeddings.weight" in ours:
            ours["output.weight"] = ours["tok_embeddings.weight"]
        return ours

    def save_hf_metadata(self, folder: str, dtype: str) -> None:
        """Make the safetensors export in `folder` a folder transformers can load.

        torchtitan's `checkpoint.last_save_in_hf` writes only the weights and their index.
        This adds `config.json` (these model args; a multimodal `config.json` from
        `hf_assets_path` is kept as is, since the weights follow its layout) with `dtype` set to
        the export dtype, and copies the tokenizer files from `hf_assets_path`.
        """
        source = _read_config(self.hf_assets_path)
        if self.prefix == MULTIMODAL_PREFIX:
            config = dict(source)
        else:
            # Keep the source's other fields (token ids, ...); the shape is ours.
            config = {**source, **self.model_args.to_hf_config()}
        config.pop("torch_dtype", None)
        config["dtype"] = dtype
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for name in _HF_SIDE_FILES:
            path = os.path.join(self.hf_assets_path or "", name)
            if self.hf_assets_path and os.path.isfile(path):
                shutil.copyfile(path, os.path.join(folder, name))


def _read_config(hf_assets_path: str | None) -> dict[str, Any]:
    path = os.path.join(hf_assets_path or "", "config.json")
    if not hf_assets_path or not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _strip_prefix(key: str) -> str:
    for prefix in (MULTIMODAL_PREFIX, TEXT_PREFIX):
        if key.startswith(prefix):
            return key[len(prefix) :]
    raise KeyError(f"unexpected key {key!r} in a Qwen3.5 checkpoint")


def _checkpoint_prefix(hf_assets_path: str | None) -> str:
    return MULTIMODAL_PREFIX if "text_config" in _read_config(hf_assets_path) else TEXT_PREFIX
