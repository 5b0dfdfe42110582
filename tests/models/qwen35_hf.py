"""Tiny random transformers Qwen3.5 models (dense, and the MoE members) and a converter to llama.cpp's
`qwen35` / `qwen35moe` GGUF form.

Test code only. The converter encodes the GGUF conventions of design/qwen35.md on its own (it
shares nothing with pagelm.models.qwen35), so agreement between the two checks both. A mixture of
experts is written as llama.cpp's converter writes Qwen3.5-MoE: each layer's experts stacked into 3-D
ffn_{gate,up,down}_exps, the router (ffn_gate_inp) and the shared expert's gate (ffn_gate_inp_shexp, a
vector) F32, the shared expert ffn_{gate,up,down}_shexp.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import encode
from pagelm.quant.types import GGMLType


@dataclass(frozen=True)
class Variant:
    name: str
    hidden: int
    layers: int
    interval: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    partial_rotary: float
    rope_theta: float
    key_heads: int
    value_heads: int
    linear_dim: int  # key = value head dim (llama.cpp requires them equal)
    vocab: int = 512
    mrope_section: tuple[int, int, int] | None = None  # multimodal rope's (t, h, w) frequency pairs
    # a mixture of experts (Qwen3_5MoeForCausalLM, untied head): (experts, per token, expert ffn, shared ffn)
    experts: tuple[int, int, int, int] | None = None


VARIANTS = {
    # nv == nk, interval 4: layers 3 and 7 are attention
    "equal_heads": Variant("equal_heads", hidden=96, layers=8, interval=4, ffn=192, heads=4, kv_heads=2,
                           head_dim=32, partial_rotary=0.5, rope_theta=10_000.0, key_heads=2, value_heads=2,
                           linear_dim=32),
    # nv = 2·nk (tiled value-head order matters), interval 3, head_dim 64 with rope on a quarter
    "tiled_heads": Variant("tiled_heads", hidden=128, layers=6, interval=3, ffn=256, heads=4, kv_heads=1,
                           head_dim=64, partial_rotary=0.25, rope_theta=1_000_000.0, key_heads=2, value_heads=4,
                           linear_dim=32),
}


def hf_config(v: Variant) -> Qwen3_5TextConfig | Qwen3_5MoeTextConfig:
    moe = {} if v.experts is None else dict(zip(("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                 "shared_expert_intermediate_size"), v.experts))
    return (Qwen3_5TextConfig if v.experts is None else Qwen3_5MoeTextConfig)(
        **moe,
        **({"intermediate_size": v.ffn} if v.experts is None else {}),
        vocab_size=v.vocab,
        hidden_size=v.hidden,
        num_hidden_layers=v.layers,
        num_attention_heads=v.heads,
        num_key_value_heads=v.kv_heads,
        head_dim=v.head_dim,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": v.rope_theta, "partial_rotary_factor": v.partial_rotary,
                         **({} if v.mrope_section is None else {"mrope_section": list(v.mrope_section),
                                                                 "mrope_interleaved": True})},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=v.linear_dim,
        linear_value_head_dim=v.linear_dim,
        linear_num_key_heads=v.key_heads,
        linear_num_value_heads=v.value_heads,
        full_attention_interval=v.interval,
        tie_word_embeddings=v.experts is None,
        max_position_embeddings=4096,
    )


@torch.no_grad()
def build_hf_model(v: Variant, seed: int = 0) -> Qwen3_5ForCausalLM | Qwen3_5MoeForCausalLM:
    """A random fp32 eager-attention model whose activations and logits are far from degenerate."""
    torch.manual_seed(seed)
    config = hf_config(v)
    config._attn_implementation = "eager"
    model = (Qwen3_5ForCausalLM if v.experts is None else Qwen3_5MoeForCausalLM)(config).float().eval()
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            p.copy_(normal(p.shape, 0.4))
        elif name.endswith("linear_attn.norm.weight"):  # plain gated norm
            p.copy_(1.0 + normal(p.shape, 0.2))
        elif name.endswith("norm.weight"):  # zero-centred: the weight is (1 + w)
            p.copy_(normal(p.shape, 0.2))
        elif name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.02, 3.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(normal(p.shape, 1.0))
        elif name.endswith("conv1d.weight"):
            p.copy_(normal(p.shape, 0.5))
        elif p.dim() in (2, 3) and not name.endswith("conv1d.weight"):  # 3-D: the experts, (E, rows, columns)
            p.copy_(normal(p.shape, 1.0 / math.sqrt(p.shape[-1])))
        else:
            raise AssertionError(f"unexpected parameter {name}")
    return model


class MtpOracle(torch.nn.Module):
    """Qwen3.5's multi-token-prediction layer from transformers' own Qwen3.5 parts (transformers loads
    no `mtp.*`: its classes drop them), put together as vLLM's Qwen3NextMultiTokenPredictor and
    llama.cpp's nextn graph do: fc(concat(norm(embedding of token t + 1), norm(final hidden state at
    t))), one gated-attention decoder layer at position t, a final norm; the model's head on top.
    Its state_dict's names are the checkpoints' without the `mtp.` prefix."""

    def __init__(self, config):
        if hasattr(config, "num_experts"):  # the MoE members' layer: their experts and shared expert
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
                Qwen3_5MoeDecoderLayer as Qwen3_5DecoderLayer, Qwen3_5MoeRMSNorm as Qwen3_5RMSNorm,
                Qwen3_5MoeTextRotaryEmbedding as Qwen3_5TextRotaryEmbedding)
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                                        Qwen3_5TextRotaryEmbedding)

        super().__init__()
        one = copy.deepcopy(config)
        one.layer_types, one.num_hidden_layers = ["full_attention"], 1
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(one, 0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps)
        self.rotary = Qwen3_5TextRotaryEmbedding(one)

    @torch.no_grad()
    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Outputs (T, hidden) of pairs t = 0.. (embeddings[t], hidden[t]) at positions 0..T-1, causal."""
        T = embeddings.shape[0]
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)), -1))[None]
        rope = self.rotary(x, torch.arange(T).view(1, 1, T).expand(3, 1, T))
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        return self.norm(self.layers[0](x, position_embeddings=rope, attention_mask=mask))[0]


