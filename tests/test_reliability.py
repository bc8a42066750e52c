"""Reliability: one validation pass over the job config, bad data, NaN/inf losses, a rank killed
mid-run and a checkpoint interrupted while being written (CPU, gloo).

The fault runs train the debug model with run_train.sh; faults come from outside (SIGKILL of a
rank's process) or from tests/fixtures/faults.py (a NaN loss, a kill inside DCP's save).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"
DEBUG_CONFIG = REPO / "train_configs" / "debug_model.toml"
STEP_LOG = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+).*?docs:\s*([0-9.,]+)")
SEQ_LEN, BATCH = 128, 2
SMALL = (
    "--training.seq_len", str(SEQ_LEN),
    "--training.local_batch_size", str(BATCH),
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--debug.seed", "7",
    "--debug.deterministic",
    "--sample.prompt", "",  # no sample at the end (tests/test_quickstart.py checks it)
)  # fmt: skip
FAULTS = ("--experimental.custom_import", "tests.fixtures.faults")

pytestmark = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="CPU runs (gloo); GPU runs live in tests/gpu"
)


# Helpers: runs, checkpoints, processes


@dataclass
class Run:
    code: int
    output: str
    steps: dict[int, tuple[str, str, str]]  # step -> printed (loss, grad_norm, documents)


def _start(dump: Path, *overrides: str, ngpu: int = 1, env=None) -> subprocess.Popen:
    """run_train.sh on the debug config, started in a process group of its own (as a
    terminal's foreground job is), its output (rank 0's log, then torchrun's) piped."""
    command = ["bash", "run_train.sh", "--job.dump_folder", str(dump), *SMALL, *overrides]
    environment = {
        **os.environ,
        "NGPU": str(ngpu),
        "CONFIG_FILE": str(DEBUG_CONFIG),
        "LOG_RANK": "0",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _launch(dump: Path, *overrides: str, ngpu: int = 1, env=None, on_line=None) -> Run:
    """run_train.sh on the debug config, to its end; `on_line(line, process)` sees each output
    line as it arrives (rank 0's log, then torchrun's)."""
    process = _start(dump, *overrides, ngpu=ngpu, env=env)
    watchdog = threading.Timer(300, os.killpg, (process.pid, signal.SIGKILL))
    watchdog.start()
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line, process)
        process.wait()
    finally:
        watchdog.cancel()
    output = "".join(lines)
    steps = {int(s): (loss, norm, docs) for s, loss, norm, docs in STEP_LOG.findall(output)}
    return Run(process.returncode, output, steps)


# The tests that launch runs: each test's runs one after the other, the tests side by side

# How many of them run at once: a run of one or two gloo ranks leaves much of two cores idle
# (the config check before torchrun is one process, then start-up and the ranks' waits for each
# other), and three keep both busy without queuing many ranks for a core.
SIDE_BY_SIDE = 3

# Test name -> its body, which `side_by_side_tests` starts.
_SIDE_BY_SIDE_BODIES: dict[str, Callable] = {}


def side_by_side(body: Callable) -> Callable:
    """`body` becomes the test of its name, run in a thread of `side_by_side_tests` beside the
    module's other such tests; the test fails as the body does (its assertion, with its values).
    The body may take `tmp_path` (a folder of its own) and `uninterrupted` (the Future of
    `_uninterrupted_run`'s result)."""
    _SIDE_BY_SIDE_BODIES[body.__name__] = body

    def test(side_by_side_tests: dict[str, Future]) -> None:
        side_by_side_tests[body.__name__].result()

    test.__name__ = test.__qualname__ = body.__name__
    test.__doc__ = body.__doc__
    return test


@pytest.fixture(scope="module")
def side_by_side_tests(request, tmp_path_factory):
    """{test name: Future of its body} for the selected `@side_by_side` tests, queued in the
    file's order when the first of them runs (a selection of one test starts that one alone)."""
    selected = [item.name for item in request.session.items if item.name in _SIDE_BY_SIDE_BODIES]
    parameters = {
        name: inspect.signature(_SIDE_BY_SIDE_BODIES[name]).parameters for name in selected
    }
    pool = ThreadPoolExecutor(SIDE_BY_SIDE)
    shared = {}
    if any("uninterrupted" in wanted for wanted in parameters.values()):
        # First in the queue: it starts before any body that waits for it holds a thread.
        dump = tmp_path_factory.mktemp("uninterrupted")
        shared["uninterrupted"] = pool.submit(_uninterrupted_run, dump)
    futures = {}
    for name in selected:
        arguments = {**shared, "tmp_path": tmp_path_factory.mktemp(name[:30])}
        futures[name] = pool.submit(
            _SIDE_BY_SIDE_BODIES[name], **{key: arguments[key] for key in parameters[name]}
        )
    try:
        yield futures
    finally:
        # A session stopped early (-x, Ctrl-C) starts no more bodies; those running finish.
        pool.shutdown(cancel_futures=True)


def _tensorboard_files(dump: Path) -> set[Path]:
    return set(dump.glob("tb/**/events.out.tfevents.*"))


def _tensorboard(files) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from TensorBoard event files (float32 values, as written)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(files):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                number = value.tensor.float_val[0] if value.HasField("tensor") else None
                number = value.simple_value if number is None else number
                scalars.setdefault(value.tag, {})[event.step] = number
    return scalars


def _checkpoint(folder: Path, scratch: Path) -> dict:
    """A DCP checkpoint folder read back whole (model, optimizer, dataloader, train_state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = scratch / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(str(folder), str(target))
    return torch.load(target, weights_only=False)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _rank_pid(root: int, rank: int) -> int | None:
    """The training process of `rank` among `root`'s descendants (torchrun gives each worker
    RANK and LOCAL_RANK in its environment)."""
    wanted = {f"RANK={rank}".encode(), f"LOCAL_RANK={rank}".encode()}
    queue = [root]
    while queue:
        pid = queue.pop(0)
        try:
            environment = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            environment = set()
        if wanted <= environment:
            return pid
        queue += _children(pid)
    return None


def _killed_by_sigkill(output: str, pid: int | None = None) -> bool:
    """torchrun reports a worker that died of SIGKILL (its failure line or its summary)."""
    process = r"\d+" if pid is None else str(pid)
    return (
        re.search(rf"exitcode\s*:\s*-9\)?\s+(local_rank: \d+ )?\(pid: {process}\)", output)
        is not None
    )


def _packed_dataset(dp_rank: int, dp_world_size: int):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_gdn.data import PackedDocumentDataset, build_document_source

    return PackedDocumentDataset(
        build_document_source("tinyshakespeare", None),
        HuggingFaceTokenizer(str(TOKENIZER)),
        seq_len=SEQ_LEN,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=True,
    )


def _assert_data_consumed_exactly(checkpoint: dict, steps: int, dp_world_size: int) -> None:
    """The checkpoint's loader position is exactly `steps` batches into each rank's stream: the
    batches before it were consumed once, and a resume continues with the next row."""
    loader_states = checkpoint["dataloader"]
    assert loader_states["world_size"] == dp_world_size
    for rank in range(dp_world_size):
        state = pickle.loads(loader_states[f"dp_rank_{rank}"])
        assert state["_num_yielded"] == steps, (rank, state["_num_yielded"], steps)
        reference = _packed_dataset(rank, dp_world_size)
        rows = iter(reference)
        assert len(list(itertools.islice(rows, steps * BATCH))) == steps * BATCH
        assert state["dataset_state"] == reference.state_dict(), rank
        resumed = _packed_dataset(rank, dp_world_size)
        resumed.load_state_dict(state["dataset_state"])
        (want_input, want_label), (got_input, got_label) = next(rows), next(iter(resumed))
        assert torch.equal(got_input["input"], want_input["input"]), rank
        assert torch.equal(got_label, want_label), rank


def _job_config(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(DEBUG_CONFIG), *args])


def _problems(job_config, world_size: int = 1) -> list[str]:
    from titan_gdn.validation import ConfigError, validate_job_config

    with pytest.raises(ConfigError) as error:
        validate_job_config(job_config, world_size)
    assert str(error.value).startswith(f"{len(error.value.problems)} problem(s)")
    return error.value.problems


def _one_problem_per_fragment(problems: list[str], fragments: list[str]) -> None:
    for fragment in fragments:
        matching = [problem for problem in problems if fragment in problem]
        assert len(matching) == 1, (fragment, problems)
    assert len(problems) == len(fragments), problems


# One validation pass over the whole job config


def test_every_problem_of_a_bad_config_is_reported_at_once(tmp_path):
    missing_data = tmp_path / "missing.txt"
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path),
        "--parallelism.context_parallel_degree", "3",
        # Head sharding, so that the heads' rules apply ("auto" would pass 3 sequence chunks).
        "--parallelism.context_parallel_mode", "heads",
        "--parallelism.tensor_parallel_degree", "2",
        "--training.seq_len", "130",
        "--training.global_batch_size", "5",
        "--training.dataset", "text",
        "--training.dataset_path", str(missing_data),
        "--training.skip_nonfinite_loss_steps", "-1",
        "--validation.enable",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
        "--checkpoint.keep_latest_k", "1",
        "--checkpoint.load_step", "7",
    )  # fmt: skip
    problems = _problems(job_config, world_size=4)
    _one_problem_per_fragment(
        problems,
        [
            "4 processes (NGPU x NNODES) cannot be split into groups of",
            "parallelism.tensor_parallel_degree = 2 is not supported",
            "training.global_batch_size = 5 is not a multiple of",
            "validation.enable = true is not supported",
            "training.seq_len = 130 is not divisible by parallelism.context_parallel_degree = 3",
            "linear_num_key_heads = 4 is not divisible",
            "linear_num_value_heads = 8 is not divisible",
            "n_heads = 4 is not divisible",
            "n_kv_heads = 2 can neither be split nor evenly repeated",
            f'training.dataset_path = "{missing_data}" does not exist',
            "checkpoint.keep_latest_k = 1",
            "checkpoint.last_save_in_hf = true exports only the model",
            "checkpoint.load_step = 7 but",
            "training.skip_nonfinite_loss_steps = -1 must be at least 0",
        ],
    )
    # Every message names the setting to change.
    setting = re.compile(r"\b(parallelism|training|validation|checkpoint|model)\.\w+|NGPU")
    assert all(setting.search(problem) for problem in problems), problems


@pytest.mark.parametrize(
    "config, world_size",
    [
        ("debug_model.toml", 1),
        ("debug_model.toml", 2),
        ("qwen3_5_0.8b.toml", 8),
        ("qwen3_5_2b_cp2.toml", 2),
        ("qwen3_5_0.8b_cp2.toml", 4),
    ],
)
def test_shipped_configs_pass_validation(config, world_size):
    from torchtitan.config import ConfigManager

    from titan_gdn.validation import validate_job_config

    # The configs' paths are relative to the checkout's root: the working directory
    # (conftest.py) has its train_configs and assets, and outputs of its own.
    job_config = ConfigManager().parse_args(["--job.config_file", f"train_configs/{config}"])
    assert job_config.training.skip_nonfinite_loss_steps == 0  # titan_gdn's settings merged in
    validate_job_config(job_config, world_size)


def test_world_size_that_does_not_fit_the_degrees_is_refused():
    job_config = _job_config("--parallelism.data_parallel_shard_degree", "2")
    _one_problem_per_fragment(
        _problems(job_config, world_size=3),
        ["the parallelism degrees multiply to 2 (data_parallel_shard_degree 2 x the others 1) "
         "but the job has 3 processes"],
    )  # fmt: skip


def test_cuda_graphs_are_refused_where_they_cannot_replay(monkeypatch):
    # As on a machine without GPUs wherever this runs, so that the list below is the same.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = ["--compile.cudagraphs", "--training.global_batch_size", "16"]
    problems = _problems(_job_config(*flags), world_size=2)
    _one_problem_per_fragment(
        problems,
        [
            'set compile.enable = true with "model" in compile.components',
            "compile.cudagraphs runs on one GPU only (2 processes)",
            "training.global_batch_size = 16 accumulates gradients over micro-batches of 4",
            "compile.cudagraphs with [sample] prompt",
            "compile.cudagraphs needs a CUDA GPU",
        ],
    )
    aot_eager_moe = _job_config(
        "--compile.cudagraphs", "--compile.enable", "--compile.backend", "aot_eager",
        "--model.flavor", "debugmoe", "--sample.prompt", "",
    )  # fmt: skip
    _one_problem_per_fragment(
        _problems(aot_eager_moe),
        [
            'compile.cudagraphs needs compile.backend = "inductor" (got "aot_eager")',
            "compile.cudagraphs is for dense flavors",
            "compile.cudagraphs needs a CUDA GPU",
        ],
    )


@pytest.mark.parametrize(
    "max_norm, effect",
    [
        ("0", "zeroes every gradient"),
        ("-1", "reverses every gradient"),
        ("nan", "makes every gradient NaN"),
    ],
)
def test_a_max_norm_that_is_not_positive_is_refused(max_norm, effect, tmp_path):
    """torchtitan scales the gradients by max_norm / norm: 0 would stop learning, a negative
    norm would climb the loss. No clipping is max_norm = inf."""
    job_config = _job_config("--job.dump_folder", str(tmp_path), "--training.max_norm", max_norm)
    (problem,) = _problems(job_config)
    assert problem.startswith(f"training.max_norm = {float(max_norm)} {effect}"), problem
    assert "or inf for no clipping" in problem


def test_lengths_torchtitan_takes_as_given_are_checked(tmp_path):
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path),
        "--training.steps", "-1",
        "--lr_scheduler.warmup_steps", "-5",
        "--lr_scheduler.total_steps", "0",
        "--metrics.log_freq", "0",
    )  # fmt: skip
    assert _problems(job_config) == [
        "training.steps = -1 must be at least 1",
        "lr_scheduler.warmup_steps = -5 must be at least 0 (0: no warm-up)",
        "lr_scheduler.total_steps = 0 must be at least 1, or unset (the schedule then spans "
        "training.steps)",
        "metrics.log_freq = 0 must be at least 1 (a line every N steps)",
    ]


def test_optimizer_settings_torch_or_torchtitan_would_refuse_per_rank_are_checked(tmp_path):
    """torch's Adam raises inside every rank for these, torchtitan for an unknown name; the
    schedule's factors and the optimizer in backward would train other than asked, silently
    (with the latter, the log showed grad_norm 0.0000 and nothing was clipped)."""
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path),
        "--optimizer.name", "SGD",
        "--optimizer.lr", "-0.001",
        "--optimizer.eps", "nan",
        "--optimizer.weight_decay", "-0.1",
        "--optimizer.beta1", "1.0",
        "--optimizer.beta2", "-0.5",
        "--optimizer.early_step_in_backward",
        "--lr_scheduler.min_lr_factor", "2",
        "--lr_scheduler.decay_ratio", "-0.2",
    )  # fmt: skip
    assert _problems(job_config) == [
        "optimizer.name = 'SGD' is not an optimizer torchtitan builds: use 'AdamW' or 'Adam'",
        "optimizer.lr = -0.001 must be at least 0",
        "optimizer.eps = nan must be at least 0",
        "optimizer.weight_decay = -0.1 must be at least 0",
        "optimizer.beta1 = 1.0 must be in [0, 1) (the weight of the past in the moving average)",
        "optimizer.beta2 = -0.5 must be in [0, 1) (the weight of the past in the moving average)",
        "optimizer.early_step_in_backward = true steps each parameter inside backward, before "
        "the gradients are clipped (training.max_norm) or checked for NaN/inf: clipping would "
        "be skipped and a NaN gradient would reach the weights; set it to false",
        "lr_scheduler.min_lr_factor = 2.0 must be in [0, 1]: the learning rate decays from "
        "optimizer.lr to optimizer.lr x min_lr_factor",
        "lr_scheduler.decay_ratio = -0.2 must be in [0, 1] (the part of the schedule that "
        "decays, at its end), or unset (decay right after warm-up)",
    ]
    edges = ("--optimizer.lr", "0", "--optimizer.beta1", "0", "--lr_scheduler.decay_ratio", "1")
    from titan_gdn.validation import validate_job_config

    validate_job_config(_job_config("--job.dump_folder", str(tmp_path), *edges), world_size=1)


@pytest.mark.parametrize(
    "overrides, problems",
    [
        (
            ("--activation_checkpoint.mode", "selective",
             "--activation_checkpoint.selective_ac_option", "foo"),
            ["activation_checkpoint.selective_ac_option = 'foo' is neither \"op\""],
        ),
        (
            ("--activation_checkpoint.mode", "selective",
             "--activation_checkpoint.selective_ac_option", "0"),
            ["activation_checkpoint.selective_ac_option = '0' is neither \"op\""],
        ),
        (
            ("--activation_checkpoint.mode", "memory_budget", "--compile.no-enable"),
            ['activation_checkpoint.mode = "memory_budget" is applied by the compiler'],
        ),
        (
            ("--activation_checkpoint.mode", "memory_budget", "--compile.enable",
             "--activation_checkpoint.memory_budget", "1.5"),
            ["activation_checkpoint.memory_budget = 1.5 must be in [0, 1]"],
        ),
        (
            ("--compile.enable", "--compile.backend", "nosuch"),
            ["compile.backend = 'nosuch' is not a torch.compile backend; use \"inductor\""],
        ),
        (
            ("--parallelism.expert_parallel_comm_backend", "deepep"),
            ["parallelism.expert_parallel_comm_backend = 'deepep' is not supported"],
        ),
    ],
)  # fmt: skip
def test_settings_torchtitan_would_refuse_per_rank_after_the_build_are_checked(
    overrides, problems, tmp_path
):
    """Each of these failed on every rank after the model was built (a traceback per rank) or,
    for deepep, trained without it."""
    job_config = _job_config("--job.dump_folder", str(tmp_path), *overrides)
    found = _problems(job_config)
    assert len(found) == len(problems), found
    for problem, start in zip(found, problems, strict=True):
        assert problem.startswith(start), problem


@pytest.mark.parametrize(
    "overrides",
    [
        ("--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "op"),
        ("--activation_checkpoint.mode", "selective",
         "--activation_checkpoint.selective_ac_option", "3"),
        ("--activation_checkpoint.mode", "memory_budget", "--compile.enable"),
        ("--compile.enable", "--compile.backend", "aot_eager"),
    ],
)  # fmt: skip
def test_valid_checkpointing_and_compile_settings_pass(overrides, tmp_path):
    from titan_gdn.validation import validate_job_config

    validate_job_config(_job_config("--job.dump_folder", str(tmp_path), *overrides), 1)


def test_max_norm_inf_trains_without_clipping(tmp_path):
    from torchtitan.distributed.utils import clip_grad_norm_

    from titan_gdn.validation import validate_job_config

    job_config = _job_config("--job.dump_folder", str(tmp_path), "--training.max_norm", "inf")
    validate_job_config(job_config, world_size=1)
    parameters = [torch.nn.Parameter(torch.randn(7, 3)) for _ in range(2)]
    gradients = [1e3 * torch.randn(7, 3) for _ in parameters]
    for parameter, gradient in zip(parameters, gradients, strict=True):
        parameter.grad = gradient.clone()
    norm = clip_grad_norm_(parameters, float("inf"), foreach=True)
    torch.testing.assert_close(norm, torch.cat([g.flatten() for g in gradients]).norm())
    assert all(torch.equal(p.grad, g) for p, g in zip(parameters, gradients, strict=True))


def test_a_tokenizer_with_ids_beyond_the_vocab_is_refused(tmp_path):
    # A tokenizer of 2020 tokens whose EOS sits at id 3000: its size fits the model's 2048
    # rows, its ids do not.
    shutil.copytree(TOKENIZER, tmp_path / "tokenizer")
    tokenizer_file = tmp_path / "tokenizer" / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text())
    spec["model"]["vocab"]["<|end_of_text|>"] = 3000
    tokenizer_file.write_text(json.dumps(spec))
    job_config = _job_config("--model.hf_assets_path", str(tmp_path / "tokenizer"))
    _one_problem_per_fragment(
        _problems(job_config),
        ["has 2020 tokens with ids up to 3000 but the model's vocab_size is 2048: the "
         "tokenizer does not belong to model.flavor = 'debugmodel'"],
    )  # fmt: skip


def test_checkpoint_settings_that_torchtitan_would_trip_over_late(tmp_path):
    hf_folder = tmp_path / "hf"  # no safetensors in it
    hf_folder.mkdir()
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path / "run"),
        "--checkpoint.enable",
        "--checkpoint.interval", "0",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.no-initial-load-model-only",
        "--checkpoint.initial_load_path", str(hf_folder),
    )  # fmt: skip
    # As a TOML file may say it (the command line's parser checks the choice, TOML's does not).
    job_config.checkpoint.async_mode = "sometimes"
    _one_problem_per_fragment(
        _problems(job_config),
        [
            "checkpoint.interval = 0 must be at least 1",
            "checkpoint.async_mode = 'sometimes'",
            "checkpoint.initial_load_in_hf = true loads only the model",
            f"checkpoint.initial_load_in_hf = true but checkpoint.initial_load_path = "
            f"'{hf_folder}' has no *.safetensors",
        ],
    )
    # The debug config checkpoints its last step; here checkpointing is off.
    disabled = _job_config(
        "--checkpoint.no-enable", "--checkpoint.initial_load_path", str(hf_folder)
    )
    ignored = f"checkpoint.initial_load_path = '{hf_folder}' has no effect while checkpoint"
    _one_problem_per_fragment(_problems(disabled), [ignored])


def _fake_step(folder: Path, step: int, complete: bool, marker: str = ".metadata") -> None:
    step_folder = folder / f"step-{step}"
    step_folder.mkdir(parents=True)
    (step_folder / "__0_0.distcp").write_bytes(os.urandom(64))
    if complete:
        (step_folder / marker).write_bytes(os.urandom(16))


def test_complete_checkpoints_are_those_torchtitan_resumes_from(tmp_path):
    from torchtitan.components.checkpoint import CheckpointManager

    from titan_gdn.checkpoint_folders import checkpoint_steps

    folder = tmp_path / "checkpoint"
    steps = random.Random().sample(range(1, 1000), 5)
    complete = sorted(steps[:3])
    for step in steps:
        _fake_step(folder, step, complete=step in complete)
    assert checkpoint_steps(folder) == (complete, sorted(steps[3:]))
    # torchtitan 0.2.2's own choice when resuming (CheckpointManager.load with step -1).
    find_load_step = CheckpointManager._find_load_step
    assert find_load_step(SimpleNamespace(folder=str(folder))) == complete[-1]
    newest = max(steps) + 1
    _fake_step(folder, newest, complete=True, marker="model.safetensors.index.json")
    assert checkpoint_steps(folder)[0][-1] == newest
    assert find_load_step(SimpleNamespace(folder=str(folder))) == newest


def test_an_interrupted_first_save_does_not_silently_drop_the_initial_weights(tmp_path):
    seed = tmp_path / "seed" / "step-0"
    _fake_step(seed.parent, 0, complete=True)
    _fake_step(tmp_path / "run" / "checkpoint", 10, complete=False)
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path / "run"),
        "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(seed),
        "--checkpoint.load_step", "10",
    )  # fmt: skip
    _one_problem_per_fragment(
        _problems(job_config),
        [
            "checkpoint.load_step = 10 but",
            "exists but holds no complete checkpoint (interrupted: step-10)",
        ],
    )


def test_resuming_with_other_data_parallel_ranks_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from titan_gdn.validation import validate_job_config

    job_config = _job_config("--job.dump_folder", str(tmp_path), "--checkpoint.enable")
    ranks = random.randint(2, 8)
    # A step the run resumes from: a checkpoint at or past training.steps is a finished run.
    step = random.randint(1, job_config.training.steps - 1)
    saved = {"dataloader": {"world_size": ranks, "dp_rank_0": b"position"}} | _model_state()
    dcp.save(saved, checkpoint_id=str(tmp_path / "checkpoint" / f"step-{step}"), no_dist=True)
    validate_job_config(job_config, world_size=ranks)  # the same ranks resume
    _one_problem_per_fragment(
        _problems(job_config, world_size=ranks - 1),
        [f"step-{step}, written by {ranks} data-parallel ranks, with {ranks - 1}"],
    )


def _model_state(flavor: str = "debugmodel") -> dict[str, torch.Tensor]:
    """The state dict of `flavor`'s model with random values (its keys and shapes)."""
    from titan_gdn.checkpoint_folders import expected_shapes
    from titan_gdn.model import qwen3_5_args

    return {key: torch.randn(shape) for key, shape in expected_shapes(qwen3_5_args[flavor]).items()}


