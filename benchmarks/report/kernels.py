"""Where a step's time goes, by kernel category and block type, and the kernels alone: FLA's
delta rule at each GDN layer's shape, attention at Qwen3.5's, one MoE layer against
transformers'."""

from __future__ import annotations

from benchmarks.flop_count import gdn_block_linear_weights
from benchmarks.report.tables import (
    Sources,
    ac_name,
    by_flavor,
    find,
    latest,
    mode,
    ms,
    ours,
    pct,
    question,
    ratio,
)
from titan_gdn.model.flavors import qwen3_5_args

CATEGORY_NAMES = {
    "delta_rule": "delta rule",
    "conv": "conv",
    "attention": "attention",
    "gemm": "GEMMs",
    "loss": "loss",
    "all_to_all": "all-to-all",
    "fsdp": "FSDP",
    "optimizer": "optimizer",
    "documents": "documents",
    "other": "other",
}


@question("Where does a step's time go?")
def where_time_goes(results: dict, sources: Sources, plots: dict) -> list[str]:
    key = lambda r: (r["flavor"], r["seq_len"], r.get("gpus"), r["cp"], r["ac"])  # noqa: E731
    rows = [item for item in ours(results) if item[2].get("breakdown")]
    rows = by_flavor(latest(rows, key), "seq_len", "gpus", "cp", "ac")
    if not rows:
        return []
    body = []
    for name, data, r in rows:
        breakdown = r["breakdown"]
        categories = breakdown["categories_ms"]
        twice = counted_twice(r)
        total = 0.0 if twice else sum(categories.values())
        shares = [pct(categories.get(c, 0.0) / total) if total else None for c in CATEGORY_NAMES]
        exposed = breakdown.get("exposed_comm_ms", {})
        cells = [
            r["flavor"],
            r["seq_len"],
            r.get("gpus"),
            r["cp"],
            mode(data, r),
            f"{r['step_time_s'] * 1000:.1f}",
            ms(breakdown.get("busy_ms")),
            ms(exposed.get("fsdp")),
            ms(exposed.get("all_to_all")),
            *shares,
            None if twice else pct(gdn_kernel_share(r)),
            None if twice else pct(gdn_kernel_share(r, layer_only=True)),
            _syncs_text(breakdown.get("host_syncs")),
        ]
        body.append((name, cells))
    measure = rows[0][2]["breakdown"].get("measure", "kernel time")
    headings = ["flavor", "seq_len", "GPUs", "cp", "checkpointing", "step ms", "busy ms"]
    headings += ["exposed FSDP ms", "exposed a2a ms", *CATEGORY_NAMES.values()]
    headings += ["GDN block: rule+conv", "GDN layer: rule+conv", "host syncs"]
    intro = [
        f"One profiled step of each configuration's most recent run; share of summed {measure}, "
        "which overlaps across streams. busy: time any kernel runs; exposed: time the "
        "collectives' kernels run while no compute kernel does (runs before this was "
        "recorded: empty); GDN block: delta rule + conv share of the GDN decoder blocks' time "
        "without FSDP; GDN layer: the same share without the MLP's GEMMs (the block's GEMM "
        "time split by the linear weights of the layer and of the MLP); host syncs: times the "
        "host waited for the device, by phase (profiles recorded before reads of a host "
        "tensor's value were told apart count those too). Shares left empty: that profile's "
        "categories sum to more than its busy time on one stream, some kernels counted under "
        "two ops (the attribution of the benchmark that wrote it; kernels are now claimed "
        "once); its busy time is right.",
        "",
    ]
    return intro + sources.table(headings, body)


def _syncs_text(syncs: dict | None) -> str | None:
    if not syncs:
        return None
    phases = syncs["by_phase"]
    inside = {p: phases[p] for p in ("documents", "forward", "loss", "backward") if p in phases}
    detail = ", ".join(f"{phase} {count}" for phase, count in inside.items())
    return f"{syncs['total']}" + (f" ({detail})" if detail else "")


