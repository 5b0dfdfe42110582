"""The opt-in int8-activation GEMV: against a float64 product of gguf-dequantized weights and of the
activations it quantized, and its distance from the exact product bounded by the rounding of x."""

import numpy as np
import pytest

from pagelm.errors import UnsupportedError
from pagelm.quant import BLOCK_LAYOUT, GGMLType
from pagelm.quant.int8dot import (GROUP, INT8_TYPES, K_GROUP, K_TYPES, Int8Rows, available, bound_rows_matmul_int8,
                                  bound_table_matmul_int8)
from pagelm.quant.matmul import MAX_GEMV_ROWS
from pagelm.quant.matmul import check_rows

from test_head import random_table
from test_matmul import oracle, two_tensors, widths

TYPES = sorted(INT8_TYPES)
pytestmark = pytest.mark.skipif(not available(), reason="the int8 kernels need AVX2")


def product(t, rows, width, seed, x):
    data, offsets, table = two_tensors(t, rows, width, seed)
    check_rows(data, t, offsets, width)
    row = Int8Rows(x[None])
    out = np.full((1, rows + 5), np.nan, np.float32)
    bound_rows_matmul_int8(data, t, offsets, width)(row, out, 2)
    assert np.isnan(out[0, :2]).all() and np.isnan(out[0, 2 + rows :]).all()  # only its columns
    return out[0, 2 : 2 + rows], oracle(table, t).astype(np.float64), row


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_int8_matmul_matches_f64_product_of_its_operands(t):
    for rows in (1, 7, 33):  # fewer rows than threads, and not a multiple of any step
        for width in widths(t):
            seed = 10 * rows + width
            x = np.random.default_rng(seed).standard_normal(width).astype(np.float32)
            got, w, row = product(t, rows, width, seed, x)
            xq = row.dequantized(t)[0].astype(np.float64)
            ref = w @ xq
            bound = 1e-5 * (np.abs(w) @ np.abs(xq))
            err = np.abs(got - ref)
            assert (err <= bound).all(), f"rows {rows} width {width}: worst err {err.max()}"


def int8_outputs() -> dict:
    """Every INT8_TYPE's GEMV over odd shapes (7 and 33 rows, widths() wide), activations over four
    decades: {"TYPE rows width": out}. tests/quant/test_avx2_kernels.py compares the AVX2 code's bits
    with the host's (AVX-512 VNNI where it has it)."""
    outs = {}
    for t in TYPES:
        for rows in (7, 33):
            for width in widths(t):
                seed = 3 * rows + width
                x = np.random.default_rng(seed).standard_normal(width) * np.geomspace(0.01, 100, width)
                outs[f"{t.name} {rows} {width}"] = product(t, rows, width, seed, x.astype(np.float32))[0]
    return outs


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_int8_matmul_is_within_the_rounding_of_its_activations(t):
    width = widths(t)[1]
    x = (np.random.default_rng(4).standard_normal(width) * np.linspace(0.01, 10, width)).astype(np.float32)
    got, w, row = product(t, 33, width, 4, x)
    exact = w @ x.astype(np.float64)
    # each activation moved by at most half its group's step (256 values a group under the K-quants)
    steps, group = (row.kd[0], K_GROUP) if t in K_TYPES else (row.xd[0], GROUP)
    half_step = np.repeat(steps.astype(np.float64), group) / 2
    bound = np.abs(w) @ half_step * (1 + 1e-5) + 1e-5 * (np.abs(w) @ np.abs(x.astype(np.float64)))
    assert (np.abs(got - exact) <= bound).all()


