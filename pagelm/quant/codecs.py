"""Decoders and encoders between GGML block bytes and float32 / bf16 arrays, numpy only.

Codecs work on arrays they are handed: they never open files and never write into `raw`.
"""

import numpy as np

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.quant.types import BLOCK_LAYOUT, GGMLType, as_ggml_type

_T = GGMLType

# Rows are decoded to bf16 through a float32 scratch of about this many values, so the
# temporaries stay in cache however many rows are asked for.
_BF16_CHUNK = 1 << 16


# --- bf16 ---------------------------------------------------------------------------


def f32_to_bf16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16) of float32 `x`, rounded to nearest even.

    NaN keeps its sign and upper bits with the quiet bit set, as ggml does.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty(x.shape, np.uint16)
    bits = x.view(np.uint32)
    # (bits + 0x7fff + lsb) >> 16 cannot wrap in uint32: only NaN bit patterns are that large.
    t = bits >> 16
    t &= 1
    t += 0x7FFF
    t += bits
    t >>= 16
    np.copyto(out, t, casting="unsafe")
    nan = np.isnan(x)
    if nan.any():
        out[nan] = (bits[nan] >> 16) | 0x0040
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (uint16); exact."""
    bits = np.asarray(bits, dtype=np.uint16)
    out = bits.astype(np.uint32)
    out <<= 16
    return out.view(np.float32)


# --- block decoders: blocks (N, bytes per block) uint8 -> o (N, values per block) float32
#
# Each follows the float operation order of gguf-py's dequantize, so results match it bit
# for bit even when a scale is subnormal, infinite or NaN. Integer parts are exact in float32,
# so only the float ops need care: products commute bitwise, sums and differences do not.


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of each block, as float32 (N, 1)."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, o: np.ndarray) -> None:
    """Low nibbles of qs (..., n) into o[..., 0, :], high nibbles into o[..., 1, :]."""
    np.bitwise_and(qs, 0x0F, out=o[..., 0, :], casting="unsafe")
    np.right_shift(qs, 4, out=o[..., 1, :], casting="unsafe")


def _dec_q8_0(b: np.ndarray, o: np.ndarray) -> None:
    d = _f16(b, 0)
    o[...] = b[:, 2:].view(np.int8)
    o *= d


def _dec_q4_0(b: np.ndarray, o: np.ndarray) -> None:
    d = _f16(b, 0)
    _nibbles(b[:, 2:], o.reshape(-1, 2, 16))
    o -= 8
    o *= d


def _dec_q4_1(b: np.ndarray, o: np.ndarray) -> None:
    d, m = _f16(b, 0), _f16(b, 2)
    _nibbles(b[:, 4:], o.reshape(-1, 2, 16))
    o *= d
    o += m


def _q5(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values (N, 32) uint8: nibbles of qs, fifth bit j from bit j of the 32-bit qh."""
    q = np.unpackbits(qh, axis=1, bitorder="little")
    q <<= 4
    q3 = q.reshape(-1, 2, 16)
    q3[:, 0] |= qs & 0x0F
    q3[:, 1] |= qs >> 4
    return q


def _dec_q5_0(b: np.ndarray, o: np.ndarray) -> None:
    d = _f16(b, 0)
    o[...] = _q5(b[:, 2:6], b[:, 6:])
    o -= 16
    o *= d


def _dec_q5_1(b: np.ndarray, o: np.ndarray) -> None:
    d, m = _f16(b, 0), _f16(b, 2)
    o[...] = _q5(b[:, 4:8], b[:, 8:])
    o *= d
    o += m


_SHIFT_NIBBLE = np.array([0, 4], np.uint8)[:, None]


