"""Every Triton kernel compiles for Hopper (sm_90) ahead of time, from the launches the wrappers really make.

Triton's pipeline and NVIDIA's ptxas (in the Triton wheel) run on the CPU: no GPU is needed. `make test` runs this
file in its third pass, with build/triton-* on the path and TRITON_INTERPRET unset; elsewhere the compile tests
skip (without Triton, or under the interpreter, whose functions `triton.compile` cannot take).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from accel.kernels import _build, state_update_triton, triton_aot, triton_kernels

needs_aot = pytest.mark.skipif(triton_aot.available() is not None,
                               reason=f"no ahead-of-time Triton compile here: {triton_aot.available()}")
needs_cc = pytest.mark.skipif(not _build.compiler_available(), reason="no C compiler for the accel CPU kernels")


def test_launch_argument_types():
    import torch

    assert triton_aot._type_of(torch.zeros(2, dtype=torch.float16)) == "*fp16"
    assert triton_aot._type_of(torch.zeros(2, dtype=torch.uint8)) == "*u8"
    assert triton_aot._type_of(torch.zeros(2, dtype=torch.int32)) == "*i32"
    assert triton_aot._type_of(7) == "i32" and triton_aot._type_of(np.int64(-7)) == "i32"
    assert triton_aot._type_of(2**31) == "i64" and triton_aot._type_of(-2**31 - 1) == "i64"
    assert triton_aot._type_of(0.5) == "fp32" and triton_aot._type_of(True) == "i1"
    with pytest.raises(TypeError, match="no Triton type"):
        triton_aot._type_of("x")


@pytest.fixture(scope="module")
def launches():
    return triton_aot.default_launches()


@needs_aot
@needs_cc
def test_recording_covers_every_kernel_and_restores_the_modules(launches):
    kernels = {name: getattr(module, name) for module, name in triton_aot.KERNELS}
    # 4 affine layouts (8, 4 and 2 bits in words, base-3 from its stream); Leech planes (one nibble stage) and
    # onehot (two stored stages), two transforms each, and the transforms at bench/gpu.py's sizes; DAMP and float32
    # steps at 2 sizes x 2 decays
    assert Counter(launch.name for launch in launches) == {"_affine_kernel": 1, "_affine_words_kernel": 3,
                                                          "_leech_nibble_kernel": 1,
                                                          "_leech_kernel": 2, "_rht_kernel": 8,
                                                          "_damp_step_kernel": 4, "_f32_step_kernel": 4}
    assert {launch.kernel for launch in launches} == set(kernels.values())
    with pytest.raises(RuntimeError, match="inside"), triton_aot.record_launches():
        raise RuntimeError("inside")
    assert {name: getattr(module, name) for module, name in triton_aot.KERNELS} == kernels
    assert triton_kernels._device is not None and state_update_triton._device is triton_kernels._device


@needs_aot
@needs_cc
@pytest.mark.parametrize("index", range(23))
def test_kernel_compiles_for_sm90(launches, index):
    launch = launches[index]
    compiled = triton_aot.compile_launch(launch, arch=90)
    assert compiled.cubin[:4] == b"\x7fELF"  # a CUDA binary, from ptxas
    assert compiled.resources["REG"] > 0 and compiled.resources["SHARED"] >= 0
    constants = {p.name for p in launch.kernel.params if p.is_constexpr}
    assert set(compiled.constants) == constants and all(v is not None for v in compiled.constants.values())
    if launch.name in ("_affine_words_kernel", "_leech_nibble_kernel", "_rht_kernel"):  # these do not spill
        assert compiled.resources["LOCAL"] == 0 and compiled.resources["STACK"] == 0


@needs_aot
@needs_cc
def test_compile_specializes_as_the_jit_does(launches):
    """A launch's integer 1 is compiled as a constant and its 16-byte aligned pointers and multiples of 16 are marked
    so, as Triton's JIT specializes a real launch. Without that the figures reported here were a pessimistic
    kernel's: the 128 x 128 state steps took 255 registers and spilled 24-32 bytes a thread; as launched they
    do not spill."""
    transform = next(la for la in launches if la.name == "_rht_kernel" and la.kwargs["P"] == 4096)  # odd = 1
    compiled = triton_aot.compile_launch(transform, arch=90)
    assert compiled.specialized == {"odd": 1}
    assert {"src", "pre", "post", "mat", "dst", "n_src"} <= set(compiled.aligned)  # n_src = 4096
    for launch in launches:
        if launch.name == "_damp_step_kernel" and launch.kwargs["DK"] == 128:
            assert triton_aot.compile_launch(launch, arch=90).resources["LOCAL"] == 0
