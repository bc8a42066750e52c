"""Regenerate docs/performance.md and its plots from the JSON files under docs/results/.

    python -m benchmarks.report           # write docs/performance.md and docs/performance/*.png
    python -m benchmarks.report --check   # exit 1 if docs/performance.md is not what the JSON gives

Reads what benchmarks.throughput and benchmarks.memory write (every JSON file under
docs/results/, subfolders included), and the summaries of scripts/summarize_runs.py. The page
is organised by question, one table each; every table names the result files it reads and the
commands that wrote them. It is never edited by hand: change the JSON (run a benchmark) or this
package, then regenerate. Plots need matplotlib (`pip install -e ".[bench]"`); without it the
text is written and the plots are left as they are.

Where each part is: `page` (the page, its order of sections, the command line), `tables` (what
every section shares), the sections by what they show, `training` (the training command,
against transformers, by row length, the training runs), `targets` (one GPU's targets, every
target), `parallel` (what context parallel costs and buys, its all-to-alls), `memory` (the
longest row that fits), `kernels` (a step's time by kernel category, the delta-rule kernel and
attention alone); and `plots`.
"""
