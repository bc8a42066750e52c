"""Where a profiled step leaves the GPU idle, and whether the host was late.

    python -m benchmarks.trace_gaps TRACE.json [--min-gap-us 20] [--top 15] [--json out.json]

Reads a Chrome trace written by torch.profiler (`benchmarks.throughput --trace-dir`). Every
interval in which no kernel, copy or memset runs on any stream is a gap. A gap is the host's
when the work after it was launched after the gap began (the GPU had nothing queued: launch
overhead, Python, a host sync); otherwise the queued work waited on something on the device
(another stream, a collective's peer, an event). Host gaps are charged to the innermost CPU op
running at the launch, which names the slow host code. The profiler's own overhead makes host
gaps longer than in an unprofiled step: compare their share with `busy_ms` and the step time of
the benchmark JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from benchmarks.trace_events import DEVICE_CATEGORIES, LAUNCH_CATEGORIES, load_events, span


def find_gaps(events: list[dict], min_gap_us: float = 20.0) -> dict:
    """Idle intervals of the device between its first and last work, split into the host's
    (launched late) and the device's (queued but waiting)."""
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    gaps, busy_until = [], None
    for work in device:
        start, end = span(work)
        if busy_until is not None and start - busy_until >= min_gap_us:
            gaps.append(_gap(busy_until, work, launches, cpu_ops))
        busy_until = end if busy_until is None else max(busy_until, end)
    return _summary(gaps, device)


def _gap(gap_start: float, after: dict, launches: dict, cpu_ops: list[dict]) -> dict:
    launch = launches.get(after.get("args", {}).get("correlation"))
    late = launch is not None and launch["ts"] > gap_start
    # Only a late launch has a host op to blame; the search scans every CPU op.
    host_op = _innermost(cpu_ops, launch) if late else None
    return {
        "start_us": gap_start,
        "us": round(after["ts"] - gap_start, 3),
        "owner": "host" if late else "device",
        "next_work": after["name"],
        "launched_by": host_op["name"] if host_op else None,
    }


def _innermost(cpu_ops: list[dict], launch: dict) -> dict | None:
    """The shortest CPU op on the launching thread that contains the launch."""
    at, thread = launch["ts"], launch.get("tid")
    around = [
        op for op in cpu_ops if op.get("tid") == thread and op["ts"] <= at <= op["ts"] + op["dur"]
    ]
    return min(around, key=lambda op: op["dur"]) if around else None


def _summary(gaps: list[dict], device: list[dict]) -> dict:
    span = (max(e["ts"] + e["dur"] for e in device) - device[0]["ts"]) if device else 0.0
    idle = {"host": 0.0, "device": 0.0}
    by_launcher: dict[str, float] = defaultdict(float)
    for gap in gaps:
        idle[gap["owner"]] += gap["us"]
        if gap["owner"] == "host":
            by_launcher[gap["launched_by"] or "?"] += gap["us"]
    return {
        "device_span_ms": round(span / 1000, 3),
        "idle_ms": {owner: round(us / 1000, 3) for owner, us in idle.items()},
        "gaps": len(gaps),
        "host_idle_by_launching_op_ms": {
            name: round(us / 1000, 3)
            for name, us in sorted(by_launcher.items(), key=lambda item: -item[1])
        },
        "largest": sorted(gaps, key=lambda gap: -gap["us"]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = find_gaps(load_events(args.trace), args.min_gap_us)
    summary["largest"] = summary["largest"][: args.top]
    print(
        f"{args.trace.name}: device span {summary['device_span_ms']} ms, "
        f"idle {summary['idle_ms']['host']} ms host-late + {summary['idle_ms']['device']} ms "
        f"waiting on the device, in {summary['gaps']} gaps >= {args.min_gap_us:g} us"
    )
    print("host-late idle by the CPU op that launched the next work (ms):")
    for name, ms in list(summary["host_idle_by_launching_op_ms"].items())[: args.top]:
        print(f"  {ms:9.3f}  {name}")
    print("largest gaps:")
    for gap in summary["largest"]:
        print(f"  {gap['us']:9.1f} us  {gap['owner']:6}  before {gap['next_work'][:60]}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
