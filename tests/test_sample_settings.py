"""[sample] settings are checked with the job config, by generate's rules: a bad one would
otherwise fail (or sample the wrong tokens) after the whole run."""

from __future__ import annotations

import pytest

from tests.test_reliability import _job_config, _problems


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            ("--sample.top_k", "0"),
            "sample.top_k = 0 must be at least 1; the vocabulary size or more samples among all "
            'tokens; sample.prompt = "" takes no sample',
        ),
        (
            ("--sample.temperature", "-1"),
            "sample.temperature = -1.0 is negative; pass 0 (greedy) or a positive value",
        ),
        (
            ("--sample.max_new_tokens", "-5"),
            "sample.max_new_tokens = -5 is negative; pass 0 or more",
        ),
    ],
)
def test_bad_sample_settings_are_refused_before_training(override, problem, tmp_path):
    job_config = _job_config("--job.dump_folder", str(tmp_path), *override)
    assert job_config.sample.prompt  # the debug config samples after training
    assert _problems(job_config) == [problem]


def test_sample_settings_are_not_checked_without_a_prompt(tmp_path):
    from titan_gdn.validation import validate_job_config

    job_config = _job_config(
        "--job.dump_folder", str(tmp_path), "--sample.prompt", "", "--sample.top_k", "0"
    )
    validate_job_config(job_config, world_size=1)  # no sample is taken: top_k is unused


def test_a_sample_longer_than_max_seq_len_is_refused_before_training(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_gdn.validation import validate_job_config

    seq_len = 128  # the debug config's training.seq_len
    job_config = _job_config("--job.dump_folder", str(tmp_path), "--model.max_seq_len", "128")
    tokenizer = HuggingFaceTokenizer(job_config.model.hf_assets_path)
    room = seq_len - len(tokenizer.encode(job_config.sample.prompt, add_bos=True, add_eos=False))
    assert 0 < room < seq_len
    job_config.sample.max_new_tokens = room
    validate_job_config(job_config, world_size=1)  # prompt + continuation fill max_seq_len
    job_config.sample.max_new_tokens = room + 1
    [problem] = _problems(job_config)
    assert f"plus sample.max_new_tokens {room + 1} exceeds the model's max_seq_len 128" in problem
    assert f"lower sample.max_new_tokens to at most {room}" in problem
    assert problem.endswith("or raise model.max_seq_len")


def test_the_command_line_keeps_its_own_names_for_the_same_rules():
    from titan_gdn.generate import GenerateError, check_sampling, parse_args

    args = parse_args(["--checkpoint", "x", "--prompt", "p", "--temperature", "1", "--top-k", "0"])
    with pytest.raises(GenerateError, match=r"^--top-k 0 must be at least 1; omit it to sample"):
        check_sampling(args)
