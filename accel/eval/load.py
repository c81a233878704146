"""Load what `eval` and `verify` compare: a source model, or an accel OUT_DIR whose weights are decoded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel.errors import AccelError
from accel.formats import jsontext
from accel.formats.artifact import MANIFEST_FILE, Artifact
from accel.memory import check_fits, float32_bytes
from accel.progress import SILENT, Progress


def is_accel_output(spec: str | Path) -> bool:
    """True for an OUT_DIR of `accel quantize`; an OUT_DIR that lost its accel.json is refused, not read as a source
    model (whose loader would stumble on the packed codes)."""
    path = Path(spec)
    if not path.is_dir():
        return False
    if (path / MANIFEST_FILE).is_file():
        return True
    if _json_object(path / "config.json").get("accel") is not None:  # the section accel quantize adds
        raise AccelError(f"{path}: an accel output without its {MANIFEST_FILE} (the manifest); write it again with "
                         f"accel quantize")
    return False


def _json_object(path: Path) -> dict:
    try:
        doc = jsontext.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def model_config(art: Artifact) -> dict[str, Any] | None:
    """The Hugging Face config an OUT_DIR's model is built from: its config.json less accel's `accel` section."""
    if not isinstance(art.config, dict):
        return None
    return {k: v for k, v in art.config.items() if k != "accel"}


@dataclass
class LoadedModel:
    model: Any  # a transformers causal LM, float32, eval mode
    tokenizer: Any
    config: dict[str, Any]
    source_kind: str  # "accel" or "source"
    maps: dict[str, Any] = field(default_factory=dict)  # kind -> accel.quantize.maps.StoredMap (OUT_DIRs only)
    input_files: list[Path] = field(default_factory=list)  # a source model's files (what calibrations record)
    path: Path | None = None  # the directory or file it was read from (an alias resolved)
    streamed: Any = None  # an accel.converters.streamed.StreamedModel whose `model` this is (streamed_causal_lm)


def load_decoded_tensors(art: Artifact, progress: Progress = SILENT) -> dict[str, np.ndarray]:
    progress.stage("decoding weights", len(art.names))
    tensors = {}
    for name in art.names:
        if art.entry(name).role in ("quantized", "kept"):
            tensors[name] = art.decode(name)
        progress.advance()
    progress.close()
    return tensors


def load_causal_lm(spec: str | Path, progress: Progress = SILENT, kernels: bool = False) -> LoadedModel:
    """A transformers model for a source model spec or an accel OUT_DIR (weights decoded to float32).

    kernels: an OUT_DIR's quantized linear weights stay in their stored form behind QuantLinear modules (fused
    decode kernels, accel.kernels) instead of being decoded; a source model is dense either way.
    """
    from transformers import AutoTokenizer

    from accel.converters import announce_tokenizer_work, build_transformers_model, open_model

    if is_accel_output(spec):
        art = Artifact(Path(spec))
        config = model_config(art)
        if config is None:
            raise AccelError(f"{spec}: config.json is missing, so the model cannot be built")
        from accel.quantize.maps import check_maps, read_maps

        maps = read_maps(art)
        check_maps(maps, config)  # a map for another model is refused before any weight is decoded
        if kernels:
            from accel.kernels.loading import build_kernel_model

            model = build_kernel_model(art, config, progress)
            progress.stage("loading the tokenizer", 1)
        else:
            check_fits(float32_bytes(art.model_shapes().values()), f"{spec}: decoding the model",
                       "--kernels keeps its quantized weights packed")
            tensors = load_decoded_tensors(art, progress)
            progress.stage("building the model", 2)  # seconds of silence otherwise (transformers, the tokenizer)
            model = build_transformers_model(config, tensors)
            del tensors
            progress.advance()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(spec))
        except (OSError, ValueError) as exc:
            raise AccelError(f"{spec}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from None
        progress.advance()
        progress.close()
        return LoadedModel(model, tokenizer, config, "accel", maps, path=Path(spec).absolute())
    progress.stage(f"opening {Path(str(spec)).name}", 1)  # a GGUF file's header and tensor table take seconds
    with open_model(spec) as source:
        progress.advance()
        names = source.tensor_names()
        check_fits(float32_bytes(source.tensor_shapes().values()), f"{spec}: loading the model")
        progress.stage("loading weights", len(names))
        tensors = {}
        for name in names:
            tensors[name] = source.load_tensor(name)
            progress.advance()
        progress.stage("building the model", 2)
        model = build_transformers_model(source.config, tensors)
        del tensors
        progress.advance()
        announce_tokenizer_work(source, progress)
        tokenizer = source.load_tokenizer()
        progress.advance()
        progress.close()
        return LoadedModel(model, tokenizer, dict(source.config), "source",
                           input_files=list(source.input_files), path=source.path)


@contextlib.contextmanager
def streamed_causal_lm(spec: str | Path, progress: Progress = SILENT,
                       nonfinite_message: str | None = None) -> Iterator[LoadedModel]:
    """A source model whose weights stay in the source while the block runs: `model` is built on the meta device,
    and `streamed` (accel.converters.streamed.StreamedModel) loads and releases parts of it. Not an OUT_DIR."""
    from accel.converters import announce_tokenizer_work, open_model
    from accel.converters.streamed import StreamedModel

    if is_accel_output(spec):
        raise AccelError(f"{spec}: an accel output is decoded whole, not streamed from its source")
    progress.stage(f"opening {Path(str(spec)).name}", 2)
    with open_model(spec) as source:
        progress.advance()
        streamed = StreamedModel(source, nonfinite_message)
        announce_tokenizer_work(source, progress)
        tokenizer = source.load_tokenizer()
        progress.advance()
        progress.close()
        yield LoadedModel(streamed.model, tokenizer, dict(source.config), "source",
                          input_files=list(source.input_files), path=source.path, streamed=streamed)
