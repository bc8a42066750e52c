"""CPU runtime: torchtitan's real trainer on CPU + gloo via run_train.sh, and the pieces under it.

The training runs use torchtitan's llama3 ``debugmodel`` with titan_gdn's parallelize function
and an offline dataloader (tests/fixtures/llama_tiny_spec.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
STEP_LOG = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+)")
STEPS = 6

needs_cpu_only = pytest.mark.skipif(
    torch.accelerator.is_available(), reason="exercises the no-accelerator path"
)


def _config(tmp_path: Path) -> Path:
    config = tmp_path / "llama3_cpu.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            [job]
            dump_folder = "{tmp_path / "outputs"}"
            description = "llama3 debugmodel on CPU (test)"

            [metrics]
            log_freq = 1
            disable_color_printing = true

            [model]
            name = "llama3_cpu_test"
            flavor = "debugmodel"
            hf_assets_path = "{REPO / "assets" / "tokenizer"}"

            [optimizer]
            name = "AdamW"
            lr = 8e-4

            [lr_scheduler]
            warmup_steps = 2

            [training]
            local_batch_size = 2
            global_batch_size = 4
            seq_len = 128
            steps = {STEPS}
            mixed_precision_param = "float32"

            [parallelism]
            data_parallel_shard_degree = -1

            [activation_checkpoint]
            mode = "none"

            [experimental]
            custom_import = "tests.fixtures.llama_tiny_spec"

            [debug]
            seed = 0
            """
        )
    )
    return config


def _run(command: list[str], env: dict[str, str], timeout: int = 300):
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return result, result.stdout + result.stderr


def _train(config: Path, ngpu: int, *overrides: str):
    env = {"NGPU": str(ngpu), "CONFIG_FILE": str(config), "LOG_RANK": "0"}
    result, output = _run(["bash", "run_train.sh", *overrides], env)
    assert result.returncode == 0, output[-6000:]
    # step -> (loss, grad_norm), from torchtitan's metrics log line
    return {
        int(s): (float(loss), float(norm)) for s, loss, norm in STEP_LOG.findall(output)
    }, output


@pytest.fixture(scope="module")
def train_from_seed(tmp_path_factory):
    """Train with NGPU = 1 and 2 ranks from one seed checkpoint; return the step log by NGPU.

    A seed checkpoint makes runs comparable: on a CPU mesh DTensor's RNG is not
    shard-aware, so weights initialised under FSDP differ from single-process ones. The two
    runs start together: the one-process run leaves a core free most of the time.
    """
    root = tmp_path_factory.mktemp("cpu_runtime")
    config = _config(root)
    seed = ("--checkpoint.enable", "--parallelism.data_parallel_shard_degree", "1")
    _train(config, 1, *seed, "--checkpoint.create_seed_checkpoint")
    seed_path = root / "outputs" / "checkpoint" / "step-0"

    def train(ngpu: int):
        return _train(
            config,
            ngpu,
            "--job.dump_folder", str(root / f"ngpu{ngpu}"),
            "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(seed_path),
        )  # fmt: skip

    with ThreadPoolExecutor(2) as runs:
        return dict(zip((1, 2), runs.map(train, (1, 2)), strict=True))


@needs_cpu_only
@pytest.mark.parametrize("ngpu", [1, 2])
def test_run_train_llama3_debugmodel_on_cpu(train_from_seed, ngpu: int):
    # NGPU=1: one rank, 2 gradient-accumulation microbatches. NGPU=2: FSDP over dp_shard=2.
    log, output = train_from_seed[ngpu]
    assert sorted(log) == list(range(1, STEPS + 1)), output[-6000:]
    assert log[STEPS][0] < log[1][0], log


@needs_cpu_only
def test_fsdp_run_matches_single_process_run(train_from_seed):
    # Same seed weights and global batches: only the reduction path differs. grad_norm is the
    # sharp check: AdamW would hide a gradient scaled by 1/2 from the losses.
    single, _ = train_from_seed[1]
    sharded, _ = train_from_seed[2]
    for step, (loss, norm) in single.items():
        assert sharded[step][0] == pytest.approx(loss, abs=1e-3), (step, single, sharded)
        assert sharded[step][1] == pytest.approx(norm, rel=1e-3), (step, single, sharded)


@needs_cpu_only
def test_fsdp_gradients_equal_single_process_gradients():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
        "-m", "tests.fixtures.fsdp_grad_check",
    ]  # fmt: skip
    result, output = _run(command, {"PYTHONPATH": str(REPO)})
    assert result.returncode == 0, output[-6000:]
    assert "GRADS MATCH" in output


@needs_cpu_only
def test_use_cpu_if_no_accelerator_points_torchtitan_at_cpu():
    from titan_gdn.cpu import use_cpu_if_no_accelerator

    assert use_cpu_if_no_accelerator() is True
    assert use_cpu_if_no_accelerator() is True  # idempotent
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tt_utils
    import torchtitan.train  # noqa: F401  (imported after the call, as titan_gdn.train does)

    for module in (tt_utils, parallel_dims, dist_utils, metrics):
        assert module.device_type == "cpu", module.__name__
    assert tt_utils.get_device_info()[0] == "cpu"
    assert dist_utils.device_module is tt_utils.device_module is metrics.device_module
    assert isinstance(tt_utils.device_module.current_device(), int)

    stats = metrics.DeviceMemoryMonitor("cpu").get_peak_stats()
    assert stats.max_reserved_gib > 0 and 0 < stats.max_reserved_pct < 100
    assert stats.num_alloc_retries == 0 and stats.num_ooms == 0


@pytest.mark.gpu
def test_use_cpu_if_no_accelerator_is_a_no_op_with_an_accelerator():
    import torchtitan.tools.utils as tt_utils

    from titan_gdn.cpu import use_cpu_if_no_accelerator

    before = tt_utils.device_type
    assert use_cpu_if_no_accelerator() is False
    assert tt_utils.device_type == before != "cpu"


@pytest.mark.parametrize(
    "degrees, setting",
    [
        ({"tp": 2}, "parallelism.tensor_parallel_degree"),
        ({"pp": 2}, "parallelism.pipeline_parallel_degree"),
        ({"dp_replicate": 2}, "parallelism.data_parallel_replicate_degree"),
    ],
)
def test_parallelize_rejects_unsupported_parallelism(degrees: dict[str, int], setting: str):
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

    from titan_gdn.parallel.parallelize import parallelize_qwen3_5

    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1}
    sizes.update(degrees)
    dims = ParallelDims(**sizes, world_size=max(sizes.values()))
    with pytest.raises(ValueError, match=re.escape(setting)):
        parallelize_qwen3_5(nn.Module(), dims, JobConfig())
