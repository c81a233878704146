"""Every codec round-trips bit-exactly through a file in every layout; lossy codecs match a float64 reference."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.formats import AccelFile, convert_layout, encode_tensor, get_codec, get_layout, write_file
from accel.formats.layouts import Layout
from accel.formats.tensor import decode_parts

LAYOUTS = sorted(Layout.registry)
shapes = st.lists(st.integers(1, 37), min_size=1, max_size=3).map(tuple)


def _roundtrip_through_file(tmp_path, entry, arrays):
    path = tmp_path / "t.safetensors"
    write_file(path, [entry], arrays)
    f = AccelFile(path)
    stored = {part: f.read_stored(name) for part, name in entry.parts.items()}
    for part, name in entry.parts.items():  # the stored bytes are exactly what was encoded
        assert np.array_equal(stored[part].view(np.uint8), np.ascontiguousarray(arrays[name]).view(np.uint8))
    return f.decode(entry.name)


def _values(seed, shape, scale):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    if x.size > 3:
        x.reshape(-1)[rng.integers(0, x.size)] *= 40  # an outlier
    return x


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), levels=st.integers(2, 256), group=st.integers(1, 70),
       symmetric=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_affine_roundtrips_bit_exactly_in_every_layout(tmp_path_factory, shape, seed, levels, group, symmetric,
                                                        scale):
    tmp = tmp_path_factory.mktemp("affine")
    x = _values(seed, shape, scale)
    decoded = []
    for layout in LAYOUTS:
        if not get_layout(layout).supports(levels) or (layout == "onehot" and levels > 64):
            continue
        entry, arrays = encode_tensor("w", x, "affine", layout=layout, levels=levels, group=group,
                                      symmetric=symmetric)
        in_memory = decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})
        from_file = _roundtrip_through_file(tmp, entry, arrays)
        assert from_file.dtype == np.float32 and from_file.shape == x.shape
        assert np.array_equal(from_file.view(np.uint32), in_memory.view(np.uint32))
        decoded.append(from_file)
    for other in decoded[1:]:
        assert np.array_equal(other.view(np.uint32), decoded[0].view(np.uint32))


def _affine_reference(x: np.ndarray, levels: int, group: int, symmetric: bool, dtype=np.float16) -> np.ndarray:
    """Float64 reference of the affine codec: same grid, scales rounded to the stored dtype (fp16 unless the fp16
    grid would miss a group, accel.formats.codecs.grid_dtype)."""
    rnd = np.dtype(dtype).type
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.empty_like(rows)
    top = levels - 1
    for r, c in itertools.product(range(rows.shape[0]), range(0, rows.shape[1], group)):
        g = rows[r, c : c + group]
        if symmetric:
            s = float(rnd(np.abs(g).max() / (top / 2)))
            q = np.clip(np.rint(g / s + top / 2), 0, top) if s > 0 else np.zeros_like(g)
            out[r, c : c + group] = (q - top / 2) * s
        else:
            lo = float(rnd(g.min()))
            s = float(rnd((g.max() - g.min()) / top))
            q = np.clip(np.rint((g - lo) / s), 0, top) if s > 0 else np.zeros_like(g)
            out[r, c : c + group] = lo + q * s
    return out.reshape(x.shape)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), levels=st.integers(2, 256), group=st.integers(1, 70),
       symmetric=st.booleans())
def test_affine_matches_float64_reference(shape, seed, levels, group, symmetric):
    x = _values(seed, shape, 1.0)
    entry, arrays = encode_tensor("w", x, "affine", levels=levels, group=group, symmetric=symmetric)
    ours = decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()}).astype(np.float64)
    ref = _affine_reference(x, levels, group, symmetric, np.dtype(entry.params["scale_dtype"]))
    assert np.allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(x).max())


def test_affine_error_is_at_most_half_a_step(rng):
    x = rng.standard_normal((64, 256)).astype(np.float32)
    for levels in (3, 4, 5, 16, 255):
        entry, arrays = encode_tensor("w", x, "affine", levels=levels, group=32)
        y = decode_parts(entry, {p: arrays[n] for p, n in entry.parts.items()})
        g = x.reshape(64, 8, 32)
        step = (g.max(axis=2) - g.min(axis=2)) / (levels - 1)
        err = np.abs(y - x).reshape(64, 8, 32).max(axis=2)
        assert np.all(err <= 0.5 * step * (1 + 2e-3) + 2e-3 * np.abs(g).max(axis=2))


@settings(max_examples=25, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), levels=st.integers(2, 32), group=st.integers(1, 50))
def test_lut_roundtrips_and_codes_are_nearest_palette_entries(tmp_path_factory, shape, seed, levels, group):
    x = _values(seed, shape, 1.0)
    entry, arrays = encode_tensor("w", x, "lut", levels=levels, group=group)
    y = _roundtrip_through_file(tmp_path_factory.mktemp("lut"), entry, arrays)
    palette = arrays["w:palette"].astype(np.float64)
    rows, cols = int(np.prod(x.shape[:-1])), x.shape[-1]
    flat_x, flat_y = x.reshape(rows, cols).astype(np.float64), y.reshape(rows, cols).astype(np.float64)
    for c in range(cols):
        pal = palette[:, c // group, :]
        best = np.abs(flat_x[:, c : c + 1] - pal).min(axis=1)
        assert np.allclose(np.abs(flat_x[:, c] - flat_y[:, c]), best)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), dtype=st.sampled_from(["float32", "float16", "bfloat16"]))
def test_raw_roundtrips_and_rounds_like_torch(tmp_path_factory, shape, seed, dtype):
    x = _values(seed, shape, 3.0)
    entry, arrays = encode_tensor("w", x, "raw", dtype=dtype)
    y = _roundtrip_through_file(tmp_path_factory.mktemp("raw"), entry, arrays)
    expected = torch.from_numpy(x).to(getattr(torch, dtype)).float().numpy()
    assert np.array_equal(y.view(np.uint32), expected.view(np.uint32))


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 10_000), bits=st.integers(1, 8), levels=st.integers(2, 256))
def test_integer_codecs_are_lossless(tmp_path_factory, shape, seed, bits, levels):
    rng = np.random.default_rng(seed)
    tmp = tmp_path_factory.mktemp("int")
    for codec, kw, high in (("uint", {"bits": bits}, 1 << bits), ("levels", {"levels": levels}, levels)):
        x = rng.integers(0, high, size=shape).astype(np.uint8)
        entry, arrays = encode_tensor("m", x, codec, role="map", **kw)
        assert np.array_equal(_roundtrip_through_file(tmp, entry, arrays), x)


@settings(max_examples=40, deadline=None)
@given(levels=st.integers(2, 64), count=st.integers(0, 300), seed=st.integers(0, 10_000))
def test_every_pair_of_layouts_converts_bit_exactly(levels, count, seed):
    codes = np.random.default_rng(seed).integers(0, levels, size=count)
    stored = {name: get_layout(name).pack(codes, levels) for name in LAYOUTS if get_layout(name).supports(levels)}
    for a, b in itertools.permutations(stored, 2):
        assert np.array_equal(convert_layout(stored[a], levels, count, a, b), stored[b])


def test_size_accounting_counts_codes_and_side_data(rng):
    x = rng.standard_normal((8, 128)).astype(np.float32)
    _entry, arrays = encode_tensor("w", x, "affine", levels=16, group=64)
    nbytes = sum(a.nbytes for a in arrays.values())
    assert nbytes == 8 * 128 * 4 // 8 + 2 * (8 * 2 * 2)  # 4-bit codes + fp16 scale and offset per group
    entry5, arrays5 = encode_tensor("w", x, "affine", levels=5, group=128, symmetric=True)
    assert entry5.layout == "base"
    assert arrays5["w:codes"].nbytes == -(-(-(-1024 // 3) * 7) // 8)  # 3 five-level codes per 7 bits


def test_codec_registry_lists_the_required_codecs():
    for name in ("raw", "affine", "uint", "levels", "lut"):
        assert get_codec(name).name == name


def test_affine_row_blocks_change_no_byte(monkeypatch):
    """The affine codec works on blocks of rows (bounded float64 temporaries): any block size gives the bytes and the
    decoded values of one block over the whole tensor, fitted or given grids, padded groups, 3-D tensors."""
    from accel.formats import codecs

    rng = np.random.default_rng(7)
    cases = [((37, 53), 16, 5, False), ((37, 53), 16, 64, True), ((5, 3, 40), 256, 16, False),
             ((1, 200), 4, 1000, False), ((64, 96), 3, 32, True), ((0, 16), 16, 8, False)]
    for shape, levels, group, symmetric in cases:
        x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 10, shape[:-1] + (1,)).astype(np.float32)
        results = []
        for block in (1 << 40, 1, 7, 100):
            monkeypatch.setattr(codecs, "BLOCK_ELEMENTS", block)
            entry, arrays = encode_tensor("w", x, "affine", levels=levels, group=group, symmetric=symmetric)
            if not symmetric:  # the same again on the grid just stored (as a GGUF tensor kept on its own grid)
                grid = {p: arrays[entry.parts[p]] for p in ("scale", "offset")}
                again = encode_tensor("w", x, "affine", levels=levels, group=group, symmetric=False, **grid)[1]
                assert all(np.array_equal(again[k], arrays[k]) for k in arrays)
            decoded = decode_parts(entry, {p: arrays[s] for p, s in entry.parts.items()})
            results.append(([arrays[k].tobytes() for k in sorted(arrays)], decoded.tobytes(), decoded.shape))
        assert all(r == results[0] for r in results), (shape, levels, group, symmetric)
        assert results[0][2] == shape
