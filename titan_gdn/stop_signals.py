"""Ctrl-C and SIGTERM end a run with one line that says where it stopped and how it resumes,
and the shell's exit status (130, 143): not a traceback of whatever the rank was doing and
torchrun's status 1, which read like a crash.

A rank takes SIGINT, SIGTERM and SIGHUP (torchrun passes the one it gets on to its ranks; a
scheduler such as Slurm may signal every process itself): the first raises :class:`Stopped`
where the rank is, later ones are ignored so the stop is not itself interrupted. Once a signal
has arrived any error counts as the stop: a rank waiting in a collective for a peer that has
already stopped fails with a connection error."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: signal.Signals | None = None
_progress: Callable[[], tuple[int, str]] | None = None
_close: Callable[[], None] | None = None


class Stopped(BaseException):
    """Raised where the rank is when the first signal arrives (a BaseException, as
    KeyboardInterrupt is: no ``except Exception`` on the way handles it as an error)."""


def _stop(signum: int, frame) -> None:
    global _received
    if _received is not None:
        return
    _received = signal.Signals(signum)
    raise Stopped(_received.name)


def stop_on_signals() -> None:
    """Install the handlers (the rank's main thread, before anything long starts)."""
    for signum in SIGNALS:
        signal.signal(signum, _stop)


def received() -> signal.Signals | None:
    """The signal that stopped the run, or None."""
    return _received


def exit_status(signum: signal.Signals) -> int:
    return 128 + signum  # what a shell reports for a process that the signal ended


def report_progress_with(progress: Callable[[], tuple[int, str]], close: Callable[[], None]):
    """The trainer's, once it exists: `progress()` -> (the step in progress, 0 before the
    first; how a rerun resumes) for the stop's line; `close()` flushes what it logs."""
    global _progress, _close
    _progress, _close = progress, close


def stop_line(signum: signal.Signals) -> str:
    step, resume = _progress() if _progress is not None else (0, "")
    where = f"during step {step}" if step > 0 else "before the first step"
    return f"titan_gdn: stopped by {signum.name} {where}" + (f"; {resume}" if resume else "")


def exit_stopped() -> NoReturn:
    """Print the stop's line, flush the metrics, and end the process with the shell's status.

    `os._exit`, not SystemExit: the interpreter's teardown with the process group still up
    crashed (SIGSEGV, SIGABRT in gloo's threads), and it resets the signal handlers, so the
    launcher's SIGTERM to the ranks still alive killed them mid-way."""
    signum = received()
    print(stop_line(signum), file=sys.stderr, flush=True)
    # @record writes the error that the stop raised, and the signal may cut that write short:
    # torchrun's launcher then fails parsing an empty file. The stop is not an error.
    remove_torchrun_error_file()
    if _close is not None:
        with contextlib.suppress(Exception):
            _close()
    exit_without_teardown(exit_status(signum))


def remove_torchrun_error_file() -> None:
    """Remove what torch's @record (around torchtitan's train) wrote, or began to write, to
    torchrun's error file for its summary, where the rank's own line says what happened."""
    with contextlib.suppress(KeyError, FileNotFoundError):
        os.remove(os.environ["TORCHELASTIC_ERROR_FILE"])


def exit_without_teardown(status: int) -> NoReturn:
    """End the process with `status` once its work is done and written: the interpreter's
    teardown, after torch's compile machinery is imported (torchtitan imports it), spends
    1-2 s of CPU freeing objects that the process's end frees anyway, in the launcher and in
    every rank, and in a rank it could crash in gloo's threads (see exit_stopped)."""
    logging.shutdown()  # flush and close the log handlers (torchtitan's, torchrun's)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
