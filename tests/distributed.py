"""Run a function on N CPU processes over gloo, for multi-rank tests."""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from titan_gdn.cpu import use_cpu_if_no_accelerator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    use_cpu_if_no_accelerator()  # torchtitan's meshes would otherwise ask for CUDA
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn, *args) -> None:
    """Call fn(rank, world_size, *args) on `world_size` processes; re-raise a rank's failure."""
    errors = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world_size, _free_port(), fn, args, errors), nprocs=world_size)
    if not errors.empty():
        raise AssertionError(errors.get())
