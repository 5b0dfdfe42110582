"""One decode token's elementwise ops and attention as compiled kernels: rope, the gated
activations of the MLPs, and one query's GQA attention over the KV cache.

A decode step of SmolLM2's 30 layers spent ~12 ms per token outside the matmuls, most of it in
the dispatch of small torch ops (rope alone is six of them per call, ~50 µs; attention's cache
writes, casts and SDPA ~170 µs); one kernel call with its wrapper costs a few µs. Inputs the
kernels do not take (a prefill's rows, other devices and dtypes) keep torch's path.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit, prange, types
from numba.extending import overload

from pagelm.quant.matmul import _bf16_bits, _u32_as_f32

MAX_ROWS = 64  # rows (tokens × heads) of one decode step take the kernels; a prefill's keep torch's


def _cpu_f32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and not t.requires_grad for t in tensors)


# --- rope ---------------------------------------------------------------------------


@njit(cache=True)
def _rope(x, cos, sin):
    T, heads, _ = x.shape
    half = cos.shape[1]
    for t in range(T):
        for r in range(heads):
            for i in range(half):
                a, b = x[t, r, i], x[t, r, half + i]
                x[t, r, i] = a * cos[t, i] - b * sin[t, i]
                x[t, r, half + i] = b * cos[t, i] + a * sin[t, i]


def rope_rows_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """NeoX rope in place on the first 2·cos.shape[-1] dims of x (T, heads, D), qwen35.apply_rope_'s
    formula in float32 (torch fuses one multiply-add, so the two differ in the last bit), when x
    is a float32 CPU tensor of at most MAX_ROWS rows with unit stride in its last axis; False
    otherwise."""
    if not (_cpu_f32(x, cos, sin) and x.dim() == 3 and x.stride(-1) == 1 and x.shape[0] * x.shape[1] <= MAX_ROWS
            and cos.shape == sin.shape == (x.shape[0], cos.shape[-1]) and cos.is_contiguous() and sin.is_contiguous()):
        return False
    _rope(x.numpy(), cos.numpy(), sin.numpy())
    return True


# --- gated activations --------------------------------------------------------------

_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


@njit(cache=True)
def _silu_mul(g, u, out):
    for r in range(g.shape[0]):
        for i in range(g.shape[1]):
            v = g[r, i]
            out[r, i] = v / (np.float32(1) + np.exp(-v)) * u[r, i]


@njit(cache=True)
def _gelu_tanh_mul(g, u, out):
    for r in range(g.shape[0]):
        for i in range(g.shape[1]):
            v = g[r, i]
            inner = _GELU_C * (v + np.float32(0.044715) * v * v * v)
            out[r, i] = np.float32(0.5) * v * (np.float32(1) + np.tanh(inner)) * u[r, i]


_GATES = {"silu": (_silu_mul, lambda g: F.silu(g)), "gelu_tanh": (_gelu_tanh_mul, lambda g: F.gelu(g, approximate="tanh"))}


def gated_product(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) · up, act "silu" or "gelu_tanh" as torch defines them: one kernel for a few
    float32 CPU rows (T ≤ MAX_ROWS, unit stride in the last axis), torch's ops otherwise."""
    kernel, act = _GATES[kind]
    if not (_cpu_f32(gate, up) and gate.dim() == 2 and gate.shape == up.shape and gate.shape[0] <= MAX_ROWS
            and gate.stride(-1) == 1 and up.stride(-1) == 1):
        return act(gate).mul_(up)
    out = torch.empty(gate.shape, dtype=torch.float32)
    kernel(gate.numpy(), up.numpy(), out.numpy())
    return out


# --- one query's attention over the KV cache ----------------------------------------


def _kv(cache, g, j, d):
    """The cache value at (g, j, d) as float32: bf16 caches are handed over as their uint16 bits."""


@overload(_kv)
def _kv_impl(cache, g, j, d):
    if cache.dtype == types.uint16:

        def from_bf16(cache, g, j, d):
            return _u32_as_f32(np.uint32(cache[g, j, d]) << 16)

        return from_bf16
    return lambda cache, g, j, d: cache[g, j, d]


def _store(cache, g, j, d, v):
    """cache[g, j, d] = v, rounded to bf16 (nearest even, as torch's cast) for a bf16 cache."""


@overload(_store)
def _store_impl(cache, g, j, d, v):
    if cache.dtype == types.uint16:

        def to_bf16(cache, g, j, d, v):
            cache[g, j, d] = _bf16_bits(v)

        return to_bf16

    def plain(cache, g, j, d, v):
        cache[g, j, d] = v

    return plain


@njit(parallel=True, cache=True, fastmath={"contract", "reassoc"})
def _attend(q, k, v, ck, cv, pos, lo, scale, out):
    H, D = q.shape
    G = k.shape[0]
    for g in range(G):
        for d in range(D):
            _store(ck, g, pos, d, k[g, d])
            _store(cv, g, pos, d, v[g, d])
    span, group = pos + 1 - lo, H // G
    for h in prange(H):
        g = h // group
        p = np.empty(span, np.float32)
        top = np.float32(-np.inf)
        for j in range(span):
            s = np.float32(0)
            for d in range(D):
                s += q[h, d] * _kv(ck, g, lo + j, d)
            p[j] = s * scale
            top = max(top, p[j])
        total = np.float32(0)
        for j in range(span):
            p[j] = np.exp(p[j] - top)
            total += p[j]
        o = out[0, h * D : (h + 1) * D]
        o[:] = 0
        for j in range(span):
            for d in range(D):
                o[d] += p[j] * _kv(cv, g, lo + j, d)
        for d in range(D):
            o[d] /= total


def _kernel_view(cache: torch.Tensor) -> np.ndarray | None:
    if cache.device.type != "cpu" or not cache.is_contiguous():
        return None
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy() if cache.dtype == torch.float32 else None


def attend_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 pos: int, scale: float, lo: int = 0) -> torch.Tensor | None:
    """One token's GQA attention: writes k and v (1, G, D) at `pos` of the caches (G, max_len, D;
    bfloat16 or float32, rounded as torch's cast rounds), then softmax(q·Kᵀ·scale)·V over keys
    lo..pos for q (1, H, D), in float32 from the cache's exact values. Returns (1, H·D) float32,
    or None (nothing written) for inputs the kernel does not take: not one float32 CPU token,
    another cache dtype or layout."""
    if not (_cpu_f32(q, k, v) and q.dim() == k.dim() == v.dim() == 3 and q.shape[0] == k.shape[0] == v.shape[0] == 1
            and k.shape == v.shape and cache_k.shape == cache_v.shape and cache_k.dtype == cache_v.dtype
            and q.shape[1] % k.shape[1] == 0 and 0 <= lo <= pos < cache_k.shape[1]
            and cache_k.shape[0] == k.shape[1] and cache_k.shape[2] == k.shape[2] == q.shape[2]):
        return None
    ck, cv = _kernel_view(cache_k), _kernel_view(cache_v)
    if ck is None or cv is None:
        return None
    H, D = q.shape[1], q.shape[2]
    out = torch.empty(1, H * D, dtype=torch.float32)
    _attend(q[0].contiguous().numpy(), k[0].contiguous().numpy(), v[0].contiguous().numpy(), ck, cv, pos, lo,
            np.float32(scale), out.numpy())
    return out
