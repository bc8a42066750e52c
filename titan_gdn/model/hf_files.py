"""The weight files of a Hugging Face checkpoint folder and the tensor names and shapes they
hold, read from the safetensors headers alone, for every part that looks at one: the state dict
adapter (which expert layout a folder stores), the config check, the trainer and `generate`."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from titan_gdn.model.hf_config import HF_INDEX


class UnreadableWeightsError(ValueError):
    """An HF folder's weights that cannot be read: a file its index names is missing, a file is
    cut short or not safetensors, or the index is not JSON. The message names the file; the
    caller adds the setting that pointed at the folder."""


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of an HF folder: those its index names, else the top-level ones
    (torchtitan's export also leaves per-rank shards in a `sharded/` subfolder)."""
    folder = Path(folder)
    index = folder / HF_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise UnreadableWeightsError(
                f"{HF_INDEX} is not a safetensors index ({type(error).__name__}: {error})"
            ) from None
        return [folder / name for name in names]
    return sorted(folder.glob("*.safetensors"))


def safetensors_shapes(files) -> dict[str, list[int]]:
    """Every tensor's name and shape in safetensors `files`, from their headers alone. A file
    that is missing or damaged raises UnreadableWeightsError, not safetensors' own error: the
    header check also finds a file cut short (its data shorter than the header says)."""
    shapes = {}
    for path in map(Path, files):
        try:
            with safe_open(str(path), framework="pt") as weights:
                for key in weights.keys():
                    shapes[key] = weights.get_slice(key).get_shape()
        except FileNotFoundError:
            named = f", which {HF_INDEX} names," if (path.parent / HF_INDEX).is_file() else ""
            raise UnreadableWeightsError(f"{path.name}{named} is missing") from None
        except (SafetensorError, OSError) as error:
            raise UnreadableWeightsError(
                f"{path.name} cannot be read ({error}): it is cut short or not a safetensors file"
            ) from None
    return shapes
