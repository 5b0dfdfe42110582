"""A tiny random transformers LFM2 model and a writer of llama.cpp's `lfm2` GGUF form.

Test code only. The writer encodes llama.cpp's conventions (convert_hf_to_gguf.py's LFM2Model:
per-layer kv head counts with 0 for a conv layer, the conv taps squeezed to (hidden, taps), the
MLP width after block_auto_adjust_ff_dim) on its own, sharing nothing with pagelm.models.lfm2.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import Lfm2Config, Lfm2ForCausalLM

from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant import encode
from pagelm.quant.types import GGMLType

LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention", "conv"]


def hf_config(heads: int = 4, vocab: int = 256) -> Lfm2Config:
    # intermediate_size 100 becomes int(2·100/3) = 66, rounded up to a multiple of 32: 96
    return Lfm2Config(vocab_size=vocab, hidden_size=64, intermediate_size=100, block_multiple_of=32,
                      num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, num_attention_heads=heads,
                      num_key_value_heads=2, norm_eps=1e-5, conv_L_cache=3, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})


@torch.no_grad()
def build_hf_model(seed: int = 0, heads: int = 4, vocab: int = 256) -> Lfm2ForCausalLM:
    """A random float32 model whose norms are not all ones (a +1 or a missing norm would show)."""
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(hf_config(heads, vocab)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * noise)
        elif name.endswith("conv.conv.weight"):
            p.copy_(0.5 * noise)
        elif name.endswith("embed_tokens.weight"):
            p.copy_(0.5 * noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def hf_to_gguf(model: Lfm2ForCausalLM, path, matrix_type: GGMLType = GGMLType.F32,
               drop_keys: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Write `model` as a llama.cpp `lfm2` GGUF (tied token_embd, no output.weight), the layers'
    matrices in `matrix_type`, everything else F32. Returns each written matrix's encoded bytes
    by Hugging Face name (for a reference that dequantizes them)."""
    c = model.config
    sd = {k: t.detach().float() for k, t in model.state_dict().items()}
    ffn = sd["model.layers.0.feed_forward.w1.weight"].shape[0]
    a = "lfm2."
    u32 = lambda x: Typed(GGUFValueType.UINT32, int(x))  # noqa: E731
    f32 = lambda x: Typed(GGUFValueType.FLOAT32, float(x))  # noqa: E731
    metadata = {
        "general.architecture": "lfm2", "general.name": "tiny-random-lfm2",
        a + "context_length": u32(4096), a + "block_count": u32(c.num_hidden_layers),
        a + "vocab_size": u32(c.vocab_size), a + "embedding_length": u32(c.hidden_size),
        a + "feed_forward_length": u32(ffn), a + "attention.head_count": u32(c.num_attention_heads),
        a + "attention.head_count_kv": Typed(GGUFValueType.ARRAY, (GGUFValueType.UINT32, [
            c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])),
        a + "attention.layer_norm_rms_epsilon": f32(c.norm_eps),
        a + "rope.freq_base": f32(c.rope_parameters["rope_theta"]),
        a + "shortconv.l_cache": u32(c.conv_L_cache),
        "tokenizer.ggml.model": "none",
    }
    for key in drop_keys:
        del metadata[key]
    tensors, encoded = [], {}

    def add(name: str, hf: str, matrix: bool = False) -> None:
        arr = np.ascontiguousarray(sd[hf].numpy().reshape(sd[hf].shape[0], -1) if "conv.conv" in hf else sd[hf].numpy())
        ggml_type = matrix_type if matrix else GGMLType.F32
        data = arr if ggml_type == GGMLType.F32 else encode(arr, ggml_type)
        encoded[hf] = data
        tensors.append(TensorToWrite(name, tuple(reversed(arr.shape)), ggml_type, [np.ascontiguousarray(data)]))

    add("token_embd.weight", "model.embed_tokens.weight")
    add("token_embd_norm.weight", "model.embedding_norm.weight")
    for i, kind in enumerate(c.layer_types):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        add(p + "attn_norm.weight", hf + "operator_norm.weight")
        add(p + "ffn_norm.weight", hf + "ffn_norm.weight")
        for gguf_name, w in (("ffn_gate", "w1"), ("ffn_up", "w3"), ("ffn_down", "w2")):
            add(p + gguf_name + ".weight", hf + f"feed_forward.{w}.weight", matrix=True)
        if kind == "conv":
            add(p + "shortconv.in_proj.weight", hf + "conv.in_proj.weight", matrix=True)
            add(p + "shortconv.conv.weight", hf + "conv.conv.weight")
            add(p + "shortconv.out_proj.weight", hf + "conv.out_proj.weight", matrix=True)
        else:
            for gguf_name, w in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                                 ("attn_output", "out_proj")):
                add(p + gguf_name + ".weight", hf + f"self_attn.{w}.weight", matrix=True)
            add(p + "attn_q_norm.weight", hf + "self_attn.q_layernorm.weight")
            add(p + "attn_k_norm.weight", hf + "self_attn.k_layernorm.weight")
    write_gguf(path, metadata, tensors)
    return encoded
