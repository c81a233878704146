"""Atomic file and directory output: temporary name, fsync, rename; nothing partial is ever left behind."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from accel.errors import AccelError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call write(f) on a temporary file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get ordinary permissions
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def check_output_dir(out: Path, force: bool, inputs: list[Path] = ()) -> None:
    """Refuse an existing output without --force, any output that is, holds or aliases an input or lies inside an
    input directory (paths compared resolved: `..`, symbolic links), an output that is or holds the working
    directory, and a parent that cannot be written."""
    if str(out) in ("", "."):
        raise AccelError("--out must name a directory, not the current one")
    out = Path(out).absolute()
    real = out.resolve()
    for source in inputs:
        source = Path(source).absolute()
        if not source.exists():
            continue
        resolved = source.resolve()
        if real == resolved or real in resolved.parents:
            raise AccelError(f"output {out} would overwrite the input {source}; choose another --out")
        if resolved.is_dir() and resolved in real.parents:  # it would change what the input holds
            raise AccelError(f"output {out} lies inside the input {source}; choose an --out outside it")
    cwd = Path.cwd().resolve()
    if real == cwd or real in cwd.parents:
        raise AccelError(f"output {out} is or holds the working directory; choose another --out")
    if out.exists() and not force:
        raise AccelError(f"output {out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise AccelError(f"output {out} exists and is not a directory")
    if not out.parent.is_dir():
        raise AccelError(f"the parent directory of {out} does not exist")
    try:  # fail now, not after the work: a read-only or special parent
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".probe", dir=out.parent))
    except OSError as e:
        raise AccelError(f"cannot write in {out.parent}: {e.strerror or e}") from None


def path_for_report(path: Path | str) -> str:
    """A path as a report gives it back, so that a script can pass it on to the next command: pathlib drops the
    "./" of "./-out", which a command line would then take for an option."""
    text = str(path)
    return f"./{text}" if text.startswith("-") else text


def _settle(tmp: Path) -> None:
    """Every file under the finished output on disk (fsync), with ordinary permissions: what the block wrote through
    other libraries keeps their modes otherwise (coremltools writes a package's model.mlmodel 0600 and its weights/
    0700, which other users of a shared machine then cannot read)."""
    mask = _umask()
    for root, dirs, files in os.walk(tmp):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            executable = os.stat(path).st_mode & 0o100
            os.chmod(path, (0o777 if executable else 0o666) & ~mask)
            with open(path, "rb") as f:
                os.fsync(f.fileno())


# errors only a write raises (a full disk, a quota, a file size limit)
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@contextlib.contextmanager
def output_dir(out: Path, force: bool = False, inputs: list[Path] = ()) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes `out` only when the block succeeds."""
    out = Path(out).absolute()
    check_output_dir(out, force, inputs)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise AccelError(f"cannot write in {out.parent}: {e.strerror or e}") from None
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        _settle(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            if old.is_symlink() or not old.is_dir():  # --force over a link replaces the link, not what it names
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.filename is None and e.errno in _WRITE_ERRNOS:  # a write to an open file
            raise OSError(e.errno, e.strerror, str(out)) from None                     # names none: say where
        raise
