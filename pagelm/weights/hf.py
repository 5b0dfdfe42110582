"""Hugging Face checkpoint directories seen the way the models read a GGUF file, with no copy.

Owns opening a directory (config.json, safetensors shards, tokenizer and template files) and
presenting it as `HFCheckpoint`: GGUF metadata keys, GGUF tensor names whose bytes stay in the
shard maps, and for each tensor the `TensorMap` that turns Hugging Face's convention into the
GGUF one the models compute with (a row order and an input-column order, applied by the
operators; a value conversion for small vectors only). Each architecture's module writes its own
mapping (`hf_layout`) and reaches this module through its caller (`HFLayouts`); it imports none.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.gguf import GGUFFile, GGUFValueType, TensorInfo
from pagelm.formats.safetensors import ShardedSafetensors, read_json_file
from pagelm.quant import GGMLType

CONFIG_NAME = "config.json"
_LAYER = re.compile(r"layers\.(\d+)\.")
MAX_CONFIG_BYTES = 16 << 20
# safetensors dtypes a matrix may have; they are computed with in place
HF_DTYPES = {"F32": GGMLType.F32, "F16": GGMLType.F16, "BF16": GGMLType.BF16}


@dataclass(frozen=True)
class TensorMap:
    """How GGUF tensor values are read from one Hugging Face tensor: GGUF row i is HF row
    `rows[i]`, GGUF column j is HF column `columns[j]` (for a small tensor possibly a subset: one of
    an interleaved pair's halves); `to_gguf` / `to_hf` convert the values of a small tensor (norm
    offsets, A_log) both ways. `transposed`: HF holds each matrix transposed, (experts, in, out) (gpt-oss's
    fused experts), and GGUF row i of expert e's matrix is HF column rows[i] of its (`WeightLoader.experts`)."""

    hf: str
    rows: np.ndarray | None = None
    columns: np.ndarray | None = None
    to_gguf: Callable[[np.ndarray], np.ndarray] | None = None
    to_hf: Callable[[np.ndarray], np.ndarray] | None = None
    hf_shape: tuple[int, ...] | None = None  # where HF's shape has more (size-1) dims than GGUF's
    transposed: bool = False


@dataclass
class HFLayout:
    """An architecture's reading of a config: GGUF metadata and GGUF name → TensorMap."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorMap] = field(default_factory=dict)


class HFConfig:
    """config.json's values, typed on the way out; errors name the file and the key. A
    multimodal config's `text_config` is where the text model's keys are looked up first."""

    def __init__(self, values: dict, name: str):
        self.values, self.name = values, name
        text = values.get("text_config")
        self.text = text if isinstance(text, dict) else {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.text.get(key, self.values.get(key, default))

    def _typed(self, key: str, default: Any, check, kind: str):
        value = self.get(key, default)
        if value is None:
            raise ModelFormatError(f"{self.name}: key '{key}' missing")
        if not check(value):
            raise ModelFormatError(f"{self.name}: key '{key}' is {json.dumps(value)[:60]}, expected {kind}")
        return value

    def int(self, key: str, default: int | None = None) -> int:
        """A size or count: a non-negative integer below 2**24 (none of a real model's is larger)."""
        return self._typed(key, default, lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 24,
                           "a non-negative integer below 2**24")

    def float(self, key: str, default: float | None = None) -> float:
        return float(self._typed(key, default, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                                 "a number"))

    def strings(self, key: str) -> list[str]:
        """A list of strings (layer_types), empty when absent."""
        value = self.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ModelFormatError(f"{self.name}: key '{key}' is {json.dumps(value)[:60]}, expected a list of strings")
        return value

    def rope(self, key: str, default: Any = None, holder: dict | None = None) -> Any:
        """A rope setting from `holder`, or `rope_parameters` (transformers 5) or `rope_scaling`,
        else the top level."""
        holders = [holder] if holder is not None else [self.get("rope_parameters"), self.get("rope_scaling")]
        for params in holders:
            if isinstance(params, dict) and key in params:
                return params[key]
        return self.get(key, default)

    def rope_float(self, key: str, default: float, holder: dict | None = None) -> float:
        value = self.rope(key, default, holder)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{self.name}: rope setting '{key}' is {json.dumps(value)[:60]}, expected a positive number")
        return float(value)


def is_hf_directory(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG_NAME))


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT64
    if isinstance(value, str):
        return GGUFValueType.STRING
    return GGUFValueType.ARRAY


