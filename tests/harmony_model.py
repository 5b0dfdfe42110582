"""A tiny synthetic model that chats in OpenAI's harmony format: Qwen3.5's tiny layers and real
vocabulary, seven of its unused ids renamed to harmony's control tokens, and gpt-oss's real chat
template (tests/chat/templates/gpt-oss.jinja). The chat layers never look at the architecture, so
this exercises the harmony path end to end without the o200k_harmony vocabulary (not available
offline)."""

from __future__ import annotations

from pathlib import Path

from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf
from pagelm.tools.synth import SHAPES, model_metadata, plan_model, tensor_chunks
from pagelm.tools.synth_arch import u32
from pagelm.tools.synth_shapes import QWEN35_VOCAB

TEMPLATE = (Path(__file__).parent / "chat" / "templates" / "gpt-oss.jinja").read_text()
# harmony's control tokens at unused ids of the Qwen3.5 vocabulary (248,077 onward are [PADi])
HARMONY_TOKENS = {"<|return|>": 248_100, "<|constrain|>": 248_101, "<|channel|>": 248_102, "<|start|>": 248_103,
                  "<|end|>": 248_104, "<|message|>": 248_105, "<|call|>": 248_106}


def write_harmony_model(path: str) -> str:
    shape = SHAPES["qwen3.5-tiny-chat"]
    assert shape.vocab == QWEN35_VOCAB
    metadata = model_metadata(shape, seed=0, name="synthetic harmony tiny-chat")
    _, (_, tokens) = metadata["tokenizer.ggml.tokens"]
    _, (_, types) = metadata["tokenizer.ggml.token_type"]
    tokens, types = list(tokens), list(types)
    for text, i in HARMONY_TOKENS.items():
        assert tokens[i].startswith("[PAD")
        tokens[i], types[i] = text, 3  # control, as llama.cpp's converter types gpt-oss's
    metadata["tokenizer.ggml.tokens"] = Typed(GGUFValueType.ARRAY, (GGUFValueType.STRING, tokens))
    metadata["tokenizer.ggml.token_type"] = Typed(GGUFValueType.ARRAY, (GGUFValueType.INT32, types))
    metadata["tokenizer.ggml.eos_token_id"] = u32(HARMONY_TOKENS["<|return|>"])
    metadata.pop("tokenizer.ggml.eot_token_id", None)
    metadata["tokenizer.chat_template"] = TEMPLATE
    plan = plan_model(shape)
    write_gguf(path, metadata, [TensorToWrite(t.name, t.dims, t.ggml_type, tensor_chunks(t, 0)) for t in plan])
    return path
