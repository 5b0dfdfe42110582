"""Qwen2 / Qwen2.5 text decoder (llama.cpp's `qwen2` architecture): llama with a bias on q, k and v,
and q/k rows as stored (NeoX rope in ggml, so llama.cpp's converter does not permute them).

Owns only what names qwen2 (its `Family`); the math, KV state and layouts are `models.llama`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagelm.models.llama import Family, LlamaConfig, LlamaModel, family_hf_config, family_layout
from pagelm.weights.hf import HFConfig, HFLayout

QWEN2 = Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True)
GGUF_ARCHITECTURES = (QWEN2.arch,)  # general.architecture values read here (pagelm.models' registry)
HF_MODEL_TYPES = (QWEN2.arch,)  # config.json model_types read here


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    family = QWEN2


def hf_layout(config: HFConfig, hf_names: set[str] | None) -> HFLayout:
    return family_layout(QWEN2, config, hf_names)


def hf_config(c: Qwen2Config, tied: bool) -> dict:
    return family_hf_config(QWEN2, c, tied)


Config, Model = Qwen2Config, LlamaModel  # the registry's names (pagelm.models)
