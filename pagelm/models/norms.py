"""RMS norm of a few rows as one compiled kernel: the decode path of every architecture's norms.

torch's `F.rms_norm` costs ~36 µs on one 1,024-value row on the CPU (several internal ops and
their dispatch), this kernel with its wrapper ~16 µs; a decode step of the Qwen3.5 0.8B geometry
calls it 61 times. Prefill rows keep torch's (vectorized over many rows, already cheap per row).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

MAX_ROWS = 64  # rows of at most one decode step (a token's heads, for the q/k norms) take the kernel


@njit(cache=True, fastmath={"contract"})
def rms_rows(x, w, eps, out):
    rows, n = x.shape
    for r in range(rows):
        ss = 0.0  # float64: one rounding for the whole sum
        for i in range(n):
            v = np.float64(x[r, i])
            ss += v * v
        scale = np.float32(1.0 / np.sqrt(ss / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * scale * w[i]


def rms_norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float, tokens_alone: bool = False) -> torch.Tensor | None:
    """x · rsqrt(mean(x²) + eps) · w over the last axis for a contiguous float32 CPU `x` of at most
    MAX_ROWS rows of w's width (as a view of any leading shape); None when `x` is not such a tensor.
    `tokens_alone`: x's leading axis is one token each of sequences of a batched step, and the row
    limit is each token's, the one it has decoding alone."""
    n = w.shape[0]
    tokens = x.shape[0] if tokens_alone and x.dim() > 1 else 1
    if not (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and x.is_contiguous() and x.shape[-1] == n and x.numel() <= MAX_ROWS * n * tokens and not x.requires_grad):
        return None
    return torch.from_numpy(norm_rows(x.numpy().reshape(-1, n), w.numpy(), eps)).view(x.shape)


def norm_rows(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """rms_norm_rows' values for float32 numpy rows x (rows, n) and weights w (n,), unchecked (a
    decode step's own arrays): written into `out` (float32 (rows, n), not x) or a new array."""
    if out is None:
        out = np.empty(x.shape, np.float32)
    rms_rows(x, w, eps, out)
    return out
