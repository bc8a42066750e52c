"""Write a tiny random Qwen3.5 checkpoint as transformers saves one, on CPU, with no download.

    python -m titan_gdn.tiny_hf_checkpoint --out ./hf_model [--tokenizer ./assets/tokenizer]

`--out` receives what a Qwen3.5 checkpoint folder holds: `config.json` and `model.safetensors`,
written by transformers' own `Qwen3_5ForCausalLM` from its `Qwen3_5TextConfig` (4 layers, 3
Gated DeltaNet and 1 attention, hidden size 64; weights from transformers' initialisation,
seeded), and the tokenizer files of `--tokenizer`, whose vocabulary the model covers. It stands
in for a real checkpoint when trying the recipes of docs/checkpoints.md on a CPU: import,
fine-tune, export, load back in transformers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path

import torch

DEFAULT_TOKENIZER = "./assets/tokenizer"
# A Qwen3.5 text model at the smallest shape every part keeps its structure in, by part:
# grouped-query attention (4 query heads, 2 KV heads) with partial RoPE,
_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)
_ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)
# Gated DeltaNet with more value heads than key heads,
_GDN_HEADS = dict(linear_num_key_heads=2, linear_num_value_heads=4)
_GDN_DIMS = dict(linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4)
# and 4 layers (3 Gated DeltaNet, 1 attention) around them.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    **_ATTENTION,
    rope_parameters=_ROPE,
    **_GDN_HEADS,
    **_GDN_DIMS,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def write_tiny_checkpoint(out: Path, tokenizer: Path, seed: int = 0) -> None:
    from tokenizers import Tokenizer

    with warnings.catch_warnings():
        # transformers imports FLA, which warns on a machine without a GPU that its Triton
        # kernels fall back to CPU; building and saving the model runs no kernel.
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    config = Qwen3_5TextConfig(
        vocab_size=vocab.get_vocab_size(), **_special_token_ids(vocab, tokenizer), **TINY_SHAPE
    )
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    for path in tokenizer.iterdir():
        if path.is_file():
            shutil.copy(path, out)


def _special_token_ids(vocab, tokenizer: Path) -> dict[str, int]:
    """bos_token_id and eos_token_id of config.json, as a real checkpoint names them: the ids of
    the tokenizer's own BOS and EOS tokens (transformers' generate stops at that EOS)."""
    config_file = tokenizer / "tokenizer_config.json"
    named = json.loads(config_file.read_text()) if config_file.is_file() else {}
    ids = {}
    for role in ("bos", "eos"):
        token = named.get(f"{role}_token")
        token_id = vocab.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids[f"{role}_token_id"] = token_id
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titan_gdn.tiny_hf_checkpoint", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=Path(DEFAULT_TOKENIZER),
        help=f"folder with tokenizer.json, copied into --out (default {DEFAULT_TOKENIZER})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"--tokenizer {args.tokenizer} has no tokenizer.json")
    write_tiny_checkpoint(args.out, args.tokenizer, args.seed)
    print(f"wrote {args.out}: config.json, model.safetensors and the tokenizer of {args.tokenizer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
