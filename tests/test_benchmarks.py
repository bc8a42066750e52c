"""The benchmark scripts run end to end on CPU and write what the report reads.

The scripts themselves are measured on GPUs; here they run the debug model at a tiny length
(gloo, 1 and 2 processes) so that a change to the model, the trainer's step or the scripts that
breaks them shows before a GPU run does. No timing is asserted.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from benchmarks import throughput
from benchmarks.breakdown import categorize
from benchmarks.common import guarded
from benchmarks.memory import find_longest
from benchmarks.report import kernels, memory, page, plots, tables, targets, training
from tests.conftest import copy_checkout
from titan_gdn.model.flavors import qwen3_5_args

# One step per stage and eager blocks keep this under a minute on two cores; compiled blocks
# are what tests/test_compile.py checks.
FAST = ["--warmup", "1", "--steps", "1", "--compile", "none"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the checkout to run the scripts in: they write their trainer's dump folder
    under their own root (outputs/benchmarks), which must not be the checkout's."""
    root = tmp_path_factory.mktemp("benchmarks") / "repo"
    copy_checkout(root)
    return root


def _run(command: list[str], checkout: Path, timeout: float = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        command, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + _first_error(result.stderr)


def _first_error(stderr: str, chars: int = 6000) -> str:
    """stderr from its first fatal or uncaught error on (where a crashed rank says why;
    torchrun's summary after it names only the signal), else its end."""
    markers = ("Fatal Python error", "terminate called", "Traceback (most recent call last)")
    starts = [i for i in (stderr.find(m) for m in markers) if i >= 0]
    start = min(starts) if starts else max(len(stderr) - chars, 0)
    return stderr[start : start + chars]


@pytest.fixture(scope="module")
def results(tmp_path_factory, checkout) -> Path:
    """The JSON of a 2-process throughput run (cp=1 and cp=2, all references) and of a
    one-trial memory search, in one folder, as docs/results/ holds them."""
    folder = tmp_path_factory.mktemp("results")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    _run(
        [*torchrun, "--nproc_per_node", "2", "-m", "benchmarks.throughput"]
        + ["--flavors", "debugmodel", "--seq-lens", "64", "--cp", "1", "2"]
        + ["--references", "transformers", "kernel", "probe"]
        + ["--out", str(folder / "throughput.json"), *FAST],
        checkout,
    )
    _run(
        [sys.executable, "-m", "benchmarks.memory", "--flavor", "debugmodel", "--cp", "1"]
        + ["--ac", "none", "--start", "64", "--limit", "64", "--granularity", "32"]
        + ["--out", str(folder / "memory.json"), "--log-dir", str(folder / "logs"), *FAST],
        checkout,
    )
    return folder


def test_throughput_json_has_every_configuration_and_reference(results):
    data = json.loads((results / "throughput.json").read_text())
    assert data["kind"] == "throughput"
    assert data["environment"]["hardware"]["processes"] == 2
    (command,) = data["commands"]
    assert command.startswith("torchrun --standalone --nproc_per_node 2 -m benchmarks.throughput")
    by_cp = {r["cp"]: r for r in data["results"]}
    assert set(by_cp) == {1, 2} and all(r["status"] == "ok" for r in by_cp.values())
    assert (by_cp[1]["dp"], by_cp[2]["dp"]) == (2, 1)
    for result in by_cp.values():
        assert result["tokens_per_s_per_gpu"] > 0
        # On CPU the host does the work: the step returns when it is done.
        assert 0.5 * result["step_time_s"] < result["host_time_s"] <= result["step_time_s"]
        assert len(result["losses"]) == 2 and all(loss > 0 for loss in result["losses"])
        assert result["flops_per_token_documents"]["total"] > 0
        categories = result["breakdown"]["categories_ms"]
        assert set(categories) >= {"delta_rule", "conv", "attention", "gemm", "all_to_all"}
        assert categories["delta_rule"] > 0 and categories["gemm"] > 0
        # Every block's time is found: both block types appear.
        assert set(result["breakdown"]["layers_ms"]) == {"linear_attention", "full_attention"}
    # One collective per direction per mixer (gloo: DTensor's all-gather stands in for the
    # all-to-all), forward and backward; none without context parallel.
    collectives = by_cp[2]["breakdown"]["all_to_all"]
    assert (collectives["forward_per_mixer"], collectives["backward_per_mixer"]) == (2, 2)
    assert by_cp[1]["breakdown"]["all_to_all"]["forward_calls"] == 0
    references = data["transformers"]
    assert [r["gradient_checkpointing"] for r in references] == [False, True]
    assert all(r["status"] == "ok" and r["tokens_per_s_per_gpu"] > 0 for r in references)
    assert [k["cp"] for k in data["kernel"]] == [1, 2]
    assert all(k["measure"] == "wall time" for k in data["kernel"])  # no GPU kernels on CPU
    assert (
        data["kernel"][1]["shape"]["value_heads"] * 2 == data["kernel"][0]["shape"]["value_heads"]
    )
    probed = {p["bytes"] for p in data["probe"]}
    assert probed >= {s["bytes"] for s in collectives["sizes"]}


def test_memory_json_reports_the_longest_fit(results):
    data = json.loads((results / "memory.json").read_text())
    assert data["kind"] == "memory" and data["options"]["flavor"] == "debugmodel"
    (trial,) = data["trials"]
    assert trial["seq_len"] == 64 and trial["status"] == "ok"
    assert data["result"]["longest_fit"] == 64 and data["result"]["first_oom"] is None
    assert data["result"]["complete"] and data["result"]["peak_reserved_gib"] > 0
    assert len(data["result"]["losses"]) == 2
    assert data["environment"]["hardware"]["processes"] == 1


def test_report_renders_tables_and_plots(results, tmp_path):
    doc = tmp_path / "performance.md"
    assert page.main(["--results", str(results), "--out", str(doc)]) == 0
    text = doc.read_text()
    assert "| debugmodel | 64 | 2 | 2 | 1 |" in text  # the cp=2 row of the throughput table
    assert "transformers `Qwen3_5ForCausalLM`" in text and "NCCL `all_to_all_single`" in text
    assert "| debugmodel | 1 | none | 64 only | 64 |" in text  # the memory search
    assert "benchmarks.memory --flavor debugmodel" in text
    # One section per question, each table citing its files with the commands that wrote them.
    assert "## How does titan_gdn compare with transformers + FLA?" in text
    assert "## How long a row fits?" in text and "`docs/results/memory.json`: `" in text
    assert "--out docs/results/throughput.json" in text
    assert page.main(["--results", str(results), "--out", str(doc), "--check"]) == 0
    # Without checkpointing each mixer's backward sends one all-to-all per direction.
    expected_row = "| debugmodel 64 cp=2 ac=none | 2 forward, 2 backward | yes |"
    assert f"| one all-to-all per direction {expected_row}" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # plots are optional (the bench extra); the text is checked above
    assert (tmp_path / "performance" / "throughput.png").stat().st_size > 0
    assert (tmp_path / "performance" / "memory.png").stat().st_size > 0


def test_a_section_is_left_out_without_the_result_files_it_reads():
    sources = tables.Sources({})
    for section in (memory.longest_rows, memory.longest_one_document_rows, training.training_runs):
        assert section({}, sources, {}) == [], section.title
    assert "No benchmark results yet." in page.render({}, {})


def test_all_to_all_target_counts_the_forwards_that_full_checkpointing_recomputes():
    def row(ac, forward, backward):
        a2a = {"forward_per_mixer": forward, "backward_per_mixer": backward, "sizes": []}
        result = {"flavor": "2B", "seq_len": 8, "cp": 2, "ac": ac, "breakdown": {"all_to_all": a2a}}
        (target,) = targets.all_to_all_rows([result], probe=[])
        return target[-1]

    assert row("none", 2, 2) == "yes" and row("selective:op", 2, 2) == "yes"
    assert row("full", 2, 4) == "yes"
    assert row("full", 2, 2) == "no" and row("none", 2, 4) == "no" and row("full", 4, 4) == "no"
    assert row("selective:2", 2, 3) is None  # every second block recomputes: no single count


def test_gdn_layer_share_leaves_out_the_mlps_share_of_the_block_gemms():
    a = qwen3_5_args["2B"]
    key_dim = a.linear_num_key_heads * a.linear_key_head_dim
    value_dim = a.linear_num_value_heads * a.linear_value_head_dim
    # in_proj_qkv, in_proj_z, in_proj_a and in_proj_b, out_proj; the MLP's three matrices.
    layer = (
        a.dim * (2 * key_dim + value_dim)
        + 2 * a.dim * value_dim
        + 2 * a.dim * a.linear_num_value_heads
    )
    mlp = 3 * a.dim * a.hidden_dim
    block_ms = {"delta_rule": 30.0, "conv": 10.0, "gemm": 100.0, "other": 10.0, "fsdp": 50.0}
    result = {"flavor": "2B", "breakdown": {"layers_ms": {"linear_attention": block_ms}}}
    assert kernels.gdn_kernel_share(result) == pytest.approx(40 / 150)
    layer_gemm_ms = 100.0 * layer / (layer + mlp)
    expected = 40 / (50 + layer_gemm_ms)
    assert kernels.gdn_kernel_share(result, layer_only=True) == pytest.approx(expected)


def test_throughput_plot_joins_a_configuration_across_runs_and_keeps_the_latest():
    def run(date, results, transformers=()):
        env = {"date": date}
        return {"environment": env, "results": results, "transformers": list(transformers)}

    def ours(seq_len, value, cp=1, gpus=1):
        fields = {"flavor": "2B", "seq_len": seq_len, "cp": cp, "gpus": gpus, "ac": "full"}
        return {**fields, "status": "ok", "tokens_per_s_per_gpu": value}

    theirs = {"flavor": "2B", "seq_len": 16, "gradient_checkpointing": False, "status": "ok"}
    files = [
        ("b.json", run("2026-11-30 02:00 UTC", [ours(16, 2.0), ours(32, 3.0, cp=2, gpus=2)])),
        ("a.json", run("2026-11-30 01:00 UTC", [ours(16, 1.0), ours(64, 4.0)])),
        ("c.json", run("2026-11-29 23:00 UTC", [], [{**theirs, "tokens_per_s_per_gpu": 5.0}])),
    ]
    series = plots.throughput_series({"throughput": files})
    assert series == {
        "2B": {
            "ours cp=1, 1 GPU, ac=full": [(16, 2.0), (64, 4.0)],
            "ours cp=2, 2 GPUs, ac=full": [(32, 3.0)],
            "transformers, no AC": [(16, 5.0)],
        }
    }


def test_a_run_with_overrides_is_its_own_configuration_in_every_table():
    def run(date, step_s, overrides=()):
        result = {"flavor": "2B", "seq_len": 16, "cp": 1, "gpus": 1, "dp": 1, "ac": "none"}
        result |= {"status": "ok", "config": "c.toml", "tokens_per_s_per_gpu": 16 / step_s}
        result |= {"step_time_s": step_s, "breakdown": {"busy_ms": 100.0, "categories_ms": {}}}
        options = {"overrides": list(overrides)}
        return {"environment": {"date": date}, "options": options, "results": [result]}

    files = [
        ("plain.json", run("2026-12-01 01:00 UTC", 0.120)),
        ("graphs.json", run("2026-12-01 00:00 UTC", 0.104, ["--compile.cudagraphs"])),
        ("older.json", run("2026-11-30 00:00 UTC", 0.200)),
    ]
    results = {"throughput": files}
    sources = tables.Sources(results)
    met = "\n".join(targets.targets_met(results, sources, {}))
    assert "| 2B 16 cp=1 ac=none | 1.200 (120.0 / 100.0 ms) | no (20% over busy) |" in met
    graphs_row = "| 2B 16 cp=1 ac=none `--compile.cudagraphs` | 1.040 (104.0 / 100.0 ms) | yes |"
    assert graphs_row in met
    assert "200.0" not in met  # the older plain run gave way to the newer one
    rows = "\n".join(training.throughput_by_length(results, sources, {}))
    assert "| none, `--compile.cudagraphs` | trainer |" in rows and "| none | trainer |" in rows


def test_busy_target_holds_the_step_whose_rows_the_profiled_step_trained_again():
    result = {"flavor": "0.8B", "seq_len": 16, "cp": 1, "gpus": 1, "dp": 1, "ac": "none"}
    result |= {"status": "ok", "config": "c.toml", "tokens_per_s_per_gpu": 1.0}
    result |= {"step_time_s": 0.140}  # the median of rows unlike the profiled one
    result["breakdown"] = {"busy_ms": 100.0, "same_rows_step_ms": 104.0, "categories_ms": {}}
    data = {"environment": {"date": "2026-12-06 01:00 UTC"}, "options": {}, "results": [result]}
    results = {"throughput": [("long-tail.json", data)]}
    met = "\n".join(targets.targets_met(results, tables.Sources(results), {}))
    assert "| 0.8B 16 cp=1 ac=none | 1.040 (104.0 / 100.0 ms) | yes |" in met


def test_profiled_step_replays_the_last_timed_steps_rows():
    """The profiled step trains on the rows of the last timed step again (every micro-batch,
    as the loader gave them), a step after it on new rows, and the timed rows are the timed
    steps' alone."""
    from types import SimpleNamespace

    from benchmarks.timed_trainer import TimedTrainer

    trainer = TimedTrainer.__new__(TimedTrainer)  # the data path alone, no model
    trainer.warmup, trainer.timed_steps, trainer.gradient_accumulation_steps = 1, 2, 2
    trainer.profiled_step = lambda _: None
    trainer.rows, trainer._step_batches, trainer.model_args = [], [], None
    trainer.job_config = SimpleNamespace(model=SimpleNamespace())
    trainer.ntokens_seen = 0
    trainer.metrics_processor = SimpleNamespace(ntokens_since_last_log=0, data_loading_times=[])
    loader = (({"input": torch.full((1, 4), i)}, torch.full((1, 4), i)) for i in range(100))
    batches = trainer.batch_generator(loader)
    seen = []
    for step in range(1, 6):  # warm-up, two timed steps, the profiled step, one more
        trainer.step = step
        for _ in range(2):
            input_dict, labels = next(batches)
            seen.append(int(input_dict["input"][0, 0]))
            assert torch.equal(input_dict["input"], labels)
            input_dict["input"] = None  # as the trainer puts its device copy in the dict
    assert seen == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]
    assert [int(row[0, 0]) for row in trainer.timed_rows()] == [2, 3, 4, 5]


