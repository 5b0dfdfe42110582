"""Gemma 3 text decoder (llama.cpp's `gemma3` architecture: Gemma 3 270M, 1B, and the text
stack of the larger ones).

Owns the gemma3 math in its GGUF conventions and its KV state; never parses files (a
`WeightLoader` hands it config values, small tensors and linear operators), never embeds tokens
and never computes the output head.

GGUF conventions handled here:
- Every `*norm.weight` (attn_norm, post_attention_norm, ffn_norm, post_ffw_norm, attn_q_norm,
  attn_k_norm, output_norm) already has Gemma's +1 folded in by llama.cpp's converter
  (transformers' GGUF loader subtracts 1 again), so all norms are plain x·rsqrt(·)·w.
- q/k rows are *not* permuted (gemma uses NeoX rope in ggml), so rotate-half rope applies as is.
- Layer i is global (full attention, rope base `gemma3.rope.freq_base`, 1e6) when
  i % pattern == pattern − 1 (pattern 6, `gemma3.attention.sliding_window_pattern` if an
  integer is present), else local: sliding window `gemma3.attention.sliding_window`, rope base
  `gemma3.rope.freq_base_swa` (absent in the files seen; 10,000 as in transformers).
- Linear rope scaling (`gemma3.rope.scaling.*`) applies to global layers only.
- Query scale is query_pre_attn_scalar^-0.5; GGUF has no key for it: like llama.cpp we take
  head_dim (256 for 270M, 1B, 4B, 12B), and hidden / heads (168) for the 62-layer 27B.
  (transformers' GGUF loader always leaves its default 256, wrong only for 27B.)
- `final_logit_softcapping` is exposed on the config (None for gemma3) for whoever computes
  logits: `softcap_logits`; attention softcapping (gemma2 only) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.models.decoder import Decoder, Span, advance, per_sequence
from pagelm.models.layers import (KVState, apply_rope_, attend_spans, attention, bidirectional_attention, check_config,
                                  gated_mlp, inv_freq, rms_norm, rope_tables)
from pagelm.models.token_layers import NORMS, TokenLayers, warmup_jobs
from pagelm.models.token_ops import RopeRows, TokenStep, token_ropes
from pagelm.weights.hf import (HFConfig, HFLayout, decoder_hf_config, decoder_metadata, hf_rope, layer_period,
                               rope_scaling, shift_norms, tensor_maps)
from pagelm.weights.linear import Linear
from pagelm.weights.loader import WeightLoader

ARCH_NAME = "gemma3"
# general.architecture values read here (pagelm.models' registry); gemma-embedding (EmbeddingGemma): Gemma 3
# layers whose tokens see each other both ways, an embedding model
GGUF_ARCHITECTURES = ("gemma3", "gemma-embedding")
HF_MODEL_TYPES = ("gemma3", "gemma3_text")  # config.json model_types read here
DEFAULT_PATTERN = 6
DEFAULT_LOCAL_BASE = 10_000.0


@dataclass(frozen=True)
class Gemma3Config:
    hidden: int
    n_layers: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float  # global layers
    rope_local_base: float  # sliding-window layers
    rope_scale: float  # linear scaling of the global layers' positions; 1.0 for none
    sliding_window: int
    sliding_window_pattern: int
    query_scale: float  # query_pre_attn_scalar ** -0.5
    rms_eps: float
    final_logit_softcapping: float | None
    vocab: int  # rows of token_embd
    causal: bool = True  # False: every token sees every other (within the window each way), an encoder

    @classmethod
    def from_loader(cls, model: WeightLoader) -> Gemma3Config:
        arch = model.architecture
        if arch not in GGUF_ARCHITECTURES:
            raise ModelFormatError(f"{model.name}: metadata key 'general.architecture' is {arch!r:.40}, expected one of "
                                   f"{', '.join(GGUF_ARCHITECTURES)}")

        def key(k: str) -> str:
            return f"{arch}.{k}"

        def i(k: str) -> int:
            return model.get_int(key(k))

        def f(k: str) -> float:
            return model.get_float(key(k))

        def has(k: str) -> bool:
            return model.has(key(k))

        hidden, n_heads = i("embedding_length"), i("attention.head_count")
        embd = model.dims("token_embd.weight")
        if len(embd) != 2 or embd[0] != hidden:
            raise ModelFormatError(
                f"{model.name}: tensor 'token_embd.weight' has dims {embd} (ne0 first), expected ({hidden}, vocab)"
            )
        head_dim = i("attention.key_length") if has("attention.key_length") else 256
        if has("attention.value_length") and i("attention.value_length") != head_dim:
            raise UnsupportedError(f"{model.name}: attention.value_length differs from the key length {head_dim}")
        if has("attn_logit_softcapping"):
            raise UnsupportedError(f"{model.name}: attention logit softcapping is not supported")
        scaling = model.get(key("rope.scaling.type"))
        rope_scale = 1.0
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise UnsupportedError(f"{model.name}: rope scaling {scaling!r:.40} is not supported (none, linear are)")
            rope_scale = f("rope.scaling.factor")
        pattern = model.get(key("attention.sliding_window_pattern"))
        if pattern is not None and not isinstance(pattern, (int, np.integer)):
            raise UnsupportedError(f"{model.name}: a per-layer sliding_window_pattern array is not supported")
        n_layers = i("block_count")
        if has("attention.query_pre_attn_scalar"):
            qpas = f("attention.query_pre_attn_scalar")
        else:  # llama.cpp's rule: head_dim, except 27B (62 layers), whose scalar is hidden / heads
            qpas = hidden / n_heads if n_layers == 62 else head_dim
        config = cls(
            hidden=hidden,
            n_layers=n_layers,
            ffn=i("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=i("attention.head_count_kv") if has("attention.head_count_kv") else n_heads,
            head_dim=head_dim,
            rope_base=f("rope.freq_base") if has("rope.freq_base") else 1_000_000.0,
            rope_local_base=f("rope.freq_base_swa") if has("rope.freq_base_swa") else DEFAULT_LOCAL_BASE,
            rope_scale=rope_scale,
            sliding_window=i("attention.sliding_window"),
            sliding_window_pattern=DEFAULT_PATTERN if pattern is None else int(pattern),
            query_scale=float(qpas) ** -0.5,
            rms_eps=f("attention.layer_norm_rms_epsilon"),
            final_logit_softcapping=f("final_logit_softcapping") if has("final_logit_softcapping") else None,
            vocab=embd[1],
            causal=bool(model.get(key("attention.causal"))) if has("attention.causal") else arch == ARCH_NAME,
        )
        config.validate(model.name)
        return config

    def validate(self, where: str = "gemma3 config") -> None:
        counts = {name: getattr(self, name) for name in ("hidden", "n_layers", "ffn", "n_heads", "n_kv_heads", "head_dim",
                                                         "sliding_window", "sliding_window_pattern", "vocab")}
        check_config(where, counts, (
            (self.n_heads % self.n_kv_heads == 0, f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}"),
            (self.head_dim % 2 == 0, f"head dim {self.head_dim} must be even"),
            (self.rope_base > 0 and self.rope_local_base > 0, "rope bases must be > 0"),
            (self.rope_scale > 0, f"rope.scaling.factor {self.rope_scale} must be > 0"),
            (self.rms_eps > 0, f"attention.layer_norm_rms_epsilon {self.rms_eps} must be > 0"),
            (self.final_logit_softcapping is None or self.final_logit_softcapping > 0, "final_logit_softcapping must be > 0"),
        ))

    def is_global_layer(self, i: int) -> bool:
        return i % self.sliding_window_pattern == self.sliding_window_pattern - 1

    @property
    def encoder_window(self) -> int:
        """An encoder's sliding layers see keys with |i − j| < this (half the window each way, as
        transformers' and llama.cpp's symmetric windows)."""
        return self.sliding_window // 2 + 1

    @property
    def embedding_scale(self) -> float:
        return math.sqrt(self.hidden)


def softcap_logits(logits: np.ndarray, cap: float | None) -> np.ndarray:
    """cap·tanh(logits / cap) in place (no-op for None): Gemma's final logit softcapping."""
    if cap is not None:
        np.tanh(logits / cap, out=logits)
        logits *= cap
    return logits


