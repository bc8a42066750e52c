"""`python -m titan_gdn.generate` on checkpoints the real training command writes (CPU).

One short run of run_train.sh leaves a full checkpoint (step 10: model, optimizer, scheduler,
data loader) and a model-only one (step 20). Greedy output is checked against an argmax loop
written here, over weights loaded with DCP into a model built here; an HF folder made from the
same weights gives the same text; bad input fails in one line before any weight is read.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.test_train_qwen import REPO, TOKENIZER, _train_ok

PROMPT = "ROMEO:"
NEW_TOKENS = 20
SUMMARY = re.compile(r"generated (\d+) new tokens")

pytestmark = [
    pytest.mark.skipif(
        torch.accelerator.is_available(), reason="CPU runs (gloo); GPU runs live in tests/gpu"
    ),
    # The reference's dcp.load runs in one process on purpose.
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{step: folder}: step 10 a full checkpoint (interval save), step 20 model-only (last)."""
    dump = tmp_path_factory.mktemp("train")
    _train_ok(
        dump,
        "--training.steps", "20",
        "--checkpoint.enable",
        "--checkpoint.interval", "10",
        "--checkpoint.last_save_model_only",
    )  # fmt: skip
    return {step: dump / "checkpoint" / f"step-{step}" for step in (10, 20)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "titan_gdn.generate", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """generate's main in this process (no interpreter start-up): (code, stdout, stderr)."""
    from titan_gdn.generate import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _reference(folder, prompt: str, new_tokens: int) -> tuple[list[int], str, bool]:
    """Greedy decoding written independently of titan_gdn.generate: the debug model loaded
    in place by dcp.load (only the model's keys, as torchtitan loads a model), then argmax of
    the last position's logits, token by token. Returns (ids, text, stopped at EOS)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_gdn.model import Qwen35Model, qwen3_5_args

    model = Qwen35Model(qwen3_5_args["debugmodel"])
    dcp.load(model.state_dict(), checkpoint_id=str(folder))
    model.eval()
    tokenizer = HuggingFaceTokenizer(str(TOKENIZER))
    ids = tokenizer.encode(prompt, add_bos=True, add_eos=False)
    start = len(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            if token == tokenizer.eos_id:
                return ids[start:], tokenizer.decode(ids), True
            ids.append(token)
    return ids[start:], tokenizer.decode(ids), False


def test_greedy_cli_is_deterministic_and_matches_the_reference(checkpoints):
    args = ("--checkpoint", str(checkpoints[20]), "--prompt", PROMPT)
    args += ("--max-new-tokens", str(NEW_TOKENS))
    first, second = _cli(*args), _cli(*args)
    assert first.returncode == 0, first.stderr[-4000:]
    assert first.stdout.startswith(PROMPT), first.stdout
    assert second.stdout == first.stdout

    ids, text, stopped = _reference(checkpoints[20], PROMPT, NEW_TOKENS)
    assert stopped or len(ids) == NEW_TOKENS
    assert [int(n) for n in SUMMARY.findall(first.stderr)] == [len(ids)], first.stderr
    assert text.startswith(PROMPT)  # the bundled tokenizer round-trips this prompt
    assert first.stdout == text + "\n"


def test_generated_ids_equal_the_reference_ids(checkpoints):
    from titan_gdn.checkpoint_folders import load_model
    from titan_gdn.generate import generate, parse_args, prepare

    args = parse_args(["--checkpoint", str(checkpoints[20]), "--prompt", PROMPT])
    path, fmt, model_args, tokenizer, prompt_ids = prepare(args)
    ids = generate(load_model(path, fmt, model_args), tokenizer, prompt_ids, NEW_TOKENS)
    assert ids == _reference(checkpoints[20], PROMPT, NEW_TOKENS)[0]


def test_full_checkpoint_loads_the_model_out_of_the_training_state(checkpoints, capsys):
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoints[10])).read_metadata().state_dict_metadata
    assert any(key.startswith("optimizer.") for key in metadata)  # a full checkpoint indeed
    code, out, err = _main(
        capsys, "--checkpoint", str(checkpoints[10]), "--prompt", PROMPT,
        "--max-new-tokens", str(NEW_TOKENS),
    )  # fmt: skip
    assert code == 0, err
    assert out == _reference(checkpoints[10], PROMPT, NEW_TOKENS)[1] + "\n"


def test_hf_folder_gives_the_text_of_its_dcp_checkpoint(checkpoints, tmp_path, capsys):
    """An HF folder (safetensors, config.json and tokenizer, as the trainer's export writes
    them) of step 20's weights: the flavor and the tokenizer come from the folder."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from titan_gdn.model import Qwen35Model, Qwen35StateDictAdapter, qwen3_5_args

    model_args = qwen3_5_args["debugmodel"]
    state_dict = Qwen35Model(model_args).state_dict()
    dcp.load(state_dict, checkpoint_id=str(checkpoints[20]))
    adapter = Qwen35StateDictAdapter(model_args, str(TOKENIZER))
    hf = {key: value.contiguous() for key, value in adapter.to_hf(state_dict).items()}
    save_file(hf, str(tmp_path / "model.safetensors"))
    adapter.save_hf_metadata(str(tmp_path), "float32")

    common = ("--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS))
    code, out, err = _main(capsys, "--checkpoint", str(tmp_path), *common)
    assert code == 0, err
    assert out == _main(capsys, "--checkpoint", str(checkpoints[20]), *common)[1]


def test_sampling_is_seeded(checkpoints, capsys):
    common = ("--checkpoint", str(checkpoints[20]), "--prompt", PROMPT, "--max-new-tokens", "30")
    common += ("--temperature", "1.0", "--top-k", "50")
    runs = [_main(capsys, *common, "--seed", seed) for seed in ("1", "1", "2")]
    assert [code for code, _, _ in runs] == [0, 0, 0], runs
    assert runs[0][1] == runs[1][1]
    assert runs[0][1] != runs[2][1]


def test_missing_checkpoint_fails_in_one_line():
    result = _cli("--checkpoint", "/no/such/step-7", "--prompt", PROMPT)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "--checkpoint /no/such/step-7 does not exist; pass a step folder" in lines[0]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty folder", "is neither a DCP step folder (no .metadata) nor a Hugging Face folder"),
        ("checkpoint folder", "holds checkpoint steps, not one step; pass one of them, e.g."),
        ("flavor mismatch", "--flavor 0.8B does not match --checkpoint"),
        ("too long", "plus --max-new-tokens 10000000 exceeds the model's max_seq_len"),
    ],
)
def test_bad_input_fails_before_any_weight_is_read(
    case, message, checkpoints, tmp_path, capsys, monkeypatch
):
    import titan_gdn.checkpoint_folders as checkpoint_folders

    def not_reached(*args):
        raise AssertionError("weights read despite bad input")

    monkeypatch.setattr(checkpoint_folders, "read_state_dict", not_reached)
    checkpoint, extra = {
        "empty folder": (tmp_path, ()),
        "checkpoint folder": (checkpoints[20].parent, ()),
        "flavor mismatch": (checkpoints[20], ("--flavor", "0.8B")),
        "too long": (checkpoints[20], ("--max-new-tokens", "10000000")),
    }[case]
    code, out, err = _main(capsys, "--checkpoint", str(checkpoint), "--prompt", PROMPT, *extra)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1, err
    assert message in err, err
    if case == "flavor mismatch":
        assert err.strip().endswith("pass --flavor debugmodel"), err


def test_documents_after_an_end_of_text_follow_a_blank_line():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_gdn.generate import encode_prompt, render

    tokenizer = HuggingFaceTokenizer(str(TOKENIZER))
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    first = tokenizer.encode("\nGood night.", add_bos=False, add_eos=True)
    second = tokenizer.encode("JULIET:\nAy.", add_bos=True, add_eos=False)
    text = render(tokenizer, PROMPT, prompt_ids, first + second)
    assert text == "ROMEO:\nGood night.\n\nJULIET:\nAy."
    assert render(tokenizer, PROMPT, prompt_ids, first[:-1]) == "ROMEO:\nGood night."


def test_a_damaged_checkpoint_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    from tests.test_reliability import _zero_inside

    damaged = tmp_path / "step-10"
    shutil.copytree(checkpoints[10], damaged)
    _zero_inside(damaged / "__0_0.distcp", 4096)
    code, out, err = _main(capsys, "--checkpoint", str(damaged), "--prompt", PROMPT)
    assert code == 2 and not out
    assert err.strip() == (
        f"python -m titan_gdn.generate: error: --checkpoint {damaged} is damaged since it was "
        "saved (__0_0.distcp holds other bytes than were saved (its checksum differs)); pass "
        "another step folder"
    )
