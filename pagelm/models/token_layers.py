"""A layer's one-token step as one compiled call, from its attention norm to its FFN's activation (llama, Gemma 3, LFM2).

TokenStep's numpy step still runs ~40 Python operations a layer around the kernels (SmolLM2: ~30 µs a
layer with the caches warm, about twice that in a real step, after the products have streamed the
weights through the caches). `TokenLayers` runs a layer's norms, products, rope, attention and
residual adds in one compiled function that calls every kernel through its address (numba's
first-class functions): the very compiled code the numpy step calls, not compiled again into the
caller, so the same bits. The FFN's activation stays torch's (its bits): the one return to Python a
layer. Taken where every product is a MappedLinear of GGML rows without int8 activations.
Gemma 3's layers add q/k norms, a norm of each sublayer's output, and a rope table and a window per
layer kind (global, sliding); qwen2's a bias of q/k/v, qwen3's q/k norms; LFM2 conv layers between
its attention layers.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import from_dtype, njit, typed, typeof, types

from pagelm.models.norms import rms_rows
from pagelm.models.token_ops import TokenStep, attend_heads, conv_tokens, gated_rows, rope_heads, view_dtype
from pagelm.quant.codegen import F16_TO_F32
from pagelm.quant.matmul import gemv_kernels, readonly
from pagelm.quant.precompile import Job
from pagelm.runtime.threads import kernel_threads
from pagelm.weights.linear import MappedLinear, RowGroup

_ROWS = types.Array(types.float32, 2, "C")
_HEADS = types.Array(types.float32, 3, "C")
_INTS = types.Array(types.int64, 1, "C")
_GEMV = types.FunctionType(types.void(
    types.Array(types.uint8, 1, "C", readonly=True), types.Array(types.int64, 1, "C", readonly=True), types.int64,
    types.int64, types.Array(types.float32, 2, "C", readonly=True), types.Array(types.float32, 1, "C", readonly=True),
    _ROWS, types.int64, types.int64, types.int64))
_NORM = types.FunctionType(types.void(_ROWS, types.Array(types.float32, 1, "C"), types.float64, _ROWS))
_ROPE = types.FunctionType(types.void(_HEADS, _ROWS, _ROWS))

QKV, OUT, GATE_UP, DOWN = range(4)  # a layer's products, in `products`' second axis
# A layer's norms, in order: llama's first two, Gemma 3's all six
NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
ATTN_NORM, FFN_NORM, Q_NORM, K_NORM, POST_ATTN_NORM, POST_FFN_NORM = range(6)


@njit(cache=True)
def _empty(kind):
    return typed.List.empty_list(kind)


@njit(cache=True)
def _append(items, item):
    items.append(item)


def _arrays(arrays: list) -> typed.List:
    """arrays (of one type) as a typed list, built by cached compiled calls: a process whose numba cache is warm
    compiles nothing, where typed.List's own methods compile for each item type in every process; no copy."""
    out = _empty(typeof(arrays[0]))
    for a in arrays:
        _append(out, a)
    return out


def _functions(kind: types.FunctionType, *fns) -> typed.List:
    """fns as a typed list of one first-class function type, called from compiled code by address; built as
    _arrays is, by _append compiled for `kind`, whose entry takes each dispatcher as a function of that type
    (the addresses typed.List.append stores; a dispatcher's own type would compile _append for each kernel)."""
    out = _empty(kind)
    append = _append.compile((types.ListType(kind), kind))
    for fn in fns:
        append(out, fn)
    return out


@njit(cache=True)
def _slot(per, i, slot):
    """Layer i's norm `slot` in a list of `per` norms a layer, or -1 where the layers have no such norm."""
    return per * i + slot if slot < per else -1


@njit(cache=True)
def _product(gemv, datas, offsets, parts, f16, threads, span, x, out):
    """out = x · Wᵀ over the parts span[0]:span[1] of `parts` (kernel one row, kernel few rows, data, rows,
    out_lo, width), as MappedLinear.rows calls them."""
    few = 0 if x.shape[0] == 1 else 1
    for p in range(span[0], span[1]):
        rows = parts[p, 3]
        gemv[parts[p, few]](datas[parts[p, 2]], offsets[p], 0, rows, x, f16, out, parts[p, 4], parts[p, 5],
                            max(min(rows, threads), 1))


