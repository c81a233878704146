"""Build a transformers model from an accel OUT_DIR with QuantLinear layers over the stored weights.

Kept raw tensors (embeddings, norms, LM head) are decoded as usual. Each coded 2-D weight that a kernel can read
(quantized, or kept on its source's own grid: a quantized GGUF's Q4_1 / Q8_0 tensors, bit for bit) stays in its
stored form (memory-mapped, checksums verified) behind a QuantLinear, and so does a tied LM head over coded
embeddings (the embedding lookup gets dense rows); the model is first built with an untouched `torch.empty`
placeholder in its place (no pages are written, so no memory is used) and the Linear is then swapped. A quantized
tensor no kernel reads, or one that does not feed an nn.Linear, is decoded densely.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from accel.errors import FormatError
from accel.formats.artifact import Artifact
from accel.progress import SILENT, Progress


def stored_parts(art: Artifact, name: str, check: bool = True) -> dict[str, np.ndarray]:
    """The stored arrays of one logical tensor keyed by part name (memory-mapped), checksums verified."""
    f = art.owner[name]
    entry = f.entries[name]
    if check:
        for stored in entry.parts.values():
            if not f.checksum_ok(stored):
                raise FormatError(f"{f.path}: tensor '{name}': checksum mismatch in stored tensor '{stored}' "
                                  "(the file is corrupt)")
    return {part: f.read_stored(stored) for part, stored in entry.parts.items()}


def _tied_head_source(art: Artifact, config: dict[str, Any]) -> str | None:
    """The stored embeddings a tied LM head multiplies by (none when the head is stored on its own or not tied)."""
    name = "model.embed_tokens.weight"
    if not config.get("tie_word_embeddings") or "lm_head.weight" in art.names or name not in art.names:
        return None
    return name


def build_kernel_model(art: Artifact, config: dict[str, Any], progress: Progress = SILENT):
    """A float32 causal LM whose coded linear layers (quantized, or kept on a source's own grid) are QuantLinear
    modules (eval mode)."""
    import torch

    from accel.converters import build_transformers_model
    from accel.converters.checkpoint_names import name_map
    from accel.kernels.quant_linear import QuantLinear
    from accel.kernels.weights import Unsupported, kernel_weight

    tensors: dict[str, Any] = {}
    kernels = {}
    # the model's name of each stored tensor: a checkpoint's per-expert tensors have none (they are merged into one
    # experts parameter, which no nn.Linear multiplies by), so they are decoded; renamed ones keep their kernels
    model_names = name_map(str(config.get("model_type")), art.model_shapes())
    progress.stage("loading weights (kernels)", len(art.names))
    for name in art.names:
        entry = art.entry(name)
        coded = entry.role == "quantized" or (entry.role == "kept" and entry.codec != "raw")
        if coded and name.endswith(".weight") and len(entry.shape) == 2 and model_names.model_name(name):
            parts = stored_parts(art, name)
            try:
                kernels[name] = kernel_weight(entry, parts)
                tensors[name] = torch.empty(tuple(entry.shape), dtype=torch.float32)
            except Unsupported:
                tensors[name] = art.decode(name)
            except FormatError as exc:  # a code the format refuses (kernel_weight names the tensor)
                raise FormatError(f"{art.owner[name].path}: {exc}") from None
        elif entry.role in ("quantized", "kept"):
            tensors[name] = art.decode(name)
        progress.advance()
    progress.close()
    model = build_transformers_model(config, tensors)
    del tensors
    head = _tied_head_source(art, config)
    if head in kernels:  # a tied LM head reads the embeddings' stored codes; the lookup gets dense rows below
        model.lm_head = QuantLinear(kernels[head], None)
    for stored_name, weight in kernels.items():
        name = model_names.model_name(stored_name) or stored_name
        path = name[: -len(".weight")]
        parent_name, _, child = path.rpartition(".")
        module = model.get_submodule(path)
        if isinstance(module, torch.nn.Linear) and tuple(module.weight.shape) == weight.shape:
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantLinear(weight, module.bias))
        else:  # not a plain linear layer: give it the dense weight
            module_param = model.get_parameter(name)
            with torch.no_grad():
                module_param.copy_(torch.from_numpy(np.ascontiguousarray(art.decode(stored_name), dtype=np.float32)))
    return model.eval()
