"""The benchmarks' GPU kernel timers against CUDA events, on work that keeps the GPU busy.

The kernel-alone ceiling and the all-to-all probe report GPU kernel time from the profiler
(`benchmarks/references.py`); on CPU they are not reached. Needs a CUDA device: CI deselects
it with ``-m "not gpu"``.
"""

import pytest
import torch

from benchmarks import references

pytestmark = pytest.mark.gpu


class OneGPU:
    """The part of the benchmarks' Runtime that the timers use."""

    def synchronize(self):
        torch.cuda.synchronize()


def _event_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


@pytest.mark.gpu_alone  # another process's kernels would run inside the events' span
def test_kernel_time_of_a_call_matches_cuda_events_when_the_gpu_is_busy():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def two_matmuls():  # two kernels a call: the timer must sum them
        (a @ b) @ b

    kernel_ms = references._kernel_ms(two_matmuls, OneGPU(), repeats=5)
    event_ms = _event_ms(two_matmuls, repeats=5)
    print(f"two 8192^3 bf16 matmuls: profiler kernels {kernel_ms:.3f} ms, events {event_ms:.3f} ms")
    # Back-to-back large matmuls leave the GPU idle for microseconds out of milliseconds.
    assert 0.9 * event_ms <= kernel_ms <= 1.02 * event_ms