def _saved_step(folder: Path, step: int, model_only: bool, flavor: str = "debugmodel") -> Path:
    """A DCP step folder as the trainer writes it: the model of `flavor`, and (unless
    `model_only`) the training state a resume loads."""
    import torch.distributed.checkpoint as dcp

    state = _model_state(flavor)
    if not model_only:
        state |= {
            "optimizer": {"state": {"norm.weight": {"step": torch.tensor(1.0)}}},
            "lr_scheduler": {"last_epoch": step},
            "dataloader": {"world_size": 1, "dp_rank_0": b"position"},
            "train_state": {"step": step, "ntokens_seen": 0},
        }
    path = folder / f"step-{step}"
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def test_resuming_from_a_checkpoint_that_holds_only_the_model_is_refused(tmp_path):
    """A model-only last save (the 0.8B/2B configs' last_save_model_only) or an HF export cannot
    be resumed: torchtitan failed with a missing key or a missing .metadata."""
    from titan_gdn.validation import validate_job_config

    folder = tmp_path / "checkpoint"
    _saved_step(folder, 3, model_only=False)
    model_only = _saved_step(folder, 6, model_only=True)
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--training.steps", "9"
    )  # fmt: skip
    (problem,) = _problems(job_config)
    assert problem == (
        f"{model_only} holds only the model (checkpoint.last_save_model_only = true), not the "
        "optimizer, learning-rate schedule, data position and step a resume loads; to train on "
        "from these weights, start a new run (a new job.dump_folder) with "
        f"checkpoint.initial_load_path = '{model_only}', or resume from an earlier step with "
        "checkpoint.load_step (complete: [3])"
    )
    # Not loading what it lacks is a resume torchtitan can do.
    excluded = copy.deepcopy(job_config)
    excluded.checkpoint.exclude_from_loading = [
        "optimizer", "lr_scheduler", "dataloader", "train_state"
    ]  # fmt: skip
    validate_job_config(excluded, world_size=1)

    export = folder / "step-7"
    export.mkdir()
    (export / "model.safetensors.index.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"")
    (problem,) = _problems(job_config)
    assert problem.startswith(
        f"{export} holds only the model (a Hugging Face export, checkpoint.last_save_in_hf = "
        "true), not the optimizer"
    )
    assert (
        f"checkpoint.initial_load_path = '{export}' and checkpoint.initial_load_in_hf = true, "
        "or resume from an earlier step with checkpoint.load_step (complete: [3, 6])"
    ) in problem


def test_a_checkpoint_of_another_model_is_named_before_anything_is_built(tmp_path):
    """A resume or an initial load from a DCP checkpoint of another flavor (or config.json)
    stopped each rank with torchtitan's `Missing key in checkpoint state_dict` or a size
    mismatch, once the model was built and sharded."""
    other = "debugmoe"
    folder = _saved_step(tmp_path / "run" / "checkpoint", 3, model_only=False, flavor=other)
    resume = _job_config("--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable")
    (problem,) = _problems(resume)
    assert problem.startswith(f"{folder} holds another model than model.flavor = 'debugmodel': ")
    assert problem.endswith(
        f"(model.flavor = '{other}' fits it); resume with the model.flavor it was trained "
        "with, or set a new job.dump_folder for a new run"
    )
    initial = _job_config(
        "--job.dump_folder", str(tmp_path / "new"), "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(folder),
    )  # fmt: skip
    (problem,) = _problems(initial)
    assert problem.endswith(
        f"(model.flavor = '{other}' fits it); point checkpoint.initial_load_path at a "
        "checkpoint of this model, or set model.flavor to the one it holds"
    )
    from titan_gdn.validation import validate_job_config

    for job_config in (resume, initial):
        job_config.model.flavor = other
        validate_job_config(job_config, world_size=1)

    # One weight of another shape: named with both shapes.
    state = _model_state()
    key = random.choice(sorted(state))
    state[key] = torch.randn(*[size + 1 for size in state[key].shape])
    import torch.distributed.checkpoint as dcp

    reshaped = tmp_path / "reshaped" / "checkpoint" / "step-2"
    dcp.save(state, checkpoint_id=str(reshaped), no_dist=True)
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path / "reshaped"), "--checkpoint.enable",
        "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler,dataloader,train_state",
    )  # fmt: skip
    (problem,) = _problems(job_config)
    shape, expected = list(state[key].shape), [size - 1 for size in state[key].shape]
    assert f": {key} is {shape} there but {expected} in the model; resume" in problem, problem


