"""Layer-input Hessians H = E[x xᵀ] of every quantizable linear layer, recorded on real text.

Layers that read the same input (q/k/v, gate/up) share one matrix; the calibration directory stores it once. The
token windows they were recorded on are stored too (`windows`), for `accel quantize --tune-steps`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accel.calibrate.run import CalibContext, register_kind
from accel.errors import AccelError
from accel.formats.artifact import Artifact, WeightsWriter
from accel.formats.tensor import encode_tensor
from accel.progress import SILENT, Progress
from accel.quantize.methods import is_quantizable

HESSIAN_DIR = "weights"
WINDOWS = "windows"  # the calibration token ids [n, seq_len], stored as float32 (exact below 2^24)


def add_gram(sums: dict[str, np.ndarray], key: str, x: torch.Tensor) -> None:
    """sums[key] += xᵀx (input_gram)."""
    gram = input_gram(x)
    sums[key] = sums[key] + gram if key in sums else gram


def input_gram(x: torch.Tensor) -> np.ndarray:
    """xᵀx over the rows of a layer input, in float32 (a matrix product that BLAS runs fast), again in float64 where
    float32 overflowed (inputs of 1e19 and more), float64 out."""
    flat = x.reshape(-1, x.shape[-1]).float()
    xtx = (flat.T @ flat).double()
    if not torch.isfinite(xtx).all():
        flat = flat.double()
        xtx = flat.T @ flat
    return xtx.numpy()


Sink = Callable[[dict[str, np.ndarray]], None]


class _Recorder:
    """Sums of xᵀx by Hessian key, filled by forward pre-hooks on linear layers and by the expert hooks."""

    def __init__(self, linears: dict[str, torch.nn.Linear]):
        self.linears = linears  # weight name -> module, every quantizable nn.Linear of the model
        self.sums: dict[str, np.ndarray] = {}
        self.key_of: dict[str, str] = {}
        self.last: list = [None, None]  # (input tensor, key) of the previous call: q/k/v and gate/up run back to back

    def hook(self, model: torch.nn.Module, within: Callable[[str], bool]) -> list[Any]:
        """Record the inputs of the linear layers and fused experts whose names `within` accepts."""
        def hook_for(weight_name: str):
            def hook(_module, args):
                x = args[0]
                if x is self.last[0]:
                    self.key_of.setdefault(weight_name, self.last[1])
                    return
                key = self.key_of.setdefault(weight_name, weight_name)
                self.last[0], self.last[1] = x, key
                add_gram(self.sums, key, x)
            return hook

        handles = [mod.register_forward_pre_hook(hook_for(name)) for name, mod in self.linears.items() if within(name)]
        return handles + _expert_hooks(model, self.sums, self.key_of, within)

    def flush(self, sink: Sink, tokens: int) -> None:
        """Hand the finished means to `sink` and forget them."""
        broken = sorted(k for k, v in self.sums.items() if not np.isfinite(v).all())
        if broken:  # activations past float64's range: the model itself computes nothing usable there
            raise AccelError(f"the inputs of '{broken[0]}' overflow even in float64 (non-finite Hessian): the "
                             f"model's activations are not finite on this text")
        for v in self.sums.values():
            v /= tokens
        sums, self.sums = self.sums, {}
        if sums:
            sink(sums)


class _Resident:
    """The weights of a model built whole: nothing to load or release (the interface of StreamedModel)."""

    def load(self, within: Callable[[str], bool]) -> None:
        pass

    def release(self, within: Callable[[str], bool]) -> None:
        pass


@torch.inference_mode()
def collect_hessians(model: torch.nn.Module, windows: np.ndarray, progress: Progress = SILENT,
                     sink: Sink | None = None, layer_by_layer: bool = True, streamed: Any = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Mean x xᵀ over all tokens for each quantizable linear layer.

    Returns (hessians keyed by the first weight name that reads each input, weight name -> key). With `sink`, the
    Hessians go to it a layer at a time instead (the dict returned is empty). The decoder layers run one after the
    other over all windows (`_layer_by_layer`), so that only one layer's Hessians are in memory, where that
    reproduces the model's own forward pass bit for bit on the first window; else (or with layer_by_layer False)
    every window goes through the whole model, all Hessians in memory (the same numbers).

    streamed: an accel.converters.streamed.StreamedModel whose `model` is `model`: its weights are read a decoder
    layer at a time and released after (the parts outside the layers stay loaded); where the layers cannot run one
    by one, the whole model is loaded first.
    """
    weights = streamed if streamed is not None else _Resident()
    linears = {f"{name}.weight": mod for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and is_quantizable(f"{name}.weight", tuple(mod.weight.shape))}
    recorder = _Recorder(linears)
    kept: dict[str, np.ndarray] = {}
    sink = sink if sink is not None else kept.update
    _use_eager_experts(model)
    body = getattr(model, model.base_model_prefix, model)  # the decoder alone: the LM head adds nothing here
    stack = _decoder_stack(model, body) if layer_by_layer else None
    if stack is not None:
        body_prefix = next(f"{n}." if n else "" for n, m in model.named_modules() if m is body)
        weights.load(lambda name: name.startswith(body_prefix) and not name.startswith(stack[0] + "."))
        if not _layer_by_layer_matches(body, stack, windows[0], weights, progress):
            stack = None
    if stack is None:
        weights.load(lambda name: True)
        _whole_model(body, model, windows, recorder, progress)
        recorder.flush(sink, windows.size)
    else:
        _layer_by_layer(body, model, stack, windows, recorder, progress, sink, weights)
    return kept, dict(sorted(recorder.key_of.items()))