def k_scale_codes(b: np.ndarray) -> np.ndarray:
    """The 6-bit scales and mins (N, 2, 8) uint8 of Q4_K/Q5_K blocks (N, block bytes).

    The 12 scale bytes hold eight 6-bit scales and eight 6-bit mins: bytes 0-3 (4-7) hold the
    low 6 bits of scales (mins) 0-3 and the top 2 bits of scales (mins) 4-7, whose low 4 bits
    are the low (high) nibbles of bytes 8-11.
    """
    s = b[:, 4:16].reshape(-1, 3, 4)
    sm = np.empty((len(b), 2, 2, 4), np.uint8)  # [scales, mins] x [sub-blocks 0-3, 4-7]
    np.bitwise_and(s[:, :2], 0x3F, out=sm[:, :, 0])
    top = s[:, :2] >> 2
    top &= 0x30
    low = s[:, 2:3] >> _SHIFT_NIBBLE
    low &= 0x0F
    np.bitwise_or(low, top, out=sm[:, :, 1])
    return sm.reshape(-1, 2, 8)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sub-block d*scale and dmin*min (N, 8, 1) of a Q4_K/Q5_K block."""
    d_dmin = b[:, :4].view(np.float16).astype(np.float32)
    scaled = d_dmin[:, :, None] * k_scale_codes(b).astype(np.float32)
    return scaled[:, 0, :, None], scaled[:, 1, :, None]


def _dec_q4_k(b: np.ndarray, o: np.ndarray) -> None:
    dsc, dm = _k_scales(b)
    _nibbles(b[:, 16:].reshape(-1, 4, 32), o.reshape(-1, 4, 2, 32))
    o8 = o.reshape(-1, 8, 32)
    o8 *= dsc
    o8 -= dm


def _dec_q5_k(b: np.ndarray, o: np.ndarray) -> None:
    dsc, dm = _k_scales(b)
    q = np.empty((len(b), 8, 32), np.uint8)
    _nibbles(b[:, 48:].reshape(-1, 4, 32), q.reshape(-1, 4, 2, 32))
    # Bit i of qh[l] is the fifth bit of value l of sub-block i.
    hi = np.unpackbits(b[:, 16:48, None], axis=2, bitorder="little")
    hi <<= 4
    q |= hi.transpose(0, 2, 1)
    o8 = o.reshape(-1, 8, 32)
    o8[...] = q
    o8 *= dsc
    o8 -= dm


_SHIFT_2BIT = np.array([0, 2, 4, 6], np.uint8)[:, None]


def _dec_q6_k(b: np.ndarray, o: np.ndarray) -> None:
    ds = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    # Each half of 128 values: low nibbles of 64 ql bytes then their high nibbles; the top
    # two bits of value 32k+l come from bits 2k..2k+1 of qh[l].
    q = np.empty((len(b), 2, 4, 32), np.uint8)
    _nibbles(b[:, :128].reshape(-1, 2, 64), q.reshape(-1, 2, 2, 64))
    hi = b[:, 128:192].reshape(-1, 2, 1, 32) >> _SHIFT_2BIT
    hi &= 0x03
    hi <<= 4
    q |= hi
    o[...] = q.reshape(len(b), -1).view(np.int8)
    o -= 32
    o16 = o.reshape(-1, 16, 16)
    o16 *= ds[:, :, None]

# MXFP4: 32 FP4 (E2M1) values sharing one E8M0 scale byte e. The codes are read as twice their E2M1
# value (ggml's kvalues_mxfp4), so the scale is half of E8M0's 2^(e - 127): 2^(e - 128), subnormal
# for e < 2, never Inf or NaN (e = 255 is 2^127, as ggml reads it).
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def mxfp4_scale(e: np.ndarray) -> np.ndarray:
    """2^(e - 128) as float32 for E8M0 bytes e (uint8)."""
    e = e.astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23).astype(np.uint32).view(np.float32)


def _dec_mxfp4(b: np.ndarray, o: np.ndarray) -> None:
    q = np.empty((len(b), 2, 16), np.uint8)
    _nibbles(b[:, 1:], q)
    o[...] = MXFP4_VALUES[q.reshape(len(b), 32)]
    with np.errstate(over="ignore"):  # 12 · 2^127 is Inf, as in ggml
        o *= mxfp4_scale(b[:, :1])


_DECODERS = {
    _T.Q8_0: _dec_q8_0,
    _T.Q4_0: _dec_q4_0,
    _T.Q4_1: _dec_q4_1,
    _T.Q5_0: _dec_q5_0,
    _T.Q5_1: _dec_q5_1,
    _T.Q4_K: _dec_q4_k,
    _T.Q5_K: _dec_q5_k,
    _T.Q6_K: _dec_q6_k,
    _T.MXFP4: _dec_mxfp4,
}

DECODABLE = frozenset({_T.F32, _T.F16, _T.BF16, *_DECODERS})
ENCODABLE = frozenset({_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q5_K, _T.Q6_K, _T.MXFP4})
K_QUANTS = frozenset({_T.Q4_K, _T.Q5_K, _T.Q6_K})  # encoded by pagelm's own quantizer, not ggml's


# --- public decode ------------------------------------------------------------------


def _check_type(ggml_type: int, supported: frozenset, what: str) -> GGMLType:
    t = as_ggml_type(ggml_type)
    if t not in supported:
        raise UnsupportedError(f"cannot {what} GGML type {t.name}")
    return t


def _as_rows(raw: np.ndarray, t: GGMLType) -> tuple[np.ndarray, int]:
    """`raw` as (rows, row_nbytes) with a contiguous last axis, and the values per row."""
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim not in (1, 2):
        raise ValueError(
            f"raw must be a 1-D or 2-D uint8 array, got {getattr(raw, 'dtype', type(raw).__name__)}"
            f" with shape {getattr(raw, 'shape', None)}"
        )
    rows = raw.reshape(1, -1) if raw.ndim == 1 else raw
    if rows.strides[1] != 1:
        rows = np.ascontiguousarray(rows)
    block_values, block_bytes = BLOCK_LAYOUT[t]
    width = rows.shape[1]
    if width % block_bytes:
        raise ModelFormatError(
            f"{t.name}: a row of {width} bytes is not a whole number of "
            f"{block_bytes}-byte blocks"
        )
    return rows, width // block_bytes * block_values


def _out_rows(out: np.ndarray | None, raw: np.ndarray, shape: tuple[int, int], dtype) -> tuple:
    """(what to return, its 2-D C-contiguous view), allocating when `out` is None."""
    want = shape if raw.ndim == 2 else shape[1:]
    if out is None:
        out = np.empty(want, dtype)
    elif out.dtype != dtype or out.shape != want or not out.flags.c_contiguous:
        raise ValueError(
            f"out must be a C-contiguous {np.dtype(dtype).name} array of shape {want}, "
            f"got {out.dtype} {out.shape}"
            + ("" if out.flags.c_contiguous else " (not C-contiguous)")
        )
    return out, out.reshape(shape)


def _decode_into(rows: np.ndarray, t: GGMLType, o: np.ndarray) -> None:
    if t == _T.F32:
        o[...] = rows.view(np.float32)
    elif t == _T.F16:
        o[...] = rows.view(np.float16)
    elif t == _T.BF16:
        u = o.view(np.uint32)
        u[...] = rows.view(np.uint16)
        u <<= 16
    else:
        block_values, block_bytes = BLOCK_LAYOUT[t]
        _DECODERS[t](rows.reshape(-1, block_bytes), o.reshape(-1, block_values))


def decode_f32(raw: np.ndarray, ggml_type: int, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values (rows, n_values) of uint8 `raw` (rows, row_nbytes); 1-D for one row."""
    t = _check_type(ggml_type, DECODABLE, "decode")
    rows, n = _as_rows(raw, t)
    out, o = _out_rows(out, raw, (len(rows), n), np.float32)
    # Inf and NaN scales are valid input (decoded as gguf-py does), not a warning.
    with np.errstate(invalid="ignore"):
        _decode_into(rows, t, o)
    return out