def test_a_disk_without_room_for_a_checkpoint_is_named_before_training(tmp_path, monkeypatch):
    """The first save would fail after training up to it (DCP's `enforce fail at
    inline_container.cc`, per rank); the disk's free space is checked first."""
    import shutil

    from titan_gdn.validation import checkpoint_size, validate_job_config

    job_config = _job_config("--job.dump_folder", str(tmp_path / "a" / "b"), "--checkpoint.enable")
    needed, parameters, _ = checkpoint_size(job_config)
    seen = []

    def disk_with(free: int):
        def disk_usage(path):
            seen.append(Path(path))
            return shutil._ntuple_diskusage(10 * needed, 10 * needed - free, free)

        return disk_usage

    monkeypatch.setattr(shutil, "disk_usage", disk_with(needed))
    validate_job_config(job_config, world_size=1)
    assert seen == [tmp_path]  # the folder to be, on the disk of its nearest existing parent
    monkeypatch.setattr(shutil, "disk_usage", disk_with(needed - 1))
    (problem,) = _problems(job_config)
    assert problem.startswith(f"job.dump_folder = '{tmp_path / 'a' / 'b'}' is on a disk with ")
    assert f"({parameters:,} parameters: fp32 weights and AdamW's two moments)" in problem
    assert problem.endswith(
        "its first save would fail; free space, point job.dump_folder at a larger disk, or set "
        "checkpoint.enable = false"
    )
    # A run whose only save is the last step's weights, in bf16, needs a sixth of it.
    model_only = _job_config(
        "--job.dump_folder", str(tmp_path), "--checkpoint.enable",
        "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only",
        "--checkpoint.export_dtype", "bfloat16",
    )  # fmt: skip
    smaller, _, what = checkpoint_size(model_only)
    assert what == "bfloat16 weights" and smaller < needed / 5
    monkeypatch.setattr(shutil, "disk_usage", disk_with(smaller))
    validate_job_config(model_only, world_size=1)
    monkeypatch.setattr(shutil, "disk_usage", disk_with(0))
    no_saves = _job_config("--job.dump_folder", str(tmp_path), "--checkpoint.no-enable")
    validate_job_config(no_saves, world_size=1)


