"""CPU kernels against the float64 reference: every layout, odd sizes, outputs poisoned, SIMD and scalar paths."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

from accel.errors import FormatError
from accel.formats import bitpack
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
        pytest.skip("this CPU or compiler has no SIMD path (AVX-512 or AVX2)")
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


TILED_SHAPES = [(1, 64), (5, 200), (17, 128), (33, 96), (40, 1024)]
TILED = [  # (levels, symmetric, group): 8, 4 and 2 bits, groups of whole 4-byte blocks, or one group a row
    (256, False, 64), (256, True, 32), (16, False, 64), (16, True, 8), (4, False, 16), (3, False, 64),
    (200, False, 4096), (16, False, 4096),
    (4, True, 128), (4, False, 32), (16, True, 32),  # the unrolled block lengths: int2 8 and 2 steps, int4 4
]


@pytest.mark.parametrize("shape", TILED_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("levels,symmetric,group", TILED)
def test_affine_tiled_integer_kernel(rng, shape, levels, symmetric, group):
    """The 16-row tile copy (integer dot products on block floating point inputs) against float64, its float
    path, and its row decode bit-exact with the format's."""

    lib = _build.library()
    w = rng.standard_normal(shape)
    entry, arrays = encode_tensor("w", w, "affine", layout="packed", levels=levels, group=group,
                                  symmetric=symmetric)
    parts = _parts(entry, arrays)
    kw = _check_matvec(entry, parts, rng)
    if not lib.accel_tiled_kinds() & (1 << bitpack.bits_for_levels(levels)):
        pytest.skip("this CPU or compiler has no integer tile kernel for these codes (AVX-512 VNNI or AVX2)")
    assert kw.tiled
    tile = np.full(shape, np.nan, dtype=np.float32)
    kw.decode_rows_ptr(0, shape[0], tile.ctypes.data)
    assert np.array_equal(tile, decode_parts(entry, parts))
    # inputs with outliers (one element 1e4 times the rest in some groups) and with zero groups
    x = rng.standard_normal(shape[1]).astype(np.float32)
    x[:: max(1, shape[1] // 3)] *= 1e4
    x[: min(group, shape[1]) // 2] = 0.0
    ref = reference_matvec(entry, parts, x)
    out = kw.matvec(x, np.full(shape[0], np.nan, dtype=np.float32))
    bound = np.abs(reference_weight(entry, parts)) @ np.abs(x.astype(np.float64))
    # the input's rounding is relative to the largest element of its block (<= 128 columns): within float32
    # accumulation's own error on such a dot product (sqrt(128) * 2^-24 = 7e-7 of sum |w| |x|)
    assert _rel(out, ref) < 1e-5
    assert np.linalg.norm(out - ref) / np.linalg.norm(bound) < 2e-6
    try:  # the same tiles through the float path (the one non-finite inputs take)
        lib.accel_set_simd(0)
        out_float = kw.matvec(x, np.full(shape[0], np.nan, dtype=np.float32))
    finally:
        lib.accel_set_simd(1)
    assert np.linalg.norm(out_float - ref) / np.linalg.norm(bound) < 2e-6
    x[shape[1] // 2] = np.inf
    assert not np.isfinite(kw.matvec(x)).any()


@pytest.mark.parametrize("shape,group", [((9, 203), 4096), ((33, 1004), 12), ((16, 4100), 4), ((700, 2052), 36)])
def test_int8_tiles_at_odd_widths(rng, shape, group):
    """8-bit tiles (on AVX2: 16-bit input pieces, 8 columns a vector) where a block or the row ends 4 columns into
    a vector, which writes one step of input only, and on enough rows for both threads."""
    lib = _build.library()
    if not lib.accel_tiled_kinds() & (1 << 8):
        pytest.skip("this CPU or compiler has no 8-bit integer tile kernel (AVX-512 VNNI or AVX2)")
    w = rng.standard_normal(shape)
    entry, arrays = encode_tensor("w", w, "affine", layout="packed", levels=256, group=group)
    parts = _parts(entry, arrays)
    kw = _check_matvec(entry, parts, rng)
    assert kw.tiled
    x = rng.standard_normal(shape[1]).astype(np.float32)
    x[::7] *= 1e4
    ref = reference_matvec(entry, parts, x)
    bound = np.abs(reference_weight(entry, parts)) @ np.abs(x.astype(np.float64))
    for _ in range(3):
        out = kw.matvec(x, np.full(shape[0], np.nan, dtype=np.float32))
        assert _rel(out, ref) < 1e-5 and np.linalg.norm(out - ref) / np.linalg.norm(bound) < 2e-6


@pytest.mark.parametrize("symmetric,group", [(False, 64), (True, 128), (False, 32), (False, 16), (True, 4096)])
def test_int2_field_extractions_agree_bit_for_bit(rng, symmetric, group):
    """The two ways the VNNI tiles take 2-bit fields out of a byte (one bit-matrix product, or a shift and an AND:
    the CPU decides which runs) give the same bits, at every unrolled block length and the generic loop."""

    lib = _build.library()
    shape = (37, 4096 if group == 4096 else 1000)
    entry, arrays = encode_tensor("w", rng.standard_normal(shape), "affine", layout="packed", levels=4, group=group,
                                  symmetric=symmetric)
    parts = _parts(entry, arrays)
    if not lib.accel_tiled_kinds() & (1 << 2) or lib.accel_simd_available() != 512:
        pytest.skip("this CPU or compiler has no VNNI tile kernel for 2-bit codes")
    from accel.kernels import kernel_weight

    kw = kernel_weight(entry, parts)
    assert kw.tiled
    x = rng.standard_normal(shape[1]).astype(np.float32)
    native = lib.accel_fields_by_shift(-1)
    outs = {}
    try:
        for mode in (0, 1):
            assert lib.accel_fields_by_shift(mode) == mode
            outs[mode] = kw.matvec(x, np.full(shape[0], np.nan, dtype=np.float32))
    finally:
        lib.accel_fields_by_shift(native)
    assert np.array_equal(outs[0], outs[1])
    assert _rel(outs[0], reference_matvec(entry, parts, x)) < 1e-5


@pytest.mark.parametrize("shape", [(1, 23), (17, 200), (40, 1027)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("symmetric,group", [(False, 64), (True, 7), (False, 4096), (True, 45), (False, 100),
                                             (True, 256), (False, 192)])
def test_base3_tile_copy(rng, shape, symmetric, group):
    """Base-3 codes in 16-row tiles (five blocks' digits a byte, integer products): blocks of whole and partial
    dwords, several blocks a group, one group a row, odd widths, super-blocks short of blocks; decode bit-exact; the
    float path over the tiles."""
    lib = _build.library()
    w = rng.standard_normal(shape)
    entry, arrays = encode_tensor("w", w, "affine", layout="base", levels=3, group=group, symmetric=symmetric)
    parts = _parts(entry, arrays)
    kw = _check_matvec(entry, parts, rng)
    if not lib.accel_tiled_kinds() & (1 << 3):
        pytest.skip("this CPU or compiler has no base-3 tile kernel (AVX-512 VNNI)")
    assert kw.tiled == "base3"
    tile = np.full(shape, np.nan, dtype=np.float32)
    kw.decode_rows_ptr(0, shape[0], tile.ctypes.data)
    assert np.array_equal(tile, decode_parts(entry, parts))
    x = rng.standard_normal(shape[1]).astype(np.float32)
    ref = reference_matvec(entry, parts, x)
    try:
        lib.accel_set_simd(0)
        out_float = kw.matvec(x, np.full(shape[0], np.nan, dtype=np.float32))
    finally:
        lib.accel_set_simd(1)
    bound = np.abs(reference_weight(entry, parts)) @ np.abs(x.astype(np.float64))
    assert np.linalg.norm(out_float - ref) / np.linalg.norm(bound) < 1e-6


def _base3_steps(cols: int, width: int) -> int:
    """Steps a row of the base-3 "planes" tile copy takes: super-blocks of 5 blocks, ceil(width / 4) steps each."""
    blocks = -(-cols // width)
    return -(-blocks // 5) * -(-width // 4)


def test_base3_block_width_keeps_blocks_inside_groups():
    """The base-3 tiles' input blocks (a block's sums share one input exponent and one scale): inside one group, at
    most 128 columns, whole dwords with one group a row, and never needing more steps than the widest choice."""
    lib = _build.library()
    for cols in (1, 4, 23, 200, 576, 1027, 1536, 4096, 14336):
        for group in (1, 7, 32, 45, 64, 100, 128, 256, 1 << 20):
            width = lib.accel_base3_block_width(cols, group)
            assert 1 <= width <= 128
            if -(-cols // group) > 1:
                assert group % width == 0 and not any(group % w == 0 for w in range(width + 1, 129))
            else:
                assert width % 4 == 0 and _base3_steps(cols, width) <= _base3_steps(cols, 128)


@pytest.mark.parametrize("shape", [(1, 23), (17, 200), (40, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("levels,layout,symmetric,group", [(256, "packed", False, 64), (16, "packed", True, 32),
                                                           (4, "packed", False, 16), (3, "base", False, 45),
                                                           (3, "base", True, 7), (5, "base", False, 16)])
def test_affine_stored_layout_is_recovered(rng, shape, levels, layout, symmetric, group):
    """The Triton path reads the stored layout; where the CPU tile copy replaced it, stored() gives it back
    bit-exactly (the tile copy is a bijection on the stored bytes)."""
    from accel.kernels import kernel_weight

    entry, arrays = encode_tensor("w", rng.standard_normal(shape), "affine", layout=layout, levels=levels,
                                  group=group, symmetric=symmetric)
    parts = _parts(entry, arrays)
    kw = kernel_weight(entry, parts)
    got = kw.stored()
    assert sorted(got) == sorted(parts)
    for name, part in parts.items():
        assert np.array_equal(got[name].reshape(-1).view(np.uint8), np.ascontiguousarray(part).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("levels,layout", [(16, "packed"), (3, "base")])
def test_affine_float32_scales(simd, rng, levels, layout):
    w = rng.standard_normal((19, 70)) * 1e7  # steps too large for fp16 scales: the codec stores float32
    for symmetric in (False, True):
        entry, arrays = encode_tensor("w", w, "affine", layout=layout, levels=levels, group=32, symmetric=symmetric)
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


def test_leech_planes_tile_copy(rng):
    """4-plane stages read a 16-row tile copy of their planes (AVX-512: GFNI bit transpose + integer products; AVX2:
    byte subset-sum tables): against float64 with rows and a width past whole tiles and steps, next to a gathered
    3-plane stage; a non-finite input takes the float path."""

    lib = _build.library()
    w = rng.standard_normal((37, 200))  # 3 tiles, the last of 5 rows; 216 columns = 27 bytes a plane row
    for shells in ((13,), (13, 3)):
        entry, arrays = encode_tensor("w", w, "leech", layout="planes", shells=shells, seed_in=3, seed_out=4)
        kw = _check_matvec(entry, _parts(entry, arrays), rng)
        if not lib.accel_leech_tiles_available():
            pytest.skip("this CPU or compiler has no AVX-512 VNNI + GFNI path")
        assert len(kw.tiled) == 1
        x = rng.standard_normal(200).astype(np.float32)
        x[7] = np.nan
        assert not np.isfinite(kw.matvec(x)).any()


def _extreme_leech_codes(layout: str, v: int | None, n: int, rng) -> np.ndarray:
    """A stage's stored codes for n blocks with every coordinate's v (x = 2 v + p) at v, or random (v None): planes
    of v's bits, or onehot masks, sign and parity; not lattice points, which the kernels need not be."""
    from accel.formats.leech_codec import LeechOneHotLayout, _plane_bits

    parity = rng.integers(0, 256, size=-(-n // 8), dtype=np.uint8)
    if layout == "planes":
        assert _plane_bits(13) == 4
        if v is None:
            return np.concatenate([rng.integers(0, 256, size=4 * 3 * n, dtype=np.uint8), parity])
        return np.concatenate([np.full(3 * n, 255 * ((v >> j) & 1), dtype=np.uint8) for j in range(4)] + [parity])
    K = LeechOneHotLayout(13)._levels()
    if v is None:  # a random magnitude k in 0..K a coordinate, random signs
        k = rng.integers(0, K + 1, size=24 * n)
        masks = [np.packbits(k == level, bitorder="little") for level in range(1, K + 1)]
        return np.concatenate(masks + [rng.integers(0, 256, size=3 * n, dtype=np.uint8), parity])
    # v = 6 (k = K, positive) or v = -7 (k = K, negative, odd parity: x = -13): the ends onehot reaches
    full, empty = np.full(3 * n, 255, dtype=np.uint8), np.zeros(3 * n, dtype=np.uint8)
    masks = [full if level == K else empty for level in range(1, K + 1)]
    return np.concatenate(masks + [full if v < 0 else empty, np.full(-(-n // 8), 255 if v < 0 else 0, np.uint8)])


@pytest.mark.parametrize("rows,cols", [(16, 48), (21, 72), (40, 264)])
def test_planes_tile_orders_hold_the_same_bits(rng, rows, cols):
    """The AVX2 build's 4-plane tile copy (lane order) is the AVX-512 copy's bytes moved, with plane 3 complemented:
    checked on any CPU, whichever order this machine's kernels read."""
    from accel.kernels.weights import _LANE_ROWS, _planes_tiles

    stream = rng.integers(0, 256, size=4 * rows * cols // 8, dtype=np.uint8)
    qwords = _planes_tiles(stream, rows, cols)
    lanes = _planes_tiles(stream, rows, cols, lane_order=True)
    assert lanes.size == qwords.size
    # the AVX-512 order: byte 7 - (4a + j) of a row's qword is plane j's byte 2s + a; reversed, index 4a + j
    q = qwords.reshape(-1, 2, 8, 8)[..., ::-1].reshape(-1, 2, 8, 2, 4)  # (tile, step), half, row, a, plane j
    lane = lanes.reshape(-1, 2, 2, 8, 4).copy()  # (tile, step), half, a, row (in _LANE_ROWS order), plane 3 - i
    lane[..., 0] ^= 0xFF
    expect = q[:, :, _LANE_ROWS].transpose(0, 1, 3, 2, 4)[..., ::-1]
    assert np.array_equal(lane, expect)
    assert not np.array_equal(lanes, qwords)
    lib = _build.library()  # the AVX2 build reads the lane order, the AVX-512 one (and the scalar paths) the qwords
    assert lib.accel_leech_planes_lane_order() == int(lib.accel_simd_available() == 256)


@pytest.mark.parametrize("layout,v", [("planes", 7), ("planes", -8), ("planes", None), ("onehot", 6),
                                      ("onehot", -7), ("onehot", None)])
@pytest.mark.parametrize("sign", [1.0, -1.0, None])
def test_leech_tiles_at_their_integer_bounds(rng, layout, v, sign):
    """The integer tile kernels at the ends of their ranges: every coordinate's v at its largest or smallest value
    with every rotated input z just below a power of two (the largest rounded digits), all of one sign (or random),
    so that the int8 digit sums, the 16-bit block sums and the int32 row sums reach their bounds; agrees with the
    scalar float path, which has no integers."""
    from accel.formats.tensor import TensorEntry
    from accel.kernels import kernel_weight

    lib = _build.library()
    if not lib.accel_leech_tiles_available():
        pytest.skip("this CPU or compiler has no Leech tile kernels")
    rows, cols = 40, 480  # 20 blocks: 3 steps past whole 128-coordinate blocks; no column padding
    n = rows * cols // 24
    z = np.where(rng.random(cols) < 0.5, -1.999, 1.999) if sign is None else np.full(cols, 1.999 * sign)
    params = {"stages": [{"max_shell": 13, "alpha": 0.5}], "cols": cols, "seed_in": 3, "seed_out": 4,
              "scale_dtype": "float16"}
    entry = TensorEntry("w", "leech", params, (rows, cols), layout, "quantized")
    codes = _extreme_leech_codes(layout, v, n, rng)
    # check=False: coordinates at the planes' bounds are not points of the Leech ball, and no writer stores them
    kw = kernel_weight(entry, {"codes": codes, "scale": np.full(rows, 1.0, dtype=np.float16)}, check=False)
    assert len(kw.tiled) == 1
    x = rht(z, 3, inverse=True).astype(np.float32)  # so that the kernel's z = V x is z again
    out = kw.matvec(x)
    lib.accel_set_simd(0)
    try:
        ref = kw.matvec(x)
    finally:
        lib.accel_set_simd(1)
    assert _rel(out, ref) < 1e-5


def test_leech_tiles_of_many_rows(simd, rng):
    """More than one 16-row tile with a short last one, and rows whose byte count is not a multiple of 4."""
    w = rng.standard_normal((50, 120))
    for layout in ("planes", "onehot"):
        entry, arrays = encode_tensor("w", w, "leech", layout=layout, shells=(13, 3), seed_in=1, seed_out=2)
        _check_matvec(entry, _parts(entry, arrays), rng)


def _random_leech(rows, cols, width, layout, rng):
    """A leech weight of random ball indices stored `width` wide, whatever width accel quantize would pick now (the
    format-version-1 width of 4100 columns, 4104, is still served)."""
    from accel.formats.codecs import get_codec
    from accel.formats.leech_codec import ball_levels
    from accel.formats.tensor import TensorEntry

    params = {"stages": [{"max_shell": 13, "alpha": 0.5}], "cols": width, "seed_in": 6, "seed_out": 7,
              "scale_dtype": "float16"}
    indices = rng.integers(0, ball_levels(13), size=rows * width // 24, dtype=np.uint64)
    parts = {"codes": get_codec("leech").layout_for(layout, "codes", params).pack(indices, ball_levels(13)),
             "scale": (rng.random(rows) + 0.5).astype(np.float16)}
    return TensorEntry("w", "leech", params, (rows, cols), layout, "quantized"), parts


@pytest.mark.parametrize("layout", ["planes", "onehot"])
@pytest.mark.parametrize("cols,width", [(744, 744), (1104, 1104), (4100, 4104), (4096, 4128)], ids=lambda c: f"{c}")
def test_leech_matvec_odd_rotations(simd, rng, cols, width, layout):
    """Input transforms whose odd factor is a dense rotation large enough to be split between threads: 744 = 8 * 93
    (the narrow path for 8-wide vectors), 1104 = 16 * 69 (eight rows a block), 4104 = 8 * 513 (4096 columns as
    format version 1 stored them), 4128 = 32 * 129 (as version 2 does); the tiles' steps come in odd counts of blocks and chunks with a short last one
    (read in two halves)."""
    from accel.kernels import set_threads

    entry, parts = _random_leech(21, cols, width, layout, rng)
    set_threads(2)
    try:
        _check_matvec(entry, parts, rng)
    finally:
        set_threads(0)


def test_leech_call_bytes_count_the_transforms(rng):
    """What one Leech matvec reads: the stored parts, plus both sign vectors and each odd-factor rotation (m > 1)."""
    from accel.kernels import kernel_weight

    entry, arrays = encode_tensor("w", rng.standard_normal((21, 100)), "leech", shells=(13,), seed_in=6, seed_out=7)
    kw = kernel_weight(entry, _parts(entry, arrays))
    cols = int(entry.params["cols"])  # 120 = 8 * 15; 21 rows: odd factor 21
    assert kw.call_bytes - kw.nbytes == 4 * (cols + 21) + 4 * (15 * 15 + 21 * 21)
    affine, arrays = encode_tensor("a", rng.standard_normal((8, 64)), "affine", levels=16, group=32)
    aw = kernel_weight(affine, _parts(affine, arrays))
    assert aw.call_bytes == aw.nbytes


@pytest.mark.parametrize("n", [1, 8, 23, 24, 96, 432, 576, 1104, 1536, 4104])
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


@pytest.mark.parametrize("rows,cols", [(1, 24), (37, 96), (1030, 48), (40, 1560)])
def test_leech_nibble_copy_holds_the_plane_bits(rng, rows, cols):
    """The GPU copy of a 4-plane stage (`leech_nibbles`, NumPy, any machine) holds every coordinate's v + 8 in its
    nibble and every block's parity bit, in 32-row tiles: decoded back, the lattice points of the stored planes,
    bit for bit, and v = 0 with parity 0 in the padding rows. 1030 rows cross the conversion's 1024-row chunks,
    1560 columns (65 blocks) three parity words."""
    from accel.formats.leech_codec import LeechPlanesLayout, ball_levels
    from accel.kernels.triton_kernels import leech_nibbles

    layout, levels, count = LeechPlanesLayout(12), ball_levels(12), rows * cols // 24
    indices = rng.integers(0, levels, size=count, dtype=np.uint64)
    stream = layout.pack(indices, levels)
    points = layout._points(indices).astype(np.int64).reshape(rows, cols)
    nib, par = leech_nibbles(stream, rows, cols)
    tiles, nblk = -(-rows // 32), cols // 24
    assert nib.dtype == par.dtype == np.uint32
    assert nib.shape == (tiles, cols // 8, 32) and par.shape == (tiles, -(-nblk // 32), 32)
    words = nib.transpose(0, 2, 1).reshape(32 * tiles, cols // 8)  # [row, k]
    v = ((words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).astype(np.int64).reshape(-1, cols) - 8
    block = np.arange(nblk)
    pwords = par.transpose(0, 2, 1).reshape(32 * tiles, -1)
    parity = ((pwords[:, block // 32] >> (block % 32).astype(np.uint32)) & 1).astype(np.int64)
    x = 2 * v + np.repeat(parity, 24, axis=1)
    assert np.array_equal(x[:rows], points)
    assert not x[rows:].any()
    tail = nblk % 32
    assert tail == 0 or not (pwords[:, -1] >> np.uint32(tail)).any()  # the padding bits are zero


def test_half_to_float_exhaustive():
    lib = _build.library()
    bits = np.arange(1 << 16, dtype=np.uint16)
    expect = bits.view(np.float16).astype(np.float32)
    got = np.array([lib.accel_half_to_float(int(b)) for b in bits], dtype=np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(expect))
    ok = ~np.isnan(expect)
    assert np.array_equal(got[ok].view(np.uint32), expect[ok].view(np.uint32))


def test_matvec_arguments(rng):
    """x may be read-only, strided or another dtype (it is copied to contiguous float32); out must be a writable
    float32 vector of the right length, else a clean ValueError before the kernel writes anything."""
    from accel.kernels import kernel_weight
    from accel.kernels.weights import ptr

    entry, arrays = encode_tensor("w", rng.standard_normal((20, 64)), "affine", levels=4, group=32)
    parts = _parts(entry, arrays)
    kw = kernel_weight(entry, parts)
    x = rng.standard_normal(128)
    ref = reference_matvec(entry, parts, x[::2].astype(np.float32))
    ro = x[::2].astype(np.float32)
    ro.flags.writeable = False
    for arg in (x[::2], ro):
        assert _rel(kw.matvec(arg), ref) < 1e-5
    frozen = np.zeros(20, dtype=np.float32)
    frozen.flags.writeable = False
    for bad in (frozen, np.zeros(19, dtype=np.float32), np.zeros(20, dtype=np.float64)):
        with pytest.raises(ValueError):
            kw.matvec(ro, bad)
    assert not frozen.any()
    assert ptr(ro) == ro.ctypes.data and ptr(frozen) == frozen.ctypes.data  # read-only arrays: the slow address
    out = np.empty(20, dtype=np.float32)
    assert ptr(out) == out.ctypes.data


def test_unsupported_layouts_are_refused(rng):
    from accel.kernels import Unsupported, kernel_weight

    entry, arrays = encode_tensor("w", rng.standard_normal((4, 8)), "affine", layout="onehot", levels=4, group=8)
    with pytest.raises(Unsupported):
        kernel_weight(entry, _parts(entry, arrays))
    entry, arrays = encode_tensor("w", rng.standard_normal((4, 8)), "raw")
    with pytest.raises(Unsupported):
        kernel_weight(entry, _parts(entry, arrays))


def _xor(byte: int, mask: int):
    def damage(flat: np.ndarray) -> None:
        flat[byte] ^= mask
    return damage


def _set(byte: int, value: int):
    def damage(flat: np.ndarray) -> None:
        flat[byte] |= value
    return damage


@pytest.mark.parametrize("codec,layout,params,damage,message", [
    ("leech", "planes", {"shells": (13,)}, _xor(0, 1), "not a point of the ball"),
    ("leech", "onehot", {"shells": (13,)}, _xor(0, 1), "(not a point of the ball|two magnitudes)"),
    ("leech", "planes", {"shells": (13, 3)}, _xor(3, 0x10), "not a point of the ball"),  # the second stage
    ("affine", "packed", {"levels": 5, "group": 8}, _set(0, 0x7), "past the codec's 5 levels"),
    ("affine", "base", {"levels": 3, "group": 64}, _set(0, 0xFF), "group value past"),  # 255 >= 3^5
    ("affine", "base", {"levels": 5, "group": 8}, _set(0, 0x7F), "group value past"),  # 7 bits: 127 >= 5^3
])
def test_kernels_refuse_codes_the_format_refuses(rng, codec, layout, params, damage, message):
    """The kernels read stored codes as they are; a code every other reader refuses (a vector outside the Leech
    ball, an affine code past L) is refused at load too, naming the tensor: `eval --kernels` computed with them."""
    from accel.kernels import kernel_weight

    entry, arrays = encode_tensor("w", rng.standard_normal((20, 64)), codec, layout=layout, **params)
    parts = _parts(entry, arrays)
    kernel_weight(entry, parts)  # as written: served
    stream = "codes" if codec == "affine" or len(params["shells"]) == 1 else "codes2"
    parts[stream] = np.array(parts[stream], copy=True)
    damage(parts[stream].reshape(-1))
    with pytest.raises(FormatError, match=f"tensor 'w': .*{message}"):
        kernel_weight(entry, parts)
    with pytest.raises(FormatError, match=message):  # what the format's own decode says of it
        decode_parts(entry, parts)


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_KERNEL_CACHE", str(tmp_path))
    path = _build.library_path()
    assert path.parent == tmp_path and path.is_file()
    assert _build.library_path() == path  # same key, no rebuild
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left behind


def _refusing_cc(path, refused: list[str]) -> str:
    """A gcc that fails on the given options, as Apple's clang does on -fopenmp (and older ones on -march=native)."""
    tests = "".join(f'  if [ "$a" = {flag} ]; then echo "clang: error: unsupported option \'{flag}\'" >&2; exit 1; fi\n'
                    for flag in refused)
    path.write_text(f'#!/bin/sh\nfor a in "$@"; do\n{tests}done\nexec gcc "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("compiler", ["no-openmp", "no-openmp-no-native", "clang", "clang-x86-64"])
def test_other_compilers_build_working_kernels(compiler, tmp_path, monkeypatch, rng):
    """A compiler that refuses -fopenmp (as Apple's clang does) gets a one-thread build, one that also refuses
    -march=native a build for the baseline target, and clang (where installed) builds both sources, also for
    baseline x86-64 (where clang 14 has no _Float16); the kernels each builds agree with float64 on an affine and a
    Leech weight."""
    import platform

    from accel.kernels import state_update, weights

    if compiler.endswith("no-native") and os.environ.get("ACCEL_KERNEL_ARCH"):
        pytest.skip("the -march fallback is for the default target only")  # the other cases build for the one set
    if compiler.startswith("clang"):
        cc = shutil.which("clang") or shutil.which("clang-14")
        if not cc:
            pytest.skip("no clang on PATH")
        if compiler.endswith("x86-64"):
            if platform.machine() != "x86_64":
                pytest.skip("an x86-64 target")
            monkeypatch.setenv("ACCEL_KERNEL_ARCH", "x86-64")
    else:
        refused = ["-fopenmp"] + (["-march=native"] if compiler.endswith("no-native") else [])
        cc = _refusing_cc(tmp_path / "cc", refused)
    monkeypatch.setenv("CC", cc)
    monkeypatch.setenv("ACCEL_KERNEL_CACHE", str(tmp_path / "cache"))
    lib = _build.load(_build.library_path())
    if not compiler.startswith("clang"):
        assert lib.accel_openmp_available() == 0
    if compiler.endswith("no-native"):
        assert lib.accel_simd_available() == 0  # x86-64 baseline: the scalar paths
    elif not compiler.startswith("clang"):  # the target asked for, without OpenMP
        assert lib.accel_simd_available() == _build.library().accel_simd_available()
    assert _build.library_path(state_update.SOURCE, "state_update").is_file()
    monkeypatch.setattr(weights, "library", lambda: lib)
    w = rng.standard_normal((37, 120))
    for codec, kw in (("affine", {"levels": 16, "group": 32}), ("leech", {"shells": (13,), "layout": "planes"})):
        entry, arrays = encode_tensor("w", w, codec, **kw)
        assert _check_matvec(entry, _parts(entry, arrays), rng)._lib is lib


def test_sources_compile_for_aarch64(tmp_path):
    """Both C sources compile for 64-bit Arm (Apple silicon, Graviton: the scalar paths), with and without OpenMP,
    where a cross compiler is installed (Debian's gcc-aarch64-linux-gnu)."""
    import subprocess

    from accel.kernels import state_update

    cc = shutil.which("aarch64-linux-gnu-gcc")
    if not cc:
        pytest.skip("no aarch64 cross compiler")
    for source in (_build.SOURCE, state_update.SOURCE):
        for omp in (["-fopenmp"], []):
            flags = [f for f in _build.FLAGS if f != "-fopenmp"] + omp + ["-march=armv8-a", "-Werror"]
            run = subprocess.run([cc, *flags, "-o", str(tmp_path / "k.so"), str(source), "-lm"], check=False,
                                 capture_output=True, text=True)
            assert run.returncode == 0, run.stderr


def test_build_key_covers_every_part_the_source_includes(tmp_path, monkeypatch):
    """accel_kernels.c #includes its family parts: an edit to any of them (or to a header) must build anew, and the
    key of a copy (bench/kernel_ab.py's revisions) is taken from the copy's own parts."""
    monkeypatch.setenv("ACCEL_KERNEL_CACHE", str(tmp_path / "cache"))
    def touch(cc, source, target):  # the key is under test, not gcc
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"")

    monkeypatch.setattr(_build, "_build", touch)
    copy = tmp_path / "csrc"
    shutil.copytree(_build.SOURCE.parent, copy)
    parts = {p.name for p in _build.included_files(copy / "accel_kernels.c")}
    included = set(re.findall(r'#include "([^"]+)"', (copy / "accel_kernels.c").read_text()))
    assert included <= parts and "base3_tiles.c" in parts and "accel_kernels.c" not in parts
    first = _build.library_path(copy / "accel_kernels.c")
    assert _build.library_path(copy / "accel_kernels.c") == first
    for name in sorted(included):
        with open(copy / name, "a") as f:
            f.write("\n/* edited */\n")
        assert _build.library_path(copy / "accel_kernels.c") != first, name
        first = _build.library_path(copy / "accel_kernels.c")


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(_build.shutil, "which", lambda name: None)
    with pytest.raises(_build.KernelUnavailable, match="need a C compiler"):
        _build.library_path()


@pytest.mark.parametrize("arch, width, needs", [("x86-64", 0, set()), ("x86-64-v3", 256, {"avx2", "fma", "f16c"})])
def test_build_target_sets_the_simd_paths(arch, width, needs, monkeypatch, tmp_path):
    """ACCEL_KERNEL_ARCH picks the -march target, and the library reports the vector width that target compiles
    in: the scalar paths alone for baseline x86-64, the AVX2 paths (without AVX-512) for x86-64-v3, which is how
    `make test` runs this file on the AVX2 paths of an AVX-512 machine."""
    import ctypes
    import platform

    if platform.machine() != "x86_64" or not needs <= _build.cpu_flags():
        pytest.skip(f"{arch} code does not run on this CPU")
    monkeypatch.setenv("ACCEL_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("ACCEL_KERNEL_ARCH", arch)
    assert f"-march={arch}" in _build.flags()
    lib = ctypes.CDLL(str(_build.library_path()))
    assert lib.accel_simd_available() == width


def test_build_target_name_is_checked(monkeypatch):
    monkeypatch.setenv("ACCEL_KERNEL_ARCH", "native -fplugin=x.so")
    with pytest.raises(_build.KernelUnavailable, match="ACCEL_KERNEL_ARCH"):
        _build.flags()
