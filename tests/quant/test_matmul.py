import gguf.quants
import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant import BLOCK_LAYOUT, DECODABLE, GGMLType, decode_bf16, decode_f32
from pagelm.quant.matmul import MAX_GEMV_ROWS, check_rows, rows_dequantize, rows_matmul

from test_head import random_table, readonly

T = GGMLType
TYPES = sorted(DECODABLE)
FLOATS = (T.F32, T.F16, T.BF16)


def widths(t: GGMLType) -> tuple[int, ...]:
    """Widths that are no multiple of any kernel step: 32-blocks not filling 256, partial 32s for floats,
    K-quant rows of 1, 2, 5 and 7 blocks."""
    if t in FLOATS:
        return 45, 577
    return (256, 512, 1280, 1792) if BLOCK_LAYOUT[t][0] == 256 else (96, 576)


def oracle(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # (MXFP4's largest scale times 12 is Inf)
        return gguf.quants.dequantize(raw, GGMLQuantizationType(t)).astype(np.float32)


def two_tensors(t: GGMLType, rows: int, width: int, seed: int, specials: bool = False):
    """(data, offsets, the rows' bytes): `rows` rows picked in a random order from two tables at odd
    byte offsets of one buffer, as a fused projection of two tensors of one file would be. With
    `specials`, half the scales of the second table are special (NaN, Inf, subnormal...)."""
    blocks = width // BLOCK_LAYOUT[t][0]
    a = random_table(t, rows, blocks, seed)
    b = random_table(t, rows + 2, blocks, seed + 1, specials)
    data = np.concatenate([np.full(5, 0xEE, np.uint8), a.reshape(-1), np.full(3, 0xEE, np.uint8), b.reshape(-1)])
    starts = np.concatenate([5 + np.arange(rows) * a.shape[1], 8 + a.size + np.arange(rows + 2) * b.shape[1]])
    pick = np.random.default_rng(seed).permutation(len(starts))[:rows]
    offsets = starts[pick].astype(np.int64)
    table = np.concatenate([a, b])[pick]
    return readonly(data), offsets, table


def assert_same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    same = got.view(np.uint32) == expected.view(np.uint32)
    assert same.all(), f"{(~same).sum()} values differ, first at {np.argwhere(~same)[0]}"


# --- rows_matmul ----------------------------------------------------------------------


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n", [1, 3, MAX_GEMV_ROWS])
def test_matmul_matches_f64_product_of_gguf_weights(t, n):
    for rows in (1, 7, 33):
        for width in widths(t):
            seed = rows * 1000 + width + n
            data, offsets, table = two_tensors(t, rows, width, seed)
            check_rows(data, t, offsets, width)
            w = oracle(table, t).astype(np.float64)
            x = np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)
            out = np.full((n, rows + 5), np.nan, np.float32)
            rows_matmul(data, t, offsets, width, x, out, out_lo=2)
            ref = x.astype(np.float64) @ w.T
            bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
            err = np.abs(out[:, 2 : 2 + rows] - ref)
            assert (err <= bound).all(), f"rows {rows} width {width}: worst err {err.max()}"
            assert np.isnan(out[:, :2]).all() and np.isnan(out[:, 2 + rows :]).all()  # only its columns



@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_multiplies_gguf_weights_exactly(t):
    """Against unit vectors each product is one weight (fma(w, 1, 0) and sums of zeros), so the
    kernels' weights must be gguf's dequantized values exactly, not merely close (-0 reads as +0)."""
    rows, width = 5, widths(t)[-1]
    data, offsets, table = two_tensors(t, rows, width, seed=int(t) + 11)
    w = oracle(table, t)
    units = np.eye(width, dtype=np.float32)
    for n in (1, 3, MAX_GEMV_ROWS):  # the one-row kernel and two pass shapes of the few-row one
        for j0 in range(0, width, n):
            x = units[j0 : j0 + n]
            out = np.empty((len(x), rows), np.float32)
            rows_matmul(data, t, offsets, width, x, out)
            assert (out == w[:, j0 : j0 + n].T).all(), f"n {n}, columns {j0}..{j0 + n}"