def test_a_run_whose_checkpoint_is_at_or_past_training_steps_is_named_finished(tmp_path):
    from titan_gdn.validation import validate_job_config

    step = random.randint(2, 50)
    folder = _saved_step(tmp_path / "checkpoint", step, model_only=False)
    for steps in (step, step - 1):
        job_config = _job_config(
            "--job.dump_folder", str(tmp_path), "--training.steps", str(steps)
        )  # fmt: skip
        assert _problems(job_config) == [
            f"{folder} is step {step}, at or past training.steps = {steps}: the run in "
            f"job.dump_folder = '{tmp_path}' is finished and would train nothing; raise "
            f"training.steps above {step} to train on, or set a new job.dump_folder for a new run"
        ]
    validate_job_config(_job_config("--job.dump_folder", str(tmp_path)), world_size=1)


@side_by_side
def test_rerunning_a_finished_run_says_what_to_change(tmp_path):
    """The same command again trains nothing: it says so instead of "Training completed".
    With more steps, a last checkpoint of only the model is named, not a KeyError."""
    model_only = ("--checkpoint.enable", "--checkpoint.last_save_model_only")
    first = _launch(tmp_path, "--training.steps", "3", *model_only)
    assert first.code == 0 and sorted(first.steps) == [1, 2, 3], first.output[-6000:]
    folder = tmp_path / "checkpoint" / "step-3"
    again = _launch(tmp_path, "--training.steps", "3", *model_only)
    assert again.code == 1 and not again.steps, again.output[-6000:]
    assert f"{folder} is step 3, at or past training.steps = 3" in again.output
    assert "Training completed" not in again.output
    longer = _launch(tmp_path, "--training.steps", "5", *model_only)
    assert longer.code == 1 and not longer.steps, longer.output[-6000:]
    assert f"{folder} holds only the model (checkpoint.last_save_model_only = true)" in (
        longer.output
    )
    assert "Traceback" not in again.output + longer.output


@side_by_side
def test_a_resume_onto_a_longer_schedule_says_so(tmp_path):
    """training.steps sets the schedule's length: 4 steps continued to 6 train steps 5-6 on
    another curve than an uninterrupted 6-step run, and the log says so."""
    full = ("--checkpoint.enable", "--checkpoint.no-last-save-model-only")
    warmup = ("--lr_scheduler.warmup_steps", "2")
    first = _launch(tmp_path, "--training.steps", "4", *full, *warmup)
    assert first.code == 0, first.output[-6000:]
    longer = _launch(tmp_path, "--training.steps", "6", *full, *warmup)
    assert longer.code == 0 and sorted(longer.steps) == [5, 6], longer.output[-6000:]
    assert (
        "The learning-rate schedule is not the one the checkpoint of step 4 was trained with "
        "(training.steps or [lr_scheduler] changed): step 5 trains at lr "
    ) in longer.output
    assert "set lr_scheduler.total_steps to its final length" in longer.output


def test_an_hf_import_that_would_leave_tensors_out_is_refused(hf_qwen3_5, tmp_path):
    """config.json asking for 2 of the checkpoint's 4 layers loaded a cut-down model: the import
    reads the tensors the model asks for and never looks at the others."""
    from safetensors.torch import load_file, save_file

    from tests.hf_reference import hf_import_arguments, random_hf_model, tiny_hf_config
    from titan_gdn.validation import validate_job_config

    source = tmp_path / "hf"
    config = tiny_hf_config(tied=True, vocab_size=2048)
    random_hf_model(hf_qwen3_5, config, seed=3).save_pretrained(source, safe_serialization=True)
    shutil.copytree(TOKENIZER, source, dirs_exist_ok=True)
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path / "run"),
        *hf_import_arguments(source),
    )  # fmt: skip
    validate_job_config(job_config, world_size=1)  # the checkpoint's own config.json

    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    (problem,) = _problems(job_config)
    weights = load_file(source / "model.safetensors")
    unused = sorted(name for name in weights if re.match(r"model\.layers\.[23]\.", name))
    assert problem == (
        f"checkpoint.initial_load_path = '{source}' holds {len(unused)} tensor(s) that "
        "model.flavor = 'from_hf_config' does not use, which an HF import leaves out without a "
        f"word: {', '.join(unused[:3])}, ... ({len(unused) - 3} more); it has layers up to 3 "
        "and the model 2 (n_layers, num_hidden_layers in config.json); use the checkpoint's "
        'own config.json (model.flavor = "from_hf_config" with model.hf_assets_path at its '
        "folder)"
    )

    # A tensor of a name the model does not have, in a checkpoint of the right depth.
    (source / "config.json").write_text(json.dumps(config))
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, source / "extra.safetensors")
    (problem,) = _problems(job_config)
    assert "holds 1 tensor(s) that model.flavor = 'from_hf_config' does not use" in problem
    assert "word: model.layers.0.mlp.extra.weight; use the checkpoint's own" in problem


