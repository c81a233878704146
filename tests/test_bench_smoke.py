"""The benchmark scripts still run: each one's quick mode, to its JSON line (figures are not checked here; they
are measured by hand and recorded in docs/benchmarks.md). One script at a time, never two PyTorch processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel.kernels import _build

ROOT = Path(__file__).resolve().parents[1]

RUNS = {
    "gemv": (["bench/gemv.py", "--quick", "--shapes", "576x576,1536x576", "--footprint", "1", "--json"],
             {"copy_gbps", "read_gbps", "read_patterns_gbps", "rows", "goals"}),
    "state_update": (["bench/state_update.py", "--quick", "--json"], {"bench", "rows"}),
    "leech_encode": (["bench/leech_encode.py", "--quick", "--json"], {"benchmark", "rows"}),
    "damp": (["bench/damp.py", "--quick", "--fixtures", "tiny-gdn", "--json"], {"bench", "fixtures"}),
}


@pytest.mark.skipif(not _build.compiler_available(), reason="no C compiler for the accel CPU kernels")
@pytest.mark.parametrize("name", list(RUNS))
def test_bench_quick_mode_runs_to_its_json_line(name):
    argv, keys = RUNS[name]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert keys <= set(last), sorted(last)
    rows = last.get("rows") or last.get("fixtures")
    assert rows, "no measured rows"
