"""Triton autotuning bounded for the GPU tests: the first configuration that runs is kept.

FLA autotunes each Triton kernel the first time a process meets a shape: it compiles and times
every configuration of the kernel's list (tens per kernel), which on a machine with a cold
compile cache took most of the GPU suite's time (5 tests in 7 minutes). The tests check
results, not speed, and any configuration that runs computes the same function, so the tests
compile configurations in the kernel's order only until one runs, and keep that one. The
choice is not written to Triton's on-disk autotune cache, so a training run on the same
machine still tunes for itself.
"""

from __future__ import annotations

import functools

UNRUN = [float("inf")] * 3  # what Triton's own benchmark returns for a configuration that failed


def first_config_that_runs(bench):
    """Wrap `Autotuner._bench(self, *args, config, **meta)`: within one tuning (from
    `prune_configs` to the choice) the configurations after the first one that ran are not
    compiled; Triton then picks that one as the fastest."""

    @functools.wraps(bench)
    def bounded(self, *args, config, **meta):
        if getattr(self, "_bounded_found", False):
            return UNRUN
        timing = bench(self, *args, config=config, **meta)
        self._bounded_found = timing != UNRUN
        return timing

    return bounded


def new_tuning_each_prune(prune_configs):
    """Wrap `Autotuner.prune_configs`, which Triton calls once at the start of every tuning."""

    @functools.wraps(prune_configs)
    def pruned(self, *args, **kwargs):
        self._bounded_found = False
        return prune_configs(self, *args, **kwargs)

    return pruned


def tune_without_disk_cache(self, tuning_key, configs, bench_fn):
    """`Autotuner.check_disk_cache` that tunes and writes nothing: a bounded choice must not
    be found by a later training run on the same machine. False: not taken from a cache."""
    bench_fn()
    return False


def install(monkeypatch) -> None:
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "_bench", first_config_that_runs(Autotuner._bench))
    monkeypatch.setattr(Autotuner, "prune_configs", new_tuning_each_prune(Autotuner.prune_configs))
    monkeypatch.setattr(Autotuner, "check_disk_cache", tune_without_disk_cache)
