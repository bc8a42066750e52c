"""The targets and how far each configuration is from them: one GPU's, and every target of every
configuration's most recent run."""

from __future__ import annotations

import re

from benchmarks.report.kernels import CATEGORY_NAMES, counted_twice, gdn_kernel_share
from benchmarks.report.tables import (
    Sources,
    by_flavor,
    configuration,
    date,
    find,
    is_trainer,
    met,
    mode,
    ok,
    overrides,
    pct,
    question,
    ratio,
)

TARGET_SPEEDUP_VS_TRANSFORMERS = 2.0
TARGET_STEP_OVER_BUSY = 1.05  # at most: the step against the time any kernel runs
TARGET_MFU_DOCUMENTS = 0.45
TARGET_MFU_AT = ("2B", 32768)  # the configuration the MFU target is set for
TARGET_CP_EFFICIENCY = 0.85
TARGET_BANDWIDTH_SHARE = 0.8
TARGET_GDN_KERNEL_SHARE = 0.7
TARGET_CP_LENGTH_RATIO = 1.9


@question("How far is one GPU from its targets?")
def one_gpu_targets(results: dict, sources: Sources, plots: dict) -> list[str]:
    points = {}
    for name, data in results.get("throughput", []):
        theirs = data.get("transformers", [])
        for r in ok(data["results"]):
            tried = transformers_for(theirs, r)
            if not (is_trainer(r) and r["gpus"] == 1 and tried and "breakdown" in r):
                continue
            key = (r["flavor"], r["seq_len"])
            rank = (date(data), r["tokens_per_s_per_gpu"])
            if key not in points or points[key][0] <= rank:
                points[key] = (rank, name, data, r)
    if not points:
        return []
    entries = by_flavor([(n, d, r) for _, n, d, r in points.values()], "seq_len")
    body = [(name, _one_gpu_row(data, r)) for name, data, r in entries]
    headings = ["flavor", "seq_len", "checkpointing", "tokens/s", "transformers best"]
    headings += ["ours / theirs", "step ms", "GPU-busy ms", "step / busy", "MFU (documents)"]
    headings += ["largest kernel shares"]
    intro = [
        "The training command on one GPU at each row length, its fastest checkpointing mode of "
        "the run, against transformers + FLA's best mode that fits on the same rows in the "
        f"same run. Targets: >= {TARGET_SPEEDUP_VS_TRANSFORMERS}x transformers; the step at "
        f"most {TARGET_STEP_OVER_BUSY}x the time in which any kernel runs (GPU-busy, from the "
        "profiled step, which trains on the last timed step's rows again; `step / busy` holds "
        "that step against it, the median step in files from before; above it the GPU waited "
        "for the host); MFU over documents >= "
        f"{TARGET_MFU_DOCUMENTS:.0%} at {TARGET_MFU_AT[0]} {TARGET_MFU_AT[1]:,}. Kernel shares "
        "are of the summed kernel time; the whole profile of each point is under the "
        "breakdown question.",
        "",
    ]
    return intro + sources.table(headings, body)


def _one_gpu_row(data: dict, r: dict) -> list:
    fits = ok(transformers_for(data["transformers"], r))
    if fits:
        best = max(fits, key=lambda t: t["tokens_per_s_per_gpu"])
        theirs_mode = "checkpointing" if best["gradient_checkpointing"] else "no checkpointing"
        theirs = f"{best['tokens_per_s_per_gpu']:,.0f} ({theirs_mode})"
        speedup = ratio(r["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"])
    else:
        theirs, speedup = "out of memory", "fits only ours"
    categories = r["breakdown"].get("categories_ms", {})
    if counted_twice(r):
        shares = "— (kernels counted twice in this profile)"
    else:
        total = sum(categories.values()) or 1
        largest = sorted(categories.items(), key=lambda item: -item[1])[:3]
        shares = ", ".join(f"{CATEGORY_NAMES.get(k, k)} {v / total:.0%}" for k, v in largest)
    return [
        r["flavor"],
        r["seq_len"],
        mode(data, r),
        r["tokens_per_s_per_gpu"],
        theirs,
        speedup,
        round(r["step_time_s"] * 1000, 1),
        r["breakdown"]["busy_ms"],
        f"{step_over_busy(r):.3f}",
        pct(r.get("mfu_documents")),
        shares,
    ]


