"""The decoder llama and the architectures that differ from it only by a `Family`'s switches are:
pre-norm GQA attention with NeoX rope and a SiLU-gated MLP over a KV cache.

Owns that math in its GGUF conventions, its KV state and its Hugging Face layout; never parses files
(a `WeightLoader` hands it config values, small tensors and linear operators), never embeds tokens,
never computes the output head, and names no architecture (each one's module holds its `Family`).

GGUF conventions handled here:
- A family's converter may reorder the rows of attn_q / attn_k within each head (llama.cpp's does
  for llama, so that ggml's normal rope applies): `Family.qk_rows`; the q/k operators read the rows
  back in Hugging Face's order (no copy in mapped mode) and rope is NeoX / rotate-half (pairs
  (i, i + D/2)) like transformers.
- Optional per family: a bias on q, k and v (attn_{q,k,v}.bias); an RMSNorm of q and k per head
  before rope (attn_{q,k}_norm.weight, head_dim values each); a mixture of experts as every layer's
  feed-forward (`models.moe`: ffn_gate_inp and the 3-D ffn_{gate,up,down}_exps), whose decode steps
  take `_token_layers` in numpy, not TokenLayers' compiled layers.
- Optional per family as well: a bias on attn_output; attention sinks (attn_sinks.weight, a logit per head
  in each softmax: layers.sink_attention, whose decode goes through torch's path, not the one-token
  kernels); every other layer (0, 2, ...) attends within attention.sliding_window (a full-length KV
  cache masked to the window); the feed-forward's norm named post_attention_norm; experts with
  biases, routed by the top k of the router's logits (with its bias) then a softmax over those k,
  activated by the clamped SwiGLU (`models.moe`); YaRN rope scaling.
- RMSNorm weights are used as stored (no +1); no embedding scale.
- rope scaling: `<arch>.rope.scaling.type` none or linear, and the llama3-style per-pair
  frequency factors: GGUF's `rope_freqs.weight`, or computed from a Hugging Face config's llama3
  numbers (`models.rope_scaling`); yarn where the family reads it (`Family.yarn`: factor,
  original_context_length, llama.cpp's yarn_beta_fast / yarn_beta_slow, and pagelm's yarn_truncate,
  false when absent as gpt-oss's config says); other scalings are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

import numpy as np

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.models.decoder import Decoder, Span, advance, per_sequence
from pagelm.models.moe import ClampedSwiglu, Experts
from pagelm.models.layers import (KVState, apply_rope_, check_config, attend_spans, attention, gated_mlp, inv_freq, rms_norm,
                                  rope_tables, yarn_inv_freq)
from pagelm.models.rope_scaling import Llama3Scaling, YarnScaling
from pagelm.models.token_layers import K_NORM, TokenLayers, warmup_jobs
from pagelm.models.token_ops import RopeRows, TokenStep, token_ropes
from pagelm.weights.hf import (LLAMA3_KEYS, HFConfig, HFLayout, decoder_hf_config, decoder_metadata, expert_tensor,
                               hf_rope, rope_scaling, tensor_maps)
from pagelm.weights.linear import Linear
from pagelm.weights.loader import WeightLoader


@dataclass(frozen=True)
class Family:
    """What sets a llama-like architecture apart: its GGUF and Hugging Face names and switches."""

    arch: str  # general.architecture, the metadata keys' prefix and (unless hf_type) config.json's model_type
    hf_class: str  # config.json's architectures entry
    # qk_rows(rows, heads): the GGUF row of each Hugging Face row of attn_q / attn_k, where the
    # converter reorders them; None: as stored
    qk_rows: Callable[[int, int], np.ndarray] | None = None
    qkv_bias: bool = False  # attn_q/k/v have biases
    qk_norm: bool = False  # q and k are RMS-normed per head before rope
    moe: bool = False  # the feed-forward is a mixture of experts (models.moe): ffn_gate_inp, ffn_{gate,up,down}_exps
    hf_type: str | None = None  # config.json's model_type where it is not `arch`
    out_bias: bool = False  # attn_output has a bias
    sinks: bool = False  # attn_sinks.weight: each head's softmax has that logit more (layers.sink_attention)
    swa_period: int = 0  # layer i attends within attention.sliding_window unless i % swa_period == swa_period - 1
    ffn_norm: str = "ffn_norm"  # the GGUF name of the norm before the feed-forward
    # gpt-oss's experts: ffn_gate_inp.bias and ffn_{gate,up,down}_exps.bias, the top k of the logits then
    # their softmax, the clamped SwiGLU (models.moe)
    oss_experts: bool = False
    yarn: bool = False  # rope.scaling.type yarn is read (models.rope_scaling.YarnScaling)

    @property
    def model_type(self) -> str:
        return self.hf_type or self.arch

    @property
    def token_step(self) -> bool:
        """Whether a decode step may take `_token_layers` (token_ops.TokenStep): its one-token kernels
        have no attention sinks, windows or output bias; such a family's decode is torch's `_layers`."""
        return not (self.sinks or self.swa_period or self.out_bias)


@dataclass(frozen=True)
class FamilyConfig:
    family: ClassVar[Family]  # set by family_module's subclass
    hidden: int
    n_layers: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rope_scale: float  # linear rope scaling factor (positions are divided by it); 1.0 for none
    rms_eps: float
    vocab: int  # rows of token_embd
    llama3: Llama3Scaling | None = None  # Llama 3.1's rope scaling from a config's numbers (else rope_freqs.weight)
    # a mixture of experts (family.moe): expert_count, expert_used_count, expert_feed_forward_length,
    # and whether the chosen experts' weights are renormalized (expert_weights_norm, llama.cpp's
    # qwen3moe always does)
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    expert_norm: bool = True
    sliding_window: int = 0  # family.swa_period's windowed layers' attention.sliding_window
    yarn: YarnScaling | None = None

    @classmethod
    def from_loader(cls, model: WeightLoader) -> FamilyConfig:
        arch, name = model.architecture, cls.family.arch
        if arch != name:
            raise ModelFormatError(f"{model.name}: metadata key 'general.architecture' is {arch!r:.40}, expected '{name}'")

        def i(key: str) -> int:
            return model.get_int(f"{name}.{key}")

        def opt(key: str):
            return model.get(f"{name}.{key}")

        hidden, n_heads = i("embedding_length"), i("attention.head_count")
        embd = model.dims("token_embd.weight")
        if len(embd) != 2 or embd[0] != hidden:
            raise ModelFormatError(
                f"{model.name}: tensor 'token_embd.weight' has dims {embd} (ne0 first), expected ({hidden}, vocab)"
            )
        head_dim = i("attention.key_length") if opt("attention.key_length") is not None else hidden // max(n_heads, 1)
        if opt("attention.value_length") is not None and i("attention.value_length") != head_dim:
            raise UnsupportedError(f"{model.name}: attention.value_length differs from the key length {head_dim}")
        if opt("rope.dimension_count") is not None and i("rope.dimension_count") != head_dim:
            raise UnsupportedError(f"{model.name}: partial rope ({i('rope.dimension_count')} of {head_dim} dims) is not supported")
        scaling = opt("rope.scaling.type")
        rope_scale, llama3 = 1.0, None
        yarn = None
        if scaling == "llama3":  # a Hugging Face config's numbers (a GGUF carries rope_freqs.weight)
            llama3 = Llama3Scaling(*(model.get_float(f"{name}.rope.scaling.{key}") for key in ("factor", *LLAMA3_KEYS)))
        elif scaling == "yarn" and cls.family.yarn:
            yarn = YarnScaling(model.get_float(f"{name}.rope.scaling.factor"),
                               model.get_float(f"{name}.rope.scaling.original_context_length"),
                               *(model.get_float(f"{name}.rope.scaling.{key}") if opt(f"rope.scaling.{key}") is not None
                                 else default for key, default in (("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0))),
                               bool(opt("rope.scaling.yarn_truncate") or False))
        elif scaling not in (None, "none"):
            if scaling != "linear":
                raise UnsupportedError(f"{model.name}: rope scaling {scaling!r:.40} is not supported (none, linear, "
                                       f"llama3{', yarn' if cls.family.yarn else ''} are)")
            rope_scale = model.get_float(f"{name}.rope.scaling.factor")
        n_kv = i("attention.head_count_kv") if opt("attention.head_count_kv") is not None else n_heads
        config = cls(
            hidden=hidden,
            n_layers=i("block_count"),
            ffn=i("feed_forward_length"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            rope_base=model.get_float(f"{name}.rope.freq_base") if opt("rope.freq_base") is not None else 10000.0,
            rope_scale=rope_scale,
            rms_eps=model.get_float(f"{name}.attention.layer_norm_rms_epsilon"),
            vocab=embd[1],
            llama3=llama3,
            yarn=yarn,
            sliding_window=i("attention.sliding_window") if cls.family.swa_period else 0,
        )
        if cls.family.moe:
            norm = opt("expert_weights_norm")
            config = replace(config, n_experts=i("expert_count"), n_experts_used=i("expert_used_count"),
                             expert_ffn=i("expert_feed_forward_length"), expert_norm=True if norm is None else bool(norm))
        config.validate(model.name)
        return config

    def validate(self, where: str | None = None) -> None:
        where = where or f"{self.family.arch} config"
        moe = ("n_experts", "n_experts_used", "expert_ffn")
        counts = {name: value for name, value in vars(self).items()
                  if name not in ("rope_base", "rope_scale", "rms_eps", "llama3", "expert_norm", "yarn")
                  and (self.family.moe or name not in moe) and (self.family.swa_period or name != "sliding_window")}
        check_config(where, counts, (
            (self.n_heads % self.n_kv_heads == 0, f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}"),
            (self.head_dim % 2 == 0, f"head dim {self.head_dim} must be even"),
            (self.rope_base > 0, f"rope.freq_base {self.rope_base} must be > 0"),
            (self.rope_scale > 0, f"rope.scaling.factor {self.rope_scale} must be > 0"),
            (self.rms_eps > 0, f"attention.layer_norm_rms_epsilon {self.rms_eps} must be > 0"),
            (self.n_experts_used <= self.n_experts,
             f"expert_used_count {self.n_experts_used} exceeds expert_count {self.n_experts}"),
            (self.yarn is None or self.yarn.factor > 0 and self.yarn.original_context > 0,
             f"rope.scaling.factor and original_context_length must be > 0, got {self.yarn}"),
        ))

    def window(self, i: int) -> int | None:
        """Layer i's attention window (None: every earlier key)."""
        p = self.family.swa_period
        return self.sliding_window if p and i % p != p - 1 else None


