"""Training-step throughput of titan_gdn for a list of configurations, in one process group.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.throughput \\
        --flavors 0.8B --seq-lens 8192 16384 --cp 1 2 --references transformers kernel probe \\
        --out docs/results/throughput_h200x2_0.8b.json

Every configuration uses all ranks: cp ranks per row, data parallel (FSDP) over the rest, so
with 2 processes cp=1 is 2-way data parallel and cp=2 one row over both GPUs. For each, after
`--warmup` steps (compilation, autotuning), `--steps` steps are timed (median, slowest rank);
one more step is profiled for the time breakdown. Reported: tokens/s per GPU, MFU (two FLOP
counts, see benchmarks/flop_count.py), peak memory, the breakdown, the all-to-alls per mixer.

References (`--references`): transformers' Qwen3_5ForCausalLM on rank 0's rows, one GPU,
without and with gradient checkpointing (`transformers`); FLA's delta-rule kernel alone at
each configuration's layer shape (`kernel`); NCCL all_to_all_single at the mixers' message
sizes (`probe`). The JSON is rewritten after every measurement, and `--resume` skips what the
file already holds, so a run cut short by a time limit continues where it stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from pathlib import Path

import torch

from benchmarks import common, records
from benchmarks.breakdown import exchange_kernels, layer_ranges, step_breakdown
from benchmarks.common import RunConfig, Runtime
from benchmarks.flop_count import (
    documents_flops_per_token,
    mfu,
    peak_flops,
    trainer_flops_per_token,
)

MODULE = "benchmarks.throughput"
REFERENCES = ("transformers", "kernel", "probe")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--flavors", nargs="+", default=["0.8B"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[8192])
    parser.add_argument("--cp", nargs="+", type=int, default=[1], help="context-parallel degrees")
    parser.add_argument(
        "--ac",
        nargs="+",
        default=["none"],
        help='activation checkpointing modes, each measured: none, full, "selective:op", ...',
    )
    parser.add_argument("--references", nargs="*", default=[], choices=REFERENCES)
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--resume", action="store_true", help="skip what --out already holds")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="start no new measurement after this many seconds (rerun with --resume)",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled step")
    parser.add_argument("--trace-dir", type=Path, help="also save each profiled step's trace")
    records.add_training_arguments(parser, steps=10, warmup=3)
    return parser.parse_args(argv)


class Run:
    """The state of one benchmark run: options, results so far, the output file."""

    def __init__(self, args: argparse.Namespace, rt: Runtime):
        self.args = args
        self.rt = rt
        self.opts = common.options_from_args(args)
        self.started = time.monotonic()
        self.stopped = False
        previous = records.read_json(args.out) if args.resume else None
        environment = common.environment(rt, MODULE)
        # `environment` stays the first invocation's; each entry says when and at which commit
        # it was measured, since a --resume run may measure at a later one.
        self.measured = {"date": environment["date"], "git": environment["git"]}
        self.data = previous or {
            "kind": "throughput",
            "environment": environment,
            "options": {**vars(self.opts), "references": args.references},
            "results": [],
            "transformers": [],
            "kernel": [],
            "probe": [],
        }
        # Every invocation that added to the file: --resume runs may differ in their lists.
        records.add_command(self.data, records.command_line(MODULE, rt.world_size))

    def done(self, section: str, key: dict) -> bool:
        return any(_matches(entry, key) for entry in self.data[section])

    def add(self, section: str, entry: dict) -> None:
        self.data[section].append({**entry, "measured": self.measured})
        self.save()

    def save(self) -> None:
        if self.rt.rank == 0:
            records.write_json(self.args.out, self.data)

    def out_of_time(self) -> bool:
        budget = self.args.time_budget_s
        late = budget is not None and time.monotonic() - self.started > budget
        self.stopped = self.rt.any_rank(late)  # every rank stops at the same point
        return self.stopped

    def batches(self, run: RunConfig, count: int, dp_rank: int | None = None):
        """Rows packed as the trainer's loader packs them for `run` (for the references)."""
        job = common.trainer_job_config(run, self.opts)
        dp_size = self.rt.world_size // run.cp
        rank = common.dp_rank(self.rt, run.cp) if dp_rank is None else dp_rank
        tokenizer = common.load_tokenizer(job)
        return common.make_batches(job, tokenizer, run.seq_len, count, rank, dp_size)