@question("Are the targets met?")
def targets_met(results: dict, sources: Sources, plots: dict) -> list[str]:
    latest = {}
    for name, data in results.get("throughput", []):
        rank = (any(is_trainer(r) for r in data["results"]), date(data))
        for row in _target_rows(data):
            key = (row[0], row[1])
            if key not in latest or latest[key][0] <= rank:
                latest[key] = (rank, name, row)
    if not latest:
        return []
    entries = sorted(latest.values(), key=lambda entry: (entry[2][0], _natural(entry[2][1])))
    body = [(name, row) for _, name, row in entries]
    intro = [
        f"From each configuration's most recent run: our tokens/s at cp=1 against transformers "
        f"+ FLA's best mode that fits (>= {TARGET_SPEEDUP_VS_TRANSFORMERS}x; met where none of "
        f"its modes fits); the step at most {TARGET_STEP_OVER_BUSY}x its GPU-busy time (the "
        f"profiled step's time in which any kernel runs against the timed step whose rows it "
        f"trained on again, the median step in files from before it did: above it, the GPU "
        f"waited for the host); MFU counted over documents >= {TARGET_MFU_DOCUMENTS:.0%} "
        f"at {TARGET_MFU_AT[0]} {TARGET_MFU_AT[1]:,}; cp=2's tokens/s per GPU against "
        f"cp=1's (>= {TARGET_CP_EFFICIENCY}); one all-to-all per direction per mixer, at >= "
        f"{TARGET_BANDWIDTH_SHARE:.0%} of NCCL's bandwidth alone for the same bytes (the lowest "
        f"size counts); >= {TARGET_GDN_KERNEL_SHARE:.0%} of a GDN layer's kernel time in the "
        f"delta rule and conv. The longest row with cp is under the context-parallel question.",
        "",
    ]
    return intro + sources.table(["target", "configuration", "value", "met"], body)


def _natural(text: str) -> list:
    """Sort key reading the numbers in `text` as numbers (8192 before 16384)."""
    return [
        (0, float(part), "") if part[0].isdigit() else (1, 0.0, part)
        for part in re.findall(r"\d+\.?\d*|\D+", text)
    ]


def _target_rows(data: dict) -> list[list]:
    """The targets, computed from one run's numbers."""
    # A run with other settings than the shipped config's is another configuration.
    changed = overrides(data)
    results = [{**r, "overrides": changed} for r in ok(data["results"])]
    rows = _speedup_rows(results, data.get("transformers", []))
    rows += _busy_rows(results)
    rows += _mfu_rows(results)
    rows += _cp_efficiency_rows(results)
    rows += all_to_all_rows(results, data.get("probe", []))
    rows += _gdn_share_rows(results)
    return rows


def _speedup_rows(results: list[dict], references: list[dict]) -> list[list]:
    rows = []
    target = f">= {TARGET_SPEEDUP_VS_TRANSFORMERS}x transformers"
    for r in results:
        tried = transformers_for(references, r)
        if r["cp"] != 1 or not tried:
            continue
        config = f"{configuration(r)} vs best transformers"
        theirs = [t["tokens_per_s_per_gpu"] for t in ok(tried)]
        if theirs:
            speedup = r["tokens_per_s_per_gpu"] / max(theirs)
            rows.append(
                [target, config, ratio(speedup), met(speedup, TARGET_SPEEDUP_VS_TRANSFORMERS)]
            )
        elif all(t.get("status") == "oom" for t in tried):
            rows.append([target, config, "transformers out of memory in every mode", "yes"])
    return rows


def transformers_for(references: list[dict], result: dict) -> list[dict]:
    """transformers' entries (every mode, finished or not) for `result`'s flavor and length."""
    point = (result["flavor"], result["seq_len"])
    return [t for t in references if (t["flavor"], t["seq_len"]) == point]


def step_over_busy(result: dict) -> float:
    """The step against the time in which any kernel runs in the profiled step."""
    return busy_step_ms(result) / result["breakdown"]["busy_ms"]


def busy_step_ms(result: dict) -> float:
    """The step that GPU-busy time is held against: the timed step whose rows the profiled step
    trained on again, or (files from before it replayed them) the median step."""
    return result["breakdown"].get("same_rows_step_ms", result["step_time_s"] * 1000)


def _busy_rows(results: list[dict]) -> list[list]:
    rows = []
    for r in results:
        busy = r.get("breakdown", {}).get("busy_ms")
        if r["cp"] != 1 or r.get("gpus", 1) != 1 or not busy:
            continue
        over_busy = step_over_busy(r)
        value = f"{over_busy:.3f} ({busy_step_ms(r):.1f} / {busy:.1f} ms)"
        within = (
            "yes" if over_busy <= TARGET_STEP_OVER_BUSY else f"no ({over_busy - 1:.0%} over busy)"
        )
        rows.append([f"step <= {TARGET_STEP_OVER_BUSY}x GPU-busy", configuration(r), value, within])
    return rows