@dataclass
class FamilyLayer:
    attn_norm: torch.Tensor  # (hidden,) fp32
    qkv: Linear  # (H·D + 2·G·D, hidden): attn_q, attn_k (both in HF row order), attn_v
    out: Linear  # (hidden, H·D)
    ffn_norm: torch.Tensor
    gate_up: Linear | None  # (2·ffn, hidden): ffn_gate then ffn_up; None where the layer has experts
    down: Linear | None  # (hidden, ffn)
    experts: Experts | None = None  # the feed-forward of a family.moe layer
    qkv_bias: torch.Tensor | None = None  # (H·D + 2·G·D,) fp32, qkv's rows' order
    q_norm: torch.Tensor | None = None  # (D,) fp32
    k_norm: torch.Tensor | None = None
    out_bias: torch.Tensor | None = None  # (hidden,) fp32
    sinks: torch.Tensor | None = None  # (H,) fp32


def load_layer(c: FamilyConfig, model: WeightLoader, i: int) -> FamilyLayer:
    f, p = c.family, f"blk.{i}."
    hd, kvd = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    orders = [np.arange(hd), np.arange(kvd), np.arange(kvd)] if f.qk_rows is None \
        else [f.qk_rows(hd, c.n_heads), f.qk_rows(kvd, c.n_kv_heads), np.arange(kvd)]
    qkv = [(p + f"attn_{x}.weight", len(order), order) for x, order in zip("qkv", orders)]
    bias = None
    if f.qkv_bias:
        bias = torch.cat([model.tensor(p + f"attn_{x}.bias", (len(order),))[torch.from_numpy(order)]
                          for x, order in zip("qkv", orders)])
    return FamilyLayer(
        attn_norm=model.tensor(p + "attn_norm.weight", (c.hidden,)),
        qkv=model.linear(c.hidden, *qkv),
        out=model.linear(hd, (p + "attn_output.weight", c.hidden)),
        ffn_norm=model.tensor(p + f.ffn_norm + ".weight", (c.hidden,)),
        gate_up=None if f.moe else model.linear(c.hidden, (p + "ffn_gate.weight", c.ffn), (p + "ffn_up.weight", c.ffn)),
        down=None if f.moe else model.linear(c.ffn, (p + "ffn_down.weight", c.hidden)),
        experts=load_experts(c, model, p, oss=f.oss_experts) if f.moe else None,
        qkv_bias=bias,
        q_norm=model.tensor(p + "attn_q_norm.weight", (c.head_dim,)) if f.qk_norm else None,
        k_norm=model.tensor(p + "attn_k_norm.weight", (c.head_dim,)) if f.qk_norm else None,
        out_bias=model.tensor(p + "attn_output.bias", (c.hidden,)) if f.out_bias else None,
        sinks=model.tensor(p + "attn_sinks.weight", (c.n_heads,)) if f.sinks else None,
    )


