"""How much of a training step the host takes: the benchmark's training step, timed twice.

- `step`: from the call to the device finishing (synchronized before and after);
- `host`: from the call until it returns, with the device never waited on inside the step:
  when the host is ahead, this is well below `step`; when `host` is close to `step`, the GPU
  has been waiting for launches (the step is host-bound).

Then where the host's time goes, two ways: a sampled profile of a few steps (every thread's
Python stack read every millisecond: by innermost function and by every function on the
stack, per thread; a thread waiting, the main one in backward for instance, counts where it
waits), and cProfile tables of one step, by own and by cumulative time: the main thread
(forward, loss, optimizer) and, in a separate step, autograd's device thread, where backward
runs on a GPU (Python 3.12 allows one profiler at a time, and its call counts are exact where
its times are not: it counted the custom ops' bodies twice).

    torchrun --standalone --nproc_per_node 1 -m benchmarks.host_profile --flavor 0.8B \\
        --seq-len 8192 --ac full --out host_profile.txt
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import threading
from collections import Counter
from pathlib import Path

import torch

from benchmarks import common

WARMUP_STEPS = 3
SAMPLED_STEPS = 3


class StackSampler(threading.Thread):
    """Counts, per thread, the innermost Python function and every function on the stack of
    every other thread, every `interval_s` (a sample waits for the GIL when C code holds it)."""

    def __init__(self, interval_s: float = 0.001):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.innermost: dict[str, Counter] = {}
        self.on_stack: dict[str, Counter] = {}
        self.samples: Counter = Counter()
        self._stop_event = threading.Event()

    def run(self) -> None:
        names = {}
        while not self._stop_event.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == self.ident:
                    continue
                if ident not in names:
                    thread = next((t for t in threading.enumerate() if t.ident == ident), None)
                    names[ident] = thread.name if thread else f"thread {ident}"
                name = names[ident]
                self.samples[name] += 1
                self.innermost.setdefault(name, Counter())[_where(frame)] += 1
                seen = set()
                while frame is not None:
                    seen.add(_where(frame))
                    frame = frame.f_back
                self.on_stack.setdefault(name, Counter()).update(seen)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def report(self, rows: int) -> str:
        lines = [f"=== sampled: every {self.interval_s * 1e3:g} ms, by thread ==="]
        for name, total in self.samples.most_common():
            lines.append(f"--- {name}: {total} samples; innermost function, then on the stack")
            for counter in (self.innermost[name], self.on_stack[name]):
                for where, count in counter.most_common(rows):
                    lines.append(f"{100 * count / total:6.1f}%  {where}")
                lines.append("")
        return "\n".join(lines) + "\n"


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_filename}:{code.co_firstlineno}({code.co_name})"


class _ProfileBackward(torch.autograd.Function):
    """Identity whose backward, the first node backward runs, turns a profiler on in the
    thread that runs backward, and off when backward ends."""

    @staticmethod
    def forward(ctx, loss, profiler):
        ctx.profiler = profiler
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        ctx.profiler.enable()
        torch.autograd.Variable._execution_engine.queue_callback(ctx.profiler.disable)
        return grad, None


def _tables(profiler: cProfile.Profile, title: str, rows: int) -> str:
    text = io.StringIO()
    text.write(f"=== {title} ===\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    return text.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--flavor", default="0.8B")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--ac", default="full")
    parser.add_argument("--compile", default="config", help="as benchmarks.throughput's")
    parser.add_argument("--config", help="as benchmarks.throughput's")
    parser.add_argument("--rows", type=int, default=45, help="lines per cProfile table")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    common.prepare_environment()
    rt = common.init_runtime(timeout_s=600)
    run = common.RunConfig(args.flavor, args.seq_len, args.cp, args.ac)
    opts = common.Options(warmup=WARMUP_STEPS, steps=1, config=args.config, compile=args.compile)
    # The trainer's own step, called one at a time; later steps are neither timed nor profiled.
    trainer = common.build_trainer(
        run, opts, rt, profiled_step=lambda trainer: contextlib.nullcontext()
    )
    data = trainer.batch_generator(trainer.dataloader)

    def step():
        trainer.step += 1
        trainer.train_step(data)

    for _ in range(WARMUP_STEPS + 1):
        step()
    (step_s,), (host_s,) = rt.reduce(trainer.step_seconds), rt.reduce(trainer.host_seconds)

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # the sampler gets the GIL between bytecodes sooner
    sampler = StackSampler()
    sampler.start()
    for _ in range(SAMPLED_STEPS):
        step()
    rt.synchronize()
    sampler.stop()
    sys.setswitchinterval(switch_interval)

    main_thread = cProfile.Profile()
    main_thread.enable()
    step()
    rt.synchronize()
    main_thread.disable()
    backward = cProfile.Profile()
    loss_fn = trainer.loss_fn
    trainer.loss_fn = lambda pred, labels: _ProfileBackward.apply(loss_fn(pred, labels), backward)
    step()
    rt.synchronize()

    report = (
        f"{run.label()}: step {step_s * 1e3:.1f} ms, host until the step returns "
        f"{host_s * 1e3:.1f} ms ({100 * host_s / step_s:.0f}%)\n\n"
        + sampler.report(args.rows)
        + _tables(
            main_thread, "main thread: forward, loss, optimizer (backward if on CPU)", args.rows
        )
        + _tables(backward, "backward (autograd's device thread on a GPU)", args.rows)
    )
    if rt.rank == 0:
        args.out.write_text(report)
        print(report.splitlines()[0])


if __name__ == "__main__":
    main()