def _layer_weights(prefix: str, i: int) -> Callable[[str], bool]:
    return lambda name: name.startswith(f"{prefix}.{i}.")


def _run(body: torch.nn.Module, window: np.ndarray) -> None:
    body(input_ids=torch.from_numpy(np.ascontiguousarray(window))[None], use_cache=False)


def _whole_model(body, model, windows, recorder: _Recorder, progress: Progress) -> None:
    """Every window through the whole decoder with every layer hooked: all Hessians in memory at once."""
    handles = recorder.hook(model, lambda name: True)
    try:
        progress.stage("calibrating (Hessians)", len(windows))
        for window in windows:
            recorder.last[0] = None
            _run(body, window)
            progress.advance()
        progress.close()
    finally:
        for h in handles:
            h.remove()


def _decoder_stack(model: torch.nn.Module, body: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(name in `model`, module list) of the decoder layers: the ModuleList of `*DecoderLayer` modules."""
    names = {id(m): n for n, m in model.named_modules()}
    for module in body.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and all(
                type(layer).__name__.endswith("DecoderLayer") for layer in module):
            return names[id(module)], module
    return None


class _Captured:
    """What the decoder passes to each layer for one window: the first layer's input, and every layer's other
    arguments (masks, rotary tables, positions), recorded by running the decoder with each layer replaced by
    the identity."""

    def __init__(self, body: torch.nn.Module, stack: torch.nn.ModuleList, window: np.ndarray):
        self.hidden: torch.Tensor | None = None
        self.calls: list[tuple[tuple, dict[str, Any]]] = []

        def passthrough(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if self.hidden is None:
                self.hidden = hidden
            self.calls.append((args[1:], kwargs))
            return hidden

        for layer in stack:
            layer.forward = passthrough
        try:
            _run(body, window)
        finally:
            for layer in stack:
                del layer.forward
        if self.hidden is None or len(self.calls) != len(stack):
            raise _NotLayerByLayer()

    def run_layer(self, stack: torch.nn.ModuleList, i: int, hidden: torch.Tensor) -> torch.Tensor:
        args, kwargs = self.calls[i]
        out = stack[i](hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _NotLayerByLayer(Exception):
    pass


def _layer_by_layer_matches(body, stack_named: tuple[str, torch.nn.ModuleList], window: np.ndarray,
                            weights: Any, progress: Progress = SILENT) -> bool:
    """Whether running the layers one by one on what the decoder passes them reproduces, bit for bit, the last
    layer's output of a whole forward pass (a model whose decoder does more between its layers would not). Both
    run in one pass over the layers: while the whole forward pass is in layer i (its weights loaded), layer i also
    takes the one-by-one chain's hidden state."""
    prefix, stack = stack_named
    try:
        captured = _Captured(body, stack, window)
    except (_NotLayerByLayer, TypeError, IndexError, ValueError, RuntimeError):
        return False
    chained = [captured.hidden]
    whole: list[torch.Tensor] = []

    def both(i: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args, **kwargs):
            weights.load(_layer_weights(prefix, i))
            try:
                out = original(*args, **kwargs)
                if chained[0] is not None:
                    try:
                        step = original(chained[0], *captured.calls[i][0], **captured.calls[i][1])
                        chained[0] = step[0] if isinstance(step, tuple) else step
                    except (TypeError, IndexError, ValueError, RuntimeError):
                        chained[0] = None
                if i == len(stack) - 1:
                    whole.append(out[0] if isinstance(out, tuple) else out)
            finally:
                weights.release(_layer_weights(prefix, i))
                progress.advance()
            return out
        return forward

    progress.stage("checking the layer-by-layer pass", len(stack))
    for i, layer in enumerate(stack):
        layer.forward = both(i, layer.forward)
    try:
        _run(body, window)
    finally:
        for layer in stack:
            del layer.forward
    progress.close()
    hidden = chained[0]
    return hidden is not None and len(whole) == 1 and hidden.shape == whole[0].shape and torch.equal(hidden, whole[0])


def _layer_by_layer(body, model, stack_named: tuple[str, torch.nn.ModuleList], windows: np.ndarray,
                    recorder: _Recorder, progress: Progress, sink: Sink, weights: Any) -> None:
    """The Hessians a layer at a time (GPTQ's sequential order): all windows' hidden states go through layer i,
    its Hessians go to `sink`, then layer i+1. Linear layers outside the stack are recorded while the decoder's
    arguments are captured. Memory: the hidden states of all windows, one layer's Hessians, and (streamed) one
    layer's weights."""
    prefix, stack = stack_named
    progress.stage("calibrating (Hessians, layer by layer)", len(stack) + 1)
    outside = recorder.hook(model, lambda name: not name.startswith(prefix + "."))
    try:
        captured = []
        for window in windows:
            recorder.last[0] = None
            captured.append(_Captured(body, stack, window))
    finally:
        for h in outside:
            h.remove()
    recorder.flush(sink, windows.size)  # the layers outside the stack are done
    hidden = [c.hidden for c in captured]
    for c in captured:
        c.hidden = None  # held once, in `hidden`
    progress.advance()
    for i in range(len(stack)):
        weights.load(_layer_weights(prefix, i))  # before the hooks: the expert hooks know a parameter by its storage
        handles = recorder.hook(model, _layer_weights(prefix, i))
        try:
            for w, c in enumerate(captured):
                recorder.last[0] = None
                hidden[w] = c.run_layer(stack, i, hidden[w])
        finally:
            for h in handles:
                h.remove()
            weights.release(_layer_weights(prefix, i))
        recorder.flush(sink, windows.size)
        progress.advance()
    progress.close()


def expert_key(param_name: str, expert: int) -> str:
    """The name an expert's slice of a fused experts parameter is recorded under: `<param>.<expert>`."""
    return f"{param_name}.{expert}"


# The Hessian name of an expert no calibration token reached: `unreached:<param>.<expert>`, for which
# HessianStore.get gives the identity, so that GPTQ rounds to nearest on its grid and Leech takes the nearest
# lattice points (GPTQModel's fail-safe does the same). The mean of the layer's recorded experts' Hessians was
# measured first and did worse: on a tiny Mixtral (8 experts, top-1, 2048 calibration tokens), the output error of
# gate_up on the eval tokens routed to an expert was 0.139-0.161 with the pooled Hessian, 0.136-0.145 with the
# identity and 0.062-0.112 with the expert's own (docs/architecture.md): routing makes each expert's inputs its own.
UNREACHED_PREFIX = "unreached:"


def unreached_key(param_name: str, expert: int) -> str:
    return UNREACHED_PREFIX + expert_key(param_name, expert)


def recorded_experts(param_name: str, recorded: dict[str, str]) -> list[str]:
    """The expert keys (`<param>.<e>`) calibration recorded for one fused experts parameter."""
    prefix = param_name + "."
    return sorted((w for w in recorded if w.startswith(prefix) and w[len(prefix):].isdigit()),
                  key=lambda w: int(w[len(prefix):]))


def _fused_experts(model: torch.nn.Module) -> dict[str, dict[str, torch.nn.Parameter]]:
    """Module name -> its 3-D parameters ([experts, out, in]), for each fused mixture-of-experts module."""
    fused = {name: {p_name: p for p_name, p in mod.named_parameters(recurse=False) if p.ndim == 3}
             for name, mod in model.named_modules()
             if not isinstance(mod, torch.nn.modules.conv._ConvNd)}  # a convolution's weight is 3-D too
    return {name: params for name, params in fused.items() if params}


def _use_eager_experts(model: torch.nn.Module) -> None:
    """Fused experts run their eager loop, whose F.linear calls `_expert_hooks` sees (the grouped kernels make
    none): set before any forward pass, so that every pass computes the same way."""
    for name in _fused_experts(model):
        config = getattr(model.get_submodule(name), "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"


def _expert_hooks(model: torch.nn.Module, sums: dict[str, np.ndarray], key_of: dict[str, str],
                  within: Callable[[str], bool] = lambda name: True) -> list[Any]:
    """Hooks that record the inputs of each expert of a fused mixture-of-experts module (transformers 5 holds all
    experts' projections in one 3-D parameter, [experts, out, in], and multiplies each routed token group by a slice
    with F.linear). While such a module runs, F.linear is wrapped: a call whose weight is expert e's slice of one of
    its 3-D parameters adds xᵀx to `<param>.<e>`. The module runs its eager loop for this (`_use_eager_experts`).
    An expert no token reached has no Hessian; quantize says so. Only the parameters `within` accepts."""
    fused = {name: {p_name: p for p_name, p in params.items() if within(f"{name}.{p_name}")}
             for name, params in _fused_experts(model).items()}
    fused = {name: params for name, params in fused.items() if params}
    if not fused:
        return []
    _use_eager_experts(model)
    original = torch.nn.functional.linear

    def recording(params: dict[str, torch.nn.Parameter], prefix: str):
        def linear(x, weight, bias=None):
            for p_name, p in params.items():
                if weight.ndim == 2 and tuple(weight.shape) == tuple(p.shape[1:]) \
                        and weight.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() \
                        and (weight.storage_offset() - p.storage_offset()) % p.stride(0) == 0:
                    expert = (weight.storage_offset() - p.storage_offset()) // p.stride(0)
                    key = expert_key(f"{prefix}.{p_name}", expert)
                    key_of[key] = key  # an expert's Hessian is recorded under its own name
                    add_gram(sums, key, x)
                    break
            return original(x, weight, bias)
        return linear

    handles = []
    for name, params in fused.items():
        module = model.get_submodule(name)

        def pre(_module, _args, _kwargs=None, params=params, name=name):
            torch.nn.functional.linear = recording(params, name)

        def post(_module, _args, _output):
            torch.nn.functional.linear = original

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))  # F.linear back even on an error
    return handles


