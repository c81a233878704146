"""Llama 3's rope frequency scaling, recovered from a GGUF file's `rope_freqs.weight`.

llama.cpp's converter does not record a Llama 3 model's `rope_scaling` parameters; it writes one divisor per
rotary frequency instead (`rope_freqs.weight`, head_dim / 2 values): 1 for wavelengths under
`original_max_position_embeddings / high_freq_factor`, `factor` for wavelengths over `... / low_freq_factor`, and
`1 / ((1 - s) / factor + s)` between them, with `s = (original / wavelength - low) / (high - low)`. A Hugging Face
config needs the parameters back. Between the plateaus `1 / divisor = (1 - 1/factor) · s + 1/factor` is linear in
the frequency, so two frequencies there give its slope and intercept: `original / (high - low)` and
`low / (high - low)`. Only these two ratios enter the divisors, so every triple with the same ratios describes the
same model; accel states it with `original_max_position_embeddings` 8192, Llama 3's. The candidates, in order: the
published parameters (low 1, high 4), then a line through the frequencies between the plateaus (fitted through two
or more; through one or none, as steep as the plateaus allow, `_ramp`). The parameters returned must reproduce
every divisor, or the file is refused.
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


def llama3_rope_scaling(divisors: np.ndarray, theta: float, head_dim: int,
                        context: int | None = None) -> dict[str, Any] | None:
    """The `rope_scaling` dict that reproduces `divisors` (None when they are all 1: no scaling); AccelError when
    no Llama 3 scaling does. With the model's `context` (max_position_embeddings) at or below 8192, the triple is
    halved until its original context is below it (`_below_context`)."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    freqs = rotary_frequencies(theta, head_dim)
    if divisors.shape != freqs.shape or not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise AccelError(f"rope_freqs.weight holds {divisors.size} values; a rotary head of {head_dim} has "
                         f"{freqs.size} frequencies, each divided by a positive factor")
    if np.all(divisors == 1.0):
        return None
    factor = float(np.float32(divisors.max()))
    candidates = [(1.0, 4.0)]  # every published Llama 3 (3.1, 3.2, 3.3): low 1, high 4, original 8192
    ramp = _ramp(freqs.astype(np.float64), divisors, factor)
    if ramp is not None:  # smooth(freq) = slope * freq - offset, in units of original / (2 pi (high - low))
        slope, offset = ramp
        width = LLAMA3_ORIGINAL_CONTEXT / (2 * math.pi * slope)  # high - low, with original 8192
        candidates.append((offset * width, (offset + 1) * width))
    for low, high in ((_short(low), _short(high)) for low, high in candidates):
        predicted = llama3_divisors(freqs, factor, low, high, LLAMA3_ORIGINAL_CONTEXT)
        if np.allclose(predicted, divisors, rtol=_TOLERANCE, atol=0):
            low, high, original = _below_context(low, high, LLAMA3_ORIGINAL_CONTEXT, context)
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise AccelError("rope_freqs.weight is not a Llama 3 rope scaling (no factor, low and high frequency factors "
                     "reproduce its values)")


def _below_context(low: float, high: float, original: int, context: int | None) -> tuple[float, float, int]:
    """The same triple scaled by a power of two until `original` is below `context`: transformers warns about an
    original context at or above the model's, and only the ratios original / (high - low) and low / (high - low)
    enter its frequencies, which a power-of-two scale leaves bit for bit as they were (every operation on the
    three is a division or a difference of two of them)."""
    while context is not None and original >= context and original % 2 == 0:
        low, high, original = low / 2, high / 2, original // 2
    return low, high, original


def _ramp(freqs: np.ndarray, divisors: np.ndarray, factor: float) -> tuple[float, float] | None:
    """(slope, offset) of the line smooth(freq) = slope · freq − offset that puts every frequency where its divisor
    says: smooth ≥ 1 where the divisor is 1, ≤ 0 where it is the factor, and 1/divisor = 1/factor + (1 − 1/factor)
    · smooth between. Two or more frequencies between the plateaus fix the line (least squares); with one or none,
    the plateaus only bound it, and the steepest of the bounds (doubled, to stay off them) is taken; the offset
    (low / (high − low)) must come out positive."""
    span = 1 - 1 / factor
    tol = _TOLERANCE
    between = (divisors > 1 + tol) & (divisors < factor * (1 - tol))
    smooth = (1 / divisors - 1 / factor) / span
    if between.sum() >= 2:
        slope, intercept = np.polyfit(freqs[between], smooth[between], 1)
        return (slope, -intercept) if slope > 0 and intercept < 0 else None
    high = freqs[divisors <= 1 + tol]          # the short wavelengths: smooth must reach 1 by the lowest of them
    low = freqs[divisors >= factor * (1 - tol)]  # the long ones: smooth must stay at or below 0 up to the highest
    if between.any():  # the line goes through the one point between: only its slope is free
        f, s = float(freqs[between][0]), float(smooth[between][0])
        bounds = [s / f]  # offset = slope * f - s > 0
        bounds += [(1 - s) / (float(high.min()) - f)] if high.size else []
        bounds += [s / (f - float(low.max()))] if low.size else []
        slope = 2 * max(bounds)
        return slope, slope * f - s
    if high.size and low.size and high.min() > low.max():  # a step: smooth -1/2 at the last long wavelength
        slope = 2 / float(high.min() - low.max())
        return slope, slope * float(low.max()) + 0.5
    return None


def _short(value: float) -> float:
    """A fitted factor that is a float32 rounding away from a short decimal (4.0000001 -> 4.0) as that decimal."""
    return float(str(np.float32(value)))
