"""The recurrent-state update kernels against the float64 reference (GDN and KDA decay)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from accel.kernels import state_update as su
from accel.kernels import state_update_triton

pytestmark = pytest.mark.skipif(not su.available(), reason="no C compiler for the state-update kernel")


def _step_inputs(rng, b, h, dk, dv, kda):
    q = rng.normal(size=(b, h, dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k = rng.normal(size=(b, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(b, h, dv))
    g = -rng.random((b, h, dk) if kda else (b, h)) * 0.3
    beta = rng.random((b, h))
    return q, k, v, g, beta


@pytest.mark.parametrize("kda", [False, True])
# d_v 32 / 64 / 80 / 128 take the register-resident head (d_v = 16 x 1..8 on AVX-512; 64 and 128 encode four
# vectors of codes at a time, 80 four and one), d_v 20 the generic row loops
@pytest.mark.parametrize("dims", [(2, 4, 32, 32), (1, 3, 16, 20), (2, 2, 16, 64), (1, 2, 24, 80), (1, 2, 32, 128)])
def test_mixed_step_matches_float64_reference(kda, dims):
    b, h, dk, dv = dims
    rng = np.random.default_rng(7)
    high = (rng.random((h, dk)) < 0.25).astype(np.uint8)
    state = su.MixedState.from_float(rng.normal(size=dims) * 0.3, high)
    for _ in range(3):  # several steps: the kernel reads what it wrote
        start = state.to_float()
        inp = _step_inputs(rng, b, h, dk, dv, kda)
        o_ref, s_ref = su.reference_step(start, *inp)
        o = su.step_mixed(state, *inp, threads=1)
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=2e-6 * np.abs(o_ref).max())
        # the stored state is the reference state encoded: int8 rows within half a step, fp16 rows to fp16
        got = state.to_float().reshape(b, h * dk, dv)
        ref = s_ref.reshape(b, h * dk, dv)
        hi = high.reshape(-1) != 0
        np.testing.assert_allclose(got[:, hi], ref[:, hi], rtol=2**-10, atol=1e-7)
        step = np.abs(ref[:, ~hi]).max(axis=-1, keepdims=True) / 127
        assert (np.abs(got[:, ~hi] - ref[:, ~hi]) <= 0.5 * step * 1.01 + 1e-7).all()
        # and it is bit-for-bit what the runtime's encoder makes of the same float32 rows (rare tie flips aside)
        again = su.MixedState.from_float(s_ref.astype(np.float32), high)
        assert (again.lo == state.lo).mean() > 0.999 and (again.lo_scale == state.lo_scale).mean() > 0.99


def _padded_steps(rng, b, h, dk, dv, kda, steps=3):
    """Float32 step inputs, each with v also padded by 8 zero columns (for a state padded the same way)."""
    for _ in range(steps):
        q, k, v, g, beta = (np.asarray(x, dtype=np.float32) for x in _step_inputs(rng, b, h, dk, dv, kda))
        yield q, k, v, g, beta, np.concatenate([v, np.zeros((b, h, 8), np.float32)], axis=-1)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("dv", [64, 128])
def test_register_path_is_bit_identical_to_the_generic_path(kda, dv):
    """d_v 64 / 128 take the register-resident head; the same state padded with 8 zero columns (d_v 72 / 136) takes
    the generic row loops. Zero columns change no row maximum and add only zeros, so the first d_v columns of every
    output, code and scale must agree bit for bit, in both kernels, over several steps."""
    rng = np.random.default_rng(11)
    b, h, dk = 2, 3, 32
    high = (rng.random((h, dk)) < 0.25).astype(np.uint8)
    start = (rng.normal(size=(b, h, dk, dv)) * 0.3).astype(np.float32)
    padded = np.concatenate([start, np.zeros((b, h, dk, 8), np.float32)], axis=-1)
    fast, generic = su.MixedState.from_float(start, high), su.MixedState.from_float(padded, high)
    f32_fast, f32_generic = start.copy(), padded.copy()
    for q, k, v, g, beta, v_pad in _padded_steps(rng, b, h, dk, dv, kda):
        o_fast = su.step_mixed(fast, q, k, v, g, beta, threads=1)
        o_generic = su.step_mixed(generic, q, k, v_pad, g, beta, threads=1)
        np.testing.assert_array_equal(o_fast, o_generic[..., :dv])
        np.testing.assert_array_equal(fast.hi, generic.hi[..., :dv])
        np.testing.assert_array_equal(fast.lo, generic.lo[..., :dv])
        np.testing.assert_array_equal(fast.lo_scale, generic.lo_scale)
        assert not generic.lo[..., dv:].any() and not generic.hi[..., dv:].any()
        o_fast = su.step_f32(f32_fast, q, k, v, g, beta, threads=1)
        o_generic = su.step_f32(f32_generic, q, k, v_pad, g, beta, threads=1)
        np.testing.assert_array_equal(o_fast, o_generic[..., :dv])
        np.testing.assert_array_equal(f32_fast, f32_generic[..., :dv])


def _water_widths(rng, h, dk):
    """Every width 2..16 at least once, the rest at random."""
    w = rng.integers(2, 17, size=h * dk)
    w[:15] = np.arange(2, 17)
    return rng.permutation(w).reshape(h, dk)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("dims", [(2, 2, 16, 64), (1, 2, 24, 128), (1, 3, 8, 40), (2, 1, 16, 24)])
def test_water_step_matches_float64_reference(kda, dims):
    b, h, dk, dv = dims  # d_v 64 / 128 take the vector path (with AVX-512 VBMI), 40 / 24 the scalar loops
    rng = np.random.default_rng(13)
    widths = _water_widths(rng, h, dk)
    state = su.WaterState.from_float(rng.normal(size=dims) * 0.3, widths)
    for _ in range(3):  # the kernel reads what it wrote
        start = state.to_float()
        inp = _step_inputs(rng, b, h, dk, dv, kda)
        o_ref, s_ref = su.reference_step(start, *inp)
        o = su.step_water(state, *inp, threads=1)
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=2e-6 * np.abs(o_ref).max())
        # each row within half its own step of the reference, plus qmax times the float16 scale's rounding (half
        # an ulp: 2^-11 relative, or 2^-25 where the scale is subnormal, as at K >= 12 on small rows), and (rare
        # ties aside) exactly the runtime's encoding
        got, ref = state.to_float().reshape(b, h * dk, dv), s_ref.reshape(b, h * dk, dv)
        qmax = (2.0 ** (widths.reshape(-1).astype(np.float64) - 1) - 1)[None, :, None]
        step = np.maximum(np.abs(ref).max(axis=-1, keepdims=True) / qmax, 2.0**-24)
        scale_error = np.maximum(step * 2.0**-11, 2.0**-25)
        assert (np.abs(got - ref) <= (0.5 * step + qmax * scale_error) * 1.01 + 1e-7).all()
        again = su.WaterState.from_float(s_ref.astype(np.float32), widths)
        for k in again.codes:
            assert (again.scales[k] == state.scales[k]).mean() > 0.99
            assert (again.codes[k] == state.codes[k]).mean() > 0.99


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("dv", [48, 64, 128])
def test_water_vector_path_is_bit_identical_to_the_scalar_loops(kda, dv):
    """As for the two-tier kernel: d_v 48 / 64 / 128 take the vector path (blocks of 16 packed two at a time, and
    one alone at 48), the same state zero-padded to d_v + 8 the scalar loops; the first d_v columns must agree bit
    for bit, codes and scales of every width included."""
    if not su.water_vector_path(dv):
        pytest.skip("no AVX-512 VBMI here: both shapes take the scalar loops")
    rng = np.random.default_rng(17)
    b, h, dk = 2, 2, 32
    widths = _water_widths(rng, h, dk)
    start = (rng.normal(size=(b, h, dk, dv)) * 0.3).astype(np.float32)
    padded = np.concatenate([start, np.zeros((b, h, dk, 8), np.float32)], axis=-1)
    fast, scalar = su.WaterState.from_float(start, widths), su.WaterState.from_float(padded, widths)
    assert not su.water_vector_path(dv + 8)
    for q, k, v, g, beta, v_pad in _padded_steps(rng, b, h, dk, dv, kda):
        o_fast = su.step_water(fast, q, k, v, g, beta, threads=1)
        o_scalar = su.step_water(scalar, q, k, v_pad, g, beta, threads=1)
        np.testing.assert_array_equal(o_fast, o_scalar[..., :dv])
        np.testing.assert_array_equal(fast.to_float(), scalar.to_float()[..., :dv])
        for k_ in fast.codes:
            np.testing.assert_array_equal(fast.scales[k_], scalar.scales[k_])
            rows_fast = fast.codes[k_].reshape(-1, dv * k_ // 8)
            rows_scalar = scalar.codes[k_].reshape(-1, (dv + 8) * k_ // 8)
            np.testing.assert_array_equal(rows_fast, rows_scalar[:, : dv * k_ // 8])


def test_water_state_is_the_runtime_storage_and_refuses_bad_widths():
    from accel.runtime.state_cache import StateScheme
    from accel.runtime.state_shapes import StateShape

    rng = np.random.default_rng(19)
    widths = _water_widths(rng, 2, 16)
    s = (rng.normal(size=(2, 2, 16, 64)) * 0.3).astype(np.float32)
    state = su.WaterState.from_float(s, widths)
    shape = StateShape(arch="gdn", layers=(0,), heads=2, d_k=16, d_v=64)
    scheme = StateScheme(shape, low="int8", row_formats={0: [f"int{k}" for k in widths.reshape(-1)]})
    stored = scheme.store(0, torch.from_numpy(s))
    assert stored.nbytes == state.nbytes
    for k in state.codes:
        np.testing.assert_array_equal(
            stored.parts[f"int{k}.codes"].contiguous().view(torch.uint8).numpy().reshape(-1), state.codes[k])
    np.testing.assert_array_equal(scheme.load(0, stored).numpy(), state.to_float())
    with pytest.raises(ValueError, match="2..16"):
        su.WaterState.from_float(s, np.full((2, 16), 17))
    with pytest.raises(ValueError, match="read-only"):
        state.width[3] = 9  # the streams are laid out by the widths: they cannot change under them
    inp = _step_inputs(rng, 2, 2, 16, 64, False)
    before = {k: c.copy() for k, c in state.codes.items()}
    bad = state.width.copy()
    bad[3] = 1  # a width outside 2..16 reaches the kernel: refused, nothing written
    with pytest.raises(ValueError, match="2..16"):
        su.step_water(dataclasses.replace(state, width=bad), *inp)
    moved = state.width.copy()
    moved[3] = 2 if moved[3] != 2 else 3  # a row moved to another width's stream: refused before the kernel
    with pytest.raises(ValueError, match="do not match"):
        su.step_water(dataclasses.replace(state, width=moved), *inp)
    assert all((before[k] == state.codes[k]).all() for k in before)


@pytest.mark.parametrize("kda", [False, True])
def test_float32_step_matches_reference_and_torch(kda):
    rng = np.random.default_rng(3)
    s = (rng.normal(size=(2, 4, 32, 16)) * 0.3).astype(np.float32)
    inp = _step_inputs(rng, 2, 4, 32, 16, kda)
    o_ref, s_ref = su.reference_step(s, *inp)
    o_t, s_t = su.step_torch(torch.from_numpy(s), *(torch.from_numpy(np.asarray(x, dtype=np.float32))
                                                    for x in inp))
    o = su.step_f32(s, *inp, threads=1)
    np.testing.assert_allclose(o, o_ref, atol=1e-5)
    np.testing.assert_allclose(s, s_ref, atol=1e-5)
    np.testing.assert_allclose(o_t.numpy(), o_ref, atol=1e-5)
    np.testing.assert_allclose(s_t.numpy(), s_ref, atol=1e-5)


def test_mixed_state_storage_bits():
    high = np.zeros((32, 128), dtype=np.uint8)
    high.reshape(-1)[: int(0.225 * 32 * 128)] = 1
    state = su.MixedState.from_float(np.zeros((1, 32, 128, 128), np.float32), high)
    assert state.bits_per_value == pytest.approx(9.9, abs=0.01)
    with pytest.raises(ValueError, match="do not fit"):
        su.step_mixed(state, *(np.zeros(s) for s in [(1, 32, 64), (1, 32, 64), (1, 32, 128), (1, 32), (1, 32)]))


def needs_triton(test):
    """The Triton tests: marked `gpu`, run on a GPU or under Triton's interpreter, skipped otherwise."""
    skip = pytest.mark.skipif(not state_update_triton.available(),
                              reason="needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)")
    return pytest.mark.gpu(skip(test))


