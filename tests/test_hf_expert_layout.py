"""MoE checkpoints as transformers saves them: one matrix per expert and projection
(`mlp.experts.{e}.{gate,up,down}_proj.weight`, the Hub's Qwen3-Next layout), where the model
and transformers' modules in memory hold fused `gate_up_proj` / `down_proj`. Imported and
exported through torchtitan's own HF load and save (`CheckpointManager.dcp_load` / `dcp_save`),
the code the trainer runs for `checkpoint.initial_load_in_hf` and `last_save_in_hf`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager, ModelWrapper
from torchtitan.config import ConfigManager

from benchmarks.references import transformers_qwen3_5_module
from tests.conftest import relative_error
from tests.hf_reference import hf_import_arguments, random_hf_moe_model, tiny_moe_hf_config
from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, Qwen35StateDictAdapter

FAMILIES = ["qwen3_next", "qwen3_5_moe"]
REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"
VOCAB = 2048


@pytest.fixture(scope="module")
def hf_modules():
    return {family: transformers_qwen3_5_module(True, family) for family in FAMILIES}


def _saved_hf_model(hf_modules, family: str, folder: Path, seed: int = 0):
    """transformers' tiny model of `family`, in eval mode, and its save_pretrained folder."""
    config = tiny_moe_hf_config(family, vocab_size=VOCAB)
    hf_model = random_hf_moe_model(hf_modules[family], family, config, seed).eval()
    hf_model.save_pretrained(folder, safe_serialization=True)
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)
    return hf_model


def _stored_names(folder: Path) -> list[str]:
    names = []
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as weights:
            names += weights.keys()
    return names


def _checkpointer(model: Qwen35Model, adapter: Qwen35StateDictAdapter):
    """What CheckpointManager.dcp_load / dcp_save read of their manager."""
    return SimpleNamespace(sd_adapter=adapter, states={MODEL: ModelWrapper(model)}, pg=None)


def _import(folder: Path) -> Qwen35Model:
    """The model of `folder`'s config.json with its weights, loaded as the trainer does."""
    args = Qwen35ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    torch.manual_seed(1)
    model = Qwen35Model(args)
    model.init_weights()
    manager = _checkpointer(model, Qwen35StateDictAdapter(args, str(folder)))
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        CheckpointManager.dcp_load(
            manager, manager.states[MODEL].state_dict(), str(folder), True, False
        )
    return model.eval()


