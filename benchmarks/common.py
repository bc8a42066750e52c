"""What the throughput and memory benchmarks share: the process group, building a model as the
trainer does, packed batches, the timed training step, out-of-memory handling, JSON records.

The step is torchtitan's train step with titan_gdn's pieces (`parallelize_qwen3_5`,
`prepare_batch`, the chunked loss, torchtitan's optimizer and gradient clipping), without the
Trainer around it: one process can then build, time and free many configurations in turn.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import itertools
import linecache
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from benchmarks.records import OOM_MESSAGES, REPO_ROOT, check_docs, command_line
from titan_gdn.cpu import use_cpu_if_no_accelerator
from titan_gdn.ops.local_memory import outside_allocator_gib

TOKENIZER_PATH = REPO_ROOT / "assets" / "tokenizer"
GIB = 1024**3


def prepare_environment() -> None:
    """Defaults that must be set before CUDA or Triton first read them (recorded in the JSON).

    Triton keeps autotuning results on disk (FLA asks for it too), so a later process on the
    same machine, a memory trial or the next command, skips FLA's minutes of autotuning;
    compiled kernels are cached by Triton and Inductor by default. Expandable segments keep
    long-sequence runs from failing on fragmentation rather than on memory.
    """
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


# ---------------------------------------------------------------------------------------------
# Options and configurations


@dataclass(frozen=True)
class RunConfig:
    """One measured configuration. `ac` is torchtitan's activation-checkpoint mode, with the
    selective option after a colon: "none", "full", "selective:op", "selective:2"."""

    flavor: str
    seq_len: int
    cp: int = 1
    ac: str = "none"

    @property
    def ac_mode(self) -> str:
        return self.ac.split(":", 1)[0]

    @property
    def ac_option(self) -> str | None:
        return self.ac.split(":", 1)[1] if ":" in self.ac else None

    def label(self) -> str:
        return f"{self.flavor} seq {self.seq_len} cp{self.cp} ac={self.ac}"


@dataclass(frozen=True)
class Options:
    """Settings shared by every configuration of a run."""

    steps: int = 10
    warmup: int = 3
    docs: str = "corpus"
    precision: str = "mixed"
    compile_backend: str = "auto"
    lr: float = 3e-4
    seed: int = 0
    overrides: tuple[tuple[str, str], ...] = ()

    def resolved_compile_backend(self, cuda: bool) -> str:
        # Inductor on CPU builds C++ kernels for minutes; aot_eager still traces each block
        # as one graph.
        if self.compile_backend == "auto":
            return "inductor" if cuda else "aot_eager"
        return self.compile_backend


def options_from_args(args: argparse.Namespace) -> Options:
    check_docs(args.docs)
    overrides = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides.append((key, value))
    return Options(
        steps=args.steps,
        warmup=args.warmup,
        docs=args.docs,
        precision=args.precision,
        compile_backend=args.compile_backend,
        lr=args.lr,
        seed=args.seed,
        overrides=tuple(overrides),
    )


# ---------------------------------------------------------------------------------------------
# Process group and device


@dataclass
class Runtime:
    device: torch.device
    rank: int
    world_size: int
    _dims: dict = field(default_factory=dict)
    _host_group: object = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        # A reduction, not dist.barrier: under NCCL it waits on this rank's own device.
        self.any_rank(False)

    def host_barrier(self) -> None:
        """Ranks meet on the host, launching nothing on the device (so nothing in a profile)."""
        if self._host_group is None:
            self._host_group = dist.new_group(backend="gloo")
        dist.barrier(group=self._host_group)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any: how ranks agree on a failure."""
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def reduce(self, values: list[float], op=dist.ReduceOp.MAX) -> list[float]:
        if not values:
            return []
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def dims(self, cp: int):
        """The parallel layout for `cp`, data parallel over the other ranks; built once per
        degree, since every mesh creates communicators (memory and seconds each)."""
        if cp not in self._dims:
            dims = _fsdp_everywhere_dims(cp, self.world_size)
            dims.build_mesh()
            self._dims[cp] = dims
        return self._dims[cp]

    def reset_peak_memory(self) -> None:
        _device_module().reset_peak_memory_stats()

    def peak_memory_gib(self) -> dict[str, float]:
        """Peaks since the last reset: reserved (what torchtitan logs) and active bytes; on CPU
        both are the process's peak RSS."""
        stats = _device_module().memory_stats()
        reserved, active = self.reduce(
            [stats["reserved_bytes.all.peak"] / GIB, stats["active_bytes.all.peak"] / GIB]
        )
        peaks = {"peak_reserved_gib": round(reserved, 2), "peak_active_gib": round(active, 2)}
        if self.cuda:
            (outside,) = self.reduce([outside_allocator_gib()])
            peaks["outside_allocator_gib"] = round(outside, 2)
        return peaks

    def free_memory(self) -> None:
        gc.collect()
        # Compiled graphs and their recompile counters belong to the configuration just run.
        torch._dynamo.reset()
        if self.cuda:
            torch.cuda.empty_cache()

    def device_name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name(self.device)
        return f"CPU {platform.machine()}"


