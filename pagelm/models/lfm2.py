"""LiquidAI LFM2 text decoder (llama.cpp's `lfm2`): gated short-convolution layers and GQA
attention layers with q/k norms, in the order the file lists.

Owns the lfm2 math in its GGUF conventions and its decode state (the attention layers' KV
caches, each conv layer's window of past inputs, checkpoints); never parses files (a
`WeightLoader` hands it config values, small tensors and linear operators), never embeds tokens
and never computes the output head.

GGUF conventions handled here:
- `lfm2.attention.head_count_kv` is per layer; 0 marks a conv layer.
- A conv layer: in_proj's rows are B, C and x (hidden each); out_proj(C · conv(B · x)), conv
  depthwise and causal over `lfm2.shortconv.l_cache` tokens, no activation.
- RMSNorm weights are used as stored (no +1); q/k rows as in Hugging Face (NeoX rope, no
  permutation); `token_embd_norm` is the final norm, after the last layer (transformers'
  `embedding_norm`).
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from pagelm.errors import ModelFormatError, PagelmError, UnsupportedError
from pagelm.models.decoder import Decoder, Span, advance, keep, nbytes, per_sequence, waves
from pagelm.models.layers import (KVCheckpoint, KVState, apply_rope_, attend_spans, attention, causal_conv1d,
                                  check_config, gated_mlp, inv_freq, rms_norm, rope_tables)
from pagelm.models.token_layers import K_NORM, TokenLayers, warmup_jobs
from pagelm.models.token_ops import RopeRows, TokenStep, conv_tokens, token_ropes
from pagelm.weights.hf import HFConfig, HFLayout, decoder_hf_config, hf_rope, rope_scaling, tensor_maps
from pagelm.weights.linear import Linear
from pagelm.weights.loader import WeightLoader

ARCH = "lfm2"
GGUF_ARCHITECTURES = ("lfm2",)  # general.architecture values read here (pagelm.models' registry)
HF_MODEL_TYPES = ("lfm2",)  # config.json model_types read here


@dataclass(frozen=True)
class Lfm2Config:
    hidden: int
    n_layers: int
    ffn: int
    n_heads: int
    n_kv_heads: int  # of every attention layer
    head_dim: int
    rope_base: float
    rms_eps: float
    conv_taps: int  # shortconv.l_cache: the current token and the conv_taps - 1 before it
    vocab: int  # rows of token_embd
    attention_layers: tuple[int, ...]  # the others are conv layers

    @classmethod
    def from_loader(cls, model: WeightLoader) -> Lfm2Config:
        arch = model.architecture
        if arch != ARCH:
            raise ModelFormatError(f"{model.name}: metadata key 'general.architecture' is {arch!r:.40}, expected '{ARCH}'")

        def i(key: str) -> int:
            return model.get_int(f"{ARCH}.{key}")

        def has(key: str) -> bool:
            return model.has(f"{ARCH}.{key}")

        hidden, n_heads, n_layers = i("embedding_length"), i("attention.head_count"), i("block_count")
        embd = model.dims("token_embd.weight")
        if len(embd) != 2 or embd[0] != hidden:
            raise ModelFormatError(
                f"{model.name}: tensor 'token_embd.weight' has dims {embd} (ne0 first), expected ({hidden}, vocab)"
            )
        key = f"{ARCH}.attention.head_count_kv"
        per_layer = [model.get_int(key)] * n_layers if isinstance(model.get(key), int) else model.get_int_array(key)
        heads = set(per_layer) - {0}
        if len(per_layer) != n_layers or len(heads) > 1:
            raise ModelFormatError(f"{model.name}: metadata key '{key}' is {per_layer[:64]}, expected {n_layers} "
                                   f"values, 0 for a conv layer and one head count for the attention layers")
        head_dim = i("attention.key_length") if has("attention.key_length") else hidden // max(n_heads, 1)
        if has("attention.value_length") and i("attention.value_length") != head_dim:
            raise UnsupportedError(f"{model.name}: attention.value_length differs from the key length {head_dim}")
        if model.get(f"{ARCH}.rope.scaling.type") not in (None, "none"):
            raise UnsupportedError(f"{model.name}: rope scaling is not supported for {ARCH}")
        config = cls(
            hidden=hidden,
            n_layers=n_layers,
            ffn=i("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=heads.pop() if heads else n_heads,
            head_dim=head_dim,
            rope_base=model.get_float(f"{ARCH}.rope.freq_base"),
            rms_eps=model.get_float(f"{ARCH}.attention.layer_norm_rms_epsilon"),
            conv_taps=i("shortconv.l_cache"),
            vocab=embd[1],
            attention_layers=tuple(j for j, n in enumerate(per_layer) if n),
        )
        config.validate(model.name)
        return config

    def validate(self, where: str = "lfm2 config") -> None:
        counts = {name: getattr(self, name) for name in ("hidden", "n_layers", "ffn", "n_heads", "n_kv_heads",
                                                         "head_dim", "vocab")}
        check_config(where, counts, (
            (self.n_heads % self.n_kv_heads == 0, f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}"),
            (self.head_dim % 2 == 0, f"head dim {self.head_dim} must be even"),
            (self.rope_base > 0, f"rope.freq_base {self.rope_base} must be > 0"),
            (self.rms_eps > 0, f"attention.layer_norm_rms_epsilon {self.rms_eps} must be > 0"),
            (self.conv_taps >= 2, f"shortconv.l_cache {self.conv_taps} must be >= 2"),
        ))

    def slots(self) -> list[int]:
        """Each layer's index among the layers of its kind (attention or conv): where its state is."""
        attention = set(self.attention_layers)
        return [sum(1 for j in range(i) if (j in attention) == (i in attention)) for i in range(self.n_layers)]


