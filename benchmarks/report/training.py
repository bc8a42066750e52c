"""What the training command delivers: on one GPU, against transformers + FLA, at each row
length, and in the GPU validation's training runs."""

from __future__ import annotations

from benchmarks.report.plots import image
from benchmarks.report.tables import (
    Sources,
    ac_name,
    by_flavor,
    find,
    harness,
    host_share,
    is_trainer,
    latest,
    loss_text,
    mode,
    ok,
    ours,
    overrides,
    pct,
    question,
    ratio,
    seconds,
    status_or,
)


@question("What does the training command deliver on one H200?")
def training_command(results: dict, sources: Sources, plots: dict) -> list[str]:
    rows = [item for item in ours(results, ok_only=False) if is_trainer(item[2])]
    rows = [item for item in rows if item[2].get("gpus") == 1]
    if not rows:
        return []
    rows = by_flavor(rows, "seq_len", "ac")
    body = []
    for name, data, r in rows:
        changed = overrides(data)
        cells = [
            r["flavor"],
            r["seq_len"],
            ac_name(r["ac"]),
            f"`{r['config']}`" if r.get("config") else None,
            f"`{changed}`" if changed else None,
            r["status"],
            seconds(r.get("step_time_s")),
            pct(host_share(r)),
            r.get("tokens_per_s_per_gpu"),
            pct(r.get("mfu")),
            r.get("peak_reserved_gib"),
            loss_text(r.get("losses")),
        ]
        body.append((name, cells))
    headings = ["flavor", "seq_len", "checkpointing", "config", "overrides", "status"]
    headings += ["step (s)", "host", "tokens/s", "MFU", "peak reserved GiB", "loss first → last"]
    intro = [
        "`run_train.sh`'s trainer (`Qwen35Trainer` from the shipped TOML config, compiled as "
        "the config says, no checkpoint saving; the benchmark sets the length and the "
        "checkpointing mode) timed per step by `python -m benchmarks.throughput` on one GPU: "
        "median of the timed steps after the warm-up. host: the time until the step's call "
        "returns over the step time (near 100%: the GPU waited for the host). MFU uses the "
        "trainer's FLOP count (`titan_gdn/model/flops.py`). Files named `rows_packed_in_step` "
        "ran an earlier trainer that tokenized and packed rows inside the step; "
        "`docs/results/training_command/README.md` says what each file ran.",
        "",
    ]
    return intro + sources.table(headings, body)


@question("How does titan_gdn compare with transformers + FLA?")
def against_transformers(results: dict, sources: Sources, plots: dict) -> list[str]:
    rows = []
    for name, data in results.get("throughput", []):
        theirs = data.get("transformers", [])
        for flavor, seq_len in dict.fromkeys((t["flavor"], t["seq_len"]) for t in theirs):
            mine = [
                r
                for r in ok(data["results"])
                if (r["flavor"], r["seq_len"], r["cp"]) == (flavor, seq_len, 1)
            ]
            if not mine:
                continue
            best = max(mine, key=lambda r: r["tokens_per_s_per_gpu"])
            plain = find(theirs, flavor=flavor, seq_len=seq_len, gradient_checkpointing=False)
            checkpointed = find(theirs, flavor=flavor, seq_len=seq_len, gradient_checkpointing=True)
            finished = [t["tokens_per_s_per_gpu"] for t in ok([plain or {}, checkpointed or {}])]
            speedup = best["tokens_per_s_per_gpu"] / max(finished) if finished else None
            rows.append((name, data, best, plain, checkpointed, speedup))
    if not rows:
        return []
    rows = by_flavor(rows, "seq_len")
    body = [
        (
            name,
            [
                best["flavor"],
                best["seq_len"],
                _setup(data, best),
                best["tokens_per_s_per_gpu"],
                best.get("peak_reserved_gib"),
                status_or(plain, "tokens_per_s_per_gpu"),
                status_or(plain, "peak_reserved_gib"),
                status_or(checkpointed, "tokens_per_s_per_gpu"),
                status_or(checkpointed, "peak_reserved_gib"),
                ratio(speedup),
            ],
        )
        for name, data, best, plain, checkpointed, speedup in rows
    ]
    headings = ["flavor", "seq_len", "ours: checkpointing, GPUs, step", "ours tokens/s/GPU"]
    headings += ["ours GiB", "transformers tokens/s", "GiB", "transformers, checkpointing"]
    headings += ["GiB", "ours / theirs (best)"]
    intro = [
        "transformers `Qwen3_5ForCausalLM` on the same rows (one GPU, bf16 weights and AdamW, "
        "eager, FLA's delta rule, its full-logits loss; rows as plain sequences, without "
        "document masking), without and with gradient checkpointing, against our fastest "
        "cp=1 configuration of the same run. Ours on 2 GPUs is FSDP over the two, per GPU. "
        "step: `trainer` is the training command, `rebuilt` the step older benchmark runs "
        "rebuilt from the model. GiB: peak reserved.",
        "",
    ]
    return intro + sources.table(headings, body)


