"""One accel container file: a valid safetensors file whose `__metadata__` key `accel` holds the JSON document.

Writers are atomic and deterministic; the reader validates the header, every offset and every document entry
before it trusts any of them (docs/format.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from accel.errors import FormatError, NotAccelOutput
from accel.formats import jsontext
from accel.formats.atomic import atomic_write
from accel.formats.dtypes import NUMPY_OF
from accel.formats.tensor import TensorEntry, decode_parts, storage_dtype_of

FORMAT_NAME = "accel"
FORMAT_VERSION = 2
MAX_HEADER_BYTES = 100 * 1024 * 1024
# __metadata__ key of the document's SHA-256 (hex, of its UTF-8 bytes); written since 2026-12-06, checked when present
DOC_SHA256_KEY = "accel_sha256"
_ALIGN = 8


def sha256_hex(data: memoryview | bytes | np.ndarray) -> str:
    return hashlib.sha256(memoryview(data).cast("B") if not isinstance(data, bytes) else data).hexdigest()


@dataclass(frozen=True)
class StoredInfo:
    """What a container's header says of one stored array: safetensors dtype, shape, size and SHA-256."""

    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    nbytes: int
    sha256: str


def stored_infos(entries: list[TensorEntry], arrays: dict[str, np.ndarray]) -> dict[str, StoredInfo]:
    """Each entry's stored arrays checked against its codec's parts (names, shapes, dtypes), with their header
    information; raises ValueError on a mismatch."""
    infos: dict[str, StoredInfo] = {}
    for entry in entries:
        expected = entry.expected_parts()
        if set(expected) != set(entry.parts):
            raise ValueError(f"{entry.name}: parts {sorted(entry.parts)} differ from expected {sorted(expected)}")
        for part, stored in entry.parts.items():
            shape, dtype = expected[part]
            array = arrays[stored]
            if tuple(array.shape) != tuple(shape):
                raise ValueError(f"{stored}: shape {array.shape} differs from the codec's {shape}")
            stored_dtype = storage_dtype_of(array, dtype)
            if stored_dtype != dtype:
                raise ValueError(f"{stored}: dtype {stored_dtype} differs from the codec's {dtype}")
            data = np.ascontiguousarray(array)  # (the header takes its shape: a 0-d array is stored as [1])
            infos[stored] = StoredInfo(stored_dtype, tuple(data.shape), data.dtype.itemsize, data.nbytes,
                                       sha256_hex(data.reshape(-1).view(np.uint8)))
    return infos


def write_file(path: Path, entries: list[TensorEntry], arrays: dict[str, np.ndarray],
               extra: dict[str, Any] | None = None) -> int:
    """Write entries (and their stored arrays) as one container; returns the file size. Atomic, deterministic."""
    return write_container(path, entries, stored_infos(entries, arrays), arrays.__getitem__, extra)


def write_container(path: Path, entries: list[TensorEntry], infos: dict[str, StoredInfo],
                    read: Callable[[str], np.ndarray], extra: dict[str, Any] | None = None) -> int:
    """Write one container from checked header information (`stored_infos`) and `read(stored name)`, which gives
    each array's bytes when its turn comes (one at a time: the arrays need not all be in memory)."""
    names = sorted(infos, key=lambda n: (-infos[n].itemsize, n))  # widest first keeps alignment
    header: dict[str, Any] = {}
    offset = 0
    for name in names:
        info = infos[name]
        header[name] = {"dtype": info.dtype, "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
           "tensors": {e.name: e.to_json() for e in sorted(entries, key=lambda e: e.name)},
           "checksums": {name: infos[name].sha256 for name in names}}
    if extra:
        doc.update(extra)
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    header["__metadata__"] = {"format": "pt", FORMAT_NAME: text, DOC_SHA256_KEY: sha256_hex(text.encode())}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(len(head)) % _ALIGN)

    def body(f):
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name in names:
            data = np.ascontiguousarray(read(name)).reshape(-1).view(np.uint8)
            if data.nbytes != infos[name].nbytes:
                raise ValueError(f"{name}: {data.nbytes} bytes to write, the header says {infos[name].nbytes}")
            f.write(data.data)

    atomic_write(path, body)
    return 8 + len(head) + offset