# ---------------------------------------------------------------------------------- state


@dataclass(frozen=True)
class Lfm2Checkpoint:
    """A deep copy of a state: the KV caches' checkpoint and each conv layer's window."""

    kv: KVCheckpoint
    conv: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + nbytes(self.conv)


class Lfm2State:
    """The attention layers' KV caches (a KVState, whose `pos` is this state's) and each conv
    layer's window: its last conv_taps - 1 inputs (conv_taps - 1, hidden) fp32, oldest first."""

    def __init__(self, config: Lfm2Config, max_len: int, dtype: torch.dtype, device: torch.device):
        c = config
        self.kv = KVState(len(c.attention_layers), c.n_kv_heads, c.head_dim, max_len, dtype, device)
        self.views = self.kv.views  # by attention layer, as attend_spans reads them
        self.max_len = max_len
        self.conv = [torch.zeros(c.conv_taps - 1, c.hidden, device=device)
                     for _ in range(c.n_layers - len(c.attention_layers))]

    @property
    def pos(self) -> int:
        return self.kv.pos

    @pos.setter
    def pos(self, value: int) -> None:
        self.kv.pos = value

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + nbytes(self.conv)

    def kv_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.kv.kv_pairs()

    def fixed_tensors(self) -> list[torch.Tensor]:
        """The state that is not indexed by position: the conv windows."""
        return list(self.conv)

    def checkpoint(self) -> Lfm2Checkpoint:
        with torch.inference_mode():
            return Lfm2Checkpoint(self.kv.checkpoint(), tuple(t.clone() for t in self.conv))

    def restore(self, ckpt: Lfm2Checkpoint) -> None:
        """Return exactly to the state `ckpt` was taken from (of this state or one like it)."""
        if len(ckpt.conv) != len(self.conv) or any(s.shape != d.shape or s.dtype != d.dtype
                                                   for s, d in zip(ckpt.conv, self.conv)):
            raise PagelmError(f"checkpoint of {len(ckpt.conv)} conv windows "
                              f"{[tuple(s.shape) for s in ckpt.conv[:1]]} does not fit a state of {len(self.conv)} "
                              f"{[tuple(d.shape) for d in self.conv[:1]]}")
        self.kv.restore(ckpt.kv)
        with torch.inference_mode():
            for d, s in zip(self.conv, ckpt.conv):
                d.copy_(s)