def decode_bf16(raw: np.ndarray, ggml_type: int, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 bit patterns (uint16) of `raw`, shaped as decode_f32; BF16 bits pass through."""
    t = _check_type(ggml_type, DECODABLE, "decode")
    rows, n = _as_rows(raw, t)
    out, o = _out_rows(out, raw, (len(rows), n), np.uint16)
    if t == _T.BF16:
        o[...] = rows.view(np.uint16)
        return out
    step = max(1, _BF16_CHUNK // max(n, 1))
    scratch = np.empty((min(step, len(rows)), n), np.float32)
    with np.errstate(invalid="ignore"):
        for i in range(0, len(rows), step):
            part = rows[i : i + step]
            s = scratch[: len(part)]
            _decode_into(part, t, s)
            f32_to_bf16(s, out=o[i : i + step])
    return out


# --- encode -------------------------------------------------------------------------
#
# Q8_0, Q4_0 and Q4_1 mirror gguf-py's quantize (itself a port of ggml's reference quantizers)
# so that they produce the same bytes. The K-quants (K_QUANTS) use a plain quantizer of their
# own: GGML's block layout exactly, but scales chosen to cover each sub-block's range and values
# rounded to nearest, without llama.cpp's scale search, so their bytes differ from llama.cpp's.
# Values must be finite for the block types.


def _reciprocal(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), 1 / d)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # Exact, unlike floor(|x| + 0.5), which rounds 0.49999997 up.
    a = np.abs(x)
    r = np.floor(a)
    r += (a - r) >= 0.5
    return np.copysign(r, x)


def _enc_q8_0(b: np.ndarray, o: np.ndarray) -> None:
    d = np.abs(b).max(axis=1, keepdims=True) / 127
    o[:, :2] = d.astype(np.float16).view(np.uint8)
    o[:, 2:] = _round_half_away(b * _reciprocal(d)).astype(np.int8).view(np.uint8)


def _pack_nibbles(q: np.ndarray, o: np.ndarray) -> None:
    o[...] = q[:, :16]
    o |= q[:, 16:] << 4


def _enc_q4_0(b: np.ndarray, o: np.ndarray) -> None:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = np.take_along_axis(b, imax, axis=1) / -8
    q = np.trunc(b * _reciprocal(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
    o[:, :2] = d.astype(np.float16).view(np.uint8)
    _pack_nibbles(q, o[:, 2:])


def _enc_q4_1(b: np.ndarray, o: np.ndarray) -> None:
    hi = b.max(axis=1, keepdims=True)
    lo = b.min(axis=1, keepdims=True)
    d = (hi - lo) / 15
    q = np.trunc((b - lo) * _reciprocal(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
    o[:, :2] = d.astype(np.float16).view(np.uint8)
    o[:, 2:4] = lo.astype(np.float16).view(np.uint8)
    _pack_nibbles(q, o[:, 4:])


def _f16_round(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes (N, 2), the float32 value the decoder will read) of float32 scales (N, 1)."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _ceil_ratio(x: np.ndarray, d: np.ndarray, top: int) -> np.ndarray:
    """ceil(x / d) as integers in [0, top] (0 where d == 0): the smallest code whose scale covers x."""
    with np.errstate(invalid="ignore"):
        q = np.ceil(x * _reciprocal(d) * np.float32(1 - 2.0**-20))  # a product rounded up by an ulp stays
    return q.clip(0, top).astype(np.uint8)


def _k_quantize(b: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K parts of blocks (N, 256): fp16 d and dmin bytes, 6-bit scales and mins (N, 8) and
    codes (N, 8, 32) in [0, levels]; value = d·scale·q − dmin·min as the decoder computes it.

    Each sub-block of 32 gets low = min(0, its minimum) (mins are unsigned) and the scales the
    smallest codes that cover [low, max]: low is rounded down to a multiple of dmin, the step up.
    """
    x = b.reshape(-1, 8, 32)
    neg_low = -np.minimum(x.min(axis=2), 0)  # (N, 8), >= 0
    dmin_bytes, dmin = _f16_round(neg_low.max(axis=1, keepdims=True) / 63)
    mins = _ceil_ratio(neg_low, dmin, 63)
    low = dmin * mins.astype(np.float32)  # what the decoder subtracts
    step = (x.max(axis=2) + low) / levels
    d_bytes, d = _f16_round(step.max(axis=1, keepdims=True) / 63)
    scales = _ceil_ratio(step, d, 63)
    s = (d * scales.astype(np.float32))[:, :, None]
    with np.errstate(invalid="ignore"):
        q = _round_half_away((x + low[:, :, None]) * _reciprocal(s))
    q = np.nan_to_num(q).clip(0, levels).astype(np.uint8)
    return d_bytes, dmin_bytes, scales, mins, q


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray, o: np.ndarray) -> None:
    """Eight 6-bit scales and mins (N, 8) into the 12 bytes the decoder's _k_scales reads."""
    o[:, 0:4] = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    o[:, 4:8] = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    o[:, 8:12] = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)


