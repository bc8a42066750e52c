"""Sample text from a trained checkpoint, on CPU, in one process.

    python -m titan_gdn.generate --checkpoint outputs/debug_model/checkpoint/step-100 \\
        --prompt "ROMEO:" --max-new-tokens 200 [--temperature 0.8 --top-k 50 --seed 1]

`--checkpoint` is a step folder as the trainer writes it with `checkpoint.enable` (torchtitan
DCP, full or `last_save_model_only`) or a Hugging Face folder (config.json + *.safetensors, as
`checkpoint.last_save_in_hf` exports it). The prompt and the continuation go to stdout; a
summary line goes to stderr. Each new token costs a full forward over the sequence so far (no
KV cache): simple and exact, and fast enough for the small models this is meant to inspect.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

from titan_gdn.checkpoint_folders import (
    DCP,
    HF,
    dcp_model_keys,
    flavors_that_fit,
    hf_model_shapes,
    load_model,
    model_difference,
    step_format,
    step_number,
)
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, qwen3_5_args
from titan_gdn.model.flavors import FROM_HF_CONFIG
from titan_gdn.model.hf_config import CONFIG_JSON, read_config_json
from titan_gdn.model.hf_files import UnreadableWeightsError
from titan_gdn.model.job_checks import tokenizer_id_bound

DEFAULT_FLAVOR = "debugmodel"
DEFAULT_TOKENIZER = "./assets/tokenizer"


class GenerateError(Exception):
    """A bad command line: reported as one line naming the flag and the fix, exit code 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m titan_gdn.generate", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--checkpoint", required=True, help="DCP step folder or HF folder")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (argmax)")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--flavor",
        choices=list(qwen3_5_args),
        default=None,
        help=f"model flavor of a DCP checkpoint (default {DEFAULT_FLAVOR}; {FROM_HF_CONFIG} "
        "reads config.json from --tokenizer); an HF folder's comes from its config.json",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help=f"tokenizer folder (default: the HF folder's own, else {DEFAULT_TOKENIZER})",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating after the end-of-text token (a new document, as in training)",
    )
    return parser.parse_args(argv)


# How the command line names each sampling setting; the trainer's [sample] names them
# `sample.<field> =` (validation.py), with the same rules (`sampling_problems`).
CLI_SAMPLING_NAMES = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
}


def sampling_problems(
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    names: dict[str, str],
    sample_all: str,
) -> list[str]:
    """Sampling settings that would otherwise fail (top_k < 1: an IndexError in `next_token`)
    or sample the wrong tokens (a negative temperature favours the least likely ones), each
    named by `names` (field -> how the caller spells it); `sample_all` is how to sample among
    every token."""
    problems = []
    if max_new_tokens < 0:
        problems.append(f"{names['max_new_tokens']} {max_new_tokens} is negative; pass 0 or more")
    if temperature < 0:
        problems.append(
            f"{names['temperature']} {temperature} is negative; pass 0 (greedy) or a positive value"
        )
    if top_k is not None and top_k < 1:
        problems.append(f"{names['top_k']} {top_k} must be at least 1; {sample_all}")
    return problems


def length_problem(
    prompt_tokens: int, max_new_tokens: int, max_seq_len: int, names: dict[str, str]
) -> str | None:
    """A prompt and continuation longer than the model's max_seq_len (positions it was never
    set up for), named by `names` (field -> how the caller spells it), or None."""
    if prompt_tokens + max_new_tokens <= max_seq_len:
        return None
    return (
        f"{names['prompt']} ({prompt_tokens} tokens) plus {names['max_new_tokens']} "
        f"{max_new_tokens} exceeds the model's max_seq_len {max_seq_len}; lower "
        f"{names['max_new_tokens']} to at most {max(0, max_seq_len - prompt_tokens)} or "
        f"shorten {names['prompt']}"
    )


def check_sampling(args: argparse.Namespace) -> None:
    """Reject sampling settings that would otherwise fail or be ignored mid-generation."""
    problems = sampling_problems(
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        CLI_SAMPLING_NAMES,
        sample_all="omit it to sample all",
    )
    if problems:
        raise GenerateError(problems[0])
    if args.top_k is not None and args.temperature == 0:
        raise GenerateError(
            "--top-k applies to sampling only; pass --temperature T > 0 with it, or drop --top-k"
        )


