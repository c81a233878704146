"""Runtime precision maps (SemKV for the KV cache, DAMP for recurrent states): one registry for both kinds.

A map method turns `--kv SPEC` / `--state SPEC` into a `StoredMap` (JSON parameters + named arrays). `accel
quantize` writes it into the OUT_DIR container: the parameters under the document's `maps` key, the arrays as
logical tensors with role `map` named `maps.<kind>.<array>`. `accel eval` reads it back, checks it against the
model, and asks the method for a runtime (a transformers cache factory plus the figures it reports).

SPEC is `METHOD[:ARG]`; the method parses ARG. Uniform baselines register here too, so `accel eval --kv NAME`
runs them in the same harness as the maps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from accel.errors import AccelError, FormatError
from accel.formats.tensor import TensorEntry, encode_tensor
from accel.progress import SILENT, Progress

KINDS = {"kv": ("--kv", 5), "state": ("--state", 6)}
MAP_PREFIX = "maps."


@dataclass
class StoredMap:
    """A map as it is written and read: method name, JSON-able parameters, named arrays."""

    kind: str
    method: str
    params: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class BuildContext:
    """What a map method may use to build a map at `accel quantize` time."""

    model: str  # the source model spec
    config: dict[str, Any]  # its Hugging Face config
    calib: Path | None  # --calib directory, if given
    seed: int = 0
    progress: Progress = SILENT


class Runtime:
    """What `accel eval` gets from a map: a fresh cache per window, and the figures to report."""

    def make_cache(self) -> Any:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        """JSON keys for eval (e.g. kv_bytes_per_token, state_bits_per_value), measured on the caches made."""
        return {}


class MapMethod:
    """One `--kv` or `--state` method. Subclass with `kind=` and `name=` to register."""

    kind: ClassVar[str]
    name: ClassVar[str]
    description: ClassVar[str] = ""
    _registry: ClassVar[dict[tuple[str, str], MapMethod]] = {}

    def __init_subclass__(cls, kind: str | None = None, name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind is None or name is None:
            return
        if kind not in KINDS:
            raise ValueError(f"unknown map kind {kind!r}")
        cls.kind, cls.name = kind, name
        MapMethod._registry[(kind, name)] = cls()

    def build(self, arg: str | None, ctx: BuildContext) -> StoredMap:
        """The map `accel quantize --<kind> NAME[:ARG]` writes."""
        raise AccelError(f"{KINDS[self.kind][0]} {self.name} is an evaluation-time scheme; it writes no map")

    def from_eval_spec(self, arg: str | None, config: dict[str, Any]) -> StoredMap:
        """The map `accel eval --<kind> NAME[:ARG]` applies to a model directly (uniform schemes, baselines)."""
        raise AccelError(f"{KINDS[self.kind][0]} {self.name} needs calibration: write it with `accel quantize "
                         f"{KINDS[self.kind][0]} {self.name} --calib C --out D`, then `accel eval D`")

    def check(self, stored: StoredMap, config: dict[str, Any]) -> None:
        """Refuse (AccelError) a map whose shapes or parameters do not fit this model."""

    def runtime(self, stored: StoredMap, model: Any) -> Runtime:
        raise NotImplementedError


def _load_method_modules() -> None:
    """Import the modules that register map methods (each registers on import; missing ones are skipped)."""
    import importlib

    for module in ("accel.quantize.semkv", "accel.quantize.damp", "accel.runtime.kv_baselines",
                   "accel.runtime.state_cache"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def parse_spec(kind: str, spec: str) -> tuple[MapMethod, str | None]:
    """`METHOD[:ARG]` -> (registered method, ARG or None)."""
    _load_method_modules()
    flag, issue = KINDS[kind]
    name, _, arg = spec.strip().partition(":")
    method = MapMethod._registry.get((kind, name))
    if method is None:
        known = method_names(kind)
        if not known:
            raise AccelError(f"{flag} is not available yet (tracked in issue #{issue})")
        raise AccelError(f"unknown {flag} method {name!r} (available: {', '.join(known)})")
    return method, (arg if arg else None)


def get_method(kind: str, name: str) -> MapMethod:
    _load_method_modules()
    method = MapMethod._registry.get((kind, name))
    if method is None:
        raise FormatError(f"the {kind} map names an unknown method {name!r}")
    return method


def method_names(kind: str) -> list[str]:
    """The public methods of a kind (names starting with '_' are private, e.g. registered by tests)."""
    _load_method_modules()
    return sorted(n for k, n in MapMethod._registry if k == kind and not n.startswith("_"))


def encode_map(stored: StoredMap) -> tuple[dict[str, Any], list[tuple[TensorEntry, dict[str, np.ndarray]]]]:
    """(document entry for `maps[kind]`, logical tensors) for one map. Float arrays are stored as float32 raw,
    integer arrays as the `uint` codec at the fewest bits that hold them."""
    tensors = []
    names = {}
    for key in sorted(stored.arrays):
        arr = np.asarray(stored.arrays[key])
        tname = f"{MAP_PREFIX}{stored.kind}.{key}"
        if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
            arr = arr.astype(np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= 256):
                raise ValueError(f"map array {key!r}: integers must lie in 0..255")
            bits = max(1, int(arr.max()).bit_length()) if arr.size else 1
            tensors.append(encode_tensor(tname, arr.astype(np.uint8), "uint", role="map", bits=bits))
            names[key] = {"tensor": tname, "dtype": "int"}
        else:
            tensors.append(encode_tensor(tname, arr.astype(np.float32), "raw", role="map", dtype="float32"))
            names[key] = {"tensor": tname, "dtype": "float"}
    doc = {"method": stored.method, "params": stored.params, "arrays": names}
    return doc, tensors


def read_maps(art: Any) -> dict[str, StoredMap]:
    """The maps of an Artifact, validated as far as the document goes (shapes against a model: `check`)."""
    out = {}
    for kind, doc in sorted(art.map_documents().items()):
        if kind not in KINDS:
            raise FormatError(f"unknown map kind {kind!r}")
        get_method(kind, doc["method"])
        arrays = {}
        for key, ref in doc["arrays"].items():
            if not isinstance(ref, dict) or ref.get("tensor") not in art.names:
                raise FormatError(f"the {kind} map's array {key!r} names no stored tensor")
            value = art.decode(ref["tensor"])
            arrays[key] = value.astype(np.int64) if ref.get("dtype") == "int" else value
        out[kind] = StoredMap(kind, doc["method"], doc["params"], arrays)
    return out


def check_maps(maps: dict[str, StoredMap], config: dict[str, Any]) -> None:
    """Each map's method checks it against the model's config (AccelError on a mismatch)."""
    for kind, stored in maps.items():
        get_method(kind, stored.method).check(stored, config)
