"""quantize on a Ray cluster (design.md §8): the bytes of the local pool, and clean refusals."""

from __future__ import annotations

import sys

import pytest
from test_cli import assert_one_line_error, run, run_json

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def calibrated(tiny_llama, tmp_path_factory, text_file):
    calib = tmp_path_factory.mktemp("ray") / "calib"
    from accel.calibrate.run import CalibSettings, calibrate

    calibrate(str(tiny_llama), text_file, calib, ["weights"], CalibSettings(samples=4, seq_len=32))
    return calib


def test_a_local_ray_instance_writes_the_local_pools_bytes(capsys, tiny_llama, calibrated, tmp_path):
    """gptq3 and leech2 tensors quantized by Ray tasks: every output file equals the local pool's, byte for byte."""
    for weights in ("gptq3", "leech2"):
        common = ["quantize", tiny_llama, "--weights", weights, "--calib", calibrated]
        pool = run_json(capsys, *common, "--out", tmp_path / f"{weights}-pool", "--jobs", "2")
        ray = run_json(capsys, *common, "--out", tmp_path / f"{weights}-ray", "--ray", "local", "--jobs", "2")
        assert pool["jobs"] == 2 and ray["jobs"] == 2 and ray["ray"] == "local" and "ray" not in pool
        files = sorted(p.name for p in (tmp_path / f"{weights}-pool").iterdir())
        assert files == sorted(p.name for p in (tmp_path / f"{weights}-ray").iterdir())
        for name in files:
            assert (tmp_path / f"{weights}-pool" / name).read_bytes() == (tmp_path / f"{weights}-ray" / name).read_bytes()


def test_ray_refusals(capsys, tiny_llama, calibrated, tmp_path, monkeypatch):
    common = ["quantize", tiny_llama, "--out", tmp_path / "x"]
    code, _, err = run(capsys, *common, "--weights", "rtn3", "--ray", "local")
    assert_one_line_error(code, err, contains="runs in this process")
    code, _, err = run(capsys, *common, "--weights", "gptq3", "--calib", calibrated, "--ray", "auto", "--jobs", "2")
    assert_one_line_error(code, err, contains="--jobs sets the local worker count")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, _, err = run(capsys, *common, "--weights", "gptq3", "--calib", calibrated, "--ray", "auto")
    assert_one_line_error(code, err, contains="cannot start or reach a Ray cluster")
    monkeypatch.setitem(sys.modules, "ray", None)  # not installed
    code, _, err = run(capsys, *common, "--weights", "gptq3", "--calib", calibrated, "--ray", "local")
    assert_one_line_error(code, err, contains="--ray needs Ray installed")
    assert not (tmp_path / "x").exists()


def test_a_tasks_own_error_comes_back_as_itself():
    """An AccelError raised in a Ray task reaches the caller as that AccelError (one line naming the tensor), not as
    Ray's wrapper with the remote traceback in its text."""
    import numpy as np

    from accel.errors import AccelError
    from accel.quantize.methods import WeightSettings
    from accel.quantize.parallel import encode_one, ray_workers

    with ray_workers("local", 1) as cluster:
        assert cluster.count == 1
        future = cluster.submit(encode_one, "rtn3", "w", np.zeros((4, 5), np.float32), WeightSettings(group=0))
        error = future.exception(timeout=120)
    assert type(error) is AccelError and str(error) == "tensor 'w': affine group must be positive, got 0"


def test_ray_keeps_the_callers_signal_handlers():
    """ray.init replaces SIGINT and SIGTERM handlers (its SIGTERM one exits with status 15, skipping accel's cleanup
    and its one-line message); inside and after ray_workers the caller's handlers are the ones set."""
    import signal

    from accel.quantize.parallel import ray_workers

    def ours(signum, frame):  # pragma: no cover - never called
        raise AssertionError(signum)

    before = {sig: signal.signal(sig, ours) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ray_workers("local", 1):
            assert signal.getsignal(signal.SIGINT) is ours and signal.getsignal(signal.SIGTERM) is ours
        assert signal.getsignal(signal.SIGINT) is ours and signal.getsignal(signal.SIGTERM) is ours
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_local_instance_starts_without_rays_authentication_notice(capfd, monkeypatch):
    """Ray logged 'Token authentication is enabled for this Ray cluster...' on stderr at every `--ray local` start;
    the notice is held back (authentication stays on: Ray's default is kept)."""
    import logging

    from accel.quantize.parallel import ray_workers

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    logger.addHandler(handler)
    try:
        with ray_workers("local", 1):
            pass
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "Token authentication" in r.getMessage()]
    assert "Token authentication" not in capfd.readouterr().err