def _setup(data: dict, result: dict) -> str:
    """Checkpointing, GPUs and whether the training command or a rebuilt step ran."""
    gpus = result["gpus"]
    return f"{mode(data, result)}, {gpus} GPU{'s' * (gpus > 1)}, {harness(result)}"


@question("How does throughput change with the row length?")
def throughput_by_length(results: dict, sources: Sources, plots: dict) -> list[str]:
    key = lambda r: (r["flavor"], r["seq_len"], r.get("gpus"), r["cp"], r["ac"], is_trainer(r))  # noqa: E731
    rows = latest(ours(results, ok_only=False), key)
    if not rows:
        return []
    rows = by_flavor(rows, "seq_len", "gpus", "cp", "ac")
    body = [
        (
            name,
            [
                r["flavor"],
                r["seq_len"],
                r.get("gpus"),
                r["cp"],
                r.get("dp"),
                mode(data, r),
                harness(r),
                r["status"],
                r.get("documents_per_row"),
                seconds(r.get("step_time_s")),
                pct(host_share(r)),
                r.get("tokens_per_s_per_gpu"),
                pct(r.get("mfu")),
                pct(r.get("mfu_documents")),
                r.get("peak_reserved_gib"),
                r.get("peak_active_gib"),
            ],
        )
        for name, data, r in rows
    ]
    headings = ["flavor", "seq_len", "GPUs", "cp", "dp", "checkpointing", "step", "status"]
    headings += ["docs/row", "step (s)", "host", "tokens/s/GPU", "MFU", "MFU (documents)"]
    headings += ["peak reserved GiB", "peak active GiB"]
    intro = [
        "Every configuration measured, from its most recent file. Median of the timed steps "
        "(warm-up excluded), slowest rank; tokens/s per GPU counts every rank's tokens. cp=1 "
        "with N GPUs is N-way data parallel (FSDP). step: `trainer` is the training command, "
        "`rebuilt` the step older benchmark runs rebuilt from the model (same model code, "
        "batches prepared before timing). MFU uses the trainer's FLOP count "
        "(`titan_gdn/model/flops.py`: attention over the whole row); MFU (documents) counts "
        "attention within each document and the delta rule as FLA computes it "
        "(`benchmarks/flop_count.py`). host: the time until the step's call returns over the "
        "step time; near 100%, the GPU waited for the host's launches.",
        "",
    ]
    return intro + image(plots, "throughput") + sources.table(headings, body)


@question("What do the training runs show?", reads="runs")
def training_runs(results: dict, sources: Sources, plots: dict) -> list[str]:
    files = results["runs"]
    rows = [
        (
            name,
            [
                r.get("run"),
                r.get("steps"),
                loss_text([r["first_loss"], r["last_loss"]]) if "first_loss" in r else None,
                r.get("median_tps_per_gpu"),
                r.get("peak_memory_gib"),
            ],
        )
        for name, data in files
        for r in data["runs"]
    ]
    intro = [
        "`scripts/gpu_validation.sh` runs of `run_train.sh` (its step names: long sequences on "
        "one GPU, eager against compiled, cp=2 against cp=1, the debug config on 2 GPUs), "
        "summarized by `scripts/summarize_runs.py` from rank 0's log.",
        "",
    ]
    headings = ["run", "steps", "loss first → last", "tokens/s/GPU", "peak GiB"]
    return intro + sources.table(headings, rows, [name for name, _ in files])
