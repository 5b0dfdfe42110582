"""Llama text decoder (llama.cpp's `llama` architecture: SmolLM2, Llama 2/3, ...): `llama_family`'s
decoder with q/k rows in the order llama.cpp's converter permutes them to.

Owns llama's names and that row order. llama.cpp permutes the rows of attn_q / attn_k within each
head so that ggml's *normal* rope (adjacent pairs (2i, 2i+1)) applies; the operators read them back
in the reverse order (transformers' GGUF loader's reverse permute), for NeoX rope as transformers'.
"""

from __future__ import annotations

import numpy as np

from pagelm.models.llama_family import Family, family_module


def rope_row_order(rows: int, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, HF row i + j·D/2 (j ∈ {0, 1}) is GGUF row
    2i + j (transformers' `_reverse_permute_weights`). Returns the GGUF row of each HF row."""
    d2 = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, d2, 2).transpose(0, 2, 1).reshape(rows)


LLAMA = Family("llama", "LlamaForCausalLM", qk_rows=rope_row_order)
# the registry's names (pagelm.models)
GGUF_ARCHITECTURES, HF_MODEL_TYPES, Config, Model, hf_layout, hf_config = family_module(LLAMA)
LlamaConfig, LlamaModel = Config, Model