@pytest.mark.parametrize("t", [t for t in TYPES if t not in FLOATS], ids=lambda t: t.name)
def test_matmul_propagates_special_scales(t):
    width = widths(t)[-1]
    data, offsets, table = two_tensors(t, 33, width, seed=int(t), specials=True)
    w = oracle(table, t).astype(np.float64)
    x = np.random.default_rng(1).standard_normal((2, width)).astype(np.float32)
    out = np.empty((2, 33), np.float32)
    rows_matmul(data, t, offsets, width, x, out)
    with np.errstate(invalid="ignore"):
        ref = x.astype(np.float64) @ w.T
        bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    assert np.isnan(ref).any() and np.isfinite(ref).any()
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.array_equal(np.isinf(out), np.isinf(ref))
    finite = np.isfinite(ref)
    assert (np.abs(out[finite] - ref[finite]) <= bound[finite]).all()


def test_matmul_rows_beyond_the_prefetch_distance_and_writeable_inputs():
    t = T.Q8_0
    table = random_table(t, 301, 32, seed=3)  # 301 rows of 1,088 bytes
    offsets = (np.arange(301)[::-1] * table.shape[1]).astype(np.int64)  # backwards
    x = np.random.default_rng(3).standard_normal((1, 1024)).astype(np.float32)
    out = np.empty((1, 301), np.float32)
    rows_matmul(table.reshape(-1), t, offsets, 1024, x, out)  # writeable data, offsets and x
    w = decode_f32(table, t).astype(np.float64)[::-1]
    assert (np.abs(out[0] - w @ x[0]) <= 1e-5 * (np.abs(w) @ np.abs(x[0]))).all()


def test_matmul_rejects_bad_shapes_and_dtypes():
    data, offsets, _ = two_tensors(T.Q8_0, 4, 64, seed=1)
    x = np.zeros((1, 64), np.float32)
    out = np.zeros((1, 4), np.float32)
    for bad_x in (
        x.astype(np.float64),
        np.zeros((1, 96), np.float32),
        np.zeros((MAX_GEMV_ROWS + 1, 64), np.float32),
        np.zeros((0, 64), np.float32),
        np.zeros(64, np.float32),
        np.zeros((1, 128), np.float32)[:, ::2],
    ):
        with pytest.raises(ValueError, match="x must"):
            rows_matmul(data, T.Q8_0, offsets, 64, bad_x, out)
    for bad_out in (out.astype(np.float64), np.zeros((2, 4), np.float32), np.zeros((1, 3), np.float32),
                    np.zeros((1, 8), np.float32)[:, ::2], readonly(out)):
        with pytest.raises(ValueError, match="out must"):
            rows_matmul(data, T.Q8_0, offsets, 64, x, bad_out)
    with pytest.raises(ValueError, match="out must"):
        rows_matmul(data, T.Q8_0, offsets, 64, x, np.zeros((1, 5), np.float32), out_lo=2)
    with pytest.raises(ValueError, match="out must"):
        rows_matmul(data, T.Q8_0, offsets, 64, x, out, out_lo=-1)
    with pytest.raises(UnsupportedError, match="Q2_K"):
        rows_matmul(data, T.Q2_K, offsets, 256, np.zeros((1, 256), np.float32), out)


# --- rows_dequantize --------------------------------------------------------------------


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf_and_decode(t):
    for width in widths(t):
        data, offsets, table = two_tensors(t, 33, width, seed=width + int(t), specials=t not in FLOATS)
        f32 = np.empty((33, width), np.float32)
        rows_dequantize(data, t, offsets, width, f32)
        assert_same_bits(f32, oracle(table, t))
        assert_same_bits(f32, decode_f32(table, t))
        bf16 = np.empty((33, width), np.uint16)
        rows_dequantize(data, t, offsets, width, bf16)
        assert np.array_equal(bf16, decode_bf16(table, t))
        finite = np.isfinite(f32)
        by_torch = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(bf16[finite], by_torch[finite])


