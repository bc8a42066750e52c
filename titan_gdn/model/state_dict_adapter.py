"""Map transformers Qwen3.5, Qwen3.5 MoE and Qwen3-Next checkpoints to this model's state dict
and back.

The MoE keys (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`) are this model's names as they are.
Qwen3-Next stores each GDN layer's input projections fused and interleaved per key-head group;
they are first rearranged into Qwen3.5's four projections (and back on export), so the Qwen3.5
mapping then applies unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_gdn.model.args import Qwen35ModelArgs
from titan_gdn.model.hf_config import CONFIG_JSON, NEXT, read_config_json

TEXT_PREFIX = "model."
MULTIMODAL_PREFIX = "model.language_model."
# Parts of a multimodal checkpoint that the text model does not have.
NOT_TEXT = re.compile(r"^(model\.visual\.|visual\.|mtp\.)")

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
        for key, value in split_mixer_projections(state_dict, self.model_args).items():
            if key == "output.weight":
                if not self.model_args.enable_weight_tying:
                    hf["lm_head.weight"] = value
            elif key in _TOP_LEVEL_HF:
                hf[self.prefix + _TOP_LEVEL_HF[key]] = value
            elif key.endswith(_CONV_OURS):
                hf[self.prefix + key.replace(_CONV_OURS, _CONV_HF)] = value.unsqueeze(1)
            else:
                hf[self.prefix + key] = value
        if self.model_args.hf_model_type == NEXT:
            hf = fuse_qwen3_next_projections(hf, self.model_args)
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.model_args.hf_model_type == NEXT:
            hf_state_dict = split_qwen3_next_projections(hf_state_dict, self.model_args)
        ours = {}
        for key, value in hf_state_dict.items():
            if NOT_TEXT.match(key):
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
        return fuse_mixer_projections(ours, self.model_args)

    def save_hf_metadata(self, folder: str, dtype: str) -> None:
        """Make the safetensors export in `folder` a folder transformers can load.

        torchtitan's `checkpoint.last_save_in_hf` writes only the weights and their index.
        This adds `config.json` (these model args; a multimodal `config.json` from
        `hf_assets_path` is kept as is, since the weights follow its layout) with `dtype` set to
        the export dtype, and copies the tokenizer files from `hf_assets_path`.
        """
        source = read_config_json(self.hf_assets_path) or {}
        if self.prefix == MULTIMODAL_PREFIX:
            config = dict(source)
        else:
            # Keep the source's other fields (token ids, ...); the shape is ours.
            config = {**source, **self.model_args.to_hf_config()}
        config.pop("torch_dtype", None)
        config["dtype"] = dtype
        with open(os.path.join(folder, CONFIG_JSON), "w") as f:
            json.dump(config, f, indent=2)
        for name in _HF_SIDE_FILES:
            path = os.path.join(self.hf_assets_path or "", name)
            if self.hf_assets_path and os.path.isfile(path):
                shutil.copyfile(path, os.path.join(folder, name))


# transformers keeps one matrix per projection; a titan_gdn mixer has one matrix for what its
# head groups send over context parallel, group-major (see the layers' docstrings), and one for
# its per-token gate. These functions move rows between the two layouts (a permutation: the
# round trip is exact), with views, splits and cats only, which DTensors support too.
_GDN_HF = ("in_proj_qkv", "in_proj_b", "in_proj_a")
_GDN_OURS = "in_proj_qkvba"
_ATTENTION_HF = ("q_proj", "k_proj", "v_proj")
_ATTENTION_OURS = ("qkv_proj", "gate_proj")


def fuse_mixer_projections(state_dict: dict[str, Any], args: Qwen35ModelArgs) -> dict[str, Any]:
    """Our state dict from one in transformers' projection layout (other keys as they are)."""
    return _each_mixer(
        state_dict, args, gdn=(_GDN_HF[0], _fuse_gdn), attention=(_ATTENTION_HF[0], _fuse_attention)
    )


def split_mixer_projections(state_dict: dict[str, Any], args: Qwen35ModelArgs) -> dict[str, Any]:
    """The inverse of `fuse_mixer_projections`."""
    return _each_mixer(
        state_dict,
        args,
        gdn=(_GDN_OURS, _split_gdn),
        attention=(_ATTENTION_OURS[0], _split_attention),
    )


