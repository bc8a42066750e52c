"""What the throughput and memory benchmarks share: the process group, the trainer of
`run_train.sh` built for one configuration, rows for the references, out-of-memory handling,
JSON records.

Every measured step is the trainer's own (benchmarks/timed_trainer.py): the configuration is a
TOML config plus `run_train.sh` overrides (`trainer_arguments`), so what is measured is what a
user runs. One process builds, trains and frees one trainer per configuration in turn; the
process group is made once and torchtitan's setup reuses it.
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
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import corpora
from benchmarks.records import OOM_MESSAGES, REPO_ROOT, command_line
from titan_gdn.cpu import use_cpu_if_no_accelerator
from titan_gdn.ops.local_memory import outside_allocator_gib

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
    config: str | None = None  # None: each flavor's shipped config (SHIPPED_CONFIGS)
    compile: str = "config"  # "config" (as the config says), "none", or a backend name
    corpus: str = "short"  # the rows' document lengths: benchmarks/corpora.py
    overrides: tuple[str, ...] = ()  # more run_train.sh arguments, appended last


def options_from_args(args: argparse.Namespace) -> Options:
    overrides = []
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise SystemExit(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides += _cli_setting(key, value)
    return Options(
        steps=args.steps,
        warmup=args.warmup,
        config=args.config,
        compile=args.compile,
        corpus=args.corpus,
        overrides=tuple(overrides),
    )


def _cli_setting(key: str, value: str) -> list[str]:
    """`key=value` as run_train.sh takes it: booleans are flags (--x.y / --x.no-y)."""
    section, _, name = key.rpartition(".")
    if value.lower() in ("true", "false"):
        prefix = "" if value.lower() == "true" else "no-"
        return [f"--{section}.{prefix}{name}"]
    return [f"--{key}", value]


# ---------------------------------------------------------------------------------------------
# Process group and device


@dataclass
class Runtime:
    device: torch.device
    rank: int
    world_size: int
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

    def leave(self, finished: bool) -> None:
        """Destroy the process group. After a finished run the ranks first meet (rank 0 may
        still be writing its JSON) and free what is left to the garbage collector, so that no
        rank tears its group down while another still uses its own, and interpreter teardown
        frees no tensor that a collective touched: a complete 2-process gloo run once ended
        with one rank aborting (SIGABRT) at exit. After a failure the other ranks may be inside
        another collective, so there is no meeting to wait for."""
        if finished:
            self.barrier()
            self.synchronize()
            self.free_memory()
            self.barrier()
        dist.destroy_process_group()

    def device_name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name(self.device)
        return f"CPU {platform.machine()}"


def run_as_command(main: Callable[[], None]) -> None:
    """A multi-process benchmark's command: `main`, then, once it has returned (its results
    written, its process group destroyed), the process ends without interpreter teardown. A
    complete 2-process gloo run still ended, now and then, with one rank aborting there
    ("terminate called without an active exception", no Python frame): a gloo worker thread
    met the teardown, and torchrun reported the finished run as failed."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _device_module():
    # Looked up per call: titan_gdn.cpu rebinds it to a CPU module when there is no GPU.
    from torchtitan.tools import utils

    return utils.device_module


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


def load_tokenizer(job):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(job.model.hf_assets_path)


# ---------------------------------------------------------------------------------------------
# The trainer, as run_train.sh builds it

CONFIG_DIR = REPO_ROOT / "train_configs"
SHIPPED_CONFIGS = {
    "debugmodel": "debug_model.toml",
    "0.8B": "qwen3_5_0.8b.toml",
    "2B": "qwen3_5_2b.toml",
    "debugmoe": "debug_moe.toml",
    "35B-A3B-4layers": "qwen3_5_35b_a3b_4layers.toml",
}
BENCHMARK_DUMP_FOLDER = REPO_ROOT / "outputs" / "benchmarks"


def config_file(flavor: str, opts: Options) -> str:
    if opts.config is not None:
        return opts.config
    if flavor not in SHIPPED_CONFIGS:
        raise SystemExit(f"no shipped config for flavor {flavor!r}: pass --config FILE")
    return str((CONFIG_DIR / SHIPPED_CONFIGS[flavor]).relative_to(REPO_ROOT))