@torch.no_grad()
def mtp_tensors(model, seed: int = 1) -> tuple[MtpOracle, dict[str, torch.Tensor]]:
    """A random MTP layer for `model` (a Qwen3.5, dense or MoE): the oracle and its tensors by checkpoint name."""
    oracle = MtpOracle(model.config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in oracle.named_parameters():
        if name.endswith("norm.weight"):  # zero-centred
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return oracle, {f"mtp.{k}": t.detach().clone() for k, t in oracle.state_dict().items() if "rotary" not in k}


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """(T, vocab) fp32 logits of one sequence, no cache."""
    with torch.no_grad():
        return model(input_ids=ids[None], use_cache=False).logits[0].float()


# ------------------------------------------------------------------------------ converter


def _value_head_order(nk: int, nv: int) -> list[int]:
    """GGUF value head j is HF value head (j mod nk)·r + j div nk (r = nv / nk): HF groups the
    value heads of one key head together (key head h // r), llama.cpp tiles them (key head j mod nk)."""
    r = nv // nk
    return [(j % nk) * r + j // nk for j in range(nv)]


def _reorder_heads(x: torch.Tensor, order: list[int], head: int, dim: int = 0) -> torch.Tensor:
    """Blocks of `head` entries along `dim` permuted so that block j is old block order[j]."""
    index = torch.tensor([h * head + i for h in order for i in range(head)])
    return x.index_select(dim, index)


def hf_to_gguf(model, path, *, drop_keys: tuple[str, ...] = (), drop_tensors: tuple[str, ...] = (),
               matrix_type: GGMLType = GGMLType.F32, fused_gate_up: bool = False,
               mtp: dict[str, torch.Tensor] | None = None, nextn: int = 1) -> None:
    """Write `model` as a llama.cpp `qwen35` GGUF (`qwen35moe` for a Qwen3_5MoeForCausalLM): F32 tensors
    (or `matrix_type` for the layer matrices, the experts' 3-D ones and an untied output.weight), a
    tied token_embd and no output.weight where the model ties them. `drop_keys` / `drop_tensors` leave
    metadata keys / tensors out (to test the reader's errors). `fused_gate_up`: each layer's experts' gate
    and up rows in one ffn_gate_up_exps (transformers' gate_up_proj as it is), as newer llama.cpp writes.
    `mtp`: a multi-token-prediction layer's tensors by their checkpoint names (mtp.*, `mtp_tensors`),
    written after the trunk as llama.cpp writes Qwen3.5's: blk.{layers}.nextn.* and the layer's
    attention and feed-forward under blk.{layers}., counted in block_count and nextn_predict_layers (`nextn`,
    which a test may set wrong)."""
    c = model.config
    moe = hasattr(c, "num_experts")
    sd = {k: t.detach().float() for k, t in model.state_dict().items()}
    sd.update({k: t.detach().float() for k, t in (mtp or {}).items()})
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    order = _value_head_order(nk, nv)
    rope_dim = int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
    interval = next(i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention")
    # Text positions are equal in every M-RoPE section, so any split of the rope_dim / 2 frequency
    # pairs over t/h/w is plain 1-D rope, as long as the three sections cover them all (llama.cpp's
    # interleaved M-RoPE gives uncovered pairs the fourth, zero, position), as the real [11, 11, 10] do.
    # A model made for images has its own sections, which image positions need.
    pairs = rope_dim // 2
    mrope = c.rope_parameters.get("mrope_section")
    sections = [*mrope, 0] if mrope else [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0]

    arch = "qwen35moe" if moe else "qwen35"
    a = arch + "."
    u32 = lambda x: Typed(GGUFValueType.UINT32, int(x))  # noqa: E731
    f32 = lambda x: Typed(GGUFValueType.FLOAT32, float(x))  # noqa: E731
    metadata = {
        "general.architecture": arch,
        "general.name": f"tiny-random-{arch}",
        a + "context_length": u32(c.max_position_embeddings),
        a + "block_count": u32(c.num_hidden_layers),
        a + "vocab_size": u32(c.vocab_size),
        a + "embedding_length": u32(c.hidden_size),
        a + "attention.head_count": u32(c.num_attention_heads),
        a + "attention.head_count_kv": u32(c.num_key_value_heads),
        a + "attention.key_length": u32(c.head_dim),
        a + "attention.value_length": u32(c.head_dim),
        a + "attention.layer_norm_rms_epsilon": f32(c.rms_norm_eps),
        a + "rope.freq_base": f32(c.rope_parameters["rope_theta"]),
        a + "rope.dimension_count": u32(rope_dim),
        a + "rope.dimension_sections": Typed(GGUFValueType.ARRAY, (GGUFValueType.INT32, sections)),
        a + "ssm.conv_kernel": u32(c.linear_conv_kernel_dim),
        a + "ssm.state_size": u32(dk),
        a + "ssm.group_count": u32(nk),
        a + "ssm.time_step_rank": u32(nv),
        a + "ssm.inner_size": u32(nv * dv),
        a + "full_attention_interval": u32(interval),
        "tokenizer.ggml.model": "none",  # token ids only; llama.cpp loads such a file
    }
    if mtp:
        metadata[a + "block_count"] = u32(c.num_hidden_layers + 1)
        metadata[a + "nextn_predict_layers"] = u32(nextn)
    if moe:  # no feed_forward_length: the config has no dense width
        metadata.update({a + "expert_count": u32(c.num_experts), a + "expert_used_count": u32(c.num_experts_per_tok),
                         a + "expert_feed_forward_length": u32(c.moe_intermediate_size),
                         a + "expert_shared_feed_forward_length": u32(c.shared_expert_intermediate_size)})
    else:
        metadata[a + "feed_forward_length"] = u32(c.intermediate_size)
    for key in drop_keys:
        del metadata[key]

    tensors: list[TensorToWrite] = []

    def add(name: str, t: torch.Tensor, matrix: bool = False) -> None:
        arr = np.ascontiguousarray(t.numpy(), dtype=np.float32)
        ggml_type = matrix_type if matrix and arr.ndim in (2, 3) else GGMLType.F32
        data = arr if ggml_type == GGMLType.F32 else encode(arr.reshape(-1, arr.shape[-1]), ggml_type)
        tensors.append(TensorToWrite(name, tuple(reversed(arr.shape)), ggml_type, [np.ascontiguousarray(data)]))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"], matrix=True)
    add("output_norm.weight", sd["model.norm.weight"] + 1.0)
    layers = [(f"model.layers.{i}.", f"blk.{i}.", kind) for i, kind in enumerate(c.layer_types)]
    if mtp:
        n = f"blk.{c.num_hidden_layers}."
        add(n + "nextn.eh_proj.weight", sd["mtp.fc.weight"], matrix=True)
        add(n + "nextn.enorm.weight", sd["mtp.pre_fc_norm_embedding.weight"] + 1.0)
        add(n + "nextn.hnorm.weight", sd["mtp.pre_fc_norm_hidden.weight"] + 1.0)
        add(n + "nextn.shared_head_norm.weight", sd["mtp.norm.weight"] + 1.0)
        layers.append(("mtp.layers.0.", n, "full_attention"))
    for hf, p, kind in layers:
        add(p + "attn_norm.weight", sd[hf + "input_layernorm.weight"] + 1.0)
        add(p + "post_attention_norm.weight", sd[hf + "post_attention_layernorm.weight"] + 1.0)
        if moe:
            m = hf + "mlp."
            gate, up = sd[m + "experts.gate_up_proj"].chunk(2, 1)  # (E, 2·ffn, hidden): gate rows, then up rows
            add(p + "ffn_gate_inp.weight", sd[m + "gate.weight"])
            if fused_gate_up:
                add(p + "ffn_gate_up_exps.weight", sd[m + "experts.gate_up_proj"], matrix=True)
            else:
                add(p + "ffn_gate_exps.weight", gate, matrix=True)
                add(p + "ffn_up_exps.weight", up, matrix=True)
            add(p + "ffn_down_exps.weight", sd[m + "experts.down_proj"], matrix=True)
            add(p + "ffn_gate_inp_shexp.weight", sd[m + "shared_expert_gate.weight"][0])  # ne = [hidden]
            for proj, name in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                add(p + name + ".weight", sd[m + f"shared_expert.{proj}.weight"], matrix=True)
        else:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                add(p + name + ".weight", sd[hf + f"mlp.{proj}.weight"], matrix=True)
        if kind == "full_attention":
            s = hf + "self_attn."
            add(p + "attn_q.weight", sd[s + "q_proj.weight"], matrix=True)  # per head: query then gate
            add(p + "attn_k.weight", sd[s + "k_proj.weight"], matrix=True)
            add(p + "attn_v.weight", sd[s + "v_proj.weight"], matrix=True)
            add(p + "attn_output.weight", sd[s + "o_proj.weight"], matrix=True)
            add(p + "attn_q_norm.weight", sd[s + "q_norm.weight"] + 1.0)
            add(p + "attn_k_norm.weight", sd[s + "k_norm.weight"] + 1.0)
        else:
            s = hf + "linear_attn."
            qkv = sd[s + "in_proj_qkv.weight"]
            kd = nk * dk
            qkv = torch.cat((qkv[: 2 * kd], _reorder_heads(qkv[2 * kd :], order, dv)))
            conv = sd[s + "conv1d.weight"].squeeze(1)  # (C, K)
            conv = torch.cat((conv[: 2 * kd], _reorder_heads(conv[2 * kd :], order, dv)))
            add(p + "attn_qkv.weight", qkv, matrix=True)
            add(p + "attn_gate.weight", _reorder_heads(sd[s + "in_proj_z.weight"], order, dv), matrix=True)
            add(p + "ssm_beta.weight", _reorder_heads(sd[s + "in_proj_b.weight"], order, 1))
            add(p + "ssm_alpha.weight", _reorder_heads(sd[s + "in_proj_a.weight"], order, 1))
            add(p + "ssm_conv1d.weight", conv)
            add(p + "ssm_dt.bias", _reorder_heads(sd[s + "dt_bias"], order, 1))
            add(p + "ssm_a", _reorder_heads(-torch.exp(sd[s + "A_log"]), order, 1))
            add(p + "ssm_norm.weight", sd[s + "norm.weight"])  # plain, no +1
            add(p + "ssm_out.weight", _reorder_heads(sd[s + "out_proj.weight"], order, dv, dim=1), matrix=True)
    write_gguf(path, metadata, [t for t in tensors if t.name not in drop_tensors])
