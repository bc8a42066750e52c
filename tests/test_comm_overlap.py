"""benchmarks/comm_overlap.py on a hand-made Chrome trace of the layout torch.profiler writes."""

import json

from benchmarks import comm_overlap

SEND = [4, 1, 1024, 8, 128]  # bf16: 8 MiB per rank


def _event(cat, name, ts, dur, tid, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def _exchange(ts, link, kernel_ts, kernel_us, tid=1):
    dims = {"Input Dims": [SEND, [], []], "Input type": ["c10::BFloat16", "", "ScalarList"]}
    return [
        _event("cpu_op", "_dtensor::shard_dim_alltoall", ts, 50, tid, **dims),
        _event("cuda_driver", "cuLaunchKernelEx", ts + 10, 5, tid, correlation=link),
        _event("kernel", "ncclDevKernel_SendRecv", kernel_ts, kernel_us, 7, correlation=link),
    ]


def _trace():
    return [
        # forward, alone: 100 us
        *_exchange(0, 1, 100, 100),
        # backward (autograd's thread), twice: once alone (150 us), once beside a
        # reduce-scatter on FSDP's stream covering 200 of its 300 us
        _event("cpu_op", "autograd::engine::evaluate_function: XBackward", 900, 2000, 2),
        *_exchange(1000, 2, 1100, 150, tid=2),
        *_exchange(1500, 3, 1600, 300, tid=2),
        _event("kernel", "ncclDevKernel_ReduceScatter_Sum_bf16", 1500, 200, 9, correlation=4),
        _event("kernel", "ncclDevKernel_AllGather_RING", 1650, 100, 9, correlation=5),
        # an exchange whose kernel was not traced is left out
        _event("cpu_op", "_dtensor::shard_dim_alltoall", 3000, 10, 1),
    ]


def test_each_exchange_has_its_kernel_size_direction_and_fsdp_company():
    found = sorted(comm_overlap.exchanges(_trace()), key=lambda e: e["kernel_us"])
    assert [e["direction"] for e in found] == ["forward", "backward", "backward"]
    assert {e["bytes"] for e in found} == {8 * 2**20}
    # merged FSDP intervals [1500, 1750] cover [1600, 1750] of the kernel [1600, 1900]
    assert [e["overlap_us"] for e in found] == [0.0, 0.0, 150.0]


def test_rows_split_alone_from_beside_fsdp(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": _trace()}))
    out = tmp_path / "rows.json"
    assert comm_overlap.main([str(trace), "--json", str(out)]) == 0
    backward, forward = json.loads(out.read_text())
    assert forward == {
        "direction": "forward",
        "mib": 8.0,
        "calls": 1,
        "median_us": 100,
        "alone": 1,
        "median_us_alone": 100,
        "beside_fsdp": 0,
        "median_us_beside_fsdp": None,
    }
    assert (backward["calls"], backward["alone"], backward["beside_fsdp"]) == (2, 1, 1)
    assert (backward["median_us_alone"], backward["median_us_beside_fsdp"]) == (150, 300)
    assert "beside FSDP" in capsys.readouterr().out
