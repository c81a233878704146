"""Turn a config dict and a set of float tensors into a transformers model, without a throw-away random init.

Parameters are created on the meta device (buffers such as rotary frequencies are computed for real), then
each is replaced by the given tensor. Loading is strict: a missing, unexpected or mis-shaped tensor is an
AccelError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from accel.converters.checkpoint_names import to_model_shapes, to_model_tensors
from accel.converters.sources import one_line
from accel.errors import AccelError

# Keys of a config.json that describe the file, not the model.
NOT_MODEL_KEYS = ("model_type", "accel", "transformers_version", "torch_dtype", "dtype", "_name_or_path")


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered in this block move to the meta device; buffers stay where they are built."""
    original = torch.nn.Module.register_parameter

    def register_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def _as_float32(name: str, value: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value, dtype=np.float32)
        if not array.flags.writeable:
            array = array.copy()
        return torch.from_numpy(array)
    raise AccelError(f"tensor {name!r} is a {type(value).__name__}, not a numpy array or torch tensor")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def empty_model(config: Mapping[str, Any], attn_implementation: str | None = None) -> torch.nn.Module:
    """The causal LM `config` describes, its parameters on the meta device (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise AccelError('the model config has no "model_type"')
    if model_type not in CONFIG_MAPPING:
        raise AccelError(f"model type {model_type!r} is not known to transformers {_transformers_version()}")
    kwargs = {k: v for k, v in config.items() if k not in NOT_MODEL_KEYS}
    try:
        hf_config = AutoConfig.for_model(model_type, **kwargs)
    except Exception as err:  # transformers' config classes validate with their own exception types
        raise AccelError(f"the model config is not a valid {model_type!r} config: {one_line(err)}") from err
    _check_sizes(hf_config, model_type)
    _check_sliding_layers(hf_config, model_type)
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        with _parameters_on_meta():
            return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, **extra)
    except Exception as err:  # a config value the model's constructor cannot use (one its config class lets through)
        raise AccelError(f"cannot build a causal LM of type {model_type!r}: {one_line(err)}") from err


# Sizes every causal LM config has (head_dim where set) and none can be 0: transformers builds zero-size layers
# (with a torch warning a tensor) and the mismatch shows only later, as a shape error against every tensor.
POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim")


def _check_sizes(hf_config: Any, model_type: str) -> None:
    for key in POSITIVE_SIZES:
        value = getattr(hf_config, key, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise AccelError(f"the {model_type!r} config's {key} is {value!r}: it must be a positive integer")


def _check_sliding_layers(hf_config: Any, model_type: str) -> None:
    """A config whose layer_types has sliding-window layers but whose window is None (Qwen2/Qwen3 set it to None
    when use_sliding_window is false) builds, then fails in transformers' cache and masks with a TypeError."""
    sliding = [i for i, kind in enumerate(getattr(hf_config, "layer_types", None) or []) if kind == "sliding_attention"]
    if sliding and getattr(hf_config, "sliding_window", None) is None:
        shown = ", ".join(map(str, sliding[:8])) + (", ..." if len(sliding) > 8 else "")
        off = " (use_sliding_window is false)" if getattr(hf_config, "use_sliding_window", None) is False else ""
        raise AccelError(f"the {model_type!r} config's layer_types makes layers {shown} sliding_attention but its "
                         f"sliding_window is unset{off}: transformers cannot run it; give a sliding_window or "
                         f"make those layers full_attention")


def parameter_groups(model: torch.nn.Module) -> dict[int, list[str]]:
    """Parameter id -> every name it has (tied parameters have several)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return groups


def tensor_problems(model: torch.nn.Module, shapes: Mapping[str, tuple[int, ...]], model_type: str) -> list[str]:
    """What `build_transformers_model` refuses in tensors of these shapes (name -> shape), one line per kind:
    a name the model does not have, a parameter none of whose names is given, a shape the model does not expect.
    `model` may live on the meta device (empty_model), so `accel verify` checks an OUT_DIR without its weights.
    `shapes` may carry a checkpoint's names (accel.converters.checkpoint_names): they are converted first."""
    try:
        shapes = to_model_shapes(model_type, shapes)
    except AccelError as exc:
        return [str(exc)]
    groups = parameter_groups(model)
    param_names = {name for names in groups.values() for name in names}
    expected = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    expected.update({n: tuple(model.get_parameter(n).shape) for n in param_names})

    def first(names: list[str]) -> str:
        return f"{names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")

    problems = []
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        problems.append(f"unexpected tensor {first(unexpected)}: a {model_type} model has no such parameter")
    missing = sorted(names[0] for names in groups.values() if not any(n in shapes for n in names))
    if missing:
        problems.append(f"missing tensor {first(missing)}: the model needs it and it was not given")
    wrong = sorted(n for n in shapes if n in expected and tuple(shapes[n]) != expected[n])
    if wrong:
        problems.append(f"tensor {wrong[0]!r} has shape {tuple(shapes[wrong[0]])}, the model expects "
                        f"{expected[wrong[0]]}" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    return problems


def loading_problem(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """The first thing `build_transformers_model` would refuse in a model of this config with tensors of these
    shapes (an invalid config, a missing, unexpected or misshapen tensor), found on the meta device without loading
    anything; None when it would build."""
    try:
        problems = tensor_problems(empty_model(config), shapes, str(config.get("model_type")))
    except AccelError as exc:
        return str(exc)
    return problems[0] if problems else None


def assign_parameters(model: torch.nn.Module, groups: list[list[str]], tensors: Mapping[str, Any]) -> None:
    """Set each group of tied parameter names (`parameter_groups`) to one float32 parameter made from the tensors
    given for it (by model name; several given must be equal)."""
    for names in groups:
        given = [n for n in names if n in tensors]
        value = _as_float32(given[0], tensors[given[0]])
        for other in given[1:]:
            if not torch.equal(value, _as_float32(other, tensors[other])):
                raise AccelError(f"tensors {given[0]!r} and {other!r} are tied in this model but differ")
        param = torch.nn.Parameter(value, requires_grad=False)
        for name in names:
            module_name, _, leaf = name.rpartition(".")
            model.get_submodule(module_name)._parameters[leaf] = param


def build_transformers_model(
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray | torch.Tensor],
    *,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """A float32 `AutoModelForCausalLM` in eval mode holding exactly `tensors` (HF names).

    Tied parameters (lm_head.weight with tie_word_embeddings) need only one of their names; if several are
    given they must be equal. float32 inputs are used in place (no copy), others are converted; parameters
    have requires_grad False.
    """
    model = empty_model(config, attn_implementation)
    tensors = to_model_tensors(config["model_type"], tensors)  # a checkpoint's per-expert tensors merged, ...
    problems = tensor_problems(model, {n: tuple(t.shape) for n, t in tensors.items()}, config["model_type"])
    if problems:
        raise AccelError(problems[0])
    groups = parameter_groups(model)
    param_names = {name for names in groups.values() for name in names}
    persistent_buffers = [n for n in model.state_dict(keep_vars=True) if n not in param_names]
    assign_parameters(model, sorted(groups.values()), tensors)

    for name in persistent_buffers:
        if name in tensors:
            buffer = model.get_buffer(name)
            buffer.copy_(_as_float32(name, tensors[name]).to(buffer.dtype))

    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise AccelError(f"tensor {still_meta[0]!r} was not loaded")
    model.config.dtype = torch.float32
    return model.eval()