def trainer_arguments(run: RunConfig, opts: Options) -> list[str]:
    """The run_train.sh arguments that train `run`: the config file, the configuration's
    settings, and what a measurement changes (no checkpoints, no TensorBoard files, its own
    dump folder). Every one is a setting a user can write too."""
    arguments = ["--job.config_file", config_file(run.flavor, opts)]
    arguments += ["--model.flavor", run.flavor, "--training.seq_len", str(run.seq_len)]
    arguments += ["--parallelism.context_parallel_degree", str(run.cp)]
    arguments += ["--activation_checkpoint.mode", run.ac_mode]
    if run.ac_option is not None:
        arguments += ["--activation_checkpoint.selective_ac_option", run.ac_option]
    if run.seq_len > _flavor_max_seq_len(run.flavor):
        arguments += ["--model.max_seq_len", str(run.seq_len)]
    if opts.compile == "none":
        arguments += ["--compile.no-enable"]
    elif opts.compile != "config":
        arguments += ["--compile.enable", "--compile.backend", opts.compile]
    arguments += ["--checkpoint.no-enable", "--metrics.no-enable-tensorboard"]
    arguments += ["--job.dump_folder", str(BENCHMARK_DUMP_FOLDER)]
    return arguments + corpora.trainer_settings(opts.corpus) + list(opts.overrides)


def _flavor_max_seq_len(flavor: str) -> int:
    from titan_gdn.model import qwen3_5_args

    return qwen3_5_args[flavor].max_seq_len if flavor in qwen3_5_args else 2**62


def trainer_job_config(run: RunConfig, opts: Options):
    """The JobConfig that `run_train.sh <trainer_arguments>` trains with."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(trainer_arguments(run, opts))


def model_args(job):
    """The model args the trainer builds for `job` (its checks, with their messages)."""
    from titan_gdn.model import qwen3_5_args

    args = copy.deepcopy(qwen3_5_args[job.model.flavor])
    args.update_from_config(job)
    return args


def build_trainer(run: RunConfig, opts: Options, rt: Runtime, profiled_step=None):
    """The trainer of `run`, stopping after opts.warmup + opts.steps timed steps (and one
    profiled step with `profiled_step`, a context-manager factory taking the trainer)."""
    from benchmarks.timed_trainer import TimedTrainer

    return TimedTrainer(
        trainer_job_config(run, opts),
        warmup=opts.warmup,
        steps=opts.steps,
        synchronize=rt.synchronize,
        reset_peak_memory=rt.reset_peak_memory,
        profiled_step=profiled_step,
    )


def trained(rt: Runtime, trainer) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """Train `trainer` (its own train loop); each timed step's seconds and host seconds on
    the slowest rank, and the warm-up and timed steps' losses."""
    try:
        trainer.train()
    finally:
        trainer.close()
    seconds, host_seconds = rt.reduce(trainer.step_seconds), rt.reduce(trainer.host_seconds)
    return seconds, host_seconds, trainer.measured_losses()


# ---------------------------------------------------------------------------------------------
# Packed rows for the references


def make_batches(
    job, tokenizer, seq_len: int, count: int, dp_rank: int, dp_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` rows (inputs, labels), each [1, seq_len], of data-parallel rank `dp_rank`, from
    the job's dataset packed as the trainer's loader packs it."""
    from titan_gdn.data import PackedDocumentDataset, build_document_source

    training = job.training
    dataset = PackedDocumentDataset(
        build_document_source(training.dataset, training.dataset_path),
        tokenizer,
        seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_size,
        infinite=True,
    )
    rows = itertools.islice(iter(dataset), count)
    return [(sample["input"][None], labels[None]) for sample, labels in rows]


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


def one_device_environment(device: torch.device, module: str) -> dict:
    """`environment` for a benchmark that runs in this one process on `device`, without a
    process group: a one-rank `Runtime` describes it."""
    return environment(Runtime(device=device, rank=0, world_size=1), module)


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