@njit(cache=True)
def _add(h, r):
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[i, j] += r[i, j]


@njit(cache=True)
def _residual(norm, norms, at, eps, r, y, h):
    """h += r, or h += norm(r, norms[at]) where at >= 0 (Gemma 3 norms each sublayer's output); y: scratch."""
    if at >= 0:
        norm[0](r, norms[at], eps, y)
        _add(h, y)
    else:
        _add(h, r)


@njit(cache=True)
def _down(gemv, datas, offsets, parts, f16, threads, span, act, r, h, norm, norms, post, eps, y):
    """h += down(act) (normed by norms[post] where post >= 0): a layer's last product and residual add."""
    _product(gemv, datas, offsets, parts, f16, threads, span, act, r)
    _residual(norm, norms, post, eps, r, y, h)


@njit(cache=True)
def last_down(gemv, datas, offsets, parts, f16, threads, span, act, r, h, norm, norms, post, eps, y):
    """_down of the last layer (the one compiled call after the layers' loop; never called from compiled code,
    so that a benchmark may time it in its place)."""
    _down(gemv, datas, offsets, parts, f16, threads, span, act, r, h, norm, norms, post, eps, y)


def _attend_kind(like: np.dtype) -> types.FunctionType:
    """attend_heads' type as TokenLayers calls it, over KV caches whose kernel views are of dtype `like`."""
    return types.FunctionType(types.void(_HEADS, _HEADS, _HEADS, _INTS, _INTS, types.Array(from_dtype(like), 3, "C"),
                                         _INTS, _INTS, _INTS, types.float32, _ROWS))


def warmup(like: str) -> None:
    """Compiles (or loads) TokenLayers' kernels that no block type decides, for KV caches whose kernel views are
    of numpy dtype `like` (uint16: bf16 bits; float32): the builders of its typed lists of every item type it
    lists, its norm, rope and attention functions. What is left compiles at the first step: the layers'
    own calls (to_activation, last_down), which need the block types' GEMVs first."""
    for items in ([readonly(np.zeros(1, np.uint8))], [readonly(np.zeros(1, np.int64))], [np.zeros(1, np.float32)],
                  [np.zeros((1, 1), np.float32)]):
        _arrays(items)
    _empty(_GEMV)
    _append.compile((types.ListType(_GEMV), _GEMV))
    _functions(_NORM, rms_rows)
    _functions(_ROPE, rope_heads)
    _functions(_attend_kind(np.dtype(like)), attend_heads)


def warmup_jobs(layers: list, kv_dtype: torch.dtype) -> list[Job]:
    """The worker job of `warmup` for layers TokenLayers takes, with KV caches of `kv_dtype` (none otherwise),
    run at load beside the block types' (weights.loader.WeightLoader.warmup)."""
    if not TokenLayers.take(layers):
        return []
    return [Job(__name__, "warmup", (view_dtype(kv_dtype),), (_empty, _append, rms_rows, rope_heads, attend_heads), "", cost=4.0)]


_NO_CONV = np.zeros((0, 0), np.int64)  # conv windows' addresses of a model without conv layers


