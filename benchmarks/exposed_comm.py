"""Where in a profiled step the collectives run with no compute beside them.

    python -m benchmarks.exposed_comm TRACE.json [--top 15] [--json out.json]

Reads a Chrome trace written by torch.profiler (`benchmarks.throughput --trace-dir`). A
collective kernel is exposed while no other kernel, copy or memset runs on the device: the step
waits on the link (or on a late peer) then. Prints the exposed time per NCCL kernel kind and per
step phase (the benchmark's `bench::` ranges on the device; backward is what lies between the
loss and gradient clipping), and the longest exposed stretches with their offset from the step's
first kernel. The step breakdown of `benchmarks.throughput` records the same exposed time per
kind of collective (`exposed_comm_ms`).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from benchmarks.intervals import merged, uncovered
from benchmarks.trace_events import DEVICE_CATEGORIES, STEP_PHASES, load_events, span


def exposed_stretches(events: list[dict]) -> tuple[list[dict], float]:
    """Exposed parts of each collective kernel: kernel name, start, end (us); and the step's
    first device timestamp."""
    work = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    compute = merged(span(e) for e in work if not e["name"].startswith("nccl"))
    stretches = []
    for kernel in (e for e in work if e["name"].startswith("nccl")):
        for gap_start, gap_end in uncovered(compute, *span(kernel)):
            stretches.append({"kernel": kernel["name"], "start": gap_start, "end": gap_end})
    origin = min((e["ts"] for e in work), default=0.0)
    return stretches, origin


def phase_spans(events: list[dict]) -> list[tuple[str, float, float]]:
    spans = [
        (e["name"].removeprefix("bench::"), *span(e))
        for e in events
        if e.get("cat") == "gpu_user_annotation" and e["name"] in STEP_PHASES
    ]
    spans.sort(key=lambda phase: phase[1])
    by_name = {name: (start, end) for name, start, end in spans}
    if "loss" in by_name and "clip_grad_norm" in by_name:
        spans.append(("backward", by_name["loss"][1], by_name["clip_grad_norm"][0]))
    return spans


def phase_of(time: float, spans: list[tuple[str, float, float]]) -> str:
    return next((name for name, start, end in spans if start <= time < end), "other")


def kind(kernel: str) -> str:
    for part in ("AllGather", "ReduceScatter", "SendRecv", "AllToAll", "AllReduce"):
        if part in kernel:
            return part
    return kernel[:40]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    events = load_events(args.trace)
    stretches, origin = exposed_stretches(events)
    spans = phase_spans(events)
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for s in stretches:
        s["phase"] = phase_of(s["start"], spans)
        totals[kind(s["kernel"]), s["phase"]] += s["end"] - s["start"]
    print(f"{args.trace.name}: exposed collective time {sum(totals.values()) / 1000:.2f} ms")
    print(f"{'kind':<15}{'phase':<16}{'ms':>8}")
    for (name, phase), us in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{name:<15}{phase:<16}{us / 1000:>8.2f}")
    print("longest stretches (offset from the step's first kernel):")
    longest = sorted(stretches, key=lambda s: s["start"] - s["end"])[: args.top]
    for s in longest:
        offset, length = (s["start"] - origin) / 1000, (s["end"] - s["start"]) / 1000
        print(f"  {offset:9.2f} ms  {length:7.3f} ms  {s['phase']:<14} {s['kernel'][:60]}")
    if args.json:
        rows = [{"kind": k, "phase": p, "ms": round(us / 1000, 3)} for (k, p), us in totals.items()]
        args.json.write_text(json.dumps({"totals": rows, "longest": longest}, indent=1))


if __name__ == "__main__":
    main()
