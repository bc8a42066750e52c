"""Summarize torchtitan training logs: losses, throughput and memory, as a table and JSON.

    python scripts/summarize_runs.py LOG [LOG ...] [--compare A B] [--json out.json]

Each LOG is the output of run_train.sh (rank 0). `--compare A B` also reports the largest
per-step relative loss difference between two runs (e.g. cp=2 against cp=1).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([0-9.naninf]+).*?memory:\s*([0-9.]+)GiB.*?tps:\s*([0-9,]+)"
)


def parse(path: str) -> dict:
    steps = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        match = STEP.search(ANSI.sub("", line))
        if match:
            step, loss, memory, tps = match.groups()
            steps[int(step)] = dict(
                loss=float(loss), memory_gib=float(memory), tps=int(tps.replace(",", ""))
            )
    return steps


def summary(name: str, steps: dict) -> dict:
    if not steps:
        return dict(run=name, steps=0)
    ordered = [steps[k] for k in sorted(steps)]
    warm = ordered[len(ordered) // 3 :] or ordered  # skip compile/autotune warm-up
    return dict(
        run=name,
        steps=max(steps),
        first_loss=ordered[0]["loss"],
        last_loss=ordered[-1]["loss"],
        median_tps_per_gpu=statistics.median(s["tps"] for s in warm),
        peak_memory_gib=max(s["memory_gib"] for s in ordered),
    )


def compare(a: dict, b: dict) -> dict:
    common = sorted(set(a) & set(b))
    diffs = [abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in common]
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    return dict(
        steps_compared=len(common),
        max_relative_loss_diff=max(diffs) if diffs else None,
        at_step=common[worst] if diffs else None,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("logs", nargs="*")
    parser.add_argument("--compare", nargs=2, action="append", default=[])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [summary(Path(p).stem, parse(p)) for p in args.logs]
    header = ("run", "steps", "loss first", "loss last", "tok/s/GPU", "peak GiB")
    print("{:28s} {:>5s} {:>10s} {:>10s} {:>10s} {:>9s}".format(*header))
    for r in rows:
        if r["steps"]:
            print(
                f"{r['run']:28s} {r['steps']:5d} {r['first_loss']:10.4f} {r['last_loss']:10.4f} "
                f"{r['median_tps_per_gpu']:10.0f} {r['peak_memory_gib']:9.2f}"
            )
        else:
            print(f"{r['run']:28s} no steps logged")
    comparisons = []
    for a, b in args.compare:
        result = dict(a=Path(a).stem, b=Path(b).stem, **compare(parse(a), parse(b)))
        comparisons.append(result)
        print(f"compare {result['a']} vs {result['b']}: {result}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runs=rows, comparisons=comparisons), indent=2))


if __name__ == "__main__":
    main()
