"""Writing a GGUF checkpoint out as a Hugging Face or FastFlowLM directory: the same model in another container.

Owns the inverse of `weights.hf` and `weights.flm`: each architecture's `hf_config` and layout say
what the directory holds, and every tensor is written in that container's convention (rows and
columns back in its order, norm offsets and A_log undone as it requires). F32 / F16 / BF16
tensors keep their type and values; quantized ones are written as their exact float32 decoding,
or rounded to bf16 on request, except that a FastFlowLM directory holds Q8_0, Q4_1 and Q4_K
matrices of whole 256-value blocks as tiles of the same codes (`quant.tiles`).
Used by `pagelm synth --format hf|flm` and by tests that compare containers on the same numbers.
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
from pagelm.models import architecture_module
from pagelm.quant import GGMLType, f32_to_bf16
from pagelm.quant.tiles import COLUMNS, ROWS, TILE_BYTES, TileKind, pack_groups
from pagelm.weights.flm import MODEL_FILE, VERSION_KEY, copy_name, flm_layout
from pagelm.weights.hf import CONFIG_NAME, HFConfig, TensorMap, expert_tensor
from pagelm.weights.loader import WeightLoader, dequantize_tensor

Quantized = Literal["f32", "bf16"]
Container = Literal["hf", "flm"]
FLM_VERSIONS = ("1.0.3", "1.0.2")
_KEEP = {GGMLType.F32: "F32", GGMLType.F16: "F16", GGMLType.BF16: "BF16"}
_TILED = {GGMLType.Q8_0: TileKind.Q8, GGMLType.Q4_1: TileKind.Q4_1, GGMLType.Q4_K: TileKind.Q4_K}


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


def _producer(file: GGUFFile, name: str, tmap: TensorMap, dtype: str,
              rows: np.ndarray | None = None) -> Callable[[], np.ndarray]:
    """The values of tensor `name`, or of its rows `rows` (one expert's of a 3-D tensor), as `tmap` says
    the directory holds them."""
    def produce() -> np.ndarray:
        info = file.tensors[name]
        if dtype != "F32" and tmap.to_hf is None and tmap.rows is None and tmap.columns is None \
                and info.ggml_type == GGMLType[dtype]:
            raw = file.tensor_data(name).view(np.uint16 if dtype == "BF16" else np.float16)
            if rows is not None:
                return raw.reshape(-1, info.dims[0])[rows]
            return raw.reshape(tmap.hf_shape or info.shape)  # the stored bits, untouched
        values = _to_hf(dequantize_tensor(file, name, rows=rows).numpy(), tmap)
        return f32_to_bf16(values) if dtype == "BF16" else values.astype(np.float16 if dtype == "F16" else np.float32)
    return produce


def _expert_parts(name: str, rows: int, maps: dict[str, TensorMap]) -> list[tuple[str, int, int]]:
    """What one expert's `rows` rows of the 3-D expert tensor `name` hold: (the name `maps` knows the
    matrix by, its first row among them, its rows) each; ffn_gate_up_exps is gate then up. Empty where
    `name` is no expert tensor the maps know."""
    if expert_tensor(name, 0) in maps:
        return [(name, 0, rows)]
    if name.endswith("ffn_gate_up_exps.weight") and expert_tensor(name.replace("gate_up", "gate"), 0) in maps:
        return [(name.replace("gate_up", x), lo, rows // 2) for x, lo in (("gate", 0), ("up", rows // 2))]
    return []


def _fused_producer(file: GGUFFile, parts: list[tuple[str, TensorMap]], shape: tuple[int, ...],
                    dtype: str) -> Callable[[], np.ndarray]:
    """The values of one Hugging Face tensor that several GGUF tensors are columns of (gpt-oss's
    gate_up_proj: its even columns ffn_gate_exps' rows, transposed, its odd ones ffn_up_exps'; its
    bias likewise), as each part's TensorMap says (`transposed` with `rows`, or `columns`)."""
    def produce() -> np.ndarray:
        out = np.empty(shape, np.float32)
        for name, tmap in parts:
            values = dequantize_tensor(file, name).numpy()
            if tmap.transposed:  # (experts, rows, in) into columns `rows` of (experts, in, columns)
                out[:, :, np.arange(values.shape[1]) if tmap.rows is None else tmap.rows] = values.transpose(0, 2, 1)
            else:
                out[..., np.arange(values.shape[-1]) if tmap.columns is None else tmap.columns] = values
        return f32_to_bf16(out) if dtype == "BF16" else out.astype(np.float16 if dtype == "F16" else np.float32)
    return produce


