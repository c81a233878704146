"""Layouts: ways to store a stream of integer codes, separate from the codec that made them.

Every layout stores one uint8 part named `codes`; converting between layouts is exact (codes -> layout -> codes).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from accel.errors import FormatError
from accel.formats import bitpack


class Layout:
    """One way to store `count` codes in [0, levels) as a uint8 array."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, Layout]] = {}

    def __init_subclass__(cls, name: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if name is not None:  # codec-specific layouts (leech) are reached through Codec.layout_for instead
            cls.name = name
            Layout.registry[name] = cls()

    def supports(self, levels: int) -> bool:
        raise NotImplementedError

    def stored_shape(self, levels: int, count: int) -> tuple[int, ...]:
        raise NotImplementedError

    def pack(self, codes: np.ndarray, levels: int) -> np.ndarray:
        raise NotImplementedError

    def unpack(self, stored: np.ndarray, levels: int, count: int) -> np.ndarray:
        raise NotImplementedError


class PackedLayout(Layout, name="packed"):
    """A plain bit stream, ceil(log2 L) bits a code (any L up to 2**64)."""

    def supports(self, levels: int) -> bool:
        return 2 <= levels <= 2**64

    def stored_shape(self, levels, count):
        return (bitpack.packed_nbytes(count, bitpack.bits_for_levels(levels)),)

    def pack(self, codes, levels):
        return bitpack.pack_bits(codes, bitpack.bits_for_levels(levels))

    def unpack(self, stored, levels, count):
        codes = bitpack.unpack_bits(stored, bitpack.bits_for_levels(levels), count)
        if count and levels < 2**64 and int(codes.max()) >= levels:
            raise FormatError(f"a stored code is {int(codes.max())}, past the codec's {levels} levels")
        return codes


class BaseLevelsLayout(Layout, name="base"):
    """Base-L groups: g codes in ceil(g*log2 L) bits (3 five-level codes in 7 bits, 5 three-level in 8)."""

    def supports(self, levels):
        return 2 <= levels <= 256

    def stored_shape(self, levels, count):
        return (bitpack.base_levels_nbytes(count, levels),)

    def pack(self, codes, levels):
        return bitpack.pack_base_levels(codes, levels)

    def unpack(self, stored, levels, count):
        return bitpack.unpack_base_levels(stored, levels, count)


class BitPlanesLayout(Layout, name="planes"):
    """One packed bit plane per code bit: row j holds bit j of every code (decodable with shifts and masks)."""

    def supports(self, levels):
        return 2 <= levels <= 2**16

    def stored_shape(self, levels, count):
        return (bitpack.bits_for_levels(levels), (count + 7) // 8)

    def pack(self, codes, levels):
        width = bitpack.bits_for_levels(levels)
        flat = np.ascontiguousarray(codes).reshape(-1).astype(np.uint64)
        planes = [(flat >> np.uint64(j)) & np.uint64(1) for j in range(width)]
        return np.stack([np.packbits(p.astype(np.uint8), bitorder="little") for p in planes]).reshape(
            self.stored_shape(levels, flat.size)
        )

    def unpack(self, stored, levels, count):
        width = bitpack.bits_for_levels(levels)
        if stored.shape != self.stored_shape(levels, count):
            raise FormatError(f"bit planes have shape {stored.shape}, expected {self.stored_shape(levels, count)}")
        codes = np.zeros(count, dtype=np.uint16)
        for j in range(width):
            codes |= np.unpackbits(stored[j], count=count, bitorder="little").astype(np.uint16) << j
        _check_padding(stored, count)
        if count and int(codes.max()) >= levels:
            raise FormatError(f"a stored code is {int(codes.max())}, past the codec's {levels} levels")
        return codes


class OneHotLayout(Layout, name="onehot"):
    """One packed mask per level: row l has a 1 where the code equals l; exactly one row is set per code."""

    def supports(self, levels):
        return 2 <= levels <= 256

    def stored_shape(self, levels, count):
        return (levels, (count + 7) // 8)

    def pack(self, codes, levels):
        flat = np.ascontiguousarray(codes).reshape(-1)
        masks = np.zeros((levels, (flat.size + 7) // 8), dtype=np.uint8)
        for level in range(levels):
            masks[level] = np.packbits(flat == level, bitorder="little")
        return masks

    def unpack(self, stored, levels, count):
        if stored.shape != self.stored_shape(levels, count):
            raise FormatError(f"one-hot masks have shape {stored.shape}, expected {self.stored_shape(levels, count)}")
        codes = np.zeros(count, dtype=np.uint16)
        hits = np.zeros(count, dtype=np.uint16)
        for level in range(levels):
            bits = np.unpackbits(stored[level], count=count, bitorder="little")
            codes += bits.astype(np.uint16) * level
            hits += bits
        _check_padding(stored, count)
        if np.any(hits != 1):
            raise FormatError("one-hot masks do not have exactly one level set for every code")
        return codes


def _check_padding(rows: np.ndarray, count: int) -> None:
    tail = count % 8
    if tail and rows.shape[-1] and np.any(rows[..., -1] >> tail):
        raise FormatError("packed rows have non-zero padding bits after the last code")


LAYOUT_ALIASES = {"compact": "packed"}  # the on-disk index stream of design.md is the plain packed stream


def get_layout(name: str) -> Layout:
    try:
        return Layout.registry[LAYOUT_ALIASES.get(name, name)]
    except KeyError:
        known = sorted([*Layout.registry, *LAYOUT_ALIASES])
        raise FormatError(f"unknown layout '{name}' (known: {', '.join(known)})") from None


def convert_layout(stored: np.ndarray, levels: int, count: int, source: str, target: str) -> np.ndarray:
    """Re-store codes from one layout in another, bit-exactly."""
    return get_layout(target).pack(get_layout(source).unpack(stored, levels, count), levels)
