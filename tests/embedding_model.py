"""A tiny random EmbeddingGemma made by transformers' own classes (Gemma3TextModel with attention
both ways) in sentence-transformers' layout: mean pooling, two dense projections, normalization,
a byte-level BPE tokenizer of its own. And the oracle: transformers' hidden states through the
same pipeline, written out from the layout's definition (sentence-transformers itself pins a
huggingface_hub older than pagelm's)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 300
HIDDEN, PROJECTED, OUT = 64, 96, 48
CORPUS = ["the quick brown fox jumps over the lazy dog", "a vector for every text", "embeddings in place",
          "mean pooling then two projections"] * 4


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    # EmbeddingGemma's framing of an input: <bos> text <eos>
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                             special_tokens=[("<bos>", 2), ("<eos>", 1)])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>",
                                                            "add_bos_token": True}))


def write(path: Path, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The model directory at `path`; returns the transformers model and the two projections."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, initializer_range=0.2, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
        use_bidirectional_attention=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.Gemma3TextModel(config).eval().to(dtype)
    model.save_pretrained(path)
    dense = [(torch.randn(PROJECTED, HIDDEN) * 0.1).to(dtype), (torch.randn(OUT, PROJECTED) * 0.1).to(dtype)]
    from safetensors.torch import save_file

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": HIDDEN,
                                                                "pooling_mode_mean_tokens": True}))
    for i, weight in enumerate(dense, start=2):
        folder = path / f"{i}_Dense"
        folder.mkdir()
        save_file({"linear.weight": weight.contiguous()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({
            "in_features": weight.shape[1], "out_features": weight.shape[0], "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"}))
        modules.append({"idx": i, "name": str(i), "path": folder.name, "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "task: search result | query: ", "document": "title: none | text: "}}))
    _tokenizer(path)
    return model, dense


def write_qwen3_embedding(path: Path):
    """Qwen3-Embedding's layout at `path`: a tiny random Qwen3 base model, last-token pooling,
    normalization, no projection; returns the transformers model."""
    import transformers

    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, initializer_range=0.2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(2)
    model = transformers.Qwen3Model(config).eval()
    model.save_pretrained(path)
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return model


def reference(model, dense, ids: list[int]) -> np.ndarray:
    """The pipeline in float32 over the stored values: hidden states, mean, projections, L2 norm."""
    model = model.float()
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
        for weight in dense:
            h = weight.float() @ h
        return (h / h.norm()).numpy()


def write_gguf(model, dense, path: Path, matrix_type=None) -> tuple[dict, list]:
    """The model as llama.cpp's converter writes EmbeddingGemma (`gemma-embedding`): names from the
    `gguf` package's map, Gemma's norms with their +1 folded in, mean pooling, the two projections as
    `dense_2` / `dense_3`; matrices in `matrix_type` (F32 when None). Returns what the file holds as
    (the model's state dict, the projections), quantized values decoded by `gguf.quants`."""
    import gguf
    from hf_gguf import decoder_metadata

    from pagelm.formats.gguf import GGUFValueType, TensorToWrite, Typed, write_gguf as write
    from pagelm.quant.types import GGMLType

    arch, config = "gemma-embedding", model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA_EMBEDDING, config.num_hidden_layers)
    tensors, held = [], {}
    for hf_name, t in [*model.state_dict().items(), ("dense_2.weight", dense[0]), ("dense_3.weight", dense[1])]:
        name = hf_name if hf_name.startswith("dense_") else names.get_name(hf_name, try_suffixes=(".weight",))
        values = np.ascontiguousarray(t.detach().float().numpy())
        if name.endswith("norm.weight"):
            values = values + np.float32(1)
        qtype = matrix_type if values.ndim == 2 and matrix_type is not None else GGMLType.F32
        data = values if qtype == GGMLType.F32 else gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype.name])
        tensors.append(TensorToWrite(name, tuple(reversed(values.shape)), qtype, [np.ascontiguousarray(data)]))
        if qtype != GGMLType.F32:
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype.name])
        if name.endswith("norm.weight"):
            values = values - np.float32(1)  # back to transformers' zero-centred norms
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(values, np.float32))
    rope = config.rope_parameters
    metadata = {**decoder_metadata(arch, config),
                f"{arch}.rope.freq_base": Typed(GGUFValueType.FLOAT32, rope["full_attention"]["rope_theta"]),
                f"{arch}.rope.freq_base_swa": Typed(GGUFValueType.FLOAT32, rope["sliding_attention"]["rope_theta"]),
                f"{arch}.attention.sliding_window": Typed(GGUFValueType.UINT32, (config.sliding_window - 1) * 2),
                f"{arch}.pooling_type": Typed(GGUFValueType.UINT32, 1)}
    for dense_name, weight in (("dense_2", dense[0]), ("dense_3", dense[1])):
        metadata[f"{arch}.{dense_name}_feat_in"] = Typed(GGUFValueType.UINT32, weight.shape[1])
        metadata[f"{arch}.{dense_name}_feat_out"] = Typed(GGUFValueType.UINT32, weight.shape[0])
    write(path, metadata, tensors)
    return {k: v for k, v in held.items() if not k.startswith("dense_")}, [held["dense_2.weight"], held["dense_3.weight"]]
