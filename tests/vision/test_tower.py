"""The vision tower against transformers' `Qwen3_5VisionModel` in float32: a tiny random tower
converted into an mmproj GGUF (llama.cpp's names, F32 and F16), pagelm's own random towers read
into transformers by gguf-py (tiny and the real 0.8B geometry), mapped and dense weights, the
blocked attention, and bf16 matmuls."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from pagelm.errors import PagelmError, UnsupportedError
from pagelm.quant import GGMLType
from pagelm.tools.synth_tower import SHAPES, write_mmproj
from pagelm.vision import VisionTower, preprocess
from pagelm.vision.tower import attention
from pagelm.weights.loader import WeightLoader

transformers = pytest.importorskip("transformers")
from vision_hf import gguf_to_hf, hf_config, hf_encode, hf_to_gguf, random_hf_model  # noqa: E402

REL_TOL = 1e-4
TINY = SHAPES["qwen3.5-tiny"]


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _rows(width: int, height: int, seed: int = 0, max_tokens: int = 1024):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return preprocess(out.getvalue(), max_tokens=max_tokens)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random transformers tower and its mmproj files (F32 and F16 matrices)."""
    model = random_hf_model(TINY, seed=0)
    values = hf_to_gguf(model)
    root = tmp_path_factory.mktemp("mmproj")
    paths = {}
    for matrix_type in (GGMLType.F32, GGMLType.F16):
        paths[matrix_type] = str(root / f"tiny-{matrix_type.name}.gguf")
        write_mmproj(paths[matrix_type], TINY, values=values, matrix_type=matrix_type)
    return model, paths


@pytest.mark.parametrize("matrix_type", [GGMLType.F32, GGMLType.F16], ids=["F32", "F16"])
@pytest.mark.parametrize("size", [(720, 1080), (64, 64), (333, 517), (1, 150)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_converted_tower_matches_transformers(converted, matrix_type, size):
    model, paths = converted
    pixels = _rows(*size)
    ours = VisionTower.load(WeightLoader.open(paths[matrix_type])).encode(pixels.rows, pixels.grid)
    ref = hf_encode(model, pixels.rows, pixels.grid)
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape == (pixels.tokens, TINY.out_hidden)
    assert _rel(ours, ref) <= REL_TOL
    assert ref.std(axis=0).mean() > 0.1 * ref.std()  # tokens differ from each other: a real test


def test_blocked_attention_matches_transformers(converted):
    """1080 × 720 (2,992 patches) with blocks of a few query rows: many blocks, one answer."""
    model, paths = converted
    pixels = _rows(720, 1080)
    tower = VisionTower.load(WeightLoader.open(paths[GGMLType.F32]))
    tower.attention_block_values = TINY.heads * 2992 * 100  # 100 query rows per block, the last one short
    assert _rel(tower.encode(pixels.rows, pixels.grid), hf_encode(model, pixels.rows, pixels.grid)) <= REL_TOL


def test_attention_blocks_equal_one_block():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(301, 3, 16, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1).reshape(301, 48)
    for block_values in (3 * 301 * 13, 3 * 301 * 300, 1 << 30):  # 24 blocks, 2, 1
        assert torch.allclose(attention(q, k, v, block_values), full, rtol=0, atol=1e-6)


def test_dense_and_mapped_weights_agree(converted):
    _, paths = converted
    pixels = _rows(200, 300)
    outs = [VisionTower.load(WeightLoader.open(paths[GGMLType.F16], weights=mode)).encode(pixels.rows, pixels.grid)
            for mode in ("mapped", "dense")]
    assert torch.equal(outs[0], outs[1])


def test_bf16_matmuls_stay_close(converted):
    model, paths = converted
    pixels = _rows(300, 200)
    tower = VisionTower.load(WeightLoader.open(paths[GGMLType.F16], dtype=torch.bfloat16))
    ours = tower.encode(pixels.rows, pixels.grid)
    assert ours.dtype == torch.float32
    assert _rel(ours, hf_encode(model, pixels.rows, pixels.grid)) <= 3e-2


@pytest.mark.parametrize("shape", ["qwen3.5-tiny-k", "qwen3.5-0.8b"])
def test_random_tower_matches_transformers(tmp_path, shape):
    """pagelm's own random tower (F16, as llama.cpp ships them), read into transformers by gguf-py:
    the real 0.8B geometry (12 blocks of 768, 12 heads) on a 320 × 240 image."""
    config = SHAPES[shape]
    path = str(tmp_path / "mmproj.gguf")
    write_mmproj(path, config, seed=3)
    model = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(hf_config(config)).eval()
    gguf_to_hf(path, model)
    pixels = _rows(320, 240, seed=1)
    ours = VisionTower.load(WeightLoader.open(path)).encode(pixels.rows, pixels.grid)
    ref = hf_encode(model, pixels.rows, pixels.grid)
    assert tuple(ours.shape) == (pixels.tokens, config.out_hidden) == (80, config.out_hidden)
    assert _rel(ours, ref) <= REL_TOL
    # numerically healthy: finite, tokens distinct, at the scale of the synthetic text embeddings
    assert np.isfinite(ref).all() and 0.05 < ref.std() < 1.0
    assert ref.std(axis=0).mean() > 0.3 * ref.std()


def test_bad_rows_and_grids_raise(converted):
    _, paths = converted
    tower = VisionTower.load(WeightLoader.open(paths[GGMLType.F32]))
    pixels = _rows(64, 64)
    with pytest.raises(PagelmError, match="expected \\(256, 1536\\)"):
        tower.encode(pixels.rows[:-1], pixels.grid)
    with pytest.raises(PagelmError, match="multiples of the merge size 2"):
        tower.encode(pixels.rows, (1, 15, 17))
    with pytest.raises(UnsupportedError, match="1 frame"):
        tower.encode(pixels.rows, (2, 8, 16))
    video = pixels.rows.copy().reshape(256, 3, 2, 256)
    video[:, :, 1] += 0.25
    with pytest.raises(UnsupportedError, match="two frames differ"):
        tower.encode(video.reshape(256, 1536), pixels.grid)