def load_experts(c, model: WeightLoader, p: str, shared_ffn: int = 0, oss: bool = False) -> Experts:
    """The mixture of the layer whose names start with `p`, of a config with hidden, n_experts,
    n_experts_used, expert_ffn and expert_norm (FamilyConfig's, qwen35moe's); with `shared_ffn`, a
    shared expert of that width (ffn_{gate,up,down}_shexp) whose gate (ffn_gate_inp_shexp, one row)
    is the router's last row; `oss`: gpt-oss's experts (top-k then softmax, biases, clamped SwiGLU)."""
    shared = [(p + "ffn_gate_inp_shexp.weight", 1)] if shared_ffn else []
    # newer llama.cpp files may hold each expert's gate and up rows in one tensor, ffn_gate_up_exps (gate first)
    fused = p + "ffn_gate_up_exps.weight"
    gate_up = [(fused, 2 * c.expert_ffn)] if model.has_tensor(fused) else \
        [(p + "ffn_gate_exps.weight", c.expert_ffn), (p + "ffn_up_exps.weight", c.expert_ffn)]
    experts = Experts(  # the experts first: an expert count unlike their tensors' is named by the 3-D tensor
        gate_up=model.experts(c.hidden, c.n_experts, *gate_up),
        down=model.experts(c.expert_ffn, c.n_experts, (p + "ffn_down_exps.weight", c.hidden)),
        router=model.linear(c.hidden, (p + "ffn_gate_inp.weight", c.n_experts), *shared),
        top_k=c.n_experts_used, normalize=c.expert_norm,
        shared=(model.linear(c.hidden, (p + "ffn_gate_shexp.weight", shared_ffn), (p + "ffn_up_shexp.weight", shared_ffn)),
                model.linear(shared_ffn, (p + "ffn_down_shexp.weight", c.hidden))) if shared_ffn else None,
        pages=model.expert_pages(c.n_experts, *(name for name, _ in gate_up), p + "ffn_down_exps.weight"),
    )
    if not oss:
        return experts
    E, F_ = c.n_experts, c.expert_ffn
    return replace(experts, softmax_first=False, activation=ClampedSwiglu(),
                   router_bias=model.tensor(p + "ffn_gate_inp.bias", (E,)),
                   gate_up_bias=torch.cat([model.tensor(p + "ffn_gate_exps.bias", (E, F_)),
                                           model.tensor(p + "ffn_up_exps.bias", (E, F_))], 1),
                   down_bias=model.tensor(p + "ffn_down_exps.bias", (E, c.hidden)))


