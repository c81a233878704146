"""Hugging Face style model directories: config.json + model.safetensors (or shards with an index)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from accel.converters.sources import (
    PICKLE_SUFFIXES,
    ModelSource,
    config_json_bytes,
    one_line,
    pickle_refusal,
)
from accel.errors import AccelError, FormatError
from accel.formats import jsontext

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Files beside the weights that a converted model needs to be used: copied byte for byte.
SUPPORT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def read_json(path: Path) -> Any:
    try:
        return jsontext.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise FormatError(f"{path}: not valid JSON: {one_line(err)}") from err


class HFDirSource(ModelSource):
    """A directory as written by `save_pretrained`: config.json, safetensors weights, tokenizer files."""

    def __init__(self, path: Path, name: str | None = None):
        self.path = Path(path).absolute()
        self.name = name if name is not None else str(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise AccelError(
                f"{self.name}: no config.json in the directory (expected a Hugging Face model directory)"
            )
        config = read_json(config_path)
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            raise FormatError(f'{config_path}: not a Hugging Face config (no "model_type")')
        self.config = config

        shards, weight_map, index_path = self._find_weights()
        self._handles: dict[Path, Any] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # tensor -> (file offset, bytes)
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for shard in shards:
            self._scan_shard(shard)
        if weight_map is not None:
            self._check_index(index_path, weight_map)

        self.input_files = [config_path]
        if index_path is not None:
            self.input_files.append(index_path)
        self.input_files += shards
        self.input_files += [self.path / f for f in SUPPORT_FILES if (self.path / f).is_file()]
        self._names = sorted(self._meta)
        self._tokenizer = None

    def _find_weights(self) -> tuple[list[Path], dict[str, str] | None, Path | None]:
        index_path = self.path / INDEX_FILE
        if index_path.is_file():
            index = read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if (
                not isinstance(weight_map, dict)
                or not weight_map
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
            ):
                raise FormatError(f'{index_path}: no "weight_map" of tensor name -> shard file')
            shards = []
            for shard_name in sorted(set(weight_map.values())):
                shard = self.path / shard_name
                if Path(shard_name).name != shard_name or not shard.is_file():
                    raise AccelError(f"{index_path}: lists shard {shard_name!r}, which is not in {self.path}")
                shards.append(shard)
            return shards, weight_map, index_path
        single = self.path / SINGLE_FILE
        if single.is_file():
            return [single], None, None
        others = sorted(p.name for p in self.path.glob("*.safetensors"))
        if others:
            raise AccelError(
                f"{self.name}: has {', '.join(others)} but neither {SINGLE_FILE} nor {INDEX_FILE}; "
                f"sharded weights need their index"
            )
        pickles = sorted(p for p in self.path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
        if pickles:
            raise pickle_refusal(pickles[0])
        raise AccelError(
            f"{self.name}: no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}) in the directory"
        )

    def _scan_shard(self, shard: Path) -> None:
        try:
            handle = safe_open(str(shard), framework="numpy")  # validates the header, offsets and sizes
            keys = list(handle.keys())
            meta = {}
            for key in keys:
                part = handle.get_slice(key)
                meta[key] = (tuple(int(d) for d in part.get_shape()), part.get_dtype())
            with open(shard, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for key in keys:
                start, end = header[key]["data_offsets"]
                self._spans[key] = (8 + length + int(start), int(end) - int(start))
        except Exception as err:  # the Rust reader raises its own SafetensorError, and OSError
            raise FormatError(f"{shard}: not a valid safetensors file: {one_line(err)}") from err
        self._handles[shard] = handle
        for key, (shape, st_dtype) in meta.items():
            if key in self._where:
                raise FormatError(f"{shard}: tensor {key!r} is also in {self._where[key].name}")
            dtype = _SAFETENSORS_DTYPES.get(st_dtype)
            if dtype is None:
                raise AccelError(
                    f"{shard}: tensor {key!r} is {st_dtype}; "
                    f"only float32/float16/bfloat16 weights are accepted"
                )
            self._where[key] = shard
            self._meta[key] = (shape, dtype)

    def _check_index(self, index_path: Path, weight_map: dict[str, str]) -> None:
        for key, shard_name in sorted(weight_map.items()):
            found = self._where.get(key)
            if found is None:
                raise FormatError(f"{index_path}: lists tensor {key!r}, which is not in {shard_name}")
            if found.name != shard_name:
                raise FormatError(
                    f"{index_path}: puts tensor {key!r} in {shard_name}, but it is in {found.name}"
                )
        for key in sorted(self._where):
            if key not in weight_map:
                raise FormatError(
                    f"{index_path}: does not list tensor {key!r} (found in {self._where[key].name})"
                )

    def tensor_names(self) -> list[str]:
        return list(self._names)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        if name not in self._meta:
            raise self._unknown_tensor(name)
        return self._meta[name][0]

    def tensor_dtype(self, name: str) -> str:
        if name not in self._meta:
            raise self._unknown_tensor(name)
        return self._meta[name][1]

    def load_tensor(self, name: str) -> np.ndarray:
        shard = self._where.get(name)
        if shard is None:
            raise self._unknown_tensor(name)
        # read, not taken from safe_open's memory map: the pages a mapped read touches stay in this process's
        # resident set, so a whole model's worth of them counted in peak_rss_mb (docs/architecture.md, "Memory")
        shape, dtype = self._meta[name]
        offset, nbytes = self._spans[name]
        try:
            with open(shard, "rb") as f:
                f.seek(offset)
                raw = np.fromfile(f, dtype=np.uint8, count=nbytes)
        except OSError as err:
            raise FormatError(f"{shard}: cannot read tensor {name!r}: {one_line(err)}") from err
        if raw.size != nbytes:
            raise FormatError(f"{shard}: cannot read tensor {name!r}: the file ends {nbytes - raw.size} bytes early")
        if dtype == "bfloat16":
            array = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            array = raw.view("<f4" if dtype == "float32" else "<f2").astype(np.float32)
        return array.reshape(shape)

    def load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            if not any((self.path / f).is_file() for f in TOKENIZER_MODEL_FILES):
                raise AccelError(
                    f"{self.name}: no tokenizer file in the directory "
                    f"(one of {', '.join(TOKENIZER_MODEL_FILES)})"
                )
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(str(self.path), use_fast=True)
            except Exception as err:
                raise AccelError(f"{self.name}: cannot load the tokenizer: {one_line(err)}") from err
        return self._tokenizer

    def save_support_files(self, out_dir: Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_bytes(config_json_bytes(self.config))
        for file_name in SUPPORT_FILES:
            source = self.path / file_name
            if source.is_file():
                shutil.copyfile(source, out_dir / file_name)

    def close(self) -> None:
        self._handles.clear()
