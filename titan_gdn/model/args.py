"""Model arguments for the Qwen3.5 hybrid text model: dense, MoE (Qwen3.5 MoE) and Qwen3-Next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from titan_gdn.job_config import setting
from titan_gdn.model import hf_config
from titan_gdn.model.flops import count_params_and_flops
from titan_gdn.model.job_checks import job_config_problems
from titan_gdn.model.layer_types import FULL_ATTENTION, LAYER_TYPES, LINEAR_ATTENTION

# The kernel choices a job can set (`[model]` in the TOML; titan_gdn/job_config.py).
KERNEL_BACKENDS = ("attn_backend", "delta_rule_backend", "conv_backend", "experts_backend")
CHUNKED_LOSS_MIN_VOCAB = 32768
# 1024 tokens x 248,320 fp32 logits is 1 GiB per chunk: large matmuls, a bounded peak.
DEFAULT_LOSS_CHUNK_TOKENS = 1024


@dataclass
class Qwen35ModelArgs(BaseModelArgs):
    dim: int = 1024
    n_layers: int = 24
    vocab_size: int = 248320
    hidden_dim: int = 3584  # SwiGLU intermediate size
    norm_eps: float = 1e-6
    enable_weight_tying: bool = True
    # The transformers model type the checkpoint keys and config.json follow (HF export).
    hf_model_type: str = "qwen3_5_text"

    # gated full attention. Each part's `*_backend` names its kernels (a job setting, [model]);
    # None picks per device: FLA and torch's flash and cuDNN kernels on CUDA, pure torch on CPU.
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 256
    attn_backend: str | None = None
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25

    # Gated DeltaNet
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    delta_rule_backend: str | None = None
    linear_conv_kernel_dim: int = 4
    conv_backend: str | None = None

    # Every `full_attention_interval`-th layer is full attention, unless `layer_types` says so.
    full_attention_interval: int = 4
    layer_types: list[str] | None = None

    max_seq_len: int = 262144
    initializer_range: float = 0.02

    # Mixture of experts (Qwen3.5 MoE, Qwen3-Next); num_experts = 0: every MLP is dense
    # (`hidden_dim`). An MoE layer routes each token to num_experts_per_tok experts of
    # `moe_hidden_dim` and adds a gated shared expert of `shared_expert_hidden_dim`. Qwen3-Next
    # keeps dense MLPs in `mlp_only_layers` and in layers i with (i + 1) % decoder_sparse_step.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = True
    moe_hidden_dim: int = 0
    shared_expert_hidden_dim: int = 0
    experts_backend: str | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Weight of transformers' load-balancing loss in the training loss (titan_gdn/loss.py).
    router_aux_loss_coef: float = 0.0

    # Training loss over this many tokens at a time, never materialising full-sequence logits
    # (titan_gdn/loss.py); 0 computes the logits at once. None: chunked when the vocabulary
    # is at least CHUNKED_LOSS_MIN_VOCAB, where full logits dominate activation memory.
    loss_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [
                FULL_ATTENTION if (i + 1) % self.full_attention_interval == 0 else LINEAR_ATTENTION
                for i in range(self.n_layers)
            ]
        self.validate()

    # torchtitan builds document masks (get_attention_masks) only for these attention types;
    # packed documents always need them, so the model always reports one.
    @property
    def attn_type(self) -> str:
        return "flex"

    @property
    def chunked_loss_tokens(self) -> int:
        """`loss_chunk_tokens` resolved: the loss's chunk size, 0 for the plain loss."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        return DEFAULT_LOSS_CHUNK_TOKENS if self.vocab_size >= CHUNKED_LOSS_MIN_VOCAB else 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has the sparse MoE block, as transformers'
        Qwen3-Next decides it (Qwen3.5 MoE: every layer)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def validate(self) -> None:
        problems = []
        if len(self.layer_types) != self.n_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries but n_layers is {self.n_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            problems.append(f"layer_types contains {unknown}; allowed: {list(LAYER_TYPES)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            problems.append(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.rotary_dim % 2:
            problems.append(
                f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even for RoPE"
            )
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            problems.append(f"loss_chunk_tokens must be >= 0, got {self.loss_chunk_tokens}")
        problems += self._moe_problems()
        if problems:
            raise ValueError("Invalid Qwen3.5 model args: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        if self.num_experts == 0:
            return []
        problems = []
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            problems.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        for name in ("moe_hidden_dim", "shared_expert_hidden_dim", "decoder_sparse_step"):
            if getattr(self, name) < 1:
                problems.append(
                    f"{name} must be positive for an MoE model, got {getattr(self, name)}"
                )
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if outside:
            problems.append(f"mlp_only_layers {outside} are not layers of 0..{self.n_layers - 1}")
        if self.router_aux_loss_coef < 0:
            problems.append(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        return problems

    def update_from_config(self, job_config, **kwargs) -> None:
        """Check the job's settings against these args; every error names the setting to fix.

        torchtitan 0.2.2's `Trainer.__init__` calls this without the tokenizer; the
        TrainSpec's tokenizer builder calls it again with ``tokenizer=`` so that the vocabulary
        is checked too, before the data loader and the model are built.
        """
        self.apply_job_settings(job_config)
        problems = job_config_problems(self, job_config, kwargs.get("tokenizer"))
        if problems:
            raise ValueError(
                f"model.flavor = {job_config.model.flavor!r} cannot train with this job config: "
                + "; ".join(problems)
            )
        _settle_cp_load_balancer(job_config)

    def apply_job_settings(self, job_config) -> None:
        """Take `model.max_seq_len` and the kernel backends from the job where they are set
        (0 and "" keep the flavor's)."""
        for name in ("max_seq_len", *KERNEL_BACKENDS):
            value = setting(job_config, "model", name)
            if value:
                setattr(self, name, value)

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        return count_params_and_flops(self, model, seq_len)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], **overrides: Any) -> Qwen35ModelArgs:
        """Args from a transformers `config.json` dict of Qwen3.5 (`qwen3_5_text`), Qwen3.5 MoE
        (`qwen3_5_moe_text`) or Qwen3-Next (`qwen3_next`): text, or multimodal with a nested
        `text_config`; a dict without `model_type` is read as dense Qwen3.5. A missing
        required field raises KeyError naming it; another model type, ValueError naming it."""
        return cls(**{**hf_config.args_fields(config), **overrides})

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers config fields of these args, for their `hf_model_type` (export)."""
        return hf_config.config_fields(self)


def _settle_cp_load_balancer(job_config) -> None:
    # TOML has no null and torchtitan rejects "" (its `Parallelism.__post_init__`), so a config says
    # context_parallel_load_balancer = "none"; torchtitan's CP helpers want None for "do not
    # reorder tokens" (`cp_shard` in its distributed/context_parallel.py).
    parallelism = job_config.parallelism
    balancer = parallelism.context_parallel_load_balancer
    if isinstance(balancer, str) and balancer.lower() == "none":
        parallelism.context_parallel_load_balancer = None


__all__ = ["FULL_ATTENTION", "LINEAR_ATTENTION", "Qwen35ModelArgs"]