def counted_twice(result: dict) -> bool:
    """One GPU, no collectives: kernels hardly overlap, so categories summing to more than the
    busy time mean that the profile's attribution counted some kernels under two ops."""
    breakdown = result.get("breakdown", {})
    busy, categories = breakdown.get("busy_ms"), breakdown.get("categories_ms", {})
    one_stream = result.get("gpus", 1) == 1 and result.get("cp", 1) == 1
    return bool(one_stream and busy and sum(categories.values()) > 1.02 * busy)


def gdn_kernel_share(result: dict, layer_only: bool = False) -> float | None:
    """Delta rule + conv over the kernel time of the GDN blocks (FSDP's collectives, which
    overlap on their own stream, excluded), or of their GDN layers (`layer_only`).

    A compiled block's profile does not tell the layer's projection GEMMs from the MLP's, so
    for the layer the block's GEMM time is split by the linear weights each multiplies (the
    same efficiency assumed). The block's other work (norms, the MLP's activation) stays in:
    the layer's share is, if anything, understated.
    """
    block = result.get("breakdown", {}).get("layers_ms", {}).get("linear_attention")
    if not block:
        return None
    gemm_share = 1.0
    if layer_only:
        if result["flavor"] not in qwen3_5_args:
            return None
        layer_weights, mlp_weights = gdn_block_linear_weights(qwen3_5_args[result["flavor"]])
        gemm_share = layer_weights / (layer_weights + mlp_weights)
    times = {category: time for category, time in block.items() if category != "fsdp"}
    total = sum(times.values()) - (1 - gemm_share) * times.get("gemm", 0.0)
    return (times["delta_rule"] + times["conv"]) / total if total else None


@question("How close is the delta rule to FLA's kernel alone?")
def delta_rule_kernel(results: dict, sources: Sources, plots: dict) -> list[str]:
    items = [
        (name, data, {**k, "_file_results": data["results"]})
        for name, data in results.get("throughput", [])
        for k in data.get("kernel", [])
    ]
    key = lambda k: (k["flavor"], k["seq_len"], k["cp"], k["ac"])  # noqa: E731
    rows = by_flavor(latest(items, key), "seq_len", "cp", "ac")
    if not rows:
        return []
    body = []
    for name, _, k in rows:
        mine = find(
            k["_file_results"], flavor=k["flavor"], seq_len=k["seq_len"], cp=k["cp"], ac=k["ac"]
        )
        ours_ms = (mine or {}).get("breakdown", {}).get("categories_ms", {}).get("delta_rule")
        ceiling = kernel_ceiling_ms(k)
        shape = k["shape"]
        cells = [
            k["flavor"],
            k["seq_len"],
            k["cp"],
            ac_name(k["ac"]),
            f"{shape['value_heads']}x{shape['key_dim']}",
            shape["documents"],
            k.get("backend"),
            k.get("measure", "wall time"),
            k.get("forward_ms"),
            k.get("forward_backward_ms"),
            ceiling,
            ours_ms,
            ratio(ours_ms / ceiling) if ours_ms and ceiling else None,
        ]
        body.append((name, cells))
    headings = ["flavor", "seq_len", "cp", "checkpointing", "heads x dim", "documents"]
    headings += ["kernel", "timed as", "fwd ms", "fwd+bwd ms", "ceiling ms/step"]
    headings += ["ours: delta-rule ms/step", "ours / ceiling"]
    intro = [
        "The delta-rule kernel alone at each GDN layer's shape on one rank (the ceiling: "
        "forward + backward per GDN layer, and the forward once more where full checkpointing "
        "recomputes it). Ours is GPU kernel time from the profiled step; a ceiling timed as "
        "wall time also holds FLA's host work per call, so it is only an upper bound there.",
        "",
    ]
    return intro + sources.table(headings, body)


def kernel_ceiling_ms(kernel: dict) -> float | None:
    """The delta-rule kernels' time per training step if they ran alone: each GDN layer's
    forward and backward, and its forward again when full checkpointing recomputes it."""
    if kernel.get("status") != "ok":
        return None
    recomputed = kernel["forward_ms"] if kernel["ac"] == "full" else 0.0
    return round(kernel["layers"] * (kernel["forward_backward_ms"] + recomputed), 3)


