"""titan_gdn's additions to torchtitan's JobConfig, merged in by ``[job] custom_config_module =
"titan_gdn.job_config"`` (torchtitan's ConfigManager merges these dataclasses into its own).

A config without that line still trains: the trainer reads these settings with their defaults
(`setting`).
"""

# No `from __future__ import annotations`: torchtitan merges these dataclasses by their field
# types, which must be classes, not strings.
from dataclasses import dataclass, field


@dataclass
class Training:
    skip_nonfinite_loss_steps: int = 0
    """How many consecutive steps with a NaN or infinite loss are skipped (no optimizer update,
    logged) before training stops. 0: stop at the first one, before it changes the weights."""


@dataclass
class JobConfig:
    training: Training = field(default_factory=Training)


def setting(job_config, section: str, name: str):
    """`job_config.<section>.<name>`, or its default here when the config was parsed without
    this module."""
    default = getattr(JobConfig(), section)
    return getattr(getattr(job_config, section), name, getattr(default, name))
