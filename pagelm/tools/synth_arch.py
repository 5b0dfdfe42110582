"""Each architecture's part of a synthetic model: the geometry fields of a shape, the tensors of
its layers (names as llama.cpp's loader reads them, ggml dims, types, how values are drawn), the
tensors beyond the layers and its own metadata keys. The writer (`synth`) adds what every
architecture shares: token_embd (and output), the final norm, the common keys.

Value scales: every projection is drawn as N(0, gain / sqrt(fan_in)),
so a projection of an RMS-normalised vector has rms ~ gain; the residual outputs are scaled so
that the 2·n_layers residual additions bring the final hidden state to an rms of about
RESIDUAL_RMS. Norm weights are stored as each architecture's file holds them: ~1 (Qwen3.5 and
Gemma fold their +1 in; the others use them as they are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from pagelm.formats.gguf import GGUFValueType, Typed
from pagelm.models.rope_scaling import Llama3Scaling
from pagelm.quant.types import GGMLType, row_nbytes

F32 = GGMLType.F32
RESIDUAL_RMS = 8.0
_BRANCH_RMS = 0.6  # rough rms of the vector entering a residual output projection (MLP, DeltaNet, conv)
_ATTN_BRANCH_RMS = 0.3  # the same for attention: softmax averages v over positions
_NORM_NOISE = 0.05  # norm weights are 1 + N(0, _NORM_NOISE) (times a scale for output_norm)
_BIAS_RMS = 0.02


@dataclass(frozen=True)
class Init:
    """How one tensor's values are drawn.

    normal: center + scale · N(0, 1); uniform: U(low, high); neg_exp_uniform: -exp(U(low, high));
    fixed: `values` as given; table: the embedding tables' generator (random_rows) with seed +
    seed_offset; with `source`, the table random_rows draws in that type, decoded and encoded in
    the tensor's type.
    """

    kind: str
    scale: float = 0.0
    center: float = 0.0
    low: float = 0.0
    high: float = 0.0
    seed_offset: int = 0
    source: GGMLType | None = None
    values: tuple[float, ...] = ()


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dims: tuple[int, ...]  # ggml order, ne0 first
    ggml_type: GGMLType
    init: Init

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: the dims reversed."""
        return self.dims[::-1]

    @property
    def nbytes(self) -> int:
        return row_nbytes(self.ggml_type, self.dims[0]) * math.prod(self.dims[1:])


def normal(scale: float, center: float = 0.0) -> Init:
    return Init("normal", scale=scale, center=center)


def norm(center: float = 1.0) -> Init:
    return Init("normal", scale=_NORM_NOISE * center, center=center)


@dataclass(frozen=True)
class Shape:
    """The geometry of a model of architecture `arch` (a key of ARCHITECTURES); n_layers == 0 means
    embedding geometry only. The fields after `arch` belong to the architectures that name them."""

    vocab: int
    hidden: int
    embedding_type: GGMLType
    output_type: GGMLType | None  # None: the output head is tied to token_embd
    n_layers: int = 0
    ffn: int = 0
    n_head: int = 0  # attention query heads
    n_head_kv: int = 0
    head_dim: int = 0  # attention key = value head dim
    context_length: int = 262_144
    rms_eps: float = 1e-6
    rope_theta: float = 1e7
    arch: str = "qwen35"
    # qwen35: partial multimodal rope, Gated DeltaNet layers
    rope_dim: int = 0  # rotated dims at the start of each attention head
    rope_sections: tuple[int, int, int, int] = (0, 0, 0, 0)  # multimodal sections (pairs)
    ssm_k_heads: int = 0  # DeltaNet key heads (nk, ssm.group_count)
    ssm_v_heads: int = 0  # DeltaNet value heads (nv, ssm.time_step_rank)
    ssm_head_dim: int = 0  # DeltaNet key = value head dim (ssm.state_size)
    conv_kernel: int = 4  # qwen35 ssm_conv1d taps; lfm2 shortconv.l_cache
    full_attention_interval: int = 4  # layer i is full attention when i % interval == interval - 1
    mtp_layers: int = 0  # qwen35, qwen35moe: multi-token-prediction layers after the trunk (blk.{n_layers}.nextn.*)
    # lfm2: the attention layers (the others are short-convolution layers)
    attention_layers: tuple[int, ...] = ()
    # llama: llama3 rope scaling (factor, low_freq_factor, high_freq_factor, original context), or None
    llama3_rope: tuple[float, float, float, int] | None = None
    # gemma-embedding: sliding window of the local layers, one global layer in `pattern`, the widths
    # of the dense_2, dense_3 projections after mean pooling
    sliding_window: int = 0
    sliding_window_pattern: int = 6
    dense: tuple[int, ...] = ()
    # qwen3moe, qwen35moe: each layer's feed-forward a mixture of n_experts SiLU-gated MLPs of expert_ffn
    # rows, n_experts_used of them per token; qwen35moe: and a shared expert of shared_ffn rows
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    # gpt-oss: YaRN rope scaling (factor, original context length); its sliding window is sliding_window
    yarn_rope: tuple[float, int] | None = None

    @property
    def dim(self) -> int:
        return self.hidden

    @property
    def full(self) -> bool:
        """True when the shape has layers (a complete model can be written)."""
        return self.n_layers > 0

    def is_full_attention(self, layer: int) -> bool:
        return layer >= self.n_layers or layer % self.full_attention_interval == self.full_attention_interval - 1

    @property
    def ssm_qkv_channels(self) -> int:
        """Channels of attn_qkv / ssm_conv1d: q and k (nk heads each), then v (nv heads)."""
        return (2 * self.ssm_k_heads + self.ssm_v_heads) * self.ssm_head_dim

    @property
    def ssm_inner(self) -> int:
        return self.ssm_v_heads * self.ssm_head_dim

    @property
    def n_attention_wv(self) -> int:
        """llama.cpp's count of attn_v / attn_qkv tensors, over which Q4_K_M bumps attn_v: one per
        layer, except in lfm2 whose convolution layers have neither."""
        return len(self.attention_layers) if self.arch == "lfm2" else self.n_layers


