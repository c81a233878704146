"""Post-quantization tuning of Leech row scales (`accel quantize --weights leechN --tune-steps N`).

The codes stay fixed; only the fp16 row scales of every `leech` tensor move. A leech weight decodes to
W = U^T diag(s) Q V (accel.formats.leech_codec), so with C = Q V a layer computes y = ((x C^T) * s) U: the scales
are a per-output gain in the transformed domain, and the output transform U is applied to activations (a seeded
Hadamard, cheap). The scales are fitted by Adam on the KL divergence from the source model's next-token
distribution to the quantized model's, over the calibration windows (one window a step, a seeded order), then
rounded to fp16. Bits/weight do not change.

Deterministic: one torch thread during tuning, a fixed window order; the same inputs and seed give the same bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from accel.formats import dtypes
from accel.formats.tensor import TensorEntry, decode_parts
from accel.progress import SILENT, Progress
from accel.quantize.incoherence import _factors, rht, split_size

Encoded = tuple[TensorEntry, dict[str, np.ndarray]]


def _fwht(y: torch.Tensor) -> torch.Tensor:
    n = y.shape[-1]
    lead = y.shape[:-1]
    h = 1
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        y = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-2).reshape(*lead, n)
        h *= 2
    return y / float(np.sqrt(n))


class _OutputTransform(torch.nn.Module):
    """v -> v U along the last axis (the row-vector form of U^T applied to a column): rht(..., inverse=True)."""

    def __init__(self, n: int, seed: int):
        super().__init__()
        odd, self.power = split_size(n)
        signs, r = _factors(n, seed)
        self.odd = odd
        self.register_buffer("r", torch.tensor(r, dtype=torch.float32))
        self.register_buffer("signs", torch.tensor(signs, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.einsum("ji,...jk->...ik", self.r, x.reshape(*lead, self.odd, self.power))
        return _fwht(y).reshape(*lead, self.odd * self.power) * self.signs


class TunedLeechLinear(torch.nn.Module):
    """A leech linear layer with fixed codes and trainable row gains g (scale = s0 * g)."""

    def __init__(self, c: np.ndarray, scale: np.ndarray, seed_out: int):
        super().__init__()
        self.register_buffer("c", torch.tensor(c, dtype=torch.float32))
        self.register_buffer("s0", torch.tensor(scale, dtype=torch.float32))
        self.gain = torch.nn.Parameter(torch.ones(len(scale)))
        self.out_transform = _OutputTransform(len(scale), seed_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # memory: tune_leech_scales recomputes whole decoder layers in backward, this transform included
        return self.out_transform(F.linear(x, self.c) * (self.s0 * self.gain))

    def scale16(self) -> np.ndarray:
        s = (self.s0.double() * self.gain.detach().double()).numpy()
        return dtypes.to_storage(np.where(self.s0.numpy() == 0, 0.0, s), "float16")


def _unit_scale_core(entry: TensorEntry, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """C = Q V (rows x logical cols): the decode with every row scale 1, with the output transform undone."""
    parts = {part: arrays[stored] for part, stored in entry.parts.items()}
    parts["scale"] = np.ones(entry.shape[0], dtype=np.float16)
    w = decode_parts(entry, parts).astype(np.float64)
    return rht(w.T, entry.params["seed_out"]).T


def _release_large_buffers_to_the_os() -> None:
    """Fix glibc's mmap threshold at 1 MiB: buffers above it are returned to the OS when freed.

    glibc otherwise raises the threshold after each large free, so the next step's activations come from the heap
    and fragment it: SmolLM2's tuning alone grew to 6.3 GB RSS over three steps without this, 2.5 GB with it.
    A no-op where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is not None:
        mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def kl_to_reference(teacher: torch.nn.Module, student: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) of the next-token distributions."""
    with torch.no_grad():
        ref = torch.log_softmax(teacher(input_ids=ids, use_cache=False).logits.float(), dim=-1)
    out = torch.log_softmax(student(input_ids=ids, use_cache=False).logits.float(), dim=-1)
    return (ref.exp() * (ref - out)).sum(-1).mean()


def tune_leech_scales(config: Mapping[str, Any], source: Mapping[str, np.ndarray], encoded: list[Encoded],
                      windows: np.ndarray, steps: int, lr: float = 1e-3, seed: int = 0,
                      progress: Progress = SILENT, model_name: Callable[[str], str | None] | None = None
                      ) -> dict[str, Any]:
    """Refit the fp16 row scales of every leech tensor in `encoded` (in place) by KL to the source model.

    `source` holds every tensor of the source model (HF names), `windows` the calibration token ids
    [n, seq_len]. Codes and every other part stay as they are. `model_name` gives the model's name of a checkpoint
    name that transformers renames (accel.converters.checkpoint_names); the tensors are the checkpoint's. Returns a
    short report.
    """
    from accel.converters import build_transformers_model

    started = time.perf_counter()
    leech = [(e, a) for e, a in encoded if e.codec == "leech" and e.role == "quantized"]
    if not leech or steps <= 0:
        return {"steps": 0, "tensors": 0}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fixed reduction order: the same bytes on every run
    try:
        tensors = {k: np.asarray(v, dtype=np.float32) for k, v in source.items()}
        teacher = build_transformers_model(config, tensors)
        student = build_transformers_model(config, tensors)
        student.requires_grad_(False)  # only the gains below are trained: no gradients for anything else
        # recompute each decoder layer in backward instead of holding its activations (same ops, same bytes)
        student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        student.train()  # checkpointing is active in training mode only; the Llama stack has no dropout
        _release_large_buffers_to_the_os()
        modules: dict[str, TunedLeechLinear] = {}
        for entry, arrays in leech:
            path = ((model_name(entry.name) if model_name else None) or entry.name).removesuffix(".weight")
            parent, child = path.rsplit(".", 1)
            module = TunedLeechLinear(_unit_scale_core(entry, arrays), arrays[entry.parts["scale"]],
                                      entry.params["seed_out"])
            setattr(student.get_submodule(parent), child, module)
            modules[entry.name] = module
        gains = [m.gain for m in modules.values()]
        opt = torch.optim.Adam(gains, lr=lr)
        order = np.random.default_rng([seed, 0x7E57]).permutation(len(windows))
        losses = []
        progress.stage("tuning leech scales (KL to the source)", steps)
        for step in range(steps):
            ids = torch.from_numpy(np.ascontiguousarray(windows[order[step % len(windows)]], dtype=np.int64))[None]
            loss = kl_to_reference(teacher, student, ids)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            progress.advance()
        progress.close()
        for entry, arrays in leech:
            arrays[entry.parts["scale"]] = modules[entry.name].scale16()
    finally:
        torch.set_num_threads(threads)
    head = float(np.mean(losses[: max(1, steps // 8)]))
    tail = float(np.mean(losses[-max(1, steps // 8):]))
    return {"steps": steps, "tensors": len(leech), "lr": lr, "kl_first": head, "kl_last": tail,
            "seconds": time.perf_counter() - started}
