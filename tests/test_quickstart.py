"""The quickstart as the README gives it: `./run_train.sh`, no arguments, on CPU.

It runs in a temporary copy of the checkout (its tracked and untracked, not ignored files), so
that it writes that copy's outputs/debug_model as a user's first run would, and neither reads
nor overwrites the checkout's own outputs/ (the `quickstart` fixture of tests/conftest.py, run
once per session). Then the run's checkpoint is sampled with `python -m titan_gdn.generate`
and resumed for two more steps, the README's next command, the tests, passes in that copy, and
the cpu commands of README.md and of the pages under docs/ run there too.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import QUICKSTART, run_as_a_user
from tests.doc_pages import CPU_PAGES, cpu_blocks, page_id

STEP_LINE = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s.*docs: [0-9.,]+  "
    r"progress: (\d+)/(\d+)  elapsed: (\d+:\d\d)  eta: (\d+:\d\d)$"
)
NOISE = (
    "lspci",
    "Peak flops",
    "Peak FLOPS",
    "safetensors.index.json",
    "torchtitan version",
    "[GC]",
    "Sleeping 2 seconds for other ranks",  # there are none
)
STEPS, LOG_FREQ, PROMPT = 60, 10, "ROMEO:"
# Tests that read the default dump folder, ./outputs/debug_model, if they run in the checkout:
# after the quickstart it holds a checkpoint of one data-parallel rank, which a config for two
# ranks may not resume from.
VALIDATION_TESTS = (
    "tests/test_reliability.py::test_shipped_configs_pass_validation",
    "tests/test_reliability.py::test_world_size_that_does_not_fit_the_degrees_is_refused",
    "tests/test_reliability.py::test_cuda_graphs_are_refused_where_they_cannot_replay",
)
CACHES = {"__pycache__", ".pytest_cache"}
SAMPLE_TOKENS = 64  # the debug config's [sample] max_new_tokens
TITAN_RECORD = re.compile(r"\[titan\] \S+ \S+ - root - ")

pytestmark = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="the CPU quickstart; GPU runs live in tests/gpu"
)


def _steps(output: str) -> dict[int, tuple[float, str]]:
    """{step: (loss, the whole line)} from the step lines."""
    steps = {}
    for line in output.splitlines():
        match = STEP_LINE.search(line)
        if match:
            step, loss, progress_step, total = match.group(1, 2, 3, 4)
            assert (int(progress_step), int(total)) == (int(step), STEPS), line
            steps[int(step)] = (float(loss), line)
    return steps


def test_the_loss_falls_on_lines_with_progress_elapsed_and_eta(quickstart):
    _, output = quickstart
    steps = _steps(output)
    # The first step, every log_freq steps, and the last.
    assert sorted(steps) == [1, *range(LOG_FREQ, STEPS + 1, LOG_FREQ)], output[-6000:]
    first, last = steps[1][0], steps[STEPS][0]
    assert last < first - 1.5, (first, last)
    assert steps[STEPS][1].endswith("eta: 0:00"), steps[STEPS][1]


def test_a_readable_sample_is_printed(quickstart):
    _, output = quickstart
    lines = output.splitlines()
    heading = next(i for i, line in enumerate(lines) if f"Sample after step {STEPS}" in line)
    # As long as asked for: it goes on past the end of a document.
    assert f"{SAMPLE_TOKENS} new tokens" in lines[heading], lines[heading]
    sample_lines = list(
        itertools.takewhile(lambda line: not TITAN_RECORD.search(line), lines[heading + 1 :])
    )
    sample = [line.split("]:", 1)[-1] for line in sample_lines]  # after torchrun's "[rank0]:"
    assert sample[0].startswith(PROMPT), lines[heading : heading + 5]
    words = " ".join(sample).split()
    assert len(words) > 10, sample  # whitespace survives the tokenizer


def test_the_console_has_no_trace_warnings_or_colors(quickstart):
    _, output = quickstart
    assert not [line for line in output.splitlines() if line.startswith("+ ")]  # no `set -x`
    for noise in NOISE:
        assert noise not in output, noise
    assert "\x1b[" not in output
    assert '"vocab_size"' not in output  # the model args are in model_args.json instead
    # Read once for the config check and the trainer.
    assert output.count("Loading tokenizer from") == 1, output[:3000]


def test_the_dump_folder_holds_no_empty_trace_folder(quickstart):
    checkout, _ = quickstart
    dump = checkout / "outputs" / "debug_model"
    assert (dump / "checkpoint").is_dir()
    assert not (dump / "comm_traces").exists()


def test_the_last_step_checkpoint_samples_and_resumes(quickstart):
    checkout, _ = quickstart
    step_folder = checkout / "outputs" / "debug_model" / "checkpoint" / f"step-{STEPS}"
    assert (step_folder / ".metadata").is_file()
    assert (checkout / "outputs" / "debug_model" / "model_args.json").is_file()

    command = [sys.executable, "-m", "titan_gdn.generate", "--checkpoint", str(step_folder)]
    code, output = run_as_a_user([*command, "--prompt", PROMPT, "--max-new-tokens", "20"], checkout)
    assert code == 0, output[-3000:]
    assert output.startswith(PROMPT), output[-3000:]

    code, output = run_as_a_user(["./run_train.sh", "--training.steps", str(STEPS + 2)], checkout)
    assert code == 0, output[-6000:]
    assert f"Training starts at step {STEPS + 1}" in output, output[-6000:]
    assert sorted(_resumed_steps(output)) == [STEPS + 1, STEPS + 2], output[-6000:]


def test_the_config_check_counts_a_checkpoint_as_large_as_the_one_written(quickstart):
    """The config check refuses a dump folder whose disk cannot hold a checkpoint: its size
    estimate is the size of the folder the run wrote, within a few percent."""
    from torchtitan.config import ConfigManager

    from titan_gdn.validation import checkpoint_size

    checkout, _ = quickstart
    step_folder = checkout / "outputs" / "debug_model" / "checkpoint" / f"step-{STEPS}"
    written = sum(path.stat().st_size for path in step_folder.rglob("*") if path.is_file())
    config = checkout / "train_configs" / "debug_model.toml"
    estimate, _, _ = checkpoint_size(ConfigManager().parse_args(["--job.config_file", str(config)]))
    assert written <= estimate <= 1.05 * written, (written, estimate)


def _resumed_steps(output: str) -> list[int]:
    return [int(m.group(1)) for m in re.finditer(r"step:\s*(\d+)\s+loss:.*progress: ", output)]


def test_the_tests_pass_after_it_and_write_nothing_into_the_checkout(quickstart, tmp_path):
    checkout, _ = quickstart
    before = _files(checkout)
    command = [sys.executable, "-m", "pytest", "-m", "not gpu", *VALIDATION_TESTS]
    code, output = run_as_a_user([*command, "--basetemp", str(tmp_path / "basetemp")], checkout)
    assert code == 0, output[-6000:]
    assert _files(checkout) - before == set()


def _files(folder: Path) -> set[Path]:
    """The files under `folder`, caches left out."""
    files = (path.relative_to(folder) for path in folder.rglob("*") if path.is_file())
    return {path for path in files if CACHES.isdisjoint(path.parts)}


@pytest.mark.parametrize(
    "message, shown",
    [
        (
            "Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use "
            "device_name",
            False,
        ),
        (
            "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
            False,
        ),
        ("torchtitan version: 0.2.2 (0.0.0 means __version__ is not defined correctly).", False),
        ("Warmup steps (200) exceed total steps (30). Adjusting warmup steps to 30.", True),
        ("[GC] Performing periodic GC collection took 0.00 seconds", False),
        ("Sleeping 2 seconds for other ranks to complete", True),  # unless one process
    ],
)
def test_console_drops_what_a_gpu_run_cannot_act_on(message, shown):
    """The GPU-side start-up lines the CPU quickstart never prints: torchtitan's lspci probe
    (absent in containers; the device name names the GPU) and its NCCL variable override."""
    import logging

    from titan_gdn.trainer import QuietConsole

    record = logging.LogRecord("root", logging.WARNING, __file__, 0, message, None, None)
    assert QuietConsole().filter(record) is shown


def test_the_wait_for_other_ranks_is_dropped_in_a_run_of_one_process():
    import logging

    from titan_gdn.trainer import QuietConsole

    console = QuietConsole()
    console.single_process = True
    message = "Sleeping 2 seconds for other ranks to complete"
    record = logging.LogRecord("root", logging.INFO, __file__, 0, message, None, None)
    assert console.filter(record) is False


# The pages' other commands, in the quickstart's copy (tests/doc_pages.py: how a bash block
# says it is tested). A page's cpu blocks run in page order, so a block may use what an earlier
# block of its page wrote (the pages run side by side, so not what another page wrote); a block
# that several pages hold (the quickstart, on two pages) runs once, and the quickstart counts as
# run. Only exit codes are checked (and the files a recipe promises): the quickstart's output
# and losses are free to change.


def _run_block(root: Path, body: str) -> tuple[int, str]:
    """A block in `root` as a user runs it from a shell: (exit code, output)."""
    return run_as_a_user(["bash", "-e", "-o", "pipefail", "-c", body], root)


# What a block promises on disk, checked after it ran: (text in the block, path).
PROMISED_FILES = [
    ("titan_gdn.tiny_hf_checkpoint", "hf_model/model.safetensors"),
    ("--checkpoint.last_save_in_hf", "outputs/finetune/checkpoint/step-20/config.json"),
    ("--checkpoint.create_seed_checkpoint", "outputs/seed/checkpoint/step-0/.metadata"),
]


@pytest.fixture(scope="module")
def page_runs(quickstart) -> dict[Path, list]:
    """Every cpu page's blocks, run in the quickstart's copy of the checkout: a page's blocks
    one after the other, the pages side by side (a page's run of one process leaves a core
    free most of the time). {page: [(block, (exit code, output), {promised file: written})]} for the
    blocks the page ran, up to its first failure, each promised file looked for right after
    its block; a block that an earlier page holds too runs there, and the page waits for it."""
    root, _ = quickstart
    owner, done = {}, {}
    for page in CPU_PAGES:
        for body in cpu_blocks(page):
            owner.setdefault(body, page)
            done.setdefault(body, threading.Event())
    done[QUICKSTART] = threading.Event()
    done[QUICKSTART].set()

    def run_page(page: Path) -> list:
        ran = []
        try:
            for body in cpu_blocks(page):
                if body == QUICKSTART or owner[body] != page:
                    done[body].wait()
                    continue
                result = _run_block(root, body)
                promised = [file for flag, file in PROMISED_FILES if flag in body]
                ran.append((body, result, {file: (root / file).exists() for file in promised}))
                done[body].set()
                if result[0] != 0:
                    break
        finally:  # a page that stopped early holds up no other
            for body in cpu_blocks(page):
                if owner[body] == page:
                    done[body].set()
        return ran

    with ThreadPoolExecutor(len(CPU_PAGES)) as pages:
        return dict(zip(CPU_PAGES, pages.map(run_page, CPU_PAGES), strict=True))


@pytest.mark.parametrize("page", CPU_PAGES, ids=page_id)
def test_cpu_commands_of_the_page_run(page_runs, page):
    for body, (code, output), promised_files in page_runs[page]:
        assert code == 0, f"{page_id(page)}:\n{body}\n--- output ---\n{output[-6000:]}"
        for promised, written in promised_files.items():
            assert written, f"{body}\ndid not write {promised}"
