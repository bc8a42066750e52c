"""Training the qwen3_5 debug model with torchtitan's trainer (run_train.sh, CPU + gloo).

FSDP over two ranks, exact resume from a checkpoint, the HF round trip (import a transformers
checkpoint, train, export, load it back in transformers), the documents-per-step metric in the
log line and TensorBoard, and bad settings that must fail before the first step.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import relative_error
from tests.hf_reference import hf_import_arguments, random_hf_model, tiny_hf_config

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"
DEBUG_CONFIG = REPO / "train_configs" / "debug_model.toml"
# torchtitan's log line, with the documents field titan_gdn adds (colors off).
STEP_LOG = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+).*?docs:\s*([0-9.,]+)"
)
# torchrun's prefix on the lines of a rank other than 0.
OTHER_RANK = re.compile(r"\[rank[1-9]\d*\]:")
SMALL = (
    "--training.seq_len", "128",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--metrics.disable_color_printing",
    "--sample.prompt", "",  # no sample at the end (tests/test_quickstart.py checks it)
)  # fmt: skip

pytestmark = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="CPU runs (gloo); GPU runs live in tests/gpu"
)


def _start(dump: Path, *overrides: str, ngpu: int = 1, config: Path = DEBUG_CONFIG):
    """run_train.sh with `overrides`, started, showing every rank's output (a rank that fails,
    even at exit, must show why)."""
    every_rank = ",".join(str(rank) for rank in range(ngpu))
    env = {**os.environ, "NGPU": str(ngpu), "CONFIG_FILE": str(config), "LOG_RANK": every_rank}
    command = ["bash", "run_train.sh", "--job.dump_folder", str(dump), *SMALL, *overrides]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(process: subprocess.Popen, timeout: int = 300):
    """(exit code, output, {step: (loss str, docs)}) of a started run, with the steps read from
    rank 0's lines."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    output = stdout + stderr
    rank0 = "\n".join(line for line in output.splitlines() if not OTHER_RANK.match(line))
    steps = {
        int(s): (loss, float(docs.replace(",", ""))) for s, loss, _, docs in STEP_LOG.findall(rank0)
    }
    return process.returncode, output, steps


def _train(
    dump: Path, *overrides: str, ngpu: int = 1, config: Path = DEBUG_CONFIG, timeout: int = 300
):
    """run_train.sh with `overrides`, to its end: see `_finish`."""
    return _finish(_start(dump, *overrides, ngpu=ngpu, config=config), timeout)


def _train_ok(dump: Path, *overrides: str, ngpu: int = 1, timeout: int = 300):
    code, output, steps = _train(dump, *overrides, ngpu=ngpu, timeout=timeout)
    assert code == 0, output[-6000:]
    return output, steps


def _finish_side_by_side(processes: list[subprocess.Popen]) -> list:
    """`_finish` of runs started together: runs of one process keep one core busy each, and
    the config check that ends a bad run is one process, so two or more of them take little
    longer than one on two cores."""
    try:
        # Each read in a thread of its own: a run whose output nobody reads stops at a full pipe.
        with ThreadPoolExecutor(len(processes)) as readers:
            return list(readers.map(_finish, processes))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _train_side_by_side(*runs: tuple[Path, tuple[str, ...]]) -> list[tuple[str, dict]]:
    """Independent one-process runs (dump folder, overrides), started together, each checked
    and returned as `_train_ok` does."""
    results = _finish_side_by_side([_start(dump, *overrides) for dump, overrides in runs])
    for code, output, _ in results:
        assert code == 0, output[-6000:]
    return [(output, steps) for _, output, steps in results]


