"""scripts/gpu_session.sh, the prepared device run, on a machine without a GPU: every step runs, writes its file and
reports its exit status, and the benchmark's last line is its JSON (here: no device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_session_script_writes_each_steps_files(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "TESTS_S": "120", "BENCH_S": "120"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_session.sh")], env=env, capture_output=True, text=True,
                          check=False,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    versions = (tmp_path / "versions.txt").read_text()
    assert "torch" in versions and "bench/gpu.py: exit 0" in versions and "triton tests: exit 0" in versions
    last = (tmp_path / "gpu.json").read_text().strip().splitlines()[-1]
    assert json.loads(last)["bench"] == "gpu"
    assert "passed" in (tmp_path / "tests.log").read_text() or "skipped" in (tmp_path / "tests.log").read_text()
