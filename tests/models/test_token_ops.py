"""The decode token's compiled kernels (pagelm.models.token_ops) against float64 references on odd
shapes, and the inputs they refuse."""

import numpy as np
import pytest
import torch
from numba import njit

from pagelm.models.token_ops import (MAX_ROWS, RopeRows, attend_token, attend_tokens, cache_views, exp_nonpositive,
                                     rope_rows_)


@njit(fastmath={"contract", "reassoc"})  # as the attention kernel calls it
def _exp_each(x, out):
    for i in range(x.size):
        out[i] = exp_nonpositive(x[i])


def test_exp_nonpositive_matches_f64():
    x = np.concatenate([-np.linspace(0, 100, 400_003, dtype=np.float32), np.float32([0, -np.inf, np.nan, -1e-30])])
    got = np.zeros_like(x)
    _exp_each(x, got)
    want = np.exp(x.astype(np.float64))
    normal = want > 2.0**-126
    assert (np.abs(got - want) / np.where(normal, want, 1))[normal].max() < 2.5e-7
    assert np.all(got[x < -87.34] == 0) and got[-4] == 1 and got[-1] == 1 and np.isnan(got[-2])


def _rope_f64(x, cos, sin):
    x, cos, sin = x.double(), cos.double()[:, None], sin.double()[:, None]
    half = cos.shape[-1]
    out = x.clone()
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half : 2 * half] = x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("T, heads, D, half", [(1, 7, 18, 9), (2, 3, 40, 12), (1, 1, 6, 3)])
def test_rope_matches_f64_and_leaves_the_rest(T, heads, D, half):
    g = torch.Generator().manual_seed(T * heads + D)
    base = torch.randn(T, heads + 2, D, generator=g)
    x = base[:, 1 : heads + 1]  # a strided view, as q and k are views of the projection
    angles = torch.rand(T, half, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    want = _rope_f64(x, cos, sin)
    before = base.clone()
    assert rope_rows_(x, cos, sin)
    torch.testing.assert_close(x.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(base[:, 0], before[:, 0]) and torch.equal(base[:, -1], before[:, -1])


def test_rope_memo_returns_its_tables_and_stays_bounded():
    computed = []

    def table(pos):
        computed.append(pos)
        return torch.full((1, 3), float(pos)), torch.full((1, 3), -float(pos))

    rows = RopeRows(table)
    for pos in list(range(RopeRows.LIMIT + 5)) + [7, RopeRows.LIMIT + 2]:
        cos, sin = rows(pos)
        assert cos[0, 0] == pos and sin[0, 0] == -pos
        assert len(rows.rows) <= RopeRows.LIMIT
    assert computed.count(RopeRows.LIMIT + 2) == 1  # seen again: the memo's
    assert computed.count(7) == 2  # dropped when the memo started over


def test_rope_refuses_what_it_does_not_take():
    cos, sin = torch.ones(1, 4), torch.zeros(1, 4)
    assert not rope_rows_(torch.ones(1, 2, 8, dtype=torch.bfloat16), cos, sin)
    assert not rope_rows_(torch.ones(1, MAX_ROWS + 1, 8), cos, sin)  # a prefill's rows
    assert not rope_rows_(torch.ones(1, 2, 16)[..., ::2], cos, sin)  # last axis not unit stride
    assert not rope_rows_(torch.ones(2, 2, 8), cos, sin)  # cos for another number of tokens


def _attend_f64(q, keys, values, scale):
    """q (H, D), keys/values (G, S, D) float64: softmax(q·kᵀ·scale)·v per head, GQA."""
    H, G = q.shape[0], keys.shape[0]
    out = []
    for h in range(H):
        g = h // (H // G)
        p = torch.softmax(keys[g] @ q[h] * scale, 0)
        out.append(p @ values[g])
    return torch.cat(out)[None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, G, D, pos, lo", [(6, 2, 20, 13, 0), (3, 3, 33, 40, 29), (4, 1, 8, 0, 0), (2, 1, 17, 101, 3)])
def test_attend_token_matches_f64_and_writes_the_cache(dtype, H, G, D, pos, lo):
    g = torch.Generator().manual_seed(H * D + pos)
    max_len = pos + 5
    ck = torch.randn(G, max_len, D, generator=g).to(dtype)
    cv = torch.randn(G, max_len, D, generator=g).to(dtype)
    q = torch.randn(1, H, D, generator=g) * (2 if pos < 100 else 40)  # 40: most keys under e^-87
    k, v = torch.randn(1, G, D, generator=g), torch.randn(1, G, D, generator=g)
    untouched = ck[:, pos + 1 :].clone()
    scale = D**-0.5
    got = attend_token(q, k, v, cache_views(ck, cv), pos, scale, lo)
    assert torch.equal(ck[:, pos], k[0].to(dtype)) and torch.equal(cv[:, pos], v[0].to(dtype))
    assert torch.equal(ck[:, pos + 1 :], untouched)
    want = _attend_f64(q[0].double(), ck[:, lo : pos + 1].double(), cv[:, lo : pos + 1].double(), scale)
    assert got.shape == (1, H * D) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attend_tokens_are_each_sequence_alone_and_match_f64(dtype):
    H, G, D, scale = 6, 2, 20, 0.3
    g = torch.Generator().manual_seed(5)
    spots = [(13, 0, 20), (0, 0, 3), (40, 29, 41), (7, 2, 9)]  # (pos, lo, max_len) of sequences at other lengths
    caches = [(torch.randn(G, n, D, generator=g).to(dtype), torch.randn(G, n, D, generator=g).to(dtype))
              for _, _, n in spots]
    alone = [(ck.clone(), cv.clone()) for ck, cv in caches]
    q, k, v = torch.randn(4, H, D, generator=g) * 2, torch.randn(4, G, D, generator=g), torch.randn(4, G, D, generator=g)
    got = attend_tokens(q, k, v, [cache_views(*c) for c in caches], [p for p, _, _ in spots], scale,
                        [lo for _, lo, _ in spots])
    assert got.shape == (4, H * D) and got.dtype == torch.float32
    for i, ((pos, lo, _), (ck, cv), (ak, av)) in enumerate(zip(spots, caches, alone)):
        want = attend_token(q[i : i + 1], k[i : i + 1], v[i : i + 1], cache_views(ak, av), pos, scale, lo)
        assert torch.equal(got[i].view(torch.int32), want[0].view(torch.int32))
        assert torch.equal(ck, ak) and torch.equal(cv, av)
        f64 = _attend_f64(q[i].double(), ck[:, lo : pos + 1].double(), cv[:, lo : pos + 1].double(), scale)
        torch.testing.assert_close(got[i : i + 1].double(), f64, rtol=1e-5, atol=1e-5)


def test_attend_token_refuses_without_writing():
    G, D, max_len = 2, 8, 6
    q, k, v = torch.randn(1, 4, D), torch.randn(1, G, D), torch.randn(1, G, D)
    cache = torch.zeros(G, max_len, D), torch.zeros(G, max_len, D)
    views = cache_views(*cache)
    refused = [
        (q.to(torch.bfloat16), k, v, views, 0),  # a bf16 query
        (torch.randn(2, 4, D), torch.randn(2, G, D), torch.randn(2, G, D), views, 0),  # two tokens
        (q, k, v, views, max_len),  # past the cache
        (torch.randn(1, 3, D), k, v, views, 0),  # heads not a multiple of kv heads
        (q, torch.randn(1, G, D + 1), v, views, 0),  # another head dim
        (q, k, v, None, 0),  # a cache the kernel does not take
    ]
    for args in refused:
        assert attend_token(*args, 1.0) is None
        assert not cache[0].any() and not cache[1].any()


def test_cache_views_only_of_caches_the_kernel_takes():
    G, L, D = 2, 5, 4
    assert cache_views(torch.zeros(G, L, D, dtype=torch.float16), torch.zeros(G, L, D, dtype=torch.float16)) is None
    assert cache_views(torch.zeros(G, D, L).transpose(1, 2), torch.zeros(G, L, D)) is None  # not contiguous
    assert cache_views(torch.zeros(G, L, D), torch.zeros(G, L, D, dtype=torch.bfloat16)) is None  # mixed dtypes
    ck = cache_views(torch.zeros(G, L, D, dtype=torch.bfloat16), torch.zeros(G, L, D, dtype=torch.bfloat16)).k
    assert ck.dtype.name == "uint16" and ck.shape == (G, L, D)


def test_rope_of_tokens_alone_has_each_tokens_row_limit_and_bits():
    heads, D, half, n = 9, 14, 5, 8  # SmolLM2's 9 heads: 8 tokens make 72 rows, more than one token's MAX_ROWS
    assert n * heads > MAX_ROWS
    g = torch.Generator().manual_seed(3)
    base = torch.randn(n, heads + 1, D, generator=g)
    angles = torch.rand(n, half, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    want = _rope_f64(base[:, 1:], cos, sin)
    alone = [base[i : i + 1, 1:].clone() for i in range(n)]
    assert not rope_rows_(base[:, 1:], cos, sin)  # a prefill of 8 tokens keeps torch's
    assert rope_rows_(base[:, 1:], cos, sin, tokens_alone=True)
    for i, x in enumerate(alone):
        assert rope_rows_(x, cos[i : i + 1], sin[i : i + 1])
        assert torch.equal(base[i, 1:].view(torch.int32), x[0].view(torch.int32))
    torch.testing.assert_close(base[:, 1:].double(), want, rtol=1e-6, atol=1e-6)
    assert not rope_rows_(torch.ones(2, MAX_ROWS + 1, 8), torch.ones(2, 4), torch.ones(2, 4), tokens_alone=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attend_tokens_with_rope_are_rope_then_attention_alone(dtype):
    H, G, D, half, scale = 9, 3, 22, 7, 0.25  # partial rope (2·7 of 22 dims), odd shapes
    g = torch.Generator().manual_seed(11)
    spots = [(13, 0, 20), (0, 0, 3), (40, 29, 41), (7, 2, 9), (5, 0, 6), (2, 1, 30), (9, 9, 10), (1, 0, 2)]
    n = len(spots)
    caches = [(torch.randn(G, m, D, generator=g).to(dtype), torch.randn(G, m, D, generator=g).to(dtype))
              for _, _, m in spots]
    alone = [(ck.clone(), cv.clone()) for ck, cv in caches]
    proj = torch.randn(n, (H + 2 * G) * D, generator=g)  # q, k, v as strided views of one projection
    q, k = proj[:, : H * D].view(n, H, D), proj[:, H * D : (H + G) * D].view(n, G, D)
    v = proj[:, (H + G) * D :].view(n, G, D)
    angles = torch.rand(n, half, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    qs, ks = [q[i : i + 1].clone() for i in range(n)], [k[i : i + 1].clone() for i in range(n)]
    q64, k64 = _rope_f64(q, cos, sin), _rope_f64(k, cos, sin)
    got = attend_tokens(q, k, v, [cache_views(*c) for c in caches], [p for p, _, _ in spots], scale,
                        [lo for _, lo, _ in spots], (cos, sin))
    assert got.shape == (n, H * D)
    for i, ((pos, lo, _), (ck, cv), (ak, av)) in enumerate(zip(spots, caches, alone)):
        assert rope_rows_(qs[i], cos[i : i + 1], sin[i : i + 1]) and rope_rows_(ks[i], cos[i : i + 1], sin[i : i + 1])
        want = attend_token(qs[i], ks[i], v[i : i + 1], cache_views(ak, av), pos, scale, lo)
        assert torch.equal(got[i].view(torch.int32), want[0].view(torch.int32))
        assert torch.equal(ck, ak) and torch.equal(cv, av)
        f64 = _attend_f64(q64[i], ck[:, lo : pos + 1].double(), cv[:, lo : pos + 1].double(), scale)
        torch.testing.assert_close(got[i : i + 1].double(), f64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ck[:, pos].double(), k64[i].to(dtype).double(), rtol=1e-2, atol=1e-5)


def test_attend_tokens_refusing_leaves_q_and_k_unroped():
    G, D, n = 2, 8, 3
    q, k, v = torch.randn(n, 4, D), torch.randn(n, G, D), torch.randn(n, G, D)
    caches = [(torch.zeros(G, 6, D), torch.zeros(G, 6, D)) for _ in range(n)]
    views = [cache_views(*c) for c in caches]
    q0, k0 = q.clone(), k.clone()
    rope = torch.rand(n, 4), torch.rand(n, 4)
    assert attend_tokens(q, k, v, views[:2] + [None], [1] * n, 1.0, [0] * n, rope) is None  # a missing view
    assert attend_tokens(q, k, v, views, [1, 1, 6], 1.0, [0] * n, rope) is None  # past a cache
    assert attend_tokens(q, k, v, views, [1] * n, 1.0, [0] * n, (rope[0][:2], rope[1][:2])) is None  # tables
    assert attend_tokens(q, k, v, views, [1] * n, 1.0, [0] * n, (torch.rand(n, 5), torch.rand(n, 5))) is None
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert not any(c.any() for pair in caches for c in pair)
