"""What a run cost: its peak resident memory, which reports give as `peak_rss_mb`."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_mb() -> float:
    """The largest resident set of this process or of any child it waited for (the quantize workers), in MiB.

    This process's own is its memory's high-water mark, VmHWM, where Linux gives it: getrusage's ru_maxrss survives
    exec, so a process started by a large one (a CI harness, a benchmark that built a model) reported its parent's
    size. A child's figure is at most this process's size when it started, or the child's own."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                own = int(line.split()[1])  # kB
                break
    except OSError:
        pass
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024.0
