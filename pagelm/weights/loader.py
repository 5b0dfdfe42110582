"""What an architecture reads from a checkpoint, through one object: config values, small float
tensors, and linear operators over the matrices in the chosen weights mode.

Owns mapping a checkpoint's names, types and metadata to those; models never see the file. A
checkpoint is a GGUF file, a Hugging Face directory (`weights.hf.HFCheckpoint`, which speaks
GGUF's names and says how its tensors differ: row and column orders the operators apply in place,
value conversions for small tensors) or a FastFlowLM directory (`weights.flm.FLMCheckpoint`, the
same plus tiled matrices). The weights mode is a switch here: "dense" unpacks every
matrix at load (the reference, and the way to other devices), "mapped" computes from the
(quantized) bytes in the file maps, and "mapped-int8" (opt-in) is "mapped" with decode's one-row
products of quantized matrices (and the output head's, after prefill too) taken over
int8-quantized activations (`quant.int8dot`: faster, not fp32-exact; prefill's layers are unchanged).
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.formats.gguf import GGUFArray, GGUFFile, GGUFValueType, TensorInfo
from pagelm.quant import DECODABLE, GGMLType, decode_f32
from pagelm.quant import head, int8dot, matmul, tiles
from pagelm.quant.precompile import Job, compile_missing, model_jobs
from pagelm.runtime.threads import kernel_threads
from pagelm.weights.embedding import EmbeddingMode, OutputHead, RowFormat, TokenEmbedding, load_output_head, load_token_embedding
from pagelm.weights.flm import FLMCheckpoint, TiledMatrix, is_flm_directory
from pagelm.weights.hf import HFCheckpoint, HFLayouts, expert_tensor, is_hf_directory
from pagelm.weights.linear import (ColumnOrder, DenseLinear, Linear, MappedLinear, RowGroup, Scratch, TiledPart,
                                   TransposedLinear)
from pagelm.weights.mapped import ExpertPages, MappedTensor, page_spans, tiled_matrices

Checkpoint = GGUFFile | HFCheckpoint | FLMCheckpoint

WeightsMode = Literal["mapped", "mapped-int8", "dense"]
WEIGHTS_MODES: tuple[str, ...] = ("mapped", "mapped-int8", "dense")
# The float32 temporaries of one decode step hold about this many values (4 MiB).
DECODE_CHUNK_VALUES = 1 << 20

_INT_TYPES = (
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
)
_FLOAT_TYPES = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)
_TORCH_FLOATS = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16, GGMLType.BF16: torch.bfloat16}


def open_checkpoint(path: str, hf_layouts: HFLayouts | None = None) -> Checkpoint:
    """A GGUF file, a FastFlowLM directory (one holding model.q4nx) or a Hugging Face directory
    (one holding config.json); a directory is read with the architectures' `hf_layouts`
    (`pagelm.models.hf_layouts`), which its caller hands down."""
    if (is_flm_directory(path) or is_hf_directory(path)) and hf_layouts is None:
        raise PagelmError(f"{path}: a checkpoint directory, opened without the architectures' Hugging Face layouts")
    if is_flm_directory(path):
        return FLMCheckpoint.open(path, hf_layouts)
    if is_hf_directory(path):
        return HFCheckpoint.open(path, hf_layouts)
    if os.path.isdir(path):
        raise ModelFormatError(f"{path}: a directory without config.json or model.q4nx; expected a GGUF file, "
                               f"a Hugging Face checkpoint directory or a FastFlowLM model directory")
    return GGUFFile.open(path)


def tensor_info(model: Checkpoint, name: str, shape: Sequence[int] | None = None) -> TensorInfo:
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
    model: Checkpoint,
    name: str,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    shape: Sequence[int] | None = None,
    rows: np.ndarray | None = None,
) -> torch.Tensor:
    """Tensor `name` decoded to `dtype`, in numpy order (`info.shape`), or only its rows `rows`
    (indices into its rows of ne0 values, in that order; e.g. one expert's of a 3-D tensor).

    Decodes `DECODE_CHUNK_VALUES`-sized runs of rows, straight into the result when it is a
    float32 CPU tensor, else through one float32 scratch. `out` (contiguous, of the element count
    decoded; e.g. a row slice of a fused weight) receives the values instead of a new tensor.
    `shape`, when given, is checked against the file's.
    """
    info = tensor_info(model, name, shape)
    ne0 = info.dims[0]
    raw = model.tensor_data(name).reshape(info.n_elements // ne0, info.row_nbytes)
    n_values = info.n_elements if rows is None else len(rows) * ne0
    if out is None:
        out = torch.empty(info.shape if rows is None else (len(rows), ne0), dtype=dtype)
    elif out.numel() != n_values or not out.is_contiguous():
        raise ValueError(
            f"{model.name}: tensor '{name}': out must be contiguous with {n_values} elements, "
            f"got shape {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    if rows is not None:  # a view where the rows are a run of the tensor's, else a gather of their bytes
        first = run_start(rows)
        raw = raw[rows] if first is None else raw[first : first + len(rows)]
    rows = raw.shape[0]
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


def run_start(rows: np.ndarray) -> int | None:
    """The first of `rows` where they are consecutive ascending indices (a run), else None."""
    first = int(rows[0]) if len(rows) else 0
    return first if np.array_equal(rows, np.arange(first, first + len(rows))) else None


# A part of a fused operator: (tensor name, rows) or (tensor name, rows, row order), where
# operator row i is the tensor's row order[i].
Part = tuple


class WeightLoader:
    """A checkpoint opened for one model: metadata, small tensors, and `linear` operators in the
    weights mode. Matmuls run in `dtype`; small tensors are float32; all on `device`."""

    def __init__(self, file: Checkpoint, weights: WeightsMode = "mapped", dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if weights not in WEIGHTS_MODES:
            raise PagelmError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}")
        self.device = torch.device(device)
        if weights != "dense" and self.device.type != "cpu":
            raise PagelmError(f"weights={weights!r} computes on the CPU; use weights='dense' for device {self.device}")
        if weights == "mapped-int8" and not int8dot.available():
            raise UnsupportedError("weights='mapped-int8' needs a CPU with AVX2; use weights='mapped'")
        self.file, self.weights, self.dtype = file, weights, dtype
        self.name = file.name
        self.scratch = Scratch(dtype)
        self._operators: list[Linear] = []
        self._head: OutputHead | None = None
        self._small_nbytes = 0
        self._runs: dict[tuple[int, int], np.ndarray] = {}  # _rows' shared offsets, by (rows, row bytes)

    @classmethod
    def open(cls, path: str, weights: WeightsMode = "mapped", dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", hf_layouts: HFLayouts | None = None) -> WeightLoader:
        """The checkpoint at `path` (open_checkpoint's, a directory read with `hf_layouts`)."""
        return cls(open_checkpoint(path, hf_layouts), weights, dtype, device)

    # ------------------------------------------------------------------ metadata

    @property
    def architecture(self) -> str:
        return self.file.require("general.architecture")

    def has(self, key: str) -> bool:
        return key in self.file.metadata

    def get(self, key: str, default=None):
        return self.file.metadata.get(key, default)

    def get_int(self, key: str) -> int:
        """Integer metadata `key`, which must be present and a scalar integer."""
        return int(self.file.require(key, *_INT_TYPES))

    def get_float(self, key: str) -> float:
        """Float metadata `key` (integers accepted), which must be present and a scalar."""
        return float(self.file.require(key, *_FLOAT_TYPES, *_INT_TYPES))

    def get_int_array(self, key: str) -> list[int]:
        """An integer array metadata `key`, which must be present."""
        value = self.file.require(key, GGUFValueType.ARRAY)
        # a GGUF array, or a list as a Hugging Face config gives it
        if isinstance(value, GGUFArray) and value.element_type in _INT_TYPES or isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [int(v) for v in value]
        raise ModelFormatError(f"{self.name}: metadata key '{key}' must be an array of integers")

    # ------------------------------------------------------------------ tensors

    @property
    def tiles(self) -> dict:
        return tiled_matrices(self.file)

    def has_tensor(self, name: str) -> bool:
        return name in self.file.tensors or name in self.tiles

    def dims(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s dims, ne0 (the row width) first."""
        if name in self.tiles:
            return self.tiles[name].columns, self.tiles[name].rows
        return tensor_info(self.file, name).dims

    def tensor(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """A small tensor (norms, biases, conv taps) as float32 on the device, numpy-order `shape`."""
        conversion = self.file.conversion(name)
        picked = conversion is not None and conversion.columns is not None  # some of the HF tensor's columns
        t = dequantize_tensor(self.file, name, torch.float32, shape=None if picked else shape)
        if conversion is not None:
            values = t.numpy()
            if conversion.rows is not None:
                values = values[conversion.rows]
            if picked:
                values = values[..., conversion.columns]
            if conversion.to_gguf is not None:
                values = conversion.to_gguf(values)
            t = torch.from_numpy(np.ascontiguousarray(values, np.float32))
            if tuple(t.shape) != tuple(shape):
                raise ModelFormatError(f"{self.name}: tensor '{conversion.hf}' gives '{name}' the shape "
                                       f"{tuple(t.shape)}, expected {tuple(shape)}")
        t = t.to(self.device)
        self._small_nbytes += t.numel() * t.element_size()
        return t

    def linear(self, in_features: int, *parts: Part, prefetch: bool = True) -> Linear:
        """The operator whose rows are the given tensors' rows, stacked in order (each tensor
        (rows, in_features) in numpy order, optionally reordered). `prefetch`: in mapped mode, ask
        the OS for the tensors' pages now, in the background."""
        sources, columns = [], []
        for name, rows, *order in parts:
            if getattr(self.file.conversion(name), "transposed", False):
                raise UnsupportedError(f"{self.name}: tensor '{name}' is stored transposed, which pagelm reads "
                                       f"only as experts")
            source = self._matrix(name, rows, in_features)
            rows_of = np.arange(rows, dtype=np.int64) if not order else np.asarray(order[0], np.int64)
            conversion = self.file.conversion(name)
            if conversion is not None and conversion.rows is not None:
                rows_of = np.asarray(conversion.rows, np.int64)[rows_of]
            columns.append(None if conversion is None else conversion.columns)
            sources.append((source, rows_of))
        op = self._dense(sources, in_features) if self.weights == "dense" else self._mapped(sources, in_features, prefetch)
        self._operators.append(op)
        first = columns[0]
        if any((c is None) != (first is None) or (c is not None and not np.array_equal(c, first)) for c in columns):
            raise UnsupportedError(f"{self.name}: the parts of one operator reorder their columns differently")
        return op if first is None else ColumnOrder(op, first)

    def experts(self, in_features: int, n_experts: int, *parts: tuple[str, int]) -> list[Linear]:
        """One operator per expert of a mixture: expert e's rows are, for each part (name, rows), its
        `rows` rows of the expert tensor `name` ((n_experts, rows, in_features) in numpy order, GGUF's
        3-D ffn_*_exps), stacked in order; in mapped mode row ranges of the tensor read in place. A
        checkpoint that stores each expert's matrix apart (Hugging Face's) holds them as
        `expert_tensor(name, e)`; one that stores them transposed in one 3-D tensor (gpt-oss's fused
        gate_up_proj, down_proj: TensorMap.transposed), as `TransposedLinear`s over it. Nothing is
        prefetched: a token reads only its experts' pages."""
        if any(getattr(self.file.conversion(name), "transposed", False) for name, _ in parts):
            return self._transposed_experts(in_features, n_experts, parts)
        for name, rows in parts:
            if name in self.file.tensors:
                tensor_info(self.file, name, (n_experts, rows, in_features))
        return [self.linear(in_features, *(
            (name, n_experts * rows, np.arange(e * rows, (e + 1) * rows)) if name in self.file.tensors
            else (expert_tensor(name, e), rows) for name, rows in parts), prefetch=False) for e in range(n_experts)]

    def expert_pages(self, n_experts: int, *names: str) -> ExpertPages | None:
        """Each expert's page spans in the 3-D expert tensors `names` ((n_experts, rows, in_features) in numpy
        order), to hint before a prefill reads them; None where weights are not read in place from one GGUF
        map of such tensors (dense weights, a checkpoint of per-expert or transposed tensors)."""
        if self.weights == "dense" or not isinstance(self.file, GGUFFile) or self.file.mmap is None \
                or not all(n in self.file.tensors for n in names):
            return None
        per_expert = [[] for _ in range(n_experts)]
        for name in names:
            info = self.file.tensors[name]
            for e, spans in enumerate(per_expert):
                spans.append(page_spans(info.offset, info.nbytes // n_experts, np.array([e])))
        return ExpertPages(self.file.mmap, [tuple(np.concatenate(parts) for parts in zip(*spans)) for spans in per_expert])

    def _transposed_experts(self, in_features: int, n_experts: int, parts: tuple) -> list[Linear]:
        """experts() of parts that are columns of one tensor (n_experts, in_features, columns) holding
        each expert's matrix transposed: in place (mapped) or unpacked (dense)."""
        maps = [self.file.conversion(name) for name, _ in parts]
        name = parts[0][0]
        if any(m is None or not m.transposed or m.hf != maps[0].hf for m in maps):
            raise UnsupportedError(f"{self.name}: the parts of '{name}' are not columns of one transposed tensor")
        info = tensor_info(self.file, name)
        if len(info.shape) != 3 or tuple(info.shape[:2]) != (n_experts, in_features):
            raise ModelFormatError(f"{self.name}: tensor '{maps[0].hf}' has shape {tuple(info.shape)}, expected "
                                   f"({n_experts}, {in_features}, columns)")
        if info.ggml_type not in _TORCH_FLOATS:
            raise UnsupportedError(f"{self.name}: tensor '{maps[0].hf}' has type {info.ggml_type.name}; transposed "
                                   f"experts are read as F32, F16 or BF16")
        order = np.concatenate([np.arange(rows) if m.rows is None else np.asarray(m.rows, np.int64)
                                for (_, rows), m in zip(parts, maps)])
        if len(order) != sum(rows for _, rows in parts) or order.max() >= info.shape[2]:
            raise ModelFormatError(f"{self.name}: tensor '{maps[0].hf}' of {info.shape[2]} columns does not hold "
                                   f"the rows of {', '.join(n for n, _ in parts)}")
        raw = self.file.tensor_data(name).view(np.int16 if info.ggml_type != GGMLType.F32 else np.float32)
        with warnings.catch_warnings():  # the map is read-only, and no operator writes it
            warnings.simplefilter("ignore", UserWarning)
            stored = torch.from_numpy(raw)
        stored = stored.view(_TORCH_FLOATS[info.ggml_type]).view(info.shape)
        ops: list[Linear] = []
        for e in range(n_experts):
            if self.weights == "dense":
                op = DenseLinear(stored[e].T[torch.from_numpy(order)].to(self.dtype).contiguous().to(self.device))
            else:
                op = TransposedLinear(stored[e], order, self.dtype)
            self._operators.append(op)
            ops.append(op)
        return ops

    def _matrix(self, name: str, rows: int, in_features: int) -> TensorInfo | TiledMatrix:
        """Matrix `name` of (rows, in_features) values: a tiled one, or the info of a GGML one."""
        matrix = self.tiles.get(name)
        if matrix is not None:
            if (matrix.rows, matrix.columns) != (rows, in_features):
                raise ModelFormatError(f"{self.name}: tensor '{matrix.name}' holds {matrix.rows} × {matrix.columns} "
                                       f"values, expected {rows} × {in_features}")
            return matrix
        info = tensor_info(self.file, name)
        # a 3-D tensor (n_experts, rows, columns), one matrix per expert, is n_experts · rows rows; a
        # vector is one row (llama.cpp's ffn_gate_inp_shexp)
        shape = info.shape if len(info.shape) == 2 else (math.prod(info.shape[:-1]), info.shape[-1])
        if tuple(shape) != (rows, in_features):
            raise ModelFormatError(f"{self.name}: tensor '{name}' has shape {tuple(info.shape)} (numpy order), "
                                   f"expected {(rows, in_features)}")
        if info.ggml_type not in DECODABLE:
            raise UnsupportedError(f"{self.name}: tensor '{name}' has type {info.ggml_type.name}, which pagelm "
                                   f"cannot compute with (supported: {', '.join(sorted(t.name for t in DECODABLE))})")
        return info

    def _dense(self, sources, in_features: int) -> DenseLinear:
        fused = torch.empty(sum(len(order) for _, order in sources), in_features, dtype=self.dtype)
        lo = 0
        for source, order in sources:
            part = fused[lo : lo + len(order)]
            if isinstance(source, TiledMatrix):
                part.copy_(torch.from_numpy(source.values()[order]))
            else:
                dequantize_tensor(self.file, source.name, self.dtype, out=part, rows=order)
            lo += len(order)
        return DenseLinear(fused.to(self.device))

    def _mapped(self, sources, in_features: int, prefetch: bool) -> MappedLinear:
        parts: list[RowGroup | TiledPart] = []
        lo, int8 = 0, self.weights == "mapped-int8"
        for source, order in sources:
            if isinstance(source, TiledMatrix):
                tiles.check_tiles(source.data, source.kind, source.offset, source.groups, source.col_tiles)
                parts.append(TiledPart(source, order, lo))
                if prefetch:
                    source.advise(mmap.MADV_WILLNEED)  # bring the matrix into the page cache in the background
            else:
                data, offsets = self._rows(source, order)
                matmul.check_rows(data, source.ggml_type, offsets, in_features)
                last = parts[-1] if parts else None
                if isinstance(last, RowGroup) and last.ggml_type == source.ggml_type \
                        and last.data.ctypes.data == data.ctypes.data:
                    parts[-1] = RowGroup(last.ggml_type, np.concatenate((last.offsets, offsets)), last.out_lo, data,
                                         in_features, int8)
                else:
                    parts.append(RowGroup(source.ggml_type, offsets, lo, data, in_features, int8))
                if prefetch:
                    MappedTensor(self.file, source.name).advise(mmap.MADV_WILLNEED)
            lo += len(order)
        return MappedLinear(parts, in_features, self.dtype, self.scratch)

    def _rows(self, info: TensorInfo, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(data, byte offsets in it) of rows `order` of a GGML tensor. An expert's run of rows of a
        3-D tensor is a view of its bytes whose offsets every such run of that many rows shares: one
        offset array per expert would be 8 bytes of anonymous memory a row (~170 MiB for Qwen3-30B-A3B)."""
        data, stride = self.file.tensor_buffer(info.name)[0], info.row_nbytes
        first = run_start(order)
        if len(info.shape) != 3 or first is None:
            return data, info.offset + order * stride
        offsets = self._runs.get((len(order), stride))
        if offsets is None:
            offsets = self._runs[len(order), stride] = np.arange(len(order), dtype=np.int64) * stride
            offsets.flags.writeable = False
        at = info.offset + first * stride
        return data[at : at + len(order) * stride], offsets

    def token_embedding(self, mode: EmbeddingMode, rows: RowFormat) -> TokenEmbedding:
        return load_token_embedding(self.file, mode, rows)

    def output_head(self) -> OutputHead:
        self._head = load_output_head(self.file, int8=self.weights == "mapped-int8")
        return self._head

    def warmup(self, jobs: list[Job] = ()) -> None:
        """Load the compiled kernels this model uses now rather than inside the first request: those of its
        block types (the head's and token_embd's too), tiles and weights mode, the dequantizers to its dtype;
        what the cache lacks of them and of `jobs` (the network's own, which load when first used) compiles
        in worker processes first."""
        tables = {self.file.tensors[name].ggml_type for name in ("token_embd.weight", "output.weight")
                  if name in self.file.tensors}
        dequantize_to = (np.uint16,) if self.dtype == torch.bfloat16 else (np.float32,)
        types = set() if self.weights == "dense" else {p.ggml_type for op in self._operators if isinstance(op, MappedLinear)
                                                        for p in op.parts if isinstance(p, RowGroup)}
        head_table = getattr(self._head, "tensor", None)
        int8_types = types | {getattr(head_table, "ggml_type", None)} if self.weights == "mapped-int8" else set()
        kinds = {m.kind for m in self.tiles.values()}
        # what the cache lacks compiled in processes of their own at once, then loaded here
        compile_missing(model_jobs(types, tables, kinds, int8_types - {None}, dequantize_to) + list(jobs),
                        kernel_threads())
        head.warmup(tables)
        if types:
            matmul.warmup(types, dequantize_to=dequantize_to)
        if int8_types:
            int8dot.warmup(int8_types)  # a tiled head has no type
        tiles.warmup(kinds, dequantize_to)

    @property
    def operators(self) -> tuple[Linear, ...]:
        """The linear operators made so far, in the order the model asked for them (its layers' order)."""
        return tuple(self._operators)

    @property
    def nbytes(self) -> int:
        """Anonymous bytes the weights hold: dense matrices (or the mapped mode's scratch) and small tensors."""
        return sum(op.nbytes for op in self._operators) + self.scratch.nbytes + self._small_nbytes