def _mfu_rows(results: list[dict]) -> list[list]:
    flavor, seq_len = TARGET_MFU_AT
    return [
        [
            f">= {TARGET_MFU_DOCUMENTS:.0%} MFU (documents)",
            configuration(r),
            pct(r["mfu_documents"]),
            met(r["mfu_documents"], TARGET_MFU_DOCUMENTS),
        ]
        for r in results
        if (r["flavor"], r["seq_len"], r["cp"]) == (flavor, seq_len, 1) and r.get("mfu_documents")
    ]


def _cp_efficiency_rows(results: list[dict]) -> list[list]:
    rows = []
    for r in results:
        base = find(results, flavor=r["flavor"], seq_len=r["seq_len"], cp=1, ac=r["ac"])
        if r["cp"] > 1 and base:
            efficiency = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            config = f"{configuration(r)} / cp=1 tokens/s/GPU"
            target = f">= {TARGET_CP_EFFICIENCY} cp efficiency"
            rows.append(
                [target, config, f"{efficiency:.2f}", met(efficiency, TARGET_CP_EFFICIENCY)]
            )
    return rows


def all_to_all_rows(results: list[dict], probe: list[dict]) -> list[list]:
    rows = []
    for r in results:
        a2a = r.get("breakdown", {}).get("all_to_all")
        if r["cp"] == 1 or not a2a:
            continue
        config = configuration(r)
        counted = (a2a["forward_per_mixer"], a2a["backward_per_mixer"])
        expected = expected_all_to_alls(r["ac"])
        per_mixer = f"{counted[0]:g} forward, {counted[1]:g} backward"
        if expected and expected[1] > 2:
            per_mixer += f" ({expected[1] - 2} of them recomputed)"
        as_expected = None if expected is None else ("yes" if counted == expected else "no")
        rows.append(["one all-to-all per direction", config, per_mixer, as_expected])
        share = _worst_bandwidth_share(a2a, probe)
        if share is not None:
            timed = "" if all("kernel_gb_per_s" in p for p in probe) else "; NCCL alone: wall time"
            if any("exchange_gb_per_s" in size for size in a2a["sizes"]):
                waiting = _worst_bandwidth_share(a2a, probe, key="gb_per_s")
                timed += f"; exchange from the last rank's start; op's kernels: {waiting:.0%}"
            value = f"{share:.0%} (lowest size{timed})"
            target = f">= {TARGET_BANDWIDTH_SHARE:.0%} of NCCL bandwidth"
            rows.append([target, config, value, met(share, TARGET_BANDWIDTH_SHARE)])
    return rows


def expected_all_to_alls(ac: str) -> tuple[int, int] | None:
    """A mixer's all-to-alls in one step, (forward, backward), when each direction (to heads,
    back to tokens) sends once per pass: full checkpointing recomputes the forward's two in
    backward; per-op selective checkpointing keeps them (`OPS_TO_SAVE`); other modes mix."""
    return {"none": (2, 2), "full": (2, 4), "selective:op": (2, 2)}.get(ac)


def bandwidth_share(size: dict, probe: list[dict], key: str | None = None) -> float | None:
    """The mixers' bandwidth over NCCL's alone at the same size, kernel time to kernel time
    where the probe has it (older probes: wall time, an easier bar). The mixers' time is the
    exchange's own (from the last rank's start) where every rank was profiled, else that of
    the op's kernels on rank 0 (`gb_per_s`: its copies and its wait for late peers too)."""
    key = key or ("exchange_gb_per_s" if "exchange_gb_per_s" in size else "gb_per_s")
    match = find(probe, bytes=size["bytes"]) or nearest_probe(probe, size["bytes"])
    if not match or not size.get(key):
        return None
    return size[key] / match.get("kernel_gb_per_s", match["gb_per_s"])


def nearest_probe(probe: list[dict], size: int) -> dict | None:
    # The probe rounds sizes to whole bf16 elements per rank.
    close = [p for p in probe if abs(p["bytes"] - size) <= 64]
    return close[0] if close else None


def _worst_bandwidth_share(a2a: dict, probe: list[dict], key: str | None = None) -> float | None:
    shares = [bandwidth_share(size, probe, key) for size in a2a.get("sizes", [])]
    shares = [s for s in shares if s is not None]
    return min(shares) if shares else None


def _gdn_share_rows(results: list[dict]) -> list[list]:
    rows = []
    for r in results:
        share = None if counted_twice(r) else gdn_kernel_share(r, layer_only=True)
        if share is not None:
            config = configuration(r)
            target = f">= {TARGET_GDN_KERNEL_SHARE:.0%} of a GDN layer in delta rule + conv"
            rows.append([target, config, f"{share:.0%}", met(share, TARGET_GDN_KERNEL_SHARE)])
    return rows