def test_bad_settings_stop_the_trainer_before_anything_is_built(tmp_path):
    run = _launch(
        tmp_path,
        "--training.seq_len", "131073",
        "--training.dataset", "jsonl",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
        "--training.skip_nonfinite_loss_steps", "-2",
    )  # fmt: skip
    assert run.code != 0, run.output[-6000:]
    assert "4 problem(s) in the job config; nothing was built or trained" in run.output
    for fragment in (
        "training.seq_len = 131073 exceeds the model's max_seq_len = 131072",
        'training.dataset = "jsonl" needs training.dataset_path',
        "checkpoint.last_save_in_hf = true exports only the model",
        "training.skip_nonfinite_loss_steps = -2 must be at least 0",
    ):
        assert fragment in run.output, (fragment, run.output[-6000:])
    # Raised before torchtitan's init: no process group, tokenizer, loader or model.
    for later in ("Building", "Training starts", "Packed training data"):
        assert later not in run.output, run.output[-6000:]


def test_a_config_error_on_two_ranks_is_shown_once_without_tracebacks(tmp_path):
    """With LOG_RANK=0 the console shows rank 0 only, and rank 1 could fail first: the check
    runs once before torchrun starts the ranks."""
    run = _launch(
        tmp_path,
        "--parallelism.context_parallel_degree", "2",
        "--training.seq_len", "255",
        ngpu=2,
    )  # fmt: skip
    assert run.code == 1, run.output[-6000:]
    assert run.output.splitlines() == [
        "1 problem(s) in the job config; nothing was built or trained:",
        "  - training.seq_len = 255 is not divisible by parallelism.context_parallel_degree = 2;"
        " use a multiple of 2",
    ], run.output[-6000:]


def test_a_config_error_in_a_rank_is_its_message_without_a_traceback(tmp_path):
    """Launched without run_train.sh (python or torchrun), the trainer's own check reports."""
    command = [sys.executable, "-m", "titan_gdn.train", "--job.config_file", str(DEBUG_CONFIG)]
    command += ["--job.dump_folder", str(tmp_path), "--training.seq_len", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr[-6000:]
    assert "training.seq_len = 0 must be at least 1" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-6000:]


def test_wandb_that_is_missing_or_cannot_start_stops_the_run_before_training(tmp_path, monkeypatch):
    """torchtitan logged `Failed to create WandB logger` and trained on without it: the
    metrics a user asked for were lost. wandb missing is named by the config check; one that
    is installed but fails to start (here a stand-in whose init raises, as an unconfigured
    login does) stops the rank with one message."""
    import importlib.util

    job_config = _job_config("--job.dump_folder", str(tmp_path), "--metrics.enable_wandb")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a),
    )
    assert _problems(job_config) == [
        "metrics.enable_wandb = true, but wandb is not installed: `pip install wandb` (and "
        "`wandb login`, or WANDB_MODE=offline to log to disk), or leave it off"
    ]
    monkeypatch.undo()

    stand_in = tmp_path / "stand_in" / "wandb"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        "def init(**kwargs):\n    raise RuntimeError('api_key not configured (no-tty)')\n"
    )
    path = os.pathsep.join([str(stand_in.parent), os.environ.get("PYTHONPATH", "")])
    run = _launch(tmp_path / "run", "--metrics.enable_wandb", env={"PYTHONPATH": path})
    assert run.code == 1 and not run.steps, run.output[-6000:]
    assert "Failed to create WandB logger: api_key not configured (no-tty)" in run.output
    assert (
        "metrics.enable_wandb = true, but W&B did not start (the `Failed to create WandB logger` "
        "line above says why): fix that (e.g. `wandb login`, or WANDB_MODE=offline to log to "
        "disk), or leave metrics.enable_wandb off. Nothing was trained."
    ) in run.output, run.output[-6000:]
    assert "Traceback" not in run.output, run.output[-6000:]


# Bad data


def test_token_ids_outside_the_vocab_stop_with_the_mismatch_named():
    from torchtitan.components.loss import IGNORE_INDEX

    from titan_gdn.data.vocab_check import TokenIdError, check_token_ids

    vocab = int(torch.randint(100, 5000, ()).item())
    inputs = torch.randint(0, vocab, (3, 64))
    labels = torch.randint(0, vocab, (3, 64))
    labels[torch.rand(3, 64) < 0.2] = IGNORE_INDEX  # ignored positions are no token ids
    check_token_ids(inputs, labels, vocab, "debugmodel", "./tok")

    row, column = int(torch.randint(3, ())), int(torch.randint(64, ()))
    bad_id = vocab + int(torch.randint(0, 1000, ()))
    too_large = inputs.clone()
    too_large[row, column] = bad_id
    with pytest.raises(TokenIdError) as error:
        check_token_ids(too_large, labels, vocab, "debugmodel", "./tok")
    message = str(error.value)
    assert f"input token id {bad_id}" in message and f"vocab_size = {vocab}" in message
    assert "model.hf_assets_path = './tok'" in message and "model.flavor = 'debugmodel'" in message
    negative = labels.clone()
    negative[row, column] = -1
    with pytest.raises(TokenIdError, match="label token id -1"):
        check_token_ids(inputs, negative, vocab, "debugmodel", "./tok")


def test_the_trainer_checks_every_batch_before_it_reaches_the_model():
    from titan_gdn.data.vocab_check import TokenIdError
    from titan_gdn.trainer import Qwen35Trainer

    trainer = SimpleNamespace(
        model_args=SimpleNamespace(vocab_size=2048),
        job_config=SimpleNamespace(
            model=SimpleNamespace(flavor="debugmodel", hf_assets_path="./assets/tokenizer")
        ),
    )
    good = [({"input": torch.randint(0, 2048, (2, 8))}, torch.randint(0, 2048, (2, 8)))] * 2
    bad = ({"input": torch.full((2, 8), 2048)}, torch.zeros(2, 8, dtype=torch.long))
    checked = Qwen35Trainer._checked_token_ids(trainer, [*good, bad])
    assert list(itertools.islice(checked, 2)) == good
    with pytest.raises(TokenIdError, match="input token id 2048"):
        next(checked)


def _random_documents(rng: random.Random, count: int) -> list[str]:
    words = "so shaken as we are so wan with care find we a time for frighted peace".split()
    return [" ".join(rng.choices(words, k=rng.randint(1, 40))) for _ in range(count)]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def _dataset(path: Path, infinite: bool, seq_len: int = 32):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_gdn.data import PackedDocumentDataset, build_document_source

    tokenizer = HuggingFaceTokenizer(str(TOKENIZER))
    source = build_document_source("jsonl", str(path))
    return PackedDocumentDataset(source, tokenizer, seq_len=seq_len, infinite=infinite), tokenizer


def _stream(dataset) -> list[int]:
    return [t for inputs, labels in dataset for t in [*inputs["input"].tolist(), labels[-1].item()]]


