"""Compile accel's Triton kernels ahead of time for an NVIDIA architecture, on a machine without a GPU.

`triton.compile` with an explicit `GPUTarget` runs Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX) and then
NVIDIA's ptxas, which the Triton wheel ships, into a cubin: no driver and no device are needed. That checks what
Triton's interpreter cannot (the interpreter runs the kernels as NumPy on the CPU): that each kernel lowers for the
architecture at all (types, layouts, the operations it uses), and how many registers, how much local memory
(spills) and shared memory a program takes. It does not run anything: numerics stay with the interpreter tests
(`tests/test_kernels_triton.py`), speed with `bench/gpu.py` on a lent GPU.

The launches compiled are the ones the wrappers make. `record_launches` runs a wrapper (`GpuWeight.matvec`,
`step_mixed_triton`, ...) on CPU tensors with each kernel replaced by a recorder, so every signature, constexpr and
`num_warps` comes from the real call. Import this module with TRITON_INTERPRET unset: under the interpreter
`triton.jit` gives interpreted functions, which `triton.compile` cannot take.

    python -m accel.kernels.triton_aot [--arch 90]     # a table: kernel, constants, registers, spills, shared
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from accel.kernels import state_update_triton, triton_kernels

triton = triton_kernels.triton

# kernels by the module attribute the wrappers launch them through
KERNELS = {(triton_kernels, "_affine_kernel"), (triton_kernels, "_affine_words_kernel"),
           (triton_kernels, "_leech_kernel"), (triton_kernels, "_leech_nibble_kernel"), (triton_kernels, "_rht_kernel"),
           (state_update_triton, "_damp_step_kernel"), (state_update_triton, "_f32_step_kernel")}
OPTIONS = ("num_warps", "num_stages", "num_ctas")  # launch keywords that are compile options, not arguments


@dataclass
class Launch:
    kernel: Any  # the JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class Compiled:
    launch: Launch
    constants: dict
    options: dict
    cubin: bytes
    resources: dict = field(default_factory=dict)  # REG, STACK, SHARED, LOCAL as cuobjdump reports them
    specialized: dict = field(default_factory=dict)  # arguments compiled as constants as the JIT would (an int 1)
    aligned: tuple = ()  # arguments marked divisible by 16 as the JIT would (aligned pointers, multiples of 16)


def available() -> str | None:
    """None when ahead-of-time compilation can run here, else why not."""
    if triton is None:
        return "Triton is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 turns the kernels into interpreted functions"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:  # pragma: no cover - an old Triton
        return f"this Triton has no ahead-of-time API ({e})"
    if not os.path.exists(_nvidia_tool("ptxas")):
        return "this Triton wheel has no ptxas"
    return None


def _nvidia_tool(name: str) -> str:
    from triton.backends import nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


class _Recorder:
    def __init__(self, kernel: Any, log: list[Launch]):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.log.append(Launch(self.kernel, args, kwargs))

        return launch


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Within the block the wrappers run on CPU tensors (the device rule says "cpu") and every kernel launch is
    recorded, not run: outputs stay unwritten."""
    log: list[Launch] = []
    saved = [(module, name, getattr(module, name)) for module, name in KERNELS]
    saved += [(triton_kernels, "_device", triton_kernels._device),
              (state_update_triton, "_device", state_update_triton._device)]
    try:
        for module, name in KERNELS:
            setattr(module, name, _Recorder(getattr(module, name), log))
        triton_kernels._device = state_update_triton._device = lambda: "cpu"
        yield log
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


