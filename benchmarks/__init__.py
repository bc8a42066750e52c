"""Benchmark scripts: training throughput, longest trainable sequence, and the report.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.throughput --help
    python -m benchmarks.memory --help
    python -m benchmarks.report

Each script prints a table and writes JSON; `benchmarks.report` turns the JSON files under
`docs/results/` into `docs/performance.md`. See CONTRIBUTING.md (Benchmarks).
"""
