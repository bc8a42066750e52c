"""Peak memory of a context-parallel training step, by head exchange, on CPU processes (gloo).

One forward + backward of the debug model over one packed batch, cp=2, for each exchange,
batch size, compile mode and activation checkpointing mode: the peak of the bytes allocated
during the step (torch's profiler, allocation events of rank 0), the model's weights and
what was allocated before the step left out; the least and the largest over `--steps`
identical steps.

Exchanges:
- `dtensor`: `HeadSharding` as the model uses it, DTensor's `redistribute`, which on GPUs and
  (with `titan_gdn.cpu.exchange_shards_by_all_to_all`) on CPU runs `_dtensor.shard_dim_alltoall`;
- `dtensor-gather`: the same with torch's own CPU fallback (all-gather, then a chunk);
- `op`: the custom op `titan_gdn::all_to_all` of `titan_gdn/parallel/head_sharding.py` as it
  is at `--op-from COMMIT` (default: the last commit that has it, read from git history), on
  the model's current projections.

    python scripts/exchange_memory.py --seq-len 4096

A run can be split (`--exchange`, `--batch`, `--compiled`, `--ac` pick a part of the grid):
with `--results FILE`, each run adds its peaks to the JSON file and prints the table of all.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: the repo's packages

EOS = 0
EXCHANGES = ["dtensor", "dtensor-gather", "op"]
# The last commit whose head_sharding.py has the custom op `titan_gdn::all_to_all`.
CUSTOM_OP_COMMIT = "8dedaf6"
AC_MODES = {"none": ("none", "op"), "selective op": ("selective", "op"), "full": ("full", "op")}


def _peak_allocated(step) -> int:
    """The peak, over `step()`, of the CPU bytes allocated since it began."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _op_exchange(commit: str):
    """`HeadSharding` as it was at `commit`, taking and giving one tensor as the model now does."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:titan_gdn/parallel/head_sharding.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "op_head_sharding.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("op_head_sharding", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # compiled code finds its globals by module name
    spec.loader.exec_module(module)

    class OpHeadSharding(module.HeadSharding):
        def to_heads(self, groups):
            return module.HeadSharding.to_heads(self, groups)[0]

        def to_tokens(self, groups):
            return module.HeadSharding.to_tokens(self, groups)[0]

    return OpHeadSharding, torch.ops.titan_gdn.all_to_all.default


def _job_config(ac: str, compiled: bool):
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option = AC_MODES[ac]
    job.training.mixed_precision_param = "float32"
    job.compile.enable = compiled
    job.compile.components = ["model"]
    job.compile.backend = "aot_eager"
    return job


def _measure(rank, world_size, exchange, batch, seq_len, ac, compiled, op_from, steps):
    from torch.distributed.tensor import _collective_utils, placement_types
    from torchtitan.distributed import ParallelDims

    from titan_gdn import cpu
    from titan_gdn.boundaries import DocumentBoundaries
    from titan_gdn.model import Qwen35Model, qwen3_5_args
    from titan_gdn.parallel import activation_checkpoint, context_parallel, head_sharding
    from titan_gdn.parallel.parallelize import parallelize_qwen3_5

    if exchange == "op":
        sharding, op = _op_exchange(op_from)
        context_parallel.HeadSharding = sharding
        activation_checkpoint.OPS_TO_SAVE.add(op)
    if exchange == "dtensor-gather":
        # HeadSharding would route the fallback to the all-to-all again when it is built.
        head_sharding.exchange_shards_by_all_to_all = lambda: None
        placement_types.shard_dim_alltoall = _collective_utils.shard_dim_alltoall
    else:
        cpu.exchange_shards_by_all_to_all()

    torch.manual_seed(0)
    model = Qwen35Model(qwen3_5_args["debugmodel"])
    model.init_weights()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=world_size, tp=1, pp=1, ep=1, etp=1, world_size=world_size
    )
    dims.build_mesh()
    model = parallelize_qwen3_5(model, dims, _job_config(ac, compiled))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 2048, (batch, seq_len + 1), generator=gen)
    tokens[:, torch.randint(0, seq_len, (seq_len // 256,), generator=gen)] = EOS
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    docs = DocumentBoundaries.from_tokens(inputs, EOS)
    shard = slice(rank * seq_len // world_size, (rank + 1) * seq_len // world_size)

    def step():
        logits = model(inputs[:, shard], attention_masks=docs)
        F.cross_entropy(logits.flatten(0, 1), labels[:, shard].flatten()).backward()

    step()  # compiles
    peaks = []
    # Identical steps peak differently (by up to 14% measured, under full checkpointing):
    # FSDP's collectives, over cp here, run on gloo's threads, asynchronously.
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        peaks.append(_peak_allocated(step))
    dist.barrier()
    return peaks


def _worker(rank, world_size, port, configs, op_from, steps, results):
    from titan_gdn.cpu import use_cpu_if_no_accelerator

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    use_cpu_if_no_accelerator()  # torchtitan's meshes would otherwise ask for CUDA
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    for config in configs:
        torch._dynamo.reset()
        peaks = _measure(rank, world_size, *config, op_from, steps)
        if rank == 0:
            mib = ", ".join(f"{peak / 2**20:.1f}" for peak in peaks)
            print(f"measured {config}: {mib} MiB", flush=True)
            results.put((config, peaks))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mib_range(peaks: list[int]) -> str:
    return f"{min(peaks) / 2**20:.1f} ({max(peaks) / 2**20:.1f})"


def _table(peaks: dict, seq_len: int, cp: int) -> str:
    """Markdown rows (B, compiled, AC) by columns (exchange): each case's least peak over its
    steps, in MiB, and in brackets its largest."""
    exchanges = [e for e in EXCHANGES if any(key[3] == e for key in peaks)]
    order = list(AC_MODES)
    rows = sorted({key[:3] for key in peaks}, key=lambda r: (r[0], r[1], order.index(r[2])))
    lines = [
        f"torch {torch.__version__}, debug model, cp={cp}, {seq_len} tokens a row",
        "| B | compiled | AC | " + " | ".join(f"{e} MiB" for e in exchanges) + " |",
        "|---" * (3 + len(exchanges)) + "|",
    ]
    for batch, compiled, ac in rows:
        cells = [peaks.get((batch, compiled, ac, e)) for e in exchanges]
        row = " | ".join("-" if p is None else _mib_range(p) for p in cells)
        lines.append(f"| {batch} | {'yes' if compiled else 'no'} | {ac} | {row} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--op-from",
        default=CUSTOM_OP_COMMIT,
        help=f"a commit that has titan_gdn::all_to_all (default {CUSTOM_OP_COMMIT}, the last one)",
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per case")
    parser.add_argument("--exchange", nargs="+", choices=EXCHANGES, help="default: all")
    parser.add_argument("--compiled", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--ac", nargs="+", choices=list(AC_MODES), default=list(AC_MODES))
    parser.add_argument("--results", type=Path, help="a JSON file of peaks to add to")
    args = parser.parse_args()
    exchanges = args.exchange or EXCHANGES
    peaks = {}
    if args.results and args.results.exists():
        stored = json.loads(args.results.read_text())
        if (stored["seq_len"], stored["cp"]) != (args.seq_len, args.cp):
            parser.error(f"{args.results} holds another --seq-len or --cp")
        peaks = {tuple(key): peak for key, peak in stored["peaks"]}
    compiled_modes = [c == "yes" for c in args.compiled]
    for exchange in exchanges:  # one process group per exchange: the op patches a module
        configs = [
            (exchange, batch, args.seq_len, ac, compiled)
            for batch, compiled, ac in itertools.product(args.batch, compiled_modes, args.ac)
        ]
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(
            _worker,
            args=(args.cp, _free_port(), configs, args.op_from, args.steps, results),
            nprocs=args.cp,
        )
        while not results.empty():
            (exchange, batch, _, ac, compiled), measured = results.get()
            peaks[(batch, compiled, ac, exchange)] = measured
        if args.results:  # after each exchange: a later failure keeps what was measured
            stored = {"seq_len": args.seq_len, "cp": args.cp, "torch": torch.__version__}
            stored["peaks"] = [[list(key), peak] for key, peak in sorted(peaks.items())]
            args.results.write_text(json.dumps(stored, indent=1) + "\n")
    print(_table(peaks, args.seq_len, args.cp))


if __name__ == "__main__":
    main()
