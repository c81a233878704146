"""bench/gemv.py's reading of issue #4's CPU goals from one run's rows (a pure function of the rows)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from gemv import goals


def _row(shape, kernel, us, stored, speedup, fraction):
    return {"shape": shape, "kernel": kernel, "us": us, "stored_bytes": stored, "speedup_vs_fp32": speedup,
            "byte_bound_fraction": fraction}


def test_goals_name_the_kernels_that_miss_and_the_planes_ratio():
    rows = [_row("576x576", "int4", 5.0, 100, 0.5, 0.1),  # below 4096x4096: not a goal shape
            _row("4096x4096", "torch-fp32", 2000.0, 67e6, 1.0, 0.7),
            _row("4096x4096", "int4", 400.0, 8e6, 5.0, 0.61),
            _row("4096x4096", "base3", 300.0, 4e6, 6.7, 0.35),
            _row("4096x4096", "leech-planes", 700.0, 10e6, 0.9, 0.6)]
    checks = goals({"rows": rows})
    assert list(checks) == ["4096x4096"]
    c = checks["4096x4096"]
    assert c["below_60pct_of_byte_bound"] == ["base3"]  # 0.6 itself meets "at least 60%"
    assert c["slower_than_fp32"] == ["leech-planes"] and c["faster_than_fp32"] == ["base3", "int4"]
    assert abs(c["planes_vs_int4_time_per_weight_byte"] - (700 / 10e6) / (400 / 8e6)) < 1e-12


def test_goals_without_int4_have_no_ratio():
    rows = [_row("14336x4096", "leech-planes", 700.0, 10e6, 3.0, 0.6)]
    assert goals({"rows": rows})["14336x4096"]["planes_vs_int4_time_per_weight_byte"] is None


def test_time_arms_takes_turns_and_does_not_count_a_turns_first_pass(monkeypatch):
    """On a fake clock that only the calls move, so the figures are exact and the host's load cannot touch them."""
    import types

    import gemv

    clock = [0.0]
    monkeypatch.setattr(gemv, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    log = []

    def call(name, seconds):
        def run():
            if not log or log[-1] != name:  # the first call of a turn: as if the caches were the other arm's
                clock[0] += 0.01
            log.append(name)
            clock[0] += seconds
        return run

    timed = gemv._time_arms({"a": [call("a", 0.001)], "b": [call("b", 0.002)]}, min_seconds=0.05,
                            turn_seconds=0.005)
    turns = [name for i, name in enumerate(log) if i == 0 or log[i - 1] != name]
    assert turns[:4] == ["a", "b", "a", "b"] and len(turns) >= 10  # at least 5 rounds, arms alternating
    # each turn is one slow pass (11 ms, not counted) and one fast one: counted, the medians would be the slow ones
    for name, fast in (("a", 0.001), ("b", 0.002)):
        best, median = timed[name]
        assert fast <= best <= median < fast + 0.005


def test_read_probe_reads_every_element():
    import numpy as np

    from accel.kernels._build import compiler_available, library

    if not compiler_available():
        import pytest
        pytest.skip("no C compiler for the accel CPU kernels")
    src = (np.arange(100_003) % 7).astype(np.float32)
    for threads in (1, 2, 3):
        for streams in (1, 2):
            assert library().accel_read(src.ctypes.data, src.size, threads, streams) == float(src.sum(dtype=np.float64))