def test_bandwidth_target_compares_kernel_time_with_kernel_time_when_the_probe_has_it():
    size = {"bytes": 1024, "gb_per_s": 400.0}
    wall_only = [{"bytes": 1024, "gb_per_s": 320.0}]
    assert targets.bandwidth_share(size, wall_only) == pytest.approx(1.25)
    both = [{**wall_only[0], "kernel_gb_per_s": 500.0}]
    assert targets.bandwidth_share(size, both) == pytest.approx(0.8)


def test_kernel_ceiling_counts_the_forward_that_full_checkpointing_recomputes():
    kernel = {"status": "ok", "layers": 18, "forward_ms": 2.0, "forward_backward_ms": 6.0}
    assert kernels.kernel_ceiling_ms({**kernel, "ac": "full"}) == 18 * (6.0 + 2.0)
    assert kernels.kernel_ceiling_ms({**kernel, "ac": "none"}) == 18 * 6.0
    assert kernels.kernel_ceiling_ms({**kernel, "ac": "selective:op"}) == 18 * 6.0
    assert kernels.kernel_ceiling_ms({**kernel, "ac": "full", "status": "oom"}) is None


def test_committed_performance_page_is_generated_from_the_results():
    assert page.DOC_PATH.name == "performance.md"
    assert page.main(["--check"]) == 0, "run python -m benchmarks.report"


