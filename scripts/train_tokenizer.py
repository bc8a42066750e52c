"""Train the bundled byte-level BPE tokenizer on the bundled corpus, reproducibly.

    python scripts/train_tokenizer.py                 # rewrites assets/tokenizer/tokenizer.json
    python scripts/train_tokenizer.py --output /tmp/t # writes /tmp/t/tokenizer.json

Byte-level (GPT-2 style): every byte has a token, so decode(encode(text)) == text for any text,
whitespace included. The BPE merges fill the ids below the special tokens of
assets/tokenizer/tokenizer_config.json (`added_tokens_decoder`), which keep their ids there, so
BOS/EOS and every id stay below the debug model's vocab_size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "assets" / "tinyshakespeare.txt"
TOKENIZER_DIR = REPO / "assets" / "tokenizer"


def special_tokens(config_path: Path) -> tuple[list[str], int]:
    """The config's special tokens in id order, and the first one's id. Their ids must follow
    each other without gaps: they are appended right after the learned vocabulary."""
    decoder = json.loads(config_path.read_text())["added_tokens_decoder"]
    ids = sorted(int(token_id) for token_id in decoder)
    if ids != list(range(ids[0], ids[0] + len(ids))):
        raise ValueError(f"{config_path}: added_tokens_decoder ids {ids} are not consecutive")
    return [decoder[str(token_id)]["content"] for token_id in ids], ids[0]


def empty_byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    return tokenizer


def train_tokenizer(
    corpus: Path = CORPUS, config_path: Path = TOKENIZER_DIR / "tokenizer_config.json"
) -> Tokenizer:
    """BPE over the corpus up to the first special token's id, then the special tokens."""
    specials, first_special_id = special_tokens(config_path)
    tokenizer = empty_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=first_special_id,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    learned = tokenizer.get_vocab_size()
    if learned != first_special_id:
        raise ValueError(f"{corpus} gave {learned} tokens, expected {first_special_id}")
    return with_special_tokens_in_vocab(tokenizer, specials, first_special_id)


def with_special_tokens_in_vocab(
    tokenizer: Tokenizer, specials: list[str], first_id: int
) -> Tokenizer:
    """The special tokens as plain vocabulary entries, as the previous bundled file had them:
    HuggingFaceTokenizer makes them special from tokenizer_config.json, finding their ids in
    the vocabulary (so a test can move one by editing the vocabulary alone)."""
    spec = json.loads(tokenizer.to_str())
    for offset, token in enumerate(specials):
        spec["model"]["vocab"][token] = first_id + offset
    return Tokenizer.from_str(json.dumps(spec))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=TOKENIZER_DIR, help="folder to write into")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    path = args.output / "tokenizer.json"
    tokenizer.save(str(path), pretty=True)
    print(f"wrote {path} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