@dataclass
class Gemma3Layer:
    attn_norm: torch.Tensor  # (hidden,) fp32, +1 folded in (as every norm below)
    qkv: Linear  # (H·D + 2·G·D, hidden): attn_q, attn_k, attn_v
    q_norm: torch.Tensor  # (D,) fp32
    k_norm: torch.Tensor
    out: Linear  # (hidden, H·D)
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Linear  # (2·ffn, hidden): ffn_gate then ffn_up
    down: Linear  # (hidden, ffn)
    post_ffn_norm: torch.Tensor


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def load_layer(c: Gemma3Config, model: WeightLoader, i: int) -> Gemma3Layer:
    p = f"blk.{i}."
    hd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim

    def vec(name: str, n: int) -> torch.Tensor:
        return model.tensor(p + name, (n,))

    def linear(cols: int, *parts: tuple[str, int]) -> Linear:
        return model.linear(cols, *((p + name, rows) for name, rows in parts))

    return Gemma3Layer(
        attn_norm=vec("attn_norm.weight", c.hidden),
        qkv=linear(c.hidden, ("attn_q.weight", hd), ("attn_k.weight", kvd), ("attn_v.weight", kvd)),
        q_norm=vec("attn_q_norm.weight", c.head_dim),
        k_norm=vec("attn_k_norm.weight", c.head_dim),
        out=linear(hd, ("attn_output.weight", c.hidden)),
        post_attn_norm=vec("post_attention_norm.weight", c.hidden),
        ffn_norm=vec("ffn_norm.weight", c.hidden),
        gate_up=linear(c.hidden, ("ffn_gate.weight", c.ffn), ("ffn_up.weight", c.ffn)),
        down=linear(c.ffn, ("ffn_down.weight", c.hidden)),
        post_ffn_norm=vec("post_ffw_norm.weight", c.hidden),
    )