def checkpoint_format(path: Path) -> str:
    """DCP or HF, from the files the trainer writes, so that a wrong path fails before any
    weights are read."""
    fix = (
        "pass a step folder written with --checkpoint.enable (e.g. "
        "outputs/debug_model/checkpoint/step-100) or a --checkpoint.last_save_in_hf export"
    )
    if not path.exists():
        raise GenerateError(f"--checkpoint {path} does not exist; {fix}")
    try:
        fmt = step_format(path)
    except UnreadableWeightsError as problem:
        raise damaged_hf_folder(path, problem) from None
    if fmt is not None:
        return fmt
    steps = sorted(path.glob("step-*"), key=step_number) if path.is_dir() else []
    if steps:
        raise GenerateError(
            f"--checkpoint {path} holds checkpoint steps, not one step; pass one of them, "
            f"e.g. --checkpoint {steps[-1]}"
        )
    raise GenerateError(
        f"--checkpoint {path} is neither a DCP step folder (no .metadata) nor a Hugging Face "
        f"folder (config.json + *.safetensors); {fix}"
    )


def damaged_hf_folder(path: Path, problem: UnreadableWeightsError) -> GenerateError:
    return GenerateError(
        f"--checkpoint {path} is a damaged Hugging Face folder ({problem}); copy or export it "
        "again, or pass another checkpoint"
    )


def check_intact(path: Path) -> None:
    """A DCP folder whose files changed since the save is refused (titan_gdn.checkpoint)."""
    from titan_gdn.checkpoint import checkpoint_damage

    problems = checkpoint_damage(path)
    if problems:
        raise GenerateError(
            f"--checkpoint {path} is damaged since it was saved ({'; '.join(problems)}); pass "
            "another step folder"
        )


def tokenizer_folder(option: str | None, checkpoint: Path, fmt: str) -> Path:
    """The --tokenizer folder, else an HF checkpoint's own tokenizer, else the bundled one that
    the debug config trains with."""
    if option is not None:
        return Path(option)
    if fmt == HF and (checkpoint / "tokenizer.json").is_file():
        return checkpoint
    return Path(DEFAULT_TOKENIZER)


def model_args(flavor: str | None, checkpoint: Path, fmt: str, tokenizer: Path):
    """The model's shape: an HF folder's config.json unless --flavor names one; a DCP
    checkpoint holds no config, so the flavor (or config.json beside the tokenizer, for
    from_hf_config, as the trainer reads it from model.hf_assets_path)."""
    if flavor is None and fmt == HF:
        return _args_from_config(checkpoint, "--checkpoint")
    if flavor == FROM_HF_CONFIG:
        return _args_from_config(tokenizer, "--tokenizer")
    return copy.deepcopy(qwen3_5_args[flavor or DEFAULT_FLAVOR])


def _args_from_config(folder: Path, flag: str) -> Qwen35ModelArgs:
    path = folder / CONFIG_JSON
    if not path.is_file():
        raise GenerateError(
            f"--flavor {FROM_HF_CONFIG} reads {path}, which does not exist; point {flag} at the "
            "folder with the model's config.json or pass a named --flavor"
        )
    try:
        return Qwen35ModelArgs.from_hf_config(read_config_json(folder))
    except (KeyError, ValueError) as problem:
        raise GenerateError(
            f"{path} (from {flag}) is not a valid Qwen3.5 config ({problem}); pass a named --flavor"
        ) from None


def build_tokenizer(folder: Path, model: Qwen35ModelArgs):
    """torchtitan's HF tokenizer, as the trainer builds it; its ids must fit the vocabulary."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    if not (folder / "tokenizer.json").is_file():
        raise GenerateError(
            f"--tokenizer {folder} has no tokenizer.json; pass the folder the model was trained "
            "with (the config's model.hf_assets_path)"
        )
    tokenizer = HuggingFaceTokenizer(str(folder))
    if tokenizer_id_bound(tokenizer) > model.vocab_size:
        raise GenerateError(
            f"--tokenizer {folder} has ids up to {tokenizer_id_bound(tokenizer) - 1} but the "
            f"model's vocab_size is {model.vocab_size}; pass the model's own tokenizer"
        )
    return tokenizer


def check_shapes(
    found: dict[str, torch.Size], args: Qwen35ModelArgs, flavor: str | None, path: Path
) -> None:
    """Compare the checkpoint's keys and shapes with the flavor's before any weight is read,
    and name the flavor that fits when one does."""
    problem = model_difference(found, args)
    if problem is None:
        return
    fits = flavors_that_fit(found)
    fix = f"pass --flavor {fits[0]}" if fits else "pass the --flavor the model was trained with"
    source = f"--flavor {flavor}" if flavor else f"the config.json of --checkpoint {path}"
    raise GenerateError(f"{source} does not match --checkpoint {path} ({problem}); {fix}")


def next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> int:
    """Argmax at temperature 0; else a draw from softmax(logits / T), over the top k if set."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


