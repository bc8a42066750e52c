"""`python -m titan_gdn.tiny_hf_checkpoint`: a folder that reads as a Qwen3.5 checkpoint (the
recipe of docs/checkpoints.md fine-tunes from it: tests/test_quickstart.py)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from titan_gdn import generate, tiny_hf_checkpoint

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="a CPU tool")


def test_writes_transformers_files_that_titan_gdn_samples_from(tmp_path, capsys):
    out = tmp_path / "hf_model"
    assert tiny_hf_checkpoint.main(["--out", str(out)]) == 0

    config = json.loads((out / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert config["eos_token_id"] == tokenizer.token_to_id("<|end_of_text|>")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()

    # The shape from config.json, every weight loaded, a prompt continued.
    command = ["--checkpoint", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "4"]
    assert generate.main([*command, "--ignore-eos"]) == 0
    assert "generated 4 new tokens" in capsys.readouterr().err


def test_a_folder_without_tokenizer_json_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tiny_hf_checkpoint.main(["--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "has no tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
