"""The `qwen3_5` flavors (`model.flavor`): the published Qwen3.5 and Qwen3.5 MoE text models, the
debug models, and `from_hf_config`, whose shape is the config.json in model.hf_assets_path."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from titan_gdn.model import hf_config
from titan_gdn.model.args import KERNEL_BACKENDS, Qwen35ModelArgs


def _flavor(
    dim, n_layers, n_heads, n_kv_heads, hidden_dim, v_heads, tied, **other_fields
) -> Qwen35ModelArgs:
    return Qwen35ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        hidden_dim=hidden_dim,
        linear_num_value_heads=v_heads,
        enable_weight_tying=tied,
        **other_fields,
    )


def _moe_flavor(dim, n_layers, n_heads, v_heads, experts, top_k, expert_dim) -> Qwen35ModelArgs:
    """A Qwen3.5 MoE text config: 2 KV heads, 16 GDN key heads, 248,320 tokens, untied, a
    shared expert as wide as each routed one, every layer MoE."""
    return Qwen35ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=2,
        linear_num_value_heads=v_heads,
        enable_weight_tying=False,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_hidden_dim=expert_dim,
        shared_expert_hidden_dim=expert_dim,
        router_aux_loss_coef=0.001,
        hf_model_type=hf_config.MOE,
    )


FROM_HF_CONFIG = "from_hf_config"
# Kernel and loss choices are ours, not the checkpoint's: the from_hf_config flavor keeps them.
_KEPT_FIELDS = (*KERNEL_BACKENDS, "loss_chunk_tokens")


def _read_hf_config(hf_assets_path: str | None) -> dict[str, Any]:
    """`<hf_assets_path>/config.json`, for the from_hf_config flavor."""
    config = hf_config.read_config_json(hf_assets_path)
    if config is None:
        path = os.path.join(hf_assets_path or "", hf_config.CONFIG_JSON)
        raise FileNotFoundError(
            f"model.flavor = {FROM_HF_CONFIG!r} reads config.json from model.hf_assets_path, "
            f"but {path!r} does not exist; point model.hf_assets_path at a Qwen3.5 checkpoint "
            "folder (config.json and tokenizer files) or choose a named model.flavor"
        )
    return config


@dataclass
class Qwen35ArgsFromHFConfig(Qwen35ModelArgs):
    """The `from_hf_config` flavor: all fields come from `<model.hf_assets_path>/config.json`
    (a transformers Qwen3.5 config, text or multimodal), read when the trainer calls
    `update_from_config`; until then they are the defaults."""

    def update_from_config(self, job_config, **kwargs) -> None:
        self.load_hf_config(job_config)
        super().update_from_config(job_config, **kwargs)

    def load_hf_config(self, job_config) -> None:
        """Take every field from `<model.hf_assets_path>/config.json` (keeping the kernel and
        loss choices); raise naming the setting when it is missing or not a Qwen3.5 config."""
        config = _read_hf_config(job_config.model.hf_assets_path)
        backends = {name: getattr(self, name) for name in _KEPT_FIELDS}
        try:
            loaded = Qwen35ModelArgs.from_hf_config(config, **backends)
        except KeyError as missing:
            raise ValueError(
                f"model.flavor = {FROM_HF_CONFIG!r}: the config.json in model.hf_assets_path = "
                f"{job_config.model.hf_assets_path!r} is not a Qwen3.5 config "
                f"(it has no {missing})"
            ) from None
        except ValueError as invalid:  # Qwen35ModelArgs.validate: an inconsistent shape
            raise ValueError(
                f"model.flavor = {FROM_HF_CONFIG!r}: the config.json in model.hf_assets_path = "
                f"{job_config.model.hf_assets_path!r} describes no valid model ({invalid})"
            ) from None
        for arg in fields(Qwen35ModelArgs):
            setattr(self, arg.name, getattr(loaded, arg.name))


class UnknownFlavorError(KeyError):
    # KeyError's str() is the repr of its argument; show the message as written.
    def __str__(self) -> str:
        return str(self.args[0])


class Qwen35Flavors(Mapping[str, Qwen35ModelArgs]):
    """The TrainSpec's flavors. torchtitan's `Trainer.__init__` looks `model.flavor` up with
    `[]`; an unknown name fails with a message naming the setting and the choices."""

    def __init__(self, flavors: dict[str, Qwen35ModelArgs]):
        self._flavors = dict(flavors)

    def __getitem__(self, name: str) -> Qwen35ModelArgs:
        try:
            return self._flavors[name]
        except KeyError:
            raise UnknownFlavorError(
                f"model.flavor = {name!r} is not a qwen3_5 flavor; choose one of "
                f"{', '.join(self._flavors)}"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._flavors)

    def __len__(self) -> int:
        return len(self._flavors)


# The debug model is tiny but keeps both layer types, grouped value heads and fewer KV heads
# than attention heads, so every code path is exercised. Its GDN heads stay 128 wide as in the
# published sizes: FLA's Hopper backward is lifted only for 128-wide tiles.
# Its 4 key heads go into _flavor itself: the published flavors' 16 would not divide its 8
# value heads, and the args check that when built.
_DEBUG_MODEL = replace(
    _flavor(256, 4, 4, 2, 512, 8, tied=True, linear_num_key_heads=4),
    vocab_size=2048,
    head_dim=64,
    max_seq_len=131072,
    # Chunked although the vocabulary is small, so the debug config trains through
    # the chunked loss; 200 divides no batch, so a short last chunk is exercised too.
    loss_chunk_tokens=200,
)


# Published Qwen3.5 text configs (dense), and the debug model.
# "from_hf_config" reads the shape from model.hf_assets_path/config.json instead.
qwen3_5_args: Mapping[str, Qwen35ModelArgs] = Qwen35Flavors(
    {
        "debugmodel": _DEBUG_MODEL,
        "0.8B": _flavor(1024, 24, 8, 2, 3584, 16, tied=True),
        "2B": _flavor(2048, 24, 8, 2, 6144, 16, tied=True),
        "4B": _flavor(2560, 32, 16, 4, 9216, 32, tied=True),
        "9B": _flavor(4096, 32, 16, 4, 12288, 32, tied=False),
        "27B": _flavor(5120, 64, 24, 4, 17408, 48, tied=False),
        # Qwen3.5 MoE. 35B-A3B is transformers' Qwen3_5MoeTextConfig default ("Qwen3.5-35B-A3B
        # style") and Qwen3.6-35B-A3B has the same text model; 397B-A17B's widths, layers,
        # heads and experts agree with public training scripts for it; 122B-A10B's fields and
        # 397B-A17B's GDN head counts could not be checked against their config.json here and
        # were chosen to give the published totals (tests/test_flops.py checks total and
        # active counts within 1% of 35B/3B, 122B/10B, 397B/17B).
        "35B-A3B": _moe_flavor(2048, 40, 16, 32, experts=256, top_k=8, expert_dim=512),
        "3.6-35B-A3B": _moe_flavor(2048, 40, 16, 32, experts=256, top_k=8, expert_dim=512),
        "122B-A10B": _moe_flavor(3072, 48, 32, 64, experts=256, top_k=8, expert_dim=1024),
        "397B-A17B": _moe_flavor(4096, 60, 32, 64, experts=512, top_k=10, expert_dim=1024),
        # 35B-A3B's first 4 layers (3 GDN, 1 attention) with all 256 experts: fits one H200
        # with its optimizer state, for benchmarks against transformers.
        "35B-A3B-4layers": _moe_flavor(2048, 4, 16, 32, experts=256, top_k=8, expert_dim=512),
        # The debug model with 8 experts, top-2, in every layer: trains on CPU, and 8 experts
        # split over 2 or 4 expert-parallel ranks.
        "debugmoe": replace(
            _DEBUG_MODEL,
            num_experts=8,
            num_experts_per_tok=2,
            moe_hidden_dim=128,
            shared_expert_hidden_dim=128,
            router_aux_loss_coef=0.001,
            hf_model_type=hf_config.MOE,
        ),
        FROM_HF_CONFIG: Qwen35ArgsFromHFConfig(),
    }
)
