"""CPU kernels against the float64 reference: every layout, odd sizes, outputs poisoned, SIMD and scalar paths."""

from __future__ import annotations

import numpy as np
import pytest

from accel.formats.tensor import decode_parts, encode_tensor
from accel.kernels import _build
from accel.kernels.reference import reference_matvec, reference_weight
from accel.quantize.incoherence import rht

pytestmark = pytest.mark.skipif(not _build.compiler_available(), reason="no C compiler for the accel CPU kernels")

SHAPES = [(37, 53), (17, 47), (33, 49), (1, 97), (40, 96), (5, 23)]  # 24k +- 1 columns, rows of no pattern
AFFINE = [  # (levels, layout, symmetric, group)
    (256, "packed", False, 64), (16, "packed", False, 64), (4, "packed", False, 64), (16, "packed", True, 7),
    (8, "packed", False, 16), (4, "packed", False, 6), (256, "packed", True, 5), (3, "base", False, 64),
    (5, "base", True, 10), (7, "base", False, 16), (20, "base", False, 8),
]
LEECH = [((13,), "planes"), ((13,), "onehot"), ((13,), "packed"), ((13, 3), "planes"), ((13, 3), "onehot"),
         ((13, 13), "planes"), ((13, 13), "onehot")]


@pytest.fixture(params=[1, 0], ids=["simd", "scalar"])
def simd(request):
    lib = _build.library()
    if request.param and not lib.accel_simd_available():
        pytest.skip("this CPU or compiler has no AVX-512 path")
    lib.accel_set_simd(request.param)
    yield request.param
    lib.accel_set_simd(1)


def _parts(entry, arrays):
    return {p: arrays[n] for p, n in entry.parts.items()}


def _rel(y, ref):
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30))


def _check_matvec(entry, parts, rng):
    from accel.kernels import kernel_weight

    kw = kernel_weight(entry, parts)
    rows, cols = entry.shape
    for _ in range(2):
        x = rng.standard_normal(cols).astype(np.float32)
        out = np.full(rows, np.nan, dtype=np.float32)  # poisoned: an unwritten element stays NaN
        kw.matvec(x, out)
        assert np.isfinite(out).all()
        ref = reference_matvec(entry, parts, x)
        if rows >= 5:
            assert _rel(out, ref) < 1e-5
        else:  # one or two outputs can cancel to nearly nothing: measure against sum |w| |x| instead
            scale = np.abs(reference_weight(entry, parts)) @ np.abs(x.astype(np.float64))
            assert np.linalg.norm(out - ref) / np.linalg.norm(scale) < 1e-6
    return kw


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("levels,layout,symmetric,group", AFFINE)
def test_affine_matvec_and_tiles(simd, rng, shape, levels, layout, symmetric, group):
    w = rng.standard_normal(shape)
    entry, arrays = encode_tensor("w", w, "affine", layout=layout, levels=levels, group=group, symmetric=symmetric)
    parts = _parts(entry, arrays)
    kw = _check_matvec(entry, parts, rng)
    tile = np.full((shape[0], shape[1]), np.nan, dtype=np.float32)
    kw.decode_rows_ptr(0, shape[0], tile.ctypes.data)
    assert np.array_equal(tile, decode_parts(entry, parts))  # bit-exact with the format's float32 decode
    if shape[0] > 3:
        assert np.array_equal(kw.decode_rows(1, 3), tile[1:3])


def test_affine_float32_scales(simd, rng):
    w = rng.standard_normal((19, 70)) * 1e5  # too large for fp16 scales: the codec stores float32
    for symmetric in (False, True):
        entry, arrays = encode_tensor("w", w, "affine", levels=16, group=32, symmetric=symmetric)
        assert entry.params["scale_dtype"] == "float32"
        _check_matvec(entry, _parts(entry, arrays), rng)


@pytest.mark.parametrize("shape", [(37, 53), (9, 25), (40, 96), (1, 23)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("shells,layout", LEECH, ids=lambda v: str(v))
def test_leech_matvec_and_tiles(simd, rng, shape, shells, layout):
    w = rng.standard_normal(shape)
    entry, arrays = encode_tensor("w", w, "leech", layout=layout, shells=shells, seed_in=5, seed_out=9)
    parts = _parts(entry, arrays)
    kw = _check_matvec(entry, parts, rng)
    t = np.full((shape[0], entry.params["cols"]), np.nan, dtype=np.float32)
    kw.decode_rows_ptr(0, shape[0], t.ctypes.data)
    dense = rht(rht(t.astype(np.float64).T, entry.params["seed_out"], inverse=True).T, entry.params["seed_in"],
                inverse=True)[:, : shape[1]]
    assert _rel(dense, reference_weight(entry, parts)) < 1e-6


def test_leech_tiles_of_many_rows(simd, rng):
    """More than one 16-row tile with a short last one, and rows whose byte count is not a multiple of 4."""
    w = rng.standard_normal((50, 120))
    for layout in ("planes", "onehot"):
        entry, arrays = encode_tensor("w", w, "leech", layout=layout, shells=(13, 3), seed_in=1, seed_out=2)
        _check_matvec(entry, _parts(entry, arrays), rng)


@pytest.mark.parametrize("n", [1, 8, 23, 24, 96, 576, 1536, 4104])
def test_rht_matches_numpy(rng, n, simd):
    from accel.kernels.weights import ptr
    from accel.quantize.incoherence import _factors, split_size

    lib = _build.library()
    signs, r = _factors(n, 77)
    x = rng.standard_normal((3, n))
    for inverse in (False, True):
        data = x.astype(np.float32)
        mat = np.ascontiguousarray(r.T if inverse else r, dtype=np.float32)
        s32 = signs.astype(np.float32)
        assert lib.accel_rht(ptr(data), 3, n, ptr(s32), ptr(mat), split_size(n)[0], int(inverse), 0) == 0
        assert _rel(data, rht(x, 77, inverse=inverse)) < 1e-6


def test_half_to_float_exhaustive():
    lib = _build.library()
    bits = np.arange(1 << 16, dtype=np.uint16)
    expect = bits.view(np.float16).astype(np.float32)
    got = np.array([lib.accel_half_to_float(int(b)) for b in bits], dtype=np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(expect))
    ok = ~np.isnan(expect)
    assert np.array_equal(got[ok].view(np.uint32), expect[ok].view(np.uint32))


def test_unsupported_layouts_are_refused(rng):
    from accel.kernels import Unsupported, kernel_weight

    entry, arrays = encode_tensor("w", rng.standard_normal((4, 8)), "affine", layout="onehot", levels=4, group=8)
    with pytest.raises(Unsupported):
        kernel_weight(entry, _parts(entry, arrays))
    entry, arrays = encode_tensor("w", rng.standard_normal((4, 8)), "raw")
    with pytest.raises(Unsupported):
        kernel_weight(entry, _parts(entry, arrays))


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_KERNEL_CACHE", str(tmp_path))
    path = _build.library_path()
    assert path.parent == tmp_path and path.is_file()
    assert _build.library_path() == path  # same key, no rebuild
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left behind


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(_build.shutil, "which", lambda name: None)
    with pytest.raises(_build.KernelUnavailable, match="need a C compiler"):
        _build.library_path()
