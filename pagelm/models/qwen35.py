"""Qwen3.5 text decoder: gated attention every Nth layer, Gated DeltaNet in the others; the dense
members (llama.cpp's `qwen35`) and the mixtures of experts (`qwen35moe`: Qwen3.5-35B-A3B), whose every
feed-forward is `models.moe.Experts`: a softmax router, the top-k experts always renormalized (as
transformers and llama.cpp do; no expert_weights_norm is read) and a shared expert scaled by the
sigmoid of its gate (ffn_gate_inp_shexp). A file's multi-token-prediction layer (`Qwen35Mtp`) drafts
for speculative decoding.

Owns the qwen35 math in its GGUF conventions (see design/qwen35.md) and the decode state (KV
caches, conv and recurrent states, checkpoints); never parses files (config values, small
tensors and linear operators come from a `WeightLoader`), never embeds tokens and never
computes the output head.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.models.decoder import Decoder, Span, advance, keep, kept_copies, nbytes, per_sequence
from pagelm.models.delta_rule import delta_rule_step, deltanet_tokens
from pagelm.models.delta_rule import warmup_job as deltanet_warmup_job
from pagelm.models.llama_family import expert_names, load_experts, moe_metadata
from pagelm.models.moe import Experts
from pagelm.models.layers import (apply_rope_, attention, causal_conv1d, check_config, gated_mlp, inv_freq, rms_norm,
                                  rope_tables)
from pagelm.models.token_ops import RopeRows, attend_tokens, cache_views, token_ropes
from pagelm.models.token_ops import warmup_job as attention_warmup_job
from pagelm.runtime.pages import ZeroedTensors
from pagelm.weights.hf import (HFConfig, HFLayout, TensorMap, decoder_hf_config, decoder_metadata, heads_tiled,
                               hf_rope, layer_period, rope_scaling, shift_norms, tensor_maps)
from pagelm.weights.linear import Linear
from pagelm.weights.loader import WeightLoader

ARCH, MOE_ARCH = "qwen35", "qwen35moe"
GGUF_ARCHITECTURES = (ARCH, MOE_ARCH)  # general.architecture values read here (pagelm.models' registry)
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", *MOE_MODEL_TYPES)  # config.json model_types read here
CHUNK = 64  # tokens per chunk of the chunked gated-delta rule
L2_EPS = 1e-6  # the L2 normalisation of DeltaNet q and k (fla's constant, not the rms eps)


# ---------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Qwen35Config:
    hidden: int
    n_layers: int
    ffn: int  # the dense feed-forward's width; qwen35moe: 0 unless the file says (no layer has one)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rms_eps: float
    conv_kernel: int
    linear_key_dim: int  # DeltaNet key (and query) head dim: ssm.state_size
    n_key_heads: int  # ssm.group_count
    n_value_heads: int  # ssm.time_step_rank
    linear_value_dim: int  # ssm.inner_size // n_value_heads
    full_attention_interval: int
    vocab: int  # rows of token_embd
    # multimodal rope: frequency pairs turned by the (t, h, w) positions, interleaved (mrope_axes);
    # empty: every pair by t, which for text is plain rope
    rope_sections: tuple[int, ...] = ()
    arch: str = ARCH  # general.architecture, the metadata keys' prefix
    # qwen35moe: each layer's experts (expert_count, expert_used_count, expert_feed_forward_length) and
    # its shared expert's width (expert_shared_feed_forward_length); all 0 in qwen35
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    # multi-token prediction: layers after the n_layers of the trunk (GGUF nextn_predict_layers, which
    # block_count counts); the first, blk.{n_layers}, is an attention layer whose stem reads a token's
    # embedding and the trunk's last hidden state (Qwen35Mtp)
    mtp_layers: int = 0
    expert_norm = True  # the top-k weights renormalized (not a field: qwen35moe always does)

    @classmethod
    def from_loader(cls, model: WeightLoader) -> Qwen35Config:
        arch = model.architecture  # the keys' prefix
        if arch not in GGUF_ARCHITECTURES:
            raise ModelFormatError(f"{model.name}: metadata key 'general.architecture' is {arch!r:.40}, expected "
                                   f"one of {', '.join(GGUF_ARCHITECTURES)}")

        def i(key: str) -> int:
            return model.get_int(f"{arch}.{key}")

        moe = arch == MOE_ARCH
        hidden = i("embedding_length")
        n_value_heads = i("ssm.time_step_rank")
        inner = i("ssm.inner_size")
        sections = f"{arch}.rope.dimension_sections"
        mtp = i("nextn_predict_layers") if model.has(f"{arch}.nextn_predict_layers") else 0
        if not 0 <= mtp < i("block_count"):
            raise ModelFormatError(f"{model.name}: metadata key '{arch}.nextn_predict_layers' is {mtp}, expected 0 up "
                                   f"to block_count - 1 ({i('block_count') - 1}): the layers after the model's")
        embd = model.dims("token_embd.weight")
        if len(embd) != 2 or embd[0] != hidden:
            raise ModelFormatError(
                f"{model.name}: tensor 'token_embd.weight' has dims {embd} (ne0 first), expected ({hidden}, vocab)"
            )
        if n_value_heads < 1 or inner % n_value_heads:
            raise ModelFormatError(
                f"{model.name}: metadata key '{arch}.ssm.inner_size' ({inner}) is not a multiple of "
                f"'{arch}.ssm.time_step_rank' ({n_value_heads})"
            )
        config = cls(
            hidden=hidden,
            n_layers=i("block_count") - mtp,
            mtp_layers=mtp,
            n_heads=i("attention.head_count"),
            n_kv_heads=i("attention.head_count_kv"),
            head_dim=i("attention.key_length"),
            rope_dim=i("rope.dimension_count"),
            rope_base=model.get_float(f"{arch}.rope.freq_base"),
            rms_eps=model.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
            conv_kernel=i("ssm.conv_kernel"),
            linear_key_dim=i("ssm.state_size"),
            n_key_heads=i("ssm.group_count"),
            n_value_heads=n_value_heads,
            linear_value_dim=inner // n_value_heads,
            full_attention_interval=i("full_attention_interval"),
            vocab=embd[1],
            rope_sections=tuple(model.get_int_array(sections)) if model.has(sections) else (),
            arch=arch,
            ffn=0 if moe and not model.has(f"{arch}.feed_forward_length") else i("feed_forward_length"),
            **(dict(n_experts=i("expert_count"), n_experts_used=i("expert_used_count"),
                    expert_ffn=i("expert_feed_forward_length"), shared_ffn=i("expert_shared_feed_forward_length"))
               if moe else {}),
        )
        if model.has(f"{arch}.attention.value_length"):
            value_length = i("attention.value_length")
            if value_length != config.head_dim:
                raise ModelFormatError(
                    f"{model.name}: metadata key '{arch}.attention.value_length' is {value_length}, "
                    f"expected the key length {config.head_dim}"
                )
        config.validate(model.name)
        return config

    def validate(self, where: str | None = None) -> None:
        where = where or f"{self.arch} config"
        # the counts that must be >= 1: a mixture of experts has its experts' and no dense width
        moe = ("n_experts", "n_experts_used", "expert_ffn", "shared_ffn")
        skip = ("rope_base", "rms_eps", "rope_sections", "arch", "mtp_layers", *(("ffn",) if self.is_moe else moe))
        counts = {name: value for name, value in vars(self).items() if name not in skip}
        check_config(where, counts, (
            (self.n_heads % self.n_kv_heads == 0, f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}"),
            (self.n_value_heads % self.n_key_heads == 0, f"ssm.time_step_rank {self.n_value_heads} is not a multiple of ssm.group_count {self.n_key_heads}"),
            (self.rope_dim % 2 == 0 and self.rope_dim <= self.head_dim, f"rope.dimension_count {self.rope_dim} must be even and <= key_length {self.head_dim}"),
            (self.rope_base > 0, f"rope.freq_base {self.rope_base} must be > 0"),
            (self.rms_eps > 0, f"attention.layer_norm_rms_epsilon {self.rms_eps} must be > 0"),
            (self.conv_kernel >= 2, f"ssm.conv_kernel {self.conv_kernel} must be >= 2"),
            (all(0 <= n <= self.rope_dim for n in self.rope_sections),
             f"rope.dimension_sections {list(self.rope_sections)[:8]} must be counts of frequency pairs"),
            (self.n_experts_used <= self.n_experts,
             f"expert_used_count {self.n_experts_used} exceeds expert_count {self.n_experts}"),
        ))

    @property
    def is_moe(self) -> bool:
        return self.arch == MOE_ARCH

    def is_attention_layer(self, i: int) -> bool:
        """Whether layer i is gated attention: every full_attention_interval-th of the trunk, and the
        multi-token-prediction layer after it."""
        return i >= self.n_layers or i % self.full_attention_interval == self.full_attention_interval - 1

    @property
    def conv_channels(self) -> int:
        """DeltaNet q | k | v channels: the conv1d width."""
        return 2 * self.n_key_heads * self.linear_key_dim + self.n_value_heads * self.linear_value_dim


# ---------------------------------------------------------------------------------- state


@dataclass
class KVCache:
    k: torch.Tensor  # (n_kv_heads, max_len, head_dim), model dtype, rope applied
    v: torch.Tensor

    def __post_init__(self):
        self.views = cache_views(self.k, self.v)  # the one-token attention kernel's


@dataclass
class DeltaNetCache:
    conv: torch.Tensor  # (kernel - 1, channels) fp32: the last inputs of the conv, oldest first
    recurrent: torch.Tensor  # (n_value_heads, key_dim, value_dim) fp32



@dataclass(frozen=True)
class Qwen35Checkpoint:
    """A deep copy of a state at `pos`: KV[:pos] of attention layers, conv and recurrent states."""

    pos: int
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def nbytes(self) -> int:
        return nbytes(t for pair in self.layers for t in pair)


class Qwen35State:
    """Per-layer decode state for `max_len` positions (KV pages resident once written); `pos` tokens are in it."""

    def __init__(self, config: Qwen35Config, max_len: int, dtype: torch.dtype, device: torch.device):
        if max_len < 1:
            raise PagelmError(f"max_len {max_len} must be >= 1")
        self.pos, self.max_len = 0, max_len
        c = config
        self.layers: list[KVCache | DeltaNetCache] = []
        attention_layers = sum(map(c.is_attention_layer, range(c.n_layers)))
        self._caches = ZeroedTensors((c.n_kv_heads, max_len, c.head_dim), 2 * attention_layers, dtype, device)
        caches = iter(self._caches.tensors)
        for i in range(c.n_layers):
            if c.is_attention_layer(i):
                self.layers.append(KVCache(next(caches), next(caches)))
            else:
                conv = torch.zeros(c.conv_kernel - 1, c.conv_channels, device=device)
                rec = torch.zeros(c.n_value_heads, c.linear_key_dim, c.linear_value_dim, device=device)
                self.layers.append(DeltaNetCache(conv, rec))

    def _tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(s.k, s.v) if isinstance(s, KVCache) else (s.conv, s.recurrent) for s in self.layers]

    def kv_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The attention layers' (K, V) caches, (n_kv_heads, max_len, head_dim) each."""
        return [(s.k, s.v) for s in self.layers if isinstance(s, KVCache)]

    def fixed_tensors(self) -> list[torch.Tensor]:
        """The state that is not indexed by position: each DeltaNet layer's conv and recurrent state."""
        return [t for s in self.layers if isinstance(s, DeltaNetCache) for t in (s.conv, s.recurrent)]

    @property
    def nbytes(self) -> int:
        """Resident bytes: the KV pages of the positions written so far (runtime.pages) and the
        DeltaNet states."""
        return self._caches.nbytes + nbytes(self.fixed_tensors())

    def checkpoint(self) -> Qwen35Checkpoint:
        with torch.inference_mode():
            layers = tuple(
                (s.k[:, : self.pos].clone(), s.v[:, : self.pos].clone()) if isinstance(s, KVCache)
                else (s.conv.clone(), s.recurrent.clone())
                for s in self.layers
            )
        return Qwen35Checkpoint(self.pos, layers)

    def restore(self, ckpt: Qwen35Checkpoint) -> None:
        """Return exactly to the state `ckpt` was taken from (of this state or one like it)."""
        if len(ckpt.layers) != len(self.layers) or ckpt.pos > self.max_len:
            raise PagelmError(
                f"checkpoint of {len(ckpt.layers)} layers at pos {ckpt.pos} does not fit a state of "
                f"{len(self.layers)} layers and max_len {self.max_len}"
            )
        for i, (dst, src) in enumerate(zip(self._tensors(), ckpt.layers)):
            kv = isinstance(self.layers[i], KVCache)
            for d, s in zip(dst, src):
                want = (d.shape[0], ckpt.pos, d.shape[2]) if kv else tuple(d.shape)
                if tuple(s.shape) != want or s.dtype != d.dtype:
                    raise PagelmError(f"checkpoint layer {i}: tensor {tuple(s.shape)} {s.dtype} does not match the state's {want} {d.dtype}")
        with torch.inference_mode():
            for (d0, d1), (s0, s1), layer in zip(self._tensors(), ckpt.layers, self.layers):
                if isinstance(layer, KVCache):
                    d0[:, : ckpt.pos].copy_(s0)
                    d1[:, : ckpt.pos].copy_(s1)
                else:
                    d0.copy_(s0)
                    d1.copy_(s1)
        self.pos = ckpt.pos