@njit(cache=True)
def to_activation(i, gemv, datas, offsets, parts, products, f16, threads, norm, norms, biases, eps, rope, cos, sin,
                  kinds, slots, taps, conv_at, attend, k_at, v_at, like, lens, pos, los, scale, h, y, proj, q, k, v,
                  qn, kn, o, conv_proj, conv_out, r, gu, act):
    """Layer i up to its FFN's activation: the previous layer's down product of `act` added to h (i > 0),
    the attention norm, the mixer, its output product added to h (normed where layers norm it), the FFN
    norm, gate/up into gu. The mixer: attention (slots[i] >= 0, the layer's KV caches): q/k/v (plus
    biases[i], empty where the layer has none; normed per head where layers have q/k norms), rope,
    attention; or LFM2's short convolution (slots[i] < 0: its conv windows conv_at[-1 - slots[i]], taps
    taps[i]) over in_proj's rows (conv_proj), into conv_out. kinds[i] picks the layer's rope table (cos[kinds[i]],
    sin[...]) and first keys (los[kinds[i]])."""
    per = len(norms) // products.shape[0]
    if i > 0:
        _down(gemv, datas, offsets, parts, f16, threads, products[i - 1, DOWN], act, r, h, norm, norms,
              _slot(per, i - 1, POST_FFN_NORM), eps, y)
    norm[0](h, norms[per * i + ATTN_NORM], eps, y)
    n, H, D = q.shape
    slot = slots[i]
    if slot < 0:
        _product(gemv, datas, offsets, parts, f16, threads, products[i, QKV], y, conv_proj)
        conv_tokens(taps[i], conv_at[-1 - slot], conv_proj, conv_out)
        out = conv_out
    else:
        _product(gemv, datas, offsets, parts, f16, threads, products[i, QKV], y, proj)
        bias = biases[i]
        for s in range(proj.shape[0]):
            for c in range(bias.shape[0]):
                proj[s, c] += bias[c]
        G = k.shape[1]
        for s in range(n):
            for c in range(H * D):
                q[s, c // D, c % D] = proj[s, c]
            for c in range(G * D):
                k[s, c // D, c % D] = proj[s, H * D + c]
                v[s, c // D, c % D] = proj[s, (H + G) * D + c]
        if per > K_NORM:
            norm[0](q.reshape((n * H, D)), norms[per * i + Q_NORM], eps, qn.reshape((n * H, D)))
            norm[0](k.reshape((n * G, D)), norms[per * i + K_NORM], eps, kn.reshape((n * G, D)))
        else:
            qn, kn = q, k
        t = kinds[i]
        rope[0](qn, cos[t], sin[t])
        rope[0](kn, cos[t], sin[t])
        attend[0](qn, kn, v, k_at[slot], v_at[slot], like, lens, pos, los[t], scale, o)
        out = o
    _product(gemv, datas, offsets, parts, f16, threads, products[i, OUT], out, r)
    _residual(norm, norms, _slot(per, i, POST_ATTN_NORM), eps, r, y, h)
    norm[0](h, norms[per * i + FFN_NORM], eps, y)
    _product(gemv, datas, offsets, parts, f16, threads, products[i, GATE_UP], y, gu)


class TokenLayers:
    """A model's layers as TokenLayers.run takes them: every kernel and every part of every product
    (RowGroup: a GGML type's kernels, its data, offsets, rows), each layer's norms (the first `per` of
    NORMS), q/k/v bias (`qkv_bias`, where a layer has one), kind (the index of its rope table and
    attention window in the step's) and state slot (its KV caches' index; for LFM2's conv layers, which
    have `taps`, -1 - the index of its conv windows), built once per model. A conv layer's `qkv` is its
    in_proj, and its q/k norms (where `per` has them) are unused."""

    def __init__(self, layers: list, per: int, kinds: list[int], slots: list[int]):
        kernels, datas, offsets, parts, products = {}, {}, [], [], []
        for w in layers:
            spans = []
            for linear in (w.qkv, w.out, w.gate_up, w.down):
                first = len(parts)
                for p in linear.parts:
                    if p.ggml_type not in kernels:
                        kernels[p.ggml_type] = 2 * len(kernels)
                    if id(p.data) not in datas:  # the file maps, in order: index i is datas' i-th
                        datas[id(p.data)] = (len(datas), readonly(p.data))
                    offsets.append(readonly(p.offsets))
                    parts.append((kernels[p.ggml_type], kernels[p.ggml_type] + 1, datas[id(p.data)][0], p.rows,
                                  p.out_lo, p.width))
                spans.append((first, len(parts)))
            products.append(spans)
        self.gemv = _functions(_GEMV, *(k for t in kernels for k in gemv_kernels(t)))
        self.datas = _arrays([d for _, d in datas.values()])
        self.offsets = _arrays(offsets)
        self.parts = np.array(parts, np.int64)
        self.products = np.array(products, np.int64)
        self.norms = _arrays([getattr(w, name).numpy() for w in layers for name in NORMS[:per]])
        no_bias = np.zeros(0, np.float32)
        self.biases = _arrays([no_bias if getattr(w, "qkv_bias", None) is None else w.qkv_bias.numpy()
                               for w in layers])
        no_taps = np.zeros((0, 0), np.float32)
        self.taps = _arrays([no_taps if getattr(w, "taps", None) is None else w.taps.numpy() for w in layers])
        self.per, self.kinds, self.slots = per, np.array(kinds, np.int64), np.array(slots, np.int64)
        self.norm, self.rope = _functions(_NORM, rms_rows), _functions(_ROPE, rope_heads)
        self._attend = {}

    @staticmethod
    def take(layers: list) -> bool:
        """Whether every product of the layers is GGML rows read in place without int8 (what TokenLayers runs)."""
        linears = [linear for w in layers for linear in (w.qkv, w.out, w.gate_up, w.down)]
        return all(isinstance(m, MappedLinear) and all(type(p) is RowGroup and not p.takes_int8 for p in m.parts)
                   for m in linears)

    @classmethod
    def of(cls, layers: list, per: int = 2, kinds: list[int] | None = None,
           slots: list[int] | None = None) -> TokenLayers | None:
        """The layers' calls (kinds: default all 0; slots: default each layer's index), or None where they do not
        `take` them."""
        if not cls.take(layers):
            return None
        return cls(layers, per, [0] * len(layers) if kinds is None else kinds,
                   list(range(len(layers))) if slots is None else slots)

    def _attend_function(self, like: np.ndarray) -> typed.List:
        fn = self._attend.get(like.dtype)
        if fn is None:
            fn = self._attend[like.dtype] = _functions(_attend_kind(like.dtype), attend_heads)
        return fn

    def run(self, step: TokenStep, H: int, G: int, D: int, eps: float, activation, windows: tuple = (None,),
            conv_at: np.ndarray = _NO_CONV):
        """The step's layers: a generator yielding after each layer's activation (as _layers does) whose
        result is h after the last layer (step.h, in place). windows[k], step.ropes[k]: kind k's window
        and rope table; conv_at[j, s]: the address of sequence s's window of conv layer j (float32,
        C-contiguous)."""
        h = step.h
        n = h.shape[0]
        first = step.rows[windows[0]]
        cos, sin = (np.stack([table[j] for table in step.ropes]) for j in (0, 1))
        los = np.stack([step.rows[w].los for w in windows])
        buffer = step.buffer
        y, proj = buffer("norm", h.shape), buffer("qkv", (n, (H + 2 * G) * D))
        q, k, v = (buffer(name, (n, heads, D)) for name, heads in (("q", H), ("k", G), ("v", G)))
        qn, kn = (buffer(name, (n, heads, D)) for name, heads in (("q normed", H), ("k normed", G))) \
            if self.per > K_NORM else (q, k)  # q/k normed per head, where the layers have those norms
        o, r = buffer("attention", (n, H * D)), buffer("residual", h.shape)
        conv_proj, conv_out = (buffer("conv in", (n, 3 * h.shape[1])), buffer("conv out", h.shape)) if len(conv_at) \
            else (y, y)  # no conv layer
        attend, threads = self._attend_function(first.like), kernel_threads()
        gate_up = self.parts[self.products[0, GATE_UP, 1] - 1]
        gu = buffer("gate_up", (n, gate_up[4] + gate_up[3]))
        act = buffer("activation", (n, gu.shape[1] // 2))
        L = self.products.shape[0]
        for i in range(L):
            to_activation(i, self.gemv, self.datas, self.offsets, self.parts, self.products, F16_TO_F32, threads,
                          self.norm, self.norms, self.biases, eps, self.rope, cos, sin, self.kinds, self.slots,
                          self.taps, conv_at, attend, first.k_at, first.v_at, first.like, first.lens, first.positions,
                          los, first.scale, h, y, proj, q, k, v, qn, kn, o, conv_proj, conv_out, r, gu, act)
            gated_rows(gu, activation, act)
            yield
        last_down(self.gemv, self.datas, self.offsets, self.parts, F16_TO_F32, threads, self.products[-1, DOWN], act,
                  r, h, self.norm, self.norms, _slot(self.per, L - 1, POST_FFN_NORM), eps, y)
        return h
