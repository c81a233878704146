"""A GGUF file's header: its metadata and tensor directory, read straight from the memory map.

gguf-py's GGUFReader keeps every metadata value as numpy views, one or two a token for the tokenizer's arrays: on
SmolLM2-135M (49,152 tokens, 48,900 merges) that took 5.7 s and 160 MiB to open the file, before any tensor was
read (docs/architecture.md, "Model sources"). This reader decodes the scalars accel reads and only walks over an
array, recording its type, length and extent. Tensor data are numpy views of the one read-only mapping, shaped as
gguf-py shapes them (a quantized type as rows of block bytes), so gguf.quants.dequantize takes them unchanged.

Layout (GGUF v2 and v3, little-endian): magic "GGUF", uint32 version, uint64 tensor count, uint64 metadata count;
each metadata entry a string key, a uint32 value type and the value; each tensor a string name, uint32 n_dims,
n_dims uint64 dimensions (innermost first), a uint32 ggml type and a uint64 offset into the data section, which
starts at the next multiple of `general.alignment` (default 32) after the directory. A string is a uint64 length
and that many UTF-8 bytes; an array a uint32 item type, a uint64 count and the items.

Every read is bounded by the file's size, and counts are checked against the bytes left before any loop, so a
damaged file raises GGUFHeaderError (a ValueError) naming the offset, never a struct error or a long loop.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types (gguf.GGUFValueType), as struct formats for the scalars.
STRING, ARRAY = 8, 9
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
UINT32 = 4

# ggml types stored as plain numpy items (gguf-py's choice); every other type is viewed as bytes, one row of blocks.
_ITEM_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


class GGUFHeaderError(ValueError):
    """A GGUF file that cannot be read: the message names what and where."""


@dataclass(frozen=True)
class GGUFArray:
    """An array metadata value, not decoded: its item type, its length and its bytes' extent in the file."""

    item_type: int
    count: int
    start: int
    end: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the directory. `shape` is GGUF's (innermost first); `data` a read-only view of its bytes in
    the mapping, in gguf-py's shape (reversed dimensions; for a block-quantized type, the last is bytes a row)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    """Bounded little-endian reads over the mapping."""

    def __init__(self, buffer: mmap.mmap, size: int):
        self.buffer = buffer
        self.size = size
        self.at = 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.at + n > self.size:
            raise GGUFHeaderError(f"{what} at offset {self.at} runs past the end of the file ({self.size} bytes)")

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += n
        return value

    def string(self, what: str, strict: bool) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buffer[self.at:self.at + n]
        try:
            text = raw.decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError:
            raise GGUFHeaderError(f"{what} at offset {self.at} is not UTF-8") from None
        self.at += n
        return text


MAX_NESTING = 8  # arrays of arrays: gguf-py writes none; a damaged file must not recurse without end


def _skip_array(cur: _Cursor, what: str, depth: int = 0) -> GGUFArray:
    """Walk over an array value (nested arrays included), checking every item's extent."""
    if depth > MAX_NESTING:
        raise GGUFHeaderError(f"{what} nests arrays deeper than {MAX_NESTING}")
    item_type = cur.unpack("<I", what)
    count = cur.unpack("<Q", what)
    start = cur.at
    if item_type in _SCALAR_FORMATS:
        cur.need(count * struct.calcsize(_SCALAR_FORMATS[item_type]), what)
        cur.at += count * struct.calcsize(_SCALAR_FORMATS[item_type])
    elif item_type == STRING:
        cur.need(count * 8, what)  # every item has at least its length
        buffer, at, size = cur.buffer, cur.at, cur.size
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > size:  # an item's length past the end: past it, for the check below
                at = size + 1
                break
            at += 8 + unpack_length(buffer, at)[0]
        cur.need(at - cur.at, what)  # past the end: the error names the array's start
        cur.at = at
    elif item_type == ARRAY:
        cur.need(count * 12, what)  # every item has at least its type and count
        for _ in range(count):
            _skip_array(cur, what, depth + 1)
    else:
        raise GGUFHeaderError(f"{what} has an unknown item type {item_type}")
    return GGUFArray(item_type, count, start, cur.at)


