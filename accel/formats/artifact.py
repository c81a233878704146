"""An accel weights set on disk: one container file, or shards with an index, read back as one artifact."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np

from accel.errors import AccelError, FormatError, NotAccelOutput
from accel.formats import jsontext
from accel.formats.atomic import atomic_write_text
from accel.formats.container import AccelFile, StoredInfo, stored_infos, write_container
from accel.formats.filehash import files_sha256
from accel.formats.tensor import TensorEntry

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "accel.json"
DEFAULT_SHARD_BYTES = 2 * 1024**3

Encoded = tuple[TensorEntry, dict[str, np.ndarray]]


def sidecar_files_sha256(out_dir: Path) -> dict[str, str]:
    """SHA-256 by name of an OUT_DIR's files besides its containers and accel.json (config, tokenizer files, the
    shard index): what accel.json's `files` records when quantize writes them and `verify` checks (docs/format.md
    §6). The containers are left out: each stored tensor has its own checksum in the container's document."""
    return files_sha256(out_dir, lambda rel: "/" not in rel and rel != MANIFEST_FILE and not rel.endswith(".safetensors"))


def write_weights(out_dir: Path, encoded: list[Encoded], max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  extra: dict[str, Any] | None = None) -> list[Path]:
    """Write logical tensors into one file, or into shards of at most max_shard_bytes with an HF-style index.

    All parts of a logical tensor stay in one shard, so every shard is a self-describing container.
    """
    arrays = _merge(encoded)
    tensors = [(entry, stored_infos([entry], items)) for entry, items in encoded]
    return _write_sets(Path(out_dir), tensors, arrays.__getitem__, max_shard_bytes, extra)


class WeightsWriter:
    """write_weights for tensors that come one at a time: each is checked and its arrays spilled to a scratch
    file in OUT_DIR as it is added, so only one tensor's arrays need be in memory; `finish` writes the files (the
    same bytes write_weights writes for the same tensors) and deletes the scratch file."""

    SPILL = ".accel-spill.tmp"

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out_dir, self.max_shard_bytes = Path(out_dir), max_shard_bytes
        self._spill_path = self.out_dir / self.SPILL
        self._spill = open(self._spill_path, "xb")  # noqa: SIM115 (closed by finish or discard)
        self._tensors: list[tuple[TensorEntry, dict[str, StoredInfo]]] = []
        self._where: dict[str, tuple[int, np.dtype]] = {}  # stored name -> (offset in the spill, numpy dtype)

    def add(self, item: Encoded) -> None:
        entry, arrays = item
        infos = stored_infos([entry], arrays)
        for name in infos:
            if name in self._where:
                raise ValueError(f"stored tensor '{name}' added twice")
            data = np.ascontiguousarray(arrays[name])
            self._where[name] = (self._spill.tell(), data.dtype)
            self._spill.write(data.reshape(-1).view(np.uint8).data)
        self._tensors.append((entry, infos))

    def tensors(self) -> list[tuple[TensorEntry, int]]:
        """The tensors added so far, in the order added, with the bytes each stores."""
        return [(entry, sum(info.nbytes for info in infos.values())) for entry, infos in self._tensors]

    def _read(self, name: str) -> np.ndarray:
        offset, dtype = self._where[name]
        nbytes = self._infos[name].nbytes
        return np.fromfile(self._spill_path, dtype=np.uint8, count=nbytes, offset=offset).view(dtype)

    def finish(self, extra: dict[str, Any] | None = None) -> list[Path]:
        """Write the weights files (one, or shards with an index) and remove the scratch file."""
        self._spill.close()
        self._infos = {name: info for _, infos in self._tensors for name, info in infos.items()}
        try:
            return _write_sets(self.out_dir, self._tensors, self._read, self.max_shard_bytes, extra)
        finally:
            self._spill_path.unlink()

    def discard(self) -> None:
        self._spill.close()
        self._spill_path.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._spill.closed or self._spill_path.exists():
            self.discard()


