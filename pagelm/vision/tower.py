"""Qwen3.5's vision tower and merger (transformers' `Qwen3_5VisionModel`): pixel rows of one image
in, one float32 row per image token out, in raster order of the merged grid.

Owns the math: patch projection, the learned position table resampled to the patch grid, 2-D
rotary, pre-norm blocks with non-causal attention computed a bounded block of queries at a time,
and the 2 × 2 merger. Never parses files (`vision.mmproj` hands it config and weights) and never
decodes images (`vision.preprocess`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.errors import PagelmError, UnsupportedError
from pagelm.vision.mmproj import (CHANNELS, TEMPORAL_PATCH, LayerNormWeights, VisionBlock, VisionConfig,
                                  VisionWeights, load_weights)
from pagelm.weights.loader import WeightLoader

# Scores held at once per attention call (heads × query rows × patches): 8 MiB of float32
# (SDPA holds two or three such buffers), where the full matrix of a 1080 × 720 image on the
# 2B tower would take 573 MB.
ATTENTION_BLOCK_VALUES = 1 << 21


def merge_block_positions(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch listed in merge-block order: (block_row, block_col, in_row, in_col)."""
    shape = (grid_h // merge, grid_w // merge, merge, merge)
    rows = torch.arange(grid_h).view(grid_h // merge, 1, merge, 1).expand(shape).flatten()
    cols = torch.arange(grid_w).view(1, grid_w // merge, 1, merge).expand(shape).flatten()
    return rows, cols


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(table index, weight)] of the two taps that resample `side` points to `size` points,
    align_corners=True (in float32, as transformers computes them)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    frac = src - floor
    lo = floor.long()
    return [(lo.clamp(0, side - 1), 1 - frac), ((lo + 1).clamp(0, side - 1), frac)]


def _layer_norm(x: torch.Tensor, w: LayerNormWeights, eps: float) -> torch.Tensor:
    return F.layer_norm(x, w.weight.shape, w.weight, w.bias, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (half-split) rotation of x (N, heads, head_dim) by per-patch angles (N, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_values: int) -> torch.Tensor:
    """Non-causal softmax(q·kᵀ/√d)·v over all patches, q, k, v (N, heads, head_dim) -> (N, heads·head_dim).

    Queries go a block at a time, so at most `block_values` scores exist at once whatever the
    kernel SDPA picks."""
    n, heads, head_dim = q.shape
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    k, v = k.contiguous(), v.contiguous()
    out = torch.empty(n, heads, head_dim, dtype=q.dtype)
    step = max(1, block_values // (heads * n))
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        out[lo:hi] = F.scaled_dot_product_attention(q[:, lo:hi], k, v).transpose(0, 1)
    return out.view(n, heads * head_dim)


class VisionTower:
    """The tower over weights from an mmproj file; `encode` one image at a time."""

    def __init__(self, config: VisionConfig, weights: VisionWeights):
        self.config, self.weights = config, weights
        self.attention_block_values = ATTENTION_BLOCK_VALUES
        spatial = config.head_dim // 2  # half the rotary angles follow rows, half columns
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))

    @classmethod
    def load(cls, model: WeightLoader) -> VisionTower:
        config = VisionConfig.from_loader(model)
        return cls(config, load_weights(config, model))

    def encode(self, rows: torch.Tensor | np.ndarray, grid: tuple[int, int, int]) -> torch.Tensor:
        """Image tokens (grid_h·grid_w / merge², out_hidden) float32 for the pixel rows of one image
        (grid_h·grid_w, patch_values) in merge-block order, grid = (1, grid_h, grid_w) patches."""
        c, w = self.config, self.weights
        frames, grid_h, grid_w = (int(g) for g in grid)
        rows = torch.as_tensor(rows, dtype=torch.float32)
        n = grid_h * grid_w
        if frames != 1:
            raise UnsupportedError(f"vision grid {tuple(grid)}: only still images (1 frame) are supported")
        if grid_h < 1 or grid_w < 1 or grid_h % c.merge_size or grid_w % c.merge_size:
            raise PagelmError(f"vision grid {tuple(grid)}: rows and columns must be positive multiples of "
                              f"the merge size {c.merge_size}")
        if tuple(rows.shape) != (n, c.patch_values):
            raise PagelmError(f"vision rows of shape {tuple(rows.shape)}, expected ({n}, {c.patch_values}) "
                              f"for the grid {tuple(grid)}")
        split = rows.reshape(n, CHANNELS, TEMPORAL_PATCH, -1)
        if not torch.equal(split[:, :, 0], split[:, :, 1]):
            raise UnsupportedError("vision rows whose two frames differ (video): only still images are supported")
        pixels = split[:, :, 0].reshape(n, -1)

        patch_rows, patch_cols = merge_block_positions(grid_h, grid_w, c.merge_size)
        x = F.linear(pixels, w.patch, w.patch_bias) + self._positions(patch_rows, patch_cols, grid_h, grid_w)
        cos, sin = self._rotary(patch_rows, patch_cols)
        for block in w.blocks:
            x = self._block(block, x, cos, sin)
        merged = _layer_norm(x, w.merger_norm, c.layer_norm_eps).view(-1, c.merged_hidden)
        return w.merger_down(F.gelu(w.merger_up(merged)))

    def _positions(self, rows: torch.Tensor, cols: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """The learned position_side² table resampled bilinearly (align_corners) to the patch grid."""
        side, table = self.config.position_side, self.weights.positions
        out = torch.zeros(len(rows), table.shape[1])
        for row_index, row_weight in _bilinear_taps(rows, grid_h, side):
            for col_index, col_weight in _bilinear_taps(cols, grid_w, side):
                out += (row_weight * col_weight)[:, None] * table[row_index * side + col_index]
        return out

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (N, head_dim): row angles then column angles, repeated for the two halves."""
        angles = torch.cat((rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def _block(self, b: VisionBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        n = x.shape[0]
        q, k, v = b.qkv(_layer_norm(x, b.ln1, c.layer_norm_eps)).view(n, 3, c.heads, c.head_dim).unbind(1)
        x = x + b.attn_out(attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, self.attention_block_values))
        hidden = F.gelu(b.ffn_up(_layer_norm(x, b.ln2, c.layer_norm_eps)), approximate="tanh")
        return x + b.ffn_down(hidden)
