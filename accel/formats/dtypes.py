"""Stored dtypes: safetensors dtype names, their numpy equivalents, and bfloat16 bit conversions."""

from __future__ import annotations

import numpy as np

# safetensors dtype name -> numpy dtype of the stored bytes (BF16 is kept as its raw uint16 bits)
NUMPY_OF = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
SAFETENSORS_OF = {v: k for k, v in NUMPY_OF.items() if k != "BF16"}

# logical float dtype name -> safetensors dtype of raw storage
FLOAT_STORAGE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def safetensors_dtype(array: np.ndarray) -> str:
    try:
        return SAFETENSORS_OF[array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype]
    except KeyError:
        raise ValueError(f"no safetensors dtype for numpy {array.dtype}") from None


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even) and return the raw uint16 bits; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if np.any(nan):
        out[nan] = np.uint16(0x7FC0)
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the stored array of a logical float dtype."""
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(x, dtype=np.float16)
    if dtype == "bfloat16":
        return float32_to_bf16_bits(x)
    raise ValueError(f"unknown float dtype {dtype!r}")


def from_storage(stored: np.ndarray, dtype: str) -> np.ndarray:
    """The stored array of a logical float dtype -> float32 values (exact)."""
    if dtype == "bfloat16":
        return bf16_bits_to_float32(stored)
    return np.asarray(stored, dtype=np.float32)
