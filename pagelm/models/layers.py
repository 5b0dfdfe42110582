"""The layers every architecture is built of, in torch: RMS norm, rope, GQA attention over a KV cache
(causal, optionally sliding-window), the gated MLP, and the plain KV state with its checkpoints.

Owns the arithmetic an architecture file composes (one definition each, so every architecture's
bits are the same for the same operation); never loads weights and never knows a layer list.
Where one decode token's rows fit the compiled kernels (`norms`, `token_ops`) these call them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.errors import ModelFormatError, PagelmError
from pagelm.models.decoder import nbytes, per_sequence
from pagelm.models.norms import rms_norm_rows
from pagelm.models.token_ops import attend_token, attend_tokens, cache_views, rope_rows_, window_los
from pagelm.runtime.pages import ZeroedTensors


def check_config(where: str, counts: dict, checks) -> None:
    """A config's checks as every architecture makes them: each of `counts` (name -> value) at least 1,
    then each (ok, message) of `checks`; a ModelFormatError naming `where` at the first that fails."""
    for name, value in counts.items():
        if value < 1:
            raise ModelFormatError(f"{where}: {name} is {value}, expected >= 1")
    for ok, message in checks:
        if not ok:
            raise ModelFormatError(f"{where}: {message}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, tokens_alone: bool = False) -> torch.Tensor:
    """x * rsqrt(mean(x²) + eps) * w over the last axis (GGUF form: any +1 is already in w);
    `tokens_alone` as norms.rms_norm_rows'."""
    few = rms_norm_rows(x, w, eps, tokens_alone)
    return F.rms_norm(x, w.shape, w, eps) if few is None else few


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """NeoX (rotate-half) rope, in place, on the first 2·cos.shape[-1] dims of x (T, heads, D)."""
    if rope_rows_(x, cos, sin):
        return
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    c, s = cos[:, None], sin[:, None]
    r1 = x1 * c - x2 * s
    x2.mul_(c).addcmul_(x1, s)
    x1.copy_(r1)


