"""Generation over a loaded model: a session's prefill → decode loop, sampling, cancel, checkpoints.

Owns the loop and the token bookkeeping; it never parses files (the weights loader does) and never
knows which embedding or weights mode is active.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Generator, Iterator, Sequence

import numpy as np
import torch

from pagelm import heap
from pagelm import threads as threads_module
from pagelm.errors import PagelmError, UnsupportedError
from pagelm.models import architecture_module, hf_layouts
from pagelm.models.decoder import finish
from pagelm.sampling import SamplingParams
from pagelm.weights import EmbeddingMode
from pagelm.weights.loader import WeightLoader, WeightsMode

if TYPE_CHECKING:
    from pagelm.grammar import Matcher
    from pagelm.vision.inputs import ImageInput

log = logging.getLogger("pagelm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
VISION_ARCHITECTURES = ("qwen35",)  # the models whose image tokens a vision tower (mmproj) makes
DEFAULT_IMAGE_CACHE_MIB = 256


def architecture(loader: WeightLoader):
    """(ConfigClass, ModelClass) for the checkpoint's architecture."""
    module = architecture_module(loader.architecture, loader.name)
    return module.Config, module.Model


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


class Model:
    """A model file opened for generation: mapped embedding and head, network weights (dense or
    mapped), config; `threads` (default: the CPUs this process may use) for torch and the kernels.

    A Qwen3.5 model also gets its vision tower: the mmproj file `mmproj` names, else one found
    beside the model (`find_mmproj`); its image embeddings are kept in `image_cache`, up to
    `image_cache_mib` MiB."""

    def __init__(self, path: str, embedding: EmbeddingMode = "mapped", weights: WeightsMode = "mapped",
                 dtype: str = "bfloat16", device: str = "cpu", threads: int | None = None,
                 mmproj: str | None = None, image_cache_mib: int = DEFAULT_IMAGE_CACHE_MIB):
        from pagelm.vision.cache import EmbeddingCache

        if dtype not in DTYPES:
            raise PagelmError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.threads = threads_module.configure(threads)
        heap.map_large_blocks()
        self.loader = WeightLoader.open(path, weights, DTYPES[dtype], device, hf_layouts)
        self.file = self.loader.file
        config_class, model_class = architecture(self.loader)
        self.config = config_class.from_loader(self.loader)
        # float32 compute takes float32 rows so nothing is rounded on the way in; bf16 takes bf16
        self.embedding = self.loader.token_embedding(embedding, rows="f32" if dtype == "float32" else "bf16")
        self.head = self.loader.output_head()
        self.network = model_class(self.config, self.loader)
        self.mmproj, self.tower_loader, self.tower = None, None, None
        self._attach_tower(path, mmproj, weights, dtype, device)
        self.image_cache = EmbeddingCache(image_cache_mib << 20)
        for loader in (self.loader, self.tower_loader):
            if loader is not None:
                loader.warmup()
        heap.trim()  # what decoding the small tensors and unpacking (dense) left on the heap
        eos = self.file.metadata.get("tokenizer.ggml.eos_token_id")
        self.eos_tokens: tuple[int, ...] = () if eos is None else (int(eos),)

    def _attach_tower(self, path: str, given: str | None, weights: WeightsMode, dtype: str, device: str) -> None:
        """Open the vision tower: the one given (which must fit), else one found beside a model that
        can read images; a found one that does not fit is skipped with a warning (text only)."""
        can_see = self.loader.architecture in VISION_ARCHITECTURES
        if given is not None and not can_see:
            raise UnsupportedError(f"{given}: pagelm reads images with {', '.join(VISION_ARCHITECTURES)} models; "
                                   f"{path} is {self.loader.architecture}")
        if given is not None and not os.path.isfile(given):
            raise PagelmError(f"{given}: no such mmproj file")
        try:
            mmproj = given if given is not None else find_mmproj(path) if can_see else None
            if mmproj is None:
                return
            loader = WeightLoader.open(mmproj, weights, DTYPES[dtype], device)
            self.tower = self._open_tower(path, mmproj, loader)
        except PagelmError as e:
            if given is not None:
                raise
            log.warning("pagelm: %s: text only, the vision tower found beside it was skipped: %s", path, e)
            return
        self.mmproj, self.tower_loader = mmproj, loader

    def _open_tower(self, path: str, mmproj: str, loader: WeightLoader):
        from pagelm.vision import VisionTower
        from pagelm.vision.inputs import IMAGE_PAD

        tower = VisionTower.load(loader)
        if tower.config.out_hidden != self.config.hidden:
            raise PagelmError(f"{mmproj}: the vision tower's output width (clip.vision.projection_dim) is "
                              f"{tower.config.out_hidden}, but {path} has width {self.config.hidden}: not its tower")
        if self.config.vocab <= IMAGE_PAD:
            raise PagelmError(f"{path}: a vocabulary of {self.config.vocab} tokens has no image tokens "
                              f"(<|image_pad|> is {IMAGE_PAD})")
        return tower

    def image_embedding(self, image: ImageInput) -> torch.Tensor:
        """The tower's output for `image` (tokens, hidden) float32, from `image_cache` when it holds it."""
        if self.tower is None:
            raise PagelmError("this model has no vision tower: it cannot read images")
        found = self.image_cache.get(image.key)
        if found is None:
            start = time.perf_counter()
            pixels = image.rows()
            found = self.tower.encode(pixels.rows, pixels.grid)
            self.image_cache.put(image.key, found, time.perf_counter() - start)
        return found

    def session(self, max_len: int = 4096) -> "Session":
        return Session(self, max_len)

    def decode_batch(self, sessions: Sequence["Session"], tokens: Sequence[int]) -> np.ndarray:
        """One decode step of several sessions of this model (`pagelm.batch.decode_batch`): logits
        (n, vocab), row i bit for bit what sessions[i].decode(tokens[i]) would return."""
        from pagelm.batch import decode_batch

        if any(s.model is not self for s in sessions):
            raise PagelmError("decode_batch: every session must be of this model")
        return decode_batch(sessions, tokens)

    @property
    def weights_nbytes(self) -> int:
        """Anonymous bytes the layer weights hold (dense matrices, or the mapped scratch) and small
        tensors, the vision tower's included."""
        return self.loader.nbytes + (0 if self.tower_loader is None else self.tower_loader.nbytes)


