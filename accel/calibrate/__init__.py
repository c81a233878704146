"""Calibration runs: one directory per run, one subdirectory per kind (weights, kv, state), one manifest."""

import math

CALIB_MANIFEST = "calibration.json"


def without_timings(doc):
    """`doc` without its "seconds" entries, at any depth: what a calibration writes to disk, so that the same inputs
    and seed give the same bytes (the timings stay in the report the CLI prints). A NaN or infinite figure (a rank
    correlation of constant scores) becomes null: JSON has no NaN, and json.dumps would write a bare NaN."""
    if isinstance(doc, dict):
        return {k: without_timings(v) for k, v in doc.items() if k != "seconds"}
    if isinstance(doc, list):
        return [without_timings(v) for v in doc]
    if isinstance(doc, float) and not math.isfinite(doc):
        return None
    return doc