def _on_device(*arrays, dtype=None):
    """Copies of numpy arrays on the Triton kernels' device (a GPU, or the CPU under the interpreter)."""
    where = state_update_triton.device()
    return [torch.from_numpy(np.array(a, dtype=dtype)).to(where) for a in arrays]


@needs_triton
@pytest.mark.parametrize("kda", [False, True])
def test_triton_step_matches_reference(kda):  # pragma: no cover - needs Triton
    rng = np.random.default_rng(5)
    b, h, dk, dv = 2, 8, 64, 64
    high = (rng.random((h, dk)) < 0.2).astype(np.uint8)
    state = su.MixedState.from_float(rng.normal(size=(b, h, dk, dv)) * 0.3, high)
    inp = _step_inputs(rng, b, h, dk, dv, kda)
    o_ref, s_ref = su.reference_step(state.to_float(), *inp)
    dev = _on_device(state.slot, state.hi.view(np.float16), state.lo, state.lo_scale.view(np.float16))
    o = state_update_triton.step_mixed_triton(*dev, *_on_device(*inp, dtype=np.float32))
    np.testing.assert_allclose(o.cpu().numpy(), o_ref, atol=1e-5 * np.abs(o_ref).max())
    state.hi[...] = dev[1].cpu().numpy().view(np.uint16)
    state.lo[...] = dev[2].cpu().numpy()
    state.lo_scale[...] = dev[3].cpu().numpy().view(np.uint16)
    np.testing.assert_allclose(state.to_float(), s_ref, atol=np.abs(s_ref).max() / 127)


@needs_triton
@pytest.mark.parametrize("kda", [False, True])
def test_triton_float32_step_matches_reference(kda):  # pragma: no cover - needs Triton
    rng = np.random.default_rng(6)
    b, h, dk, dv = 2, 4, 32, 64
    s = (rng.normal(size=(b, h, dk, dv)) * 0.3).astype(np.float32)
    inp = _step_inputs(rng, b, h, dk, dv, kda)
    o_ref, s_ref = su.reference_step(s, *inp)
    (state,) = _on_device(s)
    o = state_update_triton.step_f32_triton(state, *_on_device(*inp, dtype=np.float32))
    np.testing.assert_allclose(o.cpu().numpy(), o_ref, atol=1e-5 * np.abs(o_ref).max())
    np.testing.assert_allclose(state.cpu().numpy(), s_ref, atol=1e-5 * np.abs(s_ref).max())