def _each_mixer(
    state_dict: dict[str, Any], args: Qwen35ModelArgs, gdn, attention
) -> dict[str, Any]:
    """A copy of `state_dict` with each mixer rewritten, layer by layer: `gdn` and `attention`
    are (the projection that marks such a mixer, the function that rewrites its keys)."""
    rewritten = dict(state_dict)
    for key in state_dict:
        for mixer, (marker, rewrite) in ((".linear_attn.", gdn), (".self_attn.", attention)):
            layer, _, name = key.rpartition(mixer)
            if name == f"{marker}.weight":
                rewrite(rewritten, f"{layer}{mixer}", args)
    return rewritten


def _fuse_gdn(state_dict: dict[str, Any], prefix: str, args: Qwen35ModelArgs) -> None:
    qkv, b, a = (state_dict.pop(f"{prefix}{hf}.weight") for hf in _GDN_HF)
    sections = (*_qkv_sections(qkv, args), b, a)
    state_dict[f"{prefix}{_GDN_OURS}.weight"] = _group_major(sections, args.linear_num_key_heads)
    conv = _qkv_sections(state_dict[f"{prefix}conv_weight"], args)
    state_dict[f"{prefix}conv_weight"] = _group_major(conv, args.linear_num_key_heads)


def _split_gdn(state_dict: dict[str, Any], prefix: str, args: Qwen35ModelArgs) -> None:
    rows, groups = _gdn_group_rows(args), args.linear_num_key_heads
    q, k, v, b, a = _sections(state_dict.pop(f"{prefix}{_GDN_OURS}.weight"), rows, groups)
    for hf, weight in zip(_GDN_HF, (torch.cat([q, k, v]), b, a), strict=True):
        state_dict[f"{prefix}{hf}.weight"] = weight
    conv = _sections(state_dict[f"{prefix}conv_weight"], rows[:3], groups)
    state_dict[f"{prefix}conv_weight"] = torch.cat(conv)


def _fuse_attention(state_dict: dict[str, Any], prefix: str, args: Qwen35ModelArgs) -> None:
    q_and_gate, k, v = (state_dict.pop(f"{prefix}{hf}.weight") for hf in _ATTENTION_HF)
    # Per head, transformers' q_proj rows are its query, then its output gate.
    q, gate = q_and_gate.unflatten(0, (args.n_heads, 2, -1)).unbind(1)
    qkv_ours, gate_ours = _ATTENTION_OURS
    qkv = _group_major((q.flatten(0, 1), k, v), args.n_kv_heads)
    state_dict[f"{prefix}{qkv_ours}.weight"] = qkv
    state_dict[f"{prefix}{gate_ours}.weight"] = gate.flatten(0, 1)


def _split_attention(state_dict: dict[str, Any], prefix: str, args: Qwen35ModelArgs) -> None:
    head_dim, per_kv = args.head_dim, args.n_heads // args.n_kv_heads
    qkv_ours, gate_ours = _ATTENTION_OURS
    rows = [per_kv * head_dim, head_dim, head_dim]
    q, k, v = _sections(state_dict.pop(f"{prefix}{qkv_ours}.weight"), rows, args.n_kv_heads)
    gate = state_dict.pop(f"{prefix}{gate_ours}.weight")
    heads = [t.unflatten(0, (args.n_heads, head_dim)) for t in (q, gate)]
    q_and_gate = torch.stack(heads, dim=1).flatten(0, 2)
    for hf, weight in zip(_ATTENTION_HF, (q_and_gate, k, v), strict=True):
        state_dict[f"{prefix}{hf}.weight"] = weight


def _qkv_sections(weight, args: Qwen35ModelArgs) -> list:
    key_dim = args.linear_num_key_heads * args.linear_key_head_dim
    value_dim = args.linear_num_value_heads * args.linear_value_head_dim
    return list(weight.split([key_dim, key_dim, value_dim]))


def _gdn_group_rows(args: Qwen35ModelArgs) -> list[int]:
    per_group = args.linear_num_value_heads // args.linear_num_key_heads
    key, value = args.linear_key_head_dim, args.linear_value_head_dim
    return [key, key, per_group * value, per_group, per_group]


