"""The GPU tests' bound on Triton autotuning (tests/bounded_autotune.py), on Triton's own
Autotuner with its benchmark replaced: the configurations are compiled in order until one runs,
that one is chosen, each new tuning starts over, and nothing reaches the disk cache."""

import pytest
import triton
from triton.runtime.autotuner import Autotuner

from tests import bounded_autotune


class Kernel:
    """Stands in for a jitted kernel: records the configurations it was run with."""

    arg_names = ["x", "n"]

    def __init__(self):
        self.runs = []
        self.fn = lambda x, n, BLOCK: None  # the Autotuner looks through .fn for a function

    def run(self, *args, **kwargs):
        self.runs.append(kwargs["BLOCK"])


def autotuner(monkeypatch, failing: set[int], cache_results: bool = False):
    kernel = Kernel()
    configs = [triton.Config({"BLOCK": block}) for block in (16, 32, 64, 128)]
    tuner = Autotuner(
        kernel,
        kernel.arg_names,
        configs,
        key=["n"],
        reset_to_zero=None,
        restore_value=None,
        cache_results=cache_results,
    )
    benched = []

    def do_bench(kernel_call, quantiles):
        kernel_call()
        block = kernel.runs[-1]
        benched.append(block)
        if block in failing:
            raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")
        return [1.0 / block] * 3  # the widest block would win a full tuning

    monkeypatch.setattr(Autotuner, "do_bench", property(lambda self: do_bench))
    return tuner, kernel, benched


def test_full_tuning_benches_every_config(monkeypatch):
    tuner, kernel, benched = autotuner(monkeypatch, failing={16})
    tuner.run(None, 1000)
    assert benched == [16, 32, 64, 128]
    assert kernel.runs[-1] == 128


@pytest.mark.parametrize("cache_results", [False, True])
def test_bounded_tuning_keeps_the_first_config_that_runs(monkeypatch, tmp_path, cache_results):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    tuner, kernel, benched = autotuner(monkeypatch, failing={16}, cache_results=cache_results)
    bounded_autotune.install(monkeypatch)
    tuner.run(None, 1000)
    assert benched == [16, 32]  # 16 failed to compile, 32 ran: 64 and 128 never built
    assert kernel.runs[-1] == 32
    tuner.run(None, 2000)  # a new shape tunes again, from the first configuration
    assert benched == [16, 32, 16, 32]
    tuner.run(None, 1000)  # a shape met before is not tuned again
    assert benched == [16, 32, 16, 32]
    assert kernel.runs[-1] == 32
    assert not list(tmp_path.rglob("*.autotune.json"))
