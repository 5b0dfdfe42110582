"""FastFlowLM tiles: the numpy decoder and the kernels against a float64 reference written
straight from the layout in shared/design/formats.md (odd shapes: 3 groups × 2 column tiles,
rows in any order), and the repacking of GGML blocks against gguf.quants (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from pagelm.errors import ModelFormatError
from pagelm.quant import GGMLType, encode, f32_to_bf16
from pagelm.quant.matmul import MAX_GEMV_ROWS
from pagelm.quant.tiles import (TILE_BYTES, TileKind, check_tiles, decode_groups, group_steps, pack_groups,
                                tile_dequantize, tile_matmul)
from pagelm.tools.synth import bf16_scales

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

GROUPS, COL_TILES = 3, 2


def _bf16(raw: np.ndarray, at: int) -> float:
    return float(np.array([int(raw[at]) | int(raw[at + 1]) << 8], np.uint32).__lshift__(16).view(np.float32)[0])


def reference(tile: np.ndarray, kind: TileKind) -> np.ndarray:
    """The (32, 256) float64 values of one tile, element by element."""
    out = np.zeros((32, 256))
    for r in range(32):
        for c in range(256):
            kb = c // 32
            if kind in (TileKind.Q8, TileKind.Q8_V102):
                at = 512 + c * 32 + r if kind == TileKind.Q8 else 512 + (r // 16) * 4096 + c * 16 + r % 16
                out[r, c] = _bf16(tile, 2 * (kb * 32 + r)) * int(tile[at].astype(np.int8))
            elif kind == TileKind.Q4_1:
                q = (int(tile[1024 + c * 16 + r // 2]) >> (4 * (r % 2))) & 15
                out[r, c] = q * _bf16(tile, 2 * (kb * 32 + r)) + _bf16(tile, 512 + 2 * (kb * 32 + r))
            else:
                q = (int(tile[512 + c * 16 + r // 2]) >> (4 * (r % 2))) & 15
                scale = _bf16(tile, 4608 + 2 * r) * int(tile[kb * 32 + r])
                out[r, c] = scale * q - _bf16(tile, 4672 + 2 * r) * int(tile[256 + kb * 32 + r])
    return out


def random_tiles(kind: TileKind, seed: int = 0) -> np.ndarray:
    """Random bytes, with every bf16 field a finite value of a plausible size."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (GROUPS, COL_TILES, TILE_BYTES[kind]), np.uint8)
    fields = {TileKind.Q4_1: [(0, 512), (512, 1024)], TileKind.Q4_K: [(4608, 4672), (4672, 4736)]}.get(kind, [(0, 512)])
    for lo, hi in fields:
        values = rng.uniform(-0.05, 0.05, (GROUPS, COL_TILES, (hi - lo) // 2)).astype(np.float32)
        raw[..., lo:hi] = f32_to_bf16(values).view(np.uint8)
    return raw


@pytest.fixture(scope="module", params=list(TileKind), ids=lambda k: k.name)
def tiles(request):
    kind = request.param
    raw = random_tiles(kind, seed=int(kind))
    ref = np.block([[reference(raw[g, u], kind) for u in range(COL_TILES)] for g in range(GROUPS)])
    return kind, raw, ref


def test_numpy_decoder_matches_the_float64_reference(tiles):
    kind, raw, ref = tiles
    got = decode_groups(raw, kind)
    assert got.shape == ref.shape == (GROUPS * 32, COL_TILES * 256)
    assert np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()


def test_row_kernel_gives_the_decoder_bits_in_any_row_order(tiles):
    kind, raw, _ = tiles
    data = np.concatenate((np.zeros(7, np.uint8), raw.reshape(-1)))  # tiles at an odd byte offset
    rows = np.array([95, 0, 33, 33, 64, 31, 1], np.int64)
    values = decode_groups(raw, kind)
    f32 = np.empty((len(rows), COL_TILES * 256), np.float32)
    tile_dequantize(data, kind, 7, GROUPS, COL_TILES, rows, f32)
    assert np.array_equal(f32.view(np.uint32), values[rows].view(np.uint32))  # bit for bit, signed zeros too
    bf16 = np.empty_like(f32, dtype=np.uint16)
    tile_dequantize(data, kind, 7, GROUPS, COL_TILES, rows, bf16)
    assert np.array_equal(bf16, f32_to_bf16(values[rows]))


@pytest.mark.parametrize("n", [1, 3, 8])
def test_matmul_kernel_matches_the_float64_reference(tiles, n):
    kind, raw, ref = tiles
    x = np.random.default_rng(n).standard_normal((n, COL_TILES * 256)).astype(np.float32)
    out = np.empty((n, GROUPS * 32), np.float32)
    tile_matmul(raw.reshape(-1), kind, 0, GROUPS, COL_TILES, x, out)
    expected = x.astype(np.float64) @ ref.T
    assert np.abs(out - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("ggml_type,kind", [(GGMLType.Q8_0, TileKind.Q8), (GGMLType.Q4_1, TileKind.Q4_1)],
                         ids=lambda v: v.name)
def test_steps_are_the_blocks_scales(ggml_type, kind):
    values = np.random.default_rng(3).standard_normal((32, 512)).astype(np.float32)
    raw = bf16_scales(encode(values, ggml_type), ggml_type)
    d = raw.reshape(32, 16, -1)[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed, _ = pack_groups(raw, ggml_type, kind)
    assert np.array_equal(group_steps(packed, kind), np.abs(d))


PACKED = {GGMLType.Q8_0: [TileKind.Q8, TileKind.Q8_V102], GGMLType.Q4_1: [TileKind.Q4_1], GGMLType.Q4_K: [TileKind.Q4_K]}


@pytest.mark.parametrize("ggml_type,kind", [(t, k) for t, kinds in PACKED.items() for k in kinds],
                         ids=lambda v: v.name)
@pytest.mark.parametrize("n_rows", [7, 45, 64])
def test_ggml_blocks_repack_to_tiles_of_the_same_values(ggml_type, kind, n_rows):
    values = np.random.default_rng(n_rows).standard_normal((n_rows, 512)).astype(np.float32) * np.float32(0.05)
    raw = bf16_scales(encode(values, ggml_type), ggml_type)
    oracle = gguf_quants.dequantize(raw, GGMLQuantizationType(int(ggml_type))).reshape(n_rows, 512)
    packed, rounded = pack_groups(raw, ggml_type, kind)
    assert rounded == 0 and packed.shape == (-(-n_rows // 32), 2, TILE_BYTES[kind])
    decoded = decode_groups(packed, kind)
    assert np.array_equal(decoded[:n_rows], oracle)
    assert np.array_equal(decoded[n_rows:], oracle[np.arange(n_rows, len(decoded)) % n_rows])  # padding repeats rows


def test_scales_bf16_cannot_hold_are_counted():
    raw = encode(np.random.default_rng(1).standard_normal((32, 256)).astype(np.float32), GGMLType.Q8_0)
    _, rounded = pack_groups(raw, GGMLType.Q8_0, TileKind.Q8)
    assert rounded > 0


def test_bounds_are_checked_before_any_kernel_reads():
    data = np.zeros(TILE_BYTES[TileKind.Q4_1] * 6, np.uint8)
    check_tiles(data, TileKind.Q4_1, 0, 3, 2)
    for base, groups, col_tiles in [(1, 3, 2), (0, 4, 2), (-1, 1, 1), (0, 0, 1)]:
        with pytest.raises(ModelFormatError, match="outside"):
            check_tiles(data, TileKind.Q4_1, base, groups, col_tiles)
    with pytest.raises(ValueError, match="row ids"):
        tile_dequantize(data, TileKind.Q4_1, 0, 3, 2, np.array([96]), np.empty((1, 512), np.float32))
    with pytest.raises(ModelFormatError, match="5120 bytes"):
        decode_groups(np.zeros((1, 1, 4736), np.uint8), TileKind.Q4_1)
    with pytest.raises(ValueError, match="x must"):
        rows = MAX_GEMV_ROWS + 1
        tile_matmul(data, TileKind.Q4_1, 0, 3, 2, np.zeros((rows, 512), np.float32), np.empty((rows, 96), np.float32))
