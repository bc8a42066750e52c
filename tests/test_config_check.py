"""titan_gdn.config_check: an unknown section or key in a training TOML stops the run before
anything starts, naming the file, the section, the key and the closest valid name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titan_gdn.config_check import check_config_file, config_file_problems

REPO = Path(__file__).resolve().parents[1]
SHIPPED_CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))
CUSTOM_MODULE = '[job]\ncustom_config_module = "titan_gdn.job_config"\n'


def _toml(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_typo_in_a_key_names_file_section_key_and_the_fix(tmp_path):
    path = _toml(tmp_path, CUSTOM_MODULE + "[training]\nseq_lenn = 256\n")
    assert config_file_problems(path, []) == [
        f'{path}: [training] has no key "seq_lenn"; did you mean "seq_len"?'
    ]


def test_an_unknown_section_names_the_closest_section(tmp_path):
    path = _toml(tmp_path, "[trainig]\nsteps = 5\n")
    assert config_file_problems(path, []) == [
        f"{path}: unknown section [trainig]; did you mean [training]?"
    ]


def test_a_name_with_no_close_match_lists_the_valid_names(tmp_path):
    path = _toml(tmp_path, "[zzzz]\n")
    (problem,) = config_file_problems(path, [])
    assert problem.startswith(f"{path}: unknown section [zzzz] (valid: [activation_checkpoint], ")


def test_a_typo_in_a_nested_section_is_found(tmp_path):
    # torchtitan's [quantize.linear.float8] is a dataclass inside a dataclass inside JobConfig.
    path = _toml(tmp_path, '[quantize.linear.float8]\nrecipe_nam = "rowwise"\n')
    assert config_file_problems(path, []) == [
        f'{path}: [quantize.linear.float8] has no key "recipe_nam"; did you mean "recipe_name"?'
    ]


def test_the_custom_config_modules_keys_are_accepted(tmp_path):
    key = "[training]\nskip_nonfinite_loss_steps = 2\n"
    assert config_file_problems(_toml(tmp_path, CUSTOM_MODULE + key), []) == []
    # Without the module, torchtitan would reject the key too.
    (problem,) = config_file_problems(_toml(tmp_path, key, "plain.toml"), [])
    assert '[training] has no key "skip_nonfinite_loss_steps"' in problem


def test_the_custom_module_on_the_command_line_is_used_as_torchtitan_does(tmp_path):
    path = _toml(tmp_path, "[training]\nskip_nonfinite_loss_steps = 2\n")
    args = ["--job.config_file", path, "--job.custom_config_module=titan_gdn.job_config"]
    assert config_file_problems(path, args) == []


def test_fields_added_to_a_custom_module_are_picked_up(tmp_path, monkeypatch):
    # A new section and a new key in an existing one, as titan_gdn/job_config.py may grow.
    (tmp_path / "grown_job_config.py").write_text(
        "from dataclasses import dataclass, field\n\n"
        "@dataclass\nclass Model:\n    max_seq_len: int = 0\n\n"
        "@dataclass\nclass Extra:\n    knob: int = 0\n\n"
        "@dataclass\nclass JobConfig:\n"
        "    model: Model = field(default_factory=Model)\n"
        "    extra: Extra = field(default_factory=Extra)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _toml(
        tmp_path,
        '[job]\ncustom_config_module = "grown_job_config"\n'
        '[model]\nname = "qwen3_5"\nmax_seq_len = 8\n[extra]\nknob = 1\nknobb = 2\n',
    )
    assert config_file_problems(path, []) == [
        f'{path}: [extra] has no key "knobb"; did you mean "knob"?'
    ]


def test_every_problem_is_reported_at_once(tmp_path):
    path = _toml(tmp_path, CUSTOM_MODULE + "[training]\nseq_lenn = 1\nstepz = 2\n[compiel]\n")
    with pytest.raises(SystemExit) as stop:
        check_config_file([f"--job.config_file={path}"])
    assert str(stop.value.code).splitlines() == [
        f'{path}: [training] has no key "seq_lenn"; did you mean "seq_len"?',
        f'{path}: [training] has no key "stepz"; did you mean "steps"?',
        f"{path}: unknown section [compiel]; did you mean [compile]?",
    ]


def test_command_line_overrides_are_left_to_torchtitan(tmp_path):
    path = _toml(tmp_path, CUSTOM_MODULE)
    check_config_file(["--job.config_file", path, "--training.seq_lenn", "256"])
    check_config_file(["--training.steps", "5"])  # no config file: nothing to check


def test_a_missing_config_file_is_named(tmp_path):
    missing = str(tmp_path / "missing.toml")
    with pytest.raises(SystemExit, match=f"^{re.escape(missing)}: config file not found "):
        check_config_file(["--job.config_file", missing])


@pytest.mark.parametrize("config", SHIPPED_CONFIGS, ids=lambda path: path.name)
def test_every_shipped_config_passes(config):
    assert config_file_problems(str(config), []) == []


def test_training_with_a_typo_stops_before_it_starts(tmp_path):
    shipped = (REPO / "train_configs" / "debug_model.toml").read_text()
    assert "\nseq_len = 128\n" in shipped
    path = _toml(tmp_path, shipped.replace("\nseq_len = 128\n", "\nseq_lenn = 128\n"))
    dump = tmp_path / "dump"
    command = [sys.executable, "-m", "titan_gdn.train", "--job.config_file", path]
    command += ["--job.dump_folder", str(dump)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f'{path}: [training] has no key "seq_lenn"; did you mean "seq_len"?' in output
    assert "Traceback" not in output
    assert "torchtitan version" not in output  # torchtitan's main, its first log line, never ran
    assert not dump.exists()
