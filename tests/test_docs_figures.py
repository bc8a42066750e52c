"""Every measured figure in the prose is a committed result, and one quantity has one number.

The prose: README.md, CONTRIBUTING.md, docs/**/*.md and the comments of train_configs/*.toml.
docs/performance.md is not prose here: `python -m benchmarks.report` writes it from the results
and tests/test_benchmarks.py checks that it is current.

A figure is a number with a unit of measurement (tokens/s, TFLOP/s, GB/s, GiB, MiB, GB, KB, ms,
s, minutes, %, and ratios written 2.03x), or a bare number in a table column whose header (or
row whose label) names the unit; a header with ` / ` or `ratio` and no unit holds ratios. A
bare number joined to a figure by "against", "instead of", "/", "-" or "to" takes its unit
("66,304 against 66,080 tokens/s", "6-8 ms"), and in a sentence about tokens/s so does a bare
number with a thousands separator that is not a length ("49,675 tokens/s on one corpus, 60,655
on another"). Code, code spans and HTML comments are not prose. Write a measured column's unit
in its header, so that its numbers are read as figures.

A figure is backed when
- a committed result rounds to it at the precision it is written with: a JSON value under
  docs/results/ whose key says its unit (`*_gib`, `tokens_per_s*`, `*_ms`, `*_s`, `mfu`, ...,
  or a parent key such as `categories_ms`), or a number with its unit in a .log or .txt there.
  "about 80 seconds" is read to its last non-zero digit (75 to 85 s). Only results of what the
  sentence or table row names count: its flavors (0.8B, 2B, ...), row lengths (32k, 32,768
  tokens) and cp degrees (cp=2), and for a percentage or a time from the JSON, the metric's
  word (MFU, host, step, ...: METRIC_WORDS);
- it is a ratio (x) or a percentage of two numbers of one unit in its sentence or table row:
  their quotient (a percentage: the quotient, or how far it is above or below 1; also of a
  ratio beside it);
- or it is on one of the short lists below, each entry with its reason: NOT_MEASURED
  (hardware facts, assumptions and settings that carry a unit; never a measurement), DERIVED
  (arithmetic on figures that are themselves backed, evaluated here), COMPUTED (a page whose
  tables a script computes; the script runs here).

One quantity, one number: where two figures of the hand-written pages each match the values of
a single quantity (one configuration and metric: flavor, length, cp, checkpointing, corpus,
...), they match them in one result file. Pages under docs/results/ describe their files one
by one and may quote several.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import operator
import re
import runpy
import sys
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
GENERATED_PAGES = {"docs/performance.md"}

# Figures that carry a unit but are no measurement: (page, figure as written) -> why.
NOT_MEASURED = {
    ("docs/context_parallel.md", "450 GB/s"): "the NVLink bandwidth scripts/cp_traffic.py assumes",
    ("docs/context_parallel.md", "50 GB/s"): "the bandwidth between nodes cp_traffic.py assumes",
    ("docs/design.md", "1.5x"): "the bound tests/gpu/test_model_gpu.py asserts",
}

# Arithmetic on backed figures: (page, figure) -> (expression, what it computes, which names
# the operands' configuration). Every number with a unit in the expression must itself be
# backed; numbers without one are counts and settings.
_SQUARE_COST = (
    "(45.5518 s / 786432 - 23.5987 s / 524288) / 262144",
    "0.8B, full checkpointing, one GPU: the step time per token at 786,432 tokens less that at "
    "524,288 tokens, over the difference (memory_h200_0.8b_cp1_full.json)",
)
_PEAKS = "0.8B, full checkpointing, one GPU: peak reserved at 524,288 tokens and at 786,432 tokens"
_CP_TRAFFIC = "link times that scripts/cp_traffic.py prints"
DERIVED = {
    ("docs/long-context.md", "9.8 GiB"): ("(132.32 GiB - 93.22 GiB) / 4", f"{_PEAKS}, per 65,536"),
    ("docs/long-context.md", "15 GiB"): (
        "93.22 GiB - 8 * (132.32 GiB - 93.22 GiB) / 4",
        f"{_PEAKS}: their line at 0 tokens",
    ),
    ("docs/long-context.md", "5e-11 s"): _SQUARE_COST,
    ("docs/design.md", "5e-11 s"): _SQUARE_COST,
    ("docs/long-context.md", "2 GiB"): ("139.8 GiB - 137.8 GiB", "an H200 less 2B's peak"),
    ("docs/design.md", "1.3x"): (
        "10.150 ms / 7.835 ms",
        "forward + backward, FLA's conv against causal-conv1d, 6144 channels, 131k tokens",
    ),
    ("docs/design.md", "1.8x"): (
        "1.302 ms / 0.728 ms",
        "forward + backward, FLA's conv against causal-conv1d, 6144 channels, 8k tokens",
    ),
    ("docs/context_parallel.md", "12%"): (
        "100 * (1 - 32,149 tokens/s / 36,610 tokens/s)",
        "2B, 32k, selective (op): cp=2 against cp=1",
    ),
    ("docs/context_parallel.md", "19%"): (
        "100 * (1 - 26,172 tokens/s / 32,210 tokens/s)",
        "2B, 32k, full: cp=2 against cp=1",
    ),
    ("docs/context_parallel.md", "1.3x"): ("296.0 ms / 229.6 ms", f"0.8B, 1024k: {_CP_TRAFFIC}"),
    ("docs/context_parallel.md", "1.7x"): ("48.6 ms / 28.9 ms", f"0.8B, 128k: {_CP_TRAFFIC}"),
    ("docs/context_parallel.md", "1.8x"): ("1,614.1 ms / 882.0 ms", f"27B, 1024k: {_CP_TRAFFIC}"),
    ("docs/context_parallel.md", "2.8x"): ("129.6 ms / 47.1 ms", f"4B, 128k: {_CP_TRAFFIC}"),
    ("docs/context_parallel.md", "3.3x"): ("1,229.7 ms / 373.5 ms", f"4B, 1024k: {_CP_TRAFFIC}"),
    ("train_configs/qwen3_5_35b_a3b.toml", "70 GB"): (
        "35e9 * 16 / 8 / 1e9",
        "35B parameters x 16 bytes (fp32 weights and gradients, AdamW's two moments) / 8 GPUs",
    ),
    ("train_configs/qwen3_5_35b_a3b_4layers.toml", "70 GB"): (
        "4381469760 * 16 / 1e9",
        "the flavor's parameters (Qwen35Model on the meta device) x 16 bytes",
    ),
}

# Pages whose tables a script computes from the flavors' shapes: the script runs here, and the
# page's figures may be any it prints.
COMPUTED = {"docs/context_parallel.md": "scripts/cp_traffic.py"}

# Unit as the prose writes it -> canonical unit and the scale to it. Longest first.
UNIT_WORDS = [
    (r"tokens/s", "tokens/s", 1.0),
    (r"TFLOP/s", "TFLOP/s", 1.0),
    (r"GB/s", "GB/s", 1.0),
    (r"GiB|Gi\b", "GiB", 1.0),
    (r"MiB", "MiB", 1.0),
    (r"GB\b", "GB", 1.0),
    (r"KB\b", "KB", 1.0),
    (r"ms\b", "ms", 1.0),
    (r"seconds?\b|s\b", "s", 1.0),
    (r"minutes?\b", "s", 60.0),
    (r"%", "%", 1.0),
    (r"x\b", "x", 1.0),  # only touching its number: 2.03x, not "4 x states"
]
UNIT = re.compile(
    " ?(?:" + "|".join(f"(?P<u{i}>{w})" for i, (w, _, _) in enumerate(UNIT_WORDS)) + ")"
)
NUMBER = re.compile(r"(?<![\w.,=^])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(e-?\d\d?)?(?![\d,]\d)")
JOINS = re.compile(r"\s*(?:-|–|/|against|instead of|to)\s*")
APPROXIMATE = re.compile(r"(?:about|some|roughly|~)\s*$")
NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "ten": 10}
WORD_FIGURE = re.compile(r"\b(about|some) (" + "|".join(NUMBER_WORDS) + r") (minutes?|seconds?)\b")


@dataclass(frozen=True)
class Figure:
    text: str  # the number as written
    unit: str  # canonical; "" for a bare number (an operand of a ratio, not a figure)
    written_unit: str
    value: float  # in the canonical unit
    half_step: float  # half the last written digit (a coarser one after "about")
    where: str = ""  # "docs/design.md:245"
    offset: int = field(default=0, compare=False)  # in the text it was read from
    context: tuple[Figure, ...] = field(default=(), compare=False, repr=False)
    sentence: str = field(default="", compare=False, repr=False)  # or table row

    @property
    def low(self) -> float:
        return self.value - self.half_step

    @property
    def high(self) -> float:
        return self.value + self.half_step

    @property
    def page(self) -> str:
        return self.where.rsplit(":", 1)[0]

    @property
    def written(self) -> str:
        """The figure as the lists above name it: "2.03x", "19%", "450 GB/s"."""
        gap = "" if self.written_unit in ("%", "x") else " "
        return f"{self.text}{gap}{self.written_unit}"

    def __str__(self) -> str:
        return f"{self.where}: {self.written}"


def _half_step(integer: str, fraction: str | None, exponent: str | None, approximate: bool):
    scale = 10.0 ** int(exponent[1:]) if exponent else 1.0
    if fraction:
        return 0.5 * 10.0 ** -(len(fraction) - 1) * scale
    if approximate:
        digits = integer.replace(",", "")
        return 0.5 * 10.0 ** (len(digits) - len(digits.rstrip("0"))) * scale
    return 0.5 * scale


def numbers_in(
    text: str, default_unit: str | None = None, where: str = "", joins: bool = True
) -> list[Figure]:
    """The numbers of a sentence or table cell that are not labels (0.8B, 32k, H200, cp=2):
    figures with their unit, and bare numbers (unit ""). `default_unit` is the unit of the
    first bare number (a table column's); `joins=False` reads an expression, where "/" and
    "-" are arithmetic."""
    matches = list(NUMBER.finditer(text))
    units: list[tuple[str, str, float] | None] = [None] * len(matches)
    ends = [m.end() for m in matches]  # where each number's unit ends
    labels = set()
    for i, match in enumerate(matches):
        unit = UNIT.match(text, match.end())
        if unit and unit.group(0) != " x":
            _, canonical, scale = UNIT_WORDS[int(unit.lastgroup[1:])]
            units[i], ends[i] = (canonical, unit.group(0).strip(), scale), unit.end()
        elif _is_label(text, match.end()):
            labels.add(i)
    bare = [i for i in range(len(matches)) if units[i] is None and i not in labels]
    # A ratio column's cell that writes its own units holds no ratio ("56.7 / 39.5 GiB").
    if default_unit and bare and not (default_unit == "x" and any(units)):
        units[bare[0]] = (default_unit, default_unit, 1.0)
    # A bare number takes the unit of a figure it is joined to, on either side, along a chain.
    pairs = [
        (i, i + 1)
        for i in range(len(matches) - 1)
        if joins
        and {i, i + 1}.isdisjoint(labels)
        and JOINS.fullmatch(text[ends[i] : matches[i + 1].start()])
    ]
    for _ in bare:
        for i, j in pairs:
            units[i], units[j] = units[i] or units[j], units[j] or units[i]
    found = []
    for i, (match, unit) in enumerate(zip(matches, units, strict=True)):
        if i in labels:
            continue
        integer, fraction, exponent = match.groups()
        canonical, written, scale = unit or ("", "", 1.0)
        approximate = bool(APPROXIMATE.search(text[: match.start()]))
        value = float(match.group(0).replace(",", "")) * scale
        half = _half_step(integer, fraction, exponent, approximate) * scale
        found.append(Figure(match.group(0), canonical, written, value, half, where, match.start()))
    for word in WORD_FIGURE.finditer(text):
        scale = 60.0 if word.group(3).startswith("minute") else 1.0
        value = NUMBER_WORDS[word.group(2)] * scale
        half = 0.5 * scale
        found.append(Figure(word.group(2), "s", word.group(3), value, half, where, word.start(2)))
    return found


def _is_label(text: str, end: int) -> bool:
    """A number that a letter follows, or a `-`/`_` and a letter: 0.8B, 32k, 248,320-token."""
    after = text[end : end + 2]
    return bool(after) and (after[0].isalpha() or (after[0] in "_-" and after[1:].isalpha()))


def figures_in(text: str, default_unit: str | None = None, **options) -> list[Figure]:
    """The figures of `text` (numbers with a unit)."""
    return [f for f in numbers_in(text, default_unit, **options) if f.unit]


# ---------------------------------------------------------------------------------------------
# The prose


def _blank(match: re.Match) -> str:
    """The match's text as spaces, its line breaks kept: offsets and line numbers stay."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose_of_markdown(text: str) -> str:
    text = re.sub(r"^```.*?^```", _blank, text, flags=re.DOTALL | re.MULTILINE)
    text = re.sub(r"<!--.*?-->", _blank, text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", lambda m: "#" * len(m.group(0)), text)


def prose_of_toml(text: str) -> str:
    """The comments of a TOML file where they stand, the settings blanked (a comment's lines
    then read as one paragraph)."""
    lines = []
    for line in text.splitlines():
        code, hash_, comment = line.partition("#")
        lines.append(" " * len(code + hash_) + comment if hash_ else "")
    return "\n".join(lines)


TABLE = re.compile(r"(?:^\|.*\|[ \t]*(?:\n|$))+", re.MULTILINE)
SENTENCE_END = re.compile(r"(?<=[.;])\s+|\n\s*\n")


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def numbers_of_page(name: str, raw: str) -> list[Figure]:
    """Every number of a page's prose that is not a label, each with its sentence or table row
    and the other numbers there (`context`)."""
    text = prose_of_toml(raw) if name.endswith(".toml") else prose_of_markdown(raw)
    found: list[Figure] = []
    for table in TABLE.finditer(text):
        found += _numbers_of_table(table.group(0), name, _line(text, table.start()))
    text = TABLE.sub(_blank, text)
    start = 0
    for end in [m.start() for m in SENTENCE_END.finditer(text)] + [len(text)]:
        found += _numbers_of_sentence(text, start, end, name)
        start = end
    return found


def _numbers_of_sentence(text: str, start: int, end: int, page: str) -> list[Figure]:
    sentence, offsets = _squeezed(text, start, end)
    numbers = numbers_in(sentence)
    if any(n.unit == "tokens/s" for n in numbers):
        numbers = [_as_throughput(n, sentence) for n in numbers]
    numbers = [replace(n, where=f"{page}:{_line(text, offsets[n.offset])}") for n in numbers]
    return _in_context(numbers, sentence)


def _squeezed(text: str, start: int, end: int) -> tuple[str, list[int]]:
    """text[start:end] with each run of white space one space, and each character's offset."""
    chars, offsets = [], []
    for i in range(start, end):
        if text[i].isspace():
            if not chars or chars[-1] == " ":
                continue
            chars.append(" ")
        else:
            chars.append(text[i])
        offsets.append(i)
    if chars and chars[-1] == " ":
        chars.pop(), offsets.pop()
    return "".join(chars), offsets


def _as_throughput(number: Figure, sentence: str) -> Figure:
    """In a sentence about tokens/s, a bare number with a thousands separator that is not a
    row length is tokens/s too ("49,675 tokens/s on one corpus, 60,655 on another")."""
    after = sentence[number.offset + len(number.text) :]
    if number.unit or "," not in number.text or re.match(r"[ -]tokens?\b(?!/)", after):
        return number
    return replace(number, unit="tokens/s", written_unit="tokens/s")


def figures_of_page(name: str, raw: str) -> list[Figure]:
    return [f for f in numbers_of_page(name, raw) if f.unit]


def _cells(row: str) -> list[str]:
    return re.sub(r"\\\|", "/", row.strip()).strip("|").split("|")


def unit_named(text: str) -> str | None:
    """The first unit word of a header or row label (not % or x, which are words there)."""
    for word, unit, _ in UNIT_WORDS[:-2]:
        word = word.replace(r"|s\b", r"|\(s\)")  # "step (s)", not "torch's"
        if re.search(r"(?<![\w/'])(?:" + word + ")", text):
            return unit
    return None


def column_unit(header: str) -> str | None:
    if unit_named(header):
        return unit_named(header)
    return "x" if " / " in header or re.search(r"\bratio\b", header) else None


def _numbers_of_table(table: str, page: str, first_line: int):
    rows = table.rstrip("\n").split("\n")
    units = [column_unit(cell) for cell in _cells(rows[0])]
    found = []
    for offset, row in enumerate(rows[2:], start=2):
        cells = _cells(row)
        row_unit = unit_named(cells[0])  # a row whose label names the unit: "0.8B tokens/s"
        in_row = []
        for cell, unit in zip(cells, units + [None] * len(cells), strict=False):
            in_row += numbers_in(cell, unit or row_unit, f"{page}:{first_line + offset}")
        found += _in_context(in_row, f"{rows[0]} {row}")  # a row reads with its header
    return found


def _in_context(numbers: list[Figure], sentence: str) -> list[Figure]:
    return [
        replace(n, context=tuple(m for m in numbers if m is not n), sentence=sentence)
        for n in numbers
    ]


FLAVOR = re.compile(r"(?<![\w.-])(\d+(?:\.\d+)?B(?:-A\d+B)?(?:-\w+)?)(?!\w)")
LENGTH = re.compile(r"(?<![\w.,])(?:(\d+)k|(\d{1,3}(?:,\d{3})+)(?=[ -]tokens?\b(?!/)))(?!\w)")
CP_DEGREE = re.compile(r"\bcp ?= ?(\d+)")


@dataclass(frozen=True)
class Mentioned:
    """The configuration a sentence or table row names: flavors, row lengths (in thousands of
    tokens, as 32k or 32,768 tokens), cp degrees. Results of other configurations do not back
    its figures."""

    flavors: frozenset[str]
    thousands: frozenset[int]
    cps: frozenset[int]

    @classmethod
    def of(cls, text: str) -> Mentioned:
        thousands = set()
        for k, tokens in LENGTH.findall(text):
            n = int(k) * 1024 if k else int(tokens.replace(",", ""))
            thousands |= {n // 1024, round(n / 1000)}
        cps = {int(cp) for cp in CP_DEGREE.findall(text)}
        return cls(frozenset(FLAVOR.findall(text)), frozenset(thousands), frozenset(cps))

    def admits(self, result: Result) -> bool:
        flavor, seq_len, cp = result.flavor, result.seq_len, result.cp
        return (
            (not self.flavors or flavor is None or any(_is_flavor(flavor, f) for f in self.flavors))
            and (
                not self.thousands
                or seq_len is None
                or {seq_len // 1024, round(seq_len / 1000)} & self.thousands
            )
            and (not self.cps or cp is None or cp in self.cps)
        )


def _is_flavor(flavor: str, named: str) -> bool:
    return flavor == named or flavor.startswith(named + "-")


def prose_pages() -> list[Path]:
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]
    pages = [p for p in pages if p.relative_to(REPO).as_posix() not in GENERATED_PAGES]
    return pages + sorted((REPO / "train_configs").glob("*.toml"))


# ---------------------------------------------------------------------------------------------
# The committed results


@dataclass(frozen=True)
class Result:
    value: float
    unit: str
    file: str
    quantity: tuple | None = None  # configuration and metric; None: this file's alone
    flavor: str | None = None
    seq_len: int | None = None
    cp: int | None = None
    word: str | None = None  # the figure's sentence must hold it (METRIC_WORDS)


def key_units(key: str) -> list[tuple[str, float]]:
    """The units a JSON key's values are in, with the scale to each."""
    if key.endswith("gb_per_s"):
        return [("GB/s", 1.0)]
    if "tokens_per_s" in key or key == "median_tps_per_gpu":
        return [("tokens/s", 1.0)]
    if key.endswith("_gib"):
        return [("GiB", 1.0)]
    if key.endswith("_ms") or key == "ms":
        return [("ms", 1.0), ("s", 1e-3)]
    if key.endswith("_s") or key == "seconds":
        return [("s", 1.0), ("ms", 1e3)]
    if key == "tflops" or key.endswith("_tflops"):
        return [("TFLOP/s", 1.0)]
    if key == "peak_flops_per_gpu":
        return [("TFLOP/s", 1e-12)]
    if key in ("mfu", "mfu_documents", "max_relative_loss_diff"):
        return [("%", 100.0)]
    if key == "bytes":
        return [("MiB", 2.0**-20), ("GiB", 2.0**-30)]
    return []


# The fields that say what an entry measured; with the metric's key they name its quantity.
CONFIGURATION = (
    "flavor",
    "seq_len",
    "cp",
    "ac",
    "gpus",
    "corpus",
    "docs",
    "overrides",
    "model",
    "gradient_checkpointing",
    "tokens",
    "documents",
    "candidate",
    "backend",
    "channels",
    "run",
)


def json_results(data, file: str) -> list[Result]:
    options = data.get("options", {}) if isinstance(data, dict) else {}
    found = []

    def walk(node, key: str, unit_key: str, section: str, entry: dict | None):
        if isinstance(node, dict):
            if any(f in node for f in CONFIGURATION):
                entry = node
                if "host_time_s" in node and node.get("step_time_s"):
                    share = 100 * node["host_time_s"] / node["step_time_s"]
                    found.append(_result(share, "%", file, options, entry, section, "host share"))
            for k, v in node.items():
                walk(v, k, k if key_units(k) else unit_key, section, entry)
        elif isinstance(node, list):
            for item in node:
                walk(item, key, unit_key, section, entry)
        elif isinstance(node, int | float) and not isinstance(node, bool):
            for unit, scale in key_units(key) or key_units(unit_key):
                result = _result(node * scale, unit, file, options, entry, section, key, unit_key)
                found.append(result)

    top = options if any(f in options for f in CONFIGURATION) else None
    for section, node in data.items():  # results, transformers, trials, environment, ...
        walk(node, section, section, section, top)
    return found


# The word a figure's sentence must hold for it to be one of these metrics: percentages of
# every kind lie between 0 and 100, and times from many profiles are near any time, so a
# percentage or a time from the JSON names its metric. Another time's word is its key
# ("median kernel ms", or "attention" under categories_ms).
METRIC_WORDS = {
    "mfu": "MFU",
    "mfu_documents": "MFU",
    "max_relative_loss_diff": "loss",
    "host share": "host",
    "host_time_s": "host",
    "step_time_s": "step",
    "step_times_s": "step",
    "profiled_step_ms": "step",
    "same_rows_step_ms": "step",
    "busy_ms": "busy",
    "exposed_comm_ms": "exposed",
    "fwd_bwd_ms": "backward",
    "ms": "attention",  # benchmarks.attention's kernel time
    "seconds": "trial",  # a longest-row trial's wall time
}


def _metric_word(metric: str, unit: str, unit_key: str) -> str | None:
    if metric in METRIC_WORDS:
        return METRIC_WORDS[metric]
    if unit in ("s", "ms"):  # a key of its own, or one of a group such as exposed_comm_ms
        return METRIC_WORDS.get(unit_key, metric.replace("_", " "))
    return None


def _result(value, unit, file, options, entry, section, metric, unit_key="") -> Result:
    word = _metric_word(metric, unit, unit_key or metric)
    if entry is None:
        return Result(value, unit, file, word=word)
    fields = {**options, **entry}
    configuration = tuple((f, json.dumps(fields.get(f))) for f in CONFIGURATION)
    quantity = (section, configuration, metric, unit)
    flavor, seq_len, cp = (fields.get(f) for f in ("flavor", "seq_len", "cp"))
    return Result(value, unit, file, quantity, flavor, seq_len, cp, word)


TEXT_RESULT = re.compile(
    r"\b(?P<metric>tps|tflops|mfu):\s*(?P<metric_value>[\d,]+(?:\.\d+)?)"
    r"|(?P<value>\d[\d,]*(?:\.\d+)?) ?(?P<unit>GiB|ms\b|s\b|%\))"
)
TEXT_METRICS = {"tps": "tokens/s", "tflops": "TFLOP/s", "mfu": "%"}


def text_results(text: str, file: str) -> list[Result]:
    """Numbers with their unit in a log or a text report: torchtitan's metrics, sizes and
    times, the percentages in parentheses (a step's share; not those of sampled stacks)."""
    found = []
    for line in text.splitlines():
        for match in TEXT_RESULT.finditer(line):
            word = None
            if match.group("metric"):
                metric, value = match.group("metric"), match.group("metric_value")
                unit, word = TEXT_METRICS[metric], METRIC_WORDS.get(metric)
            else:
                unit, value = match.group("unit").rstrip(")"), match.group("value")
                if unit == "%":
                    word = "host" if "host" in line[: match.start()] else "memory"
            found.append(Result(float(value.replace(",", "")), unit, file, word=word))
    return found


def committed_results() -> list[Result]:
    found = []
    for path in sorted(RESULTS.rglob("*")):
        file = path.relative_to(REPO).as_posix()
        if path.suffix == ".json":
            found += json_results(json.loads(path.read_text()), file)
        elif path.suffix in (".log", ".txt"):
            found += text_results(path.read_text(), file)
    return found


def computed_figures(script: str) -> list[Result]:
    """The figures a script prints as markdown tables, as results of the script."""
    argv = sys.argv
    out = io.StringIO()
    try:
        sys.argv = [script]
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(REPO / script), run_name="__main__")
    finally:
        sys.argv = argv
    numbers = numbers_of_page(script, out.getvalue())
    return [Result(f.value, f.unit, script) for f in numbers if f.unit]


# ---------------------------------------------------------------------------------------------
# What backs a figure


def matching(figure: Figure, results: list[Result]) -> list[Result]:
    slack = 1e-9 * max(abs(figure.value), 1.0)
    mentioned = Mentioned.of(figure.sentence)
    return [
        r
        for r in results
        if r.unit == figure.unit
        and figure.low - slack <= r.value <= figure.high + slack
        and mentioned.admits(r)
        and (r.word is None or r.word.lower() in figure.sentence.lower())
    ]


def is_quotient(figure: Figure) -> bool:
    """A ratio or percentage of two numbers of one unit beside it (each at its precision)."""
    if figure.unit not in ("x", "%"):
        return False
    intervals = []
    for a in figure.context:
        if figure.unit == "%" and a.unit == "x":
            intervals.append((a.low, a.high))
        for b in figure.context:
            if a is not b and a.unit == b.unit and a.unit not in ("x", "%") and b.low > 0:
                intervals.append((max(a.low, 0.0) / b.high, a.high / b.low))
    for low, high in intervals:
        if figure.unit == "x":
            candidates = [(low, high)]
        else:
            candidates = [
                (100 * low, 100 * high),
                (100 * (low - 1), 100 * (high - 1)),
                (100 * (1 - high), 100 * (1 - low)),
            ]
        if any(lo <= figure.high and figure.low <= hi for lo, hi in candidates):
            return True
    return False


OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> float:
    """+ - * / ** and parentheses over numbers, nothing else."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)}")

    return value(ast.parse(expression, mode="eval").body)


def without_units(expression: str) -> str:
    """The expression with its figures' units and thousands separators dropped."""
    text = re.sub(r"(?<=\d),(?=\d{3})", "", expression)
    words = "|".join(w for w, _, _ in UNIT_WORDS)
    return re.sub(rf"(?<=\d) ?(?:{words})", "", text)


@dataclass
class Sources:
    results: list[Result]
    computed: dict[str, list[Result]]  # page -> what its script prints

    def backing(self, figure: Figure) -> list[Result]:
        return matching(figure, self.results + self.computed.get(figure.page, []))

    def derived(self, figure: Figure) -> str | None:
        """Why a DERIVED figure is not backed, None when it is. Its operands are read in the
        context of the entry's description (which names their configuration)."""
        expression, description = DERIVED[(figure.page, figure.written)]
        for operand in figures_in(expression, where=f"{figure.page}:derived", joins=False):
            if not self.backing(replace(operand, sentence=description)):
                return f"its operand {operand.written} is no committed result"
        value = evaluate(without_units(expression))
        if not figure.low - 1e-9 * abs(value) <= value <= figure.high + 1e-9 * abs(value):
            return f"{expression} = {value:.6g}, not {figure.written}"
        return None


def unbacked(figures: list[Figure], sources: Sources) -> list[str]:
    problems = []
    for figure in figures:
        key = (figure.page, figure.written)
        if key in NOT_MEASURED:
            continue
        if key in DERIVED:
            problem = sources.derived(figure)
            if problem:
                problems.append(f"{figure}: derived, but {problem}")
        elif not sources.backing(figure) and not is_quotient(figure):
            problems.append(f"{figure}: no committed result")
    return problems


def conflicts(figures: list[Figure], sources: Sources) -> list[str]:
    """Quantities that the hand-written pages quote from more than one result file."""
    quoted = defaultdict(lambda: defaultdict(list))
    for figure in figures:
        if figure.page.startswith("docs/results/"):
            continue
        quantities = {r.quantity for r in sources.backing(figure)}
        if len(quantities) == 1 and None not in quantities:
            (quantity,) = quantities
            files = sorted({r.file for r in sources.backing(figure)})
            quoted[quantity][", ".join(files)].append(str(figure))
    return [
        " against ".join(f"{'; '.join(where)} ({files})" for files, where in by_file.items())
        for by_file in quoted.values()
        if len(by_file) > 1
    ]


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def sources() -> Sources:
    computed = {page: computed_figures(script) for page, script in COMPUTED.items()}
    return Sources(committed_results(), computed)


@pytest.fixture(scope="module")
def prose(sources) -> list[Figure]:
    found = []
    for path in prose_pages():
        found += figures_of_page(path.relative_to(REPO).as_posix(), path.read_text())
    return found


def test_every_figure_of_the_prose_is_a_committed_result(prose, sources):
    problems = unbacked(prose, sources)
    assert not problems, "\n".join(problems)


def test_one_quantity_is_quoted_from_one_result_file(prose, sources):
    found = conflicts(prose, sources)
    assert not found, "\n".join(found)


def test_every_entry_of_the_lists_names_a_figure_of_the_prose(prose):
    written = {(f.page, f.written) for f in prose}
    stale = [key for key in [*NOT_MEASURED, *DERIVED] if key not in written]
    assert not stale, f"entries for figures the prose no longer has: {stale}"


def test_computed_page_figures_come_from_running_the_script(sources):
    for page, script in COMPUTED.items():
        assert len(sources.computed[page]) > 100, f"{script} printed no tables"


# ---------------------------------------------------------------------------------------------
# The extractor itself


def _written(text: str, default_unit: str | None = None) -> list[str]:
    return [f.written for f in figures_in(text, default_unit)]


def test_figures_are_numbers_with_units_and_labels_are_not():
    text = "0.8B at 32k on one H200, bf16, cp=2: 49,675 tokens/s at 62.1 GiB, 2.03x, 53.7% MFU"
    assert _written(text) == ["49,675 tokens/s", "62.1 GiB", "2.03x", "53.7%"]
    assert _written("heads 4 x states 2, 8 GPUs, 248,320-token vocabulary, 1e-5") == []
    assert _written("415 TFLOP/s at 450 GB/s, 26 KB, 70 GB, 12 MiB, 3.94 ms, 12.4 s") == [
        "415 TFLOP/s", "450 GB/s", "26 KB", "70 GB", "12 MiB", "3.94 ms", "12.4 s"
    ]  # fmt: skip


def test_a_bare_number_joined_to_a_figure_takes_its_unit():
    assert _written("66,304 against 66,080 tokens/s, 42.8 instead of 44.7 GiB") == [
        "66,304 tokens/s", "66,080 tokens/s", "42.8 GiB", "44.7 GiB"
    ]  # fmt: skip
    assert _written("leaves 6-8 ms, 3.2-3.7x, 56.7 / 39.5 GiB") == [
        "6 ms", "8 ms", "3.2x", "3.7x", "56.7 GiB", "39.5 GiB"
    ]  # fmt: skip
    assert _written("a node of 8 and 50 GB/s") == ["50 GB/s"]


def test_a_figure_is_read_at_the_precision_it_is_written_with():
    (exact,) = figures_in("12.4 s")
    assert (exact.low, exact.high) == pytest.approx((12.35, 12.45))
    (about,) = figures_in("in about 80 seconds")
    assert (about.low, about.high) == pytest.approx((75, 85))
    (words,) = figures_in("in about two minutes")
    assert (words.low, words.high) == pytest.approx((90, 150))
    (minutes,) = figures_in("20 minutes")
    assert minutes.value == 1200


def test_table_columns_give_their_unit_to_bare_numbers():
    table = (
        "| model | tokens/s (peak) | transformers tokens/s | ours / theirs | GPUs |\n"
        "|---|---|---|---|---|\n"
        "| 0.8B | 49,675 (62.1 GiB) | 24,483 | 2.03 | 1 |\n"
    )
    figures = figures_of_page("page.md", table)
    assert [f.written for f in figures] == [
        "49,675 tokens/s",
        "62.1 GiB",
        "24,483 tokens/s",
        "2.03x",
    ]
    assert [f.where for f in figures] == ["page.md:3"] * 4
    ratio = figures[-1]
    assert is_quotient(ratio)  # 49,675 / 24,483 in its row
    assert not is_quotient(replace(ratio, value=2.10))


def test_code_comments_and_toml_settings_are_not_prose():
    markdown = (
        "Runs at 10 ms.\n\n```bash\necho 20 ms\n```\n\n`--steps 30 ms` <!-- 40 ms -->\n"
        "and 50 ms. It takes\n60 ms.\n"
    )
    figures = figures_of_page("page.md", markdown)
    assert [(f.written, f.where) for f in figures] == [
        ("10 ms", "page.md:1"), ("50 ms", "page.md:8"), ("60 ms", "page.md:9")
    ]  # fmt: skip
    toml = "seq_len = 32768  # 49,675 tokens/s at this\n# length, 62.1 GiB\nlr = 3e-4\n"
    figures = figures_of_page("c.toml", toml)
    assert [f.written for f in figures] == ["49,675 tokens/s", "62.1 GiB"]
    assert figures[0].sentence == "49,675 tokens/s at this length, 62.1 GiB"


def test_results_are_read_with_the_unit_their_key_names():
    data = {
        "options": {"corpus": "one-document"},
        "results": [
            {
                "flavor": "0.8B",
                "seq_len": 32768,
                "cp": 1,
                "step_time_s": 0.5,
                "host_time_s": 0.25,
                "tokens_per_s_per_gpu": 74887.5,
                "peak_reserved_gib": 61.8,
                "mfu": 0.5366,
                "breakdown": {"categories_ms": {"attention": 10.5}},
                "losses": [12.6],
            }
        ],
    }
    found = {(r.unit, round(r.value, 6)) for r in json_results(data, "f.json")}
    assert found == {
        ("s", 0.5), ("ms", 500.0), ("s", 0.25), ("ms", 250.0), ("%", 50.0),
        ("tokens/s", 74887.5), ("GiB", 61.8), ("%", 53.66), ("ms", 10.5), ("s", 0.0105),
    }  # fmt: skip
    (tokens,) = [r for r in json_results(data, "f.json") if r.unit == "tokens/s"]
    assert (tokens.flavor, tokens.seq_len, tokens.cp) == ("0.8B", 32768, 1)
    assert ("corpus", '"one-document"') in tokens.quantity[1]

    log = (
        "step:  3  loss: 10.73796  memory: 134.67GiB(96.33%)  tps: 63,239  tflops: 296.04  "
        "mfu: 29.93%\n0.8B seq 8192: step 157.5 ms, host 128.5 ms (82%)\n  97.7%  /usr/lib/x.py\n"
    )
    found = {(r.unit, r.value, r.word) for r in text_results(log, "f.log")}
    assert found == {
        ("GiB", 134.67, None), ("%", 96.33, "memory"), ("tokens/s", 63239, None),
        ("TFLOP/s", 296.04, None), ("%", 29.93, "MFU"), ("ms", 157.5, None),
        ("ms", 128.5, None), ("%", 82, "host"),
    }  # fmt: skip


def test_a_figure_matches_results_of_the_configuration_its_sentence_names():
    results = [
        Result(74887.5, "tokens/s", "a.json", flavor="0.8B", seq_len=32768, cp=1),
        Result(82.0, "GiB", "b.json", flavor="35B-A3B-4layers", seq_len=16384, cp=1),
        Result(53.66, "%", "a.json", flavor="0.8B", word="MFU"),
    ]

    def backed(sentence: str) -> bool:
        return all(matching(f, results) for f in _in_context(figures_in(sentence), sentence))

    assert backed("0.8B at 32k: 74,888 tokens/s")
    assert not backed("0.8B at 32k: 74,889 tokens/s")
    assert not backed("2B at 32k: 74,888 tokens/s")
    assert not backed("0.8B at 16k: 74,888 tokens/s")
    assert not backed("0.8B at 32k, cp=2: 74,888 tokens/s")
    assert backed("35B-A3B at 16,384 tokens holds 82.0 GiB")
    assert not backed("0.8B at 327,680 tokens holds 82.0 GiB")
    assert backed("MFU 53.7%") and not backed("the host waits 53.7% of the step")


def test_derived_figures_are_evaluated_from_backed_operands(monkeypatch):
    entry = ("(132.32 GiB - 93.22 GiB) / 4", "0.8B, per 65,536 tokens")
    monkeypatch.setitem(DERIVED, ("page.md", "9.8 GiB"), entry)
    monkeypatch.setitem(DERIVED, ("page.md", "9.7 GiB"), entry)
    results = [Result(132.32, "GiB", "a.json"), Result(93.22, "GiB", "a.json")]
    (right,) = figures_in("about 9.8 GiB", where="page.md:1")
    (wrong,) = figures_in("about 9.7 GiB", where="page.md:1")
    assert Sources(results, {}).derived(right) is None
    assert "not 9.7 GiB" in Sources(results, {}).derived(wrong)
    assert "93.22 GiB is no committed result" in Sources(results[:1], {}).derived(right)
    assert evaluate(without_units("(132.32 GiB - 93.22 GiB) / 4")) == pytest.approx(9.775)
    assert evaluate(without_units("1,507,328 / 786,432")) == pytest.approx(1.9167, abs=1e-4)
    with pytest.raises(ValueError):
        evaluate("__import__('os')")


def test_the_extractor_finds_the_figures_of_the_real_pages(prose, sources):
    per_page = defaultdict(int)
    for figure in prose:
        per_page[figure.page] += 1
    assert len(prose) > 300, len(prose)
    for page in ("README.md", "docs/long-context.md", "docs/design.md", "docs/context_parallel.md"):
        assert per_page[page] >= 10, (page, per_page[page])
    assert per_page["train_configs/qwen3_5_0.8b.toml"] >= 4
    # The generated page: its throughputs, sizes, FLOP rates and bandwidths are the results'
    # values as the report rounds them, so each one is found again here.
    page = "docs/performance.md"
    figures = figures_of_page(page, (REPO / page).read_text())
    plain = [f for f in figures if f.unit in ("tokens/s", "GiB", "TFLOP/s", "GB/s")]
    assert len(plain) > 400, len(plain)
    assert not [str(f) for f in plain if not sources.backing(f)]