# ---------------------------------------------------------------------------------- weights


@dataclass
class AttentionWeights:
    qkv: Linear  # (H·D + 2·G·D, hidden): attn_q, attn_k, attn_v
    q_norm: torch.Tensor  # (D,) fp32
    k_norm: torch.Tensor
    out: Linear  # (hidden, H·D)


@dataclass
class ConvWeights:
    in_proj: Linear  # (3·hidden, hidden): B, C, x
    taps: torch.Tensor  # (conv_taps, hidden) fp32: shortconv.conv transposed, the last tap on the current token
    out: Linear  # (hidden, hidden)


@dataclass
class Lfm2Layer:
    attn_norm: torch.Tensor  # (hidden,) fp32: transformers' operator_norm
    mixer: AttentionWeights | ConvWeights
    ffn_norm: torch.Tensor
    gate_up: Linear  # (2·ffn, hidden): ffn_gate then ffn_up
    down: Linear  # (hidden, ffn)


def load_layer(c: Lfm2Config, model: WeightLoader, i: int) -> Lfm2Layer:
    p = f"blk.{i}."
    if i in c.attention_layers:
        hd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        mixer = AttentionWeights(
            qkv=model.linear(c.hidden, (p + "attn_q.weight", hd), (p + "attn_k.weight", kvd), (p + "attn_v.weight", kvd)),
            q_norm=model.tensor(p + "attn_q_norm.weight", (c.head_dim,)),
            k_norm=model.tensor(p + "attn_k_norm.weight", (c.head_dim,)),
            out=model.linear(hd, (p + "attn_output.weight", c.hidden)),
        )
    else:
        mixer = ConvWeights(
            in_proj=model.linear(c.hidden, (p + "shortconv.in_proj.weight", 3 * c.hidden)),
            taps=model.tensor(p + "shortconv.conv.weight", (c.hidden, c.conv_taps)).T.contiguous(),
            out=model.linear(c.hidden, (p + "shortconv.out_proj.weight", c.hidden)),
        )
    return Lfm2Layer(
        attn_norm=model.tensor(p + "attn_norm.weight", (c.hidden,)),
        mixer=mixer,
        ffn_norm=model.tensor(p + "ffn_norm.weight", (c.hidden,)),
        gate_up=model.linear(c.hidden, (p + "ffn_gate.weight", c.ffn), (p + "ffn_up.weight", c.ffn)),
        down=model.linear(c.ffn, (p + "ffn_down.weight", c.hidden)),
    )


# ---------------------------------------------------------------------------------- model