# matrix(name, n_in, n_out, gain=1.0): a layer matrix of the file's layer type (or its mix type)
Matrix = Callable[..., PlannedTensor]


def _vector(name: str, n: int, init: Init) -> PlannedTensor:
    return PlannedTensor(name, (n,), F32, init)


def _attention(s: Shape, b: str, matrix: Matrix, out_gain: float, q_rows: int | None = None,
               qk_norms: bool = False, biases: bool = False) -> list[PlannedTensor]:
    d, hd = s.hidden, s.head_dim
    q, kv = s.n_head * hd, s.n_head_kv * hd
    tensors = [matrix(b + "attn_q.weight", d, q_rows or q), matrix(b + "attn_k.weight", d, kv),
               matrix(b + "attn_v.weight", d, kv)]
    if biases:
        tensors += [_vector(b + f"attn_{x}.bias", n, normal(_BIAS_RMS)) for x, n in (("q", q), ("k", kv), ("v", kv))]
    if qk_norms:
        tensors += [_vector(b + "attn_q_norm.weight", hd, norm()), _vector(b + "attn_k_norm.weight", hd, norm())]
    return tensors + [matrix(b + "attn_output.weight", q, d, out_gain)]


def _mlp(s: Shape, b: str, matrix: Matrix, norm_name: str, down_gain: float) -> list[PlannedTensor]:
    return [_vector(b + norm_name, s.hidden, norm()), matrix(b + "ffn_gate.weight", s.hidden, s.ffn),
            matrix(b + "ffn_up.weight", s.hidden, s.ffn), matrix(b + "ffn_down.weight", s.ffn, s.hidden, down_gain)]


# ------------------------------------------------------------------------------ layers


def _qwen35_layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    return _qwen35_mixer(s, i, matrix, residual) + _mlp(s, f"blk.{i}.", matrix, "post_attention_norm.weight",
                                                        residual / _BRANCH_RMS)


def _qwen35moe_layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """qwen35's mixers, then the experts and the shared expert, whose gate (ffn_gate_inp_shexp, a
    vector of ne = [hidden]) is kept F32 as the router is."""
    b, d, f = f"blk.{i}.", s.hidden, s.shared_ffn
    return (_qwen35_mixer(s, i, matrix, residual) + [_vector(b + "post_attention_norm.weight", d, norm())]
            + _experts(s, b, matrix, residual)
            + [_vector(b + "ffn_gate_inp_shexp.weight", d, normal(1 / math.sqrt(d))),
               matrix(b + "ffn_gate_shexp.weight", d, f), matrix(b + "ffn_up_shexp.weight", d, f),
               matrix(b + "ffn_down_shexp.weight", f, d, residual / _BRANCH_RMS)])


