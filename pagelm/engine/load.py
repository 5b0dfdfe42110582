"""Opening a model for generation: the checkpoint's weights, its architecture's network, the token
embedding and head in the chosen modes, and a Qwen3.5's vision tower (`load_model`).

Owns the order of loading and the choice of a tower; what each part reads is the weights loader's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pagelm.engine.model import DEFAULT_IMAGE_CACHE_MIB, DTYPES, Model
from pagelm.engine.warm import run_first_step
from pagelm.errors import PagelmError, UnsupportedError
from pagelm.models import VISION_ARCHITECTURES, architecture_module, hf_layouts
from pagelm.runtime import heap
from pagelm.runtime import threads as threads_module
from pagelm.vision import VisionTower
from pagelm.vision.cache import EmbeddingCache
from pagelm.vision.inputs import IMAGE_PAD
from pagelm.weights import EmbeddingMode
from pagelm.weights.loader import WeightLoader, WeightsMode

log = logging.getLogger("pagelm")


def load_model(path: str, embedding: EmbeddingMode = "mapped", weights: WeightsMode = "mapped",
               dtype: str = "bfloat16", device: str = "cpu", threads: int | None = None,
               mmproj: str | None = None, image_cache_mib: int = DEFAULT_IMAGE_CACHE_MIB) -> Model:
    """Open the GGUF file or checkpoint directory at `path`; `threads` (default: the CPUs this
    process may use) for torch and the kernels. A Qwen3.5 model also gets its vision tower: the
    mmproj file `mmproj` names, else one found beside the model (`find_mmproj`); its image
    embeddings are kept up to `image_cache_mib` MiB."""
    if dtype not in DTYPES:
        raise PagelmError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    threads = threads_module.configure(threads)
    heap.map_large_blocks()
    heap.bound_gemm_cache()
    loader = WeightLoader.open(path, weights, DTYPES[dtype], device, hf_layouts)
    module = architecture_module(loader.architecture, loader.name)
    config = module.Config.from_loader(loader)
    # float32 compute takes float32 rows so nothing is rounded on the way in; bf16 takes bf16
    token_embedding = loader.token_embedding(embedding, rows="f32" if dtype == "float32" else "bf16")
    head = loader.output_head()
    network = module.Model(config, loader)
    tower, tower_loader, mmproj = _open_tower(path, mmproj, loader.architecture, config.hidden, config.vocab,
                                              weights, dtype, device)
    loader.warmup(network.kernel_jobs())
    if tower_loader is not None:
        tower_loader.warmup()
    model = Model(loader, config, network, token_embedding, head, threads, EmbeddingCache(image_cache_mib << 20),
                  tower, tower_loader, mmproj)
    # as llama.cpp's warmup run: what a step loads from the kernel cache on its first call (~0.1 s, the
    # compiled layers' typed lists and calls), or compiles where the cache lacks it, is done here, not in
    # the first request
    run_first_step(model)
    heap.trim()  # what decoding the small tensors, unpacking (dense) and that step left on the heap
    return model


def find_mmproj(path: str) -> str | None:
    """The vision tower beside a model: the one `mmproj*.gguf` in a GGUF file's directory (of
    several, the one whose name holds the model file's stem), or `mmproj.gguf` in a model
    directory; None when there is none."""
    model = Path(path)
    if model.is_dir():
        found = model / "mmproj.gguf"
        return str(found) if found.is_file() else None
    candidates = sorted(p for p in model.parent.glob("mmproj*.gguf") if p.is_file() and p != model)
    if len(candidates) > 1:
        named = [p for p in candidates if model.stem in p.stem]
        if len(named) != 1:
            raise PagelmError(f"{path}: several vision towers beside the model "
                              f"({', '.join(p.name for p in candidates)}); choose one with --mmproj")
        candidates = named
    return str(candidates[0]) if candidates else None


def _open_tower(path: str, given: str | None, architecture: str, hidden: int, vocab: int,
                weights: WeightsMode, dtype: str, device: str) -> tuple:
    """(tower, its loader, its file), or three Nones: the one given (which must fit), else one found beside a model
    that can read images; a found one that does not fit is skipped with a warning (text only)."""
    can_see = architecture in VISION_ARCHITECTURES
    if given is not None and not can_see:
        raise UnsupportedError(f"{given}: pagelm reads images with {', '.join(VISION_ARCHITECTURES)} models; "
                               f"{path} is {architecture}")
    if given is not None and not os.path.isfile(given):
        raise PagelmError(f"{given}: no such mmproj file")
    try:
        mmproj = given if given is not None else find_mmproj(path) if can_see else None
        if mmproj is None:
            return None, None, None
        loader = WeightLoader.open(mmproj, weights, DTYPES[dtype], device)
        tower = VisionTower.load(loader)
        if tower.config.out_hidden != hidden:
            raise PagelmError(f"{mmproj}: the vision tower's output width (clip.vision.projection_dim) is "
                              f"{tower.config.out_hidden}, but {path} has width {hidden}: not its tower")
        if vocab <= IMAGE_PAD:
            raise PagelmError(f"{path}: a vocabulary of {vocab} tokens has no image tokens "
                              f"(<|image_pad|> is {IMAGE_PAD})")
    except PagelmError as e:
        if given is not None:
            raise
        log.warning("pagelm: %s: text only, the vision tower found beside it was skipped: %s", path, e)
        return None, None, None
    return tower, loader, mmproj
