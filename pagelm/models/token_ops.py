"""One decode token's rope and attention as compiled kernels.

A decode step of SmolLM2's 30 layers spent 14–15 ms per token outside the matmuls on this stop's host, much of it in
the dispatch of small torch ops: rope is six of them (~40 µs a call here, the kernel with its
wrapper ~15), one token's attention (cache writes, casts, SDPA) ~180 µs (the kernel ~20, its
wrapper a few more, given the cache's numpy views made once). Inputs the kernels do not take
(a prefill's rows, other devices and dtypes) keep torch's path. (The gated activations stay
torch's: one vectorized op, ~5 µs.)

TokenStep runs a whole one-token step in numpy between the kernels (gemma3; llama where its layers
are not compiled calls, `token_layers`): what torch still dispatched per layer — views, casts, norms'
wrappers, attention's per-call checks — cost SmolLM2 ~3 ms of a 13-15 ms step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from numba import carray, njit, prange, types
from numba.extending import intrinsic, overload

from pagelm.models.norms import MAX_ROWS, norm_rows  # MAX_ROWS: rows (tokens × heads) of one decode step take the kernels
from pagelm.quant.codegen import fma
from pagelm.quant.matmul import bf16_bits, u32_as_f32
from pagelm.quant.precompile import Job
from pagelm.weights.linear import as_float32


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad for t in tensors)


# --- rope ---------------------------------------------------------------------------


@njit(cache=True)
def rope_heads(x, cos, sin):
    T, heads, _ = x.shape
    half = cos.shape[1]
    for t in range(T):
        for r in range(heads):
            for i in range(half):
                a, b = x[t, r, i], x[t, r, half + i]
                x[t, r, i] = a * cos[t, i] - b * sin[t, i]
                x[t, r, half + i] = b * cos[t, i] + a * sin[t, i]


def _rope_tables_take(cos: torch.Tensor, sin: torch.Tensor, T: int, D: int) -> bool:
    """Whether the kernels take rope tables (cos, sin) for T tokens of head dim D."""
    return (_cpu_f32(cos, sin) and cos.shape == sin.shape == (T, cos.shape[-1]) and 2 * cos.shape[-1] <= D
            and cos.is_contiguous() and sin.is_contiguous())


def _rope_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens_alone: bool) -> bool:
    rows = x.shape[1] if tokens_alone else x.shape[0] * x.shape[1]  # x.dim() checked first
    return (_cpu_f32(x) and x.dim() == 3 and x.stride(-1) == 1 and rows <= MAX_ROWS
            and _rope_tables_take(cos, sin, x.shape[0], x.shape[-1]))


def rope_rows_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tokens_alone: bool = False) -> bool:
    """NeoX rope in place on the first 2·cos.shape[-1] dims of x (T, heads, D), layers.apply_rope_'s
    formula in float32 (torch fuses one multiply-add, so the two differ in the last bit), when x
    is a float32 CPU tensor of at most MAX_ROWS rows with unit stride in its last axis; False
    otherwise. `tokens_alone`: each of the T tokens is a sequence's one token of a batched step,
    and the row limit is each token's (heads ≤ MAX_ROWS), the one it has decoding alone."""
    if not (x.dim() == 3 and _rope_takes(x, cos, sin, tokens_alone)):
        return False
    rope_heads(x.numpy(), cos.numpy(), sin.numpy())
    return True


