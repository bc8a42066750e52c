import copy
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

# OpenMP threads that wait sleep instead of spinning (as run_train.sh sets for its ranks): the
# suite's processes share the cores (two workers under `-n 2`, and the processes tests start),
# and spinning threads made a neighbour's steps 5-20x slower. Read when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch._prims.rng_prims import run_with_rng_state  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# What the shipped configs and the README's commands name relative to the checkout's root.
CHECKOUT_INPUTS = ("assets", "train_configs")

# How many gpu-marked tests `pytest_collection_modifyitems` deselected, for the line that says so.
GPU_TESTS_DESELECTED = pytest.StashKey[int]()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64: one number per tensor, scale-free."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


class OpCounter(TorchDispatchMode):
    """Counts the ops that reach the dispatcher while it is active."""

    supports_higher_order_operators = True  # compiled backward may wrap ops in them

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Compiled backward recomputes ops that could be random with their forward RNG state,
        # as run_with_rng_state(state, op, *args): count the op.
        self.calls[args[1] if func is run_with_rng_state else func] += 1
        return func(*args, **(kwargs or {}))


def perturb_norms_and_gates(model: torch.nn.Module, scale: float = 0.3) -> None:
    """Move norm weights and dt_bias off their init values (0 or 1), so that a wrong (1 + w)
    convention or a wrong slice of a per-head parameter shows in the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(scale * torch.randn_like(param))


# Overrides for `perturbed_debug_model`: every head 32 channels wide (the debug model's are 64
# for attention, 128 for GDN), so that the context parallel tests' 8 or 16 CPU processes stay
# affordable.
NARROW_HEADS = dict(linear_key_head_dim=32, linear_value_head_dim=32, head_dim=32)


def perturbed_debug_model(flavor: str = "debugmodel", **overrides):
    """The debug flavor (or `flavor`, with `overrides` of its args), initialised from seed 0,
    with norms and gates moved off their init."""
    from titan_gdn.model import Qwen35Model, qwen3_5_args

    torch.manual_seed(0)
    args = copy.deepcopy(qwen3_5_args[flavor])
    for name, value in overrides.items():
        setattr(args, name, value)
    model = Qwen35Model(args)
    model.init_weights()
    perturb_norms_and_gates(model)
    return model


@pytest.fixture(autouse=True)
def working_directory_outside_the_checkout(tmp_path_factory, monkeypatch):
    """Each test runs in a fresh working directory where the configs' relative paths
    (./assets/tokenizer, train_configs/...) lead to the checkout's files and their dump folders
    (./outputs/...) are new. So what a user trained in the checkout cannot change a test's
    outcome, and a test that writes with the default paths writes here, not into the checkout.
    PYTHONPATH names the checkout: a child process started here (`python -c ...`) imports its
    packages, as this one does, not an installed copy."""
    workdir = tmp_path_factory.mktemp("cwd")
    for name in CHECKOUT_INPUTS:
        (workdir / name).symlink_to(REPO / name, target_is_directory=True)
    monkeypatch.chdir(workdir)
    pythonpath = [str(REPO), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, pythonpath)))


def copy_checkout(destination: Path) -> None:
    """The checkout's tracked and untracked, not ignored files (no outputs/, no caches) into
    `destination`: a checkout as a new user clones it, for commands that write beside their
    own code (run_train.sh's ./outputs, the benchmarks' outputs/benchmarks)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def run_as_a_user(command: list[str], cwd: Path) -> tuple[int, str]:
    """`command` in `cwd` as a user runs it from a shell: PYTHONPATH unset (run_train.sh puts
    its own folder first), no NGPU, this interpreter's `python` first on PATH."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "NGPU")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    return result.returncode, result.stdout + result.stderr


# The README's quickstart.
QUICKSTART = "./run_train.sh"


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> tuple[Path, str]:
    """A copy of the checkout in which the README's quickstart ran, as a user's first run
    (it writes the copy's outputs/debug_model): (the copy, the run's output). Run once per
    session: tests/test_quickstart.py checks the run and runs the pages' other commands in the
    same copy (one module, so one pytest-xdist worker under `--dist loadfile`)."""
    checkout = tmp_path_factory.mktemp("quickstart")
    copy_checkout(checkout)
    code, output = run_as_a_user([QUICKSTART], checkout)
    assert code == 0, output[-6000:]
    return checkout, output


@pytest.fixture(scope="session")
def hf_qwen3_5():
    """transformers' Qwen3.5 module on its pure-torch path (FLA hidden while it is imported)."""
    from benchmarks.references import transformers_qwen3_5_module

    return transformers_qwen3_5_module(torch_path=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a CUDA device, a bare `pytest` leaves the gpu-marked tests out (deselected, and
    said so), instead of failing on the first one with "Torch not compiled with CUDA enabled".
    Any `-m` expression is the user's choice and is left alone: `-m gpu` still runs them."""
    if config.getoption("markexpr") or torch.cuda.is_available():
        return
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    config.hook.pytest_deselected(items=gpu_items)
    items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
    config.stash[GPU_TESTS_DESELECTED] = len(gpu_items)


def pytest_report_collectionfinish(config: pytest.Config) -> str | None:
    """The one line, right after collection, that explains the smaller test count."""
    deselected = config.stash.get(GPU_TESTS_DESELECTED, 0)
    if not deselected:
        return None
    tests = "test" if deselected == 1 else "tests"
    return (
        f"{deselected} GPU {tests} deselected: no CUDA device"
        " (run them with -m gpu on a GPU machine)"
    )
