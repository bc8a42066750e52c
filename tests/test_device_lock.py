"""The GPU suite's device lock (tests/device_lock.py), between threads (each opens its own lock
files, so their locks conflict as separate processes' do): tests share the device, a test that
runs alone waits for the others, and no test starts while it waits."""

import fcntl
import threading
import time

from tests.device_lock import TURNSTILE, holding_device

WAIT_S = 10.0


class Holder(threading.Thread):
    """Takes the device (shared or alone), says when it has it, keeps it until released."""

    def __init__(self, folder, alone: bool, log: list[str], name: str):
        super().__init__(daemon=True)
        self.folder, self.alone, self.log, self.label = folder, alone, log, name
        self.holding, self.release = threading.Event(), threading.Event()

    def run(self):
        with holding_device(self.alone, self.folder):
            self.log.append(f"{self.label} in")
            self.holding.set()
            self.release.wait(WAIT_S)
            self.log.append(f"{self.label} out")


def _until(condition) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _turnstile_taken(folder) -> bool:
    with open(folder / TURNSTILE, "a") as turnstile:
        try:
            fcntl.flock(turnstile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        return False


def test_tests_share_the_device(tmp_path):
    log = []
    first, second = Holder(tmp_path, False, log, "a"), Holder(tmp_path, False, log, "b")
    first.start()
    assert first.holding.wait(WAIT_S)
    second.start()
    assert second.holding.wait(WAIT_S), log  # while the first still holds it
    first.release.set(), second.release.set()
    first.join(WAIT_S), second.join(WAIT_S)


def test_a_test_alone_waits_for_the_others_and_no_test_starts_meanwhile(tmp_path):
    log = []
    shared = Holder(tmp_path, False, log, "shared")
    alone = Holder(tmp_path, True, log, "alone")
    later = Holder(tmp_path, False, log, "later")
    shared.start()
    assert shared.holding.wait(WAIT_S)
    alone.start()
    # The test waiting to run alone holds the turnstile: only then does the later test come.
    assert _until(lambda: _turnstile_taken(tmp_path))
    later.start()
    time.sleep(0.2)
    assert log == ["shared in"], log
    shared.release.set()
    assert alone.holding.wait(WAIT_S), log
    time.sleep(0.2)
    assert log == ["shared in", "shared out", "alone in"], log
    alone.release.set()
    assert later.holding.wait(WAIT_S), log
    later.release.set()
    for thread in (shared, alone, later):
        thread.join(WAIT_S)
    assert log == ["shared in", "shared out", "alone in", "alone out", "later in", "later out"]
