"""Checkpoint folders and the model read from them, for every part that looks at one: the config
check (`validation`), the trainer and its checkpoint manager (`checkpoint`: which step a resume
loads) and `generate` (a step folder's format, shapes and weights).

A job's checkpoints are `step-N` folders in `job.dump_folder`/`checkpoint.folder`. A step is
torchtitan's DCP (`.metadata`, which DCP writes last, by an atomic rename: a folder without it
was interrupted mid-write, and torchtitan's CheckpointManager._find_load_step passes it over) or
a Hugging Face export (`checkpoint.last_save_in_hf`: safetensors and their index).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, Qwen35StateDictAdapter, qwen3_5_args
from titan_gdn.model.flavors import FROM_HF_CONFIG
from titan_gdn.model.hf_config import CONFIG_JSON, HF_INDEX
from titan_gdn.model.hf_files import safetensors_files, safetensors_shapes

DCP, HF = "dcp", "hf"
DCP_METADATA = ".metadata"
# What a full checkpoint holds beside the model (torchtitan's CheckpointManager._states_to_load);
# the model's own keys sit beside these, flattened (`_flattened_model_states_sd`), possibly
# under a `model.` prefix.
TRAINING_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
_MODEL_PREFIX = "model."
_STEP_FOLDER = re.compile(r"step-(\d+)")


# A job's step folders


def checkpoint_folder(job_config) -> Path:
    return Path(job_config.job.dump_folder) / job_config.checkpoint.folder


def step_folder(folder: str | os.PathLike, step: int) -> Path:
    """Where torchtitan writes step `step` of the checkpoints in `folder`."""
    return Path(folder) / f"step-{step}"


def step_number(path: Path) -> int:
    """N of a `step-N` folder, -1 for any other name."""
    match = _STEP_FOLDER.fullmatch(path.name)
    return int(match.group(1)) if match else -1


def checkpoint_steps(folder: str | os.PathLike) -> tuple[list[int], list[int]]:
    """(complete, incomplete) step numbers of the `step-N` folders in `folder`, sorted.
    Resume loads the largest complete one; an incomplete one was interrupted while written."""
    complete, incomplete = [], []
    folder = Path(folder)
    if not folder.is_dir():
        return complete, incomplete
    for entry in folder.iterdir():
        step = step_number(entry)
        if step >= 0 and entry.is_dir():
            done = any((entry / marker).is_file() for marker in (DCP_METADATA, HF_INDEX))
            (complete if done else incomplete).append(step)
    return sorted(complete), sorted(incomplete)


def latest_complete_checkpoint(job_config) -> Path | None:
    """The checkpoint a rerun of this job resumes from, or None."""
    complete, _ = checkpoint_steps(checkpoint_folder(job_config))
    return step_folder(checkpoint_folder(job_config), complete[-1]) if complete else None


# One step folder


def step_format(path: Path) -> str | None:
    """DCP or HF from the files the trainer writes (no weight read), None for neither."""
    if path.is_dir() and (path / DCP_METADATA).is_file():
        return DCP
    if path.is_dir() and (path / CONFIG_JSON).is_file() and safetensors_files(path):
        return HF
    return None


def saved_states(folder: Path) -> set[str] | None:
    """The top-level names in a DCP checkpoint (model keys and training states), or None when
    its metadata cannot be read."""
    try:
        keys = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception:  # unpickling errors of every kind
        return None
    return {key.split(".", 1)[0] for key in keys}


def saved_data_parallel_ranks(folder: Path) -> int | None:
    """How many data-parallel ranks wrote the data loader's position in a DCP checkpoint, or
    None when it holds none or cannot be read."""
    state = {"dataloader": {"world_size": -1}}
    try:
        with warnings.catch_warnings():
            # Read before the process group exists, on purpose: each rank reads one entry.
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    except (Exception, CheckpointException):  # DCP's own is a BaseException
        return None
    return state["dataloader"]["world_size"]


# The model in a step folder


def dcp_model_keys(path: Path) -> dict[str, tuple[str, TensorStorageMetadata]]:
    """{our key: (key in the checkpoint, its size and dtype)} from a DCP checkpoint's metadata
    alone. The model's keys are its state_dict keys (possibly under a `model.` prefix); a full
    checkpoint's optimizer, scheduler, data loader and step state are left out."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    training_state = tuple(f"{state}." for state in TRAINING_STATES)
    keys = {}
    for key, meta in metadata.items():
        if isinstance(meta, TensorStorageMetadata) and not key.startswith(training_state):
            keys[key.removeprefix(_MODEL_PREFIX)] = (key, meta)
    return keys