@question("How fast is attention alone at Qwen3.5's shape?")
def attention_alone(results: dict, sources: Sources, plots: dict) -> list[str]:
    files = results.get("attention", [])

    def row(data: dict, r: dict) -> list:
        shape = data["shape"]
        heads = f"{shape['heads']}/{shape['kv_heads']} x {shape['head_dim']}"
        return [r["tokens"], r["documents"], heads, r["candidate"], r["ms"], r["tflops"]]

    body = _result_rows(files, row)
    if not body:
        return []
    # One-document rows first, longest first; then by documents; each by time.
    body.sort(key=lambda item: (-item[1][0] if item[1][1] == 1 else 0, item[1][1], item[1][4]))
    headings = ["tokens", "documents", "heads (q/kv) x dim", "kernel", "fwd+bwd ms", "TFLOP/s"]
    intro = [
        "Document-causal attention of one row, bf16, forward and backward "
        "(`python -m benchmarks.attention`): `titan_gdn` is the training path "
        "(`attn_backend = varlen`), the others the kernels it was chosen among. TFLOP/s counts "
        "the pairs inside documents only; every kernel's output and gradients were first "
        "checked against the fp32 dense mask.",
        "",
    ]
    return intro + sources.table(headings, body, [name for name, _ in files])


@question("How fast is one MoE layer against transformers'?")
def moe_layer_alone(results: dict, sources: Sources, plots: dict) -> list[str]:
    files = results.get("moe_layer", [])

    def row(data: dict, r: dict) -> list:
        parts = r.get("parts_ms", {})
        cells = [data["flavor"], _MIXER_NAMES.get(r["mixer"], r["mixer"]), r["tokens"]]
        cells += [r["corpus"], r["documents"], r["candidate"], r.get("ms"), r.get("step_peak_gib")]
        cells += [ratio(r["over_ours"]) if r.get("over_ours") else r.get("error")]
        return cells + [parts.get(p) for p in MOE_LAYER_PARTS] + [r.get("grouped_gemm_tflops")]

    body = _result_rows(files, row)
    if not body:
        return []
    headings = ["flavor", "mixer", "tokens", "corpus", "documents", "layer", "fwd+bwd ms"]
    headings += ["peak GiB", "/ ours", *MOE_LAYER_PARTS.values(), "grouped GEMM TFLOP/s"]
    intro = [
        "One Qwen3.5 MoE decoder layer alone, bf16, forward and backward (`python -m "
        "benchmarks.moe_layer`): ours, compiled as the trainer compiles it, against "
        "transformers' `Qwen3_5MoeDecoderLayer` (eager) holding the same weights, with each of "
        "its experts implementations, on one row whose documents are cut like the corpus. Peak "
        "GiB is what the call allocates above what was held before it; `/ ours` is "
        "transformers' time over ours. Our parts are GPU kernel ms from a profiled call "
        "(backward included); grouped GEMM TFLOP/s counts 2 * tokens * top_k * 3 * I * D "
        "forward, 3x that forward + backward, over the grouped GEMM kernels. Each transformers "
        "layer was first checked against ours: each residual branch's output and input gradient"
        " on the same input.",
        "",
    ]
    return intro + sources.table(headings, body, [name for name, _ in files])


def _result_rows(files: list, row) -> list[tuple[str, list]]:
    """(file name, row(file's data, result)) for every result of every file."""
    return [(name, row(data, r)) for name, data in files for r in data["results"]]


_MIXER_NAMES = {"linear_attention": "GDN", "full_attention": "attention"}
MOE_LAYER_PARTS = {
    "router": "router ms",
    "permutation": "permutation ms",
    "grouped_gemm": "grouped GEMMs ms",
    "combine": "combine ms",
    "shared_expert": "shared expert ms",
    "mixer": "mixer ms",
    "other": "other ms",
}
