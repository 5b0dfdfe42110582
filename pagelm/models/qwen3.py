"""Qwen3 text decoder (llama.cpp's `qwen3` architecture): llama with q and k RMS-normed per head
before rope (attn_q_norm, attn_k_norm), head_dim possibly other than hidden / heads
(attention.key_length), and q/k rows as stored (NeoX rope in ggml, not permuted by llama.cpp).

Owns only what names qwen3 (its `Family`); the math, KV state and layouts are `models.llama_family`'s.
"""

from __future__ import annotations

from pagelm.models.llama_family import Family, family_module

QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True)
# the registry's names (pagelm.models)
GGUF_ARCHITECTURES, HF_MODEL_TYPES, Config, Model, hf_layout, hf_config = family_module(QWEN3)