def _pack_k_nibbles(q: np.ndarray, o: np.ndarray) -> None:
    """Low nibbles of codes (N, 8, 32) into 128 bytes: sub-blocks 2c and 2c+1 share bytes 32c..32c+31."""
    q4 = q.reshape(-1, 4, 2, 32) & 0x0F
    o.reshape(-1, 4, 32)[...] = q4[:, :, 0] | (q4[:, :, 1] << 4)


def _enc_q4_k(b: np.ndarray, o: np.ndarray) -> None:
    d, dmin, scales, mins, q = _k_quantize(b, 15)
    o[:, 0:2], o[:, 2:4] = d, dmin
    _pack_k_scales(scales, mins, o[:, 4:16])
    _pack_k_nibbles(q, o[:, 16:])


def _enc_q5_k(b: np.ndarray, o: np.ndarray) -> None:
    d, dmin, scales, mins, q = _k_quantize(b, 31)
    o[:, 0:2], o[:, 2:4] = d, dmin
    _pack_k_scales(scales, mins, o[:, 4:16])
    # Bit j of qh[l] is the fifth bit of value l of sub-block j.
    o[:, 16:48] = np.packbits((q >> 4).transpose(0, 2, 1), axis=2, bitorder="little")[:, :, 0]
    _pack_k_nibbles(q, o[:, 48:])