class FamilyModel(Decoder):
    """The decoder stack (every layer, then output_norm); token_embd and output stay in the file.

    `forward(x, state)` maps input embeddings (T, hidden) — the raw token_embd rows, no scale —
    to final hidden states (T, hidden) fp32; `decode_batch` one token of each of several sequences. Matmuls and the KV cache run in `dtype`; norms and
    rope in fp32; the residual stream is fp32. T > 1 is a prefill, processed in segments of at
    most `segment` tokens to bound the temporaries.
    """

    segment = 512

    def __init__(self, config: FamilyConfig, model: WeightLoader):
        self.config, self.dtype, self.device = config, model.dtype, model.device
        self.layers = [load_layer(config, model, i) for i in range(config.n_layers)]
        self.output_norm = model.tensor("output_norm.weight", (config.hidden,))
        factors = None
        if model.has_tensor("rope_freqs.weight"):  # llama3-style rope scaling, per pair
            factors = model.tensor("rope_freqs.weight", (config.head_dim // 2,))
        elif config.llama3 is not None:
            factors = torch.tensor(config.llama3.factors(config.rope_base, config.head_dim), dtype=torch.float32)
        if config.yarn is not None:
            self.inv_freq = yarn_inv_freq(config.rope_base, config.head_dim, config.yarn, self.device)
        else:
            self.inv_freq = inv_freq(config.rope_base, config.head_dim, self.device, factors)
        self.token_rope = RopeRows(lambda pos: self._rope(pos, 1))
        self._compiled: TokenLayers | bool | None = None  # the one-token layers as compiled calls; False: not taken

    def new_state(self, max_len: int) -> KVState:
        c = self.config
        return KVState(c.n_layers, c.n_kv_heads, c.head_dim, max_len, self.dtype, self.device)

    def kernel_jobs(self) -> list:
        return [] if self.config.family.moe else warmup_jobs(self.layers, self.dtype)

    def _rope(self, pos: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions pos..pos+T-1, times YaRN's attention factor where the rope has one."""
        cos, sin = rope_tables(self.inv_freq, pos, T, self.config.rope_scale)
        if self.config.yarn is not None:
            factor = self.config.yarn.attention_factor
            cos, sin = cos * factor, sin * factor
        return cos, sin

    def _layers(self, x: torch.Tensor, spans: list[Span], alone: bool) -> Generator:
        c, T = self.config, x.shape[0]
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        ropes = [self.token_rope(s.state.pos) if s.hi - s.lo == 1 else self._rope(s.state.pos, s.hi - s.lo)
                 for s in spans]
        scale = D**-0.5
        tokens = token_ropes(ropes) if T == len(spans) else None  # one token each: the batched kernels
        step = None if tokens is None or not c.family.token_step \
            else TokenStep.of(x, [s.state for s in spans], [tokens], scale, H, G, D)
        if step is not None:
            return (yield from self._token_layers(step, spans, alone))
        h = x.to(device=self.device, dtype=torch.float32, copy=True)
        for i, w in enumerate(self.layers):
            y = rms_norm(h, w.attn_norm, c.rms_eps)
            proj = w.qkv(y, alone).float()
            if w.qkv_bias is not None:
                proj += w.qkv_bias
            q = proj[:, : H * D].view(T, H, D)
            k = proj[:, H * D : (H + G) * D].view(T, G, D)
            v = proj[:, (H + G) * D :].view(T, G, D)
            if w.q_norm is not None:  # a batch's rows each normed as alone (contiguous, per-token row limit)
                alone_rows = tokens is not None
                q = rms_norm(q.contiguous() if alone_rows else q, w.q_norm, c.rms_eps, tokens_alone=alone_rows)
                k = rms_norm(k.contiguous() if alone_rows else k, w.k_norm, c.rms_eps, tokens_alone=alone_rows)

            window = c.window(i)

            def attend(s: Span, rope) -> torch.Tensor:
                qs, ks = q[s.lo : s.hi], k[s.lo : s.hi]
                apply_rope_(qs, *rope)
                apply_rope_(ks, *rope)
                kv = s.state
                return attention(qs, ks, v[s.lo : s.hi], kv.layers[i], kv.pos, scale, window, kv.views[i], w.sinks)

            o = None if tokens is None or w.sinks is not None else attend_spans(q, k, v, spans, i, tokens, scale, window)
            o = w.out(per_sequence(attend, spans, ropes) if o is None else o, alone)
            h += o if w.out_bias is None else o.float() + w.out_bias
            y = rms_norm(h, w.ffn_norm, c.rms_eps)
            h += gated_mlp(w.gate_up, w.down, y, F.silu, alone, spans) if w.experts is None else w.experts(y, alone)
            yield
        advance(spans)
        return rms_norm(h, self.output_norm, c.rms_eps)

    def _token_layers(self, step: TokenStep, spans: list[Span], alone: bool) -> Generator:
        """_layers for one token of each span's sequence, in numpy between the kernels: the same
        operations on the same values, bit for bit, without ~10 torch dispatches a layer."""
        c, h = self.config, step.h
        H, G, D = c.n_heads, c.n_kv_heads, c.head_dim
        n = h.shape[0]
        if self._compiled is None:
            per = K_NORM + 1 if c.family.qk_norm else 2  # the layers' norms: attn, ffn (and q, k)
            self._compiled = (not c.family.moe and TokenLayers.of(self.layers, per)) or False
        if self._compiled:
            h = yield from self._compiled.run(step, H, G, D, c.rms_eps, F.silu)
            advance(spans)
            return torch.from_numpy(step.norm(h, self.output_norm, c.rms_eps))
        for i, w in enumerate(self.layers):
            proj = step.product(w.qkv, step.norm(h, w.attn_norm, c.rms_eps, "norm"), alone)
            if w.qkv_bias is not None:
                proj += w.qkv_bias.numpy()
            q, k, v = (np.ascontiguousarray(proj[:, a:b]).reshape(n, -1, D)
                       for a, b in ((0, H * D), (H * D, (H + G) * D), ((H + G) * D, proj.shape[1])))
            if w.q_norm is not None:
                q = step.norm(q.reshape(n * H, D), w.q_norm, c.rms_eps, "q").reshape(n, H, D)
                k = step.norm(k.reshape(n * G, D), w.k_norm, c.rms_eps, "k").reshape(n, G, D)
            h += step.product(w.out, step.attend(q, k, v, i), alone)
            y = step.norm(h, w.ffn_norm, c.rms_eps, "norm")
            h += step.gated(w.gate_up, w.down, y, F.silu, alone) if w.experts is None \
                else w.experts(torch.from_numpy(y), alone).numpy()
            yield
        advance(spans)
        return torch.from_numpy(step.norm(h, self.output_norm, c.rms_eps))


HF_GLOBALS = {"output_norm.weight": "norm.weight"}
HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def family_layout(f: Family, config: HFConfig, hf_names: set[str] | None) -> HFLayout:
    """A Hugging Face checkpoint of family `f` in GGUF terms: q/k rows in the order `f.qk_rows` gives
    GGUF's (a row order, read in place), everything else as stored."""
    if config.get("attention_bias", False) and not f.qkv_bias:
        raise UnsupportedError(f"{config.name}: attention_bias is not supported for {f.arch}")
    if config.get("use_sliding_window", False):
        raise UnsupportedError(f"{config.name}: use_sliding_window is not supported for {f.arch}")
    n_layers, hidden, n_heads = config.int("num_hidden_layers"), config.int("hidden_size"), config.int("num_attention_heads")
    n_kv = config.int("num_key_value_heads", n_heads)
    head_dim = config.int("head_dim", hidden // max(n_heads, 1))
    metadata = decoder_metadata(f.arch, config, head_dim)
    metadata[f"{f.arch}.rope.freq_base"] = config.rope_float("rope_theta", 10000.0)
    metadata.update(rope_scaling(config, f.arch))
    per_layer = dict(HF_LAYER)
    if f.qkv_bias:
        per_layer.update({f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"})
    if f.qk_norm:
        per_layer.update({f"attn_{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"})
    if f.moe:
        metadata.update(moe_metadata(f.arch, config, hf_names))
        for x in ("gate", "up", "down"):
            del per_layer[f"ffn_{x}.weight"]
        per_layer.update(expert_names(metadata[f"{f.arch}.expert_count"]))
    maps = tensor_maps(config, hf_names, n_layers, HF_GLOBALS, per_layer)
    for i in range(0 if f.qk_rows is None else n_layers):
        for name, heads in (("attn_q.weight", n_heads), ("attn_k.weight", n_kv)):
            if f"blk.{i}.{name}" in maps:
                maps[f"blk.{i}.{name}"] = replace(maps[f"blk.{i}.{name}"],
                                                  rows=np.argsort(f.qk_rows(heads * head_dim, heads)))
    return HFLayout(metadata, maps)


def moe_metadata(arch: str, config: HFConfig, hf_names: set[str] | None) -> dict:
    """A mixture of experts' GGUF keys from config.json (Qwen3-MoE's names); a checkpoint with dense
    layers among the expert ones, or with each layer's experts fused into 3-D tensors, is refused."""
    if config.int("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise UnsupportedError(f"{config.name}: dense feed-forward layers among the expert ones (decoder_sparse_step, "
                               f"mlp_only_layers) are not supported for {arch}")
    fused = next((n for n in hf_names or () if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))), None)
    if fused is not None:
        raise UnsupportedError(f"{config.name}: tensor '{fused}' holds every expert of a layer; pagelm reads "
                               f"Hugging Face experts one tensor each (mlp.experts.E.gate_proj.weight)")
    norm = config.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ModelFormatError(f"{config.name}: key 'norm_topk_prob' is {norm!r:.40}, expected true or false")
    return {f"{arch}.expert_count": config.int("num_experts", config.get("num_local_experts")),
            f"{arch}.expert_used_count": config.int("num_experts_per_tok"),
            f"{arch}.expert_feed_forward_length": config.int("moe_intermediate_size"),
            f"{arch}.expert_weights_norm": norm}


def expert_names(n_experts: int) -> dict[str, str]:
    """A layer's router and experts, GGUF → Hugging Face names (each expert's matrices apart)."""
    names = {expert_tensor(f"ffn_{x}_exps.weight", e): f"mlp.experts.{e}.{x}_proj.weight"
             for x in ("gate", "up", "down") for e in range(n_experts)}
    return {**names, "ffn_gate_inp.weight": "mlp.gate.weight"}


def family_hf_config(f: Family, c: FamilyConfig, tied: bool) -> dict:
    """config.json for a Hugging Face twin of a checkpoint of family `f` with this config."""
    config = {"architectures": [f.hf_class], "model_type": f.model_type, "hidden_act": "silu",
              "attention_bias": f.qkv_bias, "rope_parameters": hf_rope(c.rope_base, c.rope_scale),
              **decoder_hf_config(c, tied)}
    if f.moe:
        config.update(num_experts=c.n_experts, num_experts_per_tok=c.n_experts_used,
                      moe_intermediate_size=c.expert_ffn, norm_topk_prob=c.expert_norm)
    return config


def family_module(f: Family) -> tuple:
    """What the registry (pagelm.models) reads of a family's module: (GGUF_ARCHITECTURES,
    HF_MODEL_TYPES, Config, Model, hf_layout, hf_config)."""
    config = type(f.hf_class.removesuffix("ForCausalLM") + "Config", (FamilyConfig,), {"family": f})
    return ((f.arch,), (f.model_type,), config, FamilyModel, functools.partial(family_layout, f),
            functools.partial(family_hf_config, f))