def test_search_doubles_then_bisects_to_the_granularity():
    tried = []

    def fits_below(limit):
        def fits(length):
            tried.append(length)
            return length <= limit

        return fits

    assert find_longest(fits_below(300_000), 32768, 2**21, 16384) == (294912, 311296)
    assert tried[:5] == [32768, 65536, 131072, 262144, 524288]
    assert tried[5:] == [393216, 327680, 294912, 311296]
    tried.clear()
    assert find_longest(fits_below(20_000), 65536, 2**21, 4096) == (16384, 20480)
    assert tried[:3] == [65536, 32768, 16384]  # halving while the start does not fit
    assert find_longest(fits_below(10**9), 4096, 16384, 4096) == (16384, None)
    assert find_longest(fits_below(10), 4096, 16384, 4096) == (None, 4096)


def test_out_of_memory_becomes_a_record_and_other_errors_propagate():
    class OneRank:
        rank = 0

        def any_rank(self, flag):
            return flag

        def free_memory(self):
            pass

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    record = guarded(OneRank(), oom)
    assert record["status"] == "oom"
    # Where it ran out is recorded, innermost frame last.
    assert (
        record["oom_site"][-1].startswith("test_benchmarks.py:")
        and " oom: raise" in (record["oom_site"][-1])
    )
    assert guarded(OneRank(), lambda: {"x": 1}) == {"status": "ok", "x": 1}
    with pytest.raises(ValueError):
        guarded(OneRank(), lambda: int("not a number"))