def _enc_q6_k(b: np.ndarray, o: np.ndarray) -> None:
    # value = d · scale · (q − 32) with q in [0, 63], an int8 scale per 16 values; codes use −31..31
    x = b.reshape(-1, 16, 16)
    step = np.abs(x).max(axis=2) / 31  # (N, 16)
    d_bytes, d = _f16_round(step.max(axis=1, keepdims=True) / 127)
    scales = _ceil_ratio(step, d, 127)
    s = (d * scales.astype(np.float32))[:, :, None]
    q = _round_half_away(x * _reciprocal(s)).clip(-32, 31).astype(np.int8)
    q = (q + 32).astype(np.uint8)
    # Each half of 128 values: value 64a + m is nibble a of ql[m]; the top two bits of value
    # 32k + l are bits 2k..2k+1 of qh[l].
    q64 = q.reshape(-1, 2, 2, 64) & 0x0F  # [half, a, m]
    o[:, :128].reshape(-1, 2, 64)[...] = q64[:, :, 0] | (q64[:, :, 1] << 4)
    top = q.reshape(-1, 2, 4, 32) >> 4  # [half, k, l]
    o[:, 128:192].reshape(-1, 2, 32)[...] = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    o[:, 192:208] = scales  # int8 scales, all >= 0 here
    o[:, 208:210] = d_bytes


