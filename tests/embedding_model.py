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


def reference(model, dense, ids: list[int]) -> np.ndarray:
    """The pipeline in float32 over the stored values: hidden states, mean, projections, L2 norm."""
    model = model.float()
    with torch.inference_mode():
        h = model(torch.tensor([ids])).last_hidden_state[0].mean(0)
        for weight in dense:
            h = weight.float() @ h
        return (h / h.norm()).numpy()
