"""gpt-oss text decoder (llama.cpp's `gpt-oss` architecture, Hugging Face's `gpt_oss`: gpt-oss-20b):
llama's attention with q/k/v/o biases, a learned sink logit per head, every other layer (0, 2, ...)
within a sliding window and YaRN rope; every feed-forward a mixture of experts with biases, routed by
the top k of the router's logits then a softmax over those k, activated by a clamped SwiGLU.

Owns what names gpt-oss (its `Family`) and its Hugging Face layout, where each layer's experts are two
3-D tensors stored transposed, (experts, in, out): gate_up_proj, whose even columns are the gate's and
odd columns the up's (llama.cpp's converter splits them so), and down_proj, with their biases; they are
read in place (`weights.linear.TransposedLinear`). The math and KV state are `models.llama_family`'s,
the experts' `models.moe`'s.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np

from pagelm.errors import UnsupportedError
from pagelm.models.llama_family import Family, FamilyConfig, family_module
from pagelm.weights.hf import HFConfig, HFLayout, decoder_hf_config, decoder_metadata, layer_period, tensor_maps

GPT_OSS = Family("gpt-oss", "GptOssForCausalLM", qkv_bias=True, moe=True, hf_type="gpt_oss", out_bias=True,
                 sinks=True, swa_period=2, ffn_norm="post_attention_norm", oss_experts=True, yarn=True)
# the registry's names (pagelm.models)
GGUF_ARCHITECTURES, HF_MODEL_TYPES, Config, Model, _, _ = family_module(GPT_OSS)

ARCH = GPT_OSS.arch
# transformers' GptOssExperts constants, which llama.cpp's gpt-oss builds in (no GGUF key carries them)
SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
DEFAULT_THETA = 150000.0  # GptOssConfig.default_theta
HF_GLOBALS = {"output_norm.weight": "norm.weight"}
HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{x}.{kind}": f"self_attn.{hf}_proj.{kind}" for x, hf in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                        ("output", "o")) for kind in ("weight", "bias")},
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj", "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias", "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
# rope_parameters a YaRN scaling may have that pagelm does not compute with
_YARN_UNSUPPORTED = ("attention_factor", "mscale", "mscale_all_dim")


def _yarn_metadata(config: HFConfig) -> dict:
    kind = config.rope("rope_type", "default")
    if kind == "default":
        return {}
    if kind != "yarn":
        raise UnsupportedError(f"{config.name}: rope type {json.dumps(kind)[:40]} is not supported for {ARCH} "
                               f"(default, yarn are)")
    odd = [key for key in _YARN_UNSUPPORTED if config.rope(key) is not None]
    if odd:
        raise UnsupportedError(f"{config.name}: rope setting '{odd[0]}' is not supported (yarn's attention factor "
                               f"is computed from its factor)")
    truncate = config.rope("truncate", True)  # transformers' default where the config has none
    if not isinstance(truncate, bool):
        raise UnsupportedError(f"{config.name}: rope setting 'truncate' is {json.dumps(truncate)[:40]}, expected "
                               f"true or false")
    key = f"{ARCH}.rope.scaling."
    return {key + "type": "yarn", key + "factor": config.rope_float("factor", 0),
            key + "original_context_length": config.rope_float("original_max_position_embeddings", 0),
            key + "yarn_beta_fast": config.rope_float("beta_fast", 32.0),
            key + "yarn_beta_slow": config.rope_float("beta_slow", 1.0), key + "yarn_truncate": truncate}


def hf_layout(config: HFConfig, hf_names: set[str] | None) -> HFLayout:
    """A Hugging Face gpt_oss checkpoint in GGUF terms. Its experts as save_pretrained writes them
    (float gate_up_proj, down_proj); MXFP4 ones (…_blocks, …_scales, as the published checkpoints
    hold them) are refused by name."""
    packed = next((n for n in sorted(hf_names or ()) if n.endswith(("_blocks", "_scales"))), None)
    if packed is not None:
        raise UnsupportedError(f"{config.name}: tensor '{packed}' holds MXFP4-packed experts, which pagelm reads "
                               f"from GGUF files only (llama.cpp's convert_hf_to_gguf.py writes them); a Hugging "
                               f"Face directory's experts must be float (gate_up_proj, down_proj)")
    if config.get("attention_bias", True) is not True:
        raise UnsupportedError(f"{config.name}: attention_bias false is not supported for {ARCH} (its attention has biases)")
    for key, value in SWIGLU.items():
        if config.float(key, value) != value:
            raise UnsupportedError(f"{config.name}: {key} {config.float(key)} is not supported for {ARCH} "
                                   f"(only {value}, as llama.cpp's)")
    n_layers, hidden, n_heads = config.int("num_hidden_layers"), config.int("hidden_size"), config.int("num_attention_heads")
    types = config.strings("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                              for i in range(n_layers)]
    if layer_period(config, types, "full_attention", 2) != 2:
        raise UnsupportedError(f"{config.name}: layer_types must alternate sliding_attention and full_attention "
                               f"for {ARCH}")
    head_dim = config.int("head_dim", hidden // max(n_heads, 1))
    ffn = config.int("intermediate_size")
    metadata = decoder_metadata(ARCH, config, head_dim)
    metadata.update({f"{ARCH}.rope.freq_base": config.rope_float("rope_theta", DEFAULT_THETA),
                     f"{ARCH}.attention.sliding_window": config.int("sliding_window"),
                     f"{ARCH}.expert_count": config.int("num_local_experts"),
                     f"{ARCH}.expert_used_count": config.int("num_experts_per_tok"),
                     f"{ARCH}.expert_feed_forward_length": ffn, **_yarn_metadata(config)})
    maps = tensor_maps(config, hf_names, n_layers, HF_GLOBALS, HF_LAYER)
    halves = {"gate": np.arange(0, 2 * ffn, 2), "up": np.arange(1, 2 * ffn, 2)}
    for name, tmap in maps.items():
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        half = halves.get(part.removeprefix("ffn_").removesuffix("_exps"))
        if name.endswith("_exps.weight"):
            maps[name] = replace(tmap, transposed=True, rows=half)
        elif name.endswith("_exps.bias") and half is not None:
            maps[name] = replace(tmap, columns=half)
    return HFLayout(metadata, maps)


def hf_config(c: FamilyConfig, tied: bool) -> dict:
    """config.json for a Hugging Face twin of a gpt-oss checkpoint with this config."""
    config = {"architectures": [GPT_OSS.hf_class], "model_type": GPT_OSS.model_type, "attention_bias": True,
              **decoder_hf_config(c, tied), "intermediate_size": c.expert_ffn, "num_local_experts": c.n_experts,
              "num_experts_per_tok": c.n_experts_used, "sliding_window": c.sliding_window,
              "layer_types": ["full_attention" if c.window(i) is None else "sliding_attention" for i in range(c.n_layers)],
              **SWIGLU}
    rope = {"rope_type": "default", "rope_theta": c.rope_base}
    if c.yarn is not None:
        y = c.yarn
        rope.update(rope_type="yarn", factor=y.factor, original_max_position_embeddings=int(y.original_context),
                    beta_fast=y.beta_fast, beta_slow=y.beta_slow, truncate=y.truncate)
    config["rope_parameters"] = rope
    return config
