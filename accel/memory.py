"""Refuse to build a float32 model that cannot fit in memory, before the first tensor is decoded.

Without it, a model larger than the machine's memory (an 8B model in float32 is 32 GB) is decoded tensor by tensor
until the kernel's OOM killer ends the process: minutes of work, then "Killed" and exit 137, with no word of why.
The check compares the float32 bytes of the model's weights with what Linux says a process can still have without
swapping out others (MemAvailable) plus free swap, and, inside a container whose memory cgroup has a limit (Docker,
Kubernetes: /proc/meminfo shows the host's memory there), with the limit less what the group uses, its page cache
counted as free (it is reclaimed before the group is killed). Where none of these can be read (macOS), nothing is
checked. $ACCEL_MEMORY_CHECK=off turns it off (to try anyway, say with memory that the check cannot see).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

from accel.errors import AccelError

CHECK_ENV = "ACCEL_MEMORY_CHECK"
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # v2: memory.max here; v1: memory/memory.limit_in_bytes (the process's own group,
# as a container sees its cgroup namespace)


def float32_bytes(shapes: Iterable[tuple[int, ...]]) -> int:
    """The bytes of float32 tensors of these shapes."""
    return sum(4 * math.prod(int(d) for d in shape) for shape in shapes)


def row_passes(rows: int, width: int, elements: int) -> list[slice]:
    """Consecutive slices of `rows` rows of `width` elements, about `elements` elements a slice (at least one row):
    the passes in which work on a large tensor keeps its temporaries near a pass's size, not the tensor's."""
    step = max(1, elements // max(width, 1))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


def available_bytes() -> tuple[int, str] | None:
    """The smaller of the machine's and the memory cgroup's available bytes, with where the figure comes from;
    None where neither can be read."""
    found = [(n, source) for n, source in ((machine_available(_read(MEMINFO)), "MemAvailable + SwapFree"),
                                           (cgroup_available(CGROUP), "the memory cgroup's limit less its use"))
             if n is not None]
    return min(found) if found else None


def machine_available(meminfo: str | None) -> int | None:
    """MemAvailable + SwapFree of /proc/meminfo's text, in bytes; None without MemAvailable."""
    fields = {}
    for line in (meminfo or "").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            fields[name.strip()] = int(parts[0]) * 1024
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def cgroup_available(root: Path) -> int | None:
    """limit - usage + page cache of the memory cgroup mounted at `root` (v2, else v1); None without a limit."""
    for limit_file, usage_file, stat_file, cache_key in (
            (root / "memory.max", root / "memory.current", root / "memory.stat", "file"),
            (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes",
             root / "memory" / "memory.stat", "total_cache")):
        limit, usage = _number(_read(limit_file)), _number(_read(usage_file))
        if limit is None or usage is None:
            continue
        if limit >= 2**62:  # v1 writes "no limit" as the largest page-aligned int64 (v2 as "max": None above)
            return None
        cache = 0
        for line in (_read(stat_file) or "").splitlines():
            name, _, value = line.partition(" ")
            if name == cache_key and value.strip().isdigit():
                cache = int(value)
        return max(limit - usage, 0) + cache
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def check_fits(need: int, what: str, hint: str = "") -> None:
    """Refuse `what` (a model to build, named for the message) when `need` bytes exceed the memory available."""
    if os.environ.get(CHECK_ENV) == "off":
        return
    found = available_bytes()
    if found is None or need <= found[0]:
        return
    available, source = found
    hint = f"; {hint}" if hint else ""
    raise AccelError(f"{what} needs {_size(need)} of memory as float32 weights, and {_size(available)} is "
                     f"available ({source}): the process would be killed part-way{hint}; {CHECK_ENV}=off tries "
                     f"anyway")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"