def test_empty_documents_are_skipped_not_trained_on(tmp_path):
    rng = random.Random()
    texts = _random_documents(rng, 30)
    with_empty = list(texts)
    for blank in ["", "   ", "\n\t", "", " "]:
        with_empty.insert(rng.randint(0, len(with_empty)), blank)
    dataset, tokenizer = _dataset(_jsonl(tmp_path / "docs.jsonl", with_empty), infinite=False)
    stream = _stream(dataset)
    expected = [t for text in texts for t in tokenizer.encode(text, add_bos=True, add_eos=True)]
    row = 33
    assert stream == expected[: len(expected) // row * row]
    assert len(stream) >= row
    # An empty document would have packed as BOS right before EOS.
    pairs = set(zip(stream, stream[1:], strict=False))
    assert (tokenizer.bos_id, tokenizer.eos_id) not in pairs


def test_a_corpus_of_only_empty_documents_fails_instead_of_spinning(tmp_path):
    dataset, _ = _dataset(_jsonl(tmp_path / "blank.jsonl", ["", " ", "\n"]), infinite=True)

    def spinning(*_):
        raise TimeoutError("the loader kept reading empty epochs")

    previous = signal.signal(signal.SIGALRM, spinning)
    signal.alarm(30)
    try:
        with pytest.raises(ValueError, match="has only empty documents for dp rank 0"):
            next(iter(dataset))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_document_longer_than_a_row_is_split_and_a_row_without_eos_is_one_document(tmp_path):
    from titan_gdn.boundaries import DocumentBoundaries

    rng = random.Random()
    seq_len = 32
    long_text = " ".join(_random_documents(rng, 40))
    short = _random_documents(rng, 3)
    dataset, tokenizer = _dataset(
        _jsonl(tmp_path / "long.jsonl", [long_text, *short]), infinite=False, seq_len=seq_len
    )
    long_tokens = tokenizer.encode(long_text, add_bos=True, add_eos=True)
    assert len(long_tokens) > 4 * (seq_len + 1)
    rows = [torch.cat([inputs["input"], labels[-1:]]) for inputs, labels in dataset]
    # Split, not truncated: consecutive rows continue the document token for token.
    assert torch.cat(rows).tolist()[: len(long_tokens)] == long_tokens
    inside = [row for row in rows[1:] if tokenizer.eos_id not in row.tolist()]
    assert len(inside) >= 3
    # A row inside the document has no EOS: it is one document, starting at the row start.
    inputs = torch.stack([row[:-1] for row in inside])
    docs = DocumentBoundaries.from_tokens(inputs, tokenizer.eos_id)
    assert docs.cu_seqlens.tolist() == [i * seq_len for i in range(len(inside) + 1)]
    assert torch.equal(docs.position_ids, torch.arange(seq_len).expand(len(inside), -1))


# NaN / inf losses


def test_nonfinite_loss_guard_decides_after_the_last_micro_batch():
    from titan_gdn.loss_guard import NonFiniteLossError, NonFiniteLossGuard

    parameter = torch.nn.Parameter(torch.randn(4))
    guard = NonFiniteLossGuard(max_skips=0, resume_hint=lambda: "the same command resumes from x")
    for step in (1, 2):
        parameter.grad = torch.randn(4)
        for loss in torch.randn(3):
            guard.record(loss)
            guard.after_backward(step, 3, lambda: [parameter])
        assert parameter.grad is not None
    bad = float(random.choice(["nan", "inf", "-inf"]))
    guard.record(torch.tensor(bad))
    guard.after_backward(3, 2, lambda: [parameter])  # first micro-batch: no decision yet
    guard.record(torch.tensor(1.0))
    with pytest.raises(NonFiniteLossError) as error:
        guard.after_backward(3, 2, lambda: [parameter])
    message = str(error.value)
    assert message.startswith("Training stopped at step 3: the loss is NaN or infinite")
    assert "this step was not applied; the same command resumes from x. To get" in message
    assert "training.skip_nonfinite_loss_steps = N (now 0)" in message


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_gradient_of_a_finite_loss_is_not_applied(fused):
    """Fused AdamW skips on the device (`found_inf`), and the host learns of it at the next
    step or `settle`; another implementation is told at once (its gradients dropped)."""
    from titan_gdn.loss_guard import NonFiniteLossError, NonFiniteLossGuard

    parameters = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    optimizer = torch.optim.AdamW(parameters, lr=0.1, fused=fused, foreach=not fused)
    guard = NonFiniteLossGuard(max_skips=1, resume_hint=lambda: "a rerun starts at step 1")

    def step(number: int, bad: bool) -> None:
        for parameter in parameters:
            parameter.grad = torch.randn_like(parameter)
        if bad:
            parameters[random.randrange(2)].grad.view(-1)[0] = random.choice([math.inf, math.nan])
        guard.record(torch.tensor(1.0))  # a finite loss
        guard.after_backward(number, 1, lambda: parameters, [optimizer])
        optimizer.step()

    step(1, bad=False)
    before = [p.detach().clone() for p in parameters]
    moments = {k: v.clone() for k, v in optimizer.state[parameters[0]].items()}
    step(2, bad=True)
    guard.settle()  # skipped: 1 in a row is allowed
    assert guard.skipped_in_a_row == 1
    assert all(torch.equal(b, p) for b, p in zip(before, parameters, strict=True))
    assert all(torch.equal(v, optimizer.state[parameters[0]][k]) for k, v in moments.items())
    step(3, bad=False)
    guard.settle()
    assert guard.skipped_in_a_row == 0
    assert not torch.equal(before[0], parameters[0])
    assert all(torch.isfinite(p).all() for p in parameters)
    with pytest.raises(NonFiniteLossError) as error:
        step(4, bad=True)
        step(5, bad=True)  # the fused path learns of step 4 here, then of step 5 at settle
        guard.settle()
    assert str(error.value).startswith(
        "Training stopped at step 5: the gradient is NaN or infinite, the loss finite"
    )


def _run_with_bad_steps(tmp_path: Path, fault: str, *overrides: str) -> tuple[Path, Run]:
    """2 ranks, 6 steps, one bad step in a row skipped, a checkpoint each step; the fault
    (`tests/fixtures/faults.py`, `{fault}_STEPS`) at steps 2, 4 and 5 on rank 1 only, whose
    log is not the one read: rank 0 must skip and stop with it."""
    dump = tmp_path / "run"
    run = _launch(
        dump,
        *FAULTS,
        "--training.steps", "6",
        "--training.skip_nonfinite_loss_steps", "1",
        *overrides,
        "--checkpoint.enable",
        "--checkpoint.interval", "1",
        "--checkpoint.no-last-save-model-only",
        ngpu=2,
        env={f"{fault}_STEPS": "2,4,5", f"{fault}_RANK": "1"},
    )  # fmt: skip
    assert run.code != 0, run.output[-6000:]
    return dump, run


def _assert_the_skipped_steps_changed_nothing(dump: Path, tmp_path: Path) -> None:
    """Checkpoints 1-4 exist and none after; the skipped steps 2 and 4 changed neither the
    weights nor the optimizer's moments and step counts, step 3 trained, nothing went
    non-finite."""
    from titan_gdn.checkpoint_folders import checkpoint_steps

    assert checkpoint_steps(dump / "checkpoint") == ([1, 2, 3, 4], [])
    state = {
        step: _checkpoint(dump / "checkpoint" / f"step-{step}", tmp_path) for step in range(1, 5)
    }
    weights = {step: _tensors(s) for step, s in state.items()}
    moments = {step: _tensors(s["optimizer"], only="state.") for step, s in state.items()}
    assert len(weights[1]) > 10 and len(moments[1]) > 10
    for before, after in ((1, 2), (3, 4)):
        for kept in (weights, moments):
            assert kept[before].keys() == kept[after].keys()
            assert all(torch.equal(kept[before][k], kept[after][k]) for k in kept[before])
    assert not all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])
    assert all(torch.isfinite(w).all() for s in (weights, moments) for w in s[4].values())


@side_by_side
def test_steps_with_an_infinite_gradient_are_skipped_by_the_fused_optimizer(tmp_path):
    """A finite loss with an infinite gradient: the fused optimizer skips it on the device, and
    the run stops before a checkpoint holds the step that stopped it."""
    dump, run = _run_with_bad_steps(
        tmp_path, "TITAN_GDN_TEST_INF_GRAD", "--optimizer.implementation", "fused"
    )
    for step in (2, 4):
        assert f"Skipped step {step}: NaN or infinite gradient, finite loss" in run.output
    stop = (
        "Training stopped at step 5: the gradient is NaN or infinite, the loss finite (an "
        "overflow in backward) (2 steps in a row), and this step was not applied; the same "
        f"command resumes from {dump}/checkpoint/step-4. To get"
    )
    assert stop in run.output, run.output[-6000:]
    assert all(run.steps[step][0] != "nan" for step in (2, 4, 5))  # finite losses
    _assert_the_skipped_steps_changed_nothing(dump, tmp_path)


@side_by_side
def test_nan_steps_are_skipped_then_training_stops_naming_the_last_checkpoint(tmp_path):
    """NaN losses (and gradients): the guard drops the gradients before the optimizer."""
    dump, run = _run_with_bad_steps(tmp_path, "TITAN_GDN_TEST_NAN_LOSS")
    assert "Skipped step 2: NaN or infinite loss" in run.output
    assert "Skipped step 4: NaN or infinite loss" in run.output
    stop = (
        "Training stopped at step 5: the loss is NaN or infinite (2 steps in a row), and this "
        f"step was not applied; the same command resumes from {dump}/checkpoint/step-4. To get"
    )
    assert stop in run.output, run.output[-6000:]
    assert sorted(run.steps) == [1, 2, 3, 4], run.steps
    assert {step: run.steps[step][0] for step in (2, 4)} == {2: "nan", 4: "nan"}
    _assert_the_skipped_steps_changed_nothing(dump, tmp_path)


def _tensors(state: dict, only: str = "") -> dict[str, torch.Tensor]:
    return {
        key: value
        for key, value in state.items()
        if isinstance(value, torch.Tensor) and key.startswith(only)
    }


# A killed rank, an interrupted checkpoint write

STEPS, INTERVAL = 6, 2
RESUMABLE = (
    "--training.steps", str(STEPS),
    "--lr_scheduler.total_steps", str(STEPS),
    "--checkpoint.enable",
    "--checkpoint.interval", str(INTERVAL),
    "--checkpoint.no-last-save-model-only",  # full state: optimizer, lr, data, step
    "--metrics.enable_tensorboard",
)  # fmt: skip


def _uninterrupted_run(dump: Path) -> tuple[Run, dict]:
    """The 2-process run the interrupted ones must reproduce: its steps and TensorBoard."""
    run = _launch(dump, *RESUMABLE, ngpu=2)
    assert run.code == 0, run.output[-6000:]
    assert sorted(run.steps) == list(range(1, STEPS + 1))
    return run, _tensorboard(_tensorboard_files(dump))


def _assert_resumed_like_uninterrupted(dump: Path, resumed: Run, earlier_files, reference):
    run, reference_tb = reference
    first = min(resumed.steps)
    assert sorted(resumed.steps) == list(range(first, STEPS + 1))
    assert resumed.steps == {step: run.steps[step] for step in resumed.steps}
    assert "learning-rate schedule is not the one" not in resumed.output  # total_steps kept
    resumed_tb = _tensorboard(_tensorboard_files(dump) - earlier_files)
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "documents_per_step", "lr"):
        expected = {step: reference_tb[tag][step] for step in range(first, STEPS + 1)}
        assert resumed_tb[tag] == expected, (tag, resumed_tb[tag], expected)