def _fused(file: GGUFFile, maps: dict[str, TensorMap], quantized: Quantized) -> tuple[list[TensorToWrite], set[str]]:
    """The Hugging Face tensors that several GGUF tensors, or one transposed, are written into (the
    tensors), and those GGUF tensors' names."""
    groups: dict[str, list[tuple[str, TensorMap]]] = {}
    for name, tmap in maps.items():
        if name in file.tensors:
            groups.setdefault(tmap.hf, []).append((name, tmap))
    out, names = [], set()
    for hf, parts in groups.items():
        if len(parts) == 1 and not parts[0][1].transposed:
            continue
        infos = [file.tensors[name] for name, _ in parts]
        if parts[0][1].transposed:  # numpy (experts, rows, in) each
            shape = (*infos[0].shape[:-2], infos[0].shape[-1], sum(i.shape[-2] for i in infos))
        else:
            shape = (*infos[0].shape[:-1], sum(i.shape[-1] for i in infos))
        dtype = "BF16" if quantized == "bf16" and len(shape) == 3 else "F32"
        out.append(TensorToWrite(hf, dtype, shape, _fused_producer(file, parts, shape, dtype)))
        names.update(name for name, _ in parts)
    return out, names


def _tile_kind(file: GGUFFile, name: str, tmap: TensorMap, flm_version: str) -> TileKind | None:
    """The tiles a FastFlowLM directory holds matrix `name` in, or None (written as floats)."""
    info = file.tensors[name]
    kind = _TILED.get(info.ggml_type)
    if kind is None or len(info.dims) != 2 or info.dims[0] % COLUMNS or tmap.columns is not None:
        return None
    return TileKind.Q8_V102 if kind == TileKind.Q8 and flm_version == "1.0.2" else kind


class _Tiles:
    """Produces one matrix's tiles (its rows in the container's order) and, when its rows do not
    fill the last group, the bf16 copy of its real rows; counts scales bf16 had to round."""

    def __init__(self, file: GGUFFile, name: str, tmap: TensorMap, kind: TileKind):
        self.file, self.name, self.tmap, self.kind = file, name, tmap, kind
        self.rounded = 0

    def tiles(self) -> np.ndarray:
        raw = self.file.tensor_data(self.name).reshape(self.file.tensors[self.name].shape[0], -1)
        if self.tmap.rows is not None:
            stored = np.empty_like(raw)
            stored[self.tmap.rows] = raw
            raw = stored
        packed, rounded = pack_groups(raw, self.file.tensors[self.name].ggml_type, self.kind)
        self.rounded += rounded
        return packed.view(np.int8)

    def copy(self) -> np.ndarray:
        return f32_to_bf16(_to_hf(dequantize_tensor(self.file, self.name).numpy(), self.tmap))


