"""Weights and activations at float16's edges: grids that would overflow or underflow their float16 side data get
float32 (or a clear refusal where the format has only float16), never a silent NaN or a zeroed tensor."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from accel.errors import AccelError
from accel.formats.codecs import grid_dtype
from accel.formats.tensor import decode_parts, encode_tensor
from accel.quantize.methods import WeightSettings, get_weight_method


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _roundtrip(method: str, w: np.ndarray, **settings) -> np.ndarray:
    entry, arrays = get_weight_method(method).encode("model.layers.0.mlp.up_proj.weight", w,
                                                     WeightSettings(**settings))
    return decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})


def test_grid_dtype_keeps_float16_for_ordinary_grids_and_not_past_its_edges():
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (64, 64))
    lo, step = w.min(1), (w.max(1) - w.min(1)) / 15
    assert grid_dtype(step, 15, lo) == "float16"
    assert grid_dtype(step * 1e6, 15, lo * 1e6) == "float32"  # overflow
    assert grid_dtype(step * 1e-4, 255, lo * 1e-4) == "float32"  # a subnormal step misses by many steps
    assert grid_dtype(np.array([4 / 15]), 15, np.array([59998.0 + 1 / 3])) == "float32"  # the offset's ulp is 32
    assert grid_dtype(np.array([0.0]), 15, np.array([0.5])) == "float16"  # a constant group


@pytest.mark.parametrize("method", ["rtn2", "rtn4", "rtn8", "hqq4"])
@pytest.mark.parametrize("magnitude", [1e-6, 1e5])
def test_affine_methods_quantize_tiny_and_huge_weights(method, magnitude):
    """rtn8 of weights around 1e-6 rounded its step to 0 (relative error 3.0, worse than zeros); hqq4 of weights
    past 65504 stored infinite scales (exit 0, every value NaN), and of weights around 1e-6 a scale of 1."""
    w = np.random.default_rng(1).normal(0, 1, (16, 128)) * magnitude
    ordinary = _rel(_roundtrip(method, w / magnitude), w / magnitude)
    decoded = _roundtrip(method, w)
    assert np.isfinite(decoded).all()
    assert _rel(decoded, w) < ordinary * 1.05 + 1e-3


def test_gptq_grids_that_feedback_pushes_past_float16_are_float32():
    """The dtype was chosen from the weight before error feedback, which moved columns past 65504: inf offsets."""
    from accel.quantize.gptq_affine import gptq_affine

    rng = np.random.default_rng(0)
    w = rng.uniform(-64900, 64900, size=(16, 64))
    x = rng.standard_normal((256, 64))
    x[:, 1:] += 3 * x[:, :1]  # correlated inputs: feedback moves later columns a lot
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the overflowing float16 pass is thrown away without a user-visible warning
        q, scale, offset = gptq_affine(w, x.T @ x / 256, 4, 16)
    assert np.isfinite(q).all() and np.isfinite(scale.astype(np.float64)).all()
    assert np.isfinite(offset.astype(np.float64)).all() and scale.dtype == np.float32


def test_leech_refuses_rows_float16_cannot_scale_naming_the_tensor():
    """leech2 of weights past float16 wrote NaN without --calib and blamed 'targets' with it."""
    w = np.random.default_rng(2).normal(0, 1, (8, 48)) * 2e5
    with pytest.raises(AccelError, match=r"tensor 'model.layers.0.mlp.up_proj.weight': a row's RMS is .* past "
                                         r"float16's range"):
        _roundtrip("leech2", w)


def test_non_finite_hessians_are_refused():
    """An overflowed calibration made gptq write NaN weights with exit 0."""
    from accel.quantize.gptq import damped_inverse_cholesky

    h = np.eye(4)
    h[1, 2] = np.inf
    with pytest.raises(AccelError, match="NaN or Inf"):
        damped_inverse_cholesky(h)


def test_layer_inputs_past_float32_still_give_a_finite_gram():
    """Activations around 1e22 overflowed the float32 product that calibration uses: a non-finite Hessian."""
    from accel.calibrate.hessians import input_gram

    x = torch.tensor([[1e22, 1.0], [2e22, -1.0]], dtype=torch.float32)
    gram = input_gram(x)
    assert np.isfinite(gram).all()
    assert gram[0, 0] == pytest.approx(5e44, rel=1e-6) and gram[1, 1] == pytest.approx(2.0)


def test_turboquant_saturates_a_norm_past_float16():
    """128 fp16-exact entries of 6000 have norm 67882: stored as inf, they decoded to NaN."""
    from accel.quantize import turboquant

    x = np.full((1, 1, 128), 6000.0)
    codes, norms = turboquant.encode(x, np.array([16]), seed=0)
    assert np.isfinite(norms.astype(np.float64)).all()
    decoded = turboquant.decode(codes, np.array([16]), norms, seed=0)
    half_codes, half_norms = turboquant.encode(x / 2, np.array([16]), seed=0)
    half = turboquant.decode(half_codes, np.array([16]), half_norms, seed=0)
    assert np.isfinite(decoded).all()
    assert _rel(decoded, x) < _rel(half, x / 2) + 0.04  # the codec's own error and the 3.5% the norm lost


def test_a_constant_huge_group_round_trips_through_the_codec():
    w = np.full((2, 64), 70000.0)
    entry, arrays = encode_tensor("t", w, "affine", levels=16, group=64, symmetric=False)
    assert entry.params["scale_dtype"] == "float32"
    np.testing.assert_array_equal(decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()}), w)


def test_an_affine_group_spanning_past_float32_is_refused_not_decoded_to_inf():
    """A group from -3e38 to 3e38 was stored with a float32 scale whose q·scale overflows when decoded (inf where the
    weight was 3e38); quantize now names the tensor instead. A symmetric grid and a span just inside the range
    still round-trip finite."""
    from accel.quantize.parallel import encode_one

    w = np.array([[3e38, -3e38, 1.0, 2.0]], dtype=np.float32)
    with pytest.raises(AccelError, match=r"tensor 'w': an affine group's values span more than float32's range"):
        encode_one("rtn3", "w", w, WeightSettings(group=4))
    for symmetric, values in ((True, w), (False, w / 2.5)):
        entry, arrays = encode_tensor("t", values, "affine", levels=8, group=4, symmetric=symmetric)
        assert np.isfinite(decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})).all()