def _device_module():
    # Looked up per call: titan_gdn.cpu rebinds it to a CPU module when there is no GPU.
    from torchtitan.tools import utils

    return utils.device_module


def _fsdp_everywhere_dims(cp: int, world_size: int):
    from torchtitan.distributed import ParallelDims

    class FsdpEverywhereDims(ParallelDims):
        """torchtitan's ParallelDims, with FSDP2 on every mesh, a single rank included: one
        GPU then trains with the mixed precision of two (bf16 compute, fp32 weights and
        gradient reduction). torchtitan's trainer would use autocast on one GPU instead."""

        @property
        def fsdp_enabled(self) -> bool:
            return True

        def _mesh_exist(self, name: str, degree: int) -> bool:
            return name == "fsdp" or super()._mesh_exist(name, degree)

    if world_size % cp:
        raise ValueError(f"cp = {cp} does not divide the {world_size} ranks")
    return FsdpEverywhereDims(
        dp_replicate=1,
        dp_shard=world_size // cp,
        cp=cp,
        tp=1,
        pp=1,
        ep=1,
        etp=1,
        world_size=world_size,
    )


def init_runtime(timeout_s: float) -> Runtime:
    """Join the process group torchrun set up, or make a one-process group: NCCL on CUDA,
    gloo on CPU (with titan_gdn's CPU runtime for torchtitan)."""
    prepare_environment()
    use_cpu_if_no_accelerator()
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return Runtime(device=device, rank=dist.get_rank(), world_size=dist.get_world_size())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in OOM_MESSAGES)


def load_tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(TOKENIZER_PATH))


# ---------------------------------------------------------------------------------------------
# Building a model as the trainer does


@dataclass
class Training:
    model: torch.nn.Module
    optimizers: Any
    loss_fn: Callable
    dims: Any
    tokenizer: Any
    model_args: Any
    global_tokens: int  # tokens per step over all ranks (each data-parallel rank has a row)


def job_config(run: RunConfig, opts: Options, rt: Runtime):
    from torchtitan.config import JobConfig

    job = JobConfig()
    job.model.name = "qwen3_5"
    job.model.flavor = run.flavor
    job.model.hf_assets_path = str(TOKENIZER_PATH)
    job.job.dump_folder = str(REPO_ROOT / "outputs" / "benchmarks")
    training = job.training
    training.seq_len, training.local_batch_size, training.max_norm = run.seq_len, 1, 1.0
    training.mixed_precision_param, training.mixed_precision_reduce = "bfloat16", "float32"
    parallelism = job.parallelism
    parallelism.context_parallel_degree = run.cp
    parallelism.data_parallel_shard_degree = -1
    parallelism.context_parallel_load_balancer = "none"
    job.activation_checkpoint.mode = run.ac_mode
    if run.ac_option is not None:
        job.activation_checkpoint.selective_ac_option = run.ac_option
    backend = opts.resolved_compile_backend(rt.cuda)
    job.compile.enable = backend != "none"
    job.compile.components = ["model", "loss"]
    job.compile.backend = backend
    job.optimizer.lr = opts.lr
    job.optimizer.implementation = "fused" if rt.cuda else "foreach"
    for key, value in opts.overrides:
        _set_field(job, key, value)
    return job