def _nearest_steps(group: int, values: str, scales: str) -> tuple:
    """An Int8Rows of one row of 3 to 7 groups of `group` values over five decades, the second all zeros, the third's maximum
    negative: checks that its `values` are each its group's nearest step of amax / 127 (`scales`); returns (q, row)."""
    rng = np.random.default_rng(group)
    x = (rng.standard_normal(7 * GROUP) * rng.uniform(0.001, 100, 7 * GROUP)).astype(np.float32)
    x = np.resize(x, max(3, 7 * GROUP // group) * group)
    x[group : 2 * group] = 0  # a group of zeros: scale 0, values 0
    x[2 * group + 5] = -1e4  # a group whose maximum is negative
    row = Int8Rows(x[None])
    values, scales = getattr(row, values)[0], getattr(row, scales)[0]
    groups = x.reshape(-1, group).astype(np.float64)
    assert np.allclose(scales, np.abs(groups).max(axis=1) / 127, rtol=1e-6) and scales[1] == 0
    q = values.reshape(-1, group).astype(np.int64)
    assert np.abs(q).max() <= 127 and (q[1] == 0).all() and q[2, 5] == -127
    assert (np.abs(q * scales[:, None] - groups) <= scales[:, None] * (0.5 + 1e-4)).all()
    return q, row


def test_activation_rows_quantize_to_the_nearest_step():
    q, row = _nearest_steps(GROUP, "xq", "xd")
    assert np.array_equal(row.xs[0], q.reshape(-1, 16).sum(axis=1))
    assert np.allclose(row.xm[0], row.xd[0] * q.sum(axis=1), rtol=1e-6)


def test_k_quant_activations_quantize_to_the_nearest_step_of_their_256():
    q, row = _nearest_steps(K_GROUP, "kq", "kd")
    assert np.array_equal(row.k16[0], q.reshape(-1, 16).sum(axis=1))
    assert np.array_equal(row.k32[0], q.reshape(-1, 32).sum(axis=1))
    assert Int8Rows(np.ones((1, 96), np.float32)).kq.shape == (1, 0)  # no K-quant row is 96 wide


def test_int8_rows_are_whole_groups_and_types_quantized():
    with pytest.raises(ValueError, match="whole number of 32-value groups"):
        Int8Rows(np.zeros((1, 48), np.float32))
    with pytest.raises(ValueError, match=f"1 to {MAX_GEMV_ROWS} rows"):
        Int8Rows(np.zeros((MAX_GEMV_ROWS + 1, 32), np.float32))
    with pytest.raises(UnsupportedError, match="no int8-activation kernel for GGML type F16"):
        bound_rows_matmul_int8(np.zeros(64, np.uint8), GGMLType.F16, np.zeros(1, np.int64), 32)


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q6_K], ids=lambda t: t.name)
def test_int8_table_matmul_covers_every_row(t):
    rows, width = 1001, 768  # rows: no multiple of the threads' chunks or of the hints' distance
    table = random_table(t, rows, width // BLOCK_LAYOUT[t][0], seed=9)
    x = np.random.default_rng(9).standard_normal(width).astype(np.float32)
    row = Int8Rows(x[None])
    out = np.full((1, rows), np.nan, np.float32)
    bound_table_matmul_int8(table, t)(row, out, 0)
    w = oracle(table, t).astype(np.float64)
    xq = row.dequantized(t)[0].astype(np.float64)
    assert (np.abs(out[0] - w @ xq) <= 1e-5 * (np.abs(w) @ np.abs(xq))).all()


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_few_rows_at_once_are_each_the_row_alone_bit_for_bit(t):
    """Rows of activations over four decades, the weights read once for all: every row's bits are its
    call alone (batched decode and verify passes rest on it), for offsets and for a table."""
    for n, rows in ((2, 7), (5, 33), (MAX_GEMV_ROWS, 9)):
        width = widths(t)[-1]
        data, offsets, _ = two_tensors(t, rows, width, n)
        mv = bound_rows_matmul_int8(data, t, offsets, width)
        x = (np.random.default_rng(n).standard_normal((n, width)) * np.geomspace(0.01, 100, width)).astype(np.float32)
        together = np.full((n, rows + 3), np.nan, np.float32)
        mv(Int8Rows(x), together, 3)
        assert np.isnan(together[:, :3]).all()
        for i in range(n):
            alone = np.empty((1, rows + 3), np.float32)
            mv(Int8Rows(x[i : i + 1]), alone, 3)
            assert np.array_equal(together[i, 3:], alone[0, 3:]), (n, i)
    table = random_table(t, 101, width // BLOCK_LAYOUT[t][0], seed=2)
    head = bound_table_matmul_int8(table, t)
    together = np.empty((3, 101), np.float32)
    head(Int8Rows(x[:3]), together, 0)
    for i in range(3):
        alone = np.empty((1, 101), np.float32)
        head(Int8Rows(x[i : i + 1]), alone, 0)
        assert np.array_equal(together[i], alone[0])