def _matches(entry: dict, key: dict) -> bool:
    return all(entry.get(name) == value for name, value in key.items())


def measure(run: RunConfig, state: Run) -> dict:
    """Train one configuration with the trainer of run_train.sh, time its steps, profile one
    more; free its memory."""
    rt, opts = state.rt, state.opts
    profiled = None if state.args.no_profile else _profiled_step(run, state)

    def work() -> dict:
        trainer = common.build_trainer(run, opts, rt, profiled_step=profiled)
        seconds, host_seconds, losses = common.trained(rt, trainer)
        record = {
            "tokens_per_step": trainer.tokens_per_step(),
            "step_time_s": common.median(seconds),
            "step_times_s": [round(s, 4) for s in seconds],
            "host_time_s": common.median(host_seconds),
            **rt.peak_memory_gib(),
            "losses": common.global_losses(rt, losses),
            **_flop_figures(trainer, run),
            "trainer_arguments": common.trainer_arguments(run, opts),
        }
        if profiled is not None:
            record["breakdown"] = profiled.breakdown
        return record

    return common.guarded(rt, work)


def _flop_figures(trainer, run: RunConfig) -> dict:
    # This rank's rows stand for all: every rank packs the same corpus the same way.
    rows = trainer.timed_rows()
    lengths = [
        n for inputs in rows for n in common.document_lengths(inputs, trainer.tokenizer.eos_id)
    ]
    model_args, model = trainer.model_args, trainer.model_parts[0]
    return {
        "documents_per_row": round(len(lengths) / len(rows), 1),
        "flops_per_token": trainer_flops_per_token(model_args, model, run.seq_len),
        "flops_per_token_documents": documents_flops_per_token(model_args, model, lengths),
    }


class _profiled_step:
    """The trainer's last step, profiled on rank 0, whose view is reported (parsing a trace
    takes seconds per rank). With cp > 1 on GPUs every rank profiles it and sends rank 0 its
    all-to-all kernels' times, so that each exchange is also timed without waiting for a late
    peer. Called with the trainer, it is the context manager around that step."""

    def __init__(self, run: RunConfig, state: Run):
        self.run, self.state = run, state
        self.breakdown: dict = {}

    @contextlib.contextmanager
    def __call__(self, trainer):
        rt, run, state = self.state.rt, self.run, self.state
        exchanges_timed = rt.cuda and run.cp > 1
        profiled = rt.rank == 0 or exchanges_timed
        profiler = _profiler(rt) if profiled else contextlib.nullcontext()
        model = trainer.model_parts[0]
        rt.synchronize()
        with layer_ranges(model), profiler as prof:
            if exchanges_timed:
                # Starting a profiler takes each rank its own time: the first rank in would
                # show its first collective waiting for the last (30 ms of FSDP all-gather).
                rt.host_barrier()
            start = time.perf_counter()
            yield
            rt.synchronize()
            profiled_ms = (time.perf_counter() - start) * 1000
        exchanges = _every_ranks_exchanges(prof, run.cp) if exchanges_timed else None
        if rt.rank != 0:
            return
        if state.args.trace_dir is not None:
            state.args.trace_dir.mkdir(parents=True, exist_ok=True)
            ac = run.ac.replace(":", "-")
            name = f"{run.flavor}_seq{run.seq_len}_cp{run.cp}_ac-{ac}.json"
            prof.export_chrome_trace(str(state.args.trace_dir / name))
        layer_types = trainer.model_args.layer_types
        self.breakdown = step_breakdown(prof.events(), layer_types, rt.cuda, exchanges)
        self.breakdown["profiled_step_ms"] = round(profiled_ms, 3)
        # The profiled step trained on the last timed step's rows: that step's time.
        self.breakdown["same_rows_step_ms"] = round(trainer.step_seconds[-1] * 1000, 3)