_POINTEE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "uint8": "u8", "int8": "i8", "int16": "i16",
            "int32": "i32", "int64": "i64"}


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, (int, np.integer)):
        return "i32" if -2**31 <= int(value) < 2**31 else "i64"
    if isinstance(value, (float, np.floating)):
        return "fp32"
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "*" + _POINTEE[str(value.dtype).removeprefix("torch.")]
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def compile_launch(launch: Launch, arch: int = 90) -> Compiled:
    """The launch's kernel compiled to a cubin for sm_`arch`, with the launch's argument types and constants."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = launch.kernel
    options = {k: v for k, v in launch.kwargs.items() if k in OPTIONS}
    arguments = {k: v for k, v in launch.kwargs.items() if k not in OPTIONS}
    bound = inspect.signature(kernel.fn).bind(*launch.args, **arguments).arguments
    constexpr = [p.name for p in kernel.params if p.is_constexpr]
    signature = {name: "constexpr" if name in constexpr else _type_of(value) for name, value in bound.items()}
    constants = {name: bound[name] for name in constexpr}  # in the kernel's parameter order
    # what the JIT specializes on at a launch: an integer 1 becomes a constant, and pointers 16-byte aligned and
    # integers divisible by 16 are marked so (vector loads and address arithmetic depend on it)
    specialized = dict(constants)
    attrs = {}
    for index, (name, value) in enumerate(bound.items()):
        if name in constexpr or isinstance(value, bool):
            continue
        if isinstance(value, (int, np.integer)) and int(value) == 1:
            signature[name] = "constexpr"
            specialized[name] = 1
        elif (isinstance(value, (int, np.integer)) and int(value) % 16 == 0) or \
                (hasattr(value, "data_ptr") and value.data_ptr() % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=specialized, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    cubin = compiled.asm["cubin"]
    names = list(bound)
    return Compiled(launch, constants, options, cubin, _resources(cubin, launch.name),
                    {k: v for k, v in specialized.items() if k not in constants},
                    tuple(names[index] for (index,) in attrs))


def _resources(cubin: bytes, name: str) -> dict:
    """Registers, stack, shared and local (spilled) bytes of the kernel `name` in the cubin, from cuobjdump."""
    tool = _nvidia_tool("cuobjdump")
    if not os.path.exists(tool):  # pragma: no cover - every NVIDIA backend we know ships it
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=False).stdout
    for block in out.split("Function ")[1:]:
        if block.startswith(name):
            return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", block)}
    return {}


def default_launches(seed: int = 0) -> list[Launch]:
    """The launches `bench/gpu.py` and the tests make: a matvec of every stored layout the GPU serves (int8, int4,
    int2 symmetric, base-3, Leech planes, Leech onehot with a residual stage), the Leech transforms at the sizes
    bench/gpu.py times (4096 and 14336 rows and columns; columns padded to 24), and the DAMP and float32 state steps
    for GDN and KDA decay at Qwen3-Next's head size (128 x 128) and the fixtures' (64 x 64)."""
    import torch

    from accel.formats.tensor import encode_tensor
    from accel.kernels import kernel_weight

    rng = np.random.default_rng(seed)
    matvec = [("affine", {"levels": 256, "group": 64}), ("affine", {"levels": 16, "group": 64}),
              ("affine", {"levels": 4, "group": 64, "symmetric": True}),
              ("affine", {"levels": 3, "group": 64, "layout": "base"}),
              ("leech", {"shells": (13,), "layout": "planes", "seed_in": 1, "seed_out": 2}),
              ("leech", {"shells": (13, 3), "layout": "onehot", "seed_in": 1, "seed_out": 2})]
    with record_launches() as log:
        for codec, params in matvec:
            entry, arrays = encode_tensor("w", rng.standard_normal((48, 96)), codec, **params)
            weight = kernel_weight(entry, {p: arrays[n] for p, n in entry.parts.items()})
            triton_kernels.gpu_weight(weight).matvec(torch.zeros(96, dtype=torch.float32))
        for n, inverse in ((4104, False), (4096, True), (14352, False), (14336, True)):  # bench/gpu.py's shapes
            from accel.quantize.incoherence import _factors, split_size

            signs, rot = _factors(n, 1)
            transform = triton_kernels._Transform(signs, rot.T if inverse else rot, split_size(n)[0],
                                                  lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32)))
            vec = torch.zeros(n, dtype=torch.float32)
            if inverse:
                transform(torch.zeros(4 * n), n, vec, pre=vec, post=transform.signs, parts=4)
            else:
                transform(vec, n - 8, torch.zeros(9 * n // 8), stage_input=True)
        for d in (128, 64):
            for kda in (False, True):
                b, h, n_hi = 1, 2, d // 4
                q = k = torch.zeros((b, h, d))
                v = torch.zeros((b, h, d))
                g = torch.zeros((b, h, d) if kda else (b, h))
                beta = torch.zeros((b, h))
                slot = torch.arange(h * d, dtype=torch.int32)
                slot = torch.where(slot < n_hi, slot, n_hi - 1 - slot)  # n_hi rows float16, the rest int8
                hi = torch.zeros((b, n_hi, d), dtype=torch.float16)
                lo = torch.zeros((b, h * d - n_hi, d), dtype=torch.int8)
                lo_scale = torch.zeros((b, h * d - n_hi), dtype=torch.float16)
                state_update_triton.step_mixed_triton(slot, hi, lo, lo_scale, q, k, v, g, beta)
                state_update_triton.step_f32_triton(torch.zeros((b, h, d, d)), q, k, v, g, beta)
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="sm_ARCH (90: H100/H200)")
    args = parser.parse_args(argv)
    why = available()
    if why:
        print(f"error: cannot compile ahead of time here: {why}", file=sys.stderr)
        return 2
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    print("| kernel | constants | num_warps | registers | stack bytes (spills) | shared bytes |")
    print("|---|---|---|---|---|---|")
    for launch in default_launches():
        c = compile_launch(launch, args.arch)
        consts = ", ".join(f"{k}={v}" for k, v in c.constants.items())
        r = c.resources
        print(f"| {launch.name} | {consts} | {c.options.get('num_warps', 4)} | {r.get('REG', '?')} | "
              f"{r.get('STACK', '?')} | {r.get('SHARED', '?')} |")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
