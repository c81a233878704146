"""Bit packing of integer codes: fixed-width bit streams and base-L level groups.

Both are little-endian bit streams: value i of width w occupies stream bits [i*w, (i+1)*w), and stream bit k is
bit (k % 8) of byte k // 8 (docs/format.md, "Bit streams").
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

from accel.errors import FormatError

MAX_GROUP = 8  # base-L groups hold at most 8 codes, so a group value always fits in 64 bits for L <= 256
_CHUNK = 1 << 18  # values per chunk; a multiple of 8 so every chunk starts on a byte boundary


def packed_nbytes(count: int, width: int) -> int:
    """Bytes of a stream of `count` values of `width` bits."""
    return (count * width + 7) // 8


def _unit(width: int) -> tuple[int, int, int]:
    """(values, bytes, 64-bit words) of the smallest run of `width`-bit values that ends on a byte boundary."""
    values = 8 // math.gcd(width, 8)
    nbytes = values * width // 8
    return values, nbytes, -(-nbytes // 8)


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Pack non-negative integers below 2**width (1 <= width <= 64) into a little-endian bit stream."""
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be 1..64, got {width}")
    flat = np.ascontiguousarray(values).reshape(-1)
    if flat.size and (flat.dtype.kind not in "ui" or flat.min() < 0):
        raise ValueError("pack_bits takes non-negative integers")
    if width < 64 and flat.size and int(flat.max()) >> width:
        raise ValueError(f"a value does not fit in {width} bits")
    if width == 8:
        return flat.astype(np.uint8)
    # Values are OR-ed into little-endian 64-bit words a unit (a whole number of bytes) at a time; the unit's
    # bytes are then the words' first bytes. Zero values pad the last unit, so the padding bits are zero.
    per_unit, unit_bytes, nwords = _unit(width)
    out = np.empty(packed_nbytes(flat.size, width), dtype=np.uint8)
    for start in range(0, flat.size, _CHUNK):
        # widened a chunk at a time: the whole stream as uint64 was 8 bytes a code (SmolLM2's embedding: 216 MiB)
        chunk = flat[start : start + _CHUNK].astype(np.uint64)
        units = -(-chunk.size // per_unit)
        padded = np.zeros(units * per_unit, dtype=np.uint64)
        padded[: chunk.size] = chunk
        padded = padded.reshape(units, per_unit)
        words = np.zeros((units, nwords), dtype="<u8")
        for i in range(per_unit):
            word, shift = divmod(i * width, 64)
            words[:, word] |= padded[:, i] << np.uint64(shift)
            if shift + width > 64:
                words[:, word + 1] |= padded[:, i] >> np.uint64(64 - shift)
        packed = words.view(np.uint8).reshape(units, 8 * nwords)[:, :unit_bytes].reshape(-1)
        first = start * width // 8
        n = packed_nbytes(chunk.size, width)
        out[first : first + n] = packed[:n]
    return out


def unpack_bits(stream: np.ndarray, width: int, count: int) -> np.ndarray:
    """Inverse of pack_bits: `count` values of `width` bits as uint64 (uint8 for width <= 8)."""
    if not 1 <= width <= 64:
        raise ValueError(f"bit width must be 1..64, got {width}")
    stream = np.ascontiguousarray(stream, dtype=np.uint8).reshape(-1)
    expected = packed_nbytes(count, width)
    if stream.size != expected:
        raise FormatError(f"bit stream holds {stream.size} bytes, expected {expected} for {count}x{width} bits")
    tail = count * width % 8
    if tail and stream.size and int(stream[-1]) >> tail:
        raise FormatError("bit stream has non-zero padding bits after its last value")
    if width == 8:
        return stream.copy()
    per_unit, unit_bytes, nwords = _unit(width)
    mask = np.uint64((1 << width) - 1)
    out = np.empty(count, dtype=np.uint8 if width <= 8 else np.uint64)
    for start in range(0, count, _CHUNK):
        n = min(_CHUNK, count - start)
        units = -(-n // per_unit)
        first = start * width // 8
        raw = stream[first : first + packed_nbytes(n, width)]
        buf = np.zeros((units, 8 * nwords), dtype=np.uint8)
        flat = np.zeros(units * unit_bytes, dtype=np.uint8)
        flat[: raw.size] = raw
        buf[:, :unit_bytes] = flat.reshape(units, unit_bytes)
        words = buf.view("<u8")
        values = np.empty((units, per_unit), dtype=np.uint64)
        for i in range(per_unit):
            word, shift = divmod(i * width, 64)
            v = words[:, word] >> np.uint64(shift)
            if shift + width > 64:
                v |= words[:, word + 1] << np.uint64(64 - shift)
            values[:, i] = v & mask
        out[start : start + n] = values.reshape(-1)[:n]
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
