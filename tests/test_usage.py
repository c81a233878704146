"""peak_rss_mb: a process's own peak, not the size of the process that started it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from accel.usage import peak_rss_mb


def test_a_child_of_a_large_process_reports_its_own_peak():
    """getrusage's ru_maxrss survives exec: a quantize started by a 300 MB process reported at least 300 MB."""
    held = np.ones(300 * 2**20 // 8)  # 300 MiB resident in this process
    code = "from accel.usage import peak_rss_mb; print(peak_rss_mb())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert held.sum() > 0 and 1 < child < 150
    assert peak_rss_mb() >= 300  # and this process's own high-water mark covers what it holds