# ---------------------------------------------------------------------------------- math


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def mrope_axes(sections: Sequence[int], pairs: int) -> torch.Tensor:
    """Which position (0 t, 1 h, 2 w) turns each of the `pairs` rope frequencies: transformers'
    interleaved M-RoPE, pair i by h when i % 3 == 1 and i < 3·sections[1], by w when i % 3 == 2
    and i < 3·sections[2], else by t ([11, 11, 10] over 32 pairs: t h w, ten times, then t h)."""
    axes = torch.zeros(pairs, dtype=torch.long)
    for axis in (1, 2):
        if axis < len(sections):
            axes[axis : 3 * sections[axis] : 3] = axis
    return axes


def mrope_positions(first: int, length: int, images: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """The (3, length) t/h/w rope positions of `length` tokens whose first text position is
    `first`, with images at (offset, rows, columns): the offset of the image's first token among
    them and its merged grid, in order; and the position of the token after them.

    Text advances by one per token (t = h = w). An image starting at st puts its token (r, c) at
    (st, st + r, st + c), and the text after it at st + max(rows, columns) (transformers'
    get_rope_index)."""
    positions = torch.empty(3, length, dtype=torch.long)
    at, position = 0, first
    for offset, rows, columns in images:
        positions[:, at:offset] = torch.arange(position, position + offset - at)
        position += offset - at
        end = offset + rows * columns
        positions[0, offset:end] = position
        positions[1, offset:end] = position + torch.arange(rows).repeat_interleave(columns)
        positions[2, offset:end] = position + torch.arange(columns).repeat(rows)
        position += max(rows, columns)
        at = end
    positions[:, at:] = torch.arange(position, position + length - at)
    return positions, position + length - at


def _tile_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """(..., nk, d) -> (..., n, d): head j is x's head j mod nk (GGUF's tiled value-head order)."""
    r = n // x.shape[-2]
    return x if r == 1 else x.repeat(*([1] * (x.dim() - 2)), r, 1)


def gated_delta_rule_recurrent(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule token by token; advances `state` (nv, dk, dv) in place.

    q, k: (T, nk, dk) normalised (q also scaled); v: (T, nv, dv); g (log decay), beta: (T, nv);
    all fp32. Value head j reads key head j mod nk. Per token: S = e^g·S; δ = β(v − Sᵀk);
    S += k δᵀ; o = Sᵀq, computed as o = e^g·S₀ᵀq + (k·q)δ from one read of the old state.
    Returns o (T, nv, dv). On the CPU each token is one compiled step (`delta_rule.delta_rule_step`).
    """
    T, nv, dv = v.shape
    out = torch.empty(T, nv, dv, dtype=torch.float32, device=v.device)
    if v.device.type == "cpu" and state.is_contiguous():
        for t in range(T):
            out[t] = delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
        return out
    decay = g.exp()
    for t in range(T):
        kq = torch.stack((k[t], q[t]), 1)  # (nk, 2, dk)
        if nv != kq.shape[0]:
            kq = kq.repeat(nv // kq.shape[0], 1, 1)  # (nv, 2, dk), tiled
        read = torch.bmm(kq, state)  # (nv, 2, dv): S₀ᵀk, S₀ᵀq
        e = decay[t, :, None]
        delta = (v[t] - e * read[:, 0]).mul_(beta[t, :, None])
        kdotq = (kq[:, 0] * kq[:, 1]).sum(-1, keepdim=True)
        torch.addcmul(e * read[:, 1], kdotq, delta, out=out[t])
        state.mul_(e[:, :, None]).baddbmm_(kq[:, 0, :, None], delta[:, None])
    return out


def gated_delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same result as `gated_delta_rule_recurrent`, `chunk` tokens at a time (WY/UT form).

    Within a chunk with cumulative log decay γ (and Δ the rows δ_t):
      (I + A) Δ = βV − diag(β e^γ) K S₀, A[t,s] = β_t e^{γ_t−γ_s} k_t·k_s for s < t
      O = diag(e^γ) Q S₀ + M Δ,          M[t,s] = e^{γ_t−γ_s} q_t·k_s for s ≤ t
      S = e^{γ_C} S₀ + (diag(e^{γ_C−γ}) K)ᵀ Δ
    so one triangular solve per chunk (for all chunks at once) and a short scan over chunks.
    """
    T, nv, dv = v.shape
    dk = k.shape[-1]
    f32 = torch.float32
    # head-major, value heads tiled over key heads, padded to whole chunks (padding: k = v = 0,
    # g = 0, beta = 0, so it neither decays nor writes the state)
    pad = -T % chunk
    n = (T + pad) // chunk

    def heads(x, width):
        x = _tile_heads(x, nv).transpose(0, 1)  # (nv, T, d)
        return F.pad(x, (0, 0, 0, pad)).reshape(nv, n, chunk, width)

    q, k, v = heads(q, dk), heads(k, dk), heads(v, dv)
    g = F.pad(g.T, (0, pad)).reshape(nv, n, chunk)
    beta = F.pad(beta.T, (0, pad)).reshape(nv, n, chunk, 1)

    gamma = g.cumsum(-1)  # (nv, n, C)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).triu(1)
    pair_decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill_(upper, float("-inf")).exp_()
    k_beta = k * beta
    a = (k_beta @ k.transpose(-1, -2)).mul_(pair_decay)  # only the strict lower part is read
    m = (q @ k.transpose(-1, -2)).mul_(pair_decay)
    del pair_decay
    e_gamma = gamma.exp()[..., None]
    rhs = torch.cat((v * beta, k_beta * e_gamma), -1)  # (nv, n, C, dv + dk)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u, w = sol[..., :dv], sol[..., dv:]
    q_decayed = q * e_gamma
    k_decayed = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # (nv, n, 1, 1)

    out = torch.empty(n, nv, chunk, dv, dtype=f32, device=v.device)
    s = state
    for i in range(n):
        delta = torch.baddbmm(u[:, i], w[:, i], s, alpha=-1)  # (nv, C, dv)
        o = torch.bmm(q_decayed[:, i], s, out=out[i])
        o.baddbmm_(m[:, i], delta)
        s.mul_(chunk_decay[:, i]).baddbmm_(k_decayed[:, i].transpose(-1, -2), delta)
    return out.transpose(1, 2).reshape(n * chunk, nv, dv)[:T]


# ---------------------------------------------------------------------------------- weights


@dataclass
class MLPWeights:
    gate_up: Linear  # (2·ffn, hidden): ffn_gate rows then ffn_up rows
    down: Linear  # (hidden, ffn)

    def __call__(self, y: torch.Tensor, alone: bool) -> torch.Tensor:
        return gated_mlp(self.gate_up, self.down, y, F.silu, alone)  # `dtype`, as the mixers'


@dataclass
class AttentionWeights:
    qkv: Linear  # (2·H·D + 2·G·D, hidden): attn_q (per head query then gate), attn_k, attn_v
    q_norm: torch.Tensor  # (D,) fp32
    k_norm: torch.Tensor
    out: Linear  # (hidden, H·D)


@dataclass
class DeltaNetWeights:
    in_proj: Linear  # (channels + nv·dv + 2·nv, hidden): attn_qkv, attn_gate (z), ssm_beta, ssm_alpha
    conv: torch.Tensor  # (K, channels) fp32: ssm_conv1d transposed, tap K-1 is the current token
    a: torch.Tensor  # (nv,) fp32: ssm_a = −exp(A_log)
    dt_bias: torch.Tensor  # (nv,) fp32
    norm: torch.Tensor  # (dv,) fp32, plain (no +1)
    out: Linear  # (hidden, nv·dv)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (hidden,) fp32
    post_norm: torch.Tensor
    mixer: AttentionWeights | DeltaNetWeights
    mlp: MLPWeights | Experts  # each called on rows (y, alone)


def load_layer(config: Qwen35Config, model: WeightLoader, i: int) -> LayerWeights:
    c, p = config, f"blk.{i}."

    def vec(name: str, n: int) -> torch.Tensor:
        return model.tensor(p + name, (n,))

    def linear(cols: int, *parts: tuple[str, int]) -> Linear:
        return model.linear(cols, *((p + name, rows) for name, rows in parts))

    if c.is_attention_layer(i):
        hd = c.n_heads * c.head_dim
        kvd = c.n_kv_heads * c.head_dim
        mixer = AttentionWeights(
            qkv=linear(c.hidden, ("attn_q.weight", 2 * hd), ("attn_k.weight", kvd), ("attn_v.weight", kvd)),
            q_norm=vec("attn_q_norm.weight", c.head_dim),
            k_norm=vec("attn_k_norm.weight", c.head_dim),
            out=linear(hd, ("attn_output.weight", c.hidden)),
        )
    else:
        vd = c.n_value_heads * c.linear_value_dim
        nv = c.n_value_heads
        conv = model.tensor(p + "ssm_conv1d.weight", (c.conv_channels, c.conv_kernel))
        mixer = DeltaNetWeights(
            in_proj=linear(c.hidden, ("attn_qkv.weight", c.conv_channels), ("attn_gate.weight", vd),
                           ("ssm_beta.weight", nv), ("ssm_alpha.weight", nv)),
            conv=conv.T.contiguous(),
            a=vec("ssm_a", nv),
            dt_bias=vec("ssm_dt.bias", nv),
            norm=vec("ssm_norm.weight", c.linear_value_dim),
            out=linear(vd, ("ssm_out.weight", c.hidden)),
        )
    return LayerWeights(
        attn_norm=vec("attn_norm.weight", c.hidden),
        post_norm=vec("post_attention_norm.weight", c.hidden),
        mixer=mixer,
        mlp=load_experts(c, model, p, c.shared_ffn) if c.is_moe else
        MLPWeights(gate_up=linear(c.hidden, ("ffn_gate.weight", c.ffn), ("ffn_up.weight", c.ffn)),
                   down=linear(c.ffn, ("ffn_down.weight", c.hidden))),
    )


# ---------------------------------------------------------------------------------- model


class Qwen35Model(Decoder):
    """The decoder stack (every layer, then output_norm); token_embd and output stay in the file.

    `forward(x, state)` maps input embeddings (T, hidden) to final hidden states (T, hidden)
    fp32. Matmuls run in `dtype`; norms, rope, gates and the DeltaNet state in fp32; the
    residual stream is fp32. T > 1 is a prefill (chunked delta rule, causal attention over
    KV[:pos+T]), processed in segments of at most `segment` tokens to bound the temporaries.
    """

    segment = 1024
    image_positions = staticmethod(mrope_positions)

    def __init__(self, config: Qwen35Config, model: WeightLoader):
        self.config, self.dtype, self.device = config, model.dtype, model.device
        self.layers = [load_layer(config, model, i) for i in range(config.n_layers)]
        self.output_norm = model.tensor("output_norm.weight", (config.hidden,))
        self.inv_freq = inv_freq(config.rope_base, config.rope_dim, self.device)
        self.rope_axes = mrope_axes(config.rope_sections, config.rope_dim // 2).to(self.device)
        self.token_rope = RopeRows(lambda pos: rope_tables(self.inv_freq, pos, 1))
        if config.mtp_layers:
            self.mtp = Qwen35Mtp(self, model)

    def new_state(self, max_len: int) -> Qwen35State:
        return Qwen35State(self.config, max_len, self.dtype, self.device)

    def kernel_jobs(self) -> list:
        return [deltanet_warmup_job(), attention_warmup_job(self.dtype)]

    def _rope(self, s: Span) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (rows, rope_dim / 2) of a span's positions."""
        if s.positions is None and s.hi - s.lo == 1:
            return self.token_rope(s.state.pos)
        return rope_tables(self.inv_freq, s.state.pos, s.hi - s.lo) if s.positions is None else self._mrope(s.positions)

    def _mrope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # frequency pair i turns by position rope_axes[i]: for text (t = h = w) the same numbers
        freqs = positions.to(self.device)[self.rope_axes].T.to(torch.float32) * self.inv_freq
        return freqs.cos(), freqs.sin()

    def _layers(self, x: torch.Tensor, spans: list[Span], alone: bool) -> Generator:
        c = self.config
        h = x.to(device=self.device, dtype=torch.float32, copy=True)
        ropes = [self._rope(s) for s in spans]
        tokens = token_ropes(ropes) if x.shape[0] == len(spans) else None  # one token each: the batched kernels
        for i, layer in enumerate(self.layers):
            y = rms_norm(h, layer.attn_norm, c.rms_eps)
            if c.is_attention_layer(i):
                h += self._attention(layer.mixer, y, i, spans, ropes, tokens, alone)
            else:
                h += self._deltanet(layer.mixer, y, i, spans, alone)
            y = rms_norm(h, layer.post_norm, c.rms_eps)
            h += layer.mlp(y, alone)  # h stays fp32
            yield
        advance(spans)
        return rms_norm(h, self.output_norm, c.rms_eps)

    def _attention(self, w: AttentionWeights, y, i: int, spans: list[Span], ropes: list, tokens, alone: bool) -> torch.Tensor:
        """`tokens`: with one token of each span's sequence, their rope tables as one (token_ropes)."""
        c = self.config
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        proj = w.qkv(y, alone).float()
        n = proj.shape[0]
        if tokens is not None:
            qg = proj[:, : 2 * H * D].view(n, H, 2, D)
            q = rms_norm(qg[:, :, 0], w.q_norm, c.rms_eps)  # torch's, as alone: a strided view
            k = rms_norm(proj[:, 2 * H * D : (2 * H + G) * D].view(n, G, D).contiguous(), w.k_norm, c.rms_eps,
                         tokens_alone=True)
            caches = [s.state.layers[i] for s in spans]
            positions = [s.state.pos for s in spans]
            o = attend_tokens(q, k, proj[:, (2 * H + G) * D :].view(n, G, D), [m.views for m in caches], positions,
                              D**-0.5, [0] * n, tokens)
            if o is not None:
                return w.out(o * torch.sigmoid(qg[:, :, 1].reshape(n, H * D)), alone)

        def attend(s: Span, rope) -> torch.Tensor:
            T, pos, cache = s.hi - s.lo, s.state.pos, s.state.layers[i]
            rows = proj[s.lo : s.hi]
            qg = rows[:, : 2 * H * D].view(T, H, 2, D)
            q = rms_norm(qg[:, :, 0], w.q_norm, c.rms_eps)  # (T, H, D)
            gate = qg[:, :, 1].reshape(T, H * D)
            k = rms_norm(rows[:, 2 * H * D : (2 * H + G) * D].view(T, G, D), w.k_norm, c.rms_eps)
            v = rows[:, (2 * H + G) * D :].view(T, G, D)
            apply_rope_(q, *rope)
            apply_rope_(k, *rope)
            return attention(q, k, v, (cache.k, cache.v), pos, D**-0.5, views=cache.views) * torch.sigmoid(gate)

        return w.out(per_sequence(attend, spans, ropes), alone)

    def _deltanet(self, w: DeltaNetWeights, y, i: int, spans: list[Span], alone: bool) -> torch.Tensor:
        c = self.config
        nk, nv, dk, dv = c.n_key_heads, c.n_value_heads, c.linear_key_dim, c.linear_value_dim
        C, V = c.conv_channels, nv * dv
        proj = w.in_proj(y, alone).float()
        if proj.shape[0] == len(spans):  # one token each (a step, or a verify pass's rows): one kernel call
            caches, sequence_of, index = [], [], {}
            for s in spans:
                m = s.state.layers[i]
                sequence_of.append(index.setdefault(id(m), len(index)))
                if len(caches) < len(index):
                    caches.append(m)
            keeps = [kept_copies(s, caches[j].conv, caches[j].recurrent) for s, j in zip(spans, sequence_of)]
            o = deltanet_tokens(proj, [m.conv for m in caches], w.conv, w.a, w.dt_bias, w.norm,
                                [m.recurrent for m in caches], nk, c.rms_eps, L2_EPS, sequence_of, keeps)
            if o is not None:
                return w.out(o, alone)

        def mix(s: Span, _) -> torch.Tensor:
            T, cache, rows = s.hi - s.lo, s.state.layers[i], proj[s.lo : s.hi]
            qkv = F.silu(causal_conv1d(rows[:, :C], cache.conv, w.conv), inplace=True)
            z = rows[:, C : C + V].view(T, nv, dv)
            beta = torch.sigmoid(rows[:, C + V : C + V + nv])
            g = w.a * F.softplus(rows[:, C + V + nv :] + w.dt_bias)
            qk = l2_normalize(qkv[:, : 2 * nk * dk].view(T, 2 * nk, dk))
            q, k = qk[:, :nk] * dk**-0.5, qk[:, nk:]
            v = qkv[:, 2 * nk * dk :].view(T, nv, dv)
            rule = gated_delta_rule_recurrent if T == 1 else gated_delta_rule_chunked
            o = rule(q, k, v, g, beta, cache.recurrent)
            keep(s, cache.conv, cache.recurrent)
            o = rms_norm(o, w.norm, c.rms_eps).mul_(F.silu(z))
            return o.reshape(T, V)

        return w.out(per_sequence(mix, spans, [None] * len(spans)), alone)


# ---------------------------------------------------------------------------------- multi-token prediction
# Qwen3.5's MTP layer: from the trunk's final hidden state at position t and the token at t + 1, the
# hidden state whose logits (through the model's own output head) guess the token at t + 2;
# speculative decoding drafts with it (engine.speculate.MtpDraft). As the checkpoints carry it
# (`mtp.*`; llama.cpp's `blk.{n_layers}.nextn.*` after the trunk's layers): a stem,
# fc(concat(rmsnorm(embedding), rmsnorm(hidden))), embedding first; one gated-attention layer of the
# trunk's geometry with its own KV cache; a final RMSNorm. The pair (hidden t, token t + 1) sits at
# position t. Drafting further feeds the layer its own output.


class MtpState:
    """The MTP layer's KV cache for `max_len` positions (pages resident once written); `pos` pairs
    are in it. Indexed by position alone: going back is setting `pos`."""

    def __init__(self, network: Qwen35Mtp, max_len: int):
        if max_len < 1:
            raise PagelmError(f"max_len {max_len} must be >= 1")
        c = network.config
        self.pos, self.max_len = 0, max_len
        self._caches = ZeroedTensors((c.n_kv_heads, max_len, c.head_dim), 2, network.dtype, network.device)
        self.layers = [KVCache(*self._caches.tensors)]

    @property
    def nbytes(self) -> int:
        return self._caches.nbytes


class Qwen35Mtp(Decoder):
    """The MTP layer over a trunk (`Decoder.forward` of stem outputs, `inputs`, to final hidden states)."""

    def __init__(self, trunk: Qwen35Model, model: WeightLoader):
        c = trunk.config
        self.trunk, self.config, self.dtype, self.device = trunk, c, trunk.dtype, trunk.device
        self.segment = trunk.segment
        p = f"blk.{c.n_layers}."
        self.embedding_norm = model.tensor(p + "nextn.enorm.weight", (c.hidden,))
        self.hidden_norm = model.tensor(p + "nextn.hnorm.weight", (c.hidden,))
        self.stem = model.linear(2 * c.hidden, (p + "nextn.eh_proj.weight", c.hidden))
        self.layer = load_layer(c, model, c.n_layers)
        self.norm = model.tensor(p + "nextn.shared_head_norm.weight", (c.hidden,))

    def new_state(self, max_len: int) -> MtpState:
        return MtpState(self, max_len)

    def inputs(self, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The stem's rows (T, hidden) fp32 for the pairs (embeddings[t], hidden[t]): the rows of
        the tokens at t + 1 and the trunk's final hidden states at t (or the layer's own)."""
        eps = self.config.rms_eps
        both = torch.cat((rms_norm(embeddings.float(), self.embedding_norm, eps),
                          rms_norm(hidden.float(), self.hidden_norm, eps)), dim=1)
        with torch.inference_mode():
            return self.stem(both).float()

    def _layers(self, x: torch.Tensor, spans: list[Span], alone: bool) -> Generator:
        c, layer, trunk = self.config, self.layer, self.trunk
        h = x.to(device=self.device, dtype=torch.float32, copy=True)
        ropes = [trunk._rope(s) for s in spans]
        tokens = token_ropes(ropes) if x.shape[0] == len(spans) else None
        y = rms_norm(h, layer.attn_norm, c.rms_eps)
        h += trunk._attention(layer.mixer, y, 0, spans, ropes, tokens, alone)
        y = rms_norm(h, layer.post_norm, c.rms_eps)
        h += layer.mlp(y, alone)
        yield
        advance(spans)
        return rms_norm(h, self.norm, c.rms_eps)


HF_GLOBALS = {"output_norm.weight": "norm.weight"}
HF_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight"}
HF_LAYER = {  # the feed-forward's apart (HF_MLP)
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# the multi-token-prediction layer's own tensors, as llama.cpp names them (blk.{n_layers}.nextn.*), and its
# attention layer's, under mtp.layers.0. (HF_LAYER's names)
HF_MTP = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
          "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}
HF_MTP_LAYER = "mtp.layers.0."
# zero-centred in the HF checkpoint; the DeltaNet output norm (ssm_norm) is not
HF_SHIFTED_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                    "output_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


def _a_from_log(values: np.ndarray) -> np.ndarray:
    return -np.exp(values)


def _log_from_a(values: np.ndarray) -> np.ndarray:
    """log(−A), moved by up to 2 ulps where that makes _a_from_log give A back bit for bit (float32
    log and exp round): a written twin then holds the same numbers."""
    values = np.asarray(values, np.float32)
    best = np.log(-values)
    for steps in (1, -1, 2, -2):
        candidate = best.copy()
        for _ in range(abs(steps)):
            candidate = np.nextafter(candidate, np.float32(np.inf if steps > 0 else -np.inf))
        fix = (_a_from_log(best) != values) & (_a_from_log(candidate) == values)
        best = np.where(fix, candidate, best)
    return best


def hf_layout(config: HFConfig, hf_names: set[str] | None) -> HFLayout:
    """A Hugging Face Qwen3.5 checkpoint in GGUF terms (see shared/design/qwen35.md): norms get
    the +1 and A_log becomes −exp(A_log) (small vectors); when value heads outnumber key heads,
    GGUF's tiled value-head order is a row order on qkv's value rows, z, a and b, a column
    order on the out projection and a reordering of the small per-head vectors. A Qwen3.5-MoE
    checkpoint (no dense width, intermediate_size) is qwen35moe: each layer's router, its experts
    one tensor each (mlp.experts.E.{gate,up,down}_proj) and its shared expert."""
    moe = config.get("model_type") in MOE_MODEL_TYPES
    arch = MOE_ARCH if moe else ARCH
    n_layers, head_dim = config.int("num_hidden_layers"), config.int("head_dim")
    nk, nv = config.int("linear_num_key_heads"), config.int("linear_num_value_heads")
    dk, dv = config.int("linear_key_head_dim"), config.int("linear_value_head_dim")
    if nk < 1 or nv % nk:
        raise ModelFormatError(f"{config.name}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    if nv * max(dk, dv) >= 1 << 24:
        raise ModelFormatError(f"{config.name}: {nv} value heads of {max(dk, dv)} dims is not a plausible DeltaNet width")
    interval = layer_period(config, config.strings("layer_types"), "full_attention",
                            config.int("full_attention_interval", 4))
    if rope_scaling(config, arch):
        raise UnsupportedError(f"{config.name}: rope scaling is not supported for {arch}")
    metadata = decoder_metadata(arch, config, head_dim, ffn=not moe)
    feed_forward = HF_MLP
    if moe:
        metadata.update(moe_metadata(arch, config, hf_names))
        del metadata[f"{arch}.expert_weights_norm"]  # Qwen3.5-MoE always renormalizes; norm_topk_prob is not read
        metadata[f"{arch}.expert_shared_feed_forward_length"] = config.int("shared_expert_intermediate_size")
        feed_forward = {**expert_names(metadata[f"{arch}.expert_count"]),
                        "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                        **{f"ffn_{x}_shexp.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}}
    metadata.update({
        f"{arch}.rope.dimension_count": int(head_dim * config.rope_float("partial_rotary_factor", 1.0)),
        f"{arch}.rope.freq_base": config.rope_float("rope_theta", 10_000.0),
        f"{arch}.ssm.conv_kernel": config.int("linear_conv_kernel_dim"),
        f"{arch}.ssm.state_size": dk, f"{arch}.ssm.group_count": nk, f"{arch}.ssm.time_step_rank": nv,
        f"{arch}.ssm.inner_size": nv * dv, f"{arch}.full_attention_interval": interval,
    })
    sections = config.rope("mrope_section")
    if sections is not None:
        if not isinstance(sections, list) or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 16
                                                     for n in sections):
            raise ModelFormatError(f"{config.name}: rope setting 'mrope_section' is {json.dumps(sections)[:60]}, "
                                   f"expected a list of counts")
        metadata[f"{arch}.rope.dimension_sections"] = [*sections, 0]
    maps = tensor_maps(config, hf_names, n_layers, HF_GLOBALS, {**HF_LAYER, **feed_forward})
    if hf_names is not None and HF_MTP["nextn.eh_proj.weight"] in hf_names:
        # the first multi-token-prediction layer (the one pagelm drafts with) after the trunk, counted as
        # llama.cpp's converter counts it
        metadata[f"{arch}.block_count"] += 1
        metadata[f"{arch}.nextn_predict_layers"] = 1
        p = f"blk.{n_layers}."
        maps.update({p + gguf: TensorMap(hf) for gguf, hf in HF_MTP.items()})
        maps.update({p + gguf: TensorMap(HF_MTP_LAYER + hf) for gguf, hf in {**HF_LAYER, **feed_forward}.items()
                     if HF_MTP_LAYER + hf in hf_names})
    shift_norms(maps, HF_SHIFTED_NORMS)
    qk = 2 * nk * dk
    per_head = {  # GGUF name suffix -> its order over HF rows (None: as stored)
        "attn_qkv.weight": np.concatenate((np.arange(qk), qk + heads_tiled(nk, nv, dv))),
        "ssm_conv1d.weight": np.concatenate((np.arange(qk), qk + heads_tiled(nk, nv, dv))),
        "attn_gate.weight": heads_tiled(nk, nv, dv), "ssm_beta.weight": heads_tiled(nk, nv, 1),
        "ssm_alpha.weight": heads_tiled(nk, nv, 1), "ssm_a": heads_tiled(nk, nv, 1),
        "ssm_dt.bias": heads_tiled(nk, nv, 1),
    }
    for name, tmap in list(maps.items()):
        suffix = name.split(".", 2)[-1]
        if suffix == "ssm_a":
            tmap = replace(tmap, to_gguf=_a_from_log, to_hf=_log_from_a)
        if nv != nk and suffix in per_head:
            tmap = replace(tmap, rows=per_head[suffix])
        if suffix == "ssm_conv1d.weight":
            tmap = replace(tmap, hf_shape=(qk + nv * dv, 1, config.int("linear_conv_kernel_dim")))
        if nv != nk and suffix == "ssm_out.weight":
            tmap = replace(tmap, columns=heads_tiled(nk, nv, dv))
        if suffix == "ffn_gate_inp_shexp.weight":  # llama.cpp's gate is a vector, transformers' a one-row matrix
            tmap = replace(tmap, hf_shape=(1, config.int("hidden_size")))
        maps[name] = tmap
    return HFLayout(metadata, maps)


# FastFlowLM's names where they are not Hugging Face's (weights.flm)
FLM_NAMES = {"linear_attn.in_proj_a.weight": "linear_attn.ssm_alpha_proj.weight",
             "linear_attn.in_proj_b.weight": "linear_attn.ssm_beta_proj.weight"}


def flm_rows(config: HFConfig) -> dict[str, np.ndarray]:
    """FastFlowLM's planar q_proj (all heads' query rows, then all their gate rows) as the row
    order of GGUF's attn_q, whose heads interleave query and gate: row (h, s, d) is planar row
    s·H·D + h·D + d."""
    heads, dim = config.int("num_attention_heads"), config.int("head_dim")
    h, s, d = np.meshgrid(np.arange(heads), np.arange(2), np.arange(dim), indexing="ij")
    planar = (s * heads * dim + h * dim + d).reshape(-1)
    return {f"blk.{i}.attn_q.weight": planar for i in range(config.int("num_hidden_layers"))}


def hf_config(c: Qwen35Config, tied: bool) -> dict:
    """config.json for a Hugging Face twin of a checkpoint with this config."""
    config = {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_act": "silu",
        "linear_conv_kernel_dim": c.conv_kernel, "linear_key_head_dim": c.linear_key_dim,
        "linear_value_head_dim": c.linear_value_dim, "linear_num_key_heads": c.n_key_heads,
        "linear_num_value_heads": c.n_value_heads,
        "layer_types": ["full_attention" if c.is_attention_layer(i) else "linear_attention" for i in range(c.n_layers)],
        "rope_parameters": {**hf_rope(c.rope_base, 1.0), "partial_rotary_factor": c.rope_dim / c.head_dim,
                            **({"mrope_section": list(c.rope_sections[:3]), "mrope_interleaved": True}
                               if c.rope_sections else {})},
        **decoder_hf_config(c, tied),
    }
    if c.is_moe:
        if not c.ffn:
            del config["intermediate_size"]
        config.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", num_experts=c.n_experts,
                      num_experts_per_tok=c.n_experts_used, moe_intermediate_size=c.expert_ffn,
                      shared_expert_intermediate_size=c.shared_ffn)
    return config


Config, Model = Qwen35Config, Qwen35Model  # the registry's names (pagelm.models)
