"""Map transformers Qwen3.5, Qwen3.5 MoE and Qwen3-Next checkpoints to this model's state dict
and back.

The MoE keys (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`) are this model's names as they are, but
the routed experts come in two layouts: fused as above (transformers' modules in memory) or one
matrix per expert, `mlp.experts.{e}.{gate,up,down}_proj.weight`, which is what transformers'
`save_pretrained` writes and what the Hub's Qwen3-Next checkpoints hold. `from_hf` takes both.
`to_hf` writes the one the checkpoint in `hf_assets_path` holds. If there is none, it writes the
per-expert layout for Qwen3-Next and the fused one for Qwen3.5 MoE.
Qwen3-Next stores each GDN layer's input projections fused and interleaved per key-head group;
they are first rearranged into Qwen3.5's four projections (and back on export), so the Qwen3.5
mapping then applies unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_gdn.model.args import Qwen35ModelArgs
from titan_gdn.model.hf_config import CONFIG_JSON, HF_INDEX, NEXT, read_config_json
from titan_gdn.model.hf_files import UnreadableWeightsError, safetensors_files, safetensors_shapes

TEXT_PREFIX = "model."
MULTIMODAL_PREFIX = "model.language_model."
# Parts of a multimodal checkpoint that the text model does not have.
NOT_TEXT = re.compile(r"^(model\.visual\.|visual\.|mtp\.)")
# The export's file for those tensors, copied from the source.
UNTRAINED_FILE = "model-not-trained.safetensors"

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
        # torchtitan's HF load reads exactly the keys `to_hf` returns, so they must be the
        # ones on disk.
        self.per_expert = _per_expert_layout(model_args, hf_assets_path)
        # {fused HF key: how its DTensor is sharded}, from `to_hf`, for `from_hf` to rebuild it.
        self._expert_shards: dict[str, _ExpertShard] = {}

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
        if self.per_expert:
            hf = self._split_experts(hf)
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        hf_state_dict = self._stack_experts(hf_state_dict)
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
        the export dtype, and copies the tokenizer files from `hf_assets_path`, and the
        source's tensors this model does not train (a vision tower, MTP heads), so that the
        config.json the export keeps describes weights that are all there.
        """
        self._copy_untrained_tensors(folder)
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

    def _copy_untrained_tensors(self, folder: str) -> None:
        """The source's vision and MTP tensors (NOT_TEXT), as stored, into one more file of the
        export, listed in its index. Without them transformers would initialise a vision tower
        at random when loading the export of a multimodal checkpoint."""
        if not self.hf_assets_path:
            return
        tensors = {}
        for path in sorted(Path(self.hf_assets_path).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as weights:
                for name in weights.keys():
                    if NOT_TEXT.match(name):
                        tensors[name] = weights.get_tensor(name)
        if not tensors:
            return
        save_file(tensors, os.path.join(folder, UNTRAINED_FILE), metadata={"format": "pt"})
        index_path = os.path.join(folder, HF_INDEX)
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"].update(dict.fromkeys(tensors, UNTRAINED_FILE))
        with open(index_path, "w") as f:
            json.dump(index, f, indent=2)

    def _split_experts(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Fused expert weights -> one matrix per expert and projection, for this rank's
        experts only (views where the rows are not sharded): torchtitan's HF load reads each
        one in place, so no rank gathers the experts of the others."""
        out = {}
        for key, value in hf.items():
            match = _FUSED_EXPERT.search(key)
            if match is None:
                out[key] = value
                continue
            stem = key[: match.start(1)]
            first, local = self._local_experts(key, value)
            for index, weight in enumerate(local):
                expert = f"{stem}{first + index}."
                if match.group(1) == "down_proj":
                    out[f"{expert}down_proj.weight"] = weight
                else:
                    # Per expert, transformers' gate_up_proj rows are its gate, then its up.
                    gate, up = weight.chunk(2)
                    out[f"{expert}gate_proj.weight"], out[f"{expert}up_proj.weight"] = gate, up
        return out

    def _local_experts(self, key: str, value) -> tuple[int, Any]:
        """(first expert, [this rank's experts, rows, columns]) of a fused expert weight. A
        DTensor keeps its sharding over experts (expert parallel, FSDP over experts); a
        sharding of rows (FSDP where the ranks outnumber the experts) is gathered for the
        experts of this rank, since a per-expert matrix cannot be split across gate and up."""
        if not isinstance(value, DTensor):
            return 0, value
        mesh, placements = value.device_mesh, tuple(value.placements)
        whole_rows = tuple(p if _shards_experts(p) else Replicate() for p in placements)
        local = value if whole_rows == placements else value.redistribute(mesh, whole_rows)
        local = local.to_local()
        _, offset = compute_local_shape_and_global_offset(value.shape, mesh, whole_rows)
        # torchtitan's expert sharding (Shard, or StridedShard then Shard, over experts) leaves
        # each rank a contiguous run of experts, as its own MoE adapters assume.
        self._expert_shards[key] = _ExpertShard(
            mesh, placements, whole_rows, value.shape, range(offset[0], offset[0] + len(local))
        )
        return offset[0], local

    def _stack_experts(self, hf: dict[str, Any]) -> dict[str, Any]:
        """Per-expert matrices -> the fused weights (other keys as they are)."""
        out, experts = {}, {}
        for key, value in hf.items():
            match = _PER_EXPERT.match(key)
            if match is None or NOT_TEXT.match(key):  # MTP experts: not loaded
                out[key] = value
            else:
                stem, expert, projection = match.groups()
                experts.setdefault(stem, {}).setdefault(projection, {})[int(expert)] = value
        for stem, projections in experts.items():
            for fused, parts in _FUSED_PARTS.items():
                key = f"{stem}{fused}"
                shard = self._expert_shards.get(key)
                wanted = shard.experts if shard else range(self.model_args.num_experts)
                stacked = [self._expert_stack(key, projections.get(p, {}), wanted) for p in parts]
                out[key] = _sharded_like(shard, torch.cat(stacked, dim=1))
        return out

    @staticmethod
    def _expert_stack(key: str, weights: dict[int, Any], wanted: range):
        missing = [expert for expert in wanted if expert not in weights]
        if missing or len(weights) != len(wanted):
            raise KeyError(
                f"{key}: the per-expert weights are experts {sorted(weights)}, expected "
                f"{wanted.start} to {wanted.stop - 1} (num_experts in config.json)"
            )
        return torch.stack([weights[expert] for expert in wanted])


# Routed experts: this model's (and transformers' in-memory) fused weights, and the per-expert
# matrices of a checkpoint on disk; each fused weight is its parts concatenated along dim 1.
_FUSED_EXPERT = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class _ExpertShard:
    """How a fused expert DTensor was sharded: `placements` on `mesh`, `whole_rows` the same
    with only the expert dim sharded, `experts` the global indices of this rank's experts."""

    def __init__(self, mesh, placements, whole_rows, shape, experts: range):
        self.mesh, self.placements, self.whole_rows = mesh, placements, whole_rows
        self.shape, self.experts = shape, experts


def _shards_experts(placement) -> bool:
    return isinstance(placement, (Shard, _StridedShard)) and placement.dim == 0


def _sharded_like(shard: _ExpertShard | None, local):
    """This rank's stacked experts as the DTensor `to_hf` split (a plain tensor unsharded)."""
    if shard is None:
        return local
    stride = torch.empty(shard.shape, device="meta").stride()
    whole = DTensor.from_local(
        local, shard.mesh, shard.whole_rows, run_check=False, shape=shard.shape, stride=stride
    )
    if shard.whole_rows == shard.placements:
        return whole
    return whole.redistribute(shard.mesh, shard.placements)


def _per_expert_layout(args: Qwen35ModelArgs, hf_assets_path: str | None) -> bool:
    """Whether `to_hf` writes one matrix per expert: as the checkpoint in `hf_assets_path`
    stores its experts, else as transformers saves Qwen3-Next (and the Hub holds it); Qwen3.5
    MoE keeps the fused layout this adapter has always written for it."""
    if args.num_experts == 0:
        return False
    for name in _stored_names(hf_assets_path):
        if NOT_TEXT.match(name):
            continue
        if _PER_EXPERT.match(name):
            return True
        if _FUSED_EXPERT.search(name):
            return False
    return args.hf_model_type == NEXT


def _stored_names(folder: str | os.PathLike | None) -> list[str]:
    """The tensor names of an HF checkpoint folder, from the safetensors headers (no weight
    read); none for a folder without (readable) weights, whose damage the config check and the
    import report."""
    if not folder or not os.path.isdir(folder):
        return []
    try:
        return list(safetensors_shapes(safetensors_files(folder)))
    except UnreadableWeightsError:
        return []


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
