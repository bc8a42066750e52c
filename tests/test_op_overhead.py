"""scripts/op_overhead.py on CPU: each op is timed through the dispatcher and directly."""

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_op_overhead_times_each_op_and_its_body(tmp_path):
    out = tmp_path / "overhead.json"
    command = [sys.executable, "scripts/op_overhead.py", "--tokens", "64", "--calls", "3"]
    result = subprocess.run(
        [*command, "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [row["case"] for row in data["rows"]] == ["conv (torch)", "delta rule (torch)"]
    for row in data["rows"]:
        for timing in (row["op"], row["body"]):
            assert 0 < timing["host_us"] <= timing["wall_us"]
    assert "op - body" in result.stdout