@side_by_side
def test_a_killed_rank_resumes_with_the_uninterrupted_losses_and_data(
    uninterrupted: Future, tmp_path
):
    from titan_gdn.checkpoint_folders import checkpoint_steps

    dump, killed = tmp_path / "run", []

    def kill_rank_1_after_step_3(line: str, process) -> None:
        if not killed and re.search(r"step:\s*3\s+loss", line):
            pid = _rank_pid(process.pid, rank=1)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    crashed = _launch(dump, *RESUMABLE, ngpu=2, on_line=kill_rank_1_after_step_3)
    assert killed and crashed.code != 0, crashed.output[-6000:]
    assert _killed_by_sigkill(crashed.output, pid=killed[0]), crashed.output[-6000:]
    assert max(crashed.steps) < STEPS  # it died mid-run
    # The steps before the kill were the uninterrupted ones.
    reference = uninterrupted.result()
    assert crashed.steps == {step: reference[0].steps[step] for step in crashed.steps}
    complete, _ = checkpoint_steps(dump / "checkpoint")
    last = complete[-1]
    assert last >= 2 and last % INTERVAL == 0, complete

    earlier_files = _tensorboard_files(dump)
    resumed = _launch(dump, *RESUMABLE, ngpu=2)
    assert resumed.code == 0, resumed.output[-6000:]
    assert f"Training starts at step {last + 1}" in resumed.output
    assert min(resumed.steps) == last + 1
    _assert_resumed_like_uninterrupted(dump, resumed, earlier_files, reference)
    # Every sample once: the loader stood exactly `last` batches in at the checkpoint it
    # resumed from, and exactly STEPS batches in at the end, on both ranks.
    for step in (last, STEPS):
        _assert_data_consumed_exactly(
            _checkpoint(dump / "checkpoint" / f"step-{step}", tmp_path), step, dp_world_size=2
        )


@side_by_side
def test_a_checkpoint_interrupted_while_written_is_never_resumed_from(
    uninterrupted: Future, tmp_path
):
    from torchtitan.components.checkpoint import CheckpointManager

    from titan_gdn.checkpoint_folders import checkpoint_steps

    dump = tmp_path / "run"
    crashed = _launch(
        dump, *RESUMABLE, *FAULTS, ngpu=2, env={"TITAN_GDN_TEST_KILL_WHILE_SAVING": "4"}
    )
    assert crashed.code != 0 and _killed_by_sigkill(crashed.output), crashed.output[-6000:]
    assert sorted(crashed.steps) == [1, 2, 3, 4]
    folder = dump / "checkpoint"
    # Both ranks wrote their data for step 4, and their checksums; the metadata that completes
    # it never came.
    written = sorted(p.name for p in (folder / "step-4").iterdir())
    assert written == ["__0_0.distcp", "__1_0.distcp", "checksums.json"]
    assert checkpoint_steps(folder) == ([2], [4])
    assert CheckpointManager._find_load_step(SimpleNamespace(folder=str(folder))) == 2

    earlier_files = _tensorboard_files(dump)
    resumed = _launch(dump, *RESUMABLE, ngpu=2)
    assert resumed.code == 0, resumed.output[-6000:]
    assert "Ignoring checkpoint(s) step-4" in resumed.output
    assert f"Loading the checkpoint from {folder}/step-2." in resumed.output
    assert "Training starts at step 3" in resumed.output
    _assert_resumed_like_uninterrupted(dump, resumed, earlier_files, uninterrupted.result())
    assert checkpoint_steps(folder) == ([2, 4, 6], [])  # step 4 written again, whole


@side_by_side
def test_a_checkpoint_that_finds_its_disk_full_stops_the_run_in_one_message(tmp_path):
    """A save that runs out of space (rank 1's file is /dev/full: every write fails with
    ENOSPC) stopped each rank with DCP's CheckpointException and its nested tracebacks; now
    each rank says which save failed, why, and what a rerun resumes from. An async save's
    failure arrives at the next save, and names the save that failed."""
    for mode, steps in (("disabled", [1, 2, 3, 4]), ("async", [1, 2, 3, 4, 5, 6])):
        dump = tmp_path / mode
        (dump / "checkpoint" / "step-4").mkdir(parents=True)
        (dump / "checkpoint" / "step-4" / "__1_0.distcp").symlink_to("/dev/full")
        run = _launch(dump, *RESUMABLE, "--checkpoint.async_mode", mode, ngpu=2)
        assert run.code == 1 and sorted(run.steps) == steps, run.output[-6000:]
        folder = dump / "checkpoint"
        assert (
            f"[rank0]:Saving the checkpoint {folder}/step-4 failed: no room on its disk (No "
            "space left on device). Free space (checkpoint.keep_latest_k = 10 keeps the newest "
            "10), or point job.dump_folder at a larger disk; then the same command resumes from "
            f"{folder}/step-2 (the incomplete step-4 is skipped; delete it to get its space "
            "back)\n"
        ) in run.output, run.output[-6000:]
        assert "Traceback" not in run.output, run.output[-6000:]
        assert "titan_gdn.train FAILED" in run.output  # torchrun's report of the ranks


def test_a_write_failure_with_the_disk_full_is_told_from_others(tmp_path, monkeypatch):
    """torch.save's writer reports a full disk without an errno (`enforce fail at
    inline_container.cc ... unexpected pos`): the disk's free space tells it apart."""
    import shutil

    from titan_gdn.checkpoint import no_room

    failure = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert no_room(failure, tmp_path / "gone", needed=1) is None  # no disk to ask
    free = random.randint(0, 2**40)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**41, 0, free))
    assert no_room(failure, tmp_path, needed=free) is None
    assert no_room(failure, tmp_path, needed=free + 1) == (
        f"{free / 2**30:.2f} GiB free for this rank's {(free + 1) / 2**30:.2f} GiB"
    )
    quota = OSError(122, "Disk quota exceeded")
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = quota
    assert no_room(wrapped, tmp_path, needed=0) == os.strerror(122)


# A checkpoint damaged after its save


def _small_checkpoint(folder: Path, writer=None) -> None:
    """A DCP checkpoint of random tensors, saved without a process group (by `writer`)."""
    import torch.distributed.checkpoint as dcp

    from titan_gdn.checkpoint import ChecksummedWriter

    state = {"weight": torch.randn(128, 128), "bias": torch.randn(128), "train_state": {"step": 1}}
    writer = (writer or ChecksummedWriter)(str(folder))
    dcp.save(state, storage_writer=writer, no_dist=True)


def _zero_inside(path: Path, length: int) -> None:
    """`length` bytes somewhere inside `path` set to zero; its size stays."""
    data = bytearray(path.read_bytes())
    start = random.randrange(0, len(data) - length)
    assert any(data[start : start + length])
    data[start : start + length] = bytes(length)
    path.write_bytes(bytes(data))


