"""accel's additions to the coremltools PyTorch frontend: the ANE RMSNorm lowering and one torch-2.13 fix.

Importing this module registers them (idempotently) with coremltools' torch op registry.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.frontend.torch.ops import _get_inputs
from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op
from coremltools.converters.mil.mil import types


@register_torch_op(torch_alias=["accel::rms_norm_ane"], override=True)
def accel_rms_norm_ane(context, node) -> None:
    """RMSNorm on (1, C, 1, S) as concat([x, -x]) -> layer_norm over the channel axis -> the first C channels."""
    x, eps = _get_inputs(context, node, expected=2)
    np_dtype = types.nptype_from_builtin(x.dtype)
    both = mb.concat(values=[x, mb.mul(x=x, y=np.array(-1.0, dtype=np_dtype))], axis=1)
    normed = mb.layer_norm(x=both, axes=[1], epsilon=np.array(eps.val, dtype=np_dtype))
    context.add(mb.slice_by_index(x=normed, begin=[0] * x.rank, end=list(x.shape), name=node.name))


def _scalar_cast(context, node, dtype: type, dtype_name: str) -> None:
    """`aten::Int` / `aten::Bool` on a folded length-1 tensor: NumPy 2 refuses int(array([n])), so take the item."""
    (x,) = _get_inputs(context, node, expected=1)
    if x.can_be_folded_to_const():
        value = np.asarray(x.val)
        if value.size != 1:
            raise ValueError("input to cast must be a scalar or a length-1 tensor")
        context.add(mb.const(val=dtype(value.reshape(()).item()), name=node.name), node.name)
    elif x.rank > 0:
        context.add(mb.cast(x=mb.squeeze(x=x, name=node.name + "_item"), dtype=dtype_name, name=node.name))
    else:
        context.add(mb.cast(x=x, dtype=dtype_name, name=node.name))


@register_torch_op(torch_alias=["int"], override=True)
def _int(context, node) -> None:
    _scalar_cast(context, node, int, "int32")


@register_torch_op(torch_alias=["bool"], override=True)
def _bool(context, node) -> None:
    _scalar_cast(context, node, bool, "bool")
