"""Training entry point of each rank: ``torchrun ... -m titan_gdn.train --job.config_file X
[overrides]``, which ``run_train.sh`` launches.

The same as ``python -m torchtitan.train``, except that a rank started by torchrun ends when
its launcher dies, that Ctrl-C or SIGTERM ends it with one line and the shell's exit status
(see :mod:`titan_gdn.stop_signals`), that the device is settled first, so that a machine
without an accelerator trains on CPU + gloo (see :mod:`titan_gdn.cpu`), and that the config
file's section and key names are checked before anything starts (see
:mod:`titan_gdn.config_check`), and that start-up records a user cannot act on stay off the
console (see :class:`titan_gdn.trainer.QuietConsole`).
"""

import ctypes
import os
import signal
import sys
import warnings

from titan_gdn.config_check import check_config_file
from titan_gdn.cpu import use_cpu_if_no_accelerator
from titan_gdn.stop_signals import (
    exit_stopped,
    exit_without_teardown,
    received,
    remove_torchrun_error_file,
    stop_on_signals,
)


def quiet_known_warnings(on_cpu: bool) -> None:
    """Python warnings every run printed with nothing for the user to do about them."""
    # torchdata's StatefulDataLoader calls the deprecated torch.set_vital itself.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    # torchtitan sets its training timeout on every mesh group (distributed/utils.py:
    # set_pg_timeouts), the placeholder groups of unused dimensions too, which have torch's fake
    # backend (distributed/parallel_dims.py: unflatten_mesh) and run no collective; torch warns
    # for each of them.
    warnings.filterwarnings(
        "ignore",
        message="Set timeout is now only supported for either nccl or gloo",
        module="torchtitan.distributed.utils",
    )
    if on_cpu:
        # torchtitan opens an autocast context for float32 training too; CPU autocast then
        # says it disables itself, which float32 wants anyway.
        warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
        # DTensor keeps no RNG offsets on a CPU mesh: a random op draws each shard from the
        # process's generator, which torchtitan seeds alike on every rank. A user cannot change
        # that; runs that must start from equal weights in different layouts start from a seed
        # checkpoint (docs/checkpoints.md).
        warnings.filterwarnings(
            "ignore",
            message=r"DTensor (random operators|manual_seed\(\)) may not have complete support "
            "on cpu device mesh",
        )


# linux/prctl.h
_PR_SET_PDEATHSIG = 1


def end_with_launcher() -> None:
    """Under torchrun, die (SIGKILL) when the launcher does.

    torchrun starts each rank in a session of its own, so a SIGKILL of torchrun, of
    run_train.sh or of their process group never reaches the ranks: they would go on training,
    writing checkpoints into the folder a rerun uses, and holding their GPU. The kernel's
    parent-death signal does reach them (torchrun's agent is the ranks' parent)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    end_with_launcher()
    stop_on_signals()
    try:
        train()
    except BaseException:
        if received() is None:
            raise
        exit_stopped()  # one line on each rank (run_train.sh shows rank 0's), not a traceback
    exit_without_teardown(0)


def train() -> None:
    # Before torchtitan.train is imported: it and its imports copy the device at import time.
    on_cpu = use_cpu_if_no_accelerator()
    quiet_known_warnings(on_cpu)
    # A typo in the TOML stops here, named, before the process group and the model exist.
    check_config_file(sys.argv[1:])
    if "LOCAL_RANK" not in os.environ:
        # torchtitan reads the rank from torchrun's environment (a KeyError without it): the
        # config is checked as for one process, then the way to launch is named.
        from titan_gdn.validation import main as check_config

        if check_config(["--world-size", "1", *sys.argv[1:]]) != 0:
            raise SystemExit(1)
        raise SystemExit(
            "titan_gdn.train runs as a rank started by torchrun: launch "
            "`CONFIG_FILE=X ./run_train.sh [overrides]` (NGPU=1 for one process), or "
            "`torchrun --nproc_per_node N -m titan_gdn.train --job.config_file X [overrides]`"
        )
    from torchtitan.tools.logging import logger
    from torchtitan.train import main as torchtitan_main

    from titan_gdn.checkpoint import CheckpointDamageError, CheckpointWriteError
    from titan_gdn.loss_guard import NonFiniteLossError
    from titan_gdn.metrics import MetricsLoggerError
    from titan_gdn.trainer import QUIET_CONSOLE, Qwen35Trainer
    from titan_gdn.validation import ConfigError

    # On torchtitan's (root) logger itself: its init_logger replaces handlers, not filters.
    logger.addFilter(QUIET_CONSOLE)

    # torchtitan's own main: init_logger, ConfigManager().parse_args(), Trainer, train,
    # close, destroy_process_group.
    try:
        torchtitan_main(Qwen35Trainer)
    except (
        ConfigError,
        MetricsLoggerError,
        NonFiniteLossError,
        CheckpointDamageError,
        CheckpointWriteError,
    ) as error:
        # Each message says what happened and what to do; a traceback adds nothing.
        remove_torchrun_error_file()
        raise SystemExit(str(error)) from None


if __name__ == "__main__":
    main()
