"""One GPU shared by concurrent test processes (`pytest -n`), and taken alone when a test needs it.

The GPU suite runs its files in several worker processes on one device: most of its time is
compiling on the host (Inductor, Triton), which the workers do side by side. Every GPU test
shares the device; a test that measures the whole device (its free memory, kernel time against
wall time) runs alone, because another process's allocations or kernels would change what it
measures. The lock is a file lock in the system's temporary folder, so pytest runs started
separately on the same machine share it too.

Writer-preferring: a test waiting to run alone holds a turnstile that every test passes
through first, so no new test starts on the device while it waits (a plain shared/exclusive
lock would let the other workers' tests keep it shared until they all finish).
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Iterator
from pathlib import Path

DEFAULT_FOLDER = Path(tempfile.gettempdir())
TURNSTILE, DEVICE = "titan_gdn_gpu_tests.turnstile", "titan_gdn_gpu_tests.lock"


@contextlib.contextmanager
def holding_device(alone: bool, folder: Path = DEFAULT_FOLDER) -> Iterator[None]:
    """Hold the device shared with other tests, or alone (`alone=True`), until the block ends."""
    with open(folder / TURNSTILE, "a") as turnstile, open(folder / DEVICE, "a") as device:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(device, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(device, fcntl.LOCK_UN)