def test_kernels_are_attributed_to_the_op_that_launched_them():
    assert categorize("chunk_fwd_kernel_o", ["titan_gdn::gated_delta_rule_fla"]) == "delta_rule"
    assert categorize("nvjet_hsh_256x128", ["aten::mm", "bench::loss"]) == "loss"
    assert categorize("nvjet_hsh_256x128", ["aten::mm", "CompiledFunction"]) == "gemm"
    assert categorize("ncclDevKernel_SendRecv", ["nccl:all_to_all"]) == "all_to_all"
    assert categorize("ncclDevKernel_AllGather_RING", ["FSDP::all_gather"]) == "fsdp"
    assert categorize("ncclDevKernel_AllReduce", ["bench::clip_grad_norm"]) == "optimizer"
    assert categorize("triton_tem_fused_flex_attention_0", ["CompiledFunction"]) == "attention"
    assert categorize("triton_poi_fused_mul_0", ["CompiledFunction"]) == "other"


def _event(id, name, start, end, parent=None, shapes=None, seq=-1, **flags):
    from torch.autograd.profiler_util import FunctionEvent

    event = FunctionEvent(
        id=id,
        name=name,
        thread=1,
        start_us=start,
        end_us=end,
        input_shapes=shapes or [],
        sequence_nr=seq,
        **flags,
    )
    event.linked_correlation_id = 0  # set here: torch 2.11's events have no such field
    if parent is not None:
        event.set_cpu_parent(parent)
        parent.append_cpu_child(event)
    return event


