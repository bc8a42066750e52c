"""How long a row fits: the longest-sequence searches of `benchmarks.memory`."""

from __future__ import annotations

from benchmarks.report.plots import image
from benchmarks.report.tables import Sources, loss_text, question


@question("How long a row fits?", reads="memory")
def longest_rows(results: dict, sources: Sources, plots: dict) -> list[str]:
    rows = []
    for name, data in results["memory"]:
        options, result = data["options"], data.get("result", {})
        cells = [
            options["flavor"],
            options["cp"],
            options["ac"],
            _searched(options),
            result.get("longest_fit"),
            result.get("first_oom"),
            result.get("peak_reserved_gib"),
            result.get("tokens_per_s_per_gpu"),
            loss_text(result.get("losses")),
            "yes" if result.get("complete") else "no",
        ]
        rows.append((name, cells))
    headings = ["flavor", "cp (GPUs)", "AC", "lengths searched", "longest fit", "first OOM"]
    headings += ["peak reserved GiB", "tokens/s/GPU", "loss first → last", "complete"]
    intro = [
        "Powers of two, then bisection between the longest fit and the first out-of-memory "
        "length; each trial a few real training steps in a fresh process "
        "(`benchmarks/memory.py`). Peak memory and tokens/s at the longest fit; a trial's few "
        "steps are not a throughput measurement.",
        "",
    ]
    return intro + image(plots, "memory") + sources.table(headings, rows)


def _searched(options: dict) -> str:
    start, limit = options["start"], options["limit"]
    return f"{start:,} only" if start == limit else f"{start:,} to {limit:,}"


@question("How long a row of one document fits?", reads="long_row_configs")
def longest_one_document_rows(results: dict, sources: Sources, plots: dict) -> list[str]:
    rows = []
    for name, data in results["long_row_configs"]:
        for trial in data["trials"]:
            last = trial["steps"][-1] if trial["steps"] else {}
            free = trial["free_at_peak_gib"]
            cells = [trial["config"], trial["seq_len"], trial["outcome"]]
            # A step that includes compiling is no speed: tokens/s of completed runs only.
            speed = last.get("tokens_per_s") if len(trial["steps"]) > 1 else None
            cells += [last.get("max_reserved_gib"), free, speed]
            rows.append((name, cells))
    headings = ["config", "row", "outcome", "peak reserved GiB (last step logged)"]
    headings += ["GPU free at the peak GiB", "tokens/s (step 3)"]
    intro = [
        "The one-GPU long-row configs with `run_train.sh`, 3 steps on rows of one document "
        "each (`--corpus one-document` of the benchmarks), fresh machines; the GPU's memory "
        "sampled by `nvidia-smi`. Attention spans the whole row, so these steps cost more, "
        "and hold more, than rows of short documents of the same length.",
        "",
    ]
    return intro + sources.table(headings, rows)
