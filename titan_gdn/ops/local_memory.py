"""Give back the device memory that kernel autotuning leaves reserved as local memory.

FLA autotunes its Triton kernels the first time a process meets each shape (the choice is then
cached on disk, and later processes skip the tuning). Some configurations it tries spill
registers, and the CUDA driver sizes the context's local-memory reservation for the largest
per-thread stack any launched kernel needed, times every thread the GPU can hold, and keeps it
for the life of the context. On an H200 the delta rule's tuning raises the stack to 26,128
bytes per thread and holds 6.3 GiB outside PyTorch's allocator, enough to make a long cp=2 step
run out of memory on a machine's first run; setting the stack-size limit back frees it
(docs/design.md). Kernels launched later grow the reservation again only as far as they
themselves need.

The ops call `release_after_first_use` after their kernels ran: the first time an op meets a
shape in this process (when tuning may have happened) the limit is read, and reset if it grew.
Later calls cost one set lookup.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torchtitan.tools.logging import logger

DEFAULT_STACK_BYTES = 1024  # CUDA's default stack size per thread
_CU_LIMIT_STACK_SIZE = 0
_seen: set[tuple] = set()


def release_after_first_use(op: str, *tensors: torch.Tensor) -> None:
    """Call after `op`'s kernels ran on `tensors` (on a CUDA device)."""
    device = tensors[0].device
    if device.type != "cuda":
        return
    signature = (op, device, *((tuple(t.shape), t.dtype) for t in tensors))
    if signature in _seen:
        return
    _seen.add(signature)
    driver = _cuda_driver()
    if driver is not None:
        with torch.cuda.device(device):
            reset_stack_limit(driver)


def outside_allocator_gib() -> float:
    """Device memory this process holds outside PyTorch's caching allocator (CUDA context,
    communicators, loaded kernels, local memory), assuming one process per device."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / 2**30


def stack_limit(driver) -> int | None:
    """The current context's stack size per thread in bytes; None if it cannot be read."""
    limit = ctypes.c_size_t()
    if driver.cuCtxGetLimit(ctypes.byref(limit), _CU_LIMIT_STACK_SIZE) != 0:
        return None
    return limit.value


def reset_stack_limit(driver) -> int | None:
    """Set the current context's stack limit back to the default if it grew; returns the size
    it had (bytes per thread) when it was reset, else None."""
    limit = stack_limit(driver)
    if limit is None or limit <= DEFAULT_STACK_BYTES:
        return None
    status = driver.cuCtxSetLimit(_CU_LIMIT_STACK_SIZE, ctypes.c_size_t(DEFAULT_STACK_BYTES))
    if status != 0:
        logger.warning(
            f"could not reset the CUDA stack limit from {limit} to {DEFAULT_STACK_BYTES} "
            f"bytes per thread (CUresult {status}): the local memory that kernel autotuning "
            "reserved stays held until the process ends"
        )
        return None
    logger.info(
        f"kernel autotuning had raised the CUDA stack to {limit} bytes per thread; "
        f"reset to {DEFAULT_STACK_BYTES}, which gives its local-memory reservation back"
    )
    return limit


@functools.cache
def _cuda_driver():
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    driver.cuCtxGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
    driver.cuCtxSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
    return driver