def test_dequantize_rounding_cases_are_reached():
    t = T.Q6_K
    data, offsets, table = two_tensors(t, 300, 256, seed=11, specials=True)
    f32 = decode_f32(table, t)
    bits = f32.view(np.uint32) & 0x1FFFF
    assert np.isnan(f32).any() and np.isinf(f32).any() and (bits == 0x18000).any() and (bits == 0x08000).any()
    out = np.empty((300, 256), np.uint16)
    rows_dequantize(data, t, offsets, 256, out)
    assert np.array_equal(out, decode_bf16(table, t))


@pytest.mark.parametrize("t", FLOATS, ids=lambda t: t.name)
def test_dequantize_float_types_keep_every_bit_pattern(t):
    if t == T.F32:
        bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 14, dtype=np.uint32)
        bits[:4] = [0x7F800001, 0xFFC00001, 0x00000001, 0x7F7FFFFF]  # signalling / quiet NaN, subnormal, max
    else:
        bits = np.arange(1 << 16, dtype=np.uint16)  # every fp16 / bf16 value, NaN payloads included
    table = bits.view(np.uint8).reshape(256, -1)
    width = decode_f32(table[:1], t).shape[1]
    offsets = np.arange(256, dtype=np.int64) * table.shape[1]
    f32 = np.empty((256, width), np.float32)
    rows_dequantize(readonly(table.reshape(-1)), t, offsets, width, f32)
    assert_same_bits(f32, oracle(table, t))
    bf16 = np.empty((256, width), np.uint16)
    rows_dequantize(readonly(table.reshape(-1)), t, offsets, width, bf16)
    assert np.array_equal(bf16, decode_bf16(table, t))


def test_dequantize_rejects_bad_out():
    data, offsets, _ = two_tensors(T.Q4_K, 3, 256, seed=2)
    for bad in (np.empty((3, 256), np.float64), np.empty((3, 256), np.int16), np.empty((2, 256), np.float32),
                np.empty((3, 512), np.float32)[:, ::2], readonly(np.empty((3, 256), np.uint16))):
        with pytest.raises(ValueError, match="out must"):
            rows_dequantize(data, T.Q4_K, offsets, 256, bad)


# --- check_rows -----------------------------------------------------------------------


def test_check_rows_rejects_rows_outside_data_bad_widths_and_types():
    data, offsets, table = two_tensors(T.Q5_K, 5, 512, seed=4)
    check_rows(data, T.Q5_K, offsets, 512)
    check_rows(data, int(T.Q5_K), offsets[:0], 512)
    end = data.size - table.shape[1]
    check_rows(data, T.Q5_K, np.array([end]), 512)  # the last row ends exactly at the end
    with pytest.raises(ModelFormatError, match=f"Q5_K: row 1 at byte offset {end + 1}"):
        check_rows(data, T.Q5_K, np.array([0, end + 1]), 512)  # truncated: one byte short
    with pytest.raises(ModelFormatError, match="byte offset -1"):
        check_rows(data, T.Q5_K, np.array([-1]), 512)
    with pytest.raises(ModelFormatError, match="Q5_K: a row of 384 values"):
        check_rows(data, T.Q5_K, offsets, 384)
    with pytest.raises(ModelFormatError, match="Q8_0: a row of 33 values"):
        check_rows(data, T.Q8_0, offsets, 33)
    with pytest.raises(UnsupportedError, match="IQ4_NL"):
        check_rows(data, T.IQ4_NL, offsets, 32)
    with pytest.raises(UnsupportedError):
        check_rows(data, 99, offsets, 32)
    with pytest.raises(ValueError, match="row_offsets must"):
        check_rows(data, T.Q5_K, offsets.astype(np.int32), 512)
    with pytest.raises(ValueError, match="data must"):
        check_rows(data.view(np.int8), T.Q5_K, offsets, 512)