def write_directory(gguf_path: str, out_dir: str, container: Container = "hf", quantized: Quantized = "f32",
                    flm_version: str = FLM_VERSIONS[0], tokenizer: bool = True,
                    progress: Callable[[int], None] | None = None) -> int:
    """Write the model in `gguf_path` as a directory `out_dir`: a Hugging Face checkpoint (config.json,
    generation_config.json, model.safetensors) or a FastFlowLM one (model.q4nx instead, and
    `flm_version` in config.json), with tokenizer.json + tokenizer_config.json + chat_template.jinja
    when `tokenizer` and the model has a vocabulary. The directory is built as `out_dir`.part and
    renamed. Returns how many fp16 scales FastFlowLM's bf16 had to round (0: the same values)."""
    if flm_version not in FLM_VERSIONS:
        raise PagelmError(f"flm_version must be one of {', '.join(FLM_VERSIONS)}, got {flm_version!r}")
    file = GGUFFile.open(gguf_path)
    try:
        loader = WeightLoader(file, "dense", torch.float32)
        arch = loader.architecture
        module = architecture_module(arch, gguf_path)
        config = module.Config.from_loader(loader)
        tied = "output.weight" not in file.tensors
        hf_config = module.hf_config(config, tied)
        bos, eos = file.metadata.get("tokenizer.ggml.bos_token_id"), file.metadata.get("tokenizer.ggml.eos_token_id")
        hf_config.update({"bos_token_id": bos, "eos_token_id": eos, "dtype": "bfloat16" if quantized == "bf16" else "float32"})
        if container == "flm":
            hf_config[VERSION_KEY] = flm_version
            maps = flm_layout(module, HFConfig(hf_config, CONFIG_NAME), None).tensors
        else:
            maps = module.hf_layout(HFConfig(hf_config, CONFIG_NAME), None).tensors
        tensors, fused = _fused(file, maps, quantized) if container == "hf" else ([], set())
        tiled = []
        for name, info in file.tensors.items():
            if name in fused:
                continue
            tmap = maps.get(name)
            parts = _expert_parts(name, info.shape[1], maps) if tmap is None else []
            if parts:  # a 3-D expert tensor: one tensor per expert (and per half of ffn_gate_up_exps)
                dtype = _KEEP.get(info.ggml_type, "BF16" if quantized == "bf16" else "F32")
                n = info.shape[1]
                for e in range(info.shape[0]):
                    for key, lo, rows in parts:
                        emap = maps[expert_tensor(key, e)]
                        tensors.append(TensorToWrite(emap.hf, dtype, (rows, info.shape[2]), _producer(
                            file, name, emap, dtype, np.arange(e * n + lo, e * n + lo + rows))))
                continue
            if tmap is None:
                raise PagelmError(f"{gguf_path}: tensor '{name}' has no Hugging Face counterpart in pagelm's {arch} mapping")
            kind = _tile_kind(file, name, tmap, flm_version) if container == "flm" else None
            if kind is not None:
                tiles = _Tiles(file, name, tmap, kind)
                tiled.append(tiles)
                rows, columns = info.shape
                groups = -(-rows // ROWS)
                tensors.append(TensorToWrite(tmap.hf, "I8", (groups, columns // COLUMNS, TILE_BYTES[kind]), tiles.tiles))
                if rows % ROWS:
                    tensors.append(TensorToWrite(copy_name(tmap.hf), "BF16", (rows, columns), tiles.copy))
                continue
            dtype = _KEEP.get(info.ggml_type, "BF16" if quantized == "bf16" else "F32")
            if info.n_elements < 1 << 16 or tmap.to_hf is not None:
                dtype = "F32"  # small tensors (norms, biases, conv taps) stay float32, as checkpoints keep them
            tensors.append(TensorToWrite(tmap.hf, dtype, tmap.hf_shape or tuple(info.shape),
                                         _producer(file, name, tmap, dtype)))

        part = out_dir.rstrip("/") + ".part"
        shutil.rmtree(part, ignore_errors=True)
        os.makedirs(part)
        try:
            weights = MODEL_FILE if container == "flm" else "model.safetensors"
            write_safetensors(os.path.join(part, weights), tensors, {"format": "pt"}, progress)
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
        return sum(t.rounded for t in tiled)
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