class RopeRows:
    """One token's rope tables (cos, sin) by position, `table(pos)` computed once per position and
    kept (the same tensors every time: read, never written): a decode step's torch sin and cos
    (~4 small ops per sequence per step, each a dispatch and, on a busy host, a wait on the thread
    pool) leave the step once the position has been seen, by any sequence."""

    # Positions kept; past it the memo starts over. Each costs ~1.4 KiB of anonymous memory (Qwen3.5,
    # SmolLM2), ~3 KiB with Gemma 3's two tables (RSS over 16,000 positions: 22 and 47 MiB), so this
    # holds 1.4-3 MiB.
    LIMIT = 1024

    def __init__(self, table):
        self.table, self.rows = table, {}

    def __call__(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows.get(pos)
        if row is None:
            if len(self.rows) >= self.LIMIT:
                self.rows.clear()
            row = self.rows[pos] = self.table(pos)
        return row


def token_ropes(ropes: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) tables (1, half) of one token of each of n sequences as one pair (n, half)."""
    if len(ropes) == 1:
        return ropes[0]
    return torch.cat([c for c, _ in ropes]), torch.cat([s for _, s in ropes])


# --- one query's attention over the KV cache ----------------------------------------


def _kv(cache, g, j, d):
    """The cache value at (g, j, d) as float32: bf16 caches are handed over as their uint16 bits."""


@overload(_kv)
def _kv_impl(cache, g, j, d):
    if cache.dtype == types.uint16:

        def from_bf16(cache, g, j, d):
            return u32_as_f32(np.uint32(cache[g, j, d]) << 16)

        return from_bf16
    return lambda cache, g, j, d: cache[g, j, d]


def _store(cache, g, j, d, v):
    """cache[g, j, d] = v, rounded to bf16 (nearest even, as torch's cast) for a bf16 cache."""


@overload(_store)
def _store_impl(cache, g, j, d, v):
    if cache.dtype == types.uint16:

        def to_bf16(cache, g, j, d, v):
            cache[g, j, d] = bf16_bits(v)

        return to_bf16

    def plain(cache, g, j, d, v):
        cache[g, j, d] = v

    return plain


@intrinsic
def pointer(typingctx, address, like):
    """A pointer of array `like`'s dtype at an integer address (a tensor's data_ptr), for carray.
    (Arrays made so must be written through calls, not in a prange body itself: numba's parfor
    dead-code pass sees no alias of them and drops such stores.)"""
    if not (isinstance(address, types.Integer) and isinstance(like, types.Array)):
        return None
    ptr = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(address, like), codegen


@njit(cache=True)
def _write_kv(ck, cv, k, v, pos):
    G, D = k.shape
    for g in range(G):
        for d in range(D):
            _store(ck, g, pos, d, k[g, d])
            _store(cv, g, pos, d, v[g, d])


# exp_nonpositive's polynomial: e^r = sum r^k / k! for |r| <= ln 2 / 2, to k = 6 (Horner, highest first)
_LN_SMALLEST = np.float32(-87.33654)  # ln 2^-126, rounded up
_EXP_TERMS = tuple(np.float32(1 / np.prod(np.arange(1, k + 1, dtype=np.float64))) for k in range(6, -1, -1))


@njit(inline="always", fastmath={"contract"})
def exp_nonpositive(x):
    """e^x in float32 for x <= 0 (a softmax's x - max) within 2.3e-7 relative (numpy's own float32
    exp: 2.0e-7; tests/models/test_token_ops.py), 0 below ln 2^-126 (where float32 turns subnormal), NaN for
    NaN: 2^n · e^r with n = round(x · log2 e), r = x - n · ln 2 in two parts. Plain arithmetic, so
    LLVM vectorizes a loop of it: numpy's exp is a call per value."""
    low = x < _LN_SMALLEST
    x = _LN_SMALLEST if low else x
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = (x - n * np.float32(0.693145752)) - n * np.float32(1.42860677e-06)
    e = _EXP_TERMS[0]
    for c in _EXP_TERMS[1:]:
        e = e * r + c
    e = e * u32_as_f32(np.uint32(np.int32(n) + 127) << 23)
    return np.float32(0) if low else e


@njit(cache=True, fastmath={"contract", "reassoc"})
def _attend_head(q, ck, cv, g, pos, lo, scale, o):
    """o = softmax(q · keys lo..pos · scale) · their values, from cache group g. The values go in
    four keys at a time into a local sum (one key at a time into o, every dimension was a load and a
    store a key); each row's arithmetic its own alone. With the softmax's exp_nonpositive, SmolLM2's
    call after 1,000 positions: 0.059-0.061 ms before, 0.040-0.042 (`bench/attention.py`)."""
    D = q.shape[0]
    span = pos + 1 - lo
    p = np.empty(span, np.float32)
    top = np.float32(-np.inf)
    for j in range(span):
        s = np.float32(0)
        for d in range(D):
            s += q[d] * _kv(ck, g, lo + j, d)
        p[j] = s * scale
        top = max(top, p[j])
    total = np.float32(0)
    for j in range(span):
        p[j] = exp_nonpositive(p[j] - top)
        total += p[j]
    acc = np.zeros(D, np.float32)
    j = 0
    while j + 4 <= span:
        p0, p1, p2, p3 = p[j], p[j + 1], p[j + 2], p[j + 3]
        k = lo + j
        for d in range(D):
            acc[d] += (p0 * _kv(cv, g, k, d) + p1 * _kv(cv, g, k + 1, d)) + (p2 * _kv(cv, g, k + 2, d)
                                                                              + p3 * _kv(cv, g, k + 3, d))
        j += 4
    for j in range(j, span):
        for d in range(D):
            acc[d] += p[j] * _kv(cv, g, lo + j, d)
    for d in range(D):
        o[d] = acc[d] / total


@njit(parallel=True, cache=True, fastmath={"contract", "reassoc"})
def attend_heads(q, k, v, ks, vs, like, lens, pos, lo, scale, out):
    n, H, D = q.shape
    G = k.shape[1]
    for s in range(n):
        _write_kv(carray(pointer(ks[s], like), (G, lens[s], D)), carray(pointer(vs[s], like), (G, lens[s], D)),
                  k[s], v[s], pos[s])
    group = H // G
    for sh in prange(n * H):
        s, h = sh // H, sh % H
        _attend_head(q[s, h], carray(pointer(ks[s], like), (G, lens[s], D)),
                     carray(pointer(vs[s], like), (G, lens[s], D)), h // group, pos[s], lo[s], scale,
                     out[s, h * D : (h + 1) * D])


def _kernel_view(cache: torch.Tensor) -> np.ndarray | None:
    if cache.device.type != "cpu" or not cache.is_contiguous() or cache.dim() != 3:
        return None
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy() if cache.dtype == torch.float32 else None


class CacheViews(NamedTuple):
    """A K/V cache pair as attend_tokens works on it: numpy views (G, max_len, D) (bf16 as its
    uint16 bits) and their data addresses."""

    k: np.ndarray
    v: np.ndarray
    k_at: int
    v_at: int


def cache_views(cache_k: torch.Tensor, cache_v: torch.Tensor) -> CacheViews | None:
    """The views attend_token works on of a K/V cache pair (G, max_len, D), made once per cache:
    None when the kernel does not take this cache."""
    ck, cv = _kernel_view(cache_k), _kernel_view(cache_v)
    if ck is None or cv is None or ck.shape != cv.shape or ck.dtype != cv.dtype:
        return None
    return CacheViews(ck, cv, cache_k.data_ptr(), cache_v.data_ptr())


def _cache_takes(w: CacheViews | None, dtype, G: int, D: int, pos: int, lo: int = 0) -> bool:
    """Whether the kernel takes a token at `pos` (keys from `lo`) over the cache behind views w."""
    return w is not None and w.k.dtype == dtype and w.k.shape[::2] == (G, D) and 0 <= lo <= pos < w.k.shape[1]


def attend_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, views: list[CacheViews | None],
                  positions: list[int], scale: float, los: list[int],
                  rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """One token's GQA attention for each of n sequences at once, row i of each input sequence i's:
    writes k[i] and v[i] (G, D) at positions[i] of the caches behind views[i] (cache_views; bf16
    rounded as torch's cast rounds), then softmax(q[i]·Kᵀ·scale)·V over keys los[i]..positions[i]
    for q[i] (H, D), in float32 from the cache's exact values, each row as it is alone. With
    `rope` (cos, sin), each (n, rope_dim / 2): rope_rows_ on q and k first (in place where they are
    contiguous), each token as alone (tokens_alone), once every input is known to be taken. Returns (n, H·D) float32, or
    None (nothing written, q and k untouched) for inputs the kernels do not take: a missing view,
    caches of other dtypes or shapes, not float32 CPU tokens, positions outside a cache, rope
    tables rope_rows_ refuses."""
    if any(w is None for w in views) or not (q.dtype == k.dtype == v.dtype == torch.float32
                                             and q.is_cpu and k.is_cpu and v.is_cpu):
        return None
    first = views[0].k
    n, (G, _, D) = len(views), first.shape
    # C-contiguous (copies of a batch's strided views of a projection; one token's rows already are):
    # the kernels are compiled per array layout, and fastmath's reassociation may order a layout's
    # sums otherwise, so a batch must reach the very code one token alone does
    qn, kn, vn = (np.ascontiguousarray(t.numpy()) for t in (q, k, v))
    if not (qn.ndim == 3 and qn.shape[0] == n and qn.shape[2] == D and qn.shape[1] % G == 0
            and kn.shape == vn.shape == (n, G, D) and len(positions) == len(los) == n
            and all(_cache_takes(w, first.dtype, G, D, pos, lo) for w, pos, lo in zip(views, positions, los))):
        return None
    if rope is not None and not (_rope_takes(q, *rope, True) and _rope_takes(k, *rope, True)):
        return None
    rows = TokenRows.of(views, positions, los, scale)
    return torch.from_numpy(rows.attend(qn, kn, vn, None if rope is None else (rope[0].numpy(), rope[1].numpy())))


class TokenRows:
    """What attend_tokens needs of n sequences' caches beyond the token's rows, as the kernel takes it:
    the caches' addresses (one row a layer for a whole step's, `TokenStep`), their lengths, the
    token's positions and first keys."""

    def __init__(self, like: np.ndarray, k_at: np.ndarray, v_at: np.ndarray, lens: np.ndarray, positions: list[int],
                 los: list[int], scale: float):
        self.like, self.k_at, self.v_at, self.lens = like, k_at, v_at, lens
        self.positions, self.los = np.array(positions, np.int64), np.array(los, np.int64)
        self.scale = np.float32(scale)

    @classmethod
    def of(cls, views: list[CacheViews], positions: list[int], los: list[int], scale: float) -> TokenRows:
        return cls(views[0].k, np.array([w.k_at for w in views], np.int64), np.array([w.v_at for w in views], np.int64),
                   np.array([w.k.shape[1] for w in views], np.int64), positions, los, scale)

    def attend(self, qn: np.ndarray, kn: np.ndarray, vn: np.ndarray,
               rope: tuple[np.ndarray, np.ndarray] | None, layer: int | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """attend_tokens on C-contiguous float32 q (n, H, D), k and v (n, G, D) (rope, when given, applied
        to q and k in place): (n, H·D) float32, into `out` when given. `layer`: the step's layer whose
        caches these are."""
        if rope is not None:
            rope_heads(qn, *rope)
            rope_heads(kn, *rope)
        k_at, v_at = (self.k_at, self.v_at) if layer is None else (self.k_at[layer], self.v_at[layer])
        if out is None:
            out = np.empty((qn.shape[0], qn.shape[1] * qn.shape[2]), np.float32)
        attend_heads(qn, kn, vn, k_at, v_at, self.like, self.lens, self.positions, self.los, self.scale, out)
        return out


def view_dtype(kv_dtype: torch.dtype) -> str:
    """The numpy dtype of the kernels' views of a KV cache of `kv_dtype` (bf16 as its uint16 bits)."""
    return "uint16" if kv_dtype == torch.bfloat16 else "float32"


def warmup_job(kv_dtype: torch.dtype) -> Job:
    """The worker job (quant.precompile.Job) of `warmup` for KV caches of `kv_dtype`."""
    return Job(__name__, "warmup", (view_dtype(kv_dtype),), (attend_heads, rope_heads), "", cost=2.0)


def warmup(like: str) -> None:
    """Compiles (or loads) attend_tokens' kernels, rope included, for KV caches whose kernel views are of numpy
    dtype `like` (uint16: bf16 bits; float32): one token on a tiny cache, as a decode step calls them."""
    cache = [torch.zeros(1, 2, 2, dtype=torch.bfloat16 if like == "uint16" else torch.float32) for _ in range(2)]
    q, k, v = (torch.zeros(1, 1, 2) for _ in range(3))
    if attend_tokens(q, k, v, [cache_views(*cache)], [0], 1.0, [0], (torch.ones(1, 1), torch.zeros(1, 1))) is None:
        raise AssertionError("attend_tokens did not take its warmup token")


def attend_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, views: CacheViews | None,
                 pos: int, scale: float, lo: int = 0) -> torch.Tensor | None:
    """attend_tokens for one sequence: q (1, H, D), k and v (1, G, D); returns (1, H·D) or None."""
    return attend_tokens(q, k, v, [views], [pos], scale, [lo])


# --- LFM2's short convolution ---------------------------------------------------------

_WINDOW = np.zeros(1, np.float32)  # the conv windows' dtype, for `pointer`


@njit(cache=True)
def conv_tokens(taps, window_at, proj, out):
    """LFM2's short convolution of one token of each sequence s: out[s] = C · conv(B · x) from in_proj's rows
    proj[s] = [B | C | x], over the window of its last K - 1 values of B · x (float32 (K - 1, hidden) at address
    window_at[s], oldest first), advanced in place; taps (K, hidden). layers.causal_conv1d's operations: its
    addcmul_ one fused multiply-add (torch's CPU kernel rounds once)."""
    K, hidden = taps.shape
    for s in range(out.shape[0]):
        window = carray(pointer(window_at[s], _WINDOW), (K - 1, hidden))
        for c in range(hidden):
            bx = proj[s, c] * proj[s, 2 * hidden + c]
            o = bx * taps[K - 1, c]
            for j in range(K - 1):
                o = fma(window[j, c], taps[j, c], o)
            for j in range(K - 2):
                window[j, c] = window[j + 1, c]
            window[K - 2, c] = bx
            out[s, c] = proj[s, hidden + c] * o


def window_los(positions: list[int], window: int | None) -> list[int]:
    """The first key each token at `positions` sees."""
    return [0 if window is None else max(0, p + 1 - window) for p in positions]


def gated_rows(both: np.ndarray, activation, out: np.ndarray | None = None) -> np.ndarray:
    """activation(gate) · up of float32 rows `both` (n, 2·ffn) = [gate | up], into `out` when given: the
    activation torch's (its bits), the multiply numpy's (IEEE's, as torch's)."""
    half = both.shape[1] // 2
    act = activation(torch.from_numpy(both[:, :half])).numpy()
    return np.multiply(act, both[:, half:], out=act if out is None else out)


class TokenStep:
    """One decode step of one token of each of n sequences (x (n, hidden), their KVStates), run in
    numpy between the kernels: the residual rows `h` (float32, a copy of x), their norms and the
    attention of each layer on the step's rows, the very calls the torch path makes with the same
    values, without a torch dispatch per operation (~10 a layer of a small model, 5-15 µs each)."""

    def __init__(self, h: np.ndarray, ropes: list[tuple[np.ndarray, np.ndarray]], rows: dict):
        self.h, self.ropes, self.rows = h, ropes, rows
        self._buffers: dict[str, np.ndarray] = {}

    def buffer(self, key, shape: tuple[int, int]) -> np.ndarray:
        """A float32 array of `shape` reused under `key` (a name, an operator) by every layer of the
        step: a layer reads what it wrote there before the next layer writes it. (Fresh arrays for each
        product of each layer cost SmolLM2 ~0.1-0.25 ms of an 8 ms step: new pages, cold in the caches.)"""
        b = self._buffers.get(key)
        if b is None or b.shape != shape:
            b = self._buffers[key] = np.empty(shape, np.float32)
        return b

    @classmethod
    def of(cls, x: torch.Tensor, states: list, ropes: list[tuple[torch.Tensor, torch.Tensor]], scale: float,
           H: int, G: int, D: int, windows: tuple = (None,)) -> TokenStep | None:
        """The step, given each rope table (cos, sin) (n, half) its layers use and each attention
        window (None: all keys); or None where the kernels do not take it (then the torch path,
        which attend_tokens and rms_norm_rows would send to torch's ops likewise): not a CPU step,
        rope tables or heads rope_rows_ refuses, caches attend_tokens refuses."""
        if not (x.device.type == "cpu" and not x.requires_grad and H <= MAX_ROWS
                and all(_rope_tables_take(cos, sin, x.shape[0], D) for cos, sin in ropes)):
            return None
        views = [s.views for s in states]
        first = views[0][0]
        if first is None or not all(_cache_takes(w, first.k.dtype, G, D, s.pos) for s, layers in zip(states, views)
                                    for w in layers):
            return None
        positions = [s.pos for s in states]
        k_at = np.array([[w.k_at for w in layers] for layers in views], np.int64).T.copy()
        v_at = np.array([[w.v_at for w in layers] for layers in views], np.int64).T.copy()
        lens = np.array([s.max_len for s in states], np.int64)
        rows = {w: TokenRows(first.k, k_at, v_at, lens, positions, window_los(positions, w), scale) for w in windows}
        return cls(x.to(dtype=torch.float32, copy=True).numpy(), [(c.numpy(), s.numpy()) for c, s in ropes], rows)

    def norm(self, x: np.ndarray, w: torch.Tensor, eps: float, into: str | None = None) -> np.ndarray:
        """rms_norm(x, w, eps) of the step's rows (w float32 on the CPU, as the models load norms), into
        the buffer `into` (not x's) or a new array."""
        return norm_rows(x, w.numpy(), eps, None if into is None else self.buffer(into, x.shape))

    def product(self, linear, x: np.ndarray, alone: bool) -> np.ndarray:
        """linear.rows(x) into the step's buffer for the operator's products (one per operator
        shape: layers' operators of one shape share it)."""
        return linear.rows(x, alone, self.buffer(linear.out_features, (x.shape[0], linear.out_features)))

    def gated(self, gate_up, down, x: np.ndarray, activation, alone: bool) -> np.ndarray:
        """down(activation(gate) · up) of the step's rows x, gate and up the halves of gate_up(x) (both
        Linear), in the dtype gate_up's few-row products have, as the torch layers compute it (float32:
        gated_rows)."""
        if gate_up.few_rows_dtype is not torch.float32:
            gate, up = gate_up(torch.from_numpy(x), alone).chunk(2, -1)
            return as_float32(down(activation(gate).mul_(up), alone))
        return self.product(down, gated_rows(self.product(gate_up, x, alone), activation), alone)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, layer: int, rope: int = 0,
               window: int | None = None) -> np.ndarray:
        """attend_spans of this step's layer `layer`: rope table `rope` on q (n, H, D) and k (n, G, D),
        C-contiguous float32, then attention over each sequence's cache, keys within `window` (one of
        the step's windows); (n, H·D) float32 in the step's buffer "attention"."""
        out = self.buffer("attention", (q.shape[0], q.shape[1] * q.shape[2]))
        return self.rows[window].attend(q, k, v, self.ropes[rope], layer, out)