class Gemma3Model(Decoder):
    """The decoder stack (every layer, then output_norm); token_embd and output stay in the file.

    `forward(x, state)` maps the *raw* token_embd rows (T, hidden) — exactly what the engine
    looks up, unscaled — to final hidden states (T, hidden) fp32. The Gemma embedding scale
    sqrt(hidden) is applied inside forward, in fp32. Matmuls and the KV cache run in `dtype`;
    norms and rope in fp32; the residual stream is fp32. Sliding-window layers keep a
    full-length cache and mask by the window. T > 1 is a prefill, processed in segments of at
    most `segment` tokens to bound the temporaries.
    """

    segment = 512

    def __init__(self, config: Gemma3Config, model: WeightLoader):
        self.config, self.dtype, self.device = config, model.dtype, model.device
        self.layers = [load_layer(config, model, i) for i in range(config.n_layers)]
        self.output_norm = model.tensor("output_norm.weight", (config.hidden,))
        self.inv_freq_global = inv_freq(config.rope_base, config.head_dim, self.device)
        self.inv_freq_local = inv_freq(config.rope_local_base, config.head_dim, self.device)
        self.token_rope = RopeRows(lambda pos: self._ropes(pos, 1))
        self._compiled: TokenLayers | bool | None = None  # the one-token layers as compiled calls; False: not taken

    def _ropes(self, pos: int, T: int):
        """The global and the local layers' rope tables of positions pos..pos+T-1."""
        return (rope_tables(self.inv_freq_global, pos, T, self.config.rope_scale),
                rope_tables(self.inv_freq_local, pos, T))

    def new_state(self, max_len: int) -> KVState:
        c = self.config
        return KVState(c.n_layers, c.n_kv_heads, c.head_dim, max_len, self.dtype, self.device)

    def kernel_jobs(self) -> list:
        return warmup_jobs(self.layers, self.dtype)

    def _layers(self, x: torch.Tensor, spans: list[Span], alone: bool) -> Generator:
        c, T = self.config, x.shape[0]
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        ropes = [self.token_rope(s.state.pos) if s.hi - s.lo == 1 else self._ropes(s.state.pos, s.hi - s.lo)
                 for s in spans]
        tokens = None
        if T == len(spans):  # one token each: the batched kernels
            tokens = token_ropes([g for g, _ in ropes]), token_ropes([loc for _, loc in ropes])
            step = TokenStep.of(x, [s.state for s in spans], list(tokens), c.query_scale, H, G, D,
                                (None, c.sliding_window))
            if step is not None:
                return (yield from self._token_layers(step, spans, alone))
        h = x.to(device=self.device, dtype=torch.float32, copy=True).mul_(c.embedding_scale)
        for i, w in enumerate(self.layers):
            is_global = c.is_global_layer(i)
            window = None if is_global else c.sliding_window
            y = rms_norm(h, w.attn_norm, c.rms_eps)
            proj = w.qkv(y, alone).float()

            def attend(s: Span, rope) -> torch.Tensor:
                n = s.hi - s.lo
                rows = proj[s.lo : s.hi]
                q = rms_norm(rows[:, : H * D].view(n, H, D), w.q_norm, c.rms_eps)
                k = rms_norm(rows[:, H * D : (H + G) * D].view(n, G, D), w.k_norm, c.rms_eps)
                v = rows[:, (H + G) * D :].view(n, G, D)
                cos, sin = rope[0] if is_global else rope[1]
                apply_rope_(q, cos, sin)
                apply_rope_(k, cos, sin)
                kv = s.state
                if not c.causal:
                    if kv.pos != 0:
                        raise PagelmError("an encoder model takes a whole input at once (Decoder.encode)")
                    return bidirectional_attention(q, k, v, c.query_scale, None if is_global else c.encoder_window)
                return attention(q, k, v, kv.layers[i], kv.pos, c.query_scale, window, kv.views[i])

            o = None
            if tokens is not None:  # each token's q/k rows normed as alone (contiguous, per-token row limit)
                q = rms_norm(proj[:, : H * D].view(T, H, D).contiguous(), w.q_norm, c.rms_eps, tokens_alone=True)
                k = rms_norm(proj[:, H * D : (H + G) * D].view(T, G, D).contiguous(), w.k_norm, c.rms_eps,
                             tokens_alone=True)
                o = attend_spans(q, k, proj[:, (H + G) * D :].view(T, G, D), spans, i,
                                 tokens[0] if is_global else tokens[1], c.query_scale, window)
            if o is None:
                o = per_sequence(attend, spans, ropes)
            h += rms_norm(w.out(o, alone).float(), w.post_attn_norm, c.rms_eps)
            m = gated_mlp(w.gate_up, w.down, rms_norm(h, w.ffn_norm, c.rms_eps), _gelu_tanh, alone, spans)
            h += rms_norm(m.float(), w.post_ffn_norm, c.rms_eps)
            yield
        advance(spans)
        return rms_norm(h, self.output_norm, c.rms_eps)

    def _token_layers(self, step: TokenStep, spans: list[Span], alone: bool) -> Generator:
        """_layers for one token of each span's sequence, in numpy between the kernels: the same
        operations on the same values, bit for bit, without ~15 torch dispatches a layer."""
        c, h, norm = self.config, step.h, step.norm
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        n = h.shape[0]
        h *= np.float32(c.embedding_scale)
        if self._compiled is None:
            kinds = [0 if c.is_global_layer(i) else 1 for i in range(c.n_layers)]  # step.ropes' and windows' order
            self._compiled = TokenLayers.of(self.layers, len(NORMS), kinds) or False
        if self._compiled:
            h = yield from self._compiled.run(step, H, G, D, c.rms_eps, _gelu_tanh, (None, c.sliding_window))
            advance(spans)
            return torch.from_numpy(norm(h, self.output_norm, c.rms_eps))
        for i, w in enumerate(self.layers):
            is_global = c.is_global_layer(i)
            proj = step.product(w.qkv, norm(h, w.attn_norm, c.rms_eps, "norm"), alone)
            q = norm(np.ascontiguousarray(proj[:, : H * D]).reshape(n * H, D), w.q_norm, c.rms_eps,
                     "q").reshape(n, H, D)
            k = norm(np.ascontiguousarray(proj[:, H * D : (H + G) * D]).reshape(n * G, D), w.k_norm, c.rms_eps,
                     "k").reshape(n, G, D)
            v = np.ascontiguousarray(proj[:, (H + G) * D :]).reshape(n, G, D)
            o = step.attend(q, k, v, i, 0 if is_global else 1, None if is_global else c.sliding_window)
            h += norm(step.product(w.out, o, alone), w.post_attn_norm, c.rms_eps, "norm")
            m = step.gated(w.gate_up, w.down, norm(h, w.ffn_norm, c.rms_eps, "norm"), _gelu_tanh, alone)
            h += norm(m, w.post_ffn_norm, c.rms_eps, "norm")
            yield
        advance(spans)
        return torch.from_numpy(norm(h, self.output_norm, c.rms_eps))


