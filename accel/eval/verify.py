"""`accel verify` as a library call: checksums, decode every tensor, compare against a reference model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from accel.errors import AccelError, FormatError
from accel.formats.artifact import Artifact
from accel.progress import SILENT, Progress


def verify_artifact(path: Path, reference: str | None = None, progress: Progress = SILENT) -> dict[str, Any]:
    """Every fault found is one line in `errors`; `ok` is true when there are none."""
    path = Path(path)
    if not path.exists():
        raise AccelError(f"{path}: no such file or directory")
    try:
        art = Artifact(path)
    except FormatError as exc:
        return {"ok": False, "errors": [str(exc)], "tensors": 0}
    source = None
    if reference is not None:
        from accel.converters import open_model

        source = open_model(reference)
    reference_names = set(source.tensor_names()) if source is not None else set()
    errors: list[str] = []
    rel_errors: dict[str, float] = {}
    max_abs = 0.0
    try:
        progress.stage("verifying", len(art.names))
        for name in art.names:
            progress.advance()
            owner = art.owner[name]
            bad = [s for s in art.entry(name).parts.values() if not owner.checksum_ok(s)]
            if bad:
                errors.append(f"{owner.path.name}: tensor '{name}': checksum mismatch in stored tensor '{bad[0]}'")
                continue
            try:
                decoded = art.decode(name, check=False)
            except FormatError as exc:
                errors.append(str(exc))
                continue
            if decoded.dtype.kind == "f" and not np.isfinite(decoded).all():
                errors.append(f"tensor '{name}': decodes to NaN or Inf")
                continue
            if source is None or art.entry(name).role not in ("quantized", "kept"):
                continue
            if name not in reference_names:
                errors.append(f"tensor '{name}': not in the reference model")
                continue
            ref = source.load_tensor(name).astype(np.float64)
            if ref.shape != decoded.shape:
                errors.append(f"tensor '{name}': shape {list(decoded.shape)} differs from the reference's "
                              f"{list(ref.shape)}")
                continue
            diff = decoded.astype(np.float64) - ref
            norm = float(np.linalg.norm(ref))
            rel_errors[name] = float(np.linalg.norm(diff)) / norm if norm > 0 else float(np.linalg.norm(diff))
            max_abs = max(max_abs, float(np.abs(diff).max()) if diff.size else 0.0)
        progress.close()
        if source is not None:
            missing = sorted(n for n in reference_names if n not in art.owner)
            errors.extend(f"tensor '{n}': in the reference but missing from the output" for n in missing)
    finally:
        art.close()
        if source is not None:
            source.close()
    report: dict[str, Any] = {"ok": not errors, "errors": errors, "tensors": len(art.names),
                              "bytes": art.total_bytes()}
    if reference is not None:
        worst = max(rel_errors, key=rel_errors.get) if rel_errors else None
        report.update({"reference": reference, "max_rel_error": rel_errors[worst] if worst else 0.0,
                       "max_rel_error_tensor": worst, "max_abs_error": max_abs, "rel_error": rel_errors})
    return report
