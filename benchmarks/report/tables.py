"""What every table of the performance page shares: the sections' form, the citation of result
files, the choice of records to show (ours, the latest per configuration, in flavor order) and
the formatting of cells."""

from __future__ import annotations

import functools
import re


def question(title: str, reads: str | None = None):
    """Mark a section of the page, headed `title`: `function(results, sources, plots) -> lines`,
    empty when no result file answers it. A section made from one kind of result file names it
    (`reads`): without such a file the section is left out, and the function is not called."""

    def mark(function):
        @functools.wraps(function)
        def section(results: dict, sources: Sources, plots: dict) -> list[str]:
            if reads is not None and not results.get(reads):
                return []
            return function(results, sources, plots)

        section.title = title
        return section

    return mark


class Sources:
    """Numbers every result file once (by path) and lists, under a table, the files it cites
    with the commands that wrote them."""

    def __init__(self, results: dict):
        self.files = dict(sorted((n, d) for files in results.values() for n, d in files))
        self.number = {name: i + 1 for i, name in enumerate(self.files)}

    def cite(self, name: str) -> str:
        return f"[{self.number[name]}]"

    def table(self, headings: list[str], rows: list[tuple[str, list]], cited=None) -> list[str]:
        """A table of (file, cells) rows, its last column citing each row's file, then the
        files it cites (`cited`, default: the rows' files) with the commands that wrote them."""
        body = [[*cells, self.cite(name)] for name, cells in rows]
        names = [name for name, _ in rows] if cited is None else cited
        return table([*headings, "file"], body) + self.listing(names)

    def listing(self, names) -> list[str]:
        lines = []
        for name in sorted(set(names), key=self.number.__getitem__):
            commands = [_clean_command(c, name) for c in _commands(self.files[name])]
            shown = "; ".join(f"`{c}`" for c in commands)
            lines.append(f"- {self.cite(name)} `docs/results/{name}`: {shown}")
        return lines + [""] if lines else []


def _commands(data: dict) -> list[str]:
    if "runs" in data:
        return ["scripts/gpu_validation.sh ... summary"]
    env = data.get("environment") or {}
    return data.get("commands") or [env.get("command", "?")]


def _clean_command(command: str, name: str) -> str:
    """The command as it would write this file: `--out` names the committed file, trace and
    log folders a neutral name (the machine's scratch paths say nothing to a reader)."""
    command = re.sub(r"--out \S+", f"--out docs/results/{name}", command)
    command = re.sub(r"--trace-dir \S+", "--trace-dir traces", command)
    return re.sub(r"--log-dir \S+", "--log-dir logs", command)


def table(headings: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return lines + [""]


def cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def pct(value) -> str | None:
    return None if value is None else f"{100 * value:.1f}%"


def ratio(value) -> str | None:
    return None if value is None else f"{value:.2f}x"


def seconds(value) -> str | None:
    return None if value is None else f"{value:.3f}"


def ms(value) -> str | None:
    return None if value is None else f"{value:.1f}"


def mib(size: int) -> str:
    return f"{size / 2**20:.3g}"


def loss_text(losses) -> str | None:
    return f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else None


def ok(entries: list[dict]) -> list[dict]:
    return [e for e in entries if e.get("status") == "ok"]


def find(entries: list[dict], **key) -> dict | None:
    return next((e for e in entries if all(e.get(k) == v for k, v in key.items())), None)


def configuration(result: dict) -> str:
    config = f"{result['flavor']} {result['seq_len']} cp={result['cp']} ac={result['ac']}"
    return f"{config} `{result['overrides']}`" if result.get("overrides") else config


def met(value, target) -> str | None:
    return (
        None
        if value is None
        else ("yes" if value >= target else f"no ({value / target:.0%} of it)")
    )


def host_share(result: dict) -> float | None:
    host, step = result.get("host_time_s"), result.get("step_time_s")
    return None if host is None or not step else host / step


def date(data: dict) -> str:
    return (data.get("environment") or {}).get("date", "")


def is_trainer(result: dict) -> bool:
    """Measured on the training command (run_train.sh's trainer from a TOML config); older
    files timed a step the benchmark rebuilt from the model, and have no `config`."""
    return "config" in result


def harness(result: dict) -> str:
    return "trainer" if is_trainer(result) else "rebuilt"


def ours(results: dict, ok_only: bool = True):
    """(file, data, result) for every one of our configurations in the throughput files."""
    for name, data in results.get("throughput", []):
        for r in data["results"]:
            if r.get("status") == "ok" or not ok_only:
                yield name, data, r


def latest(items, key) -> list[tuple[str, dict, dict]]:
    """Per `key(record)` and the run's overrides, the record from the most recent file; a
    measurement of the training command wins over one of a rebuilt step, a finished one over a
    failed one."""
    best = {}
    for name, data, record in items:
        rank = (is_trainer(record), record.get("status") == "ok", date(data))
        k = (key(record), overrides(data))
        if k not in best or best[k][0] <= rank:
            best[k] = (rank, name, data, record)
    return [(name, data, record) for _, name, data, record in best.values()]


def ac_name(ac: str | None) -> str | None:
    return {"selective:op": "selective (op)"}.get(ac, ac)


def overrides(data: dict) -> str | None:
    """What the run changed from the shipped config: its rows' corpus (where not the bundled
    short documents) and its settings (`--set`), as the benchmark and run_train.sh take them."""
    options = data.get("options", {})
    corpus = options.get("corpus", "short")
    changed = ([f"--corpus {corpus}"] if corpus != "short" else []) + options.get("overrides", [])
    return " ".join(changed) or None


def mode(data: dict, result: dict) -> str | None:
    """The checkpointing mode, and the run's overrides where it has any: two points that differ
    only in an override (e.g. `--compile.cudagraphs`) are two configurations."""
    changed = overrides(data)
    ac = ac_name(result.get("ac"))
    return f"{ac}, `{changed}`" if changed else ac


def status_or(record: dict | None, key: str):
    if not record:
        return None
    if record.get("status") != "ok":
        return {"oom": "out of memory"}.get(record.get("status"), record.get("status"))
    return record.get(key)


def by_flavor(items, *fields):
    """(file, data, record) by flavor size, then `fields` of the record, the newest file first."""
    newest_first = sorted(items, key=lambda item: date(item[1]), reverse=True)
    return sorted(
        newest_first,
        key=lambda item: (flavor_size(item[2]["flavor"]), *(item[2].get(f) or 0 for f in fields)),
    )


def sources_of(rows) -> list[str]:
    return [item[0] for item in rows]


def flavor_size(flavor: str) -> float:
    try:
        return float(flavor.rstrip("B"))
    except ValueError:
        return 0.0
