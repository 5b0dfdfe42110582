"""What makes a model an embedding model, read from its file: how the final hidden states of an
input become one vector (pooling: the mean over its tokens, its first token, or its last), the
dense projections after that, and the normalization.

- GGUF: `{arch}.pooling_type` (llama.cpp's enum) and the `dense_2` / `dense_3` matrices
  EmbeddingGemma's converter writes (no bias, no activation); vectors are L2-normalized, as
  llama.cpp's server does by default.
- A Hugging Face directory: sentence-transformers' `modules.json` and the modules it lists after
  the transformer (a Pooling folder's config.json, Dense folders with config.json and
  model.safetensors, Normalize), and `config_sentence_transformers.json`'s prompts.
A file with neither is a generative model: `embedding_head` gives None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagelm.errors import ModelFormatError, UnsupportedError
from pagelm.formats.safetensors import SafetensorsFile, read_json_file
from pagelm.weights.loader import WeightLoader

POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_* values
ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
ST_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": torch.tanh}
GGUF_DENSE = ("dense_2", "dense_3")
JSON_LIMIT = 1 << 20


@dataclass(frozen=True)
class Dense:
    weight: torch.Tensor  # (out, in) float32
    bias: torch.Tensor | None = None
    activation: object = None  # None: identity


@dataclass(frozen=True)
class EmbeddingHead:
    pooling: str  # mean | cls | last
    dense: tuple[Dense, ...] = ()
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)  # named instruction prefixes (query, document, ...)

    @property
    def dimensions(self) -> int | None:
        """The vector's length when a projection sets it; None: the model's hidden size."""
        return int(self.dense[-1].weight.shape[0]) if self.dense else None

    def __call__(self, hidden: torch.Tensor) -> np.ndarray:
        """One input's vector from its final hidden states (T, hidden), in float32."""
        h = hidden.float()
        v = {"mean": lambda: h.mean(0), "cls": lambda: h[0], "last": lambda: h[-1]}[self.pooling]()
        for layer in self.dense:
            v = layer.weight @ v + (0 if layer.bias is None else layer.bias)
            if layer.activation is not None:
                v = layer.activation(v)
        if self.normalize:
            v = v / v.norm().clamp_min(1e-12)
        return v.numpy()


def embedding_head(loader: WeightLoader) -> EmbeddingHead | None:
    """The pooling, projections and normalization of an embedding model; None for any other."""
    directory = Path(loader.file.path)
    if directory.is_dir():
        return _sentence_transformers(directory) if (directory / "modules.json").is_file() else None
    pooling = loader.get(f"{loader.architecture}.pooling_type")
    if pooling is None:
        return None
    if int(pooling) not in POOLING_TYPES:
        raise UnsupportedError(f"{loader.name}: pooling_type {int(pooling)} is not supported "
                               f"({', '.join(f'{k} {v}' for k, v in POOLING_TYPES.items())} are)")
    dense = []
    for name in GGUF_DENSE:
        if loader.has_tensor(f"{name}.weight"):
            cols, rows = loader.dims(f"{name}.weight")
            dense.append(Dense(loader.tensor(f"{name}.weight", (rows, cols))))
    return EmbeddingHead(POOLING_TYPES[int(pooling)], tuple(dense))


def _sentence_transformers(directory: Path) -> EmbeddingHead:
    modules = read_json_file(str(directory / "modules.json"), JSON_LIMIT, (list,))
    if not all(isinstance(m, dict) for m in modules):
        raise ModelFormatError(f"{directory}/modules.json: expected a list of modules")
    pooling, dense, normalize = None, [], False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = directory / str(module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(_object(path / "config.json"), path)
        elif kind == "Dense":
            dense.append(_dense(path))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedError(f"{directory}/modules.json: module {kind!r:.60} is not supported "
                                   f"(Transformer, Pooling, Dense, Normalize are)")
    if pooling is None:
        raise ModelFormatError(f"{directory}/modules.json: no Pooling module")
    settings = directory / "config_sentence_transformers.json"
    prompts = _object(settings).get("prompts") if settings.is_file() else None
    prompts = {str(k): v for k, v in prompts.items() if isinstance(v, str)} if isinstance(prompts, dict) else {}
    return EmbeddingHead(pooling, tuple(dense), normalize, prompts)


def _pooling_mode(config: dict, where: Path) -> str:
    chosen = [mode for key, mode in ST_POOLING.items() if config.get(key) is True]
    if isinstance(config.get("pooling_mode"), str):
        chosen = [{"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(config["pooling_mode"], config["pooling_mode"])]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True and k not in ST_POOLING]
    if len(chosen) != 1 or others or chosen[0] not in ("mean", "cls", "last"):
        raise UnsupportedError(f"{where}/config.json: pooling {chosen + others} is not supported (exactly one of "
                               f"mean, cls, lasttoken is)")
    if config.get("include_prompt") is False:
        raise UnsupportedError(f"{where}/config.json: pooling without the prompt's tokens is not supported")
    return chosen[0]


def _dense(path: Path) -> Dense:
    config = _object(path / "config.json")
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if activation not in ST_ACTIVATIONS:
        raise UnsupportedError(f"{path}/config.json: activation {activation!r:.80} is not supported "
                               f"({', '.join(ST_ACTIVATIONS)} are)")
    weights = SafetensorsFile.open(path / "model.safetensors")
    try:
        weight = _float32(weights, "linear.weight")
        bias = _float32(weights, "linear.bias") if config.get("bias") else None
    finally:
        weights.close()
    expected = (config.get("out_features"), config.get("in_features"))
    if tuple(weight.shape) != expected:
        raise ModelFormatError(f"{path}: linear.weight is {tuple(weight.shape)}, config.json says {expected}")
    return Dense(weight, bias, ST_ACTIVATIONS[activation])


def _float32(weights: SafetensorsFile, name: str) -> torch.Tensor:
    """A small tensor as float32 (bf16 ones are stored as their bit patterns)."""
    if name not in weights.tensors:
        raise ModelFormatError(f"{weights.name}: no tensor {name!r}")
    values = weights.tensor(name)
    if weights.info(name).dtype == "BF16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return torch.from_numpy(values.astype(np.float32))


def _object(path: Path) -> dict:
    return read_json_file(str(path), JSON_LIMIT)