def _value(cur: _Cursor, value_type: int, what: str) -> Any:
    if value_type in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[value_type], what)
    if value_type == STRING:
        return cur.string(what, strict=False)
    if value_type == ARRAY:
        return _skip_array(cur, what)
    raise GGUFHeaderError(f"{what} has an unknown value type {value_type}")


class GGUFHeader:
    """The metadata (`fields`: key -> int, float, bool, str or GGUFArray, in file order), the value types
    (`types`), the tensor directory (`tensors`, in file order) and the offsets of a GGUF file, with `mapping` the
    read-only mmap the tensors view. `metadata_end` is the offset after the last metadata entry."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 4:
                raise GGUFHeaderError(f"{size} bytes: too short for a GGUF file")
            self.mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self.mapping, size)
        if self.mapping[:4] != MAGIC:
            raise GGUFHeaderError("no GGUF magic")
        cur.at = 4
        self.version = cur.unpack("<I", "the version")
        if self.version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise GGUFHeaderError("a big-endian GGUF file; only little-endian files are read")
            raise GGUFHeaderError(f"GGUF version {self.version} (supported: 2, 3)")
        tensor_count = cur.unpack("<Q", "the tensor count")
        kv_count = cur.unpack("<Q", "the metadata count")
        cur.need(kv_count * 13, f"{kv_count} metadata entries")  # key length, one key byte, type tag at least
        self.fields: dict[str, Any] = {}
        self.types: dict[str, int] = {}
        for _ in range(kv_count):
            at = cur.at
            key = cur.string(f"the metadata key at offset {at}", strict=True)
            if key in self.fields:
                raise GGUFHeaderError(f"metadata key {key!r} appears twice (offset {at})")
            value_type = cur.unpack("<I", f"metadata {key!r}")
            self.fields[key] = _value(cur, value_type, f"metadata {key!r}")
            self.types[key] = value_type
        self.metadata_end = cur.at

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.fields:
            if self.types["general.alignment"] != UINT32:
                raise GGUFHeaderError("general.alignment is not a uint32")
            self.alignment = self.fields["general.alignment"]
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise GGUFHeaderError(f"general.alignment {self.alignment} is not a power of two")

        cur.need(tensor_count * 24, f"{tensor_count} tensor entries")  # name length, n_dims, type, offset at least
        directory = []
        for _ in range(tensor_count):
            at = cur.at
            name = cur.string(f"the tensor name at offset {at}", strict=True)
            n_dims = cur.unpack("<I", f"tensor {name!r}")
            cur.need(8 * n_dims, f"tensor {name!r}'s {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", self.mapping, cur.at)
            cur.at += 8 * n_dims
            raw_type = cur.unpack("<I", f"tensor {name!r}")
            offset = cur.unpack("<Q", f"tensor {name!r}")
            directory.append((name, dims, raw_type, offset))
        self.data_offset = -(-cur.at // self.alignment) * self.alignment

        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, raw_type, offset in directory:
            if name in names:
                raise GGUFHeaderError(f"tensor {name!r} appears twice")
            names.add(name)
            try:
                ggml_type = gguf.GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFHeaderError(f"tensor {name!r} has an unknown ggml type {raw_type}") from None
            block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            n_elements = int(np.prod(dims, dtype=object)) if dims else 1
            if dims and dims[0] % block_size:
                raise GGUFHeaderError(f"tensor {name!r}: rows of {dims[0]} are not whole {ggml_type.name} blocks "
                                      f"of {block_size}")
            n_bytes = n_elements // block_size * type_size
            start = self.data_offset + offset
            if start + n_bytes > size:
                raise GGUFHeaderError(f"tensor {name!r} has {max(0, size - start)} of its {n_bytes} bytes")
            view_shape = tuple(reversed(dims))
            item = _ITEM_DTYPES.get(ggml_type.name)
            if item is None:
                item = np.uint8
                view_shape = (*view_shape[:-1], view_shape[-1] // block_size * type_size) if view_shape else ()
            data = np.frombuffer(self.mapping, dtype=np.uint8, count=n_bytes, offset=start)
            self.tensors.append(GGUFTensor(name, tuple(int(d) for d in dims), ggml_type, n_elements, n_bytes, start,
                                           data.view(item).reshape(view_shape)))