def _kernel(id, name, start, end, *listed_by, **flags):
    """A device event, linked to the first of `listed_by` (its launching op) and in the
    `kernels` of each, as torch's _parse_kineto_results lists it. Its own `id` is CUPTI's."""
    from torch.autograd import DeviceType

    kernel = _event(id, name, start, end, device_type=DeviceType.CUDA, **flags)
    kernel.linked_correlation_id = listed_by[0].id if listed_by else 0
    for op in listed_by:
        op.append_kernel(name, 0, end - start)
    return kernel


def _cuda_call(id, name, start, end, parent, launching=None):
    """A CUDA runtime call: its `id` is CUPTI's count, linked to the op that made it, if any."""
    call = _event(id, name, start, end, parent)
    call.linked_correlation_id = launching.id if launching is not None else 0
    return call


def test_host_syncs_of_a_gpu_step_are_the_reads_that_wait_for_the_device():
    """A hand-made CUDA trace: a value read from device memory (a synchronizing call inside),
    one from a host tensor (none: no wait), a blocking copy; on CPU every value read counts."""
    from benchmarks.breakdown import step_breakdown

    forward = _event(1, "bench::forward", 0, 100, is_user_annotation=True)
    device_item = _event(2, "aten::item", 10, 20, forward)
    device_read = _event(3, "aten::_local_scalar_dense", 11, 19, device_item)
    wait = _cuda_call(4, "cudaStreamSynchronize", 12, 18, device_read)
    host_item = _event(5, "aten::item", 30, 31, forward)
    host_read = _event(6, "aten::_local_scalar_dense", 30, 31, host_item)
    copy = _event(7, "aten::copy_", 40, 50, forward)
    copy_wait = _cuda_call(8, "cudaStreamSynchronize", 41, 49, copy)
    cpu = [forward, device_item, device_read, wait, host_item, host_read, copy, copy_wait]
    syncs = step_breakdown(cpu, ["linear_attention"], cuda=True)["host_syncs"]
    assert syncs["total"] == 2 and syncs["top_causes"] == {"aten::item": 1, "aten::copy_": 1}
    syncs = step_breakdown(cpu, ["linear_attention"], cuda=False)["host_syncs"]
    assert syncs["total"] == 3 and syncs["top_causes"] == {"aten::item": 2, "aten::copy_": 1}


def test_gpu_kernels_are_attributed_to_blocks_collectives_and_directions():
    """A hand-made CUDA trace: a GDN block whose forward runs an all-to-all and the delta rule,
    and whose compiled backward (matched by sequence number) runs another all-to-all."""
    from benchmarks.breakdown import step_breakdown

    forward = _event(1, "bench::forward", 0, 100, is_user_annotation=True)
    block = _event(2, "bench::layer 0", 10, 90, forward, is_user_annotation=True)
    compiled = _event(3, "CompiledFunction", 11, 89, block, seq=7)
    sent = [[1, 1024, 2, 64]]  # bf16: 256 KiB
    to_heads = _event(4, "_c10d_functional::all_to_all_single", 20, 30, compiled, shapes=sent)
    rule = _event(5, "titan_gdn::gated_delta_rule_fla", 40, 60, compiled)
    engine = _event(6, "autograd::engine::evaluate_function: CompiledFunctionBackward", 200, 300)
    backward = _event(7, "CompiledFunctionBackward", 201, 299, engine, seq=7)
    to_tokens = _event(8, "_c10d_functional::all_to_all_single", 210, 220, backward, shapes=sent)
    kernels = [
        _kernel(9, "ncclDevKernel_SendRecv", 21, 26, to_heads),
        _kernel(10, "chunk_fwd_kernel_o", 41, 51, rule),
        _kernel(11, "ncclDevKernel_SendRecv", 211, 219, to_tokens),
        _kernel(12, "nvjet_hsh_64x8", 45, 47),  # no launching op
    ]
    cpu = [forward, block, compiled, to_heads, rule, engine, backward, to_tokens]
    result = step_breakdown(cpu + kernels, ["linear_attention"], cuda=True)
    categories = result["categories_ms"]
    assert (categories["all_to_all"], categories["delta_rule"]) == (0.013, 0.01)
    assert categories["gemm"] == 0.002  # by its name alone
    block_ms = result["layers_ms"]["linear_attention"]
    assert (block_ms["all_to_all"], block_ms["delta_rule"]) == (0.013, 0.01)
    assert result["busy_ms"] == 0.023  # 5 + 10 + 8 us; the GEMM overlaps the delta rule
    collectives = result["all_to_all"]
    assert (collectives["forward_calls"], collectives["backward_calls"]) == (1, 1)
    by_direction = {size["direction"]: size for size in collectives["sizes"]}
    assert by_direction["forward"]["bytes"] == 1024 * 2 * 64 * 2
    assert by_direction["forward"]["gb_per_s"] == round(262144 / 0.005 / 1e6, 2)
    assert by_direction["backward"]["median_kernel_ms"] == 0.008