def _every_ranks_exchanges(prof, cp: int) -> list[list]:
    """Every rank's all-to-all kernels; rank 0's cp group first (ranks 0..cp-1: cp is the
    innermost mesh dimension without tensor parallelism)."""
    start_us = prof.profiler.kineto_results.trace_start_ns() / 1000
    own = exchange_kernels(prof.events(), start_us)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, own)
    return gathered[:cp]


def _profiler(rt: Runtime):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if rt.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True)


def _finish_record(record: dict, run: RunConfig, rt: Runtime) -> dict:
    """Derived figures: throughput per GPU and MFU."""
    if record.get("status") != "ok":
        return record
    tokens_per_s = record["tokens_per_step"] / record["step_time_s"] / rt.world_size
    peak = peak_flops(rt.device_name(), rt.cuda)
    record["tokens_per_s_per_gpu"] = round(tokens_per_s, 1)
    record["peak_flops_per_gpu"] = peak
    record["mfu"] = mfu(record["flops_per_token"], tokens_per_s, peak)
    record["mfu_documents"] = mfu(record["flops_per_token_documents"]["total"], tokens_per_s, peak)
    return record


def run_configuration(run: RunConfig, state: Run) -> None:
    rt = state.rt
    key = {**common.config_dict(run), "config": common.config_file(run.flavor, state.opts)}
    if not state.done("results", key):
        _announce(rt, f"measuring {run.label()}")
        record = {**key, "gpus": rt.world_size, "dp": rt.world_size // run.cp}
        record.update(measure(run, state))
        state.add("results", _finish_record(record, run, rt))
    if "kernel" in state.args.references and not state.done("kernel", key):
        _announce(rt, f"delta-rule kernel alone, {run.label()}")
        state.add("kernel", {**key, **_kernel_reference(run, state)})


def _kernel_reference(run: RunConfig, state: Run) -> dict:
    from benchmarks.references import delta_rule_kernel
    from titan_gdn.boundaries import DocumentBoundaries

    inputs, _ = state.batches(run, 1)[0]
    job = common.trainer_job_config(run, state.opts)
    docs = DocumentBoundaries.from_tokens(inputs, common.load_tokenizer(job).eos_id)
    args = common.model_args(job)
    return delta_rule_kernel(args, run.seq_len, run.cp, docs.cu_seqlens, state.rt)


def run_transformers(flavor: str, seq_len: int, state: Run) -> None:
    """transformers' model on rank 0's first rows, without and with checkpointing."""
    from benchmarks.references import only_on_rank0, transformers_reference

    rt, opts = state.rt, state.opts
    # The rows of the configuration with one row over all ranks (cp = number of ranks).
    rows_of = RunConfig(flavor, seq_len, cp=rt.world_size)
    for checkpointing in (False, True):
        key = {
            "flavor": flavor,
            "seq_len": seq_len,
            "config": common.config_file(flavor, opts),
            "gradient_checkpointing": checkpointing,
        }
        if state.done("transformers", key) or state.out_of_time():
            continue
        _announce(
            rt, f"transformers reference {flavor} seq {seq_len} checkpointing={checkpointing}"
        )
        record = None
        with only_on_rank0(rt) as runs_here:
            if runs_here:
                job = common.trainer_job_config(RunConfig(flavor, seq_len), opts)
                args = common.model_args(job)
                batches = state.batches(rows_of, opts.warmup + opts.steps, dp_rank=0)
                record = transformers_reference(
                    args,
                    batches,
                    rt,
                    checkpointing=checkpointing,
                    warmup=opts.warmup,
                    steps=opts.steps,
                    lr=job.optimizer.lr,
                )
                if record["status"] == "ok":
                    record["tokens_per_s_per_gpu"] = round(seq_len / record["step_time_s"], 1)
        state.add("transformers", {**key, **(record or {})})


def run_probe(state: Run) -> None:
    from benchmarks.references import all_to_all_probe

    rt = state.rt
    if rt.world_size < 2:
        return
    # The sizes come from rank 0's profiles; every rank must run the same collectives.
    sizes = {
        size["bytes"]
        for result in state.data["results"]
        for size in result.get("breakdown", {}).get("all_to_all", {}).get("sizes", [])
        if size["bytes"]
    }
    known = {entry["bytes"] for entry in state.data["probe"]}
    shared = [sorted(sizes - known)]
    torch.distributed.broadcast_object_list(shared, src=0)
    todo = shared[0]
    if not todo:
        return
    _announce(rt, f"all_to_all_single probe at {len(todo)} message sizes")
    for entry in all_to_all_probe(todo, rt):
        state.add("probe", entry)


_START = time.monotonic()


def _announce(rt: Runtime, message: str) -> None:
    if rt.rank == 0:
        print(f"[throughput {time.monotonic() - _START:6.0f} s] {message}", flush=True)


def print_summary(state: Run) -> None:
    if state.rt.rank != 0:
        return
    rows = [
        {
            **r,
            "peak": r.get("peak_reserved_gib"),
            "mfu_pct": _pct(r.get("mfu")),
            "mfu_doc_pct": _pct(r.get("mfu_documents")),
        }
        for r in state.data["results"]
    ]
    records.print_table(
        rows,
        [
            ("flavor", "flavor"),
            ("seq_len", "seq_len"),
            ("cp", "cp"),
            ("dp", "dp"),
            ("ac", "ac"),
            ("status", "status"),
            ("step_time_s", "step s"),
            ("tokens_per_s_per_gpu", "tok/s/GPU"),
            ("mfu_pct", "MFU %"),
            ("mfu_doc_pct", "MFU(doc) %"),
            ("peak", "peak GiB"),
        ],
    )
    if state.data["transformers"]:
        print("\ntransformers (rank 0, one GPU):")
        records.print_table(
            state.data["transformers"],
            [
                ("flavor", "flavor"),
                ("seq_len", "seq_len"),
                ("gradient_checkpointing", "ckpt"),
                ("status", "status"),
                ("step_time_s", "step s"),
                ("tokens_per_s_per_gpu", "tok/s/GPU"),
                ("peak_reserved_gib", "peak GiB"),
            ],
        )
    print(f"\nwrote {state.args.out}")
    if state.stopped:
        print("incomplete (--time-budget-s): run the same command with --resume to continue")
    else:
        print("complete")


def _pct(value):
    return None if value is None else round(100 * value, 1)


def configurations(args: argparse.Namespace, flavor: str, seq_len: int) -> list[RunConfig]:
    """Each checkpointing mode's cp degrees in turn: a mode's cp=1 and cp=2 run back to back,
    so a time budget that stops the run leaves whole ratios."""
    return [RunConfig(flavor, seq_len, cp, ac) for ac in args.ac for cp in args.cp]


def main(argv=None) -> None:
    args = parse_args(argv)
    rt = common.init_runtime(args.pg_timeout_s)
    finished = False
    try:
        state = Run(args, rt)
        for flavor, seq_len in itertools.product(args.flavors, args.seq_lens):
            for run in configurations(args, flavor, seq_len):
                if rt.world_size % run.cp:
                    _announce(rt, f"skipping cp={run.cp}: it does not divide {rt.world_size} ranks")
                    continue
                if state.out_of_time():
                    break
                run_configuration(run, state)
            if "transformers" in args.references:
                run_transformers(flavor, seq_len, state)
        if "probe" in args.references and not state.out_of_time():
            run_probe(state)
        state.data["complete"] = not state.stopped
        state.save()
        print_summary(state)
        finished = True
    finally:
        rt.leave(finished)


if __name__ == "__main__":
    common.run_as_command(main)
