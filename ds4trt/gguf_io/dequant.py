"""Tensor bytes -> numpy arrays, for the ggml types ds4 uses (spec ds4_architecture.md §2.8).

Quantized types go through `gguf.quants.dequantize`, the reference implementation; F32, F16 and I32
are plain numpy views. Shapes here are numpy order (outermost first) unless named `ggml_shape`.

    dequantize(raw, ggml_type, shape)                 -> float32 array of `shape`
    dequantize_rows(raw, ggml_type, shape, start, stop) -> float32 rows [start:stop] of dim 0 (one expert)
    raw_rows(raw, ggml_type, shape, start, stop)      -> the uint8 bytes of those rows (a view)
    as_int32(raw, shape)                              -> int32 view (I32 tensors, e.g. ffn_gate_tid2eid)
    tensor_nbytes(ggml_type, ggml_shape)              -> byte size, used by the reader

F32 and I32 results are views of `raw` (read-only when `raw` is a file mapping: copy before writing);
F16 and quantized results are new arrays.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _quants

from ds4trt.gguf_io import names as N

# ggml type id -> (elements per block, bytes per block), for every type the gguf package knows.
BLOCK_SIZES: dict[int, tuple[int, int]] = {int(t): (int(b), int(s)) for t, (b, s) in GGML_QUANT_SIZES.items()}

def type_name(ggml_type: int) -> str:
    """'Q8_0' for a known ggml type id, 'type 99' otherwise (for messages)."""
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


DEQUANT_TYPES = (N.F32, N.F16, N.Q8_0, N.Q2_K, N.Q4_K, N.IQ2_XXS)


def tensor_nbytes(ggml_type: int, ggml_shape) -> int:
    """Bytes of a tensor of `ggml_shape` (ne0 first); ValueError for an unknown type or a partial block."""
    if ggml_type not in BLOCK_SIZES:
        raise ValueError(f"unknown ggml type {ggml_type}")
    block, size = BLOCK_SIZES[ggml_type]
    if ggml_shape[0] % block:
        raise ValueError(f"ne0 = {ggml_shape[0]} is not a multiple of the {type_name(ggml_type)} block size {block}")
    return math.prod(ggml_shape) // block * size


def _check_raw(raw: np.ndarray, ggml_type: int, shape) -> np.ndarray:
    if raw.dtype != np.uint8:
        raise ValueError(f"raw tensor bytes must be uint8, got {raw.dtype}")
    raw = raw.reshape(-1)
    want = tensor_nbytes(ggml_type, tuple(reversed(shape)))
    if raw.size != want:
        raise ValueError(f"{type_name(ggml_type)} tensor of shape {tuple(shape)} needs {want} bytes, got {raw.size}")
    return raw


def dequantize(raw: np.ndarray, ggml_type: int, shape) -> np.ndarray:
    """float32 array of numpy `shape` from the tensor's bytes (F32, F16, Q8_0, Q2_K, Q4_K, IQ2_XXS)."""
    shape = tuple(int(s) for s in shape)
    if ggml_type not in DEQUANT_TYPES:
        hint = " (use as_int32)" if ggml_type == N.I32 else ""
        raise ValueError(f"cannot dequantize {type_name(ggml_type)}{hint}; supported: "
                         + ", ".join(N.TYPE_NAMES[t] for t in DEQUANT_TYPES))
    raw = _check_raw(raw, ggml_type, shape)
    if ggml_type == N.F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type == N.F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if raw.size == 0:  # an empty row range; gguf.quants cannot reshape zero blocks
        return np.zeros(shape, np.float32)
    block, size = BLOCK_SIZES[ggml_type]
    rows = raw.reshape(-1, shape[-1] // block * size)  # one ggml row (ne0 values) per line
    return _quants.dequantize(rows, GGMLQuantizationType(ggml_type)).reshape(shape)


def raw_rows(raw: np.ndarray, ggml_type: int, shape, start: int, stop: int) -> np.ndarray:
    """The bytes of rows [start:stop] of dim 0 of numpy `shape` (e.g. experts of a 3-D tensor): a view."""
    shape = tuple(int(s) for s in shape)
    raw = _check_raw(raw, ggml_type, shape)
    if not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"rows [{start}:{stop}] outside dim 0 of shape {shape}")
    per_row = math.prod(shape[1:])  # elements per index of dim 0
    block, size = BLOCK_SIZES[ggml_type]
    if (start * per_row) % block or (stop * per_row) % block:
        raise ValueError(f"rows [{start}:{stop}] of shape {shape} split a {type_name(ggml_type)} block of {block}")
    return raw[start * per_row // block * size: stop * per_row // block * size]


def dequantize_rows(raw: np.ndarray, ggml_type: int, shape, start: int, stop: int) -> np.ndarray:
    """float32 rows [start:stop] of dim 0 of numpy `shape`, without dequantizing the rest of the tensor."""
    shape = tuple(int(s) for s in shape)
    part = raw_rows(raw, ggml_type, shape, start, stop)
    return dequantize(part, ggml_type, (stop - start,) + shape[1:])


def as_int32(raw: np.ndarray, shape) -> np.ndarray:
    """int32 view of numpy `shape` over an I32 tensor's bytes."""
    shape = tuple(int(s) for s in shape)
    raw = _check_raw(raw, N.I32, shape)
    return raw.view(np.int32).reshape(shape)
