"""Two builds of the CPU kernels side by side: this checkout's accel/kernels/csrc against a git revision's.

Both builds run on the same weights in one process, and their arms take turns in every round (bench/gemv.py's
`_time_arms`, best pass), so a kernel change is measured against this machine's minute-to-minute bandwidth swings
instead of across them: the figure to read is the ratio, `speedup` = µs of the revision / µs of this checkout. Every
call reads a different copy of the weight (at least --footprint MiB of them; 0 keeps one copy, in cache).

Both builds read the serving copies that this checkout's accel/kernels/weights.py makes, and the revision's functions
are called with today's argument types, so a revision whose kernels expect another layout or signature cannot be
compared this way: before timing, the two builds' outputs must agree to a relative 1e-5, and the script stops with
exit status 2 where they do not (or where the revision lacks a kernel).
Usage: python bench/kernel_ab.py [--rev HEAD] [--kernels base3,int2] [--shapes 4096x4096] [--threads N]
[--footprint MiB] [--seconds S] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gemv import KERNELS, _replicas, _time_arms, make_weight, parse_shapes

ROOT = Path(__file__).resolve().parents[1]
CSRC = "accel/kernels/csrc"


class Refused(Exception):
    """Bad input or an incomparable revision: a one-line message, exit status 2."""


def _git(*args: str) -> bytes:
    run = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False)
    if run.returncode:
        raise Refused(f"git {' '.join(args)}: {run.stderr.decode(errors='replace').strip() or 'failed'}")
    return run.stdout


def revision_library(rev: str, workdir: Path):
    """(full commit id, the kernel library built from rev's accel/kernels/csrc)."""
    from accel.kernels import _build

    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    names = _git("ls-tree", "--name-only", f"{commit}:{CSRC}").decode().split()
    if "accel_kernels.c" not in names:
        raise Refused(f"revision {rev} has no {CSRC}/accel_kernels.c")
    for name in names:
        (workdir / name).write_bytes(_git("show", f"{commit}:{CSRC}/{name}"))
    path = _build.library_path(workdir / "accel_kernels.c", stem=f"accel_kernels_{commit[:12]}")
    return commit, _build.load(path, missing_ok=True)


def matvec_call(kw, lib, x: np.ndarray, out: np.ndarray, threads: int):
    """A call of lib's matvec for the kernel weight kw (built by this checkout), as kw.matvec_ptr makes it."""
    from accel.kernels.weights import LeechWeight

    if isinstance(kw, LeechWeight):
        name, args = "accel_leech_matvec", kw._matvec_args
    else:
        matvec, _, args = kw._kernels
        name = matvec.__name__
    try:
        fn = getattr(lib, name)
    except AttributeError:
        raise Refused(f"the revision's library has no {name}") from None
    if fn.argtypes is None:  # a function today's signatures do not know
        raise Refused(f"the revision's {name} has no known signature")
    xp, op = x.ctypes.data, out.ctypes.data
    return lambda: fn(*args, xp, op, threads)


def run(libs: dict, shapes: list[tuple[int, int]], kernels: list[str], threads: int, footprint: int,
        seconds: float) -> list[dict]:
    from accel.kernels import kernel_weight

    rng = np.random.default_rng(0)
    rows_out = []
    for rows, cols in shapes:
        x = rng.standard_normal(cols).astype(np.float32)
        for kind in kernels:
            entry, parts = make_weight(kind, rows, cols, rng)
            nbytes = sum(a.nbytes for a in parts.values())
            weights = [kernel_weight(entry, p) for p in _replicas(parts, nbytes, footprint)]
            outs = {arm: np.empty(rows, dtype=np.float32) for arm in libs}
            arms = {arm: [matvec_call(kw, lib, x, outs[arm], threads) for kw in weights] for arm, lib in libs.items()}
            for arm, calls in arms.items():
                outs[arm].fill(np.nan)
                calls[0]()
            base, new = outs["base"].astype(np.float64), outs["new"].astype(np.float64)
            diff = np.linalg.norm(new - base) / max(np.linalg.norm(base), 1e-30)
            if not diff < 1e-5:
                raise Refused(f"{kind} {rows}x{cols}: the two builds disagree (relative difference {diff:.2e}); "
                              "the revision's kernels read another serving layout")
            timed = _time_arms(arms, seconds)
            rows_out.append({"shape": f"{rows}x{cols}", "kernel": kind, "us_base": timed["base"][0] * 1e6,
                             "us_new": timed["new"][0] * 1e6, "speedup": timed["base"][0] / timed["new"][0],
                             "relative_difference": float(diff)})
            print(f"  measured {kind} {rows}x{cols}", file=sys.stderr, flush=True)
    return rows_out


def table(result: dict) -> str:
    header = (f"{result['threads']} threads, footprint {result['footprint_mib']} MiB; base: {result['rev']} "
              f"({result['commit'][:12]}); new: this checkout; µs: best pass, the arms in turn")
    lines = [header, "", "| shape | kernel | µs base | µs new | speedup (base / new) |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['kernel']} | {r['us_base']:.1f} | {r['us_new']:.1f} | {r['speedup']:.3f} |"
              for r in result["rows"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="git revision whose kernels are the base arm (default HEAD)")
    ap.add_argument("--kernels", default="base3", help="comma-separated subset of " + ",".join(KERNELS))
    ap.add_argument("--shapes", default="4096x4096", help="comma-separated ROWSxCOLS (default 4096x4096)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--footprint", type=int, default=256, help="MiB of weight copies cycled (0: one copy, in cache)")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per arm and shape (at least)")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object with the rows")
    args = ap.parse_args()
    try:
        kernels = [k for k in args.kernels.split(",") if k]
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown or not kernels:
            raise Refused(f"--kernels: unknown {unknown or 'none given'}; known: {','.join(KERNELS)}")
        if args.threads < 1 or args.footprint < 0 or not args.seconds > 0:
            raise Refused("--threads must be >= 1, --footprint >= 0 and --seconds > 0")
        try:
            shapes = parse_shapes(args.shapes)
        except ValueError:
            raise Refused(f"--shapes: expected ROWSxCOLS[,ROWSxCOLS...], got {args.shapes!r}") from None
        from accel.kernels import _build

        with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
            commit, base = revision_library(args.rev, Path(tmp))
        libs = {"base": base, "new": _build.library()}
        rows = run(libs, shapes, kernels, args.threads, args.footprint * 2**20, args.seconds)
    except Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    result = {"rev": args.rev, "commit": commit, "threads": args.threads, "footprint_mib": args.footprint,
              "load_average": os.getloadavg(), "rows": rows}
    print(table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
