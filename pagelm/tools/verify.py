"""Row-by-row proof that mapped embedding rows equal the dense table and the gguf-py oracle, and
that FastFlowLM tiles decode to their stored bf16 copies.

Owns the comparisons only; the CLI prints them. The oracle (the `gguf` package) is optional and
knows GGML blocks only; FastFlowLM tiles are checked against the copies the directory stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from pagelm.weights import DenseTable, MappedRows, MappedTensor
from pagelm.weights.flm import FLMCheckpoint, copy_name

VERIFY_CHUNK_ROWS = 4096


@dataclass
class VerifyReport:
    rows_checked: int = 0
    dense_differing: int = 0
    oracle: str | None = None  # None when gguf is not installed
    oracle_checked: int = 0
    oracle_differing: int = 0
    differing_rows: set[int] = field(default_factory=set)

    def as_json(self) -> dict:
        return {
            "rows_checked": self.rows_checked,
            "rows_differing": len(self.differing_rows),
            "dense_differing": self.dense_differing,
            "oracle": self.oracle,
            "oracle_checked": self.oracle_checked,
            "oracle_differing": self.oracle_differing,
            "first_differing_rows": sorted(self.differing_rows)[:10],
        }


def _gguf_oracle():
    """gguf-py's dequantize and bf16 rounding, or None when the package is absent."""
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize, quantize
    except ImportError:
        return None

    def oracle_bf16(raw: np.ndarray, ggml_type: int) -> np.ndarray:
        values = dequantize(raw, GGMLQuantizationType(int(ggml_type)))
        return quantize(values, GGMLQuantizationType.BF16).view(np.uint16).reshape(values.shape)

    import importlib.metadata

    return oracle_bf16, f"gguf {importlib.metadata.version('gguf')}"


def select_rows(vocab: int, n: int | None) -> np.ndarray:
    """All rows, or n rows spread evenly from the first to the last."""
    if n is None or n >= vocab:
        return np.arange(vocab, dtype=np.int64)
    return np.unique(np.linspace(0, vocab - 1, max(n, 1)).round().astype(np.int64))


def verify_embedding(
    tensor,
    rows: np.ndarray,
    use_oracle: bool = True,
    progress: Callable[[str, int], None] | None = None,
) -> VerifyReport:
    """Compare mapped rows against a dense table (unpacked here, as the old runtime does) and,
    when available, against gguf-py (GGML tables only). `progress(stage, n)` reports rows
    unpacked / checked."""
    report = VerifyReport()
    dense = DenseTable(tensor, progress=(lambda n: progress("unpack", n)) if progress else None)
    mapped = MappedRows(tensor)
    oracle = _gguf_oracle() if use_oracle and isinstance(tensor, MappedTensor) else None
    if oracle is not None:
        report.oracle = oracle[1]
    for lo in range(0, rows.size, VERIFY_CHUNK_ROWS):
        chunk = rows[lo : lo + VERIFY_CHUNK_ROWS]
        got = mapped.lookup(chunk)
        differs = np.any(got != dense.lookup(chunk), axis=1)
        report.dense_differing += int(differs.sum())
        report.differing_rows.update(chunk[differs].tolist())
        if oracle is not None:
            expected = oracle[0](np.ascontiguousarray(tensor.raw[chunk]), tensor.ggml_type)
            differs = np.any(got != expected, axis=1)
            report.oracle_checked += chunk.size
            report.oracle_differing += int(differs.sum())
            report.differing_rows.update(chunk[differs].tolist())
        report.rows_checked += chunk.size
        if progress:
            progress("check", chunk.size)
    return report


@dataclass
class CopiesReport:
    tensors: int = 0
    values: int = 0
    outside: int = 0  # decoded values further from the copy than half a quantization step
    worst: list[str] = field(default_factory=list)  # tensors with values outside


def verify_copies(checkpoint) -> CopiesReport:
    """Every tiled matrix of a FastFlowLM directory that has a bf16 copy beside it, decoded and
    compared with the copy (nothing to check in other checkpoints)."""
    report = CopiesReport()
    if not isinstance(checkpoint, FLMCheckpoint):
        return report
    for matrix in checkpoint.tiles.values():
        if copy_name(matrix.name) in checkpoint.shards.tensors:
            outside = checkpoint.copy_mismatches(matrix)
            report.tensors += 1
            report.values += matrix.rows * matrix.columns
            report.outside += outside
            if outside:
                report.worst.append(matrix.name)
    return report
