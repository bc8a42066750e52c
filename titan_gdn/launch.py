"""run_train.sh's launcher: torchrun, run in this process, except that a stop by a signal
(Ctrl-C, SIGTERM) ends in one line and the shell's exit status (130, 143), not torchrun's
traceback and status 1 (its ranks print where they stopped: :mod:`titan_gdn.stop_signals`),
and that a failed run ends with torchrun's report of its ranks, not the launcher's traceback.

    python -m titan_gdn.launch [torchrun's arguments] -m titan_gdn.train [the trainer's]
"""

from __future__ import annotations

import logging
import signal
import sys

from titan_gdn.stop_signals import SIGNALS, exit_status

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


def main(argv: list[str] | None = None) -> int:
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
    sys.exit(main())