class Lfm2Model(Decoder):
    """The decoder stack (every layer, then token_embd_norm); token_embd and output stay in the file.

    `forward(x, state)` maps input embeddings (T, hidden), the raw token_embd rows, to final hidden
    states (T, hidden) fp32; `decode_batch` one token of each of several sequences. Matmuls and the
    KV cache run in `dtype`; norms, rope, the gates and the conv in fp32; the residual stream is
    fp32. T > 1 is a prefill, processed in segments of at most `segment` tokens.
    """

    segment = 512

    def __init__(self, config: Lfm2Config, model: WeightLoader):
        self.config, self.dtype, self.device = config, model.dtype, model.device
        self.layers = [load_layer(config, model, i) for i in range(config.n_layers)]
        self.slots = config.slots()
        self.output_norm = model.tensor("token_embd_norm.weight", (config.hidden,))
        self.inv_freq = inv_freq(config.rope_base, config.head_dim, self.device)
        self.token_rope = RopeRows(lambda pos: rope_tables(self.inv_freq, pos, 1))
        self._compiled: TokenLayers | bool | None = None  # the one-token layers as compiled calls; False: not taken

    def new_state(self, max_len: int) -> Lfm2State:
        return Lfm2State(self.config, max_len, self.dtype, self.device)

    def kernel_jobs(self) -> list:
        return warmup_jobs([_token_layer(w) for w in self.layers], self.dtype)

    def _layers(self, x: torch.Tensor, spans: list[Span], alone: bool) -> Generator:
        c = self.config
        ropes = [self.token_rope(s.state.pos) if s.hi - s.lo == 1 else rope_tables(self.inv_freq, s.state.pos, s.hi - s.lo)
                 for s in spans]
        tokens = token_ropes(ropes) if x.shape[0] == len(spans) else None  # one token each: the batched kernels
        step = None if tokens is None else TokenStep.of(x, [s.state for s in spans], [tokens], c.head_dim**-0.5,
                                                        c.n_heads, c.n_kv_heads, c.head_dim)
        if step is not None:
            return (yield from self._token_layers(step, spans, alone))
        h = x.to(device=self.device, dtype=torch.float32, copy=True)
        for w, slot in zip(self.layers, self.slots):
            y = rms_norm(h, w.attn_norm, c.rms_eps, tokens_alone=alone)
            if isinstance(w.mixer, AttentionWeights):
                h += self._attention(w.mixer, y, slot, spans, ropes, tokens, alone)
            else:
                h += self._conv(w.mixer, y, slot, spans, alone)
            h += gated_mlp(w.gate_up, w.down, rms_norm(h, w.ffn_norm, c.rms_eps, tokens_alone=alone), F.silu, alone,
                           spans)
            yield
        advance(spans)
        return rms_norm(h, self.output_norm, c.rms_eps, tokens_alone=alone)

    def _attention(self, w: AttentionWeights, y: torch.Tensor, slot: int, spans: list[Span], ropes: list, tokens,
                   alone: bool) -> torch.Tensor:
        """`tokens`: with one token of each span's sequence, their rope tables as one (token_ropes)."""
        c, T = self.config, y.shape[0]
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        proj = w.qkv(y, alone).float()
        # contiguous, so that one token's heads take the same norm kernel alone and in a batch
        one_each = tokens is not None
        q = rms_norm(proj[:, : H * D].reshape(T, H, D).contiguous(), w.q_norm, c.rms_eps, tokens_alone=one_each)
        k = rms_norm(proj[:, H * D : (H + G) * D].reshape(T, G, D).contiguous(), w.k_norm, c.rms_eps,
                     tokens_alone=one_each)
        v = proj[:, (H + G) * D :].view(T, G, D)
        scale = D**-0.5

        def attend(s: Span, rope) -> torch.Tensor:
            qs, ks = q[s.lo : s.hi], k[s.lo : s.hi]
            apply_rope_(qs, *rope)
            apply_rope_(ks, *rope)
            kv = s.state  # its pos is the span's own (decoder.RowState), not always the KV state's
            return attention(qs, ks, v[s.lo : s.hi], kv.kv.layers[slot], kv.pos, scale, views=kv.views[slot])

        o = None if tokens is None else attend_spans(q, k, v, spans, slot, tokens, scale)
        return w.out(per_sequence(attend, spans, ropes) if o is None else o, alone)

    def _conv(self, w: ConvWeights, y: torch.Tensor, slot: int, spans: list[Span], alone: bool) -> torch.Tensor:
        n = self.config.hidden
        proj = w.in_proj(y, alone).float()
        bx = proj[:, :n] * proj[:, 2 * n :]

        def shift(s: Span, _) -> torch.Tensor:
            out = causal_conv1d(bx[s.lo : s.hi], s.state.conv[slot], w.taps)
            keep(s, s.state.conv[slot])
            return out

        return w.out(proj[:, n : 2 * n] * per_sequence(shift, spans, [None] * len(spans)), alone)


    def _token_layers(self, step: TokenStep, spans: list[Span], alone: bool) -> Generator:
        """_layers for one token of each span's sequence, in numpy between the kernels, without ~15
        torch dispatches a layer (a third of the time outside the products of a 1.2B step); or as
        compiled calls (token_layers.TokenLayers), where every product is GGML rows read in place."""
        c, h = self.config, step.h
        H, G, D, n = c.n_heads, c.n_kv_heads, c.head_dim, h.shape[0]
        if self._compiled is None:
            self._compiled = TokenLayers.of([_token_layer(w) for w in self.layers], K_NORM + 1, slots=[
                slot if isinstance(w.mixer, AttentionWeights) else -1 - slot
                for w, slot in zip(self.layers, self.slots)]) or False
        # each conv layer's window of each sequence, by address (float32, C-contiguous, never reallocated)
        windows = np.array([[s.state.conv[j].data_ptr() for s in spans] for j in range(len(spans[0].state.conv))],
                           np.int64)
        one_wave = len(waves(spans)) == 1  # distinct sequences; else a pass's rows of one, each row's windows kept
        if self._compiled and one_wave:
            h = yield from self._compiled.run(step, H, G, D, c.rms_eps, F.silu, conv_at=windows)
            advance(spans)
            return torch.from_numpy(step.norm(h, self.output_norm, c.rms_eps))
        for w, slot in zip(self.layers, self.slots):
            y = step.norm(h, w.attn_norm, c.rms_eps, "norm")
            m = w.mixer
            if isinstance(m, AttentionWeights):
                proj = step.product(m.qkv, y, alone)
                q = step.norm(np.ascontiguousarray(proj[:, : H * D]).reshape(n * H, D), m.q_norm, c.rms_eps, "q")
                k = step.norm(np.ascontiguousarray(proj[:, H * D : (H + G) * D]).reshape(n * G, D), m.k_norm,
                              c.rms_eps, "k")
                v = np.ascontiguousarray(proj[:, (H + G) * D :]).reshape(n, G, D)
                h += step.product(m.out, step.attend(q.reshape(n, H, D), k.reshape(n, G, D), v, slot), alone)
            else:
                h += step.product(m.out, self._conv_token(m, step.product(m.in_proj, y, alone), slot, windows, spans,
                                                          one_wave), alone)
            h += step.gated(w.gate_up, w.down, step.norm(h, w.ffn_norm, c.rms_eps, "norm"), F.silu, alone)
            yield
        advance(spans)
        return torch.from_numpy(step.norm(h, self.output_norm, c.rms_eps))

    def _conv_token(self, w: ConvWeights, proj: np.ndarray, slot: int, windows: np.ndarray, spans: list[Span],
                    one_wave: bool) -> np.ndarray:
        """C · conv(B · x) of one token of each span's sequence (proj: in_proj's rows B, C, x), each sequence's conv
        window (address windows[slot, s]) advanced in place: at once where the spans are distinct sequences
        (`one_wave`), row after row (each kept for rewinding) where they are a pass's rows of one (decoder.RowState)."""
        out = np.empty((proj.shape[0], self.config.hidden), np.float32)
        taps = w.taps.numpy()
        if one_wave:
            conv_tokens(taps, windows[slot], proj, out)
            return out
        for i, s in enumerate(spans):
            conv_tokens(taps, windows[slot, i : i + 1], proj[i : i + 1], out[i : i + 1])
            keep(s, s.state.conv[slot])
        return out


