"""RoPE scaling in config.json (YaRN, linear, ...) is refused by name: the model rotates by
unscaled RoPE only, and would otherwise train without the scaling and export without it.
Unscaled configs as transformers and the published checkpoints write them still import."""

from __future__ import annotations

import pytest

from tests.hf_reference import tiny_hf_config
from titan_gdn.model import Qwen35ModelArgs

_DEFAULT = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)
_YARN = dict(_DEFAULT, rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rope_parameters": _YARN}, "config.json rope_parameters.rope_type = 'yarn'"),
        # The field and key before transformers 5.
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1e7},
            "config.json rope_scaling.rope_type = 'linear'",
        ),
    ],
)
def test_scaled_rope_is_refused_naming_the_field_and_value(fields, named):
    config = {k: v for k, v in tiny_hf_config(tied=True).items() if k != "rope_parameters"}
    with pytest.raises(ValueError) as error:
        Qwen35ModelArgs.from_hf_config({**config, **fields})
    assert str(error.value).startswith(
        f'{named}: titan_gdn supports only unscaled RoPE (rope_type "default")'
    ), error.value


def test_scaled_rope_in_a_multimodal_text_config_names_its_path():
    multimodal = {
        "model_type": "qwen3_5",
        "text_config": tiny_hf_config(tied=True, rope_parameters=_YARN),
    }
    with pytest.raises(ValueError, match=r"^config.json text_config.rope_parameters.rope_type"):
        Qwen35ModelArgs.from_hf_config(multimodal)


def test_unscaled_rope_as_published_checkpoints_write_it_imports():
    plain = Qwen35ModelArgs.from_hf_config(tiny_hf_config(tied=True))
    # Qwen3.5's multimodal text_config: default RoPE with its image-position (mrope) fields.
    mrope = dict(_DEFAULT, mrope_section=[11, 11, 10], mrope_interleaved=True)
    multimodal = {
        "model_type": "qwen3_5",
        "text_config": tiny_hf_config(tied=True, rope_parameters=mrope),
        "vision_config": {"rope_parameters": {"rope_type": "axial", "rope_theta": 1e4}},
    }
    assert Qwen35ModelArgs.from_hf_config(multimodal) == plain
    # Qwen3-Next as transformers 4 wrote it: the rope fields at the top, rope_scaling null.
    config = {k: v for k, v in tiny_hf_config(tied=True).items() if k != "rope_parameters"}
    legacy = {**config, "rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_scaling": None}
    assert Qwen35ModelArgs.from_hf_config(legacy) == plain
