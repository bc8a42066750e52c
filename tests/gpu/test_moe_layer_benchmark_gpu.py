"""benchmarks/moe_layer.py on one GPU at the debug MoE shape: transformers' layer with FLA's
delta rule and each experts implementation passes the parity check against ours, and every
point has its time, memory and (ours) parts from GPU kernels. Needs a CUDA device: CI
deselects it with ``-m "not gpu"``.
"""

import json

import pytest

from benchmarks import moe_layer
from tests.test_moe_layer_benchmark import points_of_a_complete_run

pytestmark = pytest.mark.gpu


def test_moe_layer_benchmark_on_one_gpu(tmp_path):
    out = tmp_path / "moe_layer.json"
    argv = ["--flavor", "debugmoe", "--tokens", "4096", "--device", "cuda", "--reps", "3"]
    argv += ["--warmup", "2", "--profile-steps", "2", "--check-tokens", "256", "--out", str(out)]
    moe_layer.main(argv)
    result = json.loads(out.read_text())

    assert result["transformers"]["delta_rule"] == "fla"
    assert result["environment"]["versions"]["cuda"]
    points = points_of_a_complete_run(result)
    for (_, _, candidate), entry in points.items():
        assert "error" not in entry, entry
        assert entry["ms"] > 0 and entry["step_peak_gib"] > 0
        if candidate == "titan_gdn":
            assert entry["measure"] == "GPU kernel time"
            routed = [p for p in moe_layer.PARTS if p != "other"]
            assert all(entry["parts_ms"][p] > 0 for p in routed), entry["parts_ms"]
            assert 0 < entry["grouped_gemm_kernels_ms"] <= entry["parts_ms"]["grouped_gemm"]
            assert entry["grouped_gemm_tflops"] > 0