# model_type (config.json's), where (for messages) -> the architecture's layout: an object with
# `hf_layout(config, hf_names) -> HFLayout` (and FastFlowLM's `FLM_NAMES`, `flm_rows` where it has
# them), e.g. `pagelm.models.hf_layouts`, which refuses an unknown model_type
HFLayouts = Callable[[Any, str], Any]


class HFCheckpoint:
    """A Hugging Face checkpoint directory with the reading interface of `GGUFFile`."""

    value_type = GGUFFile.value_type
    require = GGUFFile.require

    def __init__(self, path: str, config: HFConfig, shards: ShardedSafetensors, layout: HFLayout):
        self.path, self.name = path, path
        self.config, self.shards = config, shards
        self.maps = layout.tensors
        self.metadata = dict(layout.metadata)
        self.metadata.update(_tokenizer_metadata(path, config))
        self._types = {key: _value_type(value) for key, value in self.metadata.items()}
        self.tensors: dict[str, TensorInfo] = {}
        for gguf_name, tmap in layout.tensors.items():
            info = shards.tensors.get(tmap.hf)
            if info is None:
                continue  # an optional tensor (an untied head) the checkpoint does not have
            if info.dtype not in HF_DTYPES:
                raise UnsupportedError(f"{path}: tensor '{tmap.hf}' has dtype {info.dtype}; pagelm computes with "
                                       f"{', '.join(HF_DTYPES)}")
            # conv taps are stored (C, 1, K); a matrix keeps its shape even with one row
            shape = info.shape if len(info.shape) <= 2 else [d for d in info.shape if d != 1]
            self.tensors[gguf_name] = TensorInfo(gguf_name, tuple(reversed(shape)), HF_DTYPES[info.dtype],
                                                 info.offset, info.nbytes)

    @classmethod
    def open(cls, path: str | os.PathLike, layouts: HFLayouts) -> HFCheckpoint:
        """The directory at `path`, read with the layout `layouts` gives its config's model_type."""
        path = os.fspath(path)
        config_path = os.path.join(path, CONFIG_NAME)
        config = HFConfig(read_json_file(config_path, MAX_CONFIG_BYTES), config_path)
        module = layouts(config.get("model_type"), config.name)
        shards = cls._open_tensors(path)
        try:
            return cls(path, config, shards, cls._layout(module, config, set(shards.tensors)))
        except BaseException:
            shards.close()
            raise

    @staticmethod
    def _open_tensors(path: str) -> ShardedSafetensors:
        return ShardedSafetensors.open(path)

    @staticmethod
    def _layout(module, config: HFConfig, names: set[str]) -> HFLayout:
        return module.hf_layout(config, names)

    def close(self) -> None:
        self.shards.close()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def conversion(self, name: str) -> TensorMap | None:
        return self.maps.get(name)

    def tensor_buffer(self, name: str):
        """(the uint8 array of the shard holding `name`, that shard's map)."""
        shard = self.shards.shard_of(self.maps[name].hf)
        return shard.data, shard.mmap

    def tensor_data(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.name}: no tensor named '{name}'")
        data, _ = self.tensor_buffer(name)
        return data[info.offset : info.offset + info.nbytes]