def _qwen35_nextn(s: Shape, i: int, matrix: Matrix) -> list[PlannedTensor]:
    """A multi-token-prediction layer's own tensors (then a qwen35 attention layer's), as llama.cpp
    writes Qwen3.5's: the stem's projection of [embedding, hidden] and its three norms."""
    b, d = f"blk.{i}.nextn.", s.hidden
    return [matrix(b + "eh_proj.weight", 2 * d, d), _vector(b + "enorm.weight", d, norm()),
            _vector(b + "hnorm.weight", d, norm()), _vector(b + "shared_head_norm.weight", d, norm())]


def _qwen35_mixer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """Conventions of design/qwen35.md: +1 folded into every norm except ssm_norm, ssm_a =
    -exp(A_log), ssm_conv1d ne = [kernel, channels]."""
    b, d = f"blk.{i}.", s.hidden
    tensors = [_vector(b + "attn_norm.weight", d, norm())]
    if s.is_full_attention(i):  # per head of attn_q: query, then gate
        tensors += _attention(s, b, matrix, residual / _ATTN_BRANCH_RMS, q_rows=s.n_head * 2 * s.head_dim,
                              qk_norms=True)
    else:
        nv, k = s.ssm_v_heads, s.conv_kernel
        tensors += [
            matrix(b + "attn_qkv.weight", d, s.ssm_qkv_channels),
            matrix(b + "attn_gate.weight", d, s.ssm_inner),
            matrix(b + "ssm_beta.weight", d, nv),
            matrix(b + "ssm_alpha.weight", d, nv, 0.5),
            PlannedTensor(b + "ssm_conv1d.weight", (k, s.ssm_qkv_channels), F32, normal(1 / math.sqrt(k))),
            # decay per step exp(ssm_a · softplus(alpha + dt_bias)): mostly 0.4 .. 0.95
            _vector(b + "ssm_dt.bias", nv, Init("uniform", low=-2.0, high=-0.5)),
            _vector(b + "ssm_a", nv, Init("neg_exp_uniform", low=-1.0, high=0.5)),
            _vector(b + "ssm_norm.weight", s.ssm_head_dim, norm()),
            matrix(b + "ssm_out.weight", s.ssm_inner, d, residual / _BRANCH_RMS),
        ]
    return tensors


def _decoder_layer(qk_norms: bool = False, biases: bool = False):
    """llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms): attention then the gated MLP, each
    after its RMSNorm. llama's q/k rows are permuted by llama.cpp's converter; random rows do not show it."""
    def layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
        b = f"blk.{i}."
        return ([_vector(b + "attn_norm.weight", s.hidden, norm())]
                + _attention(s, b, matrix, residual / _ATTN_BRANCH_RMS, qk_norms=qk_norms, biases=biases)
                + _mlp(s, b, matrix, "ffn_norm.weight", residual / _BRANCH_RMS))
    return layer


def _moe_layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """qwen3moe: qwen3's attention, then the experts."""
    b, d = f"blk.{i}.", s.hidden
    return ([_vector(b + "attn_norm.weight", d, norm())]
            + _attention(s, b, matrix, residual / _ATTN_BRANCH_RMS, qk_norms=True)
            + [_vector(b + "ffn_norm.weight", d, norm())] + _experts(s, b, matrix, residual))