@dataclass(frozen=True)
class Checkpoint:
    tokens: tuple[int, ...]
    images: tuple[str, ...]  # keys of the images among the tokens, in order
    position_delta: int
    state: object  # the network's own checkpoint (KV[:pos] + conv + recurrent)
    logits: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (0 if self.logits is None else self.logits.nbytes)


class Session:
    """One conversation's state over a model: the tokens fed so far (and the keys of the images
    among them), the last logits, and how far rope positions run ahead of token indices (images
    take fewer positions than tokens)."""

    def __init__(self, model: Model, max_len: int):
        self.model = model
        self.max_len = max_len
        self.state = model.network.new_state(max_len)
        self.tokens: list[int] = []
        self.images: list[str] = []
        self.position_delta = 0
        self.logits: np.ndarray | None = None

    def reset(self) -> None:
        """Forget everything fed so far; the state's buffers are reused, not reallocated."""
        with torch.inference_mode():
            for t in self.state.fixed_tensors():
                t.zero_()
        self.state.pos = 0
        self.tokens = []
        self.images = []
        self.position_delta = 0
        self.logits = None

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(self.tokens) + ids.size > self.max_len:
            raise PagelmError(f"context overflow: {len(self.tokens)} tokens held + {ids.size} new "
                              f"> context length {self.max_len}")
        return ids

    def _image_runs(self, ids: np.ndarray, images: Sequence[ImageInput]) -> list[tuple[int, ImageInput]]:
        """(offset, image) of each image's run of pad tokens in `ids`; with images, the runs must be
        theirs (without, a pad token is text, as one the model samples is)."""
        from pagelm.vision.inputs import IMAGE_PAD

        if not images:
            return []
        if self.model.tower is None:
            raise PagelmError("this model has no vision tower: it cannot read images")
        edges = np.flatnonzero(np.diff(np.concatenate(([0], (ids == IMAGE_PAD).astype(np.int8), [0]))))
        runs = list(zip(edges[::2].tolist(), (edges[1::2] - edges[::2]).tolist()))
        if [n for _, n in runs] != [image.tokens for image in images]:
            raise PagelmError(f"image pad tokens in runs of {[n for _, n in runs][:8]} for images of "
                              f"{[image.tokens for image in images][:8]} tokens")
        return [(offset, image) for (offset, _), image in zip(runs, images)]

    def prefill(self, tokens: Sequence[int], images: Sequence[ImageInput] = ()) -> np.ndarray:
        """Feed tokens (a prompt, or the rest of one after restore); returns the last position's
        logits. `images`: those whose pad tokens (each image's full run) are among the tokens, in order."""
        with torch.inference_mode():
            return finish(self._prefill_steps(tokens, images))

    @torch.inference_mode()
    def prefill_layers(self, tokens: Sequence[int], images: Sequence[ImageInput] = ()) -> Generator:
        """`prefill` one layer at a time: yields after each layer, returns prefill's result, bit for
        bit (a server steps other sessions between two layers). Until it has returned, the session
        is half-updated: drop it (reset or restore) if the generator is not run to its end."""
        return (yield from self._prefill_steps(tokens, images))

    def _prefill_steps(self, tokens: Sequence[int], images: Sequence[ImageInput] = ()) -> Generator:
        """prefill_layers' steps, for a caller in inference mode (Decoder.forward_layers says why)."""
        ids = self._check_tokens(tokens)
        if ids.size == 0:
            raise PagelmError("prefill needs at least one token")
        runs = self._image_runs(ids, images)
        threads_module.use()
        embedding = self.model.embedding
        embedding.prefetch(ids)
        rows = embedding.lookup(ids)
        x = torch.from_numpy(rows) if embedding.rows == "f32" else torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
        positions = None
        if runs or self.position_delta:
            for offset, image in runs:
                x[offset : offset + image.tokens] = self.model.image_embedding(image).to(x.dtype)
            first = len(self.tokens) + self.position_delta
            positions, after = self.model.network.image_positions(first, ids.size, [(offset, *image.merged)
                                                                                    for offset, image in runs])
        hidden = yield from self.model.network.forward_layers(x, self.state, positions)
        self.tokens.extend(ids.tolist())
        self.images.extend(image.key for image in images)
        if positions is not None:
            self.position_delta = after - len(self.tokens)
        self.logits = self.model.head.logits(hidden[-1].float().cpu().numpy())
        if ids.size > heap.TRIM_AFTER_TOKENS:
            heap.trim()  # give the prefill's temporaries back to the OS
        return self.logits

    def decode(self, token: int) -> np.ndarray:
        """Feed one token (normally the one just sampled); returns the next logits."""
        return self.prefill([token])

    @property
    def nbytes(self) -> int:
        """Anonymous bytes this session holds: its state (KV caches preallocated for max_len, the
        DeltaNet states) and its last logits."""
        return self.state.nbytes + (0 if self.logits is None else self.logits.nbytes)

    def checkpoint(self) -> Checkpoint:
        logits = None if self.logits is None else self.logits.copy()
        return Checkpoint(tuple(self.tokens), tuple(self.images), self.position_delta, self.state.checkpoint(), logits)

    def restore(self, checkpoint: Checkpoint) -> None:
        self.state.restore(checkpoint.state)
        self.tokens = list(checkpoint.tokens)
        self.images = list(checkpoint.images)
        self.position_delta = checkpoint.position_delta
        self.logits = None if checkpoint.logits is None else checkpoint.logits.copy()

    def generate(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                 cancel: threading.Event | None = None, constraint: Matcher | None = None,
                 images: Sequence[ImageInput] = ()) -> Iterator[int]:
        """Prefill `prompt` (may be empty to continue from the current state) with the `images`
        among its tokens, then yield sampled tokens until a stop token, max_tokens, the context
        end, or `cancel` is set (checked before every step). A stop token is yielded, then
        generation ends. `constraint` (a grammar's matcher) forbids the tokens its grammar does
        not allow at each step."""
        from pagelm.batch import Chooser

        logits = self.prefill(prompt, images) if len(prompt) else self.logits
        if logits is None:
            raise PagelmError("generate needs a prompt or a prefilled session")
        chooser = Chooser(self, params, constraint)
        try:
            for _ in range(params.max_tokens):
                if cancel is not None and cancel.is_set():
                    return
                token, done = chooser.choose(logits)
                yield token
                if done:
                    return
                logits = self.decode(token)
        finally:
            heap.trim()  # what the decode steps' temporaries left free on the heap