def inv_freq(base: float, dim: int, device=None, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Rope inverse frequencies base^(-2i/dim), i < dim/2, in fp32 as transformers computes them;
    divided by per-pair `freq_factors` (GGUF's rope_freqs tensor) when given."""
    f = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    return f if freq_factors is None else f / freq_factors.to(device=device, dtype=torch.float32)


def yarn_inv_freq(base: float, dim: int, yarn, device=None) -> torch.Tensor:
    """Rope inverse frequencies under YaRN scaling (`rope_scaling.YarnScaling`), in float32 as
    transformers computes them: per pair, the interpolated frequency blended into the extrapolated
    one by a ramp over the pairs."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    low, high = yarn.ramp_ends(base, dim)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    return 1.0 / (yarn.factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated


def rope_tables(inv: torch.Tensor, pos: int, T: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, dim/2) fp32 for positions pos..pos+T-1 (divided by a linear scaling `scale`)."""
    positions = torch.arange(pos, pos + T, dtype=torch.float32, device=inv.device)
    if scale != 1.0:
        positions = positions / scale
    freqs = positions[:, None] * inv
    return freqs.cos(), freqs.sin()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
              pos: int, scale: float, window: int | None = None,
              views: tuple[np.ndarray, np.ndarray] | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """GQA attention of T new queries over the cache after writing the new keys and values.

    q (T, H, D), k and v (T, G, D) with rope already applied (any float dtype; stored in the
    cache's dtype). Query t (absolute position pos + t) sees keys j ≤ pos + t, and with `window`
    only those with pos + t − j < window (transformers' and llama.cpp's sliding window). One token
    takes the kernel over the cache's `views` (KVState.views) when given. `sinks` (H,) float32:
    gpt-oss's attention sinks, a learned logit per head in each softmax's denominator (`sink_attention`).
    Returns (T, H·D) in the cache dtype, or float32 from the one-token kernel (token_ops.attend_token).
    """
    ck, cv = cache
    T, H, D = q.shape
    G = k.shape[1]
    end = pos + T
    # the first key any query can see
    lo = 0 if window is None else max(0, pos + 1 - window)
    o = attend_token(q, k, v, views, pos, scale, lo) if T == 1 and sinks is None else None
    if o is not None:
        return o
    ck[:, pos:end] = k.transpose(0, 1)
    cv[:, pos:end] = v.transpose(0, 1)
    keys, values = ck[None, :, lo:end], cv[None, :, lo:end]  # (1, G, S, D)
    q = q.to(ck.dtype).transpose(0, 1)  # (H, T, D)
    if sinks is not None:
        return sink_attention(q, keys[0], values[0], pos, lo, window, sinks, scale)
    if T == 1:  # the H/G query heads of one kv head form its query rows
        o = F.scaled_dot_product_attention(q.reshape(1, G, H // G, D), keys, values, scale=scale)
        return o.reshape(1, H * D)
    if lo == 0 and pos == 0 and (window is None or T <= window):
        o = F.scaled_dot_product_attention(q[None], keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        qi = torch.arange(pos, end, device=q.device)[:, None]
        kj = torch.arange(lo, end, device=q.device)[None, :]
        mask = kj <= qi
        if window is not None:
            mask &= qi - kj < window
        o = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(T, H * D)


# Scores (float32) one chunk of sink_attention's queries holds at most (16 MiB)
SINK_CHUNK_VALUES = 1 << 22


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: int, lo: int, window: int | None,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention whose softmax has one more logit per head, `sinks[h]`, that weighs no value
    (gpt-oss's attention sinks), as transformers' eager attention computes it: scores in float32, the
    row's max subtracted, softmax, the sink's column dropped. q (H, T, D) at positions pos.., keys and
    values (G, S, D) at positions lo..; query t sees keys j <= pos + t (and, with `window`, those with
    pos + t - j < window). Queries go in chunks that bound the scores' memory. Returns (T, H·D)."""
    H, T, D = q.shape
    G, S, _ = keys.shape
    r = H // G
    out = torch.empty(T, H * D, dtype=values.dtype, device=q.device)
    kj = torch.arange(lo, lo + S, device=q.device)[None, :]
    step = max(1, SINK_CHUNK_VALUES // (H * S))
    for a in range(0, T, step):
        b = min(a + step, T)
        t = b - a
        scores = torch.matmul(q[:, a:b].reshape(G, r * t, D), keys.transpose(1, 2)).view(H, t, S).float() * scale
        qi = torch.arange(pos + a, pos + b, device=q.device)[:, None]
        hidden = kj > qi
        if window is not None:
            hidden |= qi - kj >= window
        scores.masked_fill_(hidden, float("-inf"))
        logits = torch.cat([scores, sinks.view(H, 1, 1).expand(H, t, 1)], -1)
        logits = logits - logits.amax(-1, keepdim=True)
        probs = torch.softmax(logits, -1)[..., :-1].to(values.dtype)
        o = torch.matmul(probs.reshape(G, r * t, S), values).view(H, t, D)
        out[a:b] = o.transpose(0, 1).reshape(t, H * D)
    return out


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """GQA attention of a whole input where every token sees every other (an encoder's pass, as
    EmbeddingGemma's): q (T, H, D), k and v (T, G, D) with rope applied; with `window`, only the
    keys within it each way (|i − j| < window). No cache. Returns (T, H·D) in q's dtype."""
    T, H, D = q.shape
    mask = None
    if window is not None and window < T:
        i = torch.arange(T, device=q.device)
        mask = (i[:, None] - i[None, :]).abs() < window
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.to(q.dtype).transpose(0, 1)[None],
                                       v.to(q.dtype).transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1).reshape(T, H * D)


def attend_spans(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list, i: int,
                 rope: tuple[torch.Tensor, torch.Tensor], scale: float, window: int | None = None) -> torch.Tensor | None:
    """Rope, then layer i's attention, of one token of each span's sequence (q (n, H, D), k and v
    (n, G, D), row j span j's, its state a KVState) in one kernel call (token_ops.attend_tokens),
    each row's bits those of its sequence alone; None, with nothing touched, where the kernels do
    not take them (then each sequence goes through apply_rope_ and `attention`)."""
    positions = [s.state.pos for s in spans]
    los = window_los(positions, window)
    return attend_tokens(q, k, v, [s.state.views[i] for s in spans], positions, scale, los, rope)


def gated_mlp(gate_up, down, y: torch.Tensor, activation, alone: bool, spans: list | None = None) -> torch.Tensor:
    """down(activation(gate) · up) of rows y, gate and up being the two halves of gate_up(y)
    (ffn_gate's rows, then ffn_up's); in the operators' dtype. `alone`: as Linear's. With `spans`
    (the rows of several sequences), the activation runs on each span's rows by itself: torch's
    elementwise kernels split a call's values among threads and vector lanes by the call's size, and
    a transcendental's scalar tail rounds unlike its vector body, so a row's bits would otherwise
    depend on how many other rows are in the call."""
    gate, up = gate_up(y, alone).chunk(2, -1)
    if spans is None or len(spans) == 1:
        return down(activation(gate).mul_(up), alone)
    gated = per_sequence(lambda s, _: activation(gate[s.lo : s.hi]), spans, [None] * len(spans))
    return down(gated.mul_(up), alone)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The depthwise causal conv of x (T, C) with w (K, C), tap K-1 on the current token; state
    (K-1, C) holds the previous K-1 inputs, oldest first, and is advanced in place."""
    T, K = x.shape[0], w.shape[0]
    xp = torch.cat((state, x))  # (K - 1 + T, C)
    out = x * w[K - 1]
    for j in range(K - 1):
        out.addcmul_(xp[j : j + T], w[j])
    state.copy_(xp[T:])
    return out


@dataclass(frozen=True)
class KVCheckpoint:
    """A deep copy of a KVState at `pos`: each layer's K[:, :pos] and V[:, :pos]."""

    pos: int
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def nbytes(self) -> int:
        return nbytes(t for pair in self.layers for t in pair)


class KVState:
    """One (K, V) cache pair per layer, each (n_kv_heads, max_len, head_dim) in the model dtype
    with rope applied to K; `pos` tokens are in it."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device):
        if max_len < 1:
            raise PagelmError(f"max_len {max_len} must be >= 1")
        self.pos, self.max_len = 0, max_len
        self._caches = ZeroedTensors((n_kv_heads, max_len, head_dim), 2 * n_layers, dtype, device)
        pairs = self._caches.tensors
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(pairs[::2], pairs[1::2]))
        self.views = [cache_views(k, v) for k, v in self.layers]  # the one-token attention kernel's

    @property
    def nbytes(self) -> int:
        """Resident bytes: the pages of the positions written so far (runtime.pages)."""
        return self._caches.nbytes

    def kv_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(self.layers)

    def fixed_tensors(self) -> list[torch.Tensor]:
        return []  # nothing but position-indexed K and V

    def checkpoint(self) -> KVCheckpoint:
        with torch.inference_mode():
            layers = tuple((k[:, : self.pos].clone(), v[:, : self.pos].clone()) for k, v in self.layers)
        return KVCheckpoint(self.pos, layers)

    def restore(self, ckpt: KVCheckpoint) -> None:
        """Return exactly to the state `ckpt` was taken from (of this state or one like it)."""
        if len(ckpt.layers) != len(self.layers) or ckpt.pos > self.max_len:
            raise PagelmError(
                f"checkpoint of {len(ckpt.layers)} layers at pos {ckpt.pos} does not fit a state of "
                f"{len(self.layers)} layers and max_len {self.max_len}"
            )
        for i, (dst, src) in enumerate(zip(self.layers, ckpt.layers)):
            for d, s in zip(dst, src):
                want = (d.shape[0], ckpt.pos, d.shape[2])
                if tuple(s.shape) != want or s.dtype != d.dtype:
                    raise PagelmError(f"checkpoint layer {i}: tensor {tuple(s.shape)} {s.dtype} does not match "
                                      f"the state's {want} {d.dtype}")
        with torch.inference_mode():
            for (dk, dv), (sk, sv) in zip(self.layers, ckpt.layers):
                dk[:, : ckpt.pos].copy_(sk)
                dv[:, : ckpt.pos].copy_(sv)
        self.pos = ckpt.pos
