"""SHA-256 records of whole files: what an output's manifest lists of the files beside its containers (accel.json
`files`, a package manifest's `files`, calibration.json `files`) and the check of a directory against them."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def files_sha256(root: Path, keep: Callable[[str], bool], pattern: str = "*") -> dict[str, str]:
    """SHA-256 of the files under root matching pattern whose path relative to root (POSIX) `keep` accepts, by
    that path, sorted."""
    root = Path(root)
    found = {p.relative_to(root).as_posix(): p for p in root.rglob(pattern) if p.is_file()}
    return {rel: file_sha256(found[rel]) for rel in sorted(found) if keep(rel)}


def file_faults(recorded: Any, found: dict[str, str], *, writer: str, manifest: str, prefix: str = "",
                unlisted: bool = False) -> list[str]:
    """One line a recorded file that is missing or changed (`recorded` the manifest's name → SHA-256, `found`
    what files_sha256 gives now), and with `unlisted` a file found that the record does not list. `writer` names
    the command that wrote the files, `manifest` the record, `prefix` goes before each path."""
    if not isinstance(recorded, dict) or not all(isinstance(v, str) for v in recorded.values()):
        return [f"{manifest}: 'files' is not an object of file name to SHA-256"]
    faults = [f"{prefix}{name}: missing ({writer} wrote it; {manifest} lists it)" for name in sorted(recorded)
              if name not in found]
    faults += [f"{prefix}{name}: changed since {writer} wrote it (its SHA-256 differs from {manifest}'s)"
               for name in sorted(recorded) if name in found and found[name] != recorded[name]]
    if unlisted:
        faults += [f"{prefix}{name}: not written by {writer} ({manifest} does not list it)" for name in sorted(found)
                   if name not in recorded]
    return faults