def _set_field(job, key: str, text: str) -> None:
    section, name = key.rsplit(".", 1)
    target = job
    for part in section.split("."):
        target = getattr(target, part)
    if not hasattr(target, name):
        raise SystemExit(f"--set {key}: JobConfig has no such field")
    current = getattr(target, name)
    value: Any = text
    if isinstance(current, bool):
        value = text.lower() in ("1", "true", "yes")
    elif isinstance(current, int | float) or (current is None and _is_number(text)):
        value = type(current)(text) if current is not None else float(text)
    elif isinstance(current, list):
        value = [item for item in text.split(",") if item]
    setattr(target, name, value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def model_args(run: RunConfig, job):
    from titan_gdn.model import qwen3_5_args

    args = copy.deepcopy(qwen3_5_args[run.flavor])
    # A memory search goes past the flavor's position limit. RoPE is computed from positions
    # (no table), and packed documents keep positions short, so the limit guards nothing here.
    args.max_seq_len = max(args.max_seq_len, run.seq_len)
    args.update_from_config(job)  # the trainer's checks, with their messages
    return args


def build_training(run: RunConfig, opts: Options, rt: Runtime, tokenizer) -> Training:
    from torchtitan.components.optimizer import build_optimizers

    from titan_gdn.loss import build_qwen3_5_loss
    from titan_gdn.model import Qwen35Model
    from titan_gdn.parallel.parallelize import parallelize_qwen3_5

    job = job_config(run, opts, rt)
    args = model_args(run, job)
    dims = rt.dims(run.cp)
    torch.manual_seed(opts.seed)
    # As torchtitan's Trainer: parallelize on the meta device, then allocate and initialize.
    with torch.device("meta"):
        model = Qwen35Model(args)
    if opts.precision == "bf16":
        model.to(torch.bfloat16)
    model = parallelize_qwen3_5(model, dims, job)
    model.to_empty(device=rt.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = build_optimizers([model], job.optimizer, dims)
    dp = rt.world_size // run.cp
    return Training(
        model=model,
        optimizers=optimizers,
        loss_fn=build_qwen3_5_loss(job),
        dims=dims,
        tokenizer=tokenizer,
        model_args=args,
        global_tokens=run.seq_len * dp,
    )


# ---------------------------------------------------------------------------------------------
# Packed batches


def make_batches(
    docs: str, tokenizer, seq_len: int, count: int, dp_rank: int, dp_size: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` rows (inputs, labels), each [1, seq_len], of data-parallel rank `dp_rank`.

    "corpus": the bundled corpus through the project's packing (what training reads);
    "single": random tokens with no EOS, one document per row; "N": random documents of N
    tokens. Random ids stay within the tokenizer's vocabulary, like real text.
    """
    if docs == "corpus":
        from titan_gdn.data import PackedDocumentDataset, build_document_source

        dataset = PackedDocumentDataset(
            build_document_source("tinyshakespeare", None),
            tokenizer,
            seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_size,
            infinite=True,
        )
        rows = itertools.islice(iter(dataset), count)
        return [(sample["input"][None], labels[None]) for sample, labels in rows]
    generator = torch.Generator().manual_seed(seed * 1_000_003 + dp_rank)
    vocab, eos = tokenizer.get_vocab_size(), tokenizer.eos_id
    tokens = torch.randint(0, vocab, (count, seq_len + 1), generator=generator)
    tokens[tokens == eos] = (eos + 1) % vocab
    if docs != "single":
        length = int(docs)
        tokens[:, length - 1 :: length] = eos
    return [(row[None, :-1], row[None, 1:]) for row in tokens]


def document_lengths(inputs: torch.Tensor, eos_id: int) -> list[int]:
    """Lengths of the documents in packed rows [B, T]: one ends after each EOS and at each
    row end (as DocumentBoundaries counts them)."""
    lengths = []
    for row in inputs.cpu():
        ends = (row == eos_id).nonzero().flatten().add(1).tolist()
        if not ends or ends[-1] != row.numel():
            ends.append(row.numel())
        lengths += [end - start for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    return lengths


def dp_rank(rt: Runtime, cp: int) -> int:
    # torchtitan lays ranks out as [batch, cp]: the cp ranks of one row are adjacent.
    return rt.rank // cp


# ---------------------------------------------------------------------------------------------
# The training step


def train_step(t: Training, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's train step: forward, loss over the global token count, backward, gradient
    clipping, optimizer. The record_function names let the profiler attribute each phase."""
    from torchtitan.distributed.utils import clip_grad_norm_

    from titan_gdn.trainer import prepare_batch

    with record_function("bench::documents"):
        inputs, labels, extra_inputs, extra_kwargs = prepare_batch(
            t.model, t.tokenizer, t.dims, {"input": inputs}, labels
        )
    with record_function("bench::forward"):
        pred = t.model(inputs, **extra_inputs, **extra_kwargs)
    with record_function("bench::loss"):
        loss = t.loss_fn(pred, labels) / t.global_tokens
    del pred
    loss.backward()
    with record_function("bench::clip_grad_norm"):
        clip_grad_norm_(list(t.model.parameters()), max_norm=1.0, foreach=True)
    t.optimizers.step()
    t.optimizers.zero_grad()
    return loss.detach()


class TimedSteps(NamedTuple):
    seconds: list[float]  # each timed step, synchronized before and after; slowest rank
    host_seconds: list[float]  # until the step's call returned; slowest rank
    losses: list[torch.Tensor]  # every step's, warm-up included


def timed_steps(
    rt: Runtime, step: Callable[[int], torch.Tensor], warmup: int, steps: int
) -> TimedSteps:
    """Run `warmup` then `steps` steps and time the timed ones. Peak memory counts from the
    first timed step. A step's host time ends when its call returns, when the host has
    launched all of it: close to the step time, the GPU waited for the host.

    Python's collector is paused while timing, as torchtitan's trainer does, so a collection
    does not land in one step at random.
    """
    seconds, host_seconds, losses = [], [], []
    gc.collect()
    gc.disable()
    try:
        for index in range(warmup + steps):
            if index == warmup:
                rt.reset_peak_memory()
            rt.synchronize()
            start = time.perf_counter()
            losses.append(step(index))
            returned = time.perf_counter()
            rt.synchronize()
            if index >= warmup:
                seconds.append(time.perf_counter() - start)
                host_seconds.append(returned - start)
    finally:
        gc.enable()
    return TimedSteps(rt.reduce(seconds), rt.reduce(host_seconds), losses)


def global_losses(rt: Runtime, losses: list[torch.Tensor]) -> list[float]:
    # Each rank's loss is its tokens' share of the global mean: the sum is the step's loss.
    if not losses:
        return []
    total = torch.stack(losses).float()
    dist.all_reduce(total)
    return [round(x, 5) for x in total.tolist()]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def guarded(rt: Runtime, work: Callable[[], dict]) -> dict:
    """`work()`'s record, or {"status": "oom"} on every rank when any rank ran out of memory.

    Memory is freed before the ranks agree: the failed step's tensors are referenced only by
    the exception's frames, which are gone once the except block ends. An OOM that strikes one
    rank alone, mid-step, leaves the others in a collective this agreement cannot reach; the
    collective timeout (--pg-timeout-s) ends that run, and memory.py runs every trial in a
    fresh process for this reason.
    """
    record: dict = {}
    failure, site = None, []
    try:
        record = work()
    except Exception as error:  # noqa: BLE001 - anything but OOM is re-raised
        if not is_out_of_memory(error):
            raise
        failure = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        site = oom_site(error)
        # In the log too: if the other ranks never reach the agreement below, the log is
        # what tells memory.py that this trial ran out of memory.
        print(f"[rank {rt.rank}] out of memory: {failure}", file=sys.stderr, flush=True)
        print("\n".join(f"[rank {rt.rank}]   at {line}" for line in site), file=sys.stderr)
    finally:
        rt.free_memory()
    if rt.any_rank(failure is not None):
        oom = {"status": "oom", "error": failure or "out of memory on another rank"}
        return {**oom, "oom_site": site} if site else oom
    return {"status": "ok", **record}


def oom_site(error: BaseException, frames: int = 8) -> list[str]:
    """Where an allocation failed: the innermost frames of the error, innermost last. In code
    that inductor generated, the frame's line is a kernel call or an allocation; the graph
    nodes it computes are named in the comment above it."""
    site = []
    for frame in traceback.extract_tb(error.__traceback__)[-frames:]:
        where = f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
        line = f"{where}: {(frame.line or '').strip()[:100]}"
        nodes = _generated_code_nodes(frame.filename, frame.lineno)
        site.append(f"{line} [{nodes}]" if nodes else line)
    return site


def _generated_code_nodes(filename: str, lineno: int, search: int = 40) -> str:
    for back in range(1, min(search, lineno)):
        text = linecache.getline(filename, lineno - back)
        if "Source Nodes:" in text:
            return text.split("Source Nodes:", 1)[1].strip()[:200]
    return ""


# ---------------------------------------------------------------------------------------------
# Records and output


def environment(rt: Runtime, module: str) -> dict:
    """Hardware, versions and the exact command, for the report."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name, dist_name in (
        ("torchtitan", "torchtitan"),
        ("triton", "triton"),
        ("fla", "flash-linear-attention"),
        ("fla_core", "fla-core"),
        ("transformers", "transformers"),
        ("causal_conv1d", "causal-conv1d"),
    ):
        try:
            versions[name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    hardware: dict[str, Any] = {"device": rt.device_name(), "processes": rt.world_size}
    if rt.cuda:
        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        hardware["memory_gib"] = round(
            torch.cuda.get_device_properties(rt.device).total_memory / GIB, 1
        )
    hardware["cpus"] = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(module, rt.world_size),
        "git": _git_state(),
        "hardware": hardware,
        "versions": versions,
        "env": {
            key: value
            for key, value in sorted(os.environ.items())
            if key in ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
            or key.startswith(("NCCL_", "TORCH_NCCL_"))
        },
    }


def _git_state() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    if not commit:  # an exported tree (git archive) has no history: its exporter names it
        return {"commit": os.environ.get("TITAN_GDN_COMMIT"), "dirty": None}
    dirty = git("status", "--porcelain", "--", "titan_gdn", "benchmarks")
    return {"commit": commit, "dirty": bool(dirty)}


def config_dict(run: RunConfig) -> dict:
    return asdict(run)
