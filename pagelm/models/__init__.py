"""Model architectures: one module per architecture over shared layers, pure functions of (weights, inputs, state).

Owns the math of each architecture and its decode state; never parses files (weights arrive
through a `weights.loader.WeightLoader`) and never touches token embeddings or the output head.

Registration is by convention: a module `pagelm.models.<name>` that defines `GGUF_ARCHITECTURES`
(the `general.architecture` values it reads), `HF_MODEL_TYPES` (the config.json `model_type`s),
`Config` (`Config.from_loader(loader)`), `Model` (`Model(config, loader)`) and `hf_layout` is an
architecture; adding one is adding its file. Importing this package loads no torch.

Shared pieces, each in one module: `layers` (norms, rope, attention over a KV cache, the gated
MLP, KV state), `decoder` (the stack every architecture's `Model` is: segments, batches, pauses
between layers), `llama_family` (the decoder llama, qwen2, qwen3, qwen3moe and gpt-oss share; each of their
modules is its `Family`), `moe` (a mixture of experts' feed-forward), `norms`, `token_ops` and
`token_layers` (one decode token's kernels), `delta_rule` (Qwen3.5's Gated DeltaNet kernels).

Every architecture's forward has three paths, one arithmetic:
- prefill (T > 1 tokens, or a token the kernels do not take): `Model._layers` in torch over the
  rows of one or more sequences, with `layers.attention` and `layers.rms_norm`;
- decode (one token of each sequence): the same `_layers`, whose attention and norms take the
  compiled one-token kernels (`token_ops`), or `_token_layers` over a `token_ops.TokenStep` in
  numpy between those kernels (the llama family, Gemma 3), the same operations on the same values;
- compiled decode: `token_layers.TokenLayers.run`, each layer of `_token_layers` as one compiled call
  of the same kernels (the llama family, Gemma 3, where every product is GGML rows read in place).
A verify pass (`Decoder.decode_rows`: several tokens of one sequence, speculative decoding's) is a
decode step whose rows are one sequence at successive positions (`decoder.RowState`): the decode
paths as they are, recurrent states advanced row after row (`decoder.waves`) and kept for rewinding.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

# the architectures whose image tokens a vision tower (mmproj) makes
VISION_ARCHITECTURES = ("qwen35", "qwen35moe")


@functools.cache
def _architectures() -> tuple:
    modules = (importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__))
    return tuple(m for m in modules if hasattr(m, "GGUF_ARCHITECTURES"))


def _unsupported(message: str, supported) -> Exception:
    from pagelm.errors import UnsupportedError

    return UnsupportedError(f"{message} is not supported (supported: {', '.join(sorted(supported))})")


def architecture_module(name: str, where: str):
    """The module of GGUF architecture `name`: its `Config`, `Model` and Hugging Face layout."""
    for module in _architectures():
        if name in module.GGUF_ARCHITECTURES:
            return module
    raise _unsupported(f"{where}: architecture {name!r}", (a for m in _architectures() for a in m.GGUF_ARCHITECTURES))


def hf_layouts(model_type, where: str):
    """The module whose `hf_layout` (and FastFlowLM `FLM_NAMES` / `flm_rows`, where it has them)
    reads a Hugging Face checkpoint of config.json `model_type`: what `weights.hf` is handed."""
    import json

    for module in _architectures():
        if model_type in module.HF_MODEL_TYPES:
            return module
    raise _unsupported(f"{where}: model_type {json.dumps(model_type)[:60]}",
                       (t for m in _architectures() for t in m.HF_MODEL_TYPES))