def test_exposed_communication_is_collective_time_without_compute_beside_it():
    """An FSDP all-gather half hidden behind a GEMM, an all-to-all alone, and a clipping
    all-reduce beside a copy: each kind counts only the time no compute kernel runs."""
    from benchmarks.breakdown import step_breakdown

    kernels = [
        _kernel(1, "ncclDevKernel_AllGather_RING_LL", 0, 20),
        _kernel(2, "nvjet_hsh_64x8", 10, 30),
        _kernel(3, "ncclDevKernel_ReduceScatter_RING", 25, 45),  # 5 us under the GEMM
        _kernel(4, "ncclDevKernel_SendRecv", 50, 58),
        _kernel(5, "ncclDevKernel_AllReduce_Sum_f32", 60, 70),
        _kernel(6, "Memcpy DtoD (Device -> Device)", 62, 66),
    ]
    result = step_breakdown(kernels, ["linear_attention"], cuda=True)
    assert result["exposed_comm_ms"] == {"fsdp": 0.025, "all_to_all": 0.008, "all_reduce": 0.006}
    assert result["busy_ms"] == 0.063  # 0-45, 50-58, 60-70


def _one_exchange_each_way():
    """A block whose forward sends to heads and whose backward sends back, on rank 0."""
    forward = _event(1, "bench::forward", 0, 100, is_user_annotation=True)
    block = _event(2, "bench::layer 0", 10, 90, forward, is_user_annotation=True)
    compiled = _event(3, "CompiledFunction", 11, 89, block, seq=7)
    sent = [[1, 1024, 2, 64]]  # bf16: 256 KiB
    to_heads = _event(4, "_dtensor::shard_dim_alltoall", 20, 30, compiled, shapes=sent)
    engine = _event(6, "autograd::engine::evaluate_function: CompiledFunctionBackward", 200, 300)
    backward = _event(7, "CompiledFunctionBackward", 201, 299, engine, seq=7)
    to_tokens = _event(8, "_dtensor::shard_dim_alltoall", 208, 220, backward, shapes=sent)
    kernels = [
        _kernel(9, "ncclDevKernel_SendRecv", 21, 26, to_heads),
        _kernel(10, "chunk_fwd_kernel_o", 41, 51),
        # The backward op also lays its send buffer out: a copy before the exchange.
        _kernel(11, "elementwise_kernel", 209, 211, to_tokens),
        _kernel(12, "ncclDevKernel_SendRecv", 211, 219, to_tokens),
    ]
    return [forward, block, compiled, to_heads, engine, backward, to_tokens, *kernels]


def test_exchanges_are_timed_from_the_last_ranks_start():
    """Given every rank's all-to-all kernels, an exchange runs from the last rank's start to
    the last rank's end: a kernel that started early and waited does not lower its bandwidth."""
    from benchmarks.breakdown import exchange_kernels, step_breakdown

    events = _one_exchange_each_way()
    own = exchange_kernels(events, trace_start_us=1000.0)
    assert own == [(1021.0, 1026.0), (1211.0, 1219.0)]  # the copy and the delta rule left out
    peer = [(1024.0, 1026.5), (1205.0, 1219.5)]
    result = step_breakdown(events, ["linear_attention"], cuda=True, exchanges=[own, peer])
    a2a = result["all_to_all"]
    by_direction = {size["direction"]: size for size in a2a["sizes"]}
    forward, backward = by_direction["forward"], by_direction["backward"]
    assert (forward["median_nccl_kernel_ms"], forward["median_exchange_ms"]) == (0.005, 0.0025)
    assert forward["exchange_gb_per_s"] == round(262144 / 0.0025 / 1e6, 2)
    assert backward["median_kernel_ms"] == 0.01  # the op's kernels: copy + exchange
    assert (backward["median_nccl_kernel_ms"], backward["median_exchange_ms"]) == (0.008, 0.0085)
    assert a2a["exchange_end_spread_us_median"] == 0.5

    probe = [{"bytes": 262144, "gb_per_s": 50.0, "kernel_gb_per_s": 100.0}]
    shares = [targets.bandwidth_share(size, probe) for size in (forward, backward)]
    assert shares == [forward["exchange_gb_per_s"] / 100, backward["exchange_gb_per_s"] / 100]

    # A rank that saw another number of exchanges cannot be matched call by call.
    unmatched = step_breakdown(events, ["linear_attention"], True, exchanges=[own, peer[:1]])
    a2a = unmatched["all_to_all"]
    assert a2a["exchange_unmatched_kernel_counts"] == [2, 1]
    assert not any("median_exchange_ms" in size for size in a2a["sizes"])


