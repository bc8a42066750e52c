"""Training entry point: ``python -m titan_gdn.train --job.config_file X [overrides]``.

The same as ``python -m torchtitan.train``, except that the device is settled first, so that a
machine without an accelerator trains on CPU + gloo (see :mod:`titan_gdn.cpu`), and that the
config file's section and key names are checked before anything starts (see
:mod:`titan_gdn.config_check`), and that start-up records a user cannot act on stay off the
console (see :class:`titan_gdn.trainer.QuietConsole`).
"""

import sys
import warnings

from titan_gdn.config_check import check_config_file
from titan_gdn.cpu import use_cpu_if_no_accelerator


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


def main() -> None:
    # Before torchtitan.train is imported: it and its imports copy the device at import time.
    on_cpu = use_cpu_if_no_accelerator()
    quiet_known_warnings(on_cpu)
    # A typo in the TOML stops here, named, before the process group and the model exist.
    check_config_file(sys.argv[1:])
    from torchtitan.tools.logging import logger
    from torchtitan.train import main as torchtitan_main

    from titan_gdn.trainer import QUIET_CONSOLE, Qwen35Trainer

    # On torchtitan's (root) logger itself: its init_logger replaces handlers, not filters.
    logger.addFilter(QUIET_CONSOLE)

    # torchtitan's own main: init_logger, ConfigManager().parse_args(), Trainer, train,
    # close, destroy_process_group.
    torchtitan_main(Qwen35Trainer)


if __name__ == "__main__":
    main()
