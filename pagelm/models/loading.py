"""Turning a model file's tensors and metadata into torch tensors and config values.

Owns dequantizing whole layer weights (in bounded row chunks) and the typed metadata look-ups
every architecture needs; never does model math and never keeps a reference into the map.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagelm.errors import ModelFormatError
from pagelm.formats.gguf import GGUFArray, GGUFFile, GGUFValueType, TensorInfo
from pagelm.quant import decode_f32

# The float32 temporaries of one decode step hold about this many values (4 MiB).
DECODE_CHUNK_VALUES = 1 << 20

_INT_TYPES = (
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
)
_FLOAT_TYPES = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


def tensor_info(model: GGUFFile, name: str, shape: Sequence[int] | None = None) -> TensorInfo:
    """The info of tensor `name`, which must exist (and have numpy-order `shape`, when given)."""
    info = model.tensors.get(name)
    if info is None:
        raise ModelFormatError(f"{model.name}: tensor '{name}' missing")
    if shape is not None and tuple(info.shape) != tuple(shape):
        raise ModelFormatError(
            f"{model.name}: tensor '{name}' has shape {tuple(info.shape)} (numpy order), expected {tuple(shape)}"
        )
    return info


def dequantize_tensor(
    model: GGUFFile,
    name: str,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
) -> torch.Tensor:
    """Tensor `name` decoded to `dtype`, in numpy order (`info.shape`).

    Decodes `DECODE_CHUNK_VALUES`-sized runs of rows, straight into the result when it is a
    float32 CPU tensor, else through one float32 scratch. `out` (contiguous, of the tensor's
    element count; e.g. a row slice of a fused weight) receives the values instead of a new
    tensor. `shape`, when given, is checked against the file's.
    """
    info = tensor_info(model, name, shape)
    ne0 = info.dims[0]
    rows = info.n_elements // ne0
    if out is None:
        out = torch.empty(info.shape, dtype=dtype)
    elif out.numel() != info.n_elements or not out.is_contiguous():
        raise ValueError(
            f"{model.name}: tensor '{name}': out must be contiguous with {info.n_elements} elements, "
            f"got shape {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    raw = model.tensor_data(name).reshape(rows, info.row_nbytes)
    flat = out.view(rows, ne0)
    step = max(1, DECODE_CHUNK_VALUES // ne0)
    direct = flat.dtype == torch.float32 and flat.device.type == "cpu"
    scratch = None if direct else np.empty((min(step, rows), ne0), np.float32)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        if direct:
            decode_f32(raw[lo:hi], info.ggml_type, out=flat[lo:hi].numpy())
        else:
            part = scratch[: hi - lo]
            decode_f32(raw[lo:hi], info.ggml_type, out=part)
            flat[lo:hi].copy_(torch.from_numpy(part))
    return out


def stack_rows(
    model: GGUFFile,
    names: Sequence[str],
    dtype: torch.dtype,
    shapes: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Several 2-D tensors with the same row width, decoded into one (sum of rows, width) tensor.

    This is how fused projections (qkv, gate+up) are built without a second copy in memory.
    """
    width = shapes[0][1]
    for name, shape in zip(names, shapes):
        tensor_info(model, name, shape)
        if shape[1] != width:
            raise ModelFormatError(f"{model.name}: tensor '{name}' has rows of {shape[1]} values, expected {width}")
    fused = torch.empty(sum(s[0] for s in shapes), width, dtype=dtype)
    lo = 0
    for name, shape in zip(names, shapes):
        dequantize_tensor(model, name, dtype, out=fused[lo : lo + shape[0]], shape=shape)
        lo += shape[0]
    return fused


def metadata_int(model: GGUFFile, key: str) -> int:
    """Integer metadata `key`, which must be present and a scalar integer."""
    value = model.require(key, *_INT_TYPES)
    return int(value)


def metadata_float(model: GGUFFile, key: str) -> float:
    """Float metadata `key` (integers accepted), which must be present and a scalar."""
    value = model.require(key, *_FLOAT_TYPES, *_INT_TYPES)
    return float(value)


def metadata_int_array(model: GGUFFile, key: str) -> list[int]:
    """An integer array metadata `key`, which must be present."""
    value = model.require(key, GGUFValueType.ARRAY)
    if not isinstance(value, GGUFArray) or value.element_type not in _INT_TYPES:
        raise ModelFormatError(f"{model.name}: metadata key '{key}' must be an array of integers")
    return [int(v) for v in value]
