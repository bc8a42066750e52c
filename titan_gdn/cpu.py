"""Make torchtitan 0.2.2 train on CPU + gloo when the machine has no accelerator.

torchtitan decides its device once, at import (``tools.utils.get_device_info``, called at
module level), and falls back to ``"cuda"`` when nothing is found; modules copy that decision
into their own globals. :func:`use_cpu_if_no_accelerator` changes nothing when an accelerator
is present; otherwise it

- repoints every loaded ``torchtitan*`` module's ``device_type``/``device_module`` copy at
  ``"cpu"`` and at a CPU device module (``tools.utils`` and the modules that import its pair:
  ``distributed.parallel_dims``, ``distributed.utils``, ``components.metrics``,
  ``tools.profiling``), and makes ``get_device_info`` answer CPU for modules imported later
  (``distributed.dual_pipe_v`` calls it at import);
- gives that device module what ``torch.cpu`` lacks: ``get_device_name``,
  ``get_device_properties`` (physical RAM), ``memory_stats`` (peak RSS), ``reset_peak_memory_stats``
  and ``empty_cache`` for the memory monitor (``components.metrics.DeviceMemoryMonitor``), and
  an integer ``current_device`` for the pg-timeout barrier (``distributed.utils.set_pg_timeouts``);
- answers NaN for the peak FLOPS (``tools.utils.get_peak_flops``): torchtitan's probe would run
  ``lspci`` (absent on most machines, a warning each time) and then assume an A100; NaN tells
  :mod:`titan_gdn.metrics` that no MFU can be computed;
- drops the duplicate CPU backend that ``training.enable_cpu_offload`` requests
  (``distributed.utils.init_distributed``);
- lets expert parallel's token permutation (``models/moe/utils.py:_permute``) take
  ``generate_permute_indices``' CPU path, which it has but ``_permute`` never asks for (its
  default is a Triton kernel).

FSDP's ``PREMUL_SUM`` gradient reduction, which gloo lacks, is avoided where FSDP is applied:
``titan_gdn.parallel.parallelize``.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from types import SimpleNamespace

import torch
from torch._utils import _get_available_device_type

_CPU_ACTIVE = False
_GIB = 1024**3


def _peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (Linux VmHWM; else getrusage)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # ru_maxrss is KiB on Linux and bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so peaks become per log interval.
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _memory_stats(device=None) -> dict[str, int]:
    # Peak RSS stands in for both the "active" and the "reserved" peaks; CPUs have no
    # allocator retries or OOM counter.
    peak = _peak_rss_bytes()
    return {
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.peak": peak,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


class _CpuDeviceModule:
    """``torch.cpu`` plus the ``torch.cuda``-style calls torchtitan makes on its device module."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        # An index, not torch.cpu's "cpu": set_pg_timeouts passes it to barrier(device_ids=[...]).
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU {platform.processor() or platform.machine()}".strip()

    @staticmethod
    def get_device_properties(device=None) -> SimpleNamespace:
        # The memory monitor divides by total_memory; 0 would crash, so fall back to 1 GiB.
        return SimpleNamespace(total_memory=_physical_memory_bytes() or _GIB)

    memory_stats = staticmethod(_memory_stats)
    reset_peak_memory_stats = staticmethod(_reset_peak_rss)

    @staticmethod
    def empty_cache() -> None:
        return None


def _no_peak_flops(device_name: str) -> float:
    return float("nan")


def _skip_cpu_offload_backend(dist_utils) -> None:
    init_distributed = dist_utils.init_distributed

    # training.enable_cpu_offload asks for "cpu:gloo,cpu:gloo" here (the backend string that
    # init_distributed builds), which c10d rejects as a duplicate; gloo already serves CPU tensors.
    def init_distributed_on_cpu(comm_config, enable_cpu_backend=False, **kwargs):
        return init_distributed(comm_config, False, **kwargs)

    dist_utils.init_distributed = init_distributed_on_cpu


def _permute_indices_on_cpu(moe_utils) -> None:
    generate = moe_utils.generate_permute_indices

    def generate_on_the_tensors_device(tokens_per_expert_group, *args, **kwargs):
        kwargs.setdefault("use_cpu", tokens_per_expert_group.device.type == "cpu")
        return generate(tokens_per_expert_group, *args, **kwargs)

    moe_utils.generate_permute_indices = generate_on_the_tensors_device


def _rebind(stale_type: str, stale_module, device_module) -> None:
    """Point every torchtitan module-level copy of the device at the CPU."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torchtitan"):
            continue
        if getattr(module, "device_type", None) == stale_type:
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is stale_module:
            module.device_module = device_module


def use_cpu_if_no_accelerator() -> bool:
    """Run torchtitan on CPU + gloo when no accelerator is present; return True if it does.

    Idempotent. Modules imported later read the patched ``torchtitan.tools.utils`` values,
    so call it before importing ``torchtitan.train``.
    """
    global _CPU_ACTIVE
    if _CPU_ACTIVE:
        return True
    if _get_available_device_type() is not None:
        return False
    from torchtitan.tools import utils as tt_utils

    stale_type, stale_module = tt_utils.device_type, tt_utils.device_module
    device_module = _CpuDeviceModule()
    # dual_pipe_v.py calls get_device_info() at import, so the function must answer CPU too.
    tt_utils.get_device_info = lambda: ("cpu", device_module)
    # Read through the module (metrics.py and train.py call utils.get_peak_flops).
    tt_utils.get_peak_flops = _no_peak_flops
    # Copies taken at import: tools/utils, distributed/{parallel_dims,utils}, components/metrics,
    # tools/profiling (and any other torchtitan module already loaded).
    _rebind(stale_type, stale_module, device_module)
    from torchtitan.distributed import utils as dist_utils

    _skip_cpu_offload_backend(dist_utils)
    from torchtitan.models.moe import utils as moe_utils

    _permute_indices_on_cpu(moe_utils)
    _CPU_ACTIVE = True
    return True


def exchange_shards_by_all_to_all() -> None:
    """Make DTensor's Shard(i) -> Shard(j) on a CPU mesh run the all-to-all it runs on GPUs.

    On a CPU mesh, torch (2.11 to 2.13, `distributed/tensor/_collective_utils.py`,
    `shard_dim_alltoall`) gathers the whole tensor on every rank and keeps a chunk ("Gloo does
    not support alltoall"), though gloo has had the all-to-all that the op
    `_dtensor.shard_dim_alltoall` calls: the fallback holds N shards where one is needed, and
    would make CPU runs test other ops (an all-gather, a separate wait) than GPUs run. Its
    caller, `placement_types.Shard._to_new_shard_dim`, reads the function by name from its
    own module globals; that binding is replaced by the same function without the fallback.
    Idempotent; CUDA meshes are unaffected (they never took the fallback).
    """
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.tensor import placement_types

    if getattr(placement_types.shard_dim_alltoall, "_all_to_all_on_cpu", False):
        return

    def shard_dim_alltoall(input, gather_dim, shard_dim, mesh, mesh_dim):
        group_name = funcol._resolve_group_name((mesh, mesh_dim))
        return torch.ops._dtensor.shard_dim_alltoall(input, gather_dim, shard_dim, group_name)

    shard_dim_alltoall._all_to_all_on_cpu = True
    placement_types.shard_dim_alltoall = shard_dim_alltoall
