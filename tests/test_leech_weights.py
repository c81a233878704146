"""Leech weight quantization: float64 reference decode, layouts bit-exact both ways, padding, error feedback."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from accel.formats import encode_tensor
from accel.formats.codecs import get_codec
from accel.formats.leech_codec import BLOCK
from accel.formats.tensor import decode_parts
from accel.quantize.gptq import proxy_loss
from accel.quantize.incoherence import rht
from accel.quantize.leech import index_to_point, is_leech_point, shell_of
from accel.quantize.leech_weights import padded_width

LAYOUTS = ("packed", "planes", "onehot")


def _encode(w, shells=(13,), layout=None, hessian=None):
    return encode_tensor("w", w, "leech", layout=layout, shells=shells, seed_in=5, seed_out=9, hessian=hessian)


def _decode(entry, arrays):
    return decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})


def _reference_decode(entry, arrays) -> np.ndarray:
    """Float64 decode written from docs/format.md alone: dense transform matrices, no shared helpers."""
    rows, cols = entry.shape
    padded = entry.params["cols"]
    codec = get_codec("leech")
    streams = {p: codec.layout_for("packed", p, entry.params).unpack(arrays[f"w:{p}"], lv, n)
               for p, (lv, n) in codec.streams(entry.params, entry.shape).items()}
    total = np.zeros((rows * padded // BLOCK, BLOCK))
    for part, stage in zip(("codes", "codes2"), entry.params["stages"], strict=False):
        total += stage["alpha"] * index_to_point(streams[part], stage["max_shell"]).astype(np.float64)
    wt = total.reshape(rows, padded) * arrays["w:scale"].astype(np.float64)[:, None]
    u = rht(np.eye(rows), entry.params["seed_out"]).T  # U: column j is U e_j
    v = rht(np.eye(padded), entry.params["seed_in"]).T
    return (u.T @ wt @ v)[:, :cols]


@pytest.mark.parametrize("shells", [(13,), (13, 3), (13, 13)])
def test_decode_matches_float64_reference(rng, shells):
    w = rng.standard_normal((30, 50))
    entry, arrays = _encode(w, shells)
    ours = _decode(entry, arrays)
    ref = _reference_decode(entry, arrays)
    assert ours.dtype == np.float32 and ours.shape == w.shape
    assert np.allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_every_pair_of_layouts_roundtrips_bit_exactly(rng):
    w = rng.standard_normal((12, 72))
    codec = get_codec("leech")
    entry, arrays = _encode(w, (13, 3))
    streams = {p: codec.layout_for("packed", p, entry.params).unpack(arrays[f"w:{p}"], lv, n)
               for p, (lv, n) in codec.streams(entry.params, entry.shape).items()}
    for part, (levels, count) in codec.streams(entry.params, entry.shape).items():
        stored = {name: codec.layout_for(name, part, entry.params).pack(streams[part], levels) for name in LAYOUTS}
        for a, b in itertools.permutations(LAYOUTS, 2):
            back = codec.layout_for(a, part, entry.params).unpack(stored[a], levels, count)
            again = codec.layout_for(b, part, entry.params).pack(back, levels)
            assert np.array_equal(again, stored[b]), (part, a, b)
    decoded = {name: _decode(*_encode(w, (13, 3), layout=name)) for name in LAYOUTS}
    for name in LAYOUTS[1:]:
        assert np.array_equal(decoded[name].view(np.uint32), decoded["packed"].view(np.uint32))


def test_points_are_in_the_lattice_and_the_rate_is_48_bits_a_block(rng):
    w = rng.standard_normal((24, 576))
    entry, arrays = _encode(w)
    codes = get_codec("leech").layout_for("packed", "codes", entry.params).unpack(arrays["w:codes"], 2**48, 24 * 24)
    points = index_to_point(codes, 13)
    assert is_leech_point(points).all() and ((shell_of(points) >= 2) & (shell_of(points) <= 13)).all()
    assert arrays["w:codes"].nbytes * 8 == 48 * 24 * 24
    bpw = 8 * sum(a.nbytes for a in arrays.values()) / w.size
    assert bpw == pytest.approx(2 + 16 / 576)


def test_error_is_near_the_gaussian_rate_distortion(rng):
    w = rng.standard_normal((64, 240))
    for shells, bound in (((13,), 0.30), ((13, 3), 0.16), ((13, 13), 0.085)):
        y = _decode(*_encode(w, shells))
        assert np.linalg.norm(y - w) / np.linalg.norm(w) < bound, shells


def test_sizes_that_are_not_whole_blocks_are_padded_and_counted(rng):
    w = rng.standard_normal((16, 1000))
    entry, arrays = _encode(w)
    assert entry.params["cols"] == 1008  # whole blocks: 1032 = 129 * 8 would read more
    assert arrays["w:codes"].nbytes == 16 * 1008 // BLOCK * 6
    y = _decode(entry, arrays)
    assert y.shape == w.shape and np.linalg.norm(y - w) / np.linalg.norm(w) < 0.3


def test_padding_past_a_block_to_a_cheaper_transform_decodes(rng):
    """4096 columns: whole blocks would be 4104 = 8 * 513 (a 513 x 513 rotation read on every call); 16 rows pad to
    4224 = 128 * 33, the most the format allows (4096 / 32 = 128 columns)."""
    w = rng.standard_normal((16, 4096))
    entry, arrays = _encode(w)
    assert entry.params["cols"] == 4224
    assert arrays["w:codes"].nbytes == 16 * 4224 // BLOCK * 6
    y = _decode(entry, arrays)
    assert y.shape == w.shape and np.linalg.norm(y - w) / np.linalg.norm(w) < 0.3


@pytest.mark.parametrize("rows,cols,width", [(4096, 4096, 4128), (14336, 4096, 4128), (4096, 14336, 14400),
                                             (576, 576, 576), (1536, 576, 576), (576, 1536, 1536), (21, 100, 120)])
def test_padded_width_of_known_shapes(rows, cols, width):
    assert padded_width(rows, cols, (13,)) == width


def test_padded_width_reads_the_fewest_bytes_among_the_allowed_widths():
    from accel.formats.leech_codec import ball_levels, max_padding
    from accel.quantize.incoherence import split_size

    rng = np.random.default_rng(5)
    for rows, cols in zip(rng.integers(1, 20000, 300), rng.integers(1, 30000, 300), strict=True):
        for shells in ((13,), (13, 3)):
            bits = sum(int(ball_levels(s) - 1).bit_length() for s in shells)
            width = padded_width(int(rows), int(cols), shells)
            assert width % BLOCK == 0 and cols <= width <= cols + max_padding(int(cols))
            def cost(w, rows=rows, bits=bits):
                return rows * (w // BLOCK) * bits / 8 + 4 * split_size(w)[0] ** 2
            allowed = [w for w in range(BLOCK, cols + max_padding(int(cols)) + 1, BLOCK) if w >= cols]
            assert cost(width) == min(map(cost, allowed)) and width == min(w for w in allowed if cost(w) == cost(width))


@pytest.mark.slow
def test_a_4096_square_matrix(rng):
    w = rng.standard_normal((4096, 4096)).astype(np.float32)
    entry, arrays = _encode(w)
    y = _decode(entry, arrays)
    assert np.linalg.norm(y - w) / np.linalg.norm(w) < 0.3
    # stored 4128 = 32 * 129 wide (padded_width): 172 blocks of 48 bits and a 16-bit scale a row, 2.0195 bits
    assert 8 * sum(a.nbytes for a in arrays.values()) / w.size == (172 * 48 + 16) / 4096


def test_error_feedback_lowers_the_proxy_loss(rng):
    x = rng.standard_normal((2000, 96)) @ rng.standard_normal((96, 96))
    h = x.T @ x / 2000
    w = rng.standard_normal((32, 96))
    plain = _decode(*_encode(w))
    fed = _decode(*_encode(w, hessian=h))
    assert proxy_loss(w, fed, h) < 0.9 * proxy_loss(w, plain, h)


def test_same_seed_same_bytes(rng):
    w = rng.standard_normal((8, 48))
    a, b = _encode(w)[1], _encode(w)[1]
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_codec_refuses_a_padded_width_outside_the_bound():
    from accel.errors import FormatError

    codec = get_codec("leech")

    def params(cols):
        return {"stages": [{"max_shell": 13, "alpha": 0.5}], "cols": cols, "seed_in": 1, "seed_out": 2,
                "scale_dtype": "float16"}

    for cols in (4104, 4128, 4224):  # version 1's whole blocks, accel's pick, the bound (4096 + 4096 / 32)
        codec.check_params(params(cols), (16, 4096))
    for cols in (4080, 4100, 4248, 1 << 29):
        with pytest.raises(FormatError, match="padded width"):
            codec.check_params(params(cols), (16, 4096))
    codec.check_params(params(120), (16, 97))  # under 32 * 24 columns: less than a block, as in version 1
    with pytest.raises(FormatError, match="padded width"):
        codec.check_params(params(144), (16, 97))


@pytest.mark.parametrize("layout", ["planes", "onehot"])
def test_serving_layouts_refuse_non_zero_padding_after_the_parity_bits(rng, layout):
    """6 blocks: the parity bits fill one byte whose top 2 bits are padding, which must be zero (docs/format.md
    §4.2); the coordinate planes are whole bytes."""
    from accel.errors import FormatError

    entry, arrays = _encode(rng.standard_normal((3, 48)), layout=layout)
    assert entry.shape[0] * entry.params["cols"] // BLOCK == 6
    _decode(entry, arrays)
    for bit in (6, 7):
        codes = arrays["w:codes"].copy()
        codes[-1] |= 1 << bit
        with pytest.raises(FormatError, match="tensor 'w': .*non-zero padding"):
            _decode(entry, {**arrays, "w:codes": codes})


@pytest.mark.parametrize("fill,parity", [(0xFF, 0x3F), (0x00, 0x00)])
def test_bit_planes_refuse_a_vector_outside_the_ball_by_tensor(rng, fill, parity):
    """Every coordinate -1 (all bits of the 6 blocks set, padding clear): odd with sum -24, not 4 mod 8, so not a
    Leech point; all bits clear: the origin, shell 0. Either is the reader's FormatError naming the tensor."""
    from accel.errors import FormatError

    entry, arrays = _encode(rng.standard_normal((3, 48)), layout="planes")
    codes = np.full_like(arrays["w:codes"], fill)
    codes[-1] = parity
    with pytest.raises(FormatError, match="tensor 'w': .*not a point of the ball"):
        _decode(entry, {**arrays, "w:codes": codes})


