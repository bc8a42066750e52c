"""Whether the mixers' all-to-alls share the link with FSDP's collectives, from a profiled step.

    python -m benchmarks.comm_overlap TRACE.json [--json out.json]

Reads a Chrome trace written by torch.profiler (`python -m benchmarks.throughput ...
--trace-dir DIR` saves one per profiled step). For each mixer's head exchange (DTensor's op
`_dtensor::shard_dim_alltoall`): its NCCL kernel (found through the launch inside the op, by
correlation id), its message size (the op's input, bytes per rank), its direction (backward
when autograd's engine runs it, recomputed forwards included) and how much of the kernel's time
an FSDP collective kernel (all-gather, reduce-scatter) ran beside it on another stream. Per
direction and size: calls, and the median kernel time of the exchanges with and without such
company. Slow exchanges that are the overlapped ones point at shared bandwidth; slow ones
without company at the other rank arriving late (a kernel's time includes waiting for its
peers)."""

from __future__ import annotations

import argparse
import bisect
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.intervals import covered, merged
from benchmarks.trace_events import LAUNCH_CATEGORIES, load_events, span

EXCHANGE_OP = "_dtensor::shard_dim_alltoall"  # DTensor's Shard -> Shard redistribution
FSDP_KERNELS = ("AllGather", "ReduceScatter")
BACKWARD_OP = "autograd::engine::evaluate_function"
# An exchange counts as overlapped when FSDP's kernels cover this share of it.
OVERLAPPED_SHARE = 0.1
ELEMENT_BYTES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8}


def exchanges(events: list[dict]) -> list[dict]:
    """One entry per all-to-all op with a kernel: direction, bytes, kernel us, overlap us."""
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    launches = _launches_by_thread(events)
    kernels = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "kernel" and "correlation" in e.get("args", {})
    }
    fsdp = merged(
        span(e)
        for e in events
        if e.get("cat") == "kernel" and any(part in e["name"] for part in FSDP_KERNELS)
    )
    backward_ops = [e for e in cpu_ops if e["name"].startswith(BACKWARD_OP)]
    found = []
    for op in (e for e in cpu_ops if e["name"] == EXCHANGE_OP):
        kernel = _kernel_of(op, launches, kernels)
        if kernel is None:
            continue
        found.append(
            {
                "direction": "backward" if _in_backward(op, backward_ops) else "forward",
                "bytes": _input_bytes(op),
                "kernel_us": kernel["dur"],
                "overlap_us": covered(fsdp, *span(kernel)),
            }
        )
    return found


def summarize(found: list[dict]) -> list[dict]:
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for exchange in found:
        groups[exchange["direction"], exchange["bytes"]].append(exchange)
    rows = []
    for (direction, size), group in sorted(groups.items()):
        alone, shared = [], []
        for e in group:
            share = e["overlap_us"] / e["kernel_us"] if e["kernel_us"] else 0.0
            (shared if share >= OVERLAPPED_SHARE else alone).append(e["kernel_us"])
        rows.append(
            {
                "direction": direction,
                "mib": round(size / 2**20, 1),
                "calls": len(group),
                "median_us": _median([e["kernel_us"] for e in group]),
                "alone": len(alone),
                "median_us_alone": _median(alone),
                "beside_fsdp": len(shared),
                "median_us_beside_fsdp": _median(shared),
            }
        )
    return rows


def _launches_by_thread(events: list[dict]) -> dict:
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            by_thread[e.get("tid")].append((e["ts"], e["args"]["correlation"]))
    return {tid: sorted(items) for tid, items in by_thread.items()}


def _kernel_of(op: dict, launches: dict, kernels: dict) -> dict | None:
    items = launches.get(op.get("tid"), [])
    first = bisect.bisect_left(items, (op["ts"], -math.inf))
    for ts, correlation in items[first:]:
        if ts > op["ts"] + op["dur"]:
            return None
        kernel = kernels.get(correlation)
        if kernel is not None and "nccl" in kernel["name"].lower():
            return kernel
    return None


def _in_backward(op: dict, backward_ops: list[dict]) -> bool:
    return any(
        other.get("tid") == op.get("tid")
        and other["ts"] <= op["ts"]
        and op["ts"] + op["dur"] <= other["ts"] + other["dur"]
        for other in backward_ops
    )


def _input_bytes(op: dict) -> int:
    args = op.get("args", {})
    dims = (args.get("Input Dims") or [[]])[0]
    dtype = (args.get("Input type") or [""])[0]
    return math.prod(dims) * ELEMENT_BYTES.get(dtype, 0) if dims else 0


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = summarize(exchanges(load_events(args.trace)))
    print(f"{args.trace.name}: all-to-all kernels alone and beside FSDP's collectives")
    print("direction  MiB/rank  calls  median us  alone  median us  beside FSDP  median us")
    for r in rows:
        print(
            f"{r['direction']:9}  {r['mib']:8}  {r['calls']:5}  {r['median_us']!s:>9}  "
            f"{r['alone']:5}  {r['median_us_alone']!s:>9}  {r['beside_fsdp']:11}  "
            f"{r['median_us_beside_fsdp']!s:>9}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
