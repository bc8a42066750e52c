"""The step log line: torchtitan's head, the documents, the progress; MFU only with a peak."""

from types import SimpleNamespace

import pytest
from torchtitan.tools.utils import NoColor

from titan_gdn.metrics import DOCUMENTS_METRIC, Qwen35MetricsProcessor, _clock

METRICS = {
    "loss_metrics/global_avg_loss": 5.25,
    "grad_norm": 1.5,
    "memory/max_reserved(GiB)": 0.9,
    "memory/max_reserved(%)": 3.8,
    "throughput(tps)": 385.4,
    "tflops": 0.01,
    "mfu(%)": 12.345,
    DOCUMENTS_METRIC: 13.6,
}


def _processor(peak_flops: float, steps: int = 60, log_freq: int = 10) -> Qwen35MetricsProcessor:
    processor = Qwen35MetricsProcessor.__new__(Qwen35MetricsProcessor)
    processor.color, processor.gpu_peak_flops = NoColor(), peak_flops
    processor.job_config = SimpleNamespace(
        training=SimpleNamespace(steps=steps), metrics=SimpleNamespace(log_freq=log_freq)
    )
    return processor


def test_a_cpu_line_has_progress_and_no_mfu(monkeypatch):
    processor = _processor(float("nan"))
    processor.progress_start = (100.0, 0)
    monkeypatch.setattr("titan_gdn.metrics.time.perf_counter", lambda: 114.0)
    line = processor._step_line(10, METRICS)
    assert line == (
        "step: 10  loss:  5.25000  grad_norm:  1.5000  memory:  0.90GiB(3.80%)  tps: 385  "
        "docs: 13.6  progress: 10/60  elapsed: 0:14  eta: 1:10"
    )


def test_a_line_with_a_known_peak_shows_tflops_and_mfu(monkeypatch):
    processor = _processor(989e12)
    processor.progress_start = (0.0, 50)  # resumed after step 50: the pace is this run's
    monkeypatch.setattr("titan_gdn.metrics.time.perf_counter", lambda: 20.0)
    line = processor._step_line(55, METRICS)
    assert "tps: 385  tflops: 0.01  mfu: 12.35%  docs: 13.6  " in line
    assert line.endswith("progress: 55/60  elapsed: 0:20  eta: 0:20")


@pytest.mark.parametrize("first_step_done", [0, 50])
def test_the_first_every_log_freq_and_the_last_step_are_logged(first_step_done):
    processor = _processor(float("nan"), steps=65)
    processor.progress_start = (0.0, first_step_done)
    logged = [step for step in range(first_step_done + 1, 66) if processor.should_log(step)]
    tens = [step for step in range(10, 61, 10) if step > first_step_done]
    assert logged == sorted({1, first_step_done + 1, *tens, 65} - set(range(first_step_done + 1)))


def test_clock():
    assert [_clock(s) for s in (0, 59.6, 61, 3599, 3600, 7325)] == [
        "0:00", "1:00", "1:01", "59:59", "1:00:00", "2:02:05"
    ]  # fmt: skip
