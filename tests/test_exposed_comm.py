"""benchmarks/exposed_comm.py on a hand-made Chrome trace of the layout torch.profiler writes."""

import json

from benchmarks import exposed_comm


def _event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _trace():
    return [
        _event("gpu_user_annotation", "bench::forward", 0, 100),
        _event("gpu_user_annotation", "bench::loss", 100, 20),
        _event("gpu_user_annotation", "bench::clip_grad_norm", 300, 10),
        _event("kernel", "ncclDevKernel_AllGather_RING_LL", 0, 20),  # 10 us before the GEMM
        _event("kernel", "nvjet_hsh_128x256", 10, 100),
        _event("kernel", "ncclDevKernel_ReduceScatter_RING", 150, 30),  # a copy cuts it in two
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 160, 5),
        _event("kernel", "ncclDevKernel_SendRecv", 200, 8),  # hidden by a conv kernel
        _event("kernel", "causal_conv1d_bwd_kernel", 195, 20),
    ]


def test_collective_time_counts_only_where_no_other_device_work_runs():
    stretches, origin = exposed_comm.exposed_stretches(_trace())
    assert origin == 0
    found = [(s["kernel"][14:23], s["start"], s["end"]) for s in stretches]
    assert sorted(found) == [("AllGather", 0, 10), ("ReduceSca", 150, 160), ("ReduceSca", 165, 180)]


def test_stretches_fall_in_the_phase_whose_device_span_holds_them(tmp_path, capsys):
    spans = exposed_comm.phase_spans(_trace())
    assert exposed_comm.phase_of(5, spans) == "forward"
    assert exposed_comm.phase_of(150, spans) == "backward"  # between the loss and clipping
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _trace()}))
    exposed_comm.main([str(trace), "--json", str(tmp_path / "out.json")])
    totals = json.loads((tmp_path / "out.json").read_text())["totals"]
    assert sorted((t["kind"], t["phase"], t["ms"]) for t in totals) == [
        ("AllGather", "forward", 0.01),
        ("ReduceScatter", "backward", 0.025),
    ]
    assert "exposed collective time 0.04 ms" in capsys.readouterr().out
