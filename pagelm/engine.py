"""Generation over a loaded model: a session's prefill → decode loop, sampling, cancel, checkpoints.

Owns the loop and the token bookkeeping; it never parses files (the weights loader does) and never
knows which embedding or weights mode is active.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np
import torch

from pagelm import heap
from pagelm import threads as threads_module
from pagelm.errors import PagelmError
from pagelm.models import ARCHITECTURES, architecture_module
from pagelm.sampling import Sampler, SamplingParams
from pagelm.weights import EmbeddingMode
from pagelm.weights.loader import WeightLoader, WeightsMode

if TYPE_CHECKING:
    from pagelm.grammar import Matcher

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def architecture(loader: WeightLoader):
    """(ConfigClass, ModelClass) for the checkpoint's architecture."""
    module = architecture_module(loader.architecture, loader.name)
    _, config_name, model_name = ARCHITECTURES[loader.architecture]
    return getattr(module, config_name), getattr(module, model_name)


class Model:
    """A model file opened for generation: mapped embedding and head, network weights (dense or
    mapped), config; `threads` (default: the CPUs this process may use) for torch and the kernels."""

    def __init__(self, path: str, embedding: EmbeddingMode = "mapped", weights: WeightsMode = "mapped",
                 dtype: str = "bfloat16", device: str = "cpu", threads: int | None = None):
        if dtype not in DTYPES:
            raise PagelmError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.threads = threads_module.configure(threads)
        self.loader = WeightLoader.open(path, weights, DTYPES[dtype], device)
        self.file = self.loader.file
        config_class, model_class = architecture(self.loader)
        self.config = config_class.from_loader(self.loader)
        # float32 compute takes float32 rows so nothing is rounded on the way in; bf16 takes bf16
        self.embedding = self.loader.token_embedding(embedding, rows="f32" if dtype == "float32" else "bf16")
        self.head = self.loader.output_head()
        self.network = model_class(self.config, self.loader)
        self.loader.warmup()
        heap.trim()  # what decoding the small tensors and unpacking (dense) left on the heap
        eos = self.file.metadata.get("tokenizer.ggml.eos_token_id")
        self.eos_tokens: tuple[int, ...] = () if eos is None else (int(eos),)

    def session(self, max_len: int = 4096) -> "Session":
        return Session(self, max_len)

    @property
    def weights_nbytes(self) -> int:
        """Anonymous bytes the layer weights hold (dense matrices, or the mapped scratch) and small tensors."""
        return self.loader.nbytes


@dataclass(frozen=True)
class Checkpoint:
    tokens: tuple[int, ...]
    state: object  # the network's own checkpoint (KV[:pos] + conv + recurrent)
    logits: np.ndarray | None

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (0 if self.logits is None else self.logits.nbytes)


class Session:
    """One conversation's state over a model: the tokens fed so far and the last logits."""

    def __init__(self, model: Model, max_len: int):
        self.model = model
        self.max_len = max_len
        self.state = model.network.new_state(max_len)
        self.tokens: list[int] = []
        self.logits: np.ndarray | None = None

    def reset(self) -> None:
        """Forget everything fed so far; the state's buffers are reused, not reallocated."""
        with torch.inference_mode():
            for t in self.state.fixed_tensors():
                t.zero_()
        self.state.pos = 0
        self.tokens = []
        self.logits = None

    def _check_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(self.tokens) + ids.size > self.max_len:
            raise PagelmError(f"context overflow: {len(self.tokens)} tokens held + {ids.size} new "
                              f"> context length {self.max_len}")
        return ids

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed tokens (a prompt, or the rest of one after restore); returns the last position's logits."""
        ids = self._check_tokens(tokens)
        if ids.size == 0:
            raise PagelmError("prefill needs at least one token")
        threads_module.use()
        embedding = self.model.embedding
        embedding.prefetch(ids)
        rows = embedding.lookup(ids)
        x = torch.from_numpy(rows) if embedding.rows == "f32" else torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
        hidden = self.model.network.forward(x, self.state)
        self.tokens.extend(ids.tolist())
        self.logits = self.model.head.logits(hidden[-1].float().cpu().numpy())
        if ids.size > heap.TRIM_AFTER_TOKENS:
            heap.trim()  # give the prefill's temporaries back to the OS
        return self.logits

    def decode(self, token: int) -> np.ndarray:
        """Feed one token (normally the one just sampled); returns the next logits."""
        return self.prefill([token])

    def checkpoint(self) -> Checkpoint:
        logits = None if self.logits is None else self.logits.copy()
        return Checkpoint(tuple(self.tokens), self.state.checkpoint(), logits)

    def restore(self, checkpoint: Checkpoint) -> None:
        self.state.restore(checkpoint.state)
        self.tokens = list(checkpoint.tokens)
        self.logits = None if checkpoint.logits is None else checkpoint.logits.copy()

    def generate(self, prompt: Sequence[int], params: SamplingParams = SamplingParams(),
                 cancel: threading.Event | None = None, constraint: Matcher | None = None) -> Iterator[int]:
        """Prefill `prompt` (may be empty to continue from the current state), then yield sampled
        tokens until a stop token, max_tokens, the context end, or `cancel` is set (checked
        before every step). A stop token is yielded, then generation ends. `constraint` (a
        grammar's matcher) forbids the tokens its grammar does not allow at each step."""
        sampler = Sampler(params)
        stops = set(params.stop_tokens) | set(self.model.eos_tokens)
        logits = self.prefill(prompt) if len(prompt) else self.logits
        if logits is None:
            raise PagelmError("generate needs a prompt or a prefilled session")
        seen = Counter(self.tokens)
        for _ in range(params.max_tokens):
            if cancel is not None and cancel.is_set():
                return
            if constraint is not None:
                # a copy: self.logits stays the model's own (checkpoints keep it)
                logits = constraint.mask(logits.copy())
            token = sampler.sample(logits, seen)
            if constraint is not None:
                constraint.accept(token)
            yield token
            if token in stops or len(self.tokens) >= self.max_len:
                return
            seen[token] += 1
            logits = self.decode(token)
