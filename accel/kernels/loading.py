"""Build a transformers model from an accel OUT_DIR with QuantLinear layers over the stored weights.

Kept tensors (embeddings, norms, LM head) are decoded as usual; a tied LM head whose embeddings are stored coded
(a quantized GGUF's own grid, kept bit for bit) also multiplies through a QuantLinear over those codes. Each
quantized 2-D weight that a kernel can read stays in its stored form (memory-mapped, checksums verified) behind a
QuantLinear; the model is first built with an untouched `torch.empty` placeholder in its place (no pages are
written, so no memory is used) and the Linear is then swapped. A quantized tensor no kernel reads, or one that does
not feed an nn.Linear, is decoded densely.
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
                raise FormatError(f"{f.path.name}: tensor '{name}': checksum mismatch in stored tensor '{stored}' "
                                  "(the file is corrupt)")
    return {part: f.read_stored(stored) for part, stored in entry.parts.items()}


def _tied_head_source(art: Artifact, config: dict[str, Any]) -> str | None:
    """The stored embeddings a tied LM head multiplies by, when they are coded (not raw floats): a kept tensor on
    its source's own grid (docs/format.md, `kept`) or a quantized one."""
    name = "model.embed_tokens.weight"
    if not config.get("tie_word_embeddings") or "lm_head.weight" in art.names or name not in art.names:
        return None
    return None if art.entry(name).codec == "raw" else name


def build_kernel_model(art: Artifact, config: dict[str, Any], progress: Progress = SILENT):
    """A float32 causal LM whose quantized linear layers are QuantLinear modules (eval mode)."""
    import torch

    from accel.converters import build_transformers_model
    from accel.kernels.quant_linear import QuantLinear
    from accel.kernels.weights import Unsupported, kernel_weight

    tensors: dict[str, Any] = {}
    kernels = {}
    progress.stage("loading weights (kernels)", len(art.names))
    head = _tied_head_source(art, config)
    for name in art.names:
        entry = art.entry(name)
        if entry.role == "quantized" and name.endswith(".weight") and len(entry.shape) == 2:
            try:
                kernels[name] = kernel_weight(entry, stored_parts(art, name))
                tensors[name] = torch.empty(tuple(entry.shape), dtype=torch.float32)
            except Unsupported:
                tensors[name] = art.decode(name)
        elif entry.role in ("quantized", "kept"):
            tensors[name] = art.decode(name)
        progress.advance()
    progress.close()
    model = build_transformers_model(config, tensors)
    del tensors
    if head is not None:  # the tied LM head reads the embeddings' stored codes; the lookup keeps its dense rows
        try:
            model.lm_head = QuantLinear(kernel_weight(art.entry(head), stored_parts(art, head)), None)
        except Unsupported:
            pass
    for name, weight in kernels.items():
        path = name[: -len(".weight")]
        parent_name, _, child = path.rpartition(".")
        module = model.get_submodule(path)
        if isinstance(module, torch.nn.Linear) and tuple(module.weight.shape) == weight.shape:
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, QuantLinear(weight, module.bias))
        else:  # not a plain linear layer: give it the dense weight
            module_param = model.get_parameter(name)
            with torch.no_grad():
                module_param.copy_(torch.from_numpy(np.ascontiguousarray(art.decode(name), dtype=np.float32)))
    return model.eval()
