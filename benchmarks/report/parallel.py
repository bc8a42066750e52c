"""What context parallel costs (tokens/s against cp=1) and buys (longer rows), and how fast its
all-to-alls run against NCCL alone."""

from __future__ import annotations

from benchmarks.report.tables import (
    Sources,
    ac_name,
    by_flavor,
    cell,
    find,
    host_share,
    latest,
    mib,
    ms,
    ok,
    ours,
    pct,
    question,
    sources_of,
)
from benchmarks.report.targets import TARGET_CP_LENGTH_RATIO, bandwidth_share, nearest_probe


@question("What does context parallel cost and buy?")
def context_parallel(results: dict, sources: Sources, plots: dict) -> list[str]:
    pairs = []
    for name, data, r in ours(results):
        base = find(ok(data["results"]), flavor=r["flavor"], seq_len=r["seq_len"], cp=1, ac=r["ac"])
        if r["cp"] > 1 and base:
            pairs.append((name, data, r, base))
    memory = _length_ratios(results.get("memory", []))
    if not pairs and not memory:
        return []
    pairs = by_flavor(pairs, "seq_len", "ac")
    body = []
    for name, _, r, base in pairs:
        exposed = r.get("breakdown", {}).get("exposed_comm_ms", {})
        ratio = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        cells = [
            r["flavor"],
            r["seq_len"],
            ac_name(r["ac"]),
            r.get("gpus"),
            base["tokens_per_s_per_gpu"],
            r["tokens_per_s_per_gpu"],
            f"{ratio:.3f}",
            f"cp={r['cp']}",
            pct(host_share(r)),
            ms(exposed.get("all_to_all")),
            f"{cell(base.get('peak_reserved_gib'))} / {cell(r.get('peak_reserved_gib'))}",
        ]
        body.append((name, cells))
    lines = [
        "The cost: tokens/s per GPU with the row split over the GPUs (cp=2) against the same "
        "GPUs each training its own rows (cp=1, FSDP), in one run; host share and the "
        "all-to-alls' exposed time (their kernels running while no compute kernel does) are "
        "the cp=2 step's.",
        "",
    ]
    if body:
        headings = ["flavor", "seq_len", "checkpointing", "GPUs", "cp=1 tokens/s/GPU"]
        headings += ["cp tokens/s/GPU", "cp / cp=1", "cp", "cp host", "exposed a2a ms"]
        headings += ["peak reserved GiB, cp=1 / cp"]
        lines += sources.table(headings, body)
    for text, cited in memory:
        lines += [f"What it buys: {text}.", ""] + sources.listing(cited)
    return lines


def _length_ratios(files: list[tuple[str, dict]]) -> list[tuple[str, list[str]]]:
    """Sentences: the longest row with cp against one GPU, same flavor and checkpointing."""
    found = []
    for name, data in files:
        options, result = data["options"], data.get("result", {})
        if options["cp"] == 1 or not result.get("longest_fit"):
            continue
        bases = [
            (n, d)
            for n, d in files
            if d["options"]["cp"] == 1
            and (d["options"]["flavor"], d["options"]["ac"]) == (options["flavor"], options["ac"])
            and d.get("result", {}).get("longest_fit")
        ]
        if not bases:
            continue
        base_name, base = max(bases, key=lambda item: item[1]["result"]["longest_fit"])
        ratio = result["longest_fit"] / base["result"]["longest_fit"]
        text = (
            f"{options['flavor']} with {ac_name(options['ac'])} checkpointing trains "
            f"{result['longest_fit']:,}-token rows at cp={options['cp']} against "
            f"{base['result']['longest_fit']:,} on one GPU, {ratio:.2f}x (target >= "
            f"{TARGET_CP_LENGTH_RATIO}x: {'met' if ratio >= TARGET_CP_LENGTH_RATIO else 'missed'})"
        )
        found.append((text, [name, base_name]))
    return found


@question("How fast are context parallel's all-to-alls?")
def all_to_alls(results: dict, sources: Sources, plots: dict) -> list[str]:
    key = lambda r: (r["flavor"], r["seq_len"], r.get("gpus"), r["cp"], r["ac"])  # noqa: E731
    rows = [
        item
        for item in ours(results)
        if item[2]["cp"] > 1 and item[2].get("breakdown", {}).get("all_to_all")
    ]
    rows = by_flavor(latest(rows, key), "seq_len", "cp", "ac")
    body = []
    for name, data, r in rows:
        probe = data.get("probe", [])
        for size in r["breakdown"]["all_to_all"]["sizes"]:
            match = find(probe, bytes=size["bytes"]) or nearest_probe(probe, size["bytes"])
            cells = [
                r["flavor"],
                r["seq_len"],
                r["cp"],
                ac_name(r["ac"]),
                size["direction"],
                mib(size["bytes"]),
                size["calls"],
                size.get("median_kernel_ms"),
                size.get("median_nccl_kernel_ms"),
                size.get("median_exchange_ms"),
                size.get("exchange_gb_per_s"),
                match and match.get("kernel_gb_per_s", match["gb_per_s"]),
                pct(bandwidth_share(size, probe)),
            ]
            body.append((name, cells))
    if not body:
        return []
    headings = ["flavor", "seq_len", "cp", "checkpointing", "direction", "MiB/rank", "calls"]
    headings += ["op ms", "NCCL kernel ms", "exchange ms", "exchange GB/s", "NCCL alone GB/s"]
    headings += ["share"]
    intro = [
        "The mixers' all-to-alls by message size, from the profiled step, medians: `op` is "
        "every kernel of the exchange op on rank 0; `NCCL kernel` rank 0's all-to-all kernel, "
        "which includes waiting for the other ranks to arrive; `exchange` runs from the last "
        "rank's kernel start to the last rank's end (every rank profiled; older runs: blank). "
        "NCCL alone: NCCL `all_to_all_single` by itself for the same bytes in the same run, its "
        "kernel time where the probe has it. share: the exchange's bandwidth over NCCL's "
        "alone where the exchange was timed, else the op's.",
        "",
    ]
    return intro + sources.table(headings, body, sources_of(rows))
