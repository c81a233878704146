"""Llama 3's rope frequency scaling, recovered from a GGUF file's `rope_freqs.weight`.

llama.cpp's converter does not record a Llama 3 model's `rope_scaling` parameters; it writes one divisor per
rotary frequency instead (`rope_freqs.weight`, head_dim / 2 values): 1 for wavelengths under
`original_max_position_embeddings / high_freq_factor`, `factor` for wavelengths over `... / low_freq_factor`, and
`1 / ((1 - s) / factor + s)` between them, with `s = (original / wavelength - low) / (high - low)`. A Hugging Face
config needs the parameters back. Between the plateaus `1 / divisor = (1 - 1/factor) · s + 1/factor` is linear in
the frequency, so two frequencies there give its slope and intercept: `original / (high - low)` and
`low / (high - low)`. Only these two ratios enter the divisors, so every triple with the same ratios describes the
same model; accel states it with `original_max_position_embeddings` 8192, Llama 3's. The candidates, in order: the
published parameters (low 1, high 4), low 1 with the high factor one frequency between the plateaus fixes, and the
fit through all of them. The parameters returned must reproduce every divisor, or the file is refused.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from accel.errors import AccelError

LLAMA3_ORIGINAL_CONTEXT = 8192
_TOLERANCE = 1e-5  # relative; the divisors are stored in float32


def rotary_frequencies(theta: float, head_dim: int) -> np.ndarray:
    """The unscaled rotary frequencies, float32 as llama.cpp's converter and transformers compute them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (1.0 / np.power(np.float32(theta), exponents)).astype(np.float32)


def llama3_divisors(freqs: np.ndarray, factor: float, low: float, high: float, original: float) -> np.ndarray:
    """llama.cpp's `rope_freqs` values for the given Llama 3 parameters (float64)."""
    wavelengths = 2 * math.pi / freqs.astype(np.float64)
    smooth = (original / wavelengths - low) / (high - low)
    divisors = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelengths < original / high, 1.0, divisors)
    return np.where(wavelengths > original / low, factor, divisors)


def llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The `rope_scaling` dict that reproduces `divisors` (None when they are all 1: no scaling); AccelError when
    no Llama 3 scaling does."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    freqs = rotary_frequencies(theta, head_dim)
    if divisors.shape != freqs.shape or not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise AccelError(f"rope_freqs.weight holds {divisors.size} values; a rotary head of {head_dim} has "
                         f"{freqs.size} frequencies, each divided by a positive factor")
    if np.all(divisors == 1.0):
        return None
    factor = float(np.float32(divisors.max()))
    candidates = [(1.0, 4.0)]  # every published Llama 3 (3.1, 3.2, 3.3): low 1, high 4, original 8192
    between = (divisors > 1 + _TOLERANCE) & (divisors < factor * (1 - _TOLERANCE))
    span = 1 - 1 / factor
    if between.any():  # low 1, and the high factor that puts the first frequency between the plateaus where it is
        i = int(np.flatnonzero(between)[0])
        smooth = (1 / divisors[i] - 1 / factor) / span
        candidates.append((1.0, 1.0 + (LLAMA3_ORIGINAL_CONTEXT * freqs[i] / (2 * math.pi) - 1.0) / smooth))
    if between.sum() >= 2:
        slope, intercept = np.polyfit(freqs[between].astype(np.float64), 1.0 / divisors[between], 1)
        original_over_width = 2 * math.pi * slope / span        # original / (high - low)
        low_over_width = (1 / factor - intercept) / span         # low / (high - low)
        if original_over_width > 0 and low_over_width > 0:
            width = LLAMA3_ORIGINAL_CONTEXT / original_over_width
            candidates.append((low_over_width * width, (low_over_width + 1) * width))
    for low, high in ((_short(low), _short(high)) for low, high in candidates):
        predicted = llama3_divisors(freqs, factor, low, high, LLAMA3_ORIGINAL_CONTEXT)
        if np.allclose(predicted, divisors, rtol=_TOLERANCE, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    raise AccelError("rope_freqs.weight is not a Llama 3 rope scaling (no factor, low and high frequency factors "
                     "reproduce its values)")


def _short(value: float) -> float:
    """A fitted factor that is a float32 rounding away from a short decimal (4.0000001 -> 4.0) as that decimal."""
    return float(str(np.float32(value)))
