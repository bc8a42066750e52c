"""Benchmarks: training throughput, longest trainable sequence, kernels alone, the report, and
the readers of a profiled step.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.throughput --help
    python -m benchmarks.memory --help
    python -m benchmarks.attention --help      # attention kernels alone (GPU)
    python -m benchmarks.conv_backends --help  # conv backends alone (GPU)
    python -m benchmarks.report
    python -m benchmarks.trace_gaps --help     # also exposed_comm, comm_overlap: a step's trace
    torchrun --standalone --nproc_per_node 1 -m benchmarks.host_profile --help

Each benchmark prints a table and writes JSON; `benchmarks.report` turns the JSON files under
`docs/results/` into `docs/performance.md`. See CONTRIBUTING.md (Benchmarks).
"""