@torch.no_grad()
def generate(
    model: Qwen35Model,
    tokenizer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    stop_at_eos: bool = True,
) -> list[int]:
    """The new token ids (without a final end-of-text). Each step runs the whole sequence with
    the trainer's document boundaries (`get_attention_masks`), so text after an end-of-text
    token starts a new document as in training; without `chunked_loss` the model returns
    logits."""
    generator = torch.Generator().manual_seed(seed)
    # The model's device: the trainer samples its model where it trained (titan_gdn.trainer).
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new_ids: list[int] = []
    for _ in range(max_new_tokens):
        masks = model.get_attention_masks(tokens, tokenizer)
        logits = model(tokens, attention_masks=masks)[0, -1].cpu()
        token = next_token(logits, temperature, top_k, generator)
        if stop_at_eos and token == tokenizer.eos_id:
            break
        new_ids.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)
    return new_ids


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """BOS + the prompt's tokens: a document's start as the packed training data has it."""
    return tokenizer.encode(prompt, add_bos=True, add_eos=False)


def render(tokenizer, prompt: str, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The prompt as typed, then the continuation. The continuation is decoded together with the
    prompt's tokens and cut after them, so a character split across the boundary decodes. Past
    an end-of-text token (generation that goes on after it) each new document follows a blank
    line, as documents are separated in a text corpus; decoding alone would run them together."""
    first, *later = _documents(new_ids, tokenizer.eos_id)
    whole = tokenizer.decode(prompt_ids + first)
    head = tokenizer.decode(prompt_ids)
    if whole.startswith(head):
        text = prompt + whole[len(head) :]
    else:
        text = prompt + tokenizer.decode(first)
    return "\n\n".join([text, *(tokenizer.decode(ids) for ids in later)])


def _documents(ids: list[int], eos_id: int) -> list[list[int]]:
    """`ids` split at each end-of-text token (dropped)."""
    documents: list[list[int]] = [[]]
    for token in ids:
        if token == eos_id:
            documents.append([])
        else:
            documents[-1].append(token)
    return documents


def prepare(args: argparse.Namespace):
    """Every check that needs no weights: the path, the shapes against the flavor, the
    tokenizer and the prompt's length. Returns (path, format, model args, tokenizer, ids)."""
    check_sampling(args)
    path = Path(args.checkpoint)
    fmt = checkpoint_format(path)
    tokenizer_path = tokenizer_folder(args.tokenizer, path, fmt)
    margs = model_args(args.flavor, path, fmt, tokenizer_path)
    if fmt == DCP:
        check_intact(path)
        found = {ours: meta.size for ours, (_, meta) in dcp_model_keys(path).items()}
    else:
        try:
            found = hf_model_shapes(path, margs)
        except UnreadableWeightsError as problem:
            raise damaged_hf_folder(path, problem) from None
    check_shapes(found, margs, args.flavor, path)
    tokenizer = build_tokenizer(tokenizer_path, margs)
    prompt_ids = encode_prompt(tokenizer, args.prompt)
    names = {"prompt": "--prompt", **CLI_SAMPLING_NAMES}
    problem = length_problem(len(prompt_ids), args.max_new_tokens, margs.max_seq_len, names)
    if problem:
        raise GenerateError(problem)
    return path, fmt, margs, tokenizer, prompt_ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path, fmt, margs, tokenizer, prompt_ids = prepare(args)
    except GenerateError as error:
        print(f"python -m titan_gdn.generate: error: {error}", file=sys.stderr)
        return 2
    model = load_model(path, fmt, margs)
    start = time.perf_counter()
    new_ids = generate(
        model,
        tokenizer,
        prompt_ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        stop_at_eos=not args.ignore_eos,
    )
    seconds = time.perf_counter() - start
    print(render(tokenizer, args.prompt, prompt_ids, new_ids))
    ended = " (stopped at end-of-text)" if len(new_ids) < args.max_new_tokens else ""
    mode = "greedy" if args.temperature == 0 else f"T={args.temperature} top_k={args.top_k}"
    print(
        f"generated {len(new_ids)} new tokens{ended}, {mode}, in {seconds:.1f} s", file=sys.stderr
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
