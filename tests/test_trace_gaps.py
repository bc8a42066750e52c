"""benchmarks/trace_gaps.py on hand-made Chrome traces of the layout torch.profiler writes."""

import gzip
import json

import pytest

from benchmarks import trace_gaps
from benchmarks.trace_events import duration_events


def _kernel(name, ts, dur, correlation, stream=7):
    args = {"correlation": correlation, "stream": stream}
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "tid": stream,
        "args": args,
    }


def _launch(ts, correlation, tid=1):
    args = {"correlation": correlation}
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 3,
        "tid": tid,
        "args": args,
    }


def _op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {}}


def _trace():
    return [
        _op("aten::linear", 105, 35),
        _op("aten::mm", 110, 20),  # the innermost op around the late launch
        _op("other_thread_op", 115, 2, tid=2),  # another thread: not the launcher
        _launch(1, 1),
        _kernel("first", 0, 100, 1),
        _launch(120, 2),  # after the GPU went idle at 100: the host's 50 us
        _kernel("sm90_gemm", 150, 50, 2),
        _launch(90, 3),  # queued before the gap at 200 began: the device's 60 us
        _kernel("ncclDevKernel_SendRecv", 260, 40, 3),
        _launch(302, 4),
        _kernel("short_gap", 305, 5, 4),  # 5 us: below the threshold
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 400},  # not a duration event
    ]


def test_gaps_are_the_hosts_when_the_next_work_was_launched_late():
    summary = trace_gaps.find_gaps(duration_events(_trace()), min_gap_us=20)
    assert summary["idle_ms"] == {"host": 0.05, "device": 0.06}
    assert summary["gaps"] == 2 and summary["device_span_ms"] == 0.31
    assert summary["host_idle_by_launching_op_ms"] == {"aten::mm": 0.05}
    largest = summary["largest"][0]
    assert (largest["us"], largest["owner"], largest["next_work"]) == (
        60,
        "device",
        "ncclDevKernel_SendRecv",
    )


def test_work_on_another_stream_fills_a_gap():
    busy_elsewhere = _kernel("other_stream", 90, 200, 9, stream=8)
    summary = trace_gaps.find_gaps(duration_events([*_trace(), busy_elsewhere]))
    assert summary["gaps"] == 0 and summary["idle_ms"] == {"host": 0.0, "device": 0.0}


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_main_reads_plain_and_gzipped_traces_and_writes_the_summary(tmp_path, capsys, suffix):
    path = tmp_path / f"step{suffix}"
    opener = gzip.open if suffix.endswith(".gz") else open
    with opener(path, "wt") as file:
        json.dump({"traceEvents": _trace()}, file)
    out = tmp_path / "gaps.json"
    assert trace_gaps.main([str(path), "--json", str(out)]) == 0
    assert "0.05 ms host-late + 0.06 ms waiting on the device" in capsys.readouterr().out
    assert json.loads(out.read_text())["idle_ms"] == {"host": 0.05, "device": 0.06}
