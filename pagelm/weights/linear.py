"""Linear operators y = x·Wᵀ over a checkpoint's matrices: dense (W unpacked at load) or mapped
(W computed from the quantized bytes in the file, GGML rows or FastFlowLM tiles, which stay in
the page cache).

Owns the choice of path per call: a few rows of activations (decode) take the matmul kernels
(mapped) or torch's GEMV (dense); many rows (prefill) take torch's GEMM over row tiles of W,
the same calls in both modes, so prefill is bit-identical. Rows `alone` (one decode step of several
sequences) each get the bits they would get as the only row. Never parses files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.quant.int8dot import INT8_TYPES, Int8Rows, bound_rows_matmul_int8
from pagelm.quant.matmul import MAX_GEMV_ROWS, bound_rows_matmul, rows_dequantize
from pagelm.quant.tiles import ROWS, tile_dequantize, tile_matmul
from pagelm.quant.types import row_nbytes

# Weights per row tile of a many-row product: bounds the mapped mode's one reused scratch
# (8 MiB in bf16) while keeping each GEMM large enough to run at full speed.
TILE_VALUES = 1 << 22
_TILE_ALIGN = 64


def _native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


NATIVE_BF16 = _native_bf16()


def gemm_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The type a many-row product of `dtype` operands runs in on `device`."""
    widen = dtype == torch.bfloat16 and device.type == "cpu" and not NATIVE_BF16
    return torch.float32 if widen else dtype


