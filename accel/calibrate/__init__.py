"""Calibration runs: one directory per run, one subdirectory per kind (weights, kv, state), one manifest."""

CALIB_MANIFEST = "calibration.json"
