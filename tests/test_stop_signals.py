"""A rank stopped by a signal leaves torchrun nothing to misread.

The signal that stops one rank often arrives while another is already failing (its peer died,
so its collective raised): torch's @record is then writing that error to torchrun's error file,
and the stop cuts the write short. torchrun's launcher then fails parsing the empty file: a
JSONDecodeError traceback instead of its summary of the rank that died."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

REPO = Path(__file__).resolve().parents[1]

# The rank's real entry point (titan_gdn.train.main) with a train() that fails under @record,
# as torchtitan's does, and a SIGTERM that arrives once @record has opened the error file.
RANK = textwrap.dedent(
    """
    import json, os, signal
    from torch.distributed.elastic.multiprocessing.errors import record
    import titan_gdn.train as rank

    write = json.dump

    def interrupted_write(data, fp, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before a byte is written
        write(data, fp, **kwargs)

    json.dump = interrupted_write

    @record
    def train():
        raise RuntimeError("Connection closed by peer")

    rank.train = train
    rank.main()
    """
)


def _run_rank(script: str, error_file: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_rank_stopped_while_its_error_is_recorded_leaves_no_error_file(tmp_path):
    error_file = tmp_path / "error.json"
    run = _run_rank(RANK, error_file)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert "titan_gdn: stopped by SIGTERM before the first step" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert not error_file.exists(), error_file.read_text()
    # What torchrun's launcher builds for the rank: its own message, no parse of a cut file.
    failure = ProcessFailure(local_rank=1, pid=4321, exitcode=-15, error_file=str(error_file))
    assert "SIGTERM" in failure.message, failure.message


def test_an_error_without_a_stop_is_still_recorded_for_torchrun(tmp_path):
    """The error file is removed for a stop only: a rank's own failure keeps torchrun's record."""
    error_file = tmp_path / "error.json"
    run = _run_rank(RANK.replace("os.kill(os.getpid(), signal.SIGTERM)", "pass"), error_file)
    assert run.returncode == 1, run.stderr
    recorded = json.loads(error_file.read_text())
    assert recorded["message"]["message"] == "RuntimeError: Connection closed by peer"