_MXFP4_CHUNK = 1 << 14  # blocks a step: bounds the temporaries
# the codes' magnitudes (twice E2M1's) in index order 0..7, and the midpoints between neighbours
_MXFP4_MIDS = ((MXFP4_VALUES[1:8] + MXFP4_VALUES[:7]) / 2).astype(np.float32)


def _enc_mxfp4(b: np.ndarray, o: np.ndarray) -> None:
    """ggml's choice: the scale exponent floor(log2 max|x|) - 2 (so 6 · 2^e' reaches up to 1.5 · 2^k of
    a block whose largest magnitude is in [2^k, 2^(k+1))), each value the nearest code, the first on ties.

    The nearest code by the midpoints between the magnitudes, a tie going to the smaller one (the
    code of lower index, for either sign): the distances to two neighbouring codes are exact in
    float32 (each code at most twice the one below, Sterbenz), so this is their argmin's choice; a
    block whose scale is subnormal (e < 3) takes the distances themselves."""
    codes = MXFP4_VALUES.astype(np.float32)
    for lo in range(0, len(b), _MXFP4_CHUNK):
        x = b[lo : lo + _MXFP4_CHUNK]
        amax = np.abs(x).max(axis=1, keepdims=True)
        with np.errstate(divide="ignore"):
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).clip(0, 255).astype(np.uint8)
        scale = mxfp4_scale(e)
        magnitude = (np.abs(x)[:, :, None] > scale[:, :, None] * _MXFP4_MIDS).sum(axis=2, dtype=np.uint8)
        q = np.where((x < 0) & (magnitude > 0), magnitude + 8, magnitude).astype(np.uint8)
        tiny = np.flatnonzero(e[:, 0] < 3)
        if tiny.size:
            distance = np.abs(scale[tiny][:, :, None] * codes - x[tiny][:, :, None])
            q[tiny] = distance.argmin(axis=2).astype(np.uint8)
        o[lo : lo + len(x), :1] = e
        _pack_nibbles(q, o[lo : lo + len(x), 1:])


_ENCODERS = {_T.Q8_0: _enc_q8_0, _T.Q4_0: _enc_q4_0, _T.Q4_1: _enc_q4_1,
             _T.Q4_K: _enc_q4_k, _T.Q5_K: _enc_q5_k, _T.Q6_K: _enc_q6_k, _T.MXFP4: _enc_mxfp4}


def encode(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """uint8 rows (rows, row_nbytes) of float32 `values` (rows, n_values); 1-D for one row."""
    t = _check_type(ggml_type, ENCODABLE, "encode")
    v = np.ascontiguousarray(values, dtype=np.float32)
    if v.ndim not in (1, 2):
        raise ValueError(f"values must be 1-D or 2-D, got shape {v.shape}")
    rows = v.reshape(1, -1) if v.ndim == 1 else v
    block_values, block_bytes = BLOCK_LAYOUT[t]
    if rows.shape[1] % block_values:
        raise ValueError(
            f"{t.name}: {rows.shape[1]} values per row is not a multiple of "
            f"the block size {block_values}"
        )
    if t == _T.F32:
        out = rows.view(np.uint8).copy()
    elif t == _T.F16:
        with np.errstate(over="ignore"):  # beyond fp16 range is Inf, as in ggml
            out = rows.astype(np.float16).view(np.uint8)
    elif t == _T.BF16:
        out = f32_to_bf16(rows).view(np.uint8)
    else:
        if not np.isfinite(rows).all():
            raise ValueError(f"{t.name}: cannot encode non-finite values")
        out = np.empty((len(rows), rows.shape[1] // block_values * block_bytes), np.uint8)
        _ENCODERS[t](rows.reshape(-1, block_values), out.reshape(-1, block_bytes))
    return out if v.ndim == 2 else out[0]
