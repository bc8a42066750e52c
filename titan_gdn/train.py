"""Training entry point: ``python -m titan_gdn.train --job.config_file X [overrides]``.

The same as ``python -m torchtitan.train``, except that the device is settled first, so that a
machine without an accelerator trains on CPU + gloo (see :mod:`titan_gdn.cpu`), and that the
config file's section and key names are checked before anything starts (see
:mod:`titan_gdn.config_check`).
"""

import sys

from titan_gdn.config_check import check_config_file
from titan_gdn.cpu import use_cpu_if_no_accelerator


def main() -> None:
    # Before torchtitan.train is imported: it and its imports copy the device at import time.
    use_cpu_if_no_accelerator()
    # A typo in the TOML stops here, named, before the process group and the model exist.
    check_config_file(sys.argv[1:])
    from torchtitan.train import main as torchtitan_main

    from titan_gdn.trainer import Qwen35Trainer

    # torchtitan's own main: init_logger, ConfigManager().parse_args(), Trainer, train,
    # close, destroy_process_group.
    torchtitan_main(Qwen35Trainer)


if __name__ == "__main__":
    main()
