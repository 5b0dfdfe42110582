import llvmlite.binding as llvm
import numpy as np
import pytest
from numba import njit
from numba.core import config as numba_config

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant import BLOCK_LAYOUT, DECODABLE, GGMLType, decode_bf16, decode_f32, encode
from pagelm.quant import head
from pagelm.quant import matmul
from pagelm.quant.codegen import F16_TO_F32
from pagelm.quant.head import gather_rows_bf16, head_logits

from pagelm.quant.types import SCALE_FIELDS
from special_scales import F16_SPECIALS

T = GGMLType
DECODE_TYPES = sorted(DECODABLE)
KERNEL_TYPES = [T.Q8_0, T.Q6_K]




def random_table(t: GGMLType, rows: int, blocks: int, seed: int, specials: bool = False) -> np.ndarray:
    """Random (rows, row_nbytes) bytes with finite fp16 scales; with `specials`, half the scales special."""
    rng = np.random.default_rng(seed)
    block_values, block_bytes = BLOCK_LAYOUT[t]
    if t in (T.F32, T.F16, T.BF16):
        return encode(rng.standard_normal((rows, blocks)).astype(np.float32), t)
    raw = rng.integers(0, 256, (rows, blocks * block_bytes), dtype=np.uint8)
    b = raw.reshape(-1, block_bytes)
    if t == T.MXFP4:  # an E8M0 scale byte: 2^-10..2^2, specials the subnormal and the largest (Inf products)
        b[:, 0] = rng.integers(118, 131, len(b))
        if specials:
            pick = rng.random(len(b)) < 0.5
            b[pick, 0] = rng.choice(np.array([0, 1, 254, 255], np.uint8), pick.sum())
    for off in SCALE_FIELDS.get(t, ()):
        field = b[:, off : off + 2].view(np.uint16)[:, 0]
        field[:] = rng.uniform(-0.1, 0.1, len(b)).astype(np.float16).view(np.uint16)
        if specials:
            pick = rng.random(len(b)) < 0.5
            field[pick] = rng.choice(F16_SPECIALS, pick.sum())
    return raw


def readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def assert_close_to_f64(t: GGMLType, table: np.ndarray, x: np.ndarray, got: np.ndarray) -> None:
    w = decode_f32(table, t).astype(np.float64)
    ref = w @ x.astype(np.float64)
    bound = 1e-5 * (np.abs(w) @ np.abs(x.astype(np.float64)))
    assert got.dtype == np.float32 and got.shape == (len(table),)
    err = np.abs(got - ref)
    assert (err <= bound).all(), f"worst row {np.argmax(err - bound)}: err {err.max()}, bound {bound[np.argmax(err)]}"


# --- head_logits ----------------------------------------------------------------------


@pytest.mark.parametrize("t", DECODE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks", [(1, 1), (37, 1), (1, 3), (37, 5)])
def test_head_logits_matches_f64_reference(t, rows, blocks):
    table = random_table(t, rows, blocks, seed=rows * 100 + blocks)
    x = np.random.default_rng(blocks).standard_normal(table.shape[1] // BLOCK_LAYOUT[t][1] * BLOCK_LAYOUT[t][0])
    x = x.astype(np.float32)
    assert_close_to_f64(t, table, x, head_logits(table, t, x))


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 1001])  # the table ends before, around and after the prefetch distance
def test_head_kernel_row_counts_at_founding_dim(t, rows):
    blocks = 1024 // BLOCK_LAYOUT[t][0]
    table = readonly(random_table(t, rows, blocks, seed=rows))
    x = np.random.default_rng(rows).standard_normal(1024).astype(np.float32)
    assert_close_to_f64(t, table, x, head_logits(table, t, x))


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
def test_head_kernel_propagates_nan_and_inf_scales(t):
    table = random_table(t, 4, 2, seed=5)
    at = SCALE_FIELDS[t][0]
    table[1, at : at + 2] = np.array([0x7E00], np.uint16).view(np.uint8)  # NaN
    table[2, at : at + 2] = np.array([0x7C00], np.uint16).view(np.uint8)  # +Inf
    x = np.ones(decode_f32(table[:1], t).shape[1], np.float32)
    got = head_logits(table, t, x)
    assert np.isfinite(got[[0, 3]]).all()
    assert np.isnan(got[1]) and not np.isfinite(got[2])


def test_head_fallback_spans_chunks():
    t = T.Q4_0
    table = random_table(t, 300, 16, seed=9)  # 300 x 512 values: several chunks, the last ragged
    assert table.shape[0] * 512 > head.FALLBACK_CHUNK
    x = np.random.default_rng(9).standard_normal(512).astype(np.float32)
    assert_close_to_f64(t, table, x, head_logits(table, t, x))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q6_K, T.Q4_K], ids=lambda t: t.name)
def test_head_out_and_read_only_inputs(t):
    table = random_table(t, 9, 2, seed=3)
    x = np.random.default_rng(3).standard_normal(2 * BLOCK_LAYOUT[t][0]).astype(np.float32)
    expected = head_logits(table, t, x)
    out = np.full(9, np.nan, np.float32)
    assert head_logits(readonly(table), t, readonly(x), out=out) is out
    assert np.array_equal(out, expected)
    mapped = np.frombuffer(table.tobytes(), np.uint8).reshape(table.shape)  # read-only, like the map
    assert np.array_equal(head_logits(mapped, int(t), x.astype(np.float64)), expected)