class AccelFile:
    """A validated, memory-mapped reader of one container file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            raise FormatError(f"{self.path}: cannot read ({exc.strerror})") from None
        self.size = size
        self.stored: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self.doc = self._parse_header()
        self.entries = self._parse_entries()

    def _fail(self, message: str) -> FormatError:
        return FormatError(f"{self.path}: {message}")

    def _parse_header(self) -> dict[str, Any]:
        if self.size < 8:
            raise self._fail(f"truncated: {self.size} bytes is shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", self._map[:8])
        if self.size > 8 and self._map[8:9] != b"{":  # a safetensors header is a JSON object
            raise NotAccelOutput(f"{self.path}: not a safetensors file (no JSON header after its first 8 bytes)")
        if n > MAX_HEADER_BYTES or 8 + n > self.size:
            raise self._fail(f"truncated or corrupt: header length {n} runs past the file's {self.size} bytes")
        try:
            header = jsontext.loads(bytes(self._map[8 : 8 + n]))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError
            raise self._fail(f"header is not valid JSON ({exc.__class__.__name__})") from None
        if not isinstance(header, dict):
            raise self._fail("header is not a JSON object")
        meta = header.pop("__metadata__", None)
        data_start, data_size = 8 + n, self.size - 8 - n
        spans = []
        for name, info in header.items():
            try:
                dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._fail(f"tensor '{name}': malformed header entry") from None
            if not isinstance(dtype, str) or dtype not in NUMPY_OF:
                raise self._fail(f"tensor '{name}': unknown dtype {dtype!r}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
                raise self._fail(f"tensor '{name}': malformed shape or offsets")
            if not 0 <= start <= end <= data_size:
                raise self._fail(f"tensor '{name}': data offsets [{start}, {end}] lie past the end of the file "
                                 f"(data section is {data_size} bytes; truncated?)")
            if end - start != math.prod(shape) * NUMPY_OF[dtype].itemsize:  # exact: no int64 overflow
                raise self._fail(f"tensor '{name}': byte span does not match its shape {list(shape)} and {dtype}")
            self.stored[name] = (dtype, shape, data_start + start, data_start + end)
            spans.append((start, end, name))
        spans.sort()
        cursor = 0
        for start, end, name in spans:
            if start != cursor:
                raise self._fail(f"tensor '{name}': data overlaps another tensor or leaves a hole")
            cursor = end
        if cursor != data_size:
            raise self._fail(f"{data_size - cursor} bytes after the last tensor (corrupt or truncated)")
        if not isinstance(meta, dict) or FORMAT_NAME not in meta:
            raise NotAccelOutput(f"{self.path}: not an accel file (no 'accel' document in __metadata__)")
        text, recorded = meta[FORMAT_NAME], meta.get(DOC_SHA256_KEY)
        if not isinstance(text, str):
            raise self._fail("the accel document is not a string")
        try:
            doc = jsontext.loads(text)
        except ValueError:
            raise self._fail("the accel document is not valid JSON") from None
        if recorded is not None and recorded != sha256_hex(text.encode("utf-8")):
            raise self._fail(f"the accel document's SHA-256 differs from {DOC_SHA256_KEY} (it was changed after "
                             "it was written)")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise self._fail("the accel document does not name its format")
        version = doc.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise self._fail(f"format version {version!r} is not valid")
        if version > FORMAT_VERSION:
            raise self._fail(f"format version {version} is newer than this accel reads ({FORMAT_VERSION}); "
                             "upgrade accel")
        return doc

    def _parse_entries(self) -> dict[str, TensorEntry]:
        tensors = self.doc.get("tensors")
        checksums = self.doc.get("checksums")
        if not isinstance(tensors, dict) or not isinstance(checksums, dict):
            raise self._fail("the accel document lacks its 'tensors' or 'checksums' table")
        entries = {}
        claimed = set()
        for name in sorted(tensors):
            try:
                entry = TensorEntry.from_json(name, tensors[name])
                expected = entry.expected_parts()
            except FormatError as exc:
                raise self._fail(str(exc)) from None
            if set(expected) != set(entry.parts):
                raise self._fail(f"tensor '{name}': parts {sorted(entry.parts)} do not match its codec "
                                 f"({sorted(expected)})")
            for part, stored in entry.parts.items():
                if stored not in self.stored:
                    raise self._fail(f"tensor '{name}': stored tensor '{stored}' is missing")
                dtype, shape, _, _ = self.stored[stored]
                if (tuple(shape), dtype) != (tuple(expected[part][0]), expected[part][1]):
                    raise self._fail(f"tensor '{name}': part '{part}' has shape {list(shape)} {dtype}, expected "
                                     f"{list(expected[part][0])} {expected[part][1]} (shape mismatch)")
                if not isinstance(checksums.get(stored), str):
                    raise self._fail(f"tensor '{name}': no checksum for stored tensor '{stored}'")
                if stored in claimed:
                    raise self._fail(f"tensor '{name}': stored tensor '{stored}' belongs to another part as well")
                claimed.add(stored)
            entries[name] = entry
        unclaimed = sorted(set(self.stored) - claimed)
        if unclaimed:
            raise self._fail(f"stored tensor '{unclaimed[0]}' belongs to no logical tensor")
        return entries

    def raw_bytes(self, stored: str) -> memoryview:
        _, _, start, end = self.stored[stored]
        return memoryview(self._map)[start:end]

    def read_stored(self, stored: str) -> np.ndarray:
        dtype, shape, start, end = self.stored[stored]
        count = (end - start) // NUMPY_OF[dtype].itemsize
        return np.frombuffer(self._map, dtype=NUMPY_OF[dtype], count=count, offset=start).reshape(shape)

    def checksum_ok(self, stored: str) -> bool:
        return sha256_hex(self.raw_bytes(stored)) == self.doc["checksums"][stored]

    def stored_bytes(self, name: str) -> int:
        return sum(self.stored[s][3] - self.stored[s][2] for s in self.entries[name].parts.values())

    def decode(self, name: str, check: bool = True) -> np.ndarray:
        """Decode one logical tensor to float32 (integers for lossless integer codecs); checks its checksums."""
        entry = self.entries[name]
        if check:
            for stored in entry.parts.values():
                if not self.checksum_ok(stored):
                    raise FormatError(f"{self.path}: tensor '{name}': checksum mismatch in stored tensor "
                                      f"'{stored}' (the file is corrupt)")
        try:
            decoded = decode_parts(entry, {p: self.read_stored(s) for p, s in entry.parts.items()})
            # a copy where it views the map (the raw codec): its pages are released below
            return decoded if decoded.flags.owndata else decoded.copy()
        except FormatError as exc:  # a code the layout refuses: name the file too
            raise FormatError(f"{self.path}: {exc}") from None
        finally:
            self._release(entry.parts.values())

    def _release(self, stored_names) -> None:
        """Drop the mapped pages of these stored tensors from this process's resident set. The map is read-only
        and file-backed: a later read (an array that views it) faults them back in from the page cache. Without
        this, decoding a whole file tensor by tensor left all of it resident, so peak_rss_mb grew with the model
        (docs/architecture.md, "Memory")."""
        if isinstance(self._map, mmap.mmap):
            for stored in stored_names:
                drop_resident(self._map, *self.stored[stored][2:])

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            try:
                self._map.close()
            except BufferError:  # arrays still view the map; it closes when they are gone
                pass


def drop_resident(mapped: mmap.mmap, start: int, end: int) -> None:
    """madvise(MADV_DONTNEED) over the pages holding bytes [start, end) of a read-only file mapping: they leave the
    process's resident set, and a later read faults them back in from the page cache (a no-op where the OS has no
    such advice)."""
    first = start - start % mmap.PAGESIZE
    if hasattr(mmap, "MADV_DONTNEED") and end > first:
        mapped.madvise(mmap.MADV_DONTNEED, first, end - first)
