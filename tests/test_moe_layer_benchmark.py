"""benchmarks/moe_layer.py end to end on CPU at the debug MoE shape: every point and column in
its JSON and in the performance page's table, and the parity check that guards its comparison
passes with the copied weights and stops the benchmark when one weight differs."""

import json

import pytest
import torch

from benchmarks import moe_layer
from benchmarks.corpora import CORPORA
from benchmarks.references import transformers_qwen3_5_module
from benchmarks.report import kernels, page
from benchmarks.report.tables import Sources

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def modeling():
    return transformers_qwen3_5_module(torch_path=True, family="qwen3_5_moe")


def points_of_a_complete_run(result: dict) -> dict[tuple[str, str, str], dict]:
    """{(mixer, corpus, candidate): entry} of a run over every mixer and corpus, once every
    installed transformers candidate has passed its check on each branch and every point is
    there."""
    theirs = [f"transformers_{name}" for name in moe_layer.installed_experts_implementations()]
    for mixer in moe_layer.MIXERS:
        for name in theirs:
            errors = result["checks"][mixer][name]
            assert isinstance(errors, dict), f"{mixer} {name}: {errors}"
            branches = {
                f"{b}_{what}" for b in ("mixer", "moe") for what in ("output", "input_grad")
            }
            assert set(errors) == branches, errors
            assert max(errors.values()) <= result["settings"]["tolerance"]
    points = {(r["mixer"], r["corpus"], r["candidate"]): r for r in result["results"]}
    candidates = [*theirs, "titan_gdn"]
    assert set(points) == {(m, c, n) for m in moe_layer.MIXERS for c in CORPORA for n in candidates}
    return points


def test_every_point_and_column_on_cpu_and_its_table(tmp_path):
    out = tmp_path / "moe_layer.json"
    argv = ["--flavor", "debugmoe", "--tokens", "64", "--device", "cpu", "--reps", "1"]
    argv += ["--warmup", "0", "--profile-steps", "1", "--check-tokens", "32", "--out", str(out)]
    argv += ["--compile-backend", "eager"]  # compiled as the trainer does, no codegen on CPU
    moe_layer.main(argv)
    result = json.loads(out.read_text())

    assert "eager" in moe_layer.installed_experts_implementations()
    points = points_of_a_complete_run(result)
    for (mixer, corpus, candidate), entry in points.items():
        assert entry["tokens"] == 64 and entry["ms"] > 0 and "step_peak_gib" in entry
        if candidate == "titan_gdn":
            # Every part holds work: a hook that never fires leaves its part at zero.
            assert set(entry["parts_ms"]) == set(moe_layer.PARTS)
            assert all(ms > 0 for ms in entry["parts_ms"].values()), entry["parts_ms"]
            assert 0 < entry["grouped_gemm_kernels_ms"] <= entry["parts_ms"]["grouped_gemm"]
            assert entry["grouped_gemm_tflops"] > 0
        else:
            assert entry["over_ours"] == pytest.approx(
                entry["ms"] / points[mixer, corpus, "titan_gdn"]["ms"], rel=1e-2
            )
    assert result["environment"]["command"].startswith("python -m benchmarks.moe_layer")
    assert result["shape"]["num_experts"] == 8 and result["shape"]["top_k"] == 2

    # The performance page's table of it: a row per entry, the command under it.
    results = {"moe_layer": [("moe_layer_cpu.json", result)]}
    lines = kernels.moe_layer_alone(results, Sources(results), {})
    assert kernels.moe_layer_alone in page.SECTIONS
    assert list(kernels.MOE_LAYER_PARTS) == list(moe_layer.PARTS)
    assert len([line for line in lines if line.startswith("| debugmoe |")]) == len(points)
    assert any("`python -m benchmarks.moe_layer --flavor debugmoe" in line for line in lines)


@pytest.mark.parametrize(
    ("mixer", "weight"),
    [
        ("linear_attention", "linear_attn.conv1d.weight"),
        ("linear_attention", "mlp.experts.down_proj"),
        ("full_attention", "self_attn.q_proj.weight"),
        ("full_attention", "mlp.shared_expert_gate.weight"),
    ],
)
def test_parity_check_fails_when_one_weight_differs(modeling, mixer, weight):
    args = moe_layer.layer_args("debugmoe", mixer)
    layers = moe_layer.build_layers(args, CPU, modeling, delta_rule="torch")
    options = moe_layer.parse_args(["--check-tokens", "48"])
    errors = moe_layer.check_candidate(layers, "eager", options, CPU)
    assert max(errors.values()) <= options.tolerance  # the copied weights pass

    with torch.no_grad():
        parameter = layers.theirs.get_parameter(weight)
        parameter.add_(torch.randn_like(parameter) * parameter.float().std().clamp(min=0.1))
    with pytest.raises(moe_layer.ParityError, match="transformers_eager differs from ours"):
        moe_layer.check_candidate(layers, "eager", options, CPU)


def test_rows_are_cut_like_each_corpus():
    short = moe_layer.row_lengths("short", 4096)
    # The bundled documents: about 54 tokens each, so a 4k row holds dozens of them.
    assert sum(short) == 4096 and len(short) > 40
    assert moe_layer.row_lengths("one-document", 4096) == [4096]
    long_tail = moe_layer.row_lengths("long-tail", 65536)
    assert sum(long_tail) == 65536 and 3 < len(long_tail) < len(short)


