"""Bit packing of integer codes: fixed-width bit streams and base-L level groups.

Both are little-endian bit streams: value i of width w occupies stream bits [i*w, (i+1)*w), and stream bit k is
bit (k % 8) of byte k // 8 (docs/format.md, "Bit streams").
"""

from __future__ import annotations

from functools import cache

import numpy as np

from accel.errors import FormatError

MAX_GROUP = 8  # base-L groups hold at most 8 codes, so a group value always fits in 64 bits for L <= 256
_CHUNK = 1 << 18  # values per chunk; a multiple of 8 so every chunk starts on a byte boundary


def packed_nbytes(count: int, width: int) -> int:
    """Bytes of a stream of `count` values of `width` bits."""
    return (count * width + 7) // 8


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers below 2**width (1 <= width <= 64) into a little-endian bit stream."""
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be 1..64, got {width}")
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.size and (flat.dtype.kind not in "ui" or flat.min() < 0):
        raise ValueError("pack_bits takes non-negative integers")
    flat = flat.astype(np.uint64, copy=False)
    if width < 64 and flat.size and int(flat.max()) >> width:
        raise ValueError(f"a value does not fit in {width} bits")
    if width == 8:
        return flat.astype(np.uint8)
    out = np.empty(packed_nbytes(flat.size, width), dtype=np.uint8)
    shifts = np.arange(width, dtype=np.uint64)
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start : start + _CHUNK]
        bits = ((chunk[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
        packed = np.packbits(bits.reshape(-1), bitorder="little")
        first = start * width // 8
        out[first : first + packed.size] = packed
    return out


def unpack_bits(stream: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of pack_bits: `count` values of `width` bits as uint64 (uint8 for width <= 8)."""
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be 1..64, got {width}")
    stream = np.ascontiguousarray(stream, dtype=np.uint8).reshape(-1)
    expected = packed_nbytes(count, width)
    if stream.size != expected:
        raise FormatError(f"bit stream holds {stream.size} bytes, expected {expected} for {count}x{width} bits")
    if width == 8:
        return stream.copy()
    out = np.empty(count, dtype=np.uint8 if width <= 8 else np.uint64)
    for start in range(0, count, _CHUNK):
        n = min(_CHUNK, count - start)
        first = start * width // 8
        raw = stream[first : first + packed_nbytes(n, width)]
        bits = np.unpackbits(raw, count=n * width, bitorder="little").reshape(n, width)
        if width <= 8:
            weights = (1 << np.arange(width)).astype(np.uint8)
            out[start : start + n] = (bits * weights).sum(axis=1, dtype=np.uint16).astype(np.uint8)
        else:
            out[start : start + n] = (bits.astype(np.uint64) << np.arange(width, dtype=np.uint64)).sum(
                axis=1, dtype=np.uint64
            )
    tail = count * width % 8
    if tail and stream.size and int(stream[-1]) >> tail:
        raise FormatError("bit stream has non-zero padding bits after its last value")
    return out


def bits_for_levels(levels: int) -> int:
    """Bits of a plain binary code for `levels` distinct values (ceil(log2 L), at least 1)."""
    if levels < 2:
        raise ValueError(f"a code needs at least 2 levels, got {levels}")
    return max(1, (levels - 1).bit_length())


@cache
def base_grouping(levels: int) -> tuple[int, int]:
    """The best small grouping (g, bits) for base-L packing: g codes in ceil(g*log2 L) bits, g <= 8.

    Chooses the g with the fewest bits per code; ties go to the smaller g. Example: L=5 -> (3, 7), L=3 -> (5, 8).
    """
    if not 2 <= levels <= 256:
        raise ValueError(f"base-L packing takes 2..256 levels, got {levels}")
    best = (1, bits_for_levels(levels))
    for g in range(2, MAX_GROUP + 1):
        bits = (levels**g - 1).bit_length()
        if bits * best[0] < best[1] * g:
            best = (g, bits)
    return best


def base_levels_nbytes(count: int, levels: int) -> int:
    g, bits = base_grouping(levels)
    return packed_nbytes(-(-count // g), bits)


def pack_base_levels(codes: np.ndarray, levels: int) -> np.ndarray:
    """Pack codes in [0, levels) as base-L groups (digit j of a group has weight L**j) in a bit stream."""
    g, bits = base_grouping(levels)
    flat = np.ascontiguousarray(codes).reshape(-1)
    if flat.size and (flat.dtype.kind not in "ui" or flat.min() < 0 or int(flat.max()) >= levels):
        raise ValueError(f"codes must be integers in [0, {levels})")
    groups = -(-flat.size // g)
    digits = np.zeros(groups * g, dtype=np.uint64)
    digits[: flat.size] = flat
    digits = digits.reshape(groups, g)
    value = np.zeros(groups, dtype=np.uint64)
    for j in range(g - 1, -1, -1):
        value = value * np.uint64(levels) + digits[:, j]
    return pack_bits(value, bits)


def unpack_base_levels(stream: np.ndarray, levels: int, count: int) -> np.ndarray:
    """Inverse of pack_base_levels; a group value of L**g or more is corruption."""
    g, bits = base_grouping(levels)
    groups = -(-count // g)
    value = unpack_bits(stream, bits, groups).astype(np.uint64)
    if groups and g * np.log2(levels) < 64 and int(value.max()) >= levels**g:
        raise FormatError(f"base-{levels} stream holds a group value past {levels}**{g}")
    digits = np.empty((groups, g), dtype=np.uint64)
    base = np.uint64(levels)
    for j in range(g):
        digits[:, j] = value % base
        value = value // base
    out = digits.reshape(-1)
    if np.any(out[count:]):
        raise FormatError("base-L stream has non-zero padding codes after its last value")
    return out[:count].astype(np.uint8 if levels <= 256 else np.uint16)
