"""The bundled tokenizer: byte-level, so text survives a round trip whitespace and all; rebuilt
byte for byte by scripts/train_tokenizer.py; its ids fit the debug model's vocabulary."""

import json
from pathlib import Path

from torchtitan.components.tokenizer import HuggingFaceTokenizer

from scripts.train_tokenizer import CORPUS, TOKENIZER_DIR, train_tokenizer
from titan_gdn.model.flavors import qwen3_5_args
from titan_gdn.model.job_checks import tokenizer_id_bound


def _bundled() -> HuggingFaceTokenizer:
    # As the trainer loads it: model.hf_assets_path = "./assets/tokenizer".
    return HuggingFaceTokenizer(str(TOKENIZER_DIR))


def test_the_whole_corpus_round_trips():
    tokenizer = _bundled()
    text = CORPUS.read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_bos=False, add_eos=False)
    assert tokenizer.decode(ids) == text
    # Merges learned: far fewer tokens than bytes (a byte per token would be 1,115,394).
    assert len(ids) < len(text) // 2


def test_whitespace_and_unseen_characters_survive():
    tokenizer = _bundled()
    for text in ["a b\nc", "  two  spaces\n\n\tand a tab ", "caf\u00e9 \u2603 \U0001f600"]:
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False, add_eos=False)) == text


def test_documents_are_framed_by_bos_and_eos():
    tokenizer = _bundled()
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert tokenizer.bos_token == config["bos_token"] == "<|begin_of_text|>"
    assert tokenizer.eos_token == config["eos_token"] == "<|end_of_text|>"
    ids = tokenizer.encode("ROMEO:", add_bos=True, add_eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ROMEO:"
    # The special tokens keep the ids tokenizer_config.json gives them.
    for token_id, entry in config["added_tokens_decoder"].items():
        assert tokenizer.token_to_id(entry["content"]) == int(token_id)


def test_ids_fit_the_debug_model_vocabulary():
    tokenizer = _bundled()
    debug_vocab = qwen3_5_args["debugmodel"].vocab_size
    assert tokenizer_id_bound(tokenizer) <= debug_vocab
    assert max(tokenizer.get_vocab().values()) < debug_vocab


def test_the_script_reproduces_the_bundled_tokenizer(tmp_path: Path):
    path = tmp_path / "tokenizer.json"
    train_tokenizer().save(str(path), pretty=True)
    assert path.read_bytes() == (TOKENIZER_DIR / "tokenizer.json").read_bytes()
