"""Bit streams and base-L packing: exact round trips and the promised sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.errors import FormatError
from accel.formats import bitpack


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 64), count=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_bit_stream_roundtrip_any_width(width, count, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**width, size=count, dtype=np.uint64, endpoint=False) if width < 64 else \
        rng.integers(0, 2**63, size=count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    stream = bitpack.pack_bits(values, width)
    assert stream.dtype == np.uint8 and stream.size == math.ceil(count * width / 8)
    assert np.array_equal(bitpack.unpack_bits(stream, width, count).astype(np.uint64), values)


@pytest.mark.parametrize("width", range(1, 65))
def test_bit_stream_matches_a_big_integer_reference(width, monkeypatch):
    """The stream is the little-endian bytes of the integer sum(v_i << (width * i)), at every width, for counts
    that end mid-unit and mid-byte, in one chunk of the packer's and across many (a chunk of 64 values)."""
    rng = np.random.default_rng(width)
    for chunk in (bitpack._CHUNK, 64):
        monkeypatch.setattr(bitpack, "_CHUNK", chunk)
        for count in (0, 1, 7, 9, 64 + 3, 513):
            values = [int(v) for v in rng.integers(0, 2**min(width, 63), size=count, dtype=np.uint64)]
            if width == 64 and count:
                values[0] = 2**64 - 1
            reference = sum(v << (width * i) for i, v in enumerate(values))
            stream = bitpack.pack_bits(np.array(values, dtype=np.uint64), width)
            assert stream.tobytes() == reference.to_bytes(math.ceil(count * width / 8), "little")
            assert bitpack.unpack_bits(stream, width, count).astype(np.uint64).tolist() == values


def test_bit_stream_is_little_endian():
    # value 0b101 at width 3, then 0b11 -> bits 1,0,1,1,1 -> byte 0b00011101
    assert bitpack.pack_bits(np.array([5, 3]), 3).tolist() == [0b00011101]


def test_bit_stream_rejects_values_that_do_not_fit():
    with pytest.raises(ValueError):
        bitpack.pack_bits(np.array([8]), 3)


def test_bit_stream_detects_wrong_length_and_dirty_padding():
    stream = bitpack.pack_bits(np.array([1, 2, 3]), 3)
    with pytest.raises(FormatError):
        bitpack.unpack_bits(stream[:-1], 3, 3)
    dirty = stream.copy()
    dirty[-1] |= 0x80
    with pytest.raises(FormatError):
        bitpack.unpack_bits(dirty, 3, 3)


@pytest.mark.parametrize("levels,expected", [(3, (5, 8)), (5, (3, 7)), (6, (5, 13)), (7, (6, 17)), (9, (5, 16)),
                                             (16, (1, 4)), (256, (1, 8)), (2, (1, 1))])
def test_base_grouping_examples(levels, expected):
    assert bitpack.base_grouping(levels) == expected


@pytest.mark.parametrize("levels", range(2, 257))
def test_base_grouping_is_the_best_small_grouping(levels):
    g, bits = bitpack.base_grouping(levels)
    assert bits == math.ceil(g * math.log2(levels) - 1e-12)  # ceil(g*log2 L), exact for powers of two
    assert levels**g <= 2**bits < levels**g * 2
    for other in range(1, bitpack.MAX_GROUP + 1):
        other_bits = (levels**other - 1).bit_length()
        assert bits / g <= other_bits / other + 1e-12


@settings(max_examples=80, deadline=None)
@given(levels=st.integers(2, 256), count=st.integers(0, 500), seed=st.integers(0, 2**32 - 1))
def test_base_levels_roundtrip_and_size(levels, count, seed):
    codes = np.random.default_rng(seed).integers(0, levels, size=count)
    stream = bitpack.pack_base_levels(codes, levels)
    g, bits = bitpack.base_grouping(levels)
    assert stream.size == math.ceil(math.ceil(count / g) * bits / 8)  # ceil(g*log2 L)/g bits per value
    assert np.array_equal(bitpack.unpack_base_levels(stream, levels, count), codes)


def test_base_levels_rejects_group_values_past_range():
    stream = bitpack.pack_bits(np.array([125]), 7)  # 5**3 = 125 is not a valid group of three 5-level codes
    with pytest.raises(FormatError):
        bitpack.unpack_base_levels(stream, 5, 3)
