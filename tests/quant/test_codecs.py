import struct

import gguf.quants
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant import (
    BLOCK_LAYOUT,
    DECODABLE,
    ENCODABLE,
    K_QUANTS,
    GGMLType,
    bf16_to_f32,
    decode_bf16,
    decode_f32,
    encode,
    f32_to_bf16,
)
from pagelm.quant import codecs
from pagelm.quant.types import SCALE_FIELDS
from special_scales import F16_SPECIALS

T = GGMLType



F32_SPECIALS = np.array(
    [
        0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
        0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000000, 0x80000000,
    ],
    np.uint32,
)  # fmt: skip


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    same = bits(a) == bits(b)
    assert same.all(), f"{(~same).sum()} differ, first at {np.argwhere(~same)[0]}"


def random_raw(t: GGMLType, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes for `rows` rows of `blocks` blocks; every scale field gets special values."""
    rng = np.random.default_rng(seed)
    block_bytes = BLOCK_LAYOUT[t][1]
    raw = rng.integers(0, 256, (rows, blocks * block_bytes), dtype=np.uint8)
    if t in (T.F32, T.F16, T.BF16):
        specials = F32_SPECIALS if t == T.F32 else F16_SPECIALS
        flat = raw.reshape(-1).view(specials.dtype)
        flat[: len(specials)] = specials
        return raw
    b = raw.reshape(-1, block_bytes)
    for off in SCALE_FIELDS.get(t, ()):  # MXFP4's E8M0 scale: every byte is special enough (0, 1, 255)
        field = b[:, off : off + 2].view(np.uint16)[:, 0]
        # Half the blocks get a special scale, drawn independently per field, so that
        # e.g. a NaN d meets a NaN m in the same block.
        special = rng.random(len(b)) < 0.5
        field[special] = rng.choice(F16_SPECIALS, special.sum())
        field[~special] &= 0x3FFF  # finite, modest scales for the rest
    return raw


def oracle(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return gguf.quants.dequantize(raw, GGMLQuantizationType(t))


DECODE_TYPES = sorted(DECODABLE)


@pytest.mark.parametrize("t", DECODE_TYPES, ids=lambda t: t.name)
def test_decode_f32_is_bit_exact_with_gguf(t):
    blocks = 4 if BLOCK_LAYOUT[t][0] > 1 else 96
    raw = random_raw(t, rows=40, blocks=blocks, seed=int(t))
    assert_same_bits(decode_f32(raw, t), oracle(raw, t))


@pytest.mark.parametrize("t", DECODE_TYPES, ids=lambda t: t.name)
def test_decode_one_row_and_out(t):
    raw = random_raw(t, rows=3, blocks=8, seed=100 + int(t))
    expected = oracle(raw, t)

    row = decode_f32(raw[1], t)
    assert row.ndim == 1
    assert_same_bits(row, expected[1])

    out = np.full(expected.shape, 7.0, np.float32)
    assert decode_f32(raw, t, out=out) is out
    assert_same_bits(out, expected)

    out16 = np.empty(expected.shape[1], np.uint16)
    assert decode_bf16(raw[2], t, out=out16) is out16
    assert np.array_equal(out16, decode_bf16(raw, t)[2])


@pytest.mark.parametrize("t", DECODE_TYPES, ids=lambda t: t.name)
def test_decode_bf16_matches_gguf_bf16_rounding(t):
    raw = random_raw(t, rows=20, blocks=4, seed=200 + int(t))
    got = decode_bf16(raw, t)
    assert got.dtype == np.uint16
    if t == T.BF16:
        assert np.array_equal(got, raw.view(np.uint16))  # stored bits pass through
    else:
        # gguf's BF16 quantizer is a port of ggml's fp32 -> bf16, NaN handling included.
        expected = gguf.quants.quantize(oracle(raw, t), GGMLQuantizationType.BF16)
        assert np.array_equal(got, expected.view(np.uint16))


def test_decode_bf16_many_rows_crosses_chunks(monkeypatch):
    raw = random_raw(T.Q6_K, rows=37, blocks=2, seed=3)
    expected = f32_to_bf16(oracle(raw, T.Q6_K))
    for chunk in (100, 512 * 5, 1 << 16):  # a row per chunk, a ragged last chunk, one chunk
        monkeypatch.setattr(codecs, "_BF16_CHUNK", chunk)
        assert np.array_equal(decode_bf16(raw, T.Q6_K), expected), chunk


def test_decode_never_writes_raw_and_accepts_strided_rows():
    buf = random_raw(T.Q4_K, rows=6, blocks=3, seed=4)
    before = buf.copy()
    ro = buf[::2, : 2 * 144]  # read-only rows that are not adjacent in memory
    ro.flags.writeable = False
    assert_same_bits(decode_f32(ro, T.Q4_K), oracle(np.ascontiguousarray(ro), T.Q4_K))
    decode_bf16(ro, T.Q4_K)
    assert np.array_equal(buf, before)

    frozen = np.frombuffer(before.tobytes(), np.uint8).reshape(before.shape)
    assert_same_bits(decode_f32(frozen, T.Q4_K), oracle(before, T.Q4_K))


def test_decode_empty():
    assert decode_f32(np.zeros((0, 34), np.uint8), T.Q8_0).shape == (0, 32)
    assert decode_bf16(np.zeros((2, 0), np.uint8), T.Q8_0).shape == (2, 0)


# --- bf16 --------------------------------------------------------------------------


def bf16_reference(u: int) -> int:
    """bf16 bits of the float32 with bits `u`, from exact distances (Python floats)."""
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x0040
    x = struct.unpack("<f", struct.pack("<I", u))[0]
    lo = u >> 16  # truncation toward zero; lo + 1 is the next bf16 away from zero
    hi = lo + 1

    def value(b):  # the bf16 one step past max finite acts as 2**128 when rounding
        if b & 0x7FFF == 0x7F80:
            return float(2**128) * (-1 if b & 0x8000 else 1)
        return struct.unpack("<f", struct.pack("<I", b << 16))[0]

    if u & 0xFFFF == 0 or x in (float("inf"), float("-inf")):
        return lo
    d_lo, d_hi = abs(x - value(lo)), abs(value(hi) - x)  # exact in double
    if d_lo != d_hi:
        return lo if d_lo < d_hi else hi
    return lo if lo % 2 == 0 else hi


BF16_EDGES = {
    0x3F808000: 0x3F80,  # tie, even below: stays
    0x3F818000: 0x3F82,  # tie, odd below: up
    0x3F808001: 0x3F81,  # just over half
    0x3F807FFF: 0x3F80,  # just under half
    0x7F7F0000: 0x7F7F,  # max finite bf16
    0x7F7F8000: 0x7F80,  # tie above max finite bf16 -> Inf
    0x7F7FFFFF: 0x7F80,  # max finite f32 -> Inf
    0xFF7FFFFF: 0xFF80,
    0x7F800000: 0x7F80,
    0xFF800000: 0xFF80,
    0x7FC00000: 0x7FC0,
    0xFFC00000: 0xFFC0,
    0x7F800001: 0x7FC0,  # signalling NaN with a low payload: stays NaN, quiet
    0xFF812345: 0xFFC1,
    0x7FFFFFFF: 0x7FFF,
    0x00000001: 0x0000,  # subnormals
    0x00008000: 0x0000,
    0x00018000: 0x0002,
    0x807FFFFF: 0x8080,  # largest negative subnormal rounds to the smallest normal
    0x80000000: 0x8000,  # -0.0
}


def test_f32_to_bf16_edges():
    u = np.array(list(BF16_EDGES), np.uint32)
    got = f32_to_bf16(u.view(np.float32))
    assert [hex(v) for v in got] == [hex(v) for v in BF16_EDGES.values()]
    assert [hex(bf16_reference(int(v))) for v in u] == [hex(v) for v in BF16_EDGES.values()]


def test_f32_to_bf16_random_against_reference():
    rng = np.random.default_rng(5)
    u = np.concatenate(
        [
            rng.integers(0, 2**32, 3000, dtype=np.uint32),
            # low halves near the tie point, where rounding is decided
            (rng.integers(0, 2**16, 1000, dtype=np.uint32) << 16)
            | rng.integers(0x7FFE, 0x8002, 1000, dtype=np.uint32),
        ]
    )
    got = f32_to_bf16(u.view(np.float32).reshape(2, -1)).reshape(-1)
    assert got.tolist() == [bf16_reference(int(v)) for v in u]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20))
def test_f32_to_bf16_property(words):
    u = np.array(words, np.uint32)
    assert f32_to_bf16(u.view(np.float32)).tolist() == [bf16_reference(w) for w in words]


def test_bf16_to_f32_is_exact_and_inverts():
    b = np.arange(2**16, dtype=np.uint16)
    f = bf16_to_f32(b)
    assert f.dtype == np.float32
    assert np.array_equal(f.view(np.uint32), b.astype(np.uint32) << 16)
    back = f32_to_bf16(f)
    nan = (b & 0x7FFF) > 0x7F80
    assert np.array_equal(back[~nan], b[~nan])
    assert np.array_equal(back[nan], b[nan] | 0x0040)


# --- encode ------------------------------------------------------------------------


def sample_values(rows: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((rows, n)).astype(np.float32)
    v *= np.float32(10.0) ** rng.integers(-6, 4, (rows, 1)).astype(np.float32)
    v[0, :32] = 0  # an all-zero block
    v[0, 32:64] = -3.5  # a constant block
    v[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves everywhere
    v[1, 32:64] = np.arange(32, dtype=np.float32) * 127 / 31  # exact ties for Q8_0
    return v


@pytest.mark.parametrize("t", sorted(ENCODABLE - K_QUANTS), ids=lambda t: t.name)
def test_encode_matches_gguf(t):
    v = sample_values(24, 256, seed=int(t))
    got = encode(v, t)
    block_values, block_bytes = BLOCK_LAYOUT[t]
    assert got.dtype == np.uint8 and got.shape == (24, 256 // block_values * block_bytes)
    expected = gguf.quants.quantize(v, GGMLQuantizationType(t))
    assert np.array_equal(got, expected.view(np.uint8).reshape(got.shape))
    assert np.array_equal(encode(v[3], t), got[3])


def test_encode_non_finite_floats_matches_gguf():
    u = np.concatenate([F32_SPECIALS, np.array(list(BF16_EDGES), np.uint32)])
    v = u.view(np.float32)
    for t in (T.F32, T.F16, T.BF16):
        with np.errstate(over="ignore"):
            expected = gguf.quants.quantize(v, GGMLQuantizationType(t)).view(np.uint8)
        assert np.array_equal(encode(v, t), expected), t.name


@pytest.mark.parametrize("t", sorted(ENCODABLE - K_QUANTS), ids=lambda t: t.name)
def test_round_trip(t):
    rng = np.random.default_rng(50 + int(t))
    v = rng.standard_normal((8, 128)).astype(np.float32)
    v *= np.float32(10.0) ** rng.integers(-2, 3, (8, 1)).astype(np.float32)  # fp16 stays normal
    back = decode_f32(encode(v, t), t)
    x, y = v.reshape(-1, 32), back.reshape(-1, 32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    f16_eps = 2.0**-11  # relative rounding error of a normal fp16 scale
    tol = {
        T.F32: 0,
        T.F16: np.abs(x) * f16_eps + 2.0**-25,  # half the smallest fp16 subnormal
        T.BF16: np.abs(x) * 2.0**-8,
        T.Q8_0: amax / 127 * 0.5 + amax * f16_eps,
        # d = -max/8: the extreme of the other sign clips from 8 to 7, a whole step off.
        T.Q4_0: amax / 8 + amax * f16_eps,
        T.Q4_1: (hi - lo) / 15 * 0.5 + (np.abs(lo) + (hi - lo)) * f16_eps,
        # codes d · {0, 1, 2, 3, 4, 6, 8, 12}, d = 2^(floor(log2 amax) - 3): half the widest gap (8d to 12d),
        # or amax < 2^(k+1) clipped to 12d = 1.5 · 2^k; 4d = 2^(k-1) <= amax / 2
        T.MXFP4: amax / 2,
    }[t]
    assert (np.abs(y - x) <= tol * 1.001).all()
    if t in (T.F32, T.F16, T.BF16, T.Q8_0):
        raw = encode(v, t)
        assert np.array_equal(encode(decode_f32(raw, t), t), raw)


def k_steps(raw: np.ndarray, t: GGMLType) -> np.ndarray:
    """The quantization step of every value of K-quant rows, read from the block bytes as GGML's
    dequantize_row_q*_K reads them: d·scale per sub-block (32 values; 16 for Q6_K)."""
    b = raw.reshape(-1, BLOCK_LAYOUT[t][1])
    if t == T.Q6_K:
        steps = b[:, 208:210].view(np.float16).astype(np.float32) * b[:, 192:208].view(np.int8)
        return np.repeat(steps, 16, axis=1).reshape(raw.shape[0], -1)
    d = b[:, 0:2].view(np.float16).astype(np.float32)
    q = b[:, 4:16].astype(np.int32)
    sc = np.empty((len(b), 8), np.int32)
    for j in range(8):  # get_scale_min_k4
        sc[:, j] = q[:, j] & 63 if j < 4 else (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
    return np.repeat(d * sc, 32, axis=1).reshape(raw.shape[0], -1)


def k_values(rows: int, seed: int) -> np.ndarray:
    """Rows of 512 values (2 blocks) at scales 1e-2 .. 1e2, with the blocks a quantizer can get wrong."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((rows, 512)).astype(np.float32)
    v *= np.float32(10.0) ** rng.integers(-2, 3, (rows, 1)).astype(np.float32)
    v[0, :256] = 0  # all zero
    v[0, 256:] = -3.5  # constant, negative
    v[1, :256] = np.abs(v[1, :256]) + 2  # all positive: mins clamp at 0
    v[1, 256:288] = 0  # one zero sub-block among others
    v[2, :32] *= 1000  # one sub-block far larger than the rest of its block
    v[2, 256:] = np.arange(256, dtype=np.float32) - 100  # a ramp
    return v


@pytest.mark.parametrize("t", sorted(K_QUANTS), ids=lambda t: t.name)
def test_k_quant_encode_round_trips_through_gguf_within_half_a_step(t):
    v = k_values(24, seed=int(t))
    raw = encode(v, t)
    assert raw.dtype == np.uint8 and raw.shape == (24, 2 * BLOCK_LAYOUT[t][1])
    assert np.array_equal(encode(v[5], t), raw[5])
    back = oracle(raw, t).reshape(v.shape)  # GGML's layout, as gguf-py reads it
    assert_same_bits(decode_f32(raw, t), back)
    steps = k_steps(raw, t)
    amax = np.abs(v.reshape(-1, 256)).max(axis=1, keepdims=True)
    slack = (amax * 2.0**-10).repeat(256, axis=1).reshape(v.shape)  # fp16 scales, clipped codes
    err = np.abs(back - v)
    assert (err <= steps * 0.5 * 1.001 + slack).all(), np.argwhere(err > steps * 0.5 * 1.001 + slack)[:4]
    assert (back[0, :256] == 0).all()
    # ... and the steps are near the smallest that cover each sub-block: Gaussian rows come back
    # with the rms error of round-to-nearest at 4, 5 and 6 bits.
    g = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    rel = np.sqrt(np.mean((oracle(encode(g, t), t).reshape(g.shape) - g) ** 2))
    assert rel < {T.Q4_K: 0.09, T.Q5_K: 0.045, T.Q6_K: 0.022}[t], rel


def test_k_quant_layout_by_hand():
    """Blocks whose codes and scales are known and exact (scale codes >= 16, so their top bits are
    packed too); gguf-py must read back exactly the values encoded."""
    j = np.arange(8)[:, None]
    for t, levels in ((T.Q4_K, 16), (T.Q5_K, 32)):
        # sub-block j: step (j + 56)/64 (d = 1/64, scale j + 56), low -(j + 56)/32 (dmin = 1/32, min j + 56),
        # codes (l + j) % levels, covering 0 .. levels - 1
        q = (np.arange(32)[None, :] + j) % levels
        v = ((j + 56) / 64 * q - (j + 56) / 32).astype(np.float32).reshape(1, 256)
        raw = encode(v, t)
        assert np.array_equal(oracle(raw, t).reshape(v.shape), v), t.name
        assert np.array_equal(k_steps(raw, t).reshape(8, 32)[:, 0], (j[:, 0] + 56) / 64)
        assert raw[0, :4].view(np.float16).tolist() == [1 / 64, 1 / 32]
    # Q6_K, 16 sub-blocks of 16: step (j + 112)/256 (d = 1/256, int8 scale j + 112), codes in -31..31
    j16 = np.arange(16)[:, None]
    q = (np.arange(16)[None, :] * 5 + j16) % 63 - 31
    q[:, 0] = 31
    v = ((j16 + 112) / 256 * q).astype(np.float32).reshape(1, 256)
    raw = encode(v, T.Q6_K)
    assert np.array_equal(oracle(raw, T.Q6_K).reshape(v.shape), v)
    assert raw[0, 192:208].tolist() == list(range(112, 128))


def test_k_quant_needs_whole_blocks_and_finite_values():
    with pytest.raises(ValueError, match="block size 256"):
        encode(np.zeros((2, 128), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="non-finite"):
        encode(np.full(256, np.nan, np.float32), T.Q6_K)


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("t", [T.Q2_K, T.Q8_1, T.IQ2_XXS, T.TQ1_0, T.I32])
def test_undecodable_types_are_unsupported(t):
    raw = np.zeros(BLOCK_LAYOUT[t][1], np.uint8)
    for fn in (decode_f32, decode_bf16):
        with pytest.raises(UnsupportedError, match=t.name):
            fn(raw, t)


def test_unknown_type_id_is_unsupported():
    with pytest.raises(UnsupportedError, match="99"):
        decode_f32(np.zeros(4, np.uint8), 99)


@pytest.mark.parametrize("t", [T.Q2_K, T.Q5_1, T.Q5_0])
def test_unencodable_types_are_unsupported(t):
    with pytest.raises(UnsupportedError, match=t.name):
        encode(np.zeros(256, np.float32), t)


def test_bad_row_width():
    with pytest.raises(ModelFormatError) as e:
        decode_f32(np.zeros((2, 35), np.uint8), T.Q8_0)
    assert "Q8_0" in str(e.value) and "35" in str(e.value) and "34" in str(e.value)
    with pytest.raises(ModelFormatError, match="3 bytes"):
        decode_bf16(np.zeros(3, np.uint8), T.F16)


@pytest.mark.parametrize(
    "raw",
    [
        np.zeros((2, 34), np.int8),
        np.zeros((1, 2, 34), np.uint8),
        np.zeros(34, np.uint16),
        b"\0" * 34,
    ],
    ids=["int8", "3-D", "uint16", "bytes"],
)
def test_bad_raw_array(raw):
    with pytest.raises(ValueError, match="uint8"):
        decode_f32(raw, T.Q8_0)


def test_bad_out():
    raw = np.zeros((2, 34), np.uint8)
    bad = [
        np.empty((2, 32), np.float64),
        np.empty((2, 33), np.float32),
        np.empty(64, np.float32),
        np.empty((2, 64), np.float32)[:, ::2],
    ]
    for out in bad:
        with pytest.raises(ValueError, match=r"\(2, 32\)"):
            decode_f32(raw, T.Q8_0, out=out)
    with pytest.raises(ValueError, match="uint16"):
        decode_bf16(raw, T.Q8_0, out=np.empty((2, 32), np.float32))


def test_bad_encode_input():
    with pytest.raises(ValueError, match="block size 32"):
        encode(np.zeros((2, 48), np.float32), T.Q8_0)
    with pytest.raises(ValueError, match="non-finite"):
        encode(np.full(32, np.inf, np.float32), T.Q4_0)
    with pytest.raises(ValueError, match="2-D"):
        encode(np.zeros((1, 1, 32), np.float32), T.Q8_0)
