"""KV-cache baselines in the SemKV harness: `accel eval MODEL --kv NAME[:ARG]`.

- `fp16`: every key and value stored in half precision (the reference for the reductions).
- `kivi[:BITS]`: KIVI-style: affine at 2**BITS levels (default 2 bits), keys per channel over blocks of 32
  tokens (the open block in fp16), values per token in groups of 32 channels, the last 32 tokens' values in fp16.
  It is the affine base of `accel.runtime.kv_cache` with KIVI's settings, so its bytes are measured the same way.
- `quanto:BITS` / `hqq:BITS` (2 or 4): transformers' `QuantizedCache` with the optimum-quanto or HQQ backend,
  per-token groups of one head (q_group_size = head dim; quanto axis 0, HQQ axis 1 as transformers documents
  them; HQQ packs several groups at a time, so on 3 heads it gets smaller groups, see `group`), a full-precision
  residual of `residual` tokens (default 32, option `,residual=N`).

Bytes of the transformers caches are measured by walking what their layers hold (quantized tensors with their
inner tensors, scales, zero points, the residual). Those caches keep floating-point data in the model's dtype,
which is float32 in this CPU harness; every floating-point element is counted at 2 bytes, as it would be stored
by a half-precision model (integer and packed tensors at their real size).
"""

from __future__ import annotations

from typing import Any

import torch

from accel.errors import AccelError
from accel.quantize.maps import MapMethod, Runtime, StoredMap
from accel.quantize.semkv import _PackedMethod, make_arrays, make_params
from accel.runtime.kv_cache import fp16_bytes_per_token, model_kv_shape

KIVI = {"key_block": 32, "value_group": 32, "window": 32}


class FP16KV(_PackedMethod, kind="kv", name="fp16"):
    description = "fp16 KV cache (baseline)"

    def from_eval_spec(self, arg: str | None, config: dict[str, Any]) -> StoredMap:
        if arg:
            raise AccelError("--kv fp16 takes no argument")
        params = make_params("fp16", (16, 16), 0.0, "key_norm", 0, config)
        return StoredMap("kv", self.name, params, {})


class KiviKV(_PackedMethod, kind="kv", name="kivi"):
    description = "KIVI-style affine cache: 2 bits, per-channel keys, per-token values, fp16 window (baseline)"

    def from_eval_spec(self, arg: str | None, config: dict[str, Any]) -> StoredMap:
        bits = _int_arg(arg or "2", "--kv kivi", (1, 2, 3, 4, 8))
        params = make_params("affine", (2**bits, 2**bits), 0.0, "key_norm", 0, config, **KIVI)
        return StoredMap("kv", self.name, params, make_arrays(params, None))


def _int_arg(text: str, flag: str, allowed: tuple[int, ...]) -> int:
    try:
        value = int(text)
    except ValueError:
        raise AccelError(f"{flag}:{text}: expected an integer") from None
    if value not in allowed:
        contiguous = list(allowed) == list(range(allowed[0], allowed[-1] + 1))
        choices = f"{allowed[0]} to {allowed[-1]}" if contiguous and len(allowed) > 5 else ", ".join(map(str, allowed))
        raise AccelError(f"{flag}:{value}: choose from {choices}")
    return value


