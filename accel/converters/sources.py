"""The model-source protocol: one lazy, memory-mapped view of a model's config, tensors and tokenizer.

`open_model` turns what the user typed (a Hugging Face directory, a .gguf file or an alias) into a source.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np

from accel.converters.gguf_header import MAGIC as GGUF_MAGIC
from accel.errors import AccelError
from accel.progress import Progress

# Pickle-based checkpoint formats: loading one runs arbitrary code from the file.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# The precisions a source may report; everything loads as float32.
SOURCE_DTYPES = ("float32", "float16", "bfloat16")


def one_line(text: object) -> str:
    """Collapse a library's (possibly multi-line) message so an AccelError stays one line."""
    return " ".join(str(text).split())


def pickle_refusal(path: Path) -> AccelError:
    return AccelError(
        f"{path}: refusing a pickle checkpoint ({path.suffix}): unpickling can execute arbitrary code; "
        f"convert it to safetensors first (e.g. save_pretrained(..., safe_serialization=True))"
    )


def config_json_bytes(config: dict[str, Any]) -> bytes:
    """The canonical bytes of a config.json: sorted keys, two-space indent, trailing newline."""
    return (json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


class ModelSource(abc.ABC):
    """A source model: an HF config dict, HF-named float tensors loaded one at a time, and a tokenizer.

    Tensor names and shapes are Hugging Face's (PyTorch orientation), whatever the file stores.
    """

    name: str
    path: Path  # the directory or file the model was read from (an alias resolved)
    config: dict[str, Any]
    input_files: list[Path]

    @abc.abstractmethod
    def tensor_names(self) -> list[str]:
        """Hugging Face parameter names, sorted."""

    @abc.abstractmethod
    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape in PyTorch orientation, e.g. (out_features, in_features)."""

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape by name (nothing loaded)."""
        return {name: tuple(self.tensor_shape(name)) for name in self.tensor_names()}

    @abc.abstractmethod
    def tensor_dtype(self, name: str) -> str:
        """The source precision: "float32", "float16" or "bfloat16" (quantized GGUF types: "float32")."""

    @abc.abstractmethod
    def load_tensor(self, name: str) -> np.ndarray:
        """The tensor as a fresh float32, C-contiguous, writable array."""

    def native_grid(self, name: str) -> dict[str, Any] | None:
        """The affine grid the source itself stores the tensor on, when it stores one (quantized GGUF types): the
        `affine` codec's `levels`, `group`, and fp16 `scale` and `offset` arrays [rows, groups] on which
        `load_tensor`'s values lie exactly; None for float tensors."""
        return None

    @abc.abstractmethod
    def load_tokenizer(self) -> Any:
        """A transformers fast tokenizer."""

    def tokenizer_work(self) -> str | None:
        """What the first `load_tokenizer` will spend seconds on, for a progress bar's label; None when it only
        reads files."""
        return None

    @abc.abstractmethod
    def save_support_files(self, out_dir: Path) -> None:
        """Write config.json and the tokenizer files into out_dir (same input, same bytes)."""

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Every tensor in name order, loaded one at a time."""
        for name in self.tensor_names():
            yield name, self.load_tensor(name)

    def close(self) -> None:
        """Release file handles and memory maps (the source is unusable afterwards)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def _unknown_tensor(self, name: str) -> AccelError:
        return AccelError(f"{self.name}: no tensor named {name!r}")


def announce_tokenizer_work(source: ModelSource, progress: Progress) -> None:
    """Give the first conversion of a tokenizer (seconds) a progress stage of its own, where it has one."""
    work = source.tokenizer_work()
    if work:
        progress.stage(work, 1)


def open_model(spec: str | Path) -> ModelSource:
    """Open a Hugging Face style directory, a .gguf file, or a built-in alias (see `accel models`)."""
    from accel.converters.aliases import ALIASES, resolve_alias
    from accel.converters.gguf_file import GGUFSource
    from accel.converters.hf_dir import HFDirSource

    name = str(spec)
    path = Path(spec)
    if not path.exists():
        alias_path = resolve_alias(name) if isinstance(spec, str) else None
        if alias_path is None:
            known = ", ".join(sorted(ALIASES)) or "none"
            raise AccelError(
                f"model {name!r} not found: no such file or directory, and not a known alias ({known})"
            )
        path = alias_path
    if path.is_dir():
        return HFDirSource(path, name=name)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise pickle_refusal(path)
    if path.suffix.lower() == ".gguf" or _has_magic(path, GGUF_MAGIC):
        return GGUFSource(path, name=name)
    if path.suffix.lower() == ".safetensors":
        raise AccelError(
            f"{path}: pass the directory that holds this file and its config.json, not the .safetensors file"
        )
    raise AccelError(
        f"{path}: not a model: expected a directory with config.json + *.safetensors, or a .gguf file"
    )


def _has_magic(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError as err:
        raise AccelError(f"{path}: cannot read: {one_line(err)}") from err
