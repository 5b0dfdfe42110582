"""The batched GEMVs give each activation row the bits the one-row kernel gives it alone, for every
block type and every batch size up to MAX_GEMV_ROWS, and stay close to a float64 reference."""

import numpy as np
import pytest

from pagelm.quant import DECODABLE, GGMLType, decode_f32
from pagelm.quant.head import MAX_HEAD_ROWS, head_logits
from pagelm.quant.matmul import MAX_GEMV_ROWS, check_rows, rows_matmul

from test_head import random_table, readonly
from test_matmul import assert_same_bits, oracle, two_tensors, widths

TYPES = sorted(DECODABLE)


def one_row_products(data, t, offsets, width, x):
    out = np.empty((len(x), len(offsets)), np.float32)
    for i in range(len(x)):
        rows_matmul(data, t, offsets, width, x[i : i + 1], out[i : i + 1])
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_batch_size_gives_each_row_its_one_row_bits(t):
    rows, width = 37, widths(t)[-1]
    data, offsets, table = two_tensors(t, rows, width, seed=int(t) + 7)
    check_rows(data, t, offsets, width)
    # rows of very different magnitudes, so a mixed-up lane or order would show
    x = np.random.default_rng(int(t)).standard_normal((MAX_GEMV_ROWS, width)).astype(np.float32)
    x *= np.logspace(-3, 3, MAX_GEMV_ROWS, dtype=np.float32)[:, None]
    alone = one_row_products(data, t, offsets, width, x)
    w = oracle(table, t).astype(np.float64)
    for n in range(1, MAX_GEMV_ROWS + 1):
        out = np.full((n, rows + 3), np.nan, np.float32)
        rows_matmul(data, t, offsets, width, x[:n], out, out_lo=1)
        assert_same_bits(out[:, 1 : 1 + rows], alone[:n])
        assert np.isnan(out[:, 0]).all() and np.isnan(out[:, 1 + rows :]).all()
    ref = x.astype(np.float64) @ w.T
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)
    assert (np.abs(alone - ref) <= bound).all()


@pytest.mark.parametrize("t", [GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.F16], ids=lambda t: t.name)
def test_odd_widths_and_special_scales_keep_one_row_bits(t):
    for width in widths(t):
        data, offsets, _ = two_tensors(t, 9, width, seed=width, specials=t != GGMLType.F16)
        x = np.random.default_rng(width).standard_normal((MAX_GEMV_ROWS, width)).astype(np.float32)
        alone = one_row_products(data, t, offsets, width, x)
        for n in (2, 5, 7, MAX_GEMV_ROWS):  # passes of one group, of groups of different sizes
            out = np.empty((n, 9), np.float32)
            rows_matmul(data, t, offsets, width, x[:n], out)
            assert_same_bits(out, alone[:n])


# --- the output head ------------------------------------------------------------------


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.BF16, GGMLType.F16], ids=lambda t: t.name)
def test_head_logits_of_several_states_are_each_states_own_bits(t):
    rows, blocks = 41, 3 if t in (GGMLType.Q8_0, GGMLType.Q6_K) else 96
    table = readonly(random_table(t, rows, blocks, seed=int(t)))
    dim = decode_f32(table[:1], t).shape[1]
    x = np.random.default_rng(int(t)).standard_normal((MAX_HEAD_ROWS, dim)).astype(np.float32)
    x *= np.logspace(-2, 2, MAX_HEAD_ROWS, dtype=np.float32)[:, None]
    alone = np.stack([head_logits(table, t, x[i]) for i in range(MAX_HEAD_ROWS)])
    w = decode_f32(table, t).astype(np.float64)
    ref = x.astype(np.float64) @ w.T
    assert (np.abs(alone - ref) <= 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T)).all()
    for n in range(1, MAX_HEAD_ROWS + 1):
        assert_same_bits(head_logits(table, t, x[:n]), alone[:n])


def test_head_logits_rejects_too_many_states():
    table = random_table(GGMLType.Q8_0, 3, 1, seed=0)
    with pytest.raises(ValueError, match="1 <= n <= 16"):
        head_logits(table, GGMLType.Q8_0, np.zeros((MAX_HEAD_ROWS + 1, 32), np.float32))