def test_passes_of_rows_change_no_byte(rng, monkeypatch):
    """The transforms and the block search run a pass of rows at a time (bounded float64 temporaries): any pass
    size gives the bytes of one pass over the whole tensor, with and without a Hessian, and the same decode."""
    from accel.quantize import incoherence, leech_weights

    for n in (24, 576, 1560, 4104):  # odd factors 3, 9, 195, 513
        x = rng.standard_normal((7, 3, n))
        whole = [rht(x, 11), rht(x, 11, inverse=True)]
        monkeypatch.setattr(incoherence, "RHT_ELEMENTS", n * 2)  # two vectors a pass, the last one short
        assert all(np.array_equal(a, b) for a, b in zip(whole, [rht(x, 11), rht(x, 11, inverse=True)], strict=True))
        monkeypatch.undo()
    w = rng.standard_normal((37, 100)).astype(np.float32)
    h = np.cov(rng.standard_normal((100, 400)))
    results = []
    for elements, blocks in ((1 << 40, 1 << 40), (100, 5), (130, 13)):
        monkeypatch.setattr(incoherence, "RHT_ELEMENTS", elements)
        monkeypatch.setattr(leech_weights, "BLOCKS_PER_PASS", blocks)
        out = []
        for hessian in (None, h):
            entry, arrays = encode_tensor("w", w, "leech", shells=(13, 3), seed_in=1, seed_out=2, hessian=hessian)
            decoded = decode_parts(entry, {p: arrays[s] for p, s in entry.parts.items()})
            out.append(([arrays[k].tobytes() for k in sorted(arrays)], decoded.tobytes()))
        results.append(out)
    assert results[1] == results[0] and results[2] == results[0]
