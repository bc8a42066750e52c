import os

import pytest

from tests import bounded_autotune, device_lock

# cuBLAS reads its workspace size once, when a process first uses it: set here, before any test
# runs CUDA, so that every worker can turn on torch's deterministic kernels (which ask for this
# fixed workspace) whatever ran before in it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="session", autouse=True)
def autotune_first_config_that_runs():
    """Every GPU test runs with Triton autotuning bounded (tests/bounded_autotune.py): on a
    fresh machine FLA's autotuning, not the tests, took most of the suite's time."""
    with pytest.MonkeyPatch.context() as patch:
        bounded_autotune.install(patch)
        yield


@pytest.fixture(autouse=True)
def device_shared_or_alone(request):
    """The suite runs its files in worker processes side by side on one GPU (`-n`); a test
    marked `gpu_alone` has the device to itself (tests/device_lock.py)."""
    alone = request.node.get_closest_marker("gpu_alone") is not None
    with device_lock.holding_device(alone):
        yield