def test_gpu_kernels_follow_torchs_links_not_colliding_ids():
    """Each kernel counts once, under the op that torch lists it in: not under a CUDA call whose
    CUPTI id equals that op's id, nor twice where torch lists it twice (also in an unlinked CUDA
    call, or a range's span on the device in the range), nor a legacy op's CUDA time. Kernels
    of compiled code find their block, forward and backward, through Inductor's ranges."""
    from benchmarks.breakdown import step_breakdown

    forward = _event(1, "bench::forward", 0, 100, is_user_annotation=True)
    block = _event(2, "bench::layer 0", 10, 90, forward, is_user_annotation=True)
    compiled = _event(3, "CompiledFunction", 11, 89, block, seq=7)
    graph = _event(4, "## Call CompiledFxGraph fwd ##", 12, 88, compiled)
    rule = _event(5, "titan_gdn::gated_delta_rule_fla", 20, 40, graph)
    pointwise = _event(6, "triton_poi_fused_mul_0", 50, 52, graph)
    engine = _event(7, "autograd::engine::evaluate_function: CompiledFunctionBackward", 200, 300)
    backward = _event(8, "CompiledFunctionBackward", 201, 299, engine, seq=7)
    graph_backward = _event(9, "## Call CompiledFxGraph bwd ##", 202, 298, backward)
    reduction = _event(10, "triton_red_fused_sum_1", 210, 213, graph_backward)
    optimizer = _event(11, "Optimizer.step#AdamW.step", 400, 500, is_user_annotation=True)
    foreach = _event(12, "aten::_foreach_mul_", 410, 420, optimizer)
    legacy = _event(13, "aten::add_", 430, 440, optimizer, is_legacy=True)
    legacy.append_kernel("aten::add_", 0, 10)  # its own CUDA time, as the legacy profiler's
    fsdp = _event(14, "FSDP::all_gather", 600, 700, is_user_annotation=True)
    gather = _event(15, "c10d::_allgather_base_", 610, 620, fsdp)
    calls = [  # CUPTI's ids: 5 is the delta rule's id too, 6 the pointwise kernel's launcher's
        _cuda_call(5, "cudaLaunchKernel", 411, 412, foreach, launching=foreach),
        _cuda_call(6, "cudaEventRecord", 450, 451, optimizer),
    ]
    kernels = [
        _kernel(20, "chunk_fwd_kernel_o", 21, 31, rule),
        _kernel(21, "triton_poi_fused_mul_0", 50, 52, pointwise, calls[1]),
        _kernel(22, "triton_red_fused_sum_1", 210, 213, reduction),
        _kernel(23, "multi_tensor_apply_kernel", 411, 415, foreach),
        _kernel(24, "ncclDevKernel_AllGather_RING_LL", 611, 619, gather),
        _kernel(2, "bench::layer 0", 21, 52, block, is_user_annotation=True),
    ]
    cpu = [forward, block, compiled, graph, rule, pointwise, engine, backward, graph_backward]
    cpu += [reduction, optimizer, foreach, legacy, fsdp, gather, *calls]
    result = step_breakdown(cpu + kernels, ["linear_attention"], cuda=True)
    expected = {"delta_rule": 0.01, "other": 0.005, "optimizer": 0.004, "fsdp": 0.008}
    assert {k: v for k, v in result["categories_ms"].items() if v} == expected
    block_ms = result["layers_ms"]["linear_attention"]
    assert {k: v for k, v in block_ms.items() if v} == {"delta_rule": 0.01, "other": 0.005}
    assert result["busy_ms"] == 0.027  # the kernels alone, not the range's span over the gap