def _group_major(sections, groups: int):
    """Head-major sections (rows of all groups each) -> per group, its rows of every section."""
    return torch.cat([s.unflatten(0, (groups, -1)) for s in sections], dim=1).flatten(0, 1)


def _sections(weight, group_rows: list[int], groups: int) -> list:
    """The inverse of `_group_major`."""
    per_group = weight.unflatten(0, (groups, -1)).split(group_rows, dim=1)
    return [s.flatten(0, 1) for s in per_group]


def _strip_prefix(key: str) -> str:
    for prefix in (MULTIMODAL_PREFIX, TEXT_PREFIX):
        if key.startswith(prefix):
            return key[len(prefix) :]
    raise KeyError(f"unexpected key {key!r} in a Qwen3.5 checkpoint")


def _checkpoint_prefix(hf_assets_path: str | None) -> str:
    config = read_config_json(hf_assets_path) or {}
    return MULTIMODAL_PREFIX if "text_config" in config else TEXT_PREFIX


# Qwen3-Next's fused GDN input projections. Per key-head group g, in_proj_qkvz's rows are
# q_g [Dk], k_g [Dk], v_g [r * Dv], z_g [r * Dv] and in_proj_ba's are b_g [r], a_g [r], with
# r = value heads per key head; Qwen3.5 keeps q, k, v of all heads in in_proj_qkv (q heads,
# then k heads, then v heads) and z, b, a in projections of their own, heads in the same order.
_QKVZ, _BA = ".linear_attn.in_proj_qkvz.weight", ".linear_attn.in_proj_ba.weight"
_QWEN3_5_GDN = tuple(f".linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a"))


def _group_sizes(args: Qwen35ModelArgs) -> tuple[int, int, int]:
    per_key_head = args.linear_num_value_heads // args.linear_num_key_heads
    return args.linear_key_head_dim, per_key_head * args.linear_value_head_dim, per_key_head


def split_qwen3_next_projections(state_dict: dict[str, Any], args) -> dict[str, Any]:
    """Qwen3-Next keys -> Qwen3.5 keys: in_proj_qkvz / in_proj_ba become in_proj_qkv, _z, _b, _a."""
    dk, rdv, r = _group_sizes(args)
    groups = args.linear_num_key_heads
    out = {}
    for key, value in state_dict.items():
        if key.endswith(_QKVZ):
            q, k, v, z = value.view(groups, -1, value.shape[-1]).split([dk, dk, rdv, rdv], dim=1)
            qkv_key, z_key = (key.replace(_QKVZ, new) for new in _QWEN3_5_GDN[:2])
            out[qkv_key] = torch.cat([t.flatten(0, 1) for t in (q, k, v)])
            out[z_key] = z.flatten(0, 1)
        elif key.endswith(_BA):
            b, a = value.view(groups, 2 * r, -1).split([r, r], dim=1)
            b_key, a_key = (key.replace(_BA, new) for new in _QWEN3_5_GDN[2:])
            out[b_key], out[a_key] = b.flatten(0, 1), a.flatten(0, 1)
        else:
            out[key] = value
    return out


def fuse_qwen3_next_projections(state_dict: dict[str, Any], args) -> dict[str, Any]:
    """The inverse of `split_qwen3_next_projections`."""
    dk, rdv, r = _group_sizes(args)
    groups = args.linear_num_key_heads
    qkv_suffix, z_suffix, b_suffix, a_suffix = _QWEN3_5_GDN
    out = {}
    for key, value in state_dict.items():
        if key.endswith(qkv_suffix):
            z = state_dict[key.replace(qkv_suffix, z_suffix)]
            q, k, v = value.split([groups * dk, groups * dk, groups * rdv])
            per_group = [t.view(groups, -1, t.shape[-1]) for t in (q, k, v, z)]
            out[key.replace(qkv_suffix, _QKVZ)] = torch.cat(per_group, dim=1).flatten(0, 1)
        elif key.endswith(b_suffix):
            a = state_dict[key.replace(b_suffix, a_suffix)]
            per_group = [t.view(groups, r, -1) for t in (value, a)]
            out[key.replace(b_suffix, _BA)] = torch.cat(per_group, dim=1).flatten(0, 1)
        elif not key.endswith((z_suffix, a_suffix)):
            out[key] = value
    return out
