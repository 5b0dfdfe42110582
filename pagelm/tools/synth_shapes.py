"""The shapes `pagelm synth` writes: each real model's geometry (from its config.json, source named
beside it) and tiny shapes of the same structure for tests."""

from __future__ import annotations

from pagelm.quant.types import GGMLType
from pagelm.tools.synth_arch import Shape

QWEN35_VOCAB = 248_320
Q8_0 = GGMLType.Q8_0


def _qwen35(vocab: int, hidden: int, n_layers: int, ffn: int, n_head: int, n_head_kv: int, nk: int, nv: int,
            embedding_type: GGMLType = Q8_0, output_type: GGMLType | None = None,
            head_dim: int = 256, rope_dim: int = 64, rope_sections=(11, 11, 10, 0), ssm_head_dim: int = 128,
            context_length: int = 262_144, **fields) -> Shape:
    return Shape(vocab, hidden, embedding_type, output_type, n_layers=n_layers, ffn=ffn, n_head=n_head,
                 n_head_kv=n_head_kv, head_dim=head_dim, rope_dim=rope_dim, rope_sections=rope_sections,
                 ssm_k_heads=nk, ssm_v_heads=nv, ssm_head_dim=ssm_head_dim, context_length=context_length, **fields)


def _decoder(arch: str, vocab: int, hidden: int, n_layers: int, ffn: int, n_head: int, n_head_kv: int,
             head_dim: int, context_length: int, rope_theta: float, rms_eps: float = 1e-6,
             output_type: GGMLType | None = None, **fields) -> Shape:
    """A tied-head model unless `output_type` (most new families' real models tie their head: the Q8_0
    token_embd is the only copy)."""
    return Shape(vocab, hidden, Q8_0, output_type, n_layers=n_layers, ffn=ffn, n_head=n_head, n_head_kv=n_head_kv,
                 head_dim=head_dim, context_length=context_length, rms_eps=rms_eps, rope_theta=rope_theta,
                 arch=arch, **fields)


_QWEN35_MOE = dict(arch="qwen35moe", n_experts=256, n_experts_used=8, expert_ffn=512, shared_ffn=512)
_TINY = dict(head_dim=64, rope_dim=16, rope_sections=(3, 3, 2, 0), ssm_head_dim=32, context_length=8192)
# Llama 3.2's rope_scaling: rope_type llama3, factor 32, low_freq_factor 1, high_freq_factor 4,
# original_max_position_embeddings 8192
_LLAMA3_ROPE = (32.0, 1.0, 4.0, 8192)
# LFM2's attention layers (config.json full_attn_idxs), the others short convolutions of L_cache 3
_LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)