def test_a_kernel_listed_by_two_ops_counts_once_under_the_one_it_can_follow():
    """Where ids collide, a later op (here the optimizer's) also lists kernels that ran before
    it started: they stay with their launcher, and the summed kernel time stays the busy time."""
    from benchmarks.breakdown import step_breakdown

    rule = _event(1, "titan_gdn::gated_delta_rule_fla", 0, 20)
    loss = _event(2, "bench::loss", 30, 60, is_user_annotation=True)
    mm = _event(3, "aten::mm", 31, 40, loss)
    optimizer = _event(4, "Optimizer.step#AdamW.step", 100, 200, is_user_annotation=True)
    fused = _event(5, "aten::_fused_adamw_", 101, 190, optimizer)
    kernels = [
        _kernel(10, "chunk_fwd_kernel_o", 5, 15, rule, fused),
        _kernel(11, "nvjet_hsh_256x128", 35, 45, mm, fused),
        _kernel(12, "multi_tensor_apply_kernel", 105, 125, fused),
        _kernel(13, "chunk_fwd_kernel_o", 130, 140, fused),  # a second launch, the same shape
    ]
    result = step_breakdown([rule, loss, mm, optimizer, fused, *kernels], ["x"], cuda=True)
    expected = {"delta_rule": 0.01, "loss": 0.01, "optimizer": 0.03}
    assert {k: v for k, v in result["categories_ms"].items() if v} == expected
    assert sum(result["categories_ms"].values()) == result["busy_ms"] == 0.05


def test_the_kernels_no_category_claims_are_listed_by_name_largest_first():
    from benchmarks.breakdown import step_breakdown

    block = _event(1, "CompiledFunction", 0, 100)
    kernels = [
        _kernel(10, "triton_poi_fused_mul_0", 5, 10, block),
        _kernel(11, "nvjet_hsh_64x8", 10, 40, block),  # a GEMM: not "other"
        _kernel(12, "triton_red_fused_sort_1", 40, 60, block),
        _kernel(13, "triton_poi_fused_mul_0", 60, 62, block),  # a second launch
    ]
    result = step_breakdown([block, *kernels], ["x"], cuda=True)
    assert list(result["other_kernels_ms"].items()) == [
        ("triton_red_fused_sort_1", 0.02),
        ("triton_poi_fused_mul_0", 0.007),
    ]
    assert sum(result["other_kernels_ms"].values()) == result["categories_ms"]["other"]


def test_every_checkpointing_mode_runs_its_cp_degrees_back_to_back():
    args = throughput.parse_args(
        ["--out", "x.json", "--cp", "1", "2", "--ac", "full", "selective:op"]
    )
    runs = throughput.configurations(args, "2B", 32768)
    assert [(r.ac, r.cp) for r in runs] == [
        ("full", 1),
        ("full", 2),
        ("selective:op", 1),
        ("selective:op", 2),
    ]
    assert throughput.parse_args(["--out", "x.json"]).ac == ["none"]


def test_the_benchmark_trains_exactly_what_run_train_sh_trains(tmp_path, monkeypatch, checkout):
    """The throughput benchmark's steps are run_train.sh's: same config, data, seed, precision
    and parallel layout give the same loss at every step, to the digits the trainer logs. A
    benchmark that rebuilt the step itself (another batch, another mixed precision, FSDP where
    the trainer has none) would drift from the first or second step."""
    from tests.test_train_qwen import _train_ok

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as _run's: the same CPU reduction order
    # training.steps sets the LR schedule, so both runs must name the same.
    settings = ["training.seq_len=128", "training.local_batch_size=2", "training.steps=3"]
    settings += ["training.mixed_precision_param=bfloat16"]  # one rank: torchtitan's autocast
    out = tmp_path / "throughput.json"
    benchmark = [sys.executable, "-m", "benchmarks.throughput", "--flavors", "debugmodel"]
    benchmark += ["--seq-lens", "128", "--no-profile", "--out", str(out)]
    benchmark += ["--warmup", "1", "--steps", "2", "--compile", "none"]
    benchmark += [arg for setting in settings for arg in ("--set", setting)]
    # Side by side: each is one process on one thread.
    with ThreadPoolExecutor(1) as background:
        benchmarked = background.submit(_run, benchmark, checkout)
        _, steps = _train_ok(
            tmp_path / "trainer",
            "--training.steps",
            "3",
            "--training.mixed_precision_param",
            "bfloat16",
        )
        benchmarked.result()
    (result,) = json.loads(out.read_text())["results"]
    logged = [float(steps[step][0]) for step in (1, 2, 3)]
    assert result["losses"] == pytest.approx(logged, abs=1e-5)
    assert "--training.mixed_precision_param" in result["trainer_arguments"]