def test_bad_settings_are_named_before_any_layer_is_built():
    with pytest.raises(SystemExit, match="--flavor 0.8B is not a Qwen3.5 MoE flavor"):
        moe_layer.main(["--flavor", "0.8B", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--transformers-experts \\['fused'\\]"):
        moe_layer.main(["--transformers-experts", "fused", "--device", "cpu"])


def test_gpu_kernels_go_to_the_part_whose_forward_made_them():
    """A hand-made CUDA trace of one call: backward kernels follow their node's sequence number
    to the forward part; inside the grouped-GEMM part only the GEMMs count as GEMM time."""
    from tests.test_benchmarks import _event, _kernel

    router = _event(1, moe_layer.PART_RANGE + "router", 0, 10, is_user_annotation=True)
    logits = _event(2, "aten::mm", 1, 5, router, seq=3)
    gemms = _event(3, moe_layer.PART_RANGE + "grouped_gemm", 20, 40, is_user_annotation=True)
    gate_up = _event(4, "aten::_grouped_mm", 21, 30, gemms, seq=5)
    engine = _event(5, "autograd::engine::evaluate_function: GroupedMmBackward0", 100, 150)
    node = _event(6, "GroupedMmBackward0", 101, 149, engine, seq=5)
    grad_gemm = _event(7, "aten::_grouped_mm", 102, 120, node)
    layout = _event(8, "aten::copy_", 121, 130, node)
    accumulate = _event(9, "autograd::engine::evaluate_function: AccumulateGrad", 160, 170)
    kernels = [
        _kernel(10, "nvjet_router", 2, 4, logits),
        _kernel(11, "cutlass_grouped_fwd", 22, 28, gate_up),
        _kernel(12, "cutlass_grouped_bwd", 103, 115, grad_gemm),
        _kernel(13, "elementwise_copy", 122, 126, layout),
        _kernel(14, "elementwise_add", 161, 163, accumulate),
    ]
    cpu = [router, logits, gemms, gate_up, engine, node, grad_gemm, layout, accumulate]
    result = moe_layer.part_times_ms(cpu + kernels, cuda=True, steps=1)
    parts = result["parts_ms"]
    assert parts["router"] == 0.002
    assert parts["grouped_gemm"] == 0.022  # 6 forward + 12 backward + 4 of the copy
    assert result["grouped_gemm_kernels_ms"] == 0.018
    assert parts["other"] == 0.002  # gradient accumulation: no forward part
    assert parts["mixer"] == parts["permutation"] == 0


def test_resume_keeps_the_points_the_file_holds_and_measures_the_rest(tmp_path, monkeypatch):
    out = tmp_path / "moe_layer.json"
    argv = ["--flavor", "debugmoe", "--tokens", "64", "--device", "cpu", "--reps", "1"]
    argv += ["--warmup", "0", "--profile-steps", "1", "--check-tokens", "32", "--out", str(out)]
    argv += ["--compile-backend", "none", "--mixers", "full_attention"]
    theirs = [f"transformers_{name}" for name in moe_layer.installed_experts_implementations()]
    candidates = {"titan_gdn", *theirs}

    def entries(result, corpus):
        return [e for e in result["results"] if e["corpus"] == corpus]

    first = moe_layer.main([*argv, "--corpora", "short"])
    # A run cut short inside its second point: ours measured, transformers' not.
    cut = moe_layer.main([*argv, "--resume", "--corpora", "short", "one-document"])
    cut["results"] = [
        e for e in cut["results"] if e["corpus"] == "short" or e["candidate"] == "titan_gdn"
    ]
    out.write_text(json.dumps(cut))

    resumed = moe_layer.main([*argv, "--resume", "--corpora", "short", "one-document"])
    saved = json.loads(out.read_text())
    assert entries(saved, "short") == entries(first, "short")  # not measured again
    one_document = entries(saved, "one-document")
    assert sorted(e["candidate"] for e in one_document) == sorted(candidates)
    ours = next(e for e in one_document if e["candidate"] == "titan_gdn")
    for entry in one_document:
        if entry is not ours:  # over the ours of its own run, not the cut run's
            assert entry["over_ours"] == pytest.approx(entry["ms"] / ours["ms"], rel=1e-2)
    assert saved["environment"] == first["environment"]
    assert all(set(e["measured"]) == {"date", "git"} for e in saved["results"])
    # The cut run and the resumed one ran the same command: it is listed once.
    assert saved["commands"] == [first["environment"]["command"], resumed["commands"][-1]]
    assert "--resume" in saved["commands"][1]
    assert resumed["results"] == saved["results"]

    # Nothing left to measure: no layer is built.
    def no_layers(*args, **kwargs):
        raise AssertionError("a complete file needs no layer")

    monkeypatch.setattr(moe_layer, "build_layers", no_layers)
    moe_layer.main([*argv, "--resume", "--corpora", "one-document"])

    with pytest.raises(SystemExit, match="--reps: the file was measured with 1, this run asks 2"):
        moe_layer.main([*argv[:7], "2", *argv[8:], "--resume"])
    with pytest.raises(SystemExit, match="--resume: continues the file of --out"):
        moe_layer.main(["--resume", "--device", "cpu", "--flavor", "debugmoe"])