def _token_layer(w: Lfm2Layer) -> SimpleNamespace:
    """A layer as TokenLayers takes it: a conv layer's in_proj as its `qkv`, its attention norm in place
    of the q/k norms it lacks (unused)."""
    m = w.mixer
    conv = isinstance(m, ConvWeights)
    return SimpleNamespace(qkv=m.in_proj if conv else m.qkv, out=m.out, gate_up=w.gate_up, down=w.down,
                           attn_norm=w.attn_norm, ffn_norm=w.ffn_norm, q_norm=w.attn_norm if conv else m.q_norm,
                           k_norm=w.attn_norm if conv else m.k_norm, taps=m.taps if conv else None)


HF_GLOBALS = {"token_embd_norm.weight": "embedding_norm.weight"}
HF_LAYER = {
    "attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight", "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.out_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight", "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "shortconv.in_proj.weight": "conv.in_proj.weight", "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
}


def _attention_layers(config: HFConfig, n_layers: int) -> list[bool]:
    """Which layers attend: `layer_types` (any type but conv attends, as in transformers), else
    `full_attn_idxs`, else every layer."""
    types = config.strings("layer_types")
    if types:
        if len(types) != n_layers:
            raise ModelFormatError(f"{config.name}: layer_types lists {len(types)} layers, expected {n_layers}")
        return [t != "conv" for t in types]
    indices = config.get("full_attn_idxs")
    if indices is None:
        return [True] * n_layers
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers
                                                for i in indices):
        raise ModelFormatError(f"{config.name}: key 'full_attn_idxs' is {json.dumps(indices)[:60]}, expected "
                               f"layer indices below {n_layers}")
    return [i in indices for i in range(n_layers)]


