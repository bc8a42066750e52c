"""titan_gdn's additions to torchtitan's JobConfig, merged in by ``[job] custom_config_module =
"titan_gdn.job_config"`` (torchtitan's ConfigManager merges these dataclasses into its own).

A config without that line still trains: the trainer reads these settings with their defaults
(`setting`).
"""

# No `from __future__ import annotations`: torchtitan merges these dataclasses by their field
# types, which must be classes, not strings.
from dataclasses import dataclass, field


@dataclass
class Model:
    max_seq_len: int = 0
    """The longest training.seq_len the model accepts; 0: the flavor's (Qwen3.5's published
    max_position_embeddings, 262144). RoPE is computed from each token's position, with no
    table, so raising it changes nothing else; packed documents restart their positions, so
    only a single document longer than the published limit goes past what the checkpoint saw."""
    attn_backend: str = ""
    """The full-attention kernels: "varlen" (flash kernels over the documents; CUDA), "flex"
    (flex attention with a document block mask; CUDA, any dtype), "sdpa" (a dense document
    mask, the reference). "": per device, varlen on CUDA and sdpa on CPU."""
    delta_rule_backend: str = ""
    """The gated delta rule's kernels: "fla" (CUDA), "flash_qla" (FlashQLA, if installed:
    Hopper or Blackwell, head widths 128; under context parallel over sequence chunks the
    delta rule runs on FLA's kernels), "torch" (any device). "": per device, fla on CUDA."""
    conv_backend: str = ""
    """The GDN short convolution: "causal_conv1d" (CUDA, if installed), "fla" (CUDA), "torch".
    "": per device, in that order."""
    experts_backend: str = ""
    """The MoE experts: "grouped_mm" (one grouped GEMM per projection; CUDA), "loop" (one GEMM
    per expert). "": per device."""


@dataclass
class Training:
    skip_nonfinite_loss_steps: int = 0
    """How many consecutive steps with a NaN or infinite loss are skipped (no optimizer update,
    logged) before training stops. 0: stop at the first one, before it changes the weights."""


@dataclass
class Parallelism:
    context_parallel_mode: str = "auto"
    """How context_parallel_degree = N ranks share a row (docs/context_parallel.md):
    "heads": each mixer exchanges head groups, so every rank mixes the whole row for 1/N of the
    heads (the head counts must split N ways; best inside one NVLink domain); "states": each rank
    keeps a contiguous chunk and the layers pass recurrent states, conv tokens and attention's
    K, V across chunk boundaries (no divisibility rule; for many nodes); "auto": heads when
    the head counts split N ways and the group fits in one node, else as many head groups as
    split the heads within a node times sequence chunks. The choice is logged at start."""
    context_parallel_heads_degree: int = 0
    """The heads factor of context_parallel_degree in the two-dimensional split (heads inside
    a node, states across nodes): N = heads x states; 0 lets context_parallel_mode decide."""


@dataclass
class Compile:
    cudagraphs: bool = False
    """Replay each compiled decoder block's kernels as CUDA graphs (inductor's graph
    partitions): the delta-rule and conv ops, whose launches follow the documents, run between
    the graphs as before. It takes the host's per-kernel launch work out of the step, which is
    what bounds a step of short rows on one GPU (docs/performance.md). One GPU (no FSDP,
    context or expert parallel), dense flavors, one micro-batch per step, inductor."""


@dataclass
class Sample:
    prompt: str = ""
    """Text to continue with the trained model when training ends, printed with its
    continuation (one process only); "": no sample. The same as `python -m titan_gdn.generate
    --ignore-eos` on the last checkpoint."""
    max_new_tokens: int = 64
    """The continuation's length in tokens. It goes on across document ends (a blank line
    between documents): a document of the training data may end a few tokens after the prompt."""
    temperature: float = 0.8
    """0: greedy (argmax); above 0: a seeded draw among the `top_k` likeliest tokens."""
    top_k: int = 50
    seed: int = 0


@dataclass
class JobConfig:
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    sample: Sample = field(default_factory=Sample)


def setting(job_config, section: str, name: str):
    """`job_config.<section>.<name>`, or its default here when the config was parsed without
    this module."""
    default = getattr(JobConfig(), section)
    # A section of this module only ([sample]) is missing altogether.
    return getattr(getattr(job_config, section, default), name, getattr(default, name))