SHAPES: dict[str, Shape] = {
    "qwen3.5-0.8b": _qwen35(QWEN35_VOCAB, 1024, 24, 3584, 8, 2, 16, 16),
    "qwen3.5-2b": _qwen35(QWEN35_VOCAB, 2048, 24, 6144, 8, 2, 16, 16),
    "qwen3.5-4b": _qwen35(QWEN35_VOCAB, 2560, 32, 9216, 16, 4, 16, 32),
    "qwen3.5-9b": _qwen35(QWEN35_VOCAB, 4096, 32, 12288, 16, 4, 16, 32,
                          embedding_type=GGMLType.BF16, output_type=Q8_0),
    "qwen3.5-tiny": _qwen35(4096, 128, 4, 256, 4, 2, 2, 2, **_TINY),
    "qwen3.5-tiny-gqa": _qwen35(4096, 128, 4, 256, 4, 2, 2, 4, **_TINY),
    # tiny layers under the real 248,320-token vocabulary, tokenizer and chat template: for chat and serving tests
    "qwen3.5-tiny-chat": _qwen35(QWEN35_VOCAB, 128, 4, 256, 4, 2, 2, 2, **_TINY),
    # tiny, but every matrix's row width a multiple of 256, so that --mix q4_k_m writes K-quants
    # everywhere (8 layers: a real mix of Q4_K/Q5_K/Q6_K), and nv != nk
    "qwen3.5-tiny-k": _qwen35(4096, 256, 8, 512, 4, 2, 2, 4, **{**_TINY, "ssm_head_dim": 64}),
    # huggingface.co/Qwen/Qwen3.5-35B-A3B config.json (text_config): 40 layers of hidden 2048, every 4th full
    # attention (16 heads of 256, 2 kv heads, partial rotary 0.25, mrope [11, 11, 10], rope_theta 1e7),
    # DeltaNet 16 key / 32 value heads of 128; 256 experts of moe_intermediate_size 512, 8 per token, a
    # shared expert of shared_expert_intermediate_size 512, no dense intermediate_size; tie_word_embeddings false
    "qwen3.5-35b-a3b": _qwen35(QWEN35_VOCAB, 2048, 40, 0, 16, 2, 16, 32, output_type=Q8_0, **_QWEN35_MOE),
    # the same structure tiny, nv != nk
    "qwen3.5-35b-a3b-tiny": _qwen35(4096, 128, 4, 0, 4, 2, 2, 4, output_type=Q8_0,
                                    **{**_TINY, **_QWEN35_MOE, "n_experts": 8, "n_experts_used": 2, "expert_ffn": 64,
                                       "shared_ffn": 96}),
    # Embedding geometry only (vocab 4096, dim 256): for the embedding tests.
    "tiny": Shape(4096, 256, Q8_0, None),
    # huggingface.co/Qwen/Qwen3-0.6B and Qwen3-1.7B config.json: head_dim 128, rope_theta 1e6,
    # max_position_embeddings 40960, tie_word_embeddings true
    "qwen3-0.6b": _decoder("qwen3", 151_936, 1024, 28, 3072, 16, 8, 128, 40_960, 1e6),
    "qwen3-1.7b": _decoder("qwen3", 151_936, 2048, 28, 6144, 16, 8, 128, 40_960, 1e6),
    # huggingface.co/Qwen/Qwen2.5-1.5B-Instruct config.json: 12 heads of 128, 2 kv heads, rope_theta 1e6,
    # max_position_embeddings 32768, tie_word_embeddings true (attention qkv biases: the qwen2 architecture)
    "qwen2.5-1.5b": _decoder("qwen2", 151_936, 1536, 28, 8960, 12, 2, 128, 32_768, 1e6),
    # huggingface.co/meta-llama/Llama-3.2-1B config.json: head_dim 64, rope_theta 5e5, rms_norm_eps 1e-5,
    # max_position_embeddings 131072, tie_word_embeddings true, rope_scaling llama3 (_LLAMA3_ROPE)
    "llama3.2-1b": _decoder("llama", 128_256, 2048, 16, 8192, 32, 8, 64, 131_072, 5e5, 1e-5,
                            llama3_rope=_LLAMA3_ROPE),
    # huggingface.co/LiquidAI/LFM2-1.2B config.json: 32 heads of 64, 8 kv heads, block_ff_dim 12288
    # auto-adjusted (int(2/3 · 12288), multiple of 256) to 8192, norm_eps 1e-5, rope_theta 1e6,
    # max_position_embeddings 128000, conv_L_cache 3, full_attn_idxs, tied
    "lfm2-1.2b": _decoder("lfm2", 65_536, 2048, 16, 8192, 32, 8, 64, 128_000, 1e6, 1e-5,
                          attention_layers=_LFM2_ATTENTION, conv_kernel=3),
    # huggingface.co/google/embeddinggemma-300m config.json (Gemma3TextModel, use_bidirectional_attention):
    # 3 heads of 256, 1 kv head, intermediate 1152, sliding_window 512 (every 6th layer global),
    # rope_theta 1e6, max_position_embeddings 2048; its sentence-transformers modules: mean pooling,
    # Dense 768 → 3072, Dense 3072 → 768
    "embeddinggemma-300m": _decoder("gemma-embedding", 262_144, 768, 24, 1152, 3, 1, 256, 2048, 1e6,
                                    sliding_window=512, dense=(3072, 768)),
    # huggingface.co/Qwen/Qwen3-30B-A3B config.json: 32 heads of 128, 4 kv heads, 48 layers, 128 experts
    # of moe_intermediate_size 768, 8 per token (norm_topk_prob true), intermediate_size 6144, rope_theta 1e6,
    # max_position_embeddings 40960, tie_word_embeddings false
    "qwen3-30b-a3b": _decoder("qwen3moe", 151_936, 2048, 48, 6144, 32, 4, 128, 40_960, 1e6, output_type=Q8_0,
                              n_experts=128, n_experts_used=8, expert_ffn=768),
    # huggingface.co/openai/gpt-oss-20b config.json: 24 layers, hidden 2880, 64 heads of 64, 8 kv heads,
    # 32 experts (num_local_experts) of intermediate_size 2880, 4 per token, sliding_window 128 on every
    # other layer, rope_theta 150000 with yarn factor 32 over original_max_position_embeddings 4096,
    # max_position_embeddings 131072, rms_norm_eps 1e-5, vocab 201088, tie_word_embeddings false; the
    # experts MXFP4 (synth_arch), the other matrices Q8_0 as ggml-org's gpt-oss-20b-mxfp4.gguf
    "gpt-oss-20b": _decoder("gpt-oss", 201_088, 2880, 24, 2880, 64, 8, 64, 131_072, 150_000.0, 1e-5, output_type=Q8_0,
                            n_experts=32, n_experts_used=4, expert_ffn=2880, sliding_window=128,
                            yarn_rope=(32.0, 4096)),
    # tiny shapes of the same structure, for tests
    "qwen3-tiny": _decoder("qwen3", 4096, 128, 2, 256, 4, 2, 64, 4096, 1e6),
    "qwen2.5-tiny": _decoder("qwen2", 4096, 128, 2, 256, 4, 2, 32, 4096, 1e6),
    "llama3.2-tiny": _decoder("llama", 4096, 128, 2, 256, 4, 2, 32, 4096, 5e5, 1e-5, llama3_rope=_LLAMA3_ROPE),
    "lfm2-tiny": _decoder("lfm2", 4096, 128, 4, 256, 4, 2, 32, 4096, 1e6, 1e-5, attention_layers=(1, 3),
                          conv_kernel=3),
    "qwen3-30b-a3b-tiny": _decoder("qwen3moe", 4096, 128, 2, 256, 4, 2, 32, 4096, 1e6, output_type=Q8_0,
                                   n_experts=8, n_experts_used=2, expert_ffn=64),
    "gpt-oss-20b-tiny": _decoder("gpt-oss", 4096, 128, 3, 128, 4, 2, 32, 4096, 150_000.0, 1e-5, output_type=Q8_0,
                                 n_experts=8, n_experts_used=2, expert_ffn=64, sliding_window=8,
                                 yarn_rope=(32.0, 4096)),
    "embeddinggemma-tiny": _decoder("gemma-embedding", 4096, 128, 6, 192, 2, 1, 64, 2048, 1e6,
                                    sliding_window=8, dense=(256, 128)),
}
