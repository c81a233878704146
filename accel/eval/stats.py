"""Paired statistics between two arms evaluated on the same windows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairedDelta:
    mean: float  # mean per-window difference (arm minus reference), nats/token
    low: float  # bootstrap 95% interval
    high: float
    windows: int


def paired_bootstrap(arm: np.ndarray, reference: np.ndarray, resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> PairedDelta:
    """Percentile bootstrap of the mean paired difference; deterministic for a seed. One pair has no interval: low
    and high are NaN then (so no "CI inside a margin" test can pass on it)."""
    arm, reference = np.asarray(arm, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if arm.shape != reference.shape or arm.ndim != 1 or arm.size == 0:
        raise ValueError("paired_bootstrap takes two equal-length non-empty 1-D arrays")
    diff = arm - reference
    if diff.size == 1:
        return PairedDelta(mean=float(diff[0]), low=float("nan"), high=float("nan"), windows=1)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, 1000):  # chunks bound memory for many windows
        stop = min(resamples, start + 1000)
        means[start:stop] = diff[rng.integers(0, diff.size, size=(stop - start, diff.size))].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return PairedDelta(mean=float(diff.mean()), low=float(low), high=float(high), windows=int(diff.size))