def test_head_rejects_bad_arguments():
    table = random_table(T.Q8_0, 4, 2, seed=1)
    x = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="x must have shape"):
        head_logits(table, T.Q8_0, np.zeros(63, np.float32))
    for out in (np.zeros(4, np.float64), np.zeros(5, np.float32), np.zeros(8, np.float32)[::2], readonly(np.zeros(4, np.float32))):
        with pytest.raises(ValueError, match="out must"):
            head_logits(table, T.Q8_0, x, out=out)
    with pytest.raises(ValueError, match="table must"):
        head_logits(table[:, :34], T.Q8_0, x[:32])  # rows not contiguous
    with pytest.raises(ValueError, match="table must"):
        head_logits(table.reshape(-1), T.Q8_0, x)
    with pytest.raises(ModelFormatError):
        head_logits(table[:, :-1].copy(), T.Q8_0, x)
    with pytest.raises(UnsupportedError):
        head_logits(table, T.Q2_K, x)


# --- gather_rows_bf16 -----------------------------------------------------------------


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", [1, 4])
def test_gather_kernel_is_bit_identical_to_decode_bf16(t, blocks):
    table = readonly(random_table(t, 300, blocks, seed=blocks, specials=True))
    ids = np.random.default_rng(blocks).integers(0, 300, 500)  # unsorted, with repeats
    ids[:3] = [7, 7, 299]
    expected = decode_bf16(table[ids], t)
    f32 = decode_f32(table[ids], t)
    # The data must reach every rounding case: NaN, Inf, subnormal scales and exact ties.
    assert np.isnan(f32).any() and np.isinf(f32).any()
    assert ((f32.view(np.uint32) & 0x1FFFF) == 0x18000).any() and ((f32.view(np.uint32) & 0x1FFFF) == 0x08000).any()
    got = gather_rows_bf16(table, t, ids)
    assert got.dtype == np.uint16 and got.shape == expected.shape
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("t", DECODE_TYPES, ids=lambda t: t.name)
def test_gather_matches_decode_bf16_for_every_type(t):
    table = random_table(t, 20, 3, seed=int(t), specials=t not in (T.F32, T.F16, T.BF16))
    ids = np.array([19, 0, 5, 5, 3])
    out = np.zeros((5, decode_f32(table[:1], t).shape[1]), np.uint16)
    assert gather_rows_bf16(table, t, ids, out) is out
    assert np.array_equal(out, decode_bf16(table[ids], t))


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1], ids=lambda t: t.name)
def test_gather_ids_out_of_range_read_nothing(t):
    table = random_table(t, 10, 1, seed=2)
    out = np.full((3, 32), 0xABCD, np.uint16)
    for bad in (-1, 10, 1 << 40):
        with pytest.raises(IndexError, match=f"ids\\[1\\] = {bad}"):
            gather_rows_bf16(table, t, np.array([0, bad, 1]), out)
        assert (out == 0xABCD).all()


def test_gather_ids_forms():
    table = random_table(T.Q8_0, 10, 2, seed=4)
    expected = decode_bf16(table[[3, 1]], T.Q8_0)
    assert np.array_equal(gather_rows_bf16(table, T.Q8_0, [3, 1]), expected)
    assert np.array_equal(gather_rows_bf16(table, T.Q8_0, np.array([3, 1], np.int32)), expected)
    assert np.array_equal(gather_rows_bf16(table, T.Q8_0, readonly(np.array([3, 1]))), expected)
    assert gather_rows_bf16(table, T.Q8_0, np.zeros(0, np.int64)).shape == (0, 64)
    with pytest.raises(ValueError, match="ids must be 1-D"):
        gather_rows_bf16(table, T.Q8_0, np.array([[3]]))
    with pytest.raises(ValueError, match="out must"):
        gather_rows_bf16(table, T.Q8_0, [3], np.zeros((1, 64), np.int16))


# --- codegen ------------------------------------------------------------------------


@pytest.mark.skipif(
    numba_config.CPU_NAME is not None
    or numba_config.CPU_FEATURES is not None
    or "+avx512f" not in llvm.get_host_cpu_features().flatten(),
    reason="needs numba compiling for an AVX-512 host",
)
def test_gemv_kernel_gets_512_bit_vectors():
    # A fresh, uncached compile, so that its assembly can be read; without the function
    # attribute that _wide_vectors sets, LLVM splits each 16-lane accumulator in two ymm registers.
    mv = njit(parallel=True)(matmul._KERNELS[T.Q6_K][0][0].py_func)
    table = readonly(random_table(T.Q6_K, 2, 1, seed=0))
    mv(table.reshape(-1), readonly(np.zeros(0, np.int64)), table.shape[1], 2, readonly(np.zeros((1, 256), np.float32)),
       F16_TO_F32, np.zeros((1, 2), np.float32), 0, 256, 1)
    assert "zmm" in "".join(mv.inspect_asm().values())
