"""A damaged Hugging Face folder (a .safetensors file cut short, a shard its index names but
missing) is named in one line by generate and by the job-config check, each naming the setting
that points at it, instead of safetensors' traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pytest
from safetensors.torch import load_file, save_file

from tests.hf_reference import hf_import_arguments
from tests.test_reliability import TOKENIZER, _job_config, _problems
from titan_gdn.checkpoint_folders import HF_INDEX


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from titan_gdn.tiny_hf_checkpoint import write_tiny_checkpoint

    out = tmp_path_factory.mktemp("hf") / "intact"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_tiny_checkpoint(out, TOKENIZER)
    return out


def _damaged(intact, tmp_path, case: str):
    folder = tmp_path / case
    shutil.copytree(intact, folder)
    weights = folder / "model.safetensors"
    if case == "cut short":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return folder, "model.safetensors cannot be read ("
    # Two shards and their index, as transformers writes a large model; then one shard lost.
    tensors = load_file(weights)
    weights.unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    for shard, keys in shards.items():
        save_file({key: tensors[key] for key in keys}, folder / shard)
    weight_map = {key: shard for shard, keys in shards.items() for key in keys}
    (folder / HF_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model-00002-of-00002.safetensors").unlink()
    return folder, f"model-00002-of-00002.safetensors, which {HF_INDEX} names, is missing"


@pytest.mark.parametrize("case", ["cut short", "missing shard"])
def test_generate_names_a_damaged_hf_folder_in_one_line(case, hf_folder, tmp_path, capsys):
    from titan_gdn.generate import main

    folder, damage = _damaged(hf_folder, tmp_path, case)
    code = main(["--checkpoint", str(folder), "--prompt", "ROMEO:", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and not out.strip()
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"python -m titan_gdn.generate: error: --checkpoint {folder} is a damaged Hugging Face "
        f"folder ({damage}"
    ), err
    assert err.strip().endswith("copy or export it again, or pass another checkpoint"), err


@pytest.mark.parametrize("case", ["cut short", "missing shard"])
def test_the_job_config_check_names_a_damaged_hf_import(case, hf_folder, tmp_path):
    folder, damage = _damaged(hf_folder, tmp_path, case)
    job_config = _job_config(
        "--job.dump_folder", str(tmp_path / "run"),
        *hf_import_arguments(folder),
    )  # fmt: skip
    (problem,) = _problems(job_config)
    assert problem.startswith(
        f"checkpoint.initial_load_path = '{folder}' is a damaged Hugging Face folder ({damage}"
    ), problem
    assert problem.endswith("point checkpoint.initial_load_path at an intact one"), problem


def test_the_validation_command_reports_a_damaged_hf_import_without_a_traceback(
    hf_folder, tmp_path
):
    from tests.test_reliability import DEBUG_CONFIG, REPO

    folder, damage = _damaged(hf_folder, tmp_path, "cut short")
    command = [
        sys.executable, "-m", "titan_gdn.validation",
        "--world-size", "1",
        "--job.config_file", str(DEBUG_CONFIG),
        "--job.dump_folder", str(tmp_path / "run"),
        *hf_import_arguments(folder),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and damage in result.stderr, result.stderr