def _tokenizer_metadata(path: str, config: HFConfig) -> dict[str, Any]:
    """The chat template and BOS/EOS ids, under their GGUF keys, from the directory's files."""
    out: dict[str, Any] = {}
    tokenizer_config_path = os.path.join(path, "tokenizer_config.json")
    tokenizer_config = read_json_file(tokenizer_config_path, MAX_CONFIG_BYTES) if os.path.isfile(tokenizer_config_path) else {}
    template_path = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_path):
        with open(template_path, encoding="utf-8", errors="replace") as fh:
            out["tokenizer.chat_template"] = fh.read(MAX_CONFIG_BYTES)
    elif isinstance(tokenizer_config.get("chat_template"), str):
        out["tokenizer.chat_template"] = tokenizer_config["chat_template"]
    generation_path = os.path.join(path, "generation_config.json")
    generation = read_json_file(generation_path, MAX_CONFIG_BYTES) if os.path.isfile(generation_path) else {}
    for key in ("bos_token_id", "eos_token_id"):
        value = generation.get(key, config.get(key))
        ids = value if isinstance(value, list) else [value]
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if ids:
            out[f"tokenizer.ggml.{key}"] = ids[0]
            if key == "eos_token_id" and len(ids) > 1:
                out["tokenizer.hf.eos_token_ids"] = ids
    if isinstance(tokenizer_config.get("add_bos_token"), bool):
        out["tokenizer.ggml.add_bos_token"] = tokenizer_config["add_bos_token"]
    return out


def expert_tensor(name: str, expert: int) -> str:
    """The GGUF-side name of expert `expert`'s matrix of the 3-D expert tensor `name` (GGUF's
    ffn_*_exps) in a checkpoint that stores each expert's matrix apart, as Hugging Face's do."""
    return f"{name}.{expert}"


