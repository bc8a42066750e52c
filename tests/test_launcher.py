"""run_train.sh and the entry points, as a user launches them: the config file named either way,
bad launcher settings named in one line before anything starts, a MASTER_ADDR left in the
environment of a one-node run, a run started outside the checkout, a rank started without
torchrun, and TOML values of the wrong type."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from titan_gdn.config_check import config_file_problems

REPO = Path(__file__).resolve().parents[1]
DEBUG_CONFIG = REPO / "train_configs" / "debug_model.toml"
ONE_STEP = (
    "--training.steps", "1",
    "--training.seq_len", "64",
    "--training.local_batch_size", "1",
    "--sample.prompt", "",
)  # fmt: skip


def _run(*args: str, env=None, cwd=REPO, timeout=300) -> tuple[int, str]:
    environment = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "MASTER_ADDR")}
    environment.update({"NGPU": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
    result = subprocess.run(
        ["bash", str(REPO / "run_train.sh"), *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result.returncode, result.stdout + result.stderr


def _with_typo(tmp_path: Path) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(DEBUG_CONFIG.read_text().replace("\nseq_len = 128\n", "\nseq_lenn = 128\n"))
    return path


@pytest.mark.parametrize("form", ["--job.config_file X", "--job.config_file=X"])
def test_the_config_file_on_the_command_line_is_the_one_read(form, tmp_path):
    """It used to be passed after run_train.sh's own (CONFIG_FILE's default), which torchtitan
    reads first: the debug config trained instead, silently."""
    path = str(_with_typo(tmp_path))
    flag = form.replace("X", path).split(" ")
    code, output = _run(*flag, "--job.dump_folder", str(tmp_path / "dump"))
    assert code != 0
    assert f'{path}: [training] has no key "seq_lenn"; did you mean "seq_len"?' in output, output
    assert not (tmp_path / "dump").exists()


def test_two_different_config_files_are_refused(tmp_path):
    code, output = _run(
        "--job.config_file", str(_with_typo(tmp_path)), env={"CONFIG_FILE": str(DEBUG_CONFIG)}
    )
    assert code == 2
    assert output.strip().startswith(f"run_train.sh: two config files: CONFIG_FILE={DEBUG_CONFIG}")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NGPU": "2x"}, "run_train.sh: NGPU=2x is not a number of processes (1, 2, ...)"),
        ({"NGPU": "0"}, "run_train.sh: NGPU=0 is not a number of processes (1, 2, ...)"),
        ({"NNODES": "two"}, "run_train.sh: NNODES=two is not a number of nodes (1, 2, ...)"),
        (
            {"NGPU": "1", "LOG_RANK": "1"},
            "run_train.sh: LOG_RANK=1: local rank 1 does not exist with NGPU=1 (0 to 0)",
        ),
        (
            {"NGPU": "2", "LOG_RANK": "all"},
            "run_train.sh: LOG_RANK=all: local rank all does not exist with NGPU=2 (0 to 1)",
        ),
    ],
)
def test_bad_launcher_settings_are_named_in_one_line(env, message):
    code, output = _run(env=env)
    assert code == 2 and output.strip() == message, output


def test_a_master_addr_left_in_the_environment_does_not_pin_a_one_node_run(tmp_path):
    """Slurm and other schedulers export MASTER_ADDR; on one node it used to make the
    rendezvous wait on MASTER_ADDR:29500, so a second run blocked on the first (here: a port
    already taken)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, output = _run(
            "--job.dump_folder", str(tmp_path / "dump"), *ONE_STEP,
            env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            timeout=180,
        )  # fmt: skip
    assert code == 0, output[-4000:]
    assert "step:  1" in output


def test_a_run_outside_the_checkout_names_the_working_directory(tmp_path):
    code, output = _run(cwd=tmp_path)
    assert code != 0
    assert output.strip() == (
        f"./train_configs/debug_model.toml: config file not found in the working directory "
        f"{tmp_path} (CONFIG_FILE or --job.config_file; the shipped configs are in the "
        "checkout's train_configs/, run from its root)"
    )
    code, output = _run(env={"CONFIG_FILE": str(DEBUG_CONFIG)}, cwd=tmp_path)
    assert code != 0
    assert (
        "model.hf_assets_path = './assets/tokenizer' is not a folder of the working directory "
        f"{tmp_path}, from which relative paths are read" in output
    ), output
    assert "download" not in output  # torchtitan's advice for a deprecated setting


def test_a_rank_started_without_torchrun_says_how_to_launch(tmp_path):
    """After the config check (tests/test_reliability.py: a config error is reported first)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "titan_gdn.train",
            "--job.config_file",
            str(DEBUG_CONFIG),
            "--job.dump_folder",
            str(tmp_path),
        ],  # fmt: skip
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().startswith(
        "titan_gdn.train runs as a rank started by torchrun: launch `CONFIG_FILE=X ./run_train.sh"
    ), result.stderr
    assert "Traceback" not in result.stderr


def test_an_unimportable_custom_import_is_named_before_the_ranks_start(tmp_path):
    code, output = _run("--experimental.custom_import", "titan_gd")
    assert code == 1
    assert (
        "experimental.custom_import = 'titan_gd' is not an importable module; for this package "
        'use "titan_gdn"' in output
    )
    assert "Traceback" not in output


def test_an_unimportable_custom_config_module_is_named(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        DEBUG_CONFIG.read_text().replace(
            'custom_config_module = "titan_gdn.job_config"',
            'custom_config_module = "titan_gdn.jobconfig"',
        )
    )
    assert "titan_gdn.jobconfig" in path.read_text()
    code, output = _run("--job.config_file", str(path))
    assert code != 0 and "Traceback" not in output
    assert output.strip().startswith(
        "job.custom_config_module = 'titan_gdn.jobconfig' cannot be used (No module named"
    ), output


@pytest.mark.parametrize(
    "section, line, replacement, message",
    [
        ("training", "steps = ", 'steps = "two"', "[training] steps = 'two' should be an integer"),
        ("optimizer", "lr = ", 'lr = "4e-3"', "[optimizer] lr = '4e-3' should be a number"),
        (
            "metrics",
            "log_freq = ",
            "log_freq = 1.5",
            "[metrics] log_freq = 1.5 should be an integer",
        ),
        (
            "checkpoint",
            "enable = ",
            'enable = "false"',
            "[checkpoint] enable = 'false' should be true or false (unquoted)",
        ),
        (
            "activation_checkpoint",
            "mode = ",
            'mode = "sometimes"',
            "[activation_checkpoint] mode = 'sometimes' should be one of 'selective', 'full', "
            "'memory_budget', 'none'",
        ),
    ],
)
def test_toml_values_of_the_wrong_type_are_named(section, line, replacement, message, tmp_path):
    """torchtitan takes a TOML's values as they are: a quoted "false" is a true setting, a
    quoted number fails in each rank."""
    text, out, inside = DEBUG_CONFIG.read_text().splitlines(), [], False
    for row in text:
        if row.startswith("["):
            inside = row == f"[{section}]"
        out.append(replacement if inside and row.startswith(line) else row)
    assert out != text, (section, line)
    path = tmp_path / "mine.toml"
    path.write_text("\n".join(out) + "\n")
    assert config_file_problems(str(path), []) == [f"{path}: {message}"]


def test_the_shipped_configs_have_values_of_their_settings_types():
    for config in sorted((REPO / "train_configs").glob("*.toml")):
        assert config_file_problems(str(config), []) == [], config