def _tensorboard(dump: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from every TensorBoard event file of a run (float32 values, as
    written, so a loss compares exactly)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    scalars: dict[str, dict[int, float]] = defaultdict(dict)
    for path in sorted(dump.glob("tb/**/events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.HasField("tensor"):
                    scalars[value.tag][event.step] = value.tensor.float_val[0]
                else:
                    scalars[value.tag][event.step] = value.simple_value
    return scalars


def _first_rows(seq_len: int, rows: int, dp_rank: int = 0, dp_world_size: int = 1):
    """The first `rows` packed rows (inputs, labels) that data-parallel rank `dp_rank` trains on."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from titan_gdn.data import PackedDocumentDataset, build_document_source

    tokenizer = HuggingFaceTokenizer(str(TOKENIZER))
    dataset = PackedDocumentDataset(
        build_document_source("tinyshakespeare", None),
        tokenizer,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=True,
    )
    samples = [sample for sample, _ in zip(dataset, range(rows), strict=False)]
    inputs = torch.stack([inp["input"] for inp, _ in samples])
    labels = torch.stack([lab for _, lab in samples])
    return inputs, labels, tokenizer.eos_id


def test_fsdp_on_two_ranks_trains_and_logs_documents_per_step(tmp_path):
    steps = 4
    output, log = _train_ok(
        tmp_path, "--training.steps", str(steps), "--metrics.enable_tensorboard", ngpu=2
    )
    assert "Applied FSDP" in output and "dp_shard=2" in output, output[-6000:]
    assert sorted(log) == list(range(1, steps + 1)), output[-6000:]
    # Nothing a user cannot act on: DTensor's RNG caveats on a CPU mesh, the timeouts torch
    # cannot set on torchtitan's placeholder groups, a warm-up longer than the run reported
    # shortened and then as configured, the tokenizer read twice, an empty trace folder.
    assert "may not have complete support on cpu device mesh" not in output, output[-6000:]
    assert "Set timeout is now only supported" not in output, output[-6000:]
    assert "exceed total steps" not in output and f"total steps {steps} (warmup {steps})" in output
    assert output.count("Loading tokenizer from") == 2, output[-6000:]  # one per rank
    assert not (tmp_path / "comm_traces").exists()
    assert float(log[steps][0]) < float(log[1][0]), log

    # Documents per step: both ranks' rows (2 each), summed, in the log line and TensorBoard.
    rows = [_first_rows(128, 2 * steps, rank, 2) for rank in (0, 1)]
    from titan_gdn.data import documents_per_row

    expected = {
        step: sum(
            documents_per_row(inputs[2 * step - 2 : 2 * step], eos) for inputs, _, eos in rows
        )
        for step in range(1, steps + 1)
    }
    assert {step: docs for step, (_, docs) in log.items()} == expected
    tensorboard = _tensorboard(tmp_path)
    assert tensorboard["documents_per_step"] == expected
    assert set(tensorboard["loss_metrics/global_avg_loss"]) == set(range(1, steps + 1))


def test_resumed_run_continues_with_the_uninterrupted_losses(tmp_path):
    n, k = 6, 3
    common = (
        "--checkpoint.enable",
        "--checkpoint.interval", str(k),
        "--checkpoint.no-last-save-model-only",  # full state: optimizer, lr, data, step
        "--lr_scheduler.total_steps", str(n),  # the same schedule when stopped at k
        "--debug.seed", "7",
        "--debug.deterministic",
        "--metrics.enable_tensorboard",
    )  # fmt: skip
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    (_, whole_log), (_, first_log) = _train_side_by_side(
        (whole, (*common, "--training.steps", str(n))),
        (stopped, (*common, "--training.steps", str(k))),
    )
    output, resumed_log = _train_ok(stopped, *common, "--training.steps", str(n))

    assert f"Training starts at step {k + 1}" in output, output[-6000:]
    assert sorted(whole_log) == list(range(1, n + 1))
    assert sorted(first_log) == list(range(1, k + 1))
    assert sorted(resumed_log) == list(range(k + 1, n + 1))
    # The printed 5-decimal losses and document counts, then the float32 values in TensorBoard.
    assert {**first_log, **resumed_log} == whole_log
    whole_tb, stopped_tb = _tensorboard(whole), _tensorboard(stopped)
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "documents_per_step", "lr"):
        assert stopped_tb[tag] == whole_tb[tag], (tag, stopped_tb[tag], whole_tb[tag])
    assert float(whole_log[n][0]) < float(whole_log[1][0])


def _five_steps_from_one_seed_checkpoint(train_ok, tmp_path) -> tuple[str, ...]:
    """Writes a seed checkpoint (one rank) with `train_ok` under tmp_path/seed; the arguments
    that train 5 steps from it, with TensorBoard on (the runs to compare give it their layout)."""
    seed_run = (
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--parallelism.data_parallel_shard_degree", "1",
    )  # fmt: skip
    train_ok(tmp_path / "seed", *seed_run)
    return (
        "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0"),
        "--checkpoint.interval", "1000",
        "--training.steps", "5",
        "--metrics.enable_tensorboard",
    )  # fmt: skip


@pytest.fixture(scope="module")
def single_process_from_seed(tmp_path_factory):
    """The run the context-parallel runs must reproduce: one process, 5 steps from a seed
    checkpoint (on a CPU mesh sharded init differs by rank count). Returns the arguments that
    train 5 steps from that seed, the run's logged steps and its TensorBoard ({tag: {step:
    value}})."""
    root = tmp_path_factory.mktemp("from_seed")
    common = _five_steps_from_one_seed_checkpoint(_train_ok, root)
    _, single = _train_ok(root / "cp1", *common)
    return common, single, _tensorboard(root / "cp1")


def _assert_metrics_of_the_single_process_run(sharded: dict, single: dict, steps) -> None:
    """The losses, and the metrics that count the rows: the max over data-parallel ranks of
    their loss (one here: the average) and the tokens seen, counted once for all of a row's
    context-parallel ranks."""
    for tag in ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss"):
        for step in steps:
            expected = single["loss_metrics/global_avg_loss"][step]
            assert abs(sharded[tag][step] - expected) <= 1e-4 * expected, (tag, step, sharded)
    assert {step: sharded["n_tokens_seen"][step] for step in steps} == {
        step: single["n_tokens_seen"][step] for step in steps
    }


def test_context_parallel_run_gives_the_losses_of_the_single_process_run(
    single_process_from_seed, tmp_path
):
    """run_train.sh with cp=2 (2 ranks) vs cp=1 (1 rank), both from one seed checkpoint and the
    same global batch."""
    common, single, reference = single_process_from_seed
    _, sharded = _train_ok(
        tmp_path / "cp2", *common, "--parallelism.context_parallel_degree", "2", ngpu=2
    )
    assert sorted(single) == sorted(sharded) == [1, 2, 3, 4, 5]
    metrics = _tensorboard(tmp_path / "cp2")
    _assert_metrics_of_the_single_process_run(metrics, reference, range(1, 6))
    losses = metrics["loss_metrics/global_avg_loss"]
    assert losses[5] < losses[1]


def test_eight_rank_context_parallel_run_gives_the_losses_of_the_single_process_run(
    single_process_from_seed, tmp_path
):
    """run_train.sh at cp=8 with the default settings: the debug model's 4 key heads do not
    split 8 ways, so `context_parallel_mode = "auto"` runs heads 4 x states 2 (logged), and the
    losses are cp=1's from one seed checkpoint: the first 3 of its 5 steps, on the same 5-step
    learning-rate schedule (eight processes on two cores are slow)."""
    common, _, reference = single_process_from_seed
    # Eight processes on the CI's two cores: slower to start than the others.
    output, sharded = _train_ok(
        tmp_path / "cp8",
        *common,
        "--training.steps", "3",
        "--lr_scheduler.total_steps", "5",
        "--parallelism.context_parallel_degree", "8",
        ngpu=8,
        timeout=900,
    )  # fmt: skip
    assert "Context parallel over 8 ranks: heads 4 x states 2" in output
    assert sorted(sharded) == [1, 2, 3]
    _assert_metrics_of_the_single_process_run(_tensorboard(tmp_path / "cp8"), reference, (1, 2, 3))


def _hf_document_loss(hf_model, inputs, labels, eos_id) -> float:
    """transformers' mean next-token loss on packed rows, each document run on its own (as
    titan_gdn's document boundaries make the packed forward)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row, row_labels in zip(inputs, labels, strict=True):
            ends = (row == eos_id).nonzero().flatten().add(1).tolist()
            bounds = [0, *[e for e in ends if e < len(row)], len(row)]
            for start, end in zip(bounds, bounds[1:], strict=False):
                logits = hf_model(input_ids=row[None, start:end]).logits[0]
                total += F.cross_entropy(logits, row_labels[start:end], reduction="sum").item()
                count += end - start
    return total / count