def heads_tiled(n_key_heads: int, n_value_heads: int, head_dim: int) -> np.ndarray:
    """Rows of nv value heads of `head_dim` rows each, GGUF's tiled order from HF's grouped one:
    GGUF head j (serving key head j mod nk) is HF head (j mod nk)·r + j div nk, r = nv / nk."""
    ratio = n_value_heads // n_key_heads
    j = np.arange(n_value_heads)
    hf_head = (j % n_key_heads) * ratio + j // n_key_heads
    return (hf_head[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def tensor_maps(config: HFConfig, hf_names: set[str] | None, n_layers: int, globals_: dict[str, str],
                per_layer: dict[str, str]) -> dict[str, TensorMap]:
    """GGUF name → TensorMap for the tensors named by `globals_` (GGUF → HF name under the model
    prefix) and `per_layer` (GGUF suffix → HF suffix, blk.N. ↔ layers.N.) that the checkpoint
    holds (all of them when `hf_names` is None: a checkpoint about to be written), for whichever
    of the usual prefixes (`model.language_model.` in multimodal checkpoints, `model.`, none) it uses.
    `lm_head.weight` becomes `output.weight` unless the embeddings are tied."""
    if hf_names is None:
        prefix = "model."
    else:
        # "": a base model's own save (Gemma3TextModel, EmbeddingGemma), no head around it
        prefix = next((p for p in ("model.language_model.", "model.", "") if p + "embed_tokens.weight" in hf_names),
                      None)
        if prefix is None:
            raise ModelFormatError(f"{config.name}: the checkpoint has no model.embed_tokens.weight "
                                   f"(nor model.language_model.embed_tokens.weight, nor embed_tokens.weight)")

    def held(name: str) -> bool:
        return hf_names is None or name in hf_names

    if hf_names is not None:
        held_layers = {int(m.group(1)) for name in hf_names
                       if name.startswith(prefix) and (m := _LAYER.match(name, len(prefix)))}
        count = max(held_layers, default=-1) + 1
        if count != n_layers:
            raise ModelFormatError(f"{config.name}: num_hidden_layers is {n_layers}, but the checkpoint holds "
                                   f"layers 0..{count - 1}")
    maps = {"token_embd.weight": TensorMap(prefix + "embed_tokens.weight")}
    if not config.get("tie_word_embeddings", False) and held("lm_head.weight"):
        maps["output.weight"] = TensorMap("lm_head.weight")
    maps.update({gguf: TensorMap(prefix + hf) for gguf, hf in globals_.items()})
    for i in range(n_layers):
        for gguf, hf in per_layer.items():
            if held(f"{prefix}layers.{i}.{hf}"):
                maps[f"blk.{i}.{gguf}"] = TensorMap(f"{prefix}layers.{i}.{hf}")
    return maps


def plus_one(values: np.ndarray) -> np.ndarray:
    return values + np.float32(1)


def minus_one(values: np.ndarray) -> np.ndarray:
    return values - np.float32(1)


def shift_norms(maps: dict[str, TensorMap], suffixes: tuple[str, ...]) -> None:
    """Zero-centred RMSNorm weights (HF) → GGUF's, which have the +1 folded in."""
    for name, tmap in maps.items():
        if name.endswith(suffixes):
            maps[name] = replace(tmap, to_gguf=plus_one, to_hf=minus_one)


def decoder_metadata(arch: str, config: HFConfig, head_dim: int, ffn: bool = True) -> dict[str, Any]:
    """The GGUF keys every decoder architecture has, from config.json's usual names; the dense
    feed-forward width (intermediate_size) unless not `ffn` (a mixture of experts without one)."""
    n_heads = config.int("num_attention_heads")
    return {
        "general.architecture": arch,
        f"{arch}.block_count": config.int("num_hidden_layers"), f"{arch}.embedding_length": config.int("hidden_size"),
        **({f"{arch}.feed_forward_length": config.int("intermediate_size")} if ffn else {}),
        f"{arch}.attention.head_count": n_heads, f"{arch}.attention.head_count_kv": config.int("num_key_value_heads", n_heads),
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": config.float("rms_norm_eps"),
    }


def decoder_hf_config(c, tied: bool) -> dict[str, Any]:
    """config.json's usual decoder keys from a model config (hidden, ffn, n_layers, n_heads,
    n_kv_heads, head_dim, rms_eps, vocab: the fields every architecture's config has)."""
    return {
        "hidden_size": c.hidden, "intermediate_size": c.ffn, "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_eps, "vocab_size": c.vocab, "tie_word_embeddings": tied,
    }


LLAMA3_SCALED = ("llama",)  # the architectures whose configs may scale rope as Llama 3.1 does
# llama3's numbers besides its factor, as pagelm's own metadata keys (a GGUF carries rope_freqs.weight instead)
LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_scaling(config: HFConfig, arch: str, holder: dict | None = None) -> dict[str, Any]:
    """GGUF's rope scaling keys for the config's rope type: none for default, the factor for
    linear, llama3's numbers (LLAMA3_KEYS) for a llama; any other type is refused."""
    kind = config.rope("rope_type", "default", holder)
    if kind == "default":
        return {}
    if kind == "linear":
        return {f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": config.rope_float("factor", 0, holder)}
    if kind == "llama3" and arch in LLAMA3_SCALED:
        return {f"{arch}.rope.scaling.type": "llama3", f"{arch}.rope.scaling.factor": config.rope_float("factor", 0, holder),
                **{f"{arch}.rope.scaling.{key}": config.rope_float(key, 0, holder) for key in LLAMA3_KEYS}}
    known = "default, linear" + (", llama3" if arch in LLAMA3_SCALED else "")
    raise UnsupportedError(f"{config.name}: rope type {json.dumps(kind)[:40]} is not supported ({known} are)")


def hf_rope(base: float, scale: float) -> dict[str, Any]:
    """config.json's rope parameters for a base and a linear scale (1.0: none)."""
    if scale == 1.0:
        return {"rope_type": "default", "rope_theta": base}
    return {"rope_type": "linear", "rope_theta": base, "factor": scale}


def layer_period(config: HFConfig, types: list[str], kind: str, fallback: int) -> int:
    """The period p of `layer_types` in which layer i is of `kind` exactly when (i + 1) % p == 0
    (`fallback` when no layer is); any other list is refused."""
    n_layers = config.int("num_hidden_layers")
    first = next((i for i, t in enumerate(types) if t == kind), None)
    period = fallback if first is None else first + 1
    if len(types) != n_layers or any((t == kind) != ((i + 1) % period == 0) for i, t in enumerate(types)):
        raise UnsupportedError(f"{config.name}: layer_types must repeat a run of layers ending in one {kind} layer, "
                               f"the only layout pagelm supports")
    return period
