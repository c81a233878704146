"""Build the C kernels with gcc on first use and load them through ctypes.

The shared library is cached under $ACCEL_KERNEL_CACHE (default ~/.cache/accel/kernels) in a file named by the
SHA-256 of the source (and of the files it may include: the kernel library's parts and headers in csrc/), the
compiler command and the CPU (flags, model), since -march=native code is only valid on the CPU it was built for.
$ACCEL_KERNEL_ARCH (default "native") replaces the -march target: `x86-64-v3` builds the AVX2 paths on an AVX-512
machine (how `make test` checks them), `x86-64` the portable scalar code. A compiler that refuses -fopenmp (Apple's
clang has no OpenMP) gets a build without it, whose kernels run on one thread (accel_openmp_available() says which),
and one that refuses the default -march=native a build without -march. A build writes to a temporary name in the
cache directory and renames it into place, so concurrent first uses (test workers, spawn pools) never load a
half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from accel.errors import AccelError

SOURCE = Path(__file__).with_name("csrc") / "accel_kernels.c"
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")


def flags() -> tuple[str, ...]:
    """The compiler flags: FLAGS and the -march target ($ACCEL_KERNEL_ARCH, default native)."""
    arch = os.environ.get("ACCEL_KERNEL_ARCH", "").strip() or "native"
    if not arch.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise KernelUnavailable(f"ACCEL_KERNEL_ARCH={arch!r} is not a -march target name (such as native, "
                                "x86-64-v3)")
    return (*FLAGS, f"-march={arch}")


class KernelUnavailable(AccelError):
    """The CPU kernels cannot be built or loaded here (no C compiler, or the build failed)."""


def cache_dir() -> Path:
    env = os.environ.get("ACCEL_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "accel" / "kernels"


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None


def _cpu_identity() -> str:
    text = _cpuinfo()
    if text is None:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    text = _cpuinfo() or ""
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise KernelUnavailable("the accel CPU kernels need a C compiler (gcc) on PATH; none was found "
                                "(run without --kernels to decode weights to dense instead)")
    return cc


def included_files(source: Path) -> list[Path]:
    """The files a C source may #include, in a fixed order: the other .c and .h files beside it and in its csrc/
    (accel_kernels.c includes its family parts and omp_compat.h; state_update.c includes csrc/omp_compat.h). The
    source's own directory is what counts, so that a revision's copy (bench/kernel_ab.py) is keyed by its parts."""
    dirs = [source.parent] + ([source.parent / "csrc"] if (source.parent / "csrc").is_dir() else [])
    return [p for d in dirs for p in sorted(d.glob("*.[ch]")) if p.resolve() != source.resolve()]


def library_path(source: Path = SOURCE, stem: str = "accel_kernels") -> Path:
    """Where the library for this C source, compiler and CPU lives (built if missing)."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise KernelUnavailable(f"the C compiler {cc!r} does not run: {exc}") from None
    key = hashlib.sha256()
    included = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in included_files(source))
    for part in (source.read_bytes(), included, " ".join(flags()).encode(), version.encode(), _cpu_identity().encode(),
                 platform.machine().encode()):
        key.update(hashlib.sha256(part).digest())
    target = cache_dir() / f"{stem}-{key.hexdigest()[:24]}.so"
    if not target.exists():
        _build(cc, source, target)
    return target


def flag_fallbacks() -> list[tuple[str, ...]]:
    """The flag sets a build tries in turn: flags(), then without -fopenmp, and where -march is the default
    (native, not $ACCEL_KERNEL_ARCH), without -march too."""
    first = flags()
    no_omp = tuple(f for f in first if f != "-fopenmp")
    sets = [first, no_omp]
    if not os.environ.get("ACCEL_KERNEL_ARCH", "").strip():
        sets += [tuple(f for f in s if not f.startswith("-march=")) for s in sets]
    return sets


def _build(cc: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        first_error = None
        for flag_set in flag_fallbacks():
            run = subprocess.run([cc, *flag_set, "-o", tmp, str(source), "-lm"], check=False, capture_output=True,
                                 text=True)
            if run.returncode == 0:
                os.replace(tmp, target)  # atomic: a concurrent build of the same key writes identical bytes
                return
            first_error = first_error or run.stderr.strip()[-2000:]
        raise KernelUnavailable(f"building {source.name} failed ({cc}):\n{first_error}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_i64, _i32, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float

_SIGNATURES = {
    "accel_simd_available": ([], _i32),
    "accel_openmp_available": ([], _i32),
    "accel_set_simd": ([_i32], _i32),
    "accel_fields_by_shift": ([_i32], _i32),
    "accel_half_to_float": ([ctypes.c_uint16], _f32),
    "accel_rht": ([_ptr, _i64, _i64, _ptr, _ptr, _i64, _i32, _i32], _i32),
    "accel_affine_matvec": ([_ptr, _i64, _i32, _i32, _i32, _i32, _i32, _i32, _ptr, _ptr, _i64, _i64, _i64, _ptr,
                             _ptr, _i32], _i32),
    "accel_affine_decode_rows": ([_ptr, _i64, _i32, _i32, _i32, _i32, _i32, _i32, _ptr, _ptr, _i64, _i64, _i64,
                                  _i64, _i64, _ptr, _i32], _i32),
    "accel_leech_matvec": ([_i32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64,
                            _ptr, _ptr, _i64, _ptr, _ptr, _i32], _i32),
    "accel_leech_tiles_available": ([], _i32),
    "accel_leech_planes_lane_order": ([], _i32),
    "accel_leech_decode_rows": ([_i32, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i32],
                                _i32),
    "accel_tiled_available": ([], _i32),
    "accel_tiled_kinds": ([], _i32),
    "accel_affine_tiled_matvec": ([_ptr, _i32, _i32, _i32, _i32, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i32],
                                  _i32),
    "accel_affine_tiled_decode_rows": ([_ptr, _i32, _i32, _i32, _i32, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                        _ptr, _i32], _i32),
    "accel_base3_tiled_matvec": ([_ptr, _i32, _i32, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i32], _i32),
    "accel_base3_tiled_decode_rows": ([_ptr, _i32, _i32, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i32],
                                      _i32),
    "accel_base3_block_width": ([_i64, _i64], _i64),
    "accel_copy": ([_ptr, _ptr, _i64, _i32], None),
    "accel_read": ([_ptr, _i64, _i32, _i32], ctypes.c_float),
}


def load(path: Path, missing_ok: bool = False) -> ctypes.CDLL:
    """A built kernel library at path, with argument types set; raises KernelUnavailable. missing_ok: a library
    built from another revision of the source may lack some of today's functions (bench/kernel_ab.py)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load the accel CPU kernels from {path}: {exc}") from None
    for name, (args, res) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if missing_ok:
                continue
            raise
        fn.argtypes = args
        fn.restype = res
    return lib


@cache
def library() -> ctypes.CDLL:
    """The loaded kernel library, with argument types set; raises KernelUnavailable."""
    try:
        import torch  # noqa: F401  (load torch's OpenMP runtime first, so both share one thread pool)
    except ImportError:
        pass
    return load(library_path())


def compiler_available() -> bool:
    """A C compiler is there (so a failing build is a bug, not a missing tool)."""
    try:
        _compiler()
    except KernelUnavailable:
        return False
    return True


def available() -> bool:
    try:
        library()
    except KernelUnavailable:
        return False
    return True
