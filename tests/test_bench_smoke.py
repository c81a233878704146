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


BAD_ARGS = [
    ["bench/gemv.py", "--threads", "0"],
    ["bench/generate.py", "smollm2-135m", "--tokens", "1"],
    ["bench/generate.py", "/nonexistent/model"],
    ["bench/state_update.py", "--threads", "-3"],
    ["bench/leech_encode.py", "--quick", "--blocks", "0"],
    ["bench/leech_quality.py", "--arms", "foo"],
    ["bench/leech_ablation.py", "--arm", "foo"],
    ["bench/damp.py", "--quick", "--fixtures", "nosuch"],
    ["bench/semkv.py", "--bytes-windows", "0"],
    ["bench/gpu.py", "--shapes", "12x"],
]


@pytest.mark.parametrize("argv", BAD_ARGS, ids=lambda a: " ".join(a[:2]))
def test_bad_arguments_exit_2_without_a_traceback(argv):
    """Each was a traceback with exit 1, or ran (state_update --threads -3 recorded -3; generate --tokens 0 printed
    a negative rate), or failed after a minute of calibration (leech_ablation --arm foo)."""
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "error" in run.stderr.strip().splitlines()[-1]


def test_a_calibration_of_other_settings_is_not_reused(tmp_path):
    """A --quick run's 16 x 256 calibration in the same --workdir was taken for the full run's 64 x 512."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from weights_protocol import _reusable
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import hashlib

    (tmp_path / "calib.txt").write_text("text", encoding="utf-8")
    calib = tmp_path / "calib"
    calib.mkdir()
    sha = hashlib.sha256(b"text").hexdigest()
    (calib / "calibration.json").write_text(json.dumps({"settings": {"samples": 16, "seq_len": 256, "seed": 0},
                                                        "data": {"calib.txt": sha}}))
    assert not _reusable(calib, 64, 512)
    assert not _reusable(tmp_path / "missing", 16, 256)