def _write_sets(out_dir: Path, tensors: list[tuple[TensorEntry, dict[str, StoredInfo]]],
                read: Callable[[str], np.ndarray], max_shard_bytes: int, extra: dict[str, Any] | None) -> list[Path]:
    """The weights files of write_weights: tensors in name order, a new shard where the next would pass
    max_shard_bytes, `extra` in the first file."""
    tensors = sorted(tensors, key=lambda t: t[0].name)
    shards: list[list[tuple[TensorEntry, dict[str, StoredInfo]]]] = [[]]
    size = 0
    for item in tensors:
        nbytes = sum(info.nbytes for info in item[1].values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    if len(shards) == 1:
        path = out_dir / WEIGHTS_FILE
        write_container(path, [e for e, _ in shards[0]], _merge_infos(shards[0]), read, extra)
        return [path]
    paths, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        infos = _merge_infos(shard)
        write_container(path, [e for e, _ in shard], infos, read, extra if i == 0 else None)
        paths.append(path)
        total += sum(info.nbytes for info in infos.values())
        weight_map.update({name: path.name for name in infos})
    index = {"metadata": {"total_size": total, "format": "accel"}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(out_dir / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths


def _merge(items: list[Encoded]) -> dict[str, np.ndarray]:
    merged: dict[str, np.ndarray] = {}
    for _, arrays in items:
        merged.update(arrays)
    return merged


def _merge_infos(items: list[tuple[TensorEntry, dict[str, StoredInfo]]]) -> dict[str, StoredInfo]:
    merged: dict[str, StoredInfo] = {}
    for _, infos in items:
        merged.update(infos)
    return merged


@dataclass
class TensorReport:
    name: str
    codec: str
    layout: str
    role: str
    shape: tuple[int, ...]
    bytes: int
    bits_per_weight: float
    params: dict[str, Any]


class Artifact:
    """Read side: an OUT_DIR (weights file or shards + index, accel.json, config.json) or one container file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.exists():
            raise FormatError(f"{self.path}: no such file or directory")
        self.root = self.path if self.path.is_dir() else self.path.parent
        self.files = [self._open(p) for p in self._weight_files()]
        self.owner: dict[str, AccelFile] = {}
        for f in self.files:
            for name in f.entries:
                if name in self.owner:
                    raise FormatError(f"{f.path}: tensor '{name}' also appears in {self.owner[name].path}")
                self.owner[name] = f
        self.manifest = self._read_object(MANIFEST_FILE) if self.path.is_dir() else None
        self.config = self._read_object("config.json") if self.path.is_dir() else None
        self.extra = {k: v for k, v in self.files[0].doc.items()
                      if k not in ("format", "version", "tensors", "checksums")} if self.files else {}

    def _open(self, path: Path) -> AccelFile:
        try:
            return AccelFile(path)
        except NotAccelOutput as exc:  # inside a directory accel.json marks as an output, the container is damaged
            if self.path.is_dir() and (self.path / MANIFEST_FILE).exists():
                raise FormatError(str(exc)) from None
            raise

    def _weight_files(self) -> list[Path]:
        if self.path.is_file():
            with open(self.path, "rb") as f:
                magic = f.read(4)
            if magic == b"GGUF":  # a source model, not something accel wrote
                raise AccelError(f"{self.path.name} is a GGUF model file, not an accel output (inspect and verify read "
                                 f"what accel quantize writes; quantize and eval take a GGUF as MODEL)")
            return [self.path]
        index = self.path / INDEX_FILE
        if index.exists():
            doc = self._read_json(INDEX_FILE)
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise FormatError(f"{index}: no weight_map")
            for shard in weight_map.values():
                if not isinstance(shard, str) or "/" in shard:
                    raise FormatError(f"{index}: weight_map names {shard!r}, not a shard file name")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (self.path / shard).is_file():
                    raise FormatError(f"{index}: shard {shard!r} is missing")
            return [self.path / s for s in shards]
        single = self.path / WEIGHTS_FILE
        if not single.is_file():
            kind = FormatError if (self.path / MANIFEST_FILE).exists() else NotAccelOutput  # a damaged output has one
            raise kind(f"{self.path}: no {WEIGHTS_FILE} or {INDEX_FILE} (not an accel output directory)")
        return [single]

    def _read_object(self, name: str) -> dict | None:
        doc = self._read_json(name)
        if doc is not None and not isinstance(doc, dict):
            raise FormatError(f"{self.root / name}: not a JSON object")
        return doc

    def _read_json(self, name: str) -> Any:
        path = self.root / name
        if not path.exists():
            return None
        try:
            return jsontext.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError
            raise FormatError(f"{path}: not valid JSON ({exc.__class__.__name__})") from None

    @property
    def names(self) -> list[str]:
        return sorted(self.owner)

    def map_documents(self) -> dict[str, dict[str, Any]]:
        """The document's `maps`, each checked to be an object with a string `method`, and objects `params` and
        `arrays` (what a map means is accel.quantize.maps' to check)."""
        maps = self.extra.get("maps", {})
        if not isinstance(maps, dict):
            raise FormatError("the document's 'maps' is not an object")
        for kind, doc in maps.items():
            if not isinstance(doc, dict) or not isinstance(doc.get("method"), str) \
                    or not isinstance(doc.get("params"), dict) or not isinstance(doc.get("arrays"), dict):
                raise FormatError(f"the {kind} map lacks method, params or arrays")
        return maps

    def entry(self, name: str) -> TensorEntry:
        return self.owner[name].entries[name]

    def decode(self, name: str, check: bool = True) -> np.ndarray:
        return self.owner[name].decode(name, check=check)

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The model's tensors (roles quantized and kept, not maps) by name, with their logical shapes."""
        return {n: tuple(self.entry(n).shape) for n in self.names if self.entry(n).role in ("quantized", "kept")}

    def report(self, name: str) -> TensorReport:
        entry, nbytes = self.entry(name), self.owner[name].stored_bytes(name)
        return TensorReport(name=name, codec=entry.codec, layout=entry.layout, role=entry.role, shape=entry.shape,
                            bytes=nbytes, bits_per_weight=8.0 * nbytes / max(entry.numel, 1), params=entry.params)

    def bits_per_weight(self, role: str = "quantized") -> float | None:
        """Exact bits per weight over the logical tensors of one role: every stored byte counted."""
        reports = [self.report(n) for n in self.names if self.entry(n).role == role]
        weights = sum(int(np.prod(r.shape, dtype=np.int64)) for r in reports)
        return 8.0 * sum(r.bytes for r in reports) / weights if weights else None

    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()