def _ffn(config: HFConfig) -> int:
    """The MLP's width as transformers' Lfm2MLP derives it from the config (block_auto_adjust_ff_dim)."""
    ffn = config.int("block_ff_dim") if config.get("block_ff_dim") is not None else config.int("intermediate_size")
    adjust = config.get("block_auto_adjust_ff_dim", True)
    if not isinstance(adjust, bool):
        raise ModelFormatError(f"{config.name}: key 'block_auto_adjust_ff_dim' is {json.dumps(adjust)[:60]}, expected a boolean")
    if not adjust:
        return ffn
    ffn = int(2 * ffn / 3)
    if config.get("block_ffn_dim_multiplier", 1.0) is not None:
        ffn = int(config.float("block_ffn_dim_multiplier", 1.0) * ffn)
        multiple = config.int("block_multiple_of", 256)
        if multiple < 1:
            raise ModelFormatError(f"{config.name}: key 'block_multiple_of' is {multiple}, expected >= 1")
        ffn = multiple * ((ffn + multiple - 1) // multiple)
    return ffn


def hf_layout(config: HFConfig, hf_names: set[str]) -> HFLayout:
    """A Hugging Face LFM2 checkpoint in GGUF terms: every tensor as stored (the conv taps (hidden,
    1, taps) as (hidden, taps)); the per-layer kv head counts and the MLP width from the config."""
    n_layers, hidden, n_heads = config.int("num_hidden_layers"), config.int("hidden_size"), config.int("num_attention_heads")
    n_kv = config.int("num_key_value_heads", n_heads)
    taps = config.int("conv_L_cache", 3)
    if config.get("conv_bias", False) is not False:
        raise UnsupportedError(f"{config.name}: conv_bias {json.dumps(config.get('conv_bias'))[:20]} is not supported "
                               f"(LFM2 checkpoints have no biases)")
    if rope_scaling(config, ARCH):
        raise UnsupportedError(f"{config.name}: rope scaling is not supported for {ARCH}")
    a = ARCH + "."
    metadata = {
        "general.architecture": ARCH,
        a + "block_count": n_layers, a + "embedding_length": hidden, a + "feed_forward_length": _ffn(config),
        a + "attention.head_count": n_heads,
        a + "attention.head_count_kv": [n_kv if attends else 0 for attends in _attention_layers(config, n_layers)],
        a + "attention.key_length": config.int("head_dim", hidden // max(n_heads, 1)),
        a + "attention.layer_norm_rms_epsilon": config.float("norm_eps", 1e-5),
        a + "rope.freq_base": config.rope_float("rope_theta", 1_000_000.0),
        a + "shortconv.l_cache": taps,
    }
    maps = tensor_maps(config, hf_names, n_layers, HF_GLOBALS, HF_LAYER)
    for name, tmap in maps.items():
        if name.endswith("shortconv.conv.weight"):
            maps[name] = replace(tmap, hf_shape=(hidden, 1, taps))
    return HFLayout(metadata, maps)


def hf_config(c: Lfm2Config, tied: bool) -> dict:
    """config.json for a Hugging Face twin of a checkpoint with this config."""
    return {
        "architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "norm_eps": c.rms_eps,
        "block_auto_adjust_ff_dim": False, "conv_bias": False, "conv_L_cache": c.conv_taps,
        "layer_types": ["full_attention" if i in c.attention_layers else "conv" for i in range(c.n_layers)],
        "rope_parameters": hf_rope(c.rope_base, 1.0), **decoder_hf_config(c, tied),
    }


Config, Model = Lfm2Config, Lfm2Model  # the registry's names (pagelm.models)
