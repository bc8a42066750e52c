"""run_train.sh's launcher: the config check, then torchrun, both in this process, except that
a stop by a signal (Ctrl-C, SIGTERM) ends in one line and the shell's exit status (130, 143),
not torchrun's traceback and status 1 (its ranks print where they stopped:
:mod:`titan_gdn.stop_signals`), and that a failed run ends with torchrun's report of its ranks,
not the launcher's traceback.

    python titan_gdn/launch.py [--check WORLD_SIZE] [torchrun's arguments] \
        -m titan_gdn.train [the trainer's arguments]

`--check N`: the trainer's arguments are checked first (:func:`titan_gdn.validation.main`, for N
ranks), so a mistake is named in a few lines before any rank starts. In this process, not one of
its own: the check needs torchtitan's import (seconds), and the launcher would import it again.

Run by path, not with ``-m``: ``-m`` imports the package first (torchtitan with it), and this
file's handler for Ctrl-C must be in place before that, so that a stop during the check is one
line too.
"""

from __future__ import annotations

import os
import signal
import sys


def _stopped_in_check(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    print(f"run_train.sh: stopped by {name} during the config check; no rank was started",
          file=sys.stderr, flush=True)  # fmt: skip
    # stop_signals.exit_status's status, written out: the package is not imported yet.
    os._exit(128 + signum)  # nothing has started that needs an orderly end


if __name__ == "__main__":
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _stopped_in_check)
    # Run by path, Python put this folder first on the path, where the package's modules
    # (train, metrics, ...) would stand for top-level modules of those names.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = os.path.dirname(sys.path[0])

import logging  # noqa: E402

from titan_gdn.stop_signals import SIGNALS, exit_status, exit_without_teardown  # noqa: E402

# What a rank that a signal stopped exits with: the status it sets, or death by the signal
# (one that came before its handler was set, or the launcher's own to the ranks left).
_STOPPED = {exit_status(signum): signum for signum in SIGNALS} | {-s: s for s in SIGNALS}


def _say_stopped(signum: signal.Signals) -> int:
    print(f"run_train.sh: stopped by {signum.name}; the ranks stopped with it", file=sys.stderr)
    return exit_status(signum)


class _QuietStop(logging.Filter):
    """torchrun's records of a stop by a signal ("Received 2 death signal", "Sending process N
    closing signal SIGINT"): the launcher's line and the ranks' say it. Its records of a rank's
    failure stay."""

    stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Received %s death signal"):
            self.stopping = True
        return not (self.stopping and message.startswith(("Received %s", "Sending process")))


def _trainer_arguments(argv: list[str]) -> list[str]:
    """The arguments after torchrun's ``-m MODULE``: the trainer's."""
    return argv[argv.index("-m") + 2 :]


def _checked(argv: list[str]) -> tuple[int, list[str]]:
    """Run `--check N` if it leads `argv`: (the check's status, 0 without one; the rest of
    `argv`, torchrun's)."""
    if argv[:1] != ["--check"]:
        return 0, argv
    from titan_gdn.validation import main as check

    sys.argv[0] = "run_train.sh"  # the command that argument errors tell to rerun with --help
    return check(["--world-size", argv[1], *_trainer_arguments(argv)]), argv[2:]


def main(argv: list[str] | None = None) -> int:
    status, argv = _checked(sys.argv[1:] if argv is None else argv)
    if status:
        return status
    # From here a signal ends the run as torchrun's handlers and the ranks decide.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    quiet = _QuietStop()
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):  # fmt: skip
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun(argv)
    except SignalException as stop:  # the launcher was signalled: it stopped its ranks
        return _say_stopped(signal.Signals(stop.sigval))
    except KeyboardInterrupt:  # Ctrl-C before the ranks started
        return _say_stopped(signal.SIGINT)
    except ChildFailedError as failed:
        # The ranks were signalled, not the launcher (a scheduler signalling every process):
        # each one that ended said where. Else torchrun's report of the failed ranks (each
        # one's traceback where it left one), without the launcher's own traceback.
        statuses = {failure.exitcode for failure in failed.failures.values()}
        if statuses <= _STOPPED.keys():
            return _say_stopped(_STOPPED[max(statuses)])
        print(failed, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())