HF_GLOBALS = {"output_norm.weight": "norm.weight"}
HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_layout(config: HFConfig, hf_names: set[str]) -> HFLayout:
    """A Hugging Face Gemma 3 text checkpoint in GGUF terms: zero-centred norms get GGUF's +1
    (small vectors), the global-layer pattern comes from `layer_types`, matrices as stored."""
    n_layers = config.int("num_hidden_layers")
    head_dim = config.int("head_dim", 256)
    types = config.strings("layer_types") or [
        "full_attention" if (i + 1) % config.int("sliding_window_pattern", DEFAULT_PATTERN) == 0 else "sliding_attention"
        for i in range(n_layers)]
    pattern = layer_period(config, types, "full_attention", n_layers + 1)
    if config.get("attn_logit_softcapping") is not None:
        raise UnsupportedError(f"{config.name}: attention logit softcapping is not supported")
    params = config.get("rope_parameters")
    full_rope = params.get("full_attention") if isinstance(params, dict) and "full_attention" in params else None
    local_rope = params.get("sliding_attention") if isinstance(params, dict) and "sliding_attention" in params else None
    rope_scaling(config, ARCH_NAME, local_rope)  # refuses what is neither default nor linear

    def key(name: str) -> str:
        return f"{ARCH_NAME}.{name}"

    metadata = decoder_metadata(ARCH_NAME, config, head_dim)
    metadata.update({
        key("rope.freq_base"): config.rope_float("rope_theta", 1_000_000.0, full_rope),
        key("rope.freq_base_swa"): config.rope_float("rope_local_base_freq", DEFAULT_LOCAL_BASE)
        if local_rope is None else config.rope_float("rope_theta", DEFAULT_LOCAL_BASE, local_rope),
        key("attention.sliding_window"): config.int("sliding_window"),
        key("attention.sliding_window_pattern"): pattern,
        key("attention.query_pre_attn_scalar"): config.float("query_pre_attn_scalar", head_dim),
        key("attention.causal"): not config.get("use_bidirectional_attention", False),
    })
    metadata.update(rope_scaling(config, ARCH_NAME, full_rope))
    if config.get("final_logit_softcapping") is not None:
        metadata[key("final_logit_softcapping")] = config.float("final_logit_softcapping")
    maps = tensor_maps(config, hf_names, n_layers, HF_GLOBALS, HF_LAYER)
    shift_norms(maps, ("norm.weight",))  # every Gemma norm, q/k norms included
    return HFLayout(metadata, maps)


def _number(x: float) -> int | float:
    """An integral float as an int (transformers' config classes type some floats as int)."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)) else x


def hf_config(c: Gemma3Config, tied: bool) -> dict:
    """config.json for a Hugging Face twin of a checkpoint with this config."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": c.sliding_window,
        "layer_types": ["full_attention" if c.is_global_layer(i) else "sliding_attention" for i in range(c.n_layers)],
        "rope_parameters": {"full_attention": hf_rope(c.rope_base, c.rope_scale),
                            "sliding_attention": hf_rope(c.rope_local_base, 1.0)},
        "query_pre_attn_scalar": _number(c.query_scale ** -2), "final_logit_softcapping": c.final_logit_softcapping,
        "attn_logit_softcapping": None, **decoder_hf_config(c, tied),
    }


Config, Model = Gemma3Config, Gemma3Model  # the registry's names (pagelm.models)
