"""A multimodal Qwen3.5 checkpoint as transformers saves it, imported and exported: the output
projection tied or not as transformers reads it (the top-level setting, not text_config's), and
the tensors this model does not train (the vision tower, MTP heads) kept in the export, so that
transformers loads it whole, with the source's vision weights, not a tower initialised at random."""

import json
import shutil
import warnings

import torch
from safetensors.torch import load_file, save_file

from tests.test_reliability import TOKENIZER
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, Qwen35StateDictAdapter
from titan_gdn.model.hf_config import HF_INDEX
from titan_gdn.tiny_hf_checkpoint import TINY_SHAPE


def _multimodal_checkpoint(folder):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
        patch_size=4, temporal_patch_size=1, num_position_embeddings=16,
    )  # fmt: skip
    # Untied at the top level, which is what transformers reads; text_config says tied.
    text = dict(TINY_SHAPE, vocab_size=2048, tie_word_embeddings=True)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(folder)
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)


def _export(source, folder):
    """What `checkpoint.last_save_in_hf` writes (safetensors and their index), then the
    trainer's completion of the folder."""
    args = Qwen35ModelArgs.from_hf_config(json.loads((source / "config.json").read_text()))
    adapter = Qwen35StateDictAdapter(args, str(source))
    model = Qwen35Model(args)
    model.load_state_dict(adapter.from_hf(load_file(source / "model.safetensors")))
    hf = {key: value.contiguous() for key, value in adapter.to_hf(model.state_dict()).items()}
    folder.mkdir()
    name = "model-00001-of-00001.safetensors"  # torch's HF writer's name for one file
    save_file(hf, folder / name)
    index = {"metadata": {}, "weight_map": dict.fromkeys(hf, name)}
    (folder / HF_INDEX).write_text(json.dumps(index))
    adapter.save_hf_metadata(str(folder), "float32")


def test_the_export_of_a_multimodal_import_loads_with_its_vision_tower(tmp_path):
    from transformers import AutoModelForImageTextToText

    source, export = tmp_path / "source", tmp_path / "export"
    _multimodal_checkpoint(source)
    _export(source, export)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded, info = AutoModelForImageTextToText.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    stored = load_file(source / "model.safetensors")
    assert torch.equal(loaded.state_dict()["lm_head.weight"], stored["lm_head.weight"])
    visual = {name: value for name, value in stored.items() if name.startswith("model.visual.")}
    assert visual
    weights = loaded.state_dict()
    for name, value in visual.items():
        assert torch.equal(weights[name], value), name
