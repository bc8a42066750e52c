"""The torch-free part of the benchmarks: command-line options, JSON files, tables.

benchmarks.memory's search process imports only this: it launches trials and reads their
JSON, and starts in a fraction of a second without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# A CUDA error that is an allocation failure, whatever layer raised it (the caching
# allocator, cuBLAS, a Triton or NCCL launch).
OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "OutOfMemoryError")


def add_training_arguments(parser: argparse.ArgumentParser, steps: int, warmup: int) -> None:
    parser.add_argument("--steps", type=int, default=steps, help="timed steps (the median)")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    parser.add_argument(
        "--config",
        help="the TOML config every configuration trains with (default: the flavor's shipped "
        "config in train_configs/)",
    )
    parser.add_argument(
        "--compile",
        default="config",
        help="torch.compile: config (as the config says), none (eager), or a backend to "
        "enable it with (inductor, aot_eager)",
    )
    parser.add_argument(
        "--corpus",
        default="short",
        choices=("short", "one-document", "long-tail"),
        help="the rows' document lengths (benchmarks/corpora.py): the bundled corpus's short "
        "documents, one document a row, or a long-tailed mix",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="any other setting, as run_train.sh takes it, e.g. training.local_batch_size=2",
    )
    parser.add_argument(
        "--pg-timeout-s",
        type=float,
        default=1800,
        help="collective timeout: a rank stuck in a collective fails after this long",
    )


def command_line(module: str, processes: int) -> str:
    args = shlex.join(sys.argv[1:])
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"torchrun --standalone --nproc_per_node {processes} -m {module} {args}"
    return f"python -m {module} {args}"


def add_command(data: dict, command: str) -> None:
    """`command` into the file's `commands`, once: every invocation that added to a file that
    `--resume` runs continue."""
    commands = data.setdefault("commands", [])
    if command not in commands:
        commands.append(command)


def write_json(path: Path, data: dict) -> None:
    """Atomically: a run stopped mid-write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=str) + "\n")
    partial.replace(path)


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """Rows as a fixed-width table; columns are (key, heading)."""
    cells = [[heading for _, heading in columns]]
    cells += [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        print("  ".join(text.rjust(width) for text, width in zip(line, widths, strict=True)))
    sys.stdout.flush()


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
