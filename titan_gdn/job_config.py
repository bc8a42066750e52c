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


@dataclass
class Training:
    skip_nonfinite_loss_steps: int = 0
    """How many consecutive steps with a NaN or infinite loss are skipped (no optimizer update,
    logged) before training stops. 0: stop at the first one, before it changes the weights."""


@dataclass
class JobConfig:
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)


def setting(job_config, section: str, name: str):
    """`job_config.<section>.<name>`, or its default here when the config was parsed without
    this module."""
    default = getattr(JobConfig(), section)
    return getattr(getattr(job_config, section), name, getattr(default, name))
