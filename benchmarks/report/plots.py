"""The page's plots: tokens/s per GPU and peak memory against the row length (matplotlib, the
`bench` extra)."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.report.tables import flavor_size, is_trainer, ok

# What each plot shows (its image's text).
DESCRIPTIONS = {
    "throughput": "tokens/s per GPU vs sequence length",
    "memory": "peak memory vs sequence length",
}


def image(plots: dict[str, str], kind: str) -> list[str]:
    """The page's lines that show plot `kind`, where `plots` (`plan_plots`) has it."""
    return [f"![{DESCRIPTIONS[kind]}]({plots[kind]})", ""] if plots.get(kind) else []


def plan_plots(results: dict, doc_path: Path) -> dict[str, str]:
    """The plots the document shows (relative paths), for the kinds that have data."""
    folder = doc_path.with_suffix("")  # docs/performance/
    relative = folder.name
    plots = {}
    if any(ok(d["results"]) for _, d in results.get("throughput", [])):
        plots["throughput"] = f"{relative}/throughput.png"
    if any(d.get("trials") for _, d in results.get("memory", [])):
        plots["memory"] = f"{relative}/memory.png"
    return plots


def draw_plots(results: dict, plots: dict[str, str], doc_path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed (pip install -e '.[bench]'): plots not drawn",
            file=sys.stderr,
        )
        return False
    for kind, relative in plots.items():
        path = doc_path.parent / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        figure = (
            _throughput_figure(plt, results)
            if kind == "throughput"
            else _memory_figure(plt, results)
        )
        figure.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(figure)
    return True


def throughput_series(results: dict) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Tokens/s per GPU by flavor, then configuration, as (seq_len, value) points across all
    throughput files, so one configuration measured in several runs is one line; where runs
    overlap, the most recent run's figure is used, a training-command one before a rebuilt
    step's."""
    latest: dict[tuple[str, str, int], tuple[tuple[bool, str], float]] = {}
    for _, data in results.get("throughput", []):
        date = (data.get("environment") or {}).get("date", "")
        points = [
            (r, f"ours cp={r['cp']}, {r['gpus']} GPU{'s' * (r['gpus'] > 1)}, ac={r['ac']}")
            for r in ok(data["results"])
        ]
        points += [
            (t, f"transformers, {'checkpointing' if t['gradient_checkpointing'] else 'no AC'}")
            for t in ok(data.get("transformers", []))
        ]
        for record, label in points:
            key = (record["flavor"], label, record["seq_len"])
            rank = (is_trainer(record), date)
            if key not in latest or latest[key][0] <= rank:
                latest[key] = (rank, record["tokens_per_s_per_gpu"])
    series: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for (flavor, label, seq_len), (_, value) in sorted(latest.items()):
        series[flavor][label].append((seq_len, value))
    return {flavor: dict(by_label) for flavor, by_label in series.items()}


def _throughput_figure(plt, results: dict):
    series = throughput_series(results)
    flavors = sorted(series, key=flavor_size)
    figure, axes = plt.subplots(
        1, len(flavors), figsize=(4.2 * len(flavors) + 1.5, 4.2), squeeze=False
    )
    labels = sorted({label for by_label in series.values() for label in by_label})
    # tab20 holds 10 hues, dark then light: the first 10 labels get the dark ones.
    palette = plt.get_cmap("tab20")
    colors = {label: palette((2 * i + i // 10) % 20) for i, label in enumerate(labels)}
    for axis, flavor in zip(axes[0], flavors, strict=True):
        for label, points in sorted(series[flavor].items()):
            style = "--" if label.startswith("transformers") else "-"
            _plot_series(axis, points, style, label, color=colors[label])
        axis.set(title=flavor, xlabel="sequence length (tokens)", ylabel="tokens/s per GPU")
        _finish_axis(axis, legend=False)
    # Every label has a line in some panel; one legend entry each, in one order.
    handles = {h.get_label(): h for axis in axes[0] for h in axis.get_lines()}
    figure.legend(
        [handles[label] for label in labels],
        labels,
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        fontsize=7,
    )
    figure.tight_layout()
    return figure


def _memory_figure(plt, results: dict):
    figure, axis = plt.subplots(figsize=(7.5, 4.5))
    for _, data in results.get("memory", []):
        options = data["options"]
        label = f"{options['flavor']} cp={options['cp']} ac={options['ac']}"
        fits = [
            (t["seq_len"], t["peak_reserved_gib"]) for t in data["trials"] if t["status"] == "ok"
        ]
        line = _plot_series(axis, fits, "-", label)
        color = line.get_color() if line is not None else None
        for t in data["trials"]:
            if t["status"] == "oom":
                axis.axvline(t["seq_len"], color=color, linestyle=":", linewidth=1)
    axis.set(xlabel="sequence length (tokens); dotted: out of memory", ylabel="peak reserved GiB")
    _finish_axis(axis)
    return figure


def _plot_series(axis, points, style: str, label: str, color: str | None = None):
    if not points:
        return None
    xs, ys = zip(*sorted(points), strict=True)
    (line,) = axis.plot(xs, ys, style, marker="o", label=label, color=color)
    return line


def _finish_axis(axis, legend: bool = True) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_xscale("log", base=2)
    axis.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    axis.grid(True, alpha=0.3)
    if legend:
        axis.legend(fontsize=7)


def _tokens_label(value, _position) -> str:
    return f"{value / 1024:g}k" if value >= 1024 else f"{value:g}"
