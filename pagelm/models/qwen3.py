"""Qwen3 text decoder (llama.cpp's `qwen3` architecture): llama with q and k RMS-normed per head
before rope (attn_q_norm, attn_k_norm), head_dim possibly other than hidden / heads
(attention.key_length), and q/k rows as stored (NeoX rope in ggml, not permuted by llama.cpp).

Owns only what names qwen3 (its `Family`); the math, KV state and layouts are `models.llama`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagelm.models.llama import Family, LlamaConfig, LlamaModel, family_hf_config, family_layout
from pagelm.weights.hf import HFConfig, HFLayout

QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True)
GGUF_ARCHITECTURES = (QWEN3.arch,)  # general.architecture values read here (pagelm.models' registry)
HF_MODEL_TYPES = (QWEN3.arch,)  # config.json model_types read here


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    family = QWEN3


def hf_layout(config: HFConfig, hf_names: set[str] | None) -> HFLayout:
    return family_layout(QWEN3, config, hf_names)


def hf_config(c: Qwen3Config, tied: bool) -> dict:
    return family_hf_config(QWEN3, c, tied)


Config, Model = Qwen3Config, LlamaModel  # the registry's names (pagelm.models)
