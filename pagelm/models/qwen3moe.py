"""Qwen3-MoE text decoder (llama.cpp's `qwen3moe` architecture: Qwen3-30B-A3B): qwen3's attention (q
and k RMS-normed per head) with a mixture of experts as every layer's feed-forward: a softmax router,
the top-k experts (expert_used_count of expert_count) renormalized, each a SiLU-gated MLP.

Owns only what names qwen3moe (its `Family`); the math, KV state and layouts are `models.llama_family`'s,
the experts' `models.moe`'s.
"""

from __future__ import annotations

from pagelm.models.llama_family import Family, family_module

QWEN3MOE = Family("qwen3moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True, hf_type="qwen3_moe")
# the registry's names (pagelm.models)
GGUF_ARCHITECTURES, HF_MODEL_TYPES, Config, Model, hf_layout, hf_config = family_module(QWEN3MOE)
