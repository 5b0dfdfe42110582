"""Qwen2 / Qwen2.5 text decoder (llama.cpp's `qwen2` architecture): llama with a bias on q, k and v,
and q/k rows as stored (NeoX rope in ggml, so llama.cpp's converter does not permute them).

Owns only what names qwen2 (its `Family`); the math, KV state and layouts are `models.llama_family`'s.
"""

from __future__ import annotations

from pagelm.models.llama_family import Family, family_module

QWEN2 = Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True)
# the registry's names (pagelm.models)
GGUF_ARCHITECTURES, HF_MODEL_TYPES, Config, Model, hf_layout, hf_config = family_module(QWEN2)