def tensor_bytes(obj: Any, batch: int = 1) -> int:
    """Bytes of every tensor reachable from obj, floating-point elements counted at 2 bytes. A sub-byte packed
    tensor (quanto's PackedTensor: `rows` logical rows of `bits` each in ceil(rows * bits / 8) bytes a column,
    sequences of a batch one after another) is counted as if each of its `batch` sequences were packed alone: the
    bytes one sequence holds do not depend on how many are decoded beside it."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        bits = getattr(obj, "_bits", None)
        if isinstance(bits, int) and bits < 8 and obj.dim() >= 1 and obj.shape[0] % batch == 0:
            per_sequence = -(-(obj.shape[0] // batch) * bits // 8)
            return batch * per_sequence * (obj.numel() // obj.shape[0]) * obj._data.element_size()
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), batch) for n in names)
        size = 2 if obj.is_floating_point() else obj.element_size()
        return obj.numel() * size
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, batch) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, batch) for v in obj)
    return 0


# HQQ packs rows of this many quantization groups (8 / bits at 2 and 4 bits).
HQQ_ROW_GROUPS = {1: 8, 2: 4, 3: 10, 4: 2, 8: 1}


def hqq_group(kv_heads: int, head_dim: int, bits: int) -> int | None:
    """The largest divisor of the head dim giving a multiple of HQQ's row of groups per token (32 and 16 channels
    for 3 heads x 64); None when there is none (1 head of 10 at 2 bits)."""
    fits = [g for g in range(1, head_dim + 1)
            if head_dim % g == 0 and (kv_heads * head_dim // g) % HQQ_ROW_GROUPS[bits] == 0]
    return max(fits) if fits else None


class _TransformersRuntime(Runtime):
    def __init__(self, backend: str, bits: int, residual: int, model: Any):
        self.backend, self.bits, self.residual, self.model = backend, bits, residual, model
        self.config = model.config
        _, self.kv_heads, self.head_dim = model_kv_shape(model.config.to_dict())
        self._current = None
        self.tokens, self.bytes = 0, {"quantized": 0, "fp16": 0}

    def _finish(self) -> None:
        cache, self._current = self._current, None
        if cache is None:
            return
        first = cache.layers[0]
        batch = first.keys.shape[0] if first.keys is not None else 1
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            self.bytes["quantized"] += (tensor_bytes(layer._quantized_keys, batch)
                                        + tensor_bytes(layer._quantized_values, batch))
            self.bytes["fp16"] += tensor_bytes(layer.keys) + tensor_bytes(layer.values)
        self.tokens += first.get_seq_length() * batch

    def group(self) -> int:
        """One head per group; for HQQ, `hqq_group` (from_eval_spec refused a model without one)."""
        if self.backend != "hqq":
            return self.head_dim
        return hqq_group(self.kv_heads, self.head_dim, self.bits)

    def make_cache(self):
        from transformers import QuantizedCache

        self._finish()
        axis = 0 if self.backend == "quanto" else 1
        self._current = QuantizedCache(self.backend, self.config, nbits=self.bits, axis_key=axis, axis_value=axis,
                                       q_group_size=self.group(), residual_length=self.residual)
        return self._current

    def report(self) -> dict[str, Any]:
        self._finish()
        fp16 = fp16_bytes_per_token(self.config)
        total = sum(self.bytes.values())
        per_token = total / self.tokens if self.tokens else 0.0
        return {"kv_bytes_per_token": per_token, "kv_fp16_bytes_per_token": fp16,
                "kv_reduction": fp16 / per_token if per_token else None,
                "kv_bits_per_value": 8 * per_token / (fp16 / 2) if per_token else None,
                "kv_bytes_breakdown": {k: v / self.tokens if self.tokens else 0.0 for k, v in self.bytes.items()}}


class _TransformersMethod(MapMethod):
    backend = ""
    backend_module = ""
    allowed_bits: tuple[int, ...] = (2, 4)

    def from_eval_spec(self, arg: str | None, config: dict[str, Any]) -> StoredMap:
        import importlib.util

        flag = f"--kv {self.name}"
        head, *options = (arg or "").split(",")
        if not head:
            raise AccelError(f"{flag} needs a bit width, for example {flag}:4")
        bits = _int_arg(head, flag, self.allowed_bits)
        residual = None
        for item in options:
            key, _, value = item.partition("=")
            if key != "residual":
                raise AccelError(f"{flag}: unknown option {key!r} (known: residual)")
            if residual is not None:
                raise AccelError(f"{flag}: option residual is given twice")
            residual = _int_arg(value, f"{flag} residual", tuple(range(1, 4097)))
        if importlib.util.find_spec(self.backend_module) is None:
            raise AccelError(f"{flag} needs the {self.backend_module} package, which is not installed")
        layers, kv_heads, head_dim = model_kv_shape(config)
        if self.backend == "hqq" and hqq_group(kv_heads, head_dim, bits) is None:
            raise AccelError(f"{flag}:{bits}: HQQ packs {HQQ_ROW_GROUPS[bits]} groups in a row, and no group size of "
                             f"this model's {kv_heads} KV heads x {head_dim} channels gives a whole number of rows "
                             f"per token (use another --kv)")
        return StoredMap("kv", self.name, {"bits": bits, "residual": 32 if residual is None else residual,
                                           "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}, {})

    def check(self, stored: StoredMap, config: dict[str, Any]) -> None:
        p = stored.params
        if (p.get("layers"), p.get("kv_heads"), p.get("head_dim")) != model_kv_shape(config):
            raise AccelError("the kv scheme was made for a different model")

    def runtime(self, stored: StoredMap, model: Any) -> Runtime:
        return _TransformersRuntime(self.backend, stored.params["bits"], stored.params["residual"], model)


class QuantoKV(_TransformersMethod, kind="kv", name="quanto"):
    description = "transformers QuantizedCache, optimum-quanto backend, 2 or 4 bits (baseline)"
    backend, backend_module = "quanto", "optimum.quanto"


class HqqKV(_TransformersMethod, kind="kv", name="hqq"):
    description = "transformers QuantizedCache, HQQ backend, 2 or 4 bits (baseline)"
    backend, backend_module = "hqq", "hqq"