def tile_rows(in_features: int) -> int:
    """Rows of W per GEMM of a many-row product (the same in both modes)."""
    rows = max(1, TILE_VALUES // in_features)
    return rows // _TILE_ALIGN * _TILE_ALIGN if rows >= _TILE_ALIGN else rows


def as_float32(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a float32 numpy array (a view where it already is float32)."""
    return (t if t.dtype is torch.float32 else t.float()).numpy()


class Linear:
    """y = x·Wᵀ for x (T, in_features); W is (out_features, in_features). With `alone` (at most
    MAX_GEMV_ROWS rows, each a different sequence's), row t of y is bit for bit what x[t] alone gives."""

    in_features: int
    out_features: int
    dtype: torch.dtype  # the compute dtype of many-row products and their result

    @property
    def few_rows_dtype(self) -> torch.dtype:
        """The dtype of a few-row (decode) product's result."""
        return self.dtype

    def __call__(self, x: torch.Tensor, alone: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, xs: np.ndarray, alone: bool = False, out: np.ndarray | None = None,
             int8: Int8Rows | None = None) -> np.ndarray:
        """A decode step's product in numpy: xs float32 C-contiguous (n <= MAX_GEMV_ROWS, in_features);
        the float32 values of self(xs) (its result widened where `dtype` is narrower), without torch's
        dispatch where the operator computes in numpy; written into `out` (float32 (n, out_features),
        C-contiguous) when given, which is returned. `int8`: Int8Rows(xs), for an operator that
        `takes_int8`, made once for the products of one xs."""
        result = as_float32(self(torch.from_numpy(xs), alone))
        if out is None:
            return result
        out[:] = result
        return out

    takes_int8 = False  # decode rows are multiplied in their int8 form (mapped-int8)

    @property
    def nbytes(self) -> int:
        """Anonymous bytes this operator holds."""
        return 0

    @property
    def weight_nbytes(self) -> int:
        """The bytes of W a product reads, wherever they lie (the file map, or anonymous memory)."""
        return self.nbytes

    def _tile(self, lo: int, hi: int) -> torch.Tensor:
        """Rows lo:hi of W in `dtype`, contiguous."""
        raise NotImplementedError

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        gemm = gemm_dtype(self.dtype, x.device)
        x = x.to(self.dtype).to(gemm)
        n, step = self.out_features, tile_rows(self.in_features)
        if step >= n:
            return F.linear(x, self._gemm_tile(0, n, gemm)).to(self.dtype)
        out = torch.empty(x.shape[0], n, dtype=self.dtype, device=x.device)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            out[:, lo:hi] = F.linear(x, self._gemm_tile(lo, hi, gemm))
        return out

    def _gemm_tile(self, lo: int, hi: int, gemm: torch.dtype) -> torch.Tensor:
        """Rows lo:hi of W in the GEMM's type."""
        return self._tile(lo, hi).to(gemm)


class DenseLinear(Linear):
    """W unpacked at load into anonymous memory (`dtype`, on any device): the reference mode."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype

    def __call__(self, x: torch.Tensor, alone: bool = False) -> torch.Tensor:
        if x.shape[0] == 1:  # one row goes through mv, which CPU bf16 runs far faster than a 1-row GEMM
            return torch.mv(self.weight, x[0].to(self.dtype))[None]
        if alone:  # torch's GEMM rounds unlike its GEMV: each row's own mv (W is read once per row)
            return torch.stack([torch.mv(self.weight, row.to(self.dtype)) for row in x])
        return self._many_rows(x)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def _tile(self, lo: int, hi: int) -> torch.Tensor:
        return self.weight[lo:hi]


class Scratch:
    """One reused buffer (at most TILE_VALUES weights) in the compute dtype, shared by a model's
    mapped operators (they run one at a time), grown to the largest tile asked for; and where
    the GEMM runs wider than that dtype (bf16 on a CPU without bf16 GEMMs), a second one the tile
    is widened into: a fresh tensor per tile would be fresh pages, faulted in and zeroed each time
    (more than a second of a short prefill on the 0.8B geometry)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._flat: torch.Tensor | None = None
        self._wide: torch.Tensor | None = None

    def take(self, rows: int, cols: int) -> tuple[torch.Tensor, np.ndarray]:
        """A (rows, cols) view as a tensor and as the numpy array the kernels write (bf16 as uint16)."""
        if self._flat is None or self._flat.numel() < rows * cols:
            self._flat = torch.empty(rows * cols, dtype=self.dtype)
        tensor = self._flat[: rows * cols].view(rows, cols)
        array = tensor.view(torch.int16).numpy().view(np.uint16) if self.dtype == torch.bfloat16 else tensor.numpy()
        return tensor, array

    def widen(self, tile: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tile` converted to `dtype` (exactly: bf16 to float32) in the second buffer."""
        if self._wide is None or self._wide.dtype != dtype or self._wide.numel() < tile.numel():
            self._wide = torch.empty(tile.numel(), dtype=dtype)
        return self._wide[: tile.numel()].view(tile.shape).copy_(tile)

    @property
    def nbytes(self) -> int:
        return sum(0 if t is None else t.numel() * t.element_size() for t in (self._flat, self._wide))


class RowGroup:
    """Consecutive output rows of one GGML type in one file: W[out_lo + r] is the row of `width`
    values at data[offsets[r]:], rows the loader validated (matmul.check_rows). With `int8`, a
    quantized type multiplies the activation rows in their int8 form (int8dot) when it is given them."""

    def __init__(self, ggml_type: int, offsets: np.ndarray, out_lo: int, data: np.ndarray, width: int,
                 int8: bool = False):
        self.ggml_type, self.offsets, self.out_lo, self.data, self.width = ggml_type, offsets, out_lo, data, width
        # product(xs, out): the float rows' product, the kernel's own bound call (a decode step makes ~100)
        self.product = bound_rows_matmul(data, ggml_type, offsets, width, out_lo)
        self._int8 = bound_rows_matmul_int8(data, ggml_type, offsets, width) if int8 and ggml_type in INT8_TYPES \
            else None

    @property
    def rows(self) -> int:
        return len(self.offsets)

    @property
    def takes_int8(self) -> bool:
        return self._int8 is not None

    @property
    def weight_nbytes(self) -> int:
        return self.rows * row_nbytes(self.ggml_type, self.width)

    def matmul(self, xs: np.ndarray, out: np.ndarray, int8: Int8Rows | None = None) -> None:
        """xs: C-contiguous float32 (n <= MAX_GEMV_ROWS, width); out: float32 (n, operator's rows), its
        columns of these rows written; int8: xs quantized (each row alone), or None."""
        if int8 is not None and self._int8 is not None:
            self._int8(int8, out, self.out_lo)
        else:
            self.product(xs, out)

    def dequantize(self, lo: int, hi: int, out: np.ndarray) -> None:
        rows_dequantize(self.data, self.ggml_type, self.offsets[lo:hi], self.width, out)


@dataclass(frozen=True)
class TiledPart:
    """Consecutive output rows read from one tiled matrix (`weights.flm.TiledMatrix`): W[out_lo + r]
    is the matrix's row order[r]. A few rows of x multiply the matrix's whole 32-row groups, then
    the rows are put in order."""

    matrix: object
    order: np.ndarray  # int64
    out_lo: int
    takes_int8 = False

    @property
    def rows(self) -> int:
        return len(self.order)

    @property
    def weight_nbytes(self) -> int:  # a product reads the whole matrix's groups
        return self.matrix.nbytes

    def matmul(self, xs: np.ndarray, out: np.ndarray, int8: Int8Rows | None = None) -> None:
        self.product(xs, out)

    def product(self, xs: np.ndarray, out: np.ndarray) -> None:
        m = self.matrix
        groups = np.empty((xs.shape[0], m.groups * ROWS), np.float32)
        tile_matmul(m.data, m.kind, m.offset, m.groups, m.col_tiles, xs, groups)
        out[:, self.out_lo : self.out_lo + self.rows] = groups[:, self.order]

    def dequantize(self, lo: int, hi: int, out: np.ndarray) -> None:
        m = self.matrix
        tile_dequantize(m.data, m.kind, m.offset, m.groups, m.col_tiles, self.order[lo:hi], out)


class MappedLinear(Linear):
    """W read in place from the file maps: its rows may come from several tensors (a fused
    projection) of different types and layouts (GGML rows, FastFlowLM tiles), in any order (a row
    permutation), with no copy. Each part (RowGroup, TiledPart) multiplies and dequantizes its rows;
    the activation rows are quantized once (each alone) for the parts that take them in int8."""

    def __init__(self, parts: list, in_features: int, dtype: torch.dtype, scratch: Scratch):
        self.parts, self.scratch = parts, scratch
        self._int8 = any(p.takes_int8 for p in parts)
        self._products = [p.product for p in parts]
        self.in_features = in_features
        self.out_features = parts[-1].out_lo + parts[-1].rows
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, alone: bool = False) -> torch.Tensor:
        if x.shape[0] > MAX_GEMV_ROWS:
            if alone:
                raise ValueError(f"at most {MAX_GEMV_ROWS} rows are multiplied alone, got {x.shape[0]}")
            return self._many_rows(x)
        if x.dtype is torch.float32 and x.is_contiguous():  # a decode step's activations: skip two no-op calls
            xs = x.numpy()
        else:
            xs = x.to(torch.float32).contiguous().numpy()
        return torch.from_numpy(self.rows(xs, alone))

    def rows(self, xs: np.ndarray, alone: bool = False, out: np.ndarray | None = None,
             int8: Int8Rows | None = None) -> np.ndarray:
        if out is None:
            out = np.empty((xs.shape[0], self.out_features), np.float32)
        if self._int8 and (alone or xs.shape[0] == 1):  # each row quantized as it would be alone
            int8 = int8 or Int8Rows(xs)
            for p in self.parts:
                p.matmul(xs, out, int8)
            return out
        for product in self._products:  # the kernels give each of a few rows its one-row bits
            product(xs, out)
        return out

    few_rows_dtype = torch.float32

    @property
    def takes_int8(self) -> bool:
        return self._int8

    @property
    def weight_nbytes(self) -> int:
        return sum(p.weight_nbytes for p in self.parts)

    def _gemm_tile(self, lo: int, hi: int, gemm: torch.dtype) -> torch.Tensor:
        tile = self._tile(lo, hi)
        return tile if tile.dtype == gemm else self.scratch.widen(tile, gemm)

    def _tile(self, lo: int, hi: int) -> torch.Tensor:
        tensor, array = self.scratch.take(hi - lo, self.in_features)
        for p in self.parts:
            a, b = max(lo, p.out_lo), min(hi, p.out_lo + p.rows)
            if a < b:
                p.dequantize(a - p.out_lo, b - p.out_lo, array[a - lo : b - lo])
        return tensor


class ColumnOrder(Linear):
    """An operator over a matrix stored with its columns in another order: GGUF column j is
    stored column `columns[j]`, so the input is gathered into the stored order, never the matrix."""

    def __init__(self, inner: Linear, columns: np.ndarray):
        self.inner = inner
        self.in_features, self.out_features, self.dtype = inner.in_features, inner.out_features, inner.dtype
        gather = np.empty(len(columns), np.int64)
        gather[np.asarray(columns, np.int64)] = np.arange(len(columns))
        self.gather = torch.from_numpy(gather)

    @property
    def few_rows_dtype(self) -> torch.dtype:
        return self.inner.few_rows_dtype

    @property
    def weight_nbytes(self) -> int:
        return self.inner.weight_nbytes

    def __call__(self, x: torch.Tensor, alone: bool = False) -> torch.Tensor:
        return self.inner(x[:, self.gather], alone)


class TransposedLinear(Linear):
    """W read in place from a float matrix stored transposed, `stored` (in_features, columns) (Hugging
    Face's fused experts, gpt-oss's gate_up_proj and down_proj): W's row i is stored column order[i].
    x·Wᵀ is x times the stored matrix (BLAS reads it as it lies), then its columns in `order`; where
    `stored` is of another dtype than `dtype`, a tile of columns at a time is converted. Rows `alone`
    are each a product of one row, as a row by itself is."""

    def __init__(self, stored: torch.Tensor, order: np.ndarray, dtype: torch.dtype):
        self.stored, self.dtype = stored, dtype
        self.in_features, self.out_features = stored.shape[0], len(order)
        whole = np.array_equal(order, np.arange(stored.shape[1]))
        self.order = None if whole else torch.from_numpy(np.asarray(order, np.int64))

    @property
    def weight_nbytes(self) -> int:  # its columns' share of the stored matrix
        return self.in_features * self.out_features * self.stored.element_size()

    def __call__(self, x: torch.Tensor, alone: bool = False) -> torch.Tensor:
        x = x.to(self.dtype)
        full = torch.cat([self._product(x[r : r + 1]) for r in range(x.shape[0])]) if alone and x.shape[0] > 1 \
            else self._product(x)
        return full if self.order is None else full[:, self.order]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.stored.dtype == self.dtype:
            return x @ self.stored
        columns = self.stored.shape[1]
        step = max(1, TILE_VALUES // self.in_features)
        out = torch.empty(x.shape[0], columns, dtype=self.dtype)
        for lo in range(0, columns, step):
            out[:, lo : lo + step] = x @ self.stored[:, lo : lo + step].to(self.dtype)
        return out
