"""Writing a GGUF checkpoint out as a Hugging Face directory: the same model in the other container.

Owns the inverse of `weights.hf`: each architecture's `hf_config` and `hf_layout` say what the
directory holds, and every tensor is written in Hugging Face's convention (rows and columns back
in HF order, norm offsets and A_log undone). F32 / F16 / BF16 tensors keep their type and values;
quantized ones are written as their exact float32 decoding, or rounded to bf16 on request.
Used by `pagelm synth --format hf` and by tests that compare containers on the same numbers.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from pagelm.errors import PagelmError
from pagelm.formats.gguf import GGUFFile
from pagelm.formats.safetensors import TensorToWrite, write_safetensors
from pagelm.models import ARCHITECTURES, architecture_module
from pagelm.quant import GGMLType, f32_to_bf16
from pagelm.weights.hf import CONFIG_NAME, HFConfig, TensorMap
from pagelm.weights.loader import WeightLoader, dequantize_tensor

Quantized = Literal["f32", "bf16"]
_KEEP = {GGMLType.F32: "F32", GGMLType.F16: "F16", GGMLType.BF16: "BF16"}


def _to_hf(gguf: np.ndarray, tmap: TensorMap) -> np.ndarray:
    values = gguf if tmap.to_hf is None else tmap.to_hf(gguf)
    if tmap.rows is not None:
        out = np.empty_like(values)
        out[tmap.rows] = values
        values = out
    if tmap.columns is not None:
        out = np.empty_like(values)
        out[:, tmap.columns] = values
        values = out
    return values if tmap.hf_shape is None else values.reshape(tmap.hf_shape)


def _producer(file: GGUFFile, name: str, tmap: TensorMap, dtype: str) -> Callable[[], np.ndarray]:
    def produce() -> np.ndarray:
        if dtype != "F32" and tmap.to_hf is None and tmap.rows is None and tmap.columns is None \
                and file.tensors[name].ggml_type == GGMLType[dtype]:
            raw = file.tensor_data(name).view(np.uint16 if dtype == "BF16" else np.float16)
            return raw.reshape(tmap.hf_shape or file.tensors[name].shape)  # the stored bits, untouched
        values = _to_hf(dequantize_tensor(file, name).numpy(), tmap)
        return f32_to_bf16(values) if dtype == "BF16" else values.astype(np.float16 if dtype == "F16" else np.float32)
    return produce


def write_hf_directory(gguf_path: str, out_dir: str, quantized: Quantized = "f32", tokenizer: bool = True,
                       progress: Callable[[int], None] | None = None) -> None:
    """Write the model in `gguf_path` as a Hugging Face checkpoint directory `out_dir` (config.json,
    generation_config.json, model.safetensors, and tokenizer.json + tokenizer_config.json +
    chat_template.jinja when `tokenizer` and the model has a vocabulary). The directory is built as `out_dir`.part and renamed."""
    file = GGUFFile.open(gguf_path)
    try:
        loader = WeightLoader(file, "dense", torch.float32)
        arch = loader.architecture
        module = architecture_module(arch, gguf_path)
        config = getattr(module, ARCHITECTURES[arch][1]).from_loader(loader)
        tied = "output.weight" not in file.tensors
        hf_config = module.hf_config(config, tied)
        bos, eos = file.metadata.get("tokenizer.ggml.bos_token_id"), file.metadata.get("tokenizer.ggml.eos_token_id")
        hf_config.update({"bos_token_id": bos, "eos_token_id": eos, "dtype": "bfloat16" if quantized == "bf16" else "float32"})
        maps = module.hf_layout(HFConfig(hf_config, CONFIG_NAME), None).tensors
        tensors = []
        for name, info in file.tensors.items():
            tmap = maps.get(name)
            if tmap is None:
                raise PagelmError(f"{gguf_path}: tensor '{name}' has no Hugging Face counterpart in pagelm's {arch} mapping")
            dtype = _KEEP.get(info.ggml_type, "BF16" if quantized == "bf16" else "F32")
            if info.n_elements < 1 << 16 or tmap.to_hf is not None:
                dtype = "F32"  # small tensors (norms, biases, conv taps) stay float32, as checkpoints keep them
            tensors.append(TensorToWrite(tmap.hf, dtype, tmap.hf_shape or tuple(info.shape),
                                         _producer(file, name, tmap, dtype)))

        part = out_dir.rstrip("/") + ".part"
        shutil.rmtree(part, ignore_errors=True)
        os.makedirs(part)
        try:
            write_safetensors(os.path.join(part, "model.safetensors"), tensors, {"format": "pt"}, progress)
            _write_json(os.path.join(part, CONFIG_NAME), hf_config)
            _write_json(os.path.join(part, "generation_config.json"), {"bos_token_id": bos, "eos_token_id": eos})
            if tokenizer and file.metadata.get("tokenizer.ggml.model", "none") != "none":
                _write_tokenizer(file, part)  # a model of token ids only has no tokenizer to write
            if os.path.isdir(out_dir):
                shutil.rmtree(out_dir)
            os.replace(part, out_dir)
        except BaseException:
            shutil.rmtree(part, ignore_errors=True)
            raise
    finally:
        file.close()


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2)
        fh.write("\n")


def _write_tokenizer(file: GGUFFile, directory: str) -> None:
    from pagelm.chat.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(file, compact=False)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as fh:
        fh.write(tok.hf.to_str())
    _write_json(os.path.join(directory, "tokenizer_config.json"), {"add_bos_token": tok.add_bos})
    template = file.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as fh:
            fh.write(template)