def hf_model_shapes(path: Path, args: Qwen35ModelArgs) -> dict[str, torch.Size]:
    """Our keys' shapes in an HF folder, from the safetensors headers (no weights read)."""
    shapes = safetensors_shapes(safetensors_files(path))
    meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
    return {key: value.shape for key, value in _adapter(args).from_hf(meta).items()}


def gib(size: int) -> str:
    """A checkpoint's or a disk's size, as the messages about them print it."""
    return f"{size / 2**30:.2f} GiB"


def expected_shapes(args: Qwen35ModelArgs) -> dict[str, torch.Size]:
    """The state dict's shapes for `args`, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        return {key: value.shape for key, value in Qwen35Model(args).state_dict().items()}


def model_difference(found: dict[str, torch.Size], args: Qwen35ModelArgs) -> str | None:
    """The first way a checkpoint's {key: shape} is not the model of `args`, or None."""
    expected = expected_shapes(args)
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing:
        return f"{len(missing)} of the model's weights are missing, e.g. {missing[0]}"
    if extra:
        return f"{len(extra)} weights are not the model's, e.g. {extra[0]}"
    for key, shape in expected.items():
        if tuple(found[key]) != tuple(shape):
            return f"{key} is {list(found[key])} there but {list(shape)} in the model"
    return None


def flavors_that_fit(found: dict[str, torch.Size]) -> list[str]:
    """The named flavors whose model the checkpoint's {key: shape} is."""
    return [
        name
        for name, args in qwen3_5_args.items()
        if name != FROM_HF_CONFIG and model_difference(found, args) is None
    ]


def read_state_dict(path: Path, fmt: str, args: Qwen35ModelArgs) -> dict[str, torch.Tensor]:
    """Every model weight, on CPU, with no process group (dcp.load runs without one)."""
    if fmt == HF:
        hf = {}
        for file in safetensors_files(path):
            hf.update(load_file(file))
        return _adapter(args).from_hf(hf)
    keys = dcp_model_keys(path)
    stored = {
        stored_key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for stored_key, meta in keys.values()
    }
    with warnings.catch_warnings():
        # The single-process load is the intent here, not a missing init_process_group.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(stored, checkpoint_id=str(path))
    return {ours: stored[stored_key] for ours, (stored_key, _) in keys.items()}


def load_model(path: Path, fmt: str, args: Qwen35ModelArgs) -> Qwen35Model:
    """The model in eval mode with the checkpoint's weights (float32, CPU). Built on the meta
    device and materialized empty: every parameter is then overwritten, so init is skipped."""
    with torch.device("meta"):
        model = Qwen35Model(args)
    model.to_empty(device="cpu")
    if args.enable_weight_tying:
        # to_empty gives each module its own new Parameter, which unties them (as in
        # Qwen35Model.init_weights).
        model.output.weight = model.tok_embeddings.weight
    state_dict = read_state_dict(path, fmt, args)
    model.load_state_dict({key: value.float() for key, value in state_dict.items()}, strict=True)
    return model.eval()


def _adapter(args: Qwen35ModelArgs) -> Qwen35StateDictAdapter:
    # The text layout (`model.*`) is assumed; from_hf reads both it and the multimodal one.
    return Qwen35StateDictAdapter(args, None)


def resume_hint(checkpointing: bool, last_checkpoint: Path | None) -> str:
    """How a rerun of the same command goes on, as every stop message says it."""
    if not checkpointing:
        return "checkpointing is off ([checkpoint] enable): a rerun starts at step 1"
    if last_checkpoint is None:
        return "no checkpoint was written yet: a rerun starts at step 1"
    return f"the same command resumes from {last_checkpoint}"