def _hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for path in folder.glob("*.safetensors"):
        weights.update(load_file(path))
    return weights


def _dcp_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model-only DCP checkpoint, each in its own storage."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    weights = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in metadata.items()
    }
    dcp.load(weights, checkpoint_id=str(folder))
    return weights


def test_hf_checkpoint_imports_trains_and_exports_for_transformers(hf_qwen3_5, tmp_path):
    from titan_gdn.model import Qwen35Model, Qwen35ModelArgs, Qwen35StateDictAdapter

    # A transformers checkpoint folder as users get it: weights, config.json, tokenizer.
    config = tiny_hf_config(tied=True, vocab_size=2048)
    hf_model = random_hf_model(hf_qwen3_5, config, seed=21).eval()
    source = tmp_path / "hf_source"
    hf_model.save_pretrained(source, safe_serialization=True)
    for tokenizer_file in TOKENIZER.iterdir():
        shutil.copy(tokenizer_file, source)

    # The model comes from config.json (flavor from_hf_config), its weights from the
    # safetensors; two identical deterministic runs end in an HF export and in a DCP checkpoint.
    seq_len, batch, steps = 128, 2, 2
    common = (
        *hf_import_arguments(source),
        "--checkpoint.last_save_model_only",
        "--training.steps", str(steps),
        "--debug.seed", "5",
        "--debug.deterministic",
        "--metrics.enable_tensorboard",
    )  # fmt: skip
    (output, log), (_, dcp_log) = _train_side_by_side(
        (tmp_path / "hf", (*common, "--checkpoint.last_save_in_hf")), (tmp_path / "dcp", common)
    )
    assert f"loading from HF safetensors from --checkpoint.initial_load_path: {source}" in output
    # The flavor read config.json: the model's arguments, as the trainer writes them.
    model_args = json.loads((tmp_path / "hf" / "model_args.json").read_text())
    assert (model_args["vocab_size"], model_args["dim"]) == (2048, 64)
    assert dcp_log == log

    # Step 1's loss is the imported model's: transformers' loss on the same first batch.
    inputs, labels, eos_id = _first_rows(seq_len, batch)
    hf_loss = _hf_document_loss(hf_model, inputs, labels, eos_id)
    step1 = _tensorboard(tmp_path / "hf")["loss_metrics/global_avg_loss"][1]
    assert step1 == pytest.approx(hf_loss, rel=1e-5), (step1, hf_loss)

    # The export is a folder transformers loads as it is ...
    export = tmp_path / "hf" / "checkpoint" / f"step-{steps}"
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    exported, info = hf_qwen3_5.Qwen3_5ForCausalLM.from_pretrained(
        export, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    exported.eval()

    # ... holding the trained weights: those of the DCP checkpoint, embeddings still tied.
    trained = _dcp_weights(tmp_path / "dcp" / "checkpoint" / f"step-{steps}")
    assert torch.equal(trained["output.weight"], trained["tok_embeddings.weight"])
    args = Qwen35ModelArgs.from_hf_config(json.loads((export / "config.json").read_text()))
    adapter = Qwen35StateDictAdapter(args, None)
    from_export = adapter.from_hf(_hf_weights(export))
    assert set(from_export) == set(trained)
    for key, value in trained.items():
        assert relative_error(from_export[key], value) <= 1e-6, key
    embeddings = "model.embed_tokens.weight"
    assert not torch.equal(_hf_weights(export)[embeddings], hf_model.state_dict()[embeddings])

    ours = Qwen35Model(args)
    ours.load_state_dict(trained, strict=True)
    tokens = torch.randint(0, eos_id, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert relative_error(ours.eval()(tokens), exported(input_ids=tokens).logits) <= 1e-5


def _bad_settings(root: Path) -> dict[str, tuple[tuple[str, ...], int]]:
    """The runs of the tests below, {case: (overrides, NGPU)}; their files under `root`."""
    assets = root / "assets"
    assets.mkdir()
    for tokenizer_file in TOKENIZER.iterdir():
        shutil.copy(tokenizer_file, assets)
    (assets / "config.json").write_text(json.dumps(tiny_hf_config(tied=True, vocab_size=1000)))
    return {
        "missing data file": (
            ("--training.dataset", "text",
             "--training.dataset_path", str(root / "no_such_corpus.txt")),
            1,
        ),
        "unknown flavor": (("--model.flavor", "3B"), 1),
        "tokenizer larger than the vocab": (
            ("--model.flavor", "from_hf_config", "--model.hf_assets_path", str(assets)),
            1,
        ),
        "seq_len beyond max_seq_len": (("--training.seq_len", "131073"), 1),
        "seq_len not divisible by the cp degree": (
            ("--training.seq_len", "129", "--parallelism.context_parallel_degree", "2"),
            2,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def bad_setting_runs(tmp_path_factory) -> tuple[Path, dict]:
    """Every case of `_bad_settings` run at once: (their root, {case: `_finish`'s result})."""
    root = tmp_path_factory.mktemp("bad_settings")
    cases = _bad_settings(root)
    processes = [
        _start(root / f"run{i}", "--training.steps", "2", *overrides, ngpu=ngpu)
        for i, (overrides, ngpu) in enumerate(cases.values())
    ]
    return root, dict(zip(cases, _finish_side_by_side(processes), strict=True))


def _expect_failure_before_training(bad_setting_runs, case: str, message: str):
    # Every rank's output (`_start`): the first rank to raise ends the run, and torchrun stops
    # the others before they print (rank 0 alone raced rank 1 and lost at times).
    code, output, steps = bad_setting_runs[1][case]
    assert code != 0, output[-6000:]
    assert message in output, output[-6000:]
    assert not steps and "Training starts" not in output, output[-6000:]


def test_missing_data_file_fails_before_training(bad_setting_runs):
    missing = bad_setting_runs[0] / "no_such_corpus.txt"
    _expect_failure_before_training(
        bad_setting_runs, "missing data file", f'training.dataset_path = "{missing}" does not exist'
    )


def test_unknown_flavor_fails_before_training(bad_setting_runs):
    _expect_failure_before_training(
        bad_setting_runs,
        "unknown flavor",
        "model.flavor = '3B' is not a qwen3_5 flavor; choose one of debugmodel, 0.8B, 2B",
    )


def test_tokenizer_larger_than_the_vocab_fails_before_training(bad_setting_runs):
    assets = bad_setting_runs[0] / "assets"
    _expect_failure_before_training(
        bad_setting_runs,
        "tokenizer larger than the vocab",
        f"the tokenizer in model.hf_assets_path = '{assets}' has ",
    )


def test_seq_len_beyond_max_seq_len_fails_before_training(bad_setting_runs):
    _expect_failure_before_training(
        bad_setting_runs,
        "seq_len beyond max_seq_len",
        "training.seq_len = 131073 exceeds the model's max_seq_len = 131072",
    )


def test_seq_len_not_divisible_by_cp_degree_fails_before_training(bad_setting_runs):
    _expect_failure_before_training(
        bad_setting_runs,
        "seq_len not divisible by the cp degree",
        "training.seq_len = 129 is not divisible by parallelism.context_parallel_degree = 2",
    )


# In-process checks of the same settings (no training run).


def _job_config(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(DEBUG_CONFIG), *args])


def test_unknown_flavor_is_a_key_error_naming_the_setting():
    from titan_gdn.model import qwen3_5_args
    from titan_gdn.model.flavors import UnknownFlavorError

    assert "debugmodel" in qwen3_5_args and "3B" not in qwen3_5_args
    assert qwen3_5_args.get("3B") is None
    with pytest.raises(KeyError) as error:
        qwen3_5_args["3B"]
    assert isinstance(error.value, UnknownFlavorError)
    assert str(error.value).startswith("model.flavor = '3B' is not a qwen3_5 flavor")


def test_from_hf_config_flavor_reads_hf_assets_path(tmp_path):
    from titan_gdn.model import Qwen35ModelArgs, qwen3_5_args

    args = copy.deepcopy(qwen3_5_args["from_hf_config"])
    job_config = _job_config("--model.hf_assets_path", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape("model.hf_assets_path")):
        args.update_from_config(job_config)

    config = tiny_hf_config(tied=False, vocab_size=2048)
    (tmp_path / "config.json").write_text(json.dumps(config))
    args.update_from_config(job_config)
    assert asdict(args) == asdict(Qwen35ModelArgs.from_hf_config(config))

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="is not a Qwen3.5 config"):
        args.update_from_config(job_config)
