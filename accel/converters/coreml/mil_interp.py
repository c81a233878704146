"""A NumPy interpreter of the MIL ops accel emits, to run a saved package's program on Linux.

Tensors are stored at their declared dtype (fp16 activations, fp16 states) and each op computes in float32 from
them, then rounds its output back: fp16 storage with fp32 arithmetic, the reference an fp16 device is held to.
The constexpr weight ops are decompressed by the same reference functions the encoder is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from accel.converters.coreml.encodings import decode_arrays
from accel.errors import AccelError, FormatError

OpImpl = Callable[[Any, "Env"], list[np.ndarray]]
OPS: dict[str, OpImpl] = {}


def op(*names: str):
    def register(fn: OpImpl) -> OpImpl:
        for name in names:
            OPS[name] = fn
        return fn
    return register


NUMPY_DTYPES = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32, "int16": np.int16, "int8": np.int8,
                "uint8": np.uint8, "uint16": np.uint16, "bool": np.bool_}


class Env:
    """Values of one function call: Var -> array; states by name, updated in place."""

    def __init__(self, interpreter: Interpreter, state: dict[str, np.ndarray]):
        self.interpreter = interpreter
        self.values: dict[int, np.ndarray] = {}
        self.state = state

    def __getitem__(self, var) -> np.ndarray:
        key = id(var)
        if key not in self.values:
            producer = var.op
            if producer is None:
                raise AccelError(f"MIL interpreter: no value for {var.name}")
            if producer.op_type == "const" or producer.op_type.startswith("constexpr_"):
                return self.interpreter.constant(var)
            raise AccelError(f"MIL interpreter: {var.name} used before it is computed")
        return self.values[key]

    def get(self, op_, name: str, default: Any = None) -> Any:
        var = getattr(op_, name, None)
        if var is None:
            return default
        if var.val is not None and not var.op.op_type.startswith("constexpr_"):
            return var.val
        return self[var]

    def f32(self, op_, name: str) -> np.ndarray:
        return np.asarray(self.get(op_, name), dtype=np.float32)


def _dtype_of(var) -> np.dtype:
    from coremltools.converters.mil.mil import types

    prim = var.sym_type.get_primitive() if types.is_tensor(var.sym_type) else var.sym_type
    return np.dtype(NUMPY_DTYPES.get(types.builtin_to_string(prim), np.float32))


class Interpreter:
    """Runs the functions of one MIL program; constants (decompressed weights) are cached across calls."""

    def __init__(self, program):
        self.program = program
        self._constants: dict[int, np.ndarray] = {}

    @classmethod
    def from_package(cls, package: Path) -> Interpreter:
        return cls(load_program(package))

    @property
    def functions(self) -> list[str]:
        return list(self.program.functions)

    def constant(self, var) -> np.ndarray:
        key = id(var)
        if key not in self._constants:
            self._constants[key] = self._materialize(var)
        return self._constants[key]

    def _materialize(self, var) -> np.ndarray:
        producer = var.op
        if producer.op_type == "const":
            value = np.asarray(var.val)
            return value.astype(np.float32) if value.dtype == np.float16 else value
        inputs = {name: np.asarray(v.val) if v.op.op_type == "const" else self.constant(v)
                  for name, v in producer.inputs.items() if v is not None}
        if producer.op_type == "constexpr_lut_to_dense":
            if "vector_axis" in inputs and inputs["lut"].shape[-1] != 1:
                raise AccelError("MIL interpreter: vector palettization is not emitted by accel")
            return decode_arrays("lut", {"indices": inputs["indices"], "lut": inputs["lut"]}, var.shape)
        if producer.op_type == "constexpr_blockwise_shift_scale":
            arrays = {"data": inputs["data"], "scale": inputs["scale"]}
            if "offset" in inputs:
                arrays["offset"] = inputs["offset"]
            return decode_arrays("shift_scale", arrays, var.shape)
        raise AccelError(f"MIL interpreter: unsupported constexpr op {producer.op_type}")

    def new_state(self, function: str) -> dict[str, np.ndarray]:
        """Zeroed states of a function (fp16, as declared)."""
        from coremltools.converters.mil.mil import types

        state = {}
        for name, var in self.program.functions[function].inputs.items():
            if types.is_state(var.sym_type):
                wrapped = var.sym_type.wrapped_type()
                dtype = NUMPY_DTYPES[types.builtin_to_string(wrapped.get_primitive())]
                state[name] = np.zeros(wrapped.get_shape(), dtype=dtype)
        return state

    def run(self, function: str, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray] | None = None
            ) -> dict[str, np.ndarray]:
        """Run one function; `state` (from new_state) is read and updated in place. Returns outputs by name."""
        from coremltools.converters.mil.mil import types

        func = self.program.functions[function]
        env = Env(self, state if state is not None else self.new_state(function))
        for name, var in func.inputs.items():
            if types.is_state(var.sym_type):
                continue
            if name not in inputs:
                raise AccelError(f"MIL interpreter: function {function} needs input {name!r}")
            value = np.asarray(inputs[name]).astype(_dtype_of(var))
            if tuple(value.shape) != tuple(var.shape):
                raise AccelError(f"MIL interpreter: input {name} has shape {value.shape}, expected {var.shape}")
            env.values[id(var)] = value
        for operation in func.operations:
            if operation.op_type == "const" or operation.op_type.startswith("constexpr_"):
                continue
            impl = OPS.get(operation.op_type)
            if impl is None:
                raise AccelError(f"MIL interpreter: op {operation.op_type!r} ({operation.name}) is not supported")
            results = impl(operation, env)
            for var, value in zip(operation.outputs, results, strict=True):
                env.values[id(var)] = np.asarray(value).astype(_dtype_of(var), copy=False)
        return {var.name: env[var] for var in func.outputs}


def load_program(package: Path):
    """The MIL program saved in a .mlpackage (model spec + weight file), as a pymil Program."""
    from accel.converters.coreml.export import import_coremltools

    import_coremltools()  # quietly: coremltools logs on import
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    package = Path(package)
    model_file = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    if not model_file.is_file():
        raise FormatError(f"{package}: no Data/com.apple.CoreML/model.mlmodel (not a Core ML package)")
    from coremltools.proto import Model_pb2

    try:  # the spec parsed from its file: ct.utils.load_spec opens the package read-write and rewrites its
        spec = Model_pb2.Model()  # Manifest.json, and verify must not change its input
        spec.ParseFromString(model_file.read_bytes())
        return milproto_load(spec, spec.specificationVersion, str(package / "Data" / "com.apple.CoreML" / "weights"))
    except Exception as exc:  # noqa: BLE001 - any parse failure of a foreign file is a format error
        raise FormatError(f"{package}: cannot read the Core ML program ({type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]})") from None


# ------------------------------------------------------------------------------------------------ op set
def _f(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


@op("read_state")
def _read_state(o, env):
    return [env.state[o.input.name].copy()]


@op("coreml_update_state")
def _update_state(o, env):
    value = env[o.value]
    target = env.state[o.state.name]
    target[...] = value.astype(target.dtype)
    return [value]


def _binary(fn):
    def impl(o, env):
        x, y = env.get(o, "x"), env.get(o, "y")
        if np.asarray(x).dtype.kind == "f" or np.asarray(y).dtype.kind == "f":
            x, y = _f(x), _f(y)
        return [fn(x, y)]
    return impl


for _name, _fn in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": np.divide,
                   "maximum": np.maximum, "minimum": np.minimum, "pow": np.power,
                   "equal": np.equal, "not_equal": np.not_equal, "less": np.less, "less_equal": np.less_equal,
                   "greater": np.greater, "greater_equal": np.greater_equal, "logical_and": np.logical_and,
                   "logical_or": np.logical_or, "floor_div": np.floor_divide}.items():
    OPS[_name] = _binary(_fn)


@op("rsqrt")
def _rsqrt(o, env):
    return [1.0 / np.sqrt(env.f32(o, "x") + np.float32(env.get(o, "epsilon", 1e-12)))]


@op("sqrt")
def _sqrt(o, env):
    return [np.sqrt(env.f32(o, "x"))]


@op("exp")
def _exp(o, env):
    return [np.exp(env.f32(o, "x"))]


@op("logical_not")
def _not(o, env):
    return [np.logical_not(env.get(o, "x"))]


@op("silu")
def _silu(o, env):
    x = env.f32(o, "x")
    return [x / (1.0 + np.exp(-x))]


@op("sigmoid")
def _sigmoid(o, env):
    return [1.0 / (1.0 + np.exp(-env.f32(o, "x")))]


@op("relu")
def _relu(o, env):
    return [np.maximum(env.f32(o, "x"), 0)]


@op("softmax")
def _softmax(o, env):
    x = env.f32(o, "x")
    axis = int(env.get(o, "axis", -1))
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return [e / e.sum(axis=axis, keepdims=True)]


@op("layer_norm")
def _layer_norm(o, env):
    x = env.f32(o, "x")
    axes = tuple(int(a) for a in env.get(o, "axes"))
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + np.float32(env.get(o, "epsilon", 1e-5)))
    gamma, beta = env.get(o, "gamma"), env.get(o, "beta")
    shape = [x.shape[a] if a in {ax % x.ndim for ax in axes} else 1 for a in range(x.ndim)]
    if gamma is not None:
        y = y * _f(gamma).reshape(shape)
    if beta is not None:
        y = y + _f(beta).reshape(shape)
    return [y]


@op("reduce_sum", "reduce_mean", "reduce_max")
def _reduce(o, env):
    x = env.get(o, "x")
    axes = env.get(o, "axes")
    axes = None if axes is None else tuple(int(a) for a in np.atleast_1d(axes))
    keep = bool(env.get(o, "keep_dims", False))
    fn = {"reduce_sum": np.sum, "reduce_mean": np.mean, "reduce_max": np.max}[o.op_type]
    return [fn(_f(x) if np.asarray(x).dtype.kind == "f" else x, axis=axes, keepdims=keep)]


@op("conv")
def _conv(o, env):
    x, w = env.f32(o, "x"), env.f32(o, "weight")
    if w.shape[2:] != (1, 1) or int(env.get(o, "groups", 1)) != 1:
        raise AccelError("MIL interpreter: only 1x1 ungrouped convolutions are emitted by accel")
    strides = env.get(o, "strides")
    if strides is not None and any(int(s) != 1 for s in strides):
        raise AccelError("MIL interpreter: only stride-1 convolutions are emitted by accel")
    y = np.einsum("oc,bchw->bohw", w[:, :, 0, 0], x, optimize=True)
    bias = env.get(o, "bias")
    if bias is not None:
        y = y + _f(bias)[None, :, None, None]
    return [y]


@op("linear")
def _linear(o, env):
    x, w = env.f32(o, "x"), env.f32(o, "weight")
    y = x @ w.T
    bias = env.get(o, "bias")
    return [y + _f(bias) if bias is not None else y]


@op("matmul")
def _matmul(o, env):
    x, y = env.f32(o, "x"), env.f32(o, "y")
    if env.get(o, "transpose_x", False):
        x = np.swapaxes(x, -1, -2)
    if env.get(o, "transpose_y", False):
        y = np.swapaxes(y, -1, -2)
    return [np.matmul(x, y)]


@op("reshape")
def _reshape(o, env):
    return [env.get(o, "x").reshape(o.outputs[0].shape)]


@op("transpose")
def _transpose(o, env):
    return [np.transpose(env.get(o, "x"), [int(p) for p in env.get(o, "perm")])]


@op("expand_dims")
def _expand_dims(o, env):
    return [env.get(o, "x").reshape(o.outputs[0].shape)]


@op("squeeze")
def _squeeze(o, env):
    return [env.get(o, "x").reshape(o.outputs[0].shape)]


@op("identity")
def _identity(o, env):
    return [env.get(o, "x")]


@op("tile")
def _tile(o, env):
    return [np.tile(env.get(o, "x"), [int(r) for r in env.get(o, "reps")])]


@op("concat")
def _concat(o, env):
    if env.get(o, "interleave", False):
        raise AccelError("MIL interpreter: interleaved concat is not emitted by accel")
    return [np.concatenate([env[v] for v in o.values], axis=int(env.get(o, "axis")))]


@op("split")
def _split(o, env):
    x = env.get(o, "x")
    axis = int(env.get(o, "axis"))
    sizes = env.get(o, "split_sizes")
    if sizes is None:
        return np.split(x, int(env.get(o, "num_splits")), axis=axis)
    return np.split(x, np.cumsum([int(s) for s in sizes])[:-1], axis=axis)


def _slices(o, env, x: np.ndarray) -> tuple[tuple[slice, ...], list[bool]]:
    rank = x.ndim
    begin = [int(b) for b in env.get(o, "begin")]
    end = [int(e) for e in env.get(o, "end")]
    stride = [int(s) for s in env.get(o, "stride", [1] * rank)]
    begin_mask = list(env.get(o, "begin_mask", [False] * rank))
    end_mask = list(env.get(o, "end_mask", [False] * rank))
    squeeze = list(env.get(o, "squeeze_mask", [False] * rank))
    index = []
    for axis in range(rank):
        if squeeze[axis]:
            b = begin[axis] % x.shape[axis]
            index.append(slice(b, b + 1, 1))
            continue
        b = None if begin_mask[axis] else begin[axis]
        e = None if end_mask[axis] else end[axis]
        index.append(slice(b, e, stride[axis]))
    return tuple(index), squeeze


@op("slice_by_index")
def _slice_by_index(o, env):
    x = env.get(o, "x")
    index, _ = _slices(o, env, x)
    return [x[index].reshape(o.outputs[0].shape)]


@op("slice_update")
def _slice_update(o, env):
    x = np.array(env.get(o, "x"), copy=True)
    index, _ = _slices(o, env, x)
    x[index] = np.asarray(env.get(o, "update")).reshape(x[index].shape)
    return [x]


@op("gather")
def _gather(o, env):
    x, indices = env.get(o, "x"), np.asarray(env.get(o, "indices")).astype(np.int64)
    axis = int(env.get(o, "axis", 0))
    if int(env.get(o, "batch_dims", 0)) != 0:
        raise AccelError("MIL interpreter: batched gather is not emitted by accel")
    size = x.shape[axis]
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise AccelError(f"MIL interpreter: gather index out of range [0, {size}) in {o.name}")
    return [np.take(x, indices, axis=axis)]


@op("cast")
def _cast(o, env):
    return [np.asarray(env.get(o, "x")).astype(NUMPY_DTYPES[str(env.get(o, "dtype"))])]


@op("select")
def _select(o, env):
    a, b = env.get(o, "a"), env.get(o, "b")
    return [np.where(env.get(o, "cond"), a, b)]


@op("clip")
def _clip(o, env):
    return [np.clip(env.f32(o, "x"), np.float32(env.get(o, "alpha")), np.float32(env.get(o, "beta")))]


SUPPORTED_OPS = frozenset(OPS) | {"const", "constexpr_lut_to_dense", "constexpr_blockwise_shift_scale"}
