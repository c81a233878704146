"""Calibration runs: one directory per run, one subdirectory per kind (weights, kv, state), one manifest."""

CALIB_MANIFEST = "calibration.json"


def without_timings(doc):
    """`doc` without its "seconds" entries, at any depth: what a calibration writes to disk, so that the same inputs
    and seed give the same bytes (the timings stay in the report the CLI prints)."""
    if isinstance(doc, dict):
        return {k: without_timings(v) for k, v in doc.items() if k != "seconds"}
    if isinstance(doc, list):
        return [without_timings(v) for v in doc]
    return doc
