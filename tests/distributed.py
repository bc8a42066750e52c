"""Run a function on N CPU processes over gloo, for multi-rank tests.

The ranks are forked from one server process per test session (multiprocessing's forkserver)
that has imported torch, torchtitan and titan_gdn: a rank started afresh (spawn) spends about 6
CPU-seconds importing them, and the suite starts about a hundred ranks. The server holds those
imports only, none of a test's state (it is a new interpreter, not a fork of pytest); each rank
takes the caller's working directory and environment, as a spawned rank would.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from titan_gdn.boundaries import DocumentBoundaries
from titan_gdn.cpu import use_cpu_if_no_accelerator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the server imports once: this module's own imports (titan_gdn, and torchtitan through it)
# and what the checks build their models with.
_PRELOAD = ["tests.distributed", "titan_gdn.parallel.parallelize", "torchtitan.config"]


def _worker(rank, world_size, port, fn, args, errors, caller):
    workdir, environment = caller
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    use_cpu_if_no_accelerator()  # torchtitan's meshes would otherwise ask for CUDA
    # The ranks share the machine's cores: each gets its part of them. With torch's default
    # (every core per rank) each rank's idle OpenMP threads spin between ops on cores the
    # other ranks need; 4 ranks on 2 cores took about 10 times the CPU time.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        dist.destroy_process_group()
        raise
    exit_cleanly()


def exit_cleanly() -> None:
    """End a gloo worker that passed: wait for every rank, destroy the groups, and leave
    without the interpreter's teardown. Teardown sometimes aborts the process after the
    checks passed ("terminate called without an active exception", SIGABRT: gloo's threads
    still hold work objects whose tensors Python frees during finalization), which would
    fail a test that passed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(world_size: int, fn, *args) -> None:
    """Call fn(rank, world_size, *args) on `world_size` processes; re-raise a rank's failure."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    errors = context.SimpleQueue()
    caller = (os.getcwd(), dict(os.environ))
    mp.start_processes(
        _worker,
        args=(world_size, _free_port(), fn, args, errors, caller),
        nprocs=world_size,
        start_method="forkserver",
    )
    if not errors.empty():
        raise AssertionError(errors.get())


def rank_rows_and_tokens(dims, seq_len: int, rows_per_rank: int = 2) -> tuple[slice, slice]:
    """This rank's part of a global batch: its data-parallel rows and its cp chunk of tokens."""
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_shard > 1 else 0
    cp_rank = dims.get_mesh("cp").get_local_rank() if dims.cp > 1 else 0
    rows = slice(rows_per_rank * dp_rank, rows_per_rank * (dp_rank + 1))
    tokens = slice(cp_rank * seq_len // dims.cp, (cp_rank + 1) * seq_len // dims.cp)
    return rows, tokens


def reference_and_rank_logits(reference, model, batch, dims, eos: int):
    """Forward and backward of the next-token cross-entropy, summed and divided by the global
    token count: `reference` on the whole batch, `model` on this rank's rows and tokens, with
    the document boundaries of the rank's whole rows. Returns (reference logits of this
    rank's part, the rank's logits)."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    total_tokens = labels.numel()
    ref_logits = reference(inputs, attention_masks=DocumentBoundaries.from_tokens(inputs, eos))
    F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="sum").div(
        total_tokens
    ).backward()
    rows, tokens = rank_rows_and_tokens(dims, inputs.shape[1])
    docs = DocumentBoundaries.from_tokens(inputs[rows], eos)  # global: the rank's whole rows
    logits = model(inputs[rows, tokens], attention_masks=docs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels[rows, tokens].flatten(), reduction="sum")
    (loss / total_tokens).backward()
    return ref_logits[rows, tokens], logits