def _tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_checkpoint_imports_with_its_logits(hf_modules, family, tmp_path):
    hf_model = _saved_hf_model(hf_modules, family, tmp_path)
    names = _stored_names(tmp_path)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)

    ours = _import(tmp_path)
    tokens = _tokens()
    with torch.no_grad():
        assert relative_error(ours(tokens), hf_model(input_ids=tokens).logits) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_equal_logits(hf_modules, family, tmp_path):
    source, export = tmp_path / "source", tmp_path / "export"
    hf_model = _saved_hf_model(hf_modules, family, source)
    ours = _import(source)
    export.mkdir()
    adapter = Qwen35StateDictAdapter(ours.model_args, str(source))
    manager = _checkpointer(ours, adapter)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        CheckpointManager.dcp_save(
            manager, manager.states[MODEL].state_dict(), str(export), AsyncMode.DISABLED, to_hf=True
        )
    adapter.save_hf_metadata(str(export), "float32")
    # The layout transformers itself writes, tensor for tensor.
    assert sorted(_stored_names(export)) == sorted(_stored_names(source))

    model_cls = type(hf_model)
    exported, info = model_cls.from_pretrained(
        export, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    exported.config._experts_implementation = "eager"
    tokens = _tokens(3)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        assert relative_error(exported.eval()(input_ids=tokens).logits, expected) <= 1e-5
        assert relative_error(ours(tokens), expected) <= 1e-5


def test_qwen3_next_export_without_a_source_checkpoint_is_per_expert(hf_modules, tmp_path):
    """No checkpoint to follow (a run from scratch): Qwen3-Next is written as transformers
    writes it, so that from_pretrained loads it."""
    hf_model = _saved_hf_model(hf_modules, "qwen3_next", tmp_path)
    adapter = Qwen35StateDictAdapter(_import(tmp_path).model_args, None)
    ours = adapter.from_hf(hf_model.state_dict())  # transformers' fused modules in memory
    exported = adapter.to_hf(ours)
    saved = load_file(tmp_path / "model.safetensors")
    assert set(exported) == set(saved)
    for key, value in saved.items():
        assert torch.equal(exported[key], value), key


def _job_config(source: Path, dump: Path):
    return ConfigManager().parse_args(
        [
            "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", str(dump),
            *hf_import_arguments(source),
        ]
    )  # fmt: skip


def test_validation_names_the_tensors_an_hf_import_lacks(hf_modules, tmp_path):
    from titan_gdn.validation import configuration_problems

    source = tmp_path / "hf"
    _saved_hf_model(hf_modules, "qwen3_next", source)
    job_config = _job_config(source, tmp_path / "run")
    assert configuration_problems(job_config, 1) == []  # the per-expert layout as it is

    weights = load_file(source / "model.safetensors")
    gone = sorted(key for key in weights if key.startswith("model.layers.1.mlp.experts.3."))
    save_file({k: v for k, v in weights.items() if k not in gone}, source / "model.safetensors")
    problems = configuration_problems(job_config, 1)
    assert (
        f"checkpoint.initial_load_path = '{source}' lacks 3 tensor(s) that model.flavor = "
        f"'from_hf_config' needs from an HF import: {', '.join(gone)}; use the checkpoint's own "
        "config.json"
    ) in " ".join(problems), problems


@pytest.mark.skipif(torch.accelerator.is_available(), reason="CPU runs (gloo)")
def test_expert_parallel_import_and_export_match_the_single_process_run(hf_modules, tmp_path):
    """Under expert parallel (and FSDP over the context-parallel ranks) the experts are
    DTensors: each rank reads and writes the per-expert matrices of its own experts only."""
    from tests.test_train_moe import MOE_CONFIG
    from tests.test_train_qwen import _finish_side_by_side, _start, _tensorboard

    source = tmp_path / "source"
    _saved_hf_model(hf_modules, "qwen3_next", source)
    common = (
        *hf_import_arguments(source),
        "--checkpoint.last_save_model_only",
        "--checkpoint.last_save_in_hf",
        "--training.steps", "2",
        "--debug.seed", "5",
        "--debug.deterministic",
        "--metrics.enable_tensorboard",
    )  # fmt: skip
    parallel = ("--parallelism.context_parallel_degree", "2")
    parallel += ("--parallelism.expert_parallel_degree", "2")
    runs = _finish_side_by_side(
        [
            _start(tmp_path / "one", *common, config=MOE_CONFIG),
            _start(tmp_path / "ep2", *common, *parallel, ngpu=2, config=MOE_CONFIG),
        ]
    )
    for code, output, _ in runs:
        assert code == 0, output[-6000:]
    tag = "loss_metrics/global_avg_loss"
    single, sharded = (_tensorboard(tmp_path / run)[tag] for run in ("one", "ep2"))
    assert sorted(single) == sorted(sharded) == [1, 2]
    for step, loss in single.items():
        assert abs(sharded[step] - loss) <= 1e-5 * loss, (step, sharded[step], loss)

    exports = [tmp_path / run / "checkpoint" / "step-2" for run in ("one", "ep2")]
    weights = [{}, {}]
    for export, found in zip(exports, weights, strict=True):
        assert sorted(_stored_names(export)) == sorted(_stored_names(source))
        for path in export.glob("*.safetensors"):
            found.update(load_file(path))
    for key, value in weights[0].items():
        assert relative_error(weights[1][key], value) <= 1e-4, key
