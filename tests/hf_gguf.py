"""Tiny random transformers decoders, written as llama.cpp GGUF files the way convert_hf_to_gguf.py
writes them.

Test code only, generic over the architecture: tensor names come from the `gguf` package's own name
map (`gguf.get_tensor_name_map`) and metadata keys from `gguf.Keys`, both independent of pagelm's
layouts. Every tensor is written as stored, as llama.cpp's converter writes the architectures whose
rope is NeoX in ggml (qwen2, qwen3, qwen3moe; not llama, whose q/k rows it permutes), a layer's
experts stacked into 3-D tensors and its router (ffn_gate_inp) kept F32 as llama.cpp keeps it. Quantized types are
encoded by `gguf.quants`, whose dequantized values are what a reference model must be given to
compute what the file holds.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.quant.types import GGMLType

from hf_oracle import perturb_constant_init

TINY = ["qwen2-tied", "qwen2-untied", "qwen3-tied", "qwen3-untied", "qwen3moe-untied"]  # tiny_decoder's cases
# a mixture of experts small enough for seconds and large enough for distinct routes
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def tiny_decoder(case: str, vocab: int = 256, **moe):
    """A random fp32 transformers model of one of TINY: (architecture)-(tied or untied head); `moe`:
    a mixture of experts' settings other than TINY_MOE's."""
    import transformers

    arch, tie = case.split("-")
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, initializer_range=0.2,
                  tie_word_embeddings=tie == "tied")
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    elif arch == "qwen3moe":
        config = transformers.Qwen3MoeConfig(**common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                             head_dim=32, **{**TINY_MOE, **moe})
    else:  # a head dim other than hidden / heads
        config = transformers.Qwen3Config(**common, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                          head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    perturb_constant_init(model)
    return model


def decoder_metadata(arch: str, config) -> dict:
    """A llama-like transformers config's GGUF keys, as convert_hf_to_gguf's TextModel sets them."""
    u32 = lambda x: Typed(GGUFValueType.UINT32, int(x))  # noqa: E731
    f32 = lambda x: Typed(GGUFValueType.FLOAT32, float(x))  # noqa: E731
    k, a, r = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
    rope = getattr(config, "rope_parameters", None) or {}
    metadata = {
        gguf.Keys.General.ARCHITECTURE: arch,
        gguf.Keys.General.NAME: f"tiny-random-{arch}",
        k.CONTEXT_LENGTH.format(arch=arch): u32(config.max_position_embeddings),
        k.EMBEDDING_LENGTH.format(arch=arch): u32(config.hidden_size),
        k.FEED_FORWARD_LENGTH.format(arch=arch): u32(config.intermediate_size),
        k.BLOCK_COUNT.format(arch=arch): u32(config.num_hidden_layers),
        a.HEAD_COUNT.format(arch=arch): u32(config.num_attention_heads),
        a.HEAD_COUNT_KV.format(arch=arch): u32(config.num_key_value_heads),
        a.LAYERNORM_RMS_EPS.format(arch=arch): f32(config.rms_norm_eps),
        r.FREQ_BASE.format(arch=arch): f32(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        "tokenizer.ggml.model": "none",  # token ids only
    }
    if hasattr(config, "num_experts_per_tok"):  # no expert_weights_norm: llama.cpp's qwen3moe always renormalizes
        metadata[k.EXPERT_COUNT.format(arch=arch)] = u32(config.num_experts)
        metadata[k.EXPERT_USED_COUNT.format(arch=arch)] = u32(config.num_experts_per_tok)
        metadata[k.EXPERT_FEED_FORWARD_LENGTH.format(arch=arch)] = u32(config.moe_intermediate_size)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        metadata[a.KEY_LENGTH.format(arch=arch)] = u32(head_dim)
        metadata[a.VALUE_LENGTH.format(arch=arch)] = u32(head_dim)
    return metadata


def write_decoder_gguf(model, path, arch: str, matrix_type: GGMLType = GGMLType.F32) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers *ForCausalLM) as a GGUF of architecture `arch` (gguf.MODEL_ARCH's
    name): 2-D tensors in `matrix_type` (F32 or a type gguf.quants encodes), the rest F32; a tied model
    has no output.weight. Returns the state dict the file holds: each tensor's values after
    quantization, in transformers' names (for `load_state_dict`)."""
    config = model.config
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     config.num_hidden_layers)
    tied = config.tie_word_embeddings
    tensors, held = [], {}
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        values = t.detach().float().numpy()
        # transformers holds a layer's experts fused, (experts, 2·ffn, hidden) gate then up; the converter's are apart
        parts = [(hf_name, values)] if not hf_name.endswith("experts.gate_up_proj") else \
            [(hf_name.replace("gate_up_proj", x + "_proj"), half) for x, half in zip(("gate", "up"), np.split(values, 2, 1))]
        held_parts = []
        for part_name, part in parts:
            name = names.get_name(part_name if part.ndim != 3 else part_name + ".weight", try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"{part_name} has no GGUF name for {arch}")
            part = np.ascontiguousarray(part)
            qtype = matrix_type if part.ndim >= 2 and "ffn_gate_inp" not in name else GGMLType.F32
            data = part
            if qtype != GGMLType.F32:
                data = gguf.quants.quantize(part, gguf.GGMLQuantizationType[qtype.name])
                part = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype.name])
            tensors.append(TensorToWrite(name, tuple(reversed(part.shape)), qtype, [np.ascontiguousarray(data)]))
            held_parts.append(part)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(held_parts, 1) if len(parts) > 1
                                                              else held_parts[0], np.float32))
    write_gguf(path, decoder_metadata(arch, config), tensors)
    return held
