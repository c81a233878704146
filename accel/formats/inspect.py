"""What an accel output holds: tensors with codec, layout, exact bits per weight and sizes, and its maps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accel.formats.artifact import Artifact


def inspect_artifact(path: Path) -> dict[str, Any]:
    """A JSON-able report of an OUT_DIR or container file (keys per design.md §3, `inspect`)."""
    art = Artifact(path)
    try:
        tensors = []
        for name in art.names:
            r = art.report(name)
            tensors.append({"name": r.name, "codec": r.codec, "layout": r.layout, "role": r.role,
                            "shape": list(r.shape), "bits_per_weight": r.bits_per_weight, "bytes": r.bytes,
                            "params": r.params})
        return {
            "path": str(path),
            "bits_per_weight": art.bits_per_weight("quantized"),
            "kept_bits_per_weight": art.bits_per_weight("kept"),
            "bytes": art.total_bytes(),
            "files": [f.path.name for f in art.files],
            "format_version": art.files[0].doc["version"],
            "tensors": tensors,
            "maps": art.map_documents(),
            "settings": (art.manifest or {}).get("settings", {}),
        }
    finally:
        art.close()