def test_a_checkpoint_changed_after_its_save_is_named(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter

    from titan_gdn.checkpoint import checkpoint_damage

    folder = tmp_path / "step-1"
    _small_checkpoint(folder)
    assert checkpoint_damage(folder) == []
    data = folder / "__0_0.distcp"
    intact = data.read_bytes()
    _zero_inside(data, 4096)
    assert checkpoint_damage(folder) == [
        "__0_0.distcp holds other bytes than were saved (its checksum differs)"
    ]
    data.write_bytes(intact[: len(intact) // 2])
    assert checkpoint_damage(folder) == [
        f"__0_0.distcp is cut short ({len(intact) // 2:,} of {len(intact):,} bytes)"
    ]
    data.unlink()
    assert checkpoint_damage(folder) == ["__0_0.distcp is missing"]
    (folder / ".metadata").write_bytes(bytes(64))
    (problem,) = checkpoint_damage(folder)
    assert problem.startswith("its metadata cannot be read")
    # A checkpoint saved without checksums (torchtitan's own writer): sizes are checked.
    plain = tmp_path / "plain"
    _small_checkpoint(plain, writer=FileSystemWriter)
    assert checkpoint_damage(plain) == []
    data = plain / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-1])
    (problem,) = checkpoint_damage(plain)
    assert problem.startswith("__0_0.distcp is cut short")


def test_resume_passes_over_damaged_checkpoints_to_the_newest_intact_one(tmp_path):
    from titan_gdn.checkpoint import CheckpointDamageError, checkpoint_damage, newest_intact_step

    folder = tmp_path / "checkpoint"
    for step in (2, 4, 6):
        _small_checkpoint(folder / f"step-{step}")
    (folder / "step-8").mkdir()  # interrupted: no .metadata
    assert newest_intact_step(folder, checkpoint_damage) == 6
    _zero_inside(folder / "step-6" / "__0_0.distcp", 64)
    assert newest_intact_step(folder, checkpoint_damage) == 4
    for step in (2, 4):
        _zero_inside(folder / f"step-{step}" / "__0_0.distcp", 64)
    with pytest.raises(CheckpointDamageError, match=f"every checkpoint in {folder} is damaged"):
        newest_intact_step(folder, checkpoint_damage)


@side_by_side
def test_a_checkpoint_damaged_in_place_is_skipped_for_the_one_before(
    uninterrupted: Future, tmp_path
):
    from titan_gdn.checkpoint import checkpoint_damage
    from titan_gdn.checkpoint_folders import checkpoint_steps

    dump = tmp_path / "run"
    first = _launch(dump, *RESUMABLE, "--training.steps", "4", ngpu=2)
    assert first.code == 0 and sorted(first.steps) == [1, 2, 3, 4], first.output[-6000:]
    folder = dump / "checkpoint"
    assert checkpoint_steps(folder) == ([2, 4], [])
    _zero_inside(folder / "step-4" / "__1_0.distcp", 64 * 1024)

    earlier_files = _tensorboard_files(dump)
    resumed = _launch(dump, *RESUMABLE, ngpu=2)
    assert resumed.code == 0, resumed.output[-6000:]
    assert f"Ignoring checkpoint step-4 in {folder}: damaged since it was saved " in resumed.output
    assert "__1_0.distcp holds other bytes than were saved" in resumed.output
    assert f"Loading the checkpoint from {folder}/step-2." in resumed.output
    assert "Training starts at step 3" in resumed.output
    _assert_resumed_like_uninterrupted(dump, resumed, earlier_files, uninterrupted.result())
    assert checkpoint_steps(folder) == ([2, 4, 6], [])  # step 4 written again, whole
    assert checkpoint_damage(folder / "step-4") == []


def _alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (an orphan's zombie may wait for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@side_by_side
def test_a_launcher_killed_with_sigkill_takes_its_ranks_with_it(tmp_path):
    """kill -9 of run_train.sh (torchrun's agent, the ranks' parent) ends the training
    ranks too: none goes on training, writing checkpoints or holding a device."""
    command = ["bash", "run_train.sh", "--job.dump_folder", str(tmp_path), *SMALL]
    command += ["--training.steps", "100000"]  # far more than this test waits for
    environment = {**os.environ, "NGPU": "2", "CONFIG_FILE": str(DEBUG_CONFIG)}
    launcher = subprocess.Popen(
        command,
        cwd=REPO,
        env={**environment, "LOG_RANK": "0", "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(300, os.killpg, (launcher.pid, signal.SIGKILL))
    watchdog.start()
    ranks = []
    try:
        for line in launcher.stdout:
            if re.search(r"step:\s*2\s+loss", line):
                break
        ranks = [_rank_pid(launcher.pid, rank=rank) for rank in (0, 1)]
        assert None not in ranks, ranks
        launcher.kill()  # SIGKILL, to the launcher alone: no handler, no group
        assert launcher.wait() == -signal.SIGKILL
        deadline = time.monotonic() + 120
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their launcher"
    finally:
        watchdog.cancel()
        launcher.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid in ranks:
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)


@side_by_side
def test_ctrl_c_or_sigterm_ends_a_run_in_one_line_with_the_shells_status(tmp_path):
    """Ctrl-C reaches the launcher (the terminal's process group; torchrun passes it on), a
    scheduler's SIGTERM may reach the ranks themselves: either way the run ends with rank 0's
    line saying where it stopped and what a rerun resumes from, the launcher's line, no
    traceback, and the status a shell gives a process that the signal ended (130, 143)."""
    from titan_gdn.checkpoint_folders import checkpoint_steps

    long_run = ("--training.steps", "100000")  # far more than this test waits for
    sent = []

    def after_step(step: int, signum: int, ranks: bool):
        def send(line: str, process) -> None:
            if not sent and re.search(rf"step:\s*{step}\s+loss", line):
                pids = [_rank_pid(process.pid, rank) for rank in (0, 1)] if ranks else [process.pid]
                for pid in pids:
                    os.kill(pid, signum)
                sent.append(step)

        return send

    dump = tmp_path / "interrupted"
    run = _launch(dump, *long_run, "--checkpoint.enable", "--checkpoint.interval", "2",
                  ngpu=2, on_line=after_step(3, signal.SIGINT, ranks=False))  # fmt: skip
    assert sent and run.code == 130, run.output[-6000:]
    complete, _ = checkpoint_steps(dump / "checkpoint")
    stopped = re.search(r"\[rank0\]:titan_gdn: stopped by SIGINT during step (\d+); "
                        r"the same command resumes from (\S+)\n", run.output)  # fmt: skip
    assert stopped, run.output[-6000:]
    assert int(stopped[1]) >= 3 and stopped[2] == str(dump / "checkpoint" / f"step-{complete[-1]}")
    assert run.output.endswith("run_train.sh: stopped by SIGINT; the ranks stopped with it\n")
    assert "Traceback" not in run.output and "death signal" not in run.output, run.output[-6000:]

    sent.clear()
    run = _launch(tmp_path / "terminated", *long_run, "--checkpoint.no-enable",
                  ngpu=2, on_line=after_step(1, signal.SIGTERM, ranks=True))  # fmt: skip
    assert sent and run.code == 143, run.output[-6000:]
    no_checkpoint = "checkpointing is off ([checkpoint] enable): a rerun starts at step 1"
    stopped = re.search(
        r"\[rank0\]:titan_gdn: stopped by SIGTERM during step \d+; (.*)\n", run.output
    )
    assert stopped and stopped[1] == no_checkpoint, run.output[-6000:]
    assert run.output.endswith("run_train.sh: stopped by SIGTERM; the ranks stopped with it\n")
    assert "Traceback" not in run.output, run.output[-6000:]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_ctrl_c_during_the_config_check_ends_in_one_line(tmp_path, signum):
    """Ctrl-C (the terminal signals the whole process group) or SIGTERM while run_train.sh
    checks the config, before torchrun exists: one line and the shell's status, not an
    import's traceback."""
    launcher = _start(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not _checking_config(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _checking_config(launcher.pid), "run_train.sh never started its config check"
        time.sleep(0.5)  # inside its imports (the check takes seconds)
        os.killpg(launcher.pid, signum)
        output, _ = launcher.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    line = f"run_train.sh: stopped by {signum.name} during the config check; no rank was started\n"
    assert (launcher.returncode, output) == (128 + signum, line)
    assert not (tmp_path / "checkpoint").exists()


def _checking_config(launcher: int) -> bool:
    """run_train.sh has become the launcher (exec), which checks the config before torchrun."""
    cmdline = Path(f"/proc/{launcher}/cmdline")
    return cmdline.exists() and b"--check" in cmdline.read_bytes() and not _children(launcher)


def test_kernel_backends_are_job_settings_checked_before_anything_is_built():
    """`[model]` attn_backend, delta_rule_backend, conv_backend and experts_backend reach the
    trainer's model args; a name the model would refuse on this machine (unknown, CUDA-only on
    CPU) fails the configuration check, naming the setting, before anything is built."""
    from titan_gdn.model import qwen3_5_args
    from titan_gdn.validation import validate_job_config

    cuda_on_cpu, unknown = _problems(
        _job_config("--model.attn_backend", "flex", "--model.delta_rule_backend", "magic")
    )
    assert "model.attn_backend = 'flex' needs a CUDA device but this run is on cpu" in cuda_on_cpu
    assert "model.delta_rule_backend = 'magic' is unknown" in unknown
    chosen = {"attn_backend": "varlen", "delta_rule_backend": "torch", "conv_backend": "torch"}
    chosen["experts_backend"] = "loop"
    job_config = _job_config(*[f"--model.{name}={value}" for name, value in chosen.items()])
    validate_job_config(job_config, world_size=1)
    args = copy.deepcopy(qwen3_5_args["debugmodel"])
    args.update_from_config(job_config)
    assert {name: getattr(args, name) for name in chosen} == chosen


def test_flash_qla_at_head_widths_it_cannot_run_fails_the_config_check(monkeypatch):
    """FlashQLA's kernels are 128 wide: other GDN head widths are named by the check, as on a
    GPU machine with flash_qla installed (both stood in for here), not at the first forward."""
    from titan_gdn.model import qwen3_5_args
    from titan_gdn.ops import backends
    from titan_gdn.validation import _backend_problems

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    args = copy.deepcopy(qwen3_5_args["debugmodel"])
    args.delta_rule_backend = "flash_qla"
    assert _backend_problems(args) == []  # the debug model's GDN heads are 128 wide
    args.linear_key_head_dim = random.choice([32, 64, 256])
    assert _backend_problems(args) == [
        "model.delta_rule_backend = 'flash_qla' runs head widths of 128 only; this model's are "
        f"{args.linear_key_head_dim} (keys) and 128 (values): use 'fla'"
    ]


def test_model_max_seq_len_raises_the_limit_the_validation_names():
    """A row past the flavor's limit fails naming model.max_seq_len; setting it trains there,
    with the model built for that length (the trainer's args, not only the check)."""
    from titan_gdn.model import qwen3_5_args
    from titan_gdn.validation import validate_job_config

    limit = qwen3_5_args["debugmodel"].max_seq_len
    too_long = _job_config("--training.seq_len", str(limit + 2))
    (problem,) = _problems(too_long)
    assert f"raise model.max_seq_len to at least {limit + 2}" in problem
    raised = _job_config(
        "--training.seq_len", str(limit + 2), "--model.max_seq_len", str(limit + 2)
    )
    validate_job_config(raised, world_size=1)
    args = copy.deepcopy(qwen3_5_args["debugmodel"])
    args.update_from_config(raised)
    assert args.max_seq_len == limit + 2