@register_kind("weights")
def record_hessians(ctx: CalibContext) -> dict[str, Any]:
    """`accel calibrate --for weights`: the Hessians of every quantizable layer, into <calib>/weights, written a
    layer at a time (WeightsWriter spills each layer's; the files are the same bytes as writing them at once)."""
    count = 0
    with WeightsWriter(ctx.out_dir) as writer:
        def sink(hessians: dict[str, np.ndarray]) -> None:
            nonlocal count
            for k, h in hessians.items():
                writer.add(encode_tensor(k, h.astype(np.float32), "raw", role="data", dtype="float32"))
            count += len(hessians)

        _, key_of = collect_hessians(ctx.loaded.model, ctx.windows, ctx.progress, sink,
                                     streamed=ctx.loaded.streamed)
        if ctx.windows.size and int(ctx.windows.max()) < 1 << 24:
            writer.add(encode_tensor(WINDOWS, ctx.windows.astype(np.float32), "raw", role="data", dtype="float32"))
        writer.finish(extra={"hessians": key_of, "tokens": int(ctx.windows.size)})
    return {"hessians": count, "layers": len(key_of)}


class HessianStore:
    """Read side of out/hessians: H for a weight name, validated against the weight's input size."""

    def __init__(self, calib_dir: Path):
        path = Path(calib_dir) / HESSIAN_DIR
        if not path.is_dir():
            raise AccelError(f"--calib {calib_dir}: no Hessians (run `accel calibrate --for weights` first)")
        self.artifact = Artifact(path)
        self.key_of: dict[str, str] = self.artifact.extra.get("hessians", {})
        if not isinstance(self.key_of, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v in self.artifact.names for k, v in self.key_of.items()):
            raise AccelError(f"--calib {calib_dir}: {HESSIAN_DIR}/ is damaged (its weight -> Hessian table does not "
                             f"name stored matrices); calibrate again")
        self._last: tuple[str, np.ndarray] | None = None  # q/k/v and gate/up ask for the same matrix in a row

    def windows(self) -> np.ndarray:
        """The token windows the Hessians were recorded on, [n, seq_len] int64."""
        if WINDOWS not in self.artifact.names:
            raise AccelError("--calib holds no token windows (recorded by an older accel): run "
                             "`accel calibrate --for weights` again to use --tune-steps")
        return self.artifact.decode(WINDOWS).astype(np.int64)

    def get(self, weight_name: str, in_features: int) -> np.ndarray:
        """H for `weight_name` (a recorded weight's or expert's key); the identity for `unreached_key(...)`."""
        if weight_name.startswith(UNREACHED_PREFIX):
            return np.eye(in_features)
        key = self.key_of.get(weight_name)
        if key is None:
            raise AccelError(f"--calib has no Hessian for '{weight_name}' (calibrated on a different model?)")
        if self._last is None or self._last[0] != key:
            h = self.artifact.decode(key).astype(np.float64)
            if not np.isfinite(h).all():
                raise AccelError(f"--calib Hessian for '{weight_name}' holds NaN or Inf (a damaged or overflowed "
                                 f"calibration); calibrate again")
            self._last = (key, h)
        h = self._last[1]
        if h.shape != (in_features, in_features):
            raise AccelError(f"--calib Hessian for '{weight_name}' is {h.shape[0]}x{h.shape[1]}, but the layer "
                             f"has {in_features} inputs (calibrated on a different model?)")
        return h