def _experts(s: Shape, b: str, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """The router (ffn_gate_inp, kept F32 as llama.cpp's quantizer keeps it) and the experts' 3-D
    tensors, ne = [n_in, n_out, n_experts], drawn as one matrix each."""
    d, f, n = s.hidden, s.expert_ffn, s.n_experts

    def experts(name: str, n_in: int, n_out: int, gain: float = 1.0) -> PlannedTensor:
        return replace(matrix(b + name, n_in, n_out, gain), dims=(n_in, n_out, n))

    return [PlannedTensor(b + "ffn_gate_inp.weight", (d, n), F32, normal(1 / math.sqrt(d))),
            experts("ffn_gate_exps.weight", d, f), experts("ffn_up_exps.weight", d, f),
            experts("ffn_down_exps.weight", f, d, residual / _BRANCH_RMS)]


def _gpt_oss_layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """gpt-oss: attention with q/k/v/o biases and a sink logit per head, then the router (F32, with a
    bias) and the experts' 3-D tensors in MXFP4 whatever the other matrices' type (as every published
    gpt-oss GGUF holds them), each with a bias per expert ne = [n_out, n_experts]."""
    b, d, f, n = f"blk.{i}.", s.hidden, s.expert_ffn, s.n_experts

    def experts(name: str, n_in: int, n_out: int, gain: float = 1.0) -> list[PlannedTensor]:
        weight = replace(matrix(b + name + ".weight", n_in, n_out, gain), dims=(n_in, n_out, n),
                         ggml_type=GGMLType.MXFP4)
        return [weight, PlannedTensor(b + name + ".bias", (n_out, n), F32, normal(_BIAS_RMS))]

    return ([_vector(b + "attn_norm.weight", d, norm())]
            + _attention(s, b, matrix, residual / _ATTN_BRANCH_RMS, biases=True)
            + [_vector(b + "attn_output.bias", d, normal(_BIAS_RMS)),
               _vector(b + "attn_sinks.weight", s.n_head, normal(1.0)),
               _vector(b + "post_attention_norm.weight", d, norm()),
               PlannedTensor(b + "ffn_gate_inp.weight", (d, n), F32, normal(1 / math.sqrt(d))),
               _vector(b + "ffn_gate_inp.bias", n, normal(_BIAS_RMS))]
            + experts("ffn_gate_exps", d, f) + experts("ffn_up_exps", d, f)
            + experts("ffn_down_exps", f, d, residual / _BRANCH_RMS))


def _lfm2_layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """Attention (q/k norms) or a gated short convolution: in_proj's rows are B, C and x; the
    depthwise taps ne = [l_cache, hidden]."""
    b, d = f"blk.{i}.", s.hidden
    tensors = [_vector(b + "attn_norm.weight", d, norm())]
    if i in s.attention_layers:
        tensors += _attention(s, b, matrix, residual / _ATTN_BRANCH_RMS, qk_norms=True)
    else:
        k = s.conv_kernel
        tensors += [matrix(b + "shortconv.in_proj.weight", d, 3 * d),
                    PlannedTensor(b + "shortconv.conv.weight", (k, d), F32, normal(1 / math.sqrt(k))),
                    matrix(b + "shortconv.out_proj.weight", d, d, residual / _BRANCH_RMS)]
    return tensors + _mlp(s, b, matrix, "ffn_norm.weight", residual / _BRANCH_RMS)


def _gemma_layer(s: Shape, i: int, matrix: Matrix, residual: float) -> list[PlannedTensor]:
    """Gemma 3's sandwich: each branch normalised again (post_attention_norm, post_ffw_norm) before
    the residual add, so those norms, not the projections, set what a branch adds."""
    b, d = f"blk.{i}.", s.hidden
    return ([_vector(b + "attn_norm.weight", d, norm())]
            + _attention(s, b, matrix, 1.0, qk_norms=True)
            + [_vector(b + "post_attention_norm.weight", d, norm(residual))]
            + _mlp(s, b, matrix, "ffn_norm.weight", 1.0)
            + [_vector(b + "post_ffw_norm.weight", d, norm(residual))])


# ------------------------------------------------------------------ beyond the layers


def llama3_rope_factors(s: Shape) -> tuple[float, ...]:
    """Per rope pair, the divisor of its frequency, as llama.cpp's converter computes rope_freqs
    from a llama3 rope_scaling (LlamaModel.generate_extra_tensors)."""
    return Llama3Scaling(*s.llama3_rope).factors(s.rope_theta, s.head_dim)


def _llama_extra(s: Shape, matrix: Matrix) -> list[PlannedTensor]:
    if s.llama3_rope is None:
        return []
    return [_vector("rope_freqs.weight", s.head_dim // 2, Init("fixed", values=llama3_rope_factors(s)))]


def _gemma_embedding_extra(s: Shape, matrix: Matrix) -> list[PlannedTensor]:
    """dense_2, dense_3, ...: the projections after mean pooling (hidden → dense[0] → ... → dense[-1])."""
    widths = (s.hidden, *s.dense)
    return [matrix(f"dense_{j + 2}.weight", n_in, n_out) for j, (n_in, n_out) in enumerate(zip(widths, widths[1:]))]


def _no_extra(s: Shape, matrix: Matrix) -> list[PlannedTensor]:
    return []


# ------------------------------------------------------------------------ metadata

def u32(value: int) -> Typed:
    return Typed(GGUFValueType.UINT32, value)


def i32_array(values: list[int]) -> Typed:
    return Typed(GGUFValueType.ARRAY, (GGUFValueType.INT32, values))


def _qwen35_keys(s: Shape) -> dict:
    return {
        "rope.dimension_count": u32(s.rope_dim),
        "rope.dimension_sections": i32_array(list(s.rope_sections)),
        "ssm.conv_kernel": u32(s.conv_kernel),
        "ssm.state_size": u32(s.ssm_head_dim),
        "ssm.group_count": u32(s.ssm_k_heads),
        "ssm.time_step_rank": u32(s.ssm_v_heads),
        "ssm.inner_size": u32(s.ssm_inner),
        "full_attention_interval": u32(s.full_attention_interval),
    }


def _rope_keys(s: Shape) -> dict:
    return {"rope.dimension_count": u32(s.head_dim)}


def _expert_keys(s: Shape) -> dict:
    return {"expert_count": u32(s.n_experts), "expert_used_count": u32(s.n_experts_used),
            "expert_feed_forward_length": u32(s.expert_ffn)}


def _moe_keys(s: Shape) -> dict:
    return {**_rope_keys(s), **_expert_keys(s)}


def _qwen35moe_keys(s: Shape) -> dict:
    return {**_qwen35_keys(s), **_expert_keys(s), "expert_shared_feed_forward_length": u32(s.shared_ffn)}


def _gpt_oss_keys(s: Shape) -> dict:
    """llama.cpp's converter's: the experts', the sliding window (every other layer, from the first,
    by llama.cpp's fixed pattern) and YaRN's (its betas llama.cpp's defaults)."""
    factor, original = s.yarn_rope
    return {**_moe_keys(s), "attention.sliding_window": u32(s.sliding_window), "rope.scaling.type": "yarn",
            "rope.scaling.factor": Typed(GGUFValueType.FLOAT32, factor),
            "rope.scaling.original_context_length": u32(original)}


def _lfm2_keys(s: Shape) -> dict:
    return {"attention.head_count_kv": i32_array([s.n_head_kv if i in s.attention_layers else 0
                                                 for i in range(s.n_layers)]),
            "shortconv.l_cache": u32(s.conv_kernel)}


def _gemma_embedding_keys(s: Shape) -> dict:
    widths = (s.hidden, *s.dense)
    keys = {"attention.sliding_window": u32(s.sliding_window),
            "attention.sliding_window_pattern": u32(s.sliding_window_pattern),
            "attention.causal": False,
            "pooling_type": u32(1)}  # llama.cpp's LLAMA_POOLING_TYPE_MEAN
    for j, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        keys[f"dense_{j + 2}_feat_in"], keys[f"dense_{j + 2}_feat_out"] = u32(n_in), u32(n_out)
    return keys


@dataclass(frozen=True)
class Architecture:
    """What a synthetic model of one GGUF architecture has beyond token_embd, output and the keys
    every architecture shares: the tensors of layer i, further whole-model tensors, its own
    metadata keys (without the `arch.` prefix), the final norm's name."""

    layer: Callable[[Shape, int, Matrix, float], list[PlannedTensor]]
    keys: Callable[[Shape], dict]
    extra: Callable[[Shape, Matrix], list[PlannedTensor]] = _no_extra
    output_norm: str = "output_norm.weight"
    # a multi-token-prediction layer i's own tensors (before a layer's), where the architecture has one
    nextn: Callable[[Shape, int, Matrix], list[PlannedTensor]] | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "qwen35": Architecture(_qwen35_layer, _qwen35_keys, nextn=_qwen35_nextn),
    "qwen35moe": Architecture(_qwen35moe_layer, _qwen35moe_keys, nextn=_qwen35_nextn),
    "qwen2": Architecture(_decoder_layer(biases=True), _rope_keys),
    "qwen3": Architecture(_decoder_layer(qk_norms=True), _rope_keys),
    "llama": Architecture(_decoder_layer(), _rope_keys, _llama_extra),
    "qwen3moe": Architecture(_moe_layer, _moe_keys),
    "gpt-oss": Architecture(_gpt_oss_layer, _gpt_oss_keys),
    "lfm2": Architecture(_lfm2_layer, _lfm2_keys, output_norm="token_embd_norm.weight"),
    "gemma-embedding": Architecture(_gemma_layer, _gemma_embedding_keys, _gemma_embedding_extra),
}
