"""Chrome traces as torch.profiler writes them (`python -m benchmarks.throughput ...
--trace-dir DIR` saves one per profiled step): their events, and the names the trace tools
(`benchmarks.trace_gaps`, `benchmarks.exposed_comm`, `benchmarks.comm_overlap`) look for."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

# Work on the device: kernels, copies and memsets, on any stream.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# The host's CUDA calls that launch it (a launch and its work share a correlation id).
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
# The benchmark's profiler ranges around the parts of a step.
STEP_PHASES = ("bench::documents", "bench::forward", "bench::loss", "bench::clip_grad_norm")


def load_events(path: Path) -> list[dict]:
    """The duration events of a trace file, gzipped (`.gz`) or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        data = json.load(file)
    return duration_events(data["traceEvents"] if isinstance(data, dict) else data)


def duration_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def span(event: dict) -> tuple[float, float]:
    """(start, end) of a duration event, in us."""
    return event["ts"], event["ts"] + event["dur"]
