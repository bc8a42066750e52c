"""Device memory that the communicators of a CP run hold outside PyTorch's caching allocator.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.comm_memory --cp 2 \\
        --out docs/results/comm_memory_h200x2.json

torchtitan's meshes give every mesh dimension a process group of its own (world, cp, fsdp,
loss), and NCCL sets up buffers for each communicator the first time it is used. At long
sequence lengths those buffers compete with activations for the last GiB, so this measures
them: the process group and meshes are built as in training, then each collective the
training step issues runs once on its group, and the device memory held outside the caching
allocator is read after each. NCCL settings are taken from the environment (and recorded),
so the same command compares them, e.g. `NCCL_COMM_SPLIT_SHARE_RESOURCES=1`.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from benchmarks.common import Runtime, environment, init_runtime
from benchmarks.references import collective_seconds
from titan_gdn.ops.local_memory import outside_allocator_gib


def outside_gib(rt: Runtime) -> float:
    """The most any rank holds outside the caching allocator."""
    (outside,) = rt.reduce([outside_allocator_gib()])
    return round(outside, 3)


def collectives(rt: Runtime, cp: int, exchange_bytes: int) -> list[tuple[str, object]]:
    """What one training step runs, by group: the mixers' all-to-all on cp, FSDP's all-gather
    and reduce-scatter, the loss all-reduce, the benchmarks' own reductions on the world."""
    dims = rt.dims(cp)
    cp_group = dims.get_mesh("cp").get_group()
    fsdp_group = dims.get_mesh("fsdp").get_group()
    loss_group = dims.get_mesh("loss").get_group()
    n = rt.world_size
    exchange = torch.empty(exchange_bytes // 2 // n * n, dtype=torch.bfloat16, device=rt.device)
    received = torch.empty_like(exchange)
    shard = torch.empty(64 * 2**20 // 4, device=rt.device)
    gathered = torch.empty(shard.numel() * n, device=rt.device)
    scalar = torch.ones(1, device=rt.device)
    return [
        ("world all_reduce", lambda: dist.all_reduce(scalar)),
        ("cp all_to_all", lambda: dist.all_to_all_single(received, exchange, group=cp_group)),
        ("fsdp all_gather", lambda: dist.all_gather_into_tensor(gathered, shard, group=fsdp_group)),
        (
            "fsdp reduce_scatter",
            lambda: dist.reduce_scatter_tensor(shard, gathered, group=fsdp_group),
        ),
        ("loss all_reduce", lambda: dist.all_reduce(scalar, group=loss_group)),
    ]


def measure(rt: Runtime, cp: int, exchange_bytes: int) -> list[dict]:
    rows = [{"after": "process group", "outside_allocator_gib": outside_gib(rt)}]
    steps = collectives(rt, cp, exchange_bytes)
    rows.append({"after": "meshes built", "outside_allocator_gib": outside_gib(rt)})
    for name, run in steps:
        # The warm-up call sets the communicator's connections up.
        ms = round(collective_seconds(run, rt, repeats=5, warmup=1) * 1000, 3)
        rows.append({"after": name, "outside_allocator_gib": outside_gib(rt), "ms": ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--exchange-mib", type=int, default=1024, help="all-to-all bytes per rank")
    parser.add_argument("--out", help="JSON file to write (rank 0)")
    args = parser.parse_args()
    rt = init_runtime(timeout_s=300)
    if not rt.cuda:
        raise SystemExit("comm_memory measures device memory: run it on GPUs")
    rows = measure(rt, args.cp, args.exchange_mib * 2**20)
    if rt.rank == 0:
        previous = 0.0
        print(f"{'after':<22} {'outside allocator GiB':>22} {'added':>7} {'ms':>8}")
        for row in rows:
            gib = row["outside_allocator_gib"]
            print(f"{row['after']:<22} {gib:>22.3f} {gib - previous:>7.3f} {row.get('ms', ''):>8}")
            previous = gib
        if args.out:
            record = {
                "kind": "comm_memory",
                "options": vars(args),
                "rows": rows,
                "environment": environment(rt, "benchmarks.comm_memory"),
            }
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
