"""benchmarks/host_profile.py on CPU: the step timings and both threads' profiles are written."""

import re
import subprocess
import sys

from tests.conftest import copy_checkout


def test_host_profile_times_the_step_and_profiles_forward_and_backward(tmp_path):
    out = tmp_path / "host.txt"
    # In a copy: the script's trainer writes its dump folder under its own root.
    checkout = tmp_path / "repo"
    copy_checkout(checkout)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    command += ["1", "-m", "benchmarks.host_profile", "--flavor", "debugmodel", "--seq-len", "64"]
    command += ["--ac", "none", "--compile", "none", "--out", str(out)]
    result = subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    text = out.read_text()
    step_ms, host_ms = map(
        float, re.search(r"step ([\d.]+) ms, host .* ([\d.]+) ms", text).groups()
    )
    assert 0 < host_ms <= step_ms
    sampled, profiled = text.split("=== main thread")
    assert "--- MainThread:" in sampled and "(train_step)" in sampled
    main, backward = profiled.split("=== backward")
    # Each profile holds its part of the step: the ops' backward runs in the second.
    assert "custom_op.py:" in backward and "(backward_impl)" in backward
    assert "(train_step)" in main
