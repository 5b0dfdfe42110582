"""Perplexity of a model on a fixed English text, per weights mode (mapped, mapped-int8, dense) and compute dtype,
computed twice: through one prefill over the whole text, and teacher-forced through decode steps.

Owns the text, the two negative log-likelihood paths and their table; it never starts servers.
"""

from __future__ import annotations

import gc
import math
import sys
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pagelm.bench.report import markdown_table
from pagelm.errors import PagelmError

DEFAULT_TOKENS = 2048
WEIGHTS = ("mapped", "mapped-int8", "dense")
DEFAULT_WEIGHTS = ("mapped", "dense")
DTYPES = ("bfloat16", "float32")
TEXT_SOURCE = "Python's bundled documentation (pydoc_data.topics, topics in sorted key order)"


def default_text() -> str:
    """The English documentation bundled with Python: every pydoc topic's text, topics in sorted key order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def text_tokens(tokenizer, text: str, n: int) -> list[int]:
    """The first n token ids of `text` (with the model's BOS when its tokenizer adds one).

    Tokenizes a growing prefix of the text rather than all of it; fewer than n ids when the text
    is shorter.
    """
    chars = 8 * n + 64
    while True:
        ids = tokenizer.encode(text[:chars], add_special=True)
        # the last ids of a cut text may differ from the whole text's: keep a margin
        if len(ids) > n + 16 or chars >= len(text):
            return ids[:n]
        chars *= 2


def next_token_nll(logits: np.ndarray, target: int) -> float:
    """−log softmax(logits)[target] in float64."""
    z = logits.astype(np.float64)
    top = z.max()
    return float(top + math.log(np.exp(z - top).sum()) - z[target])


def _softcap(model):
    """The final logit softcapping the config asks for (Gemma 2 style), as a function on logits."""
    from pagelm.models.gemma3 import softcap_logits

    cap = getattr(model.config, "final_logit_softcapping", None)
    return lambda logits: softcap_logits(logits, cap)


def prefill_nll(model, ids: Sequence[int], progress: bool = True) -> np.ndarray:
    """NLL of ids[t + 1] for every t, from one forward pass over all of `ids` (as Session.prefill
    computes it, keeping every position's hidden state), then the head on each position."""
    import torch
    from tqdm import tqdm

    from pagelm.runtime import threads

    ids = np.asarray(ids, dtype=np.int64)
    cap = _softcap(model)
    with torch.inference_mode():
        threads.use()
        state = model.network.new_state(len(ids))
        embedding = model.embedding
        rows = embedding.lookup(ids)
        x = torch.from_numpy(rows) if embedding.rows == "f32" else torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
        hidden = model.network.forward(x, state).float().cpu().numpy()
    del state, x
    nll = np.empty(len(ids) - 1)
    logits = None
    for t in tqdm(range(len(ids) - 1), desc="  head over prefill", unit="tok", file=sys.stderr,
                  disable=not progress, leave=False):
        logits = model.head.logits(hidden[t], out=logits)
        nll[t] = next_token_nll(cap(logits), int(ids[t + 1]))
    return nll


def decode_nll(model, ids: Sequence[int], progress: bool = True) -> np.ndarray:
    """NLL of ids[t + 1] for every t, teacher-forced: prefill ids[0], then decode ids[1], ids[2], ..."""
    from tqdm import tqdm

    cap = _softcap(model)
    session = model.session(len(ids))
    nll = np.empty(len(ids) - 1)
    logits = session.prefill([int(ids[0])])
    for t in tqdm(range(len(ids) - 1), desc="  decode steps", unit="tok", file=sys.stderr,
                  disable=not progress, leave=False):
        if t:
            logits = session.decode(int(ids[t]))
        nll[t] = next_token_nll(cap(np.array(logits, np.float32)), int(ids[t + 1]))
    return nll


@dataclass(frozen=True)
class PerplexityRow:
    weights: str
    dtype: str
    prefill_nll: np.ndarray = field(repr=False, compare=False)  # per predicted token, through prefill
    decode_nll: np.ndarray = field(repr=False, compare=False)  # per predicted token, through decode steps

    @property
    def tokens(self) -> int:
        """Tokens of the text scored: each but the first is predicted once."""
        return len(self.prefill_nll) + 1

    @property
    def prefill(self) -> float:
        """Perplexity through prefill."""
        return math.exp(self.prefill_nll.mean())

    @property
    def decode(self) -> float:
        """Perplexity through decode steps."""
        return math.exp(self.decode_nll.mean())


def paired_ratio(nll: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """Perplexity ratio − 1 of two runs over the same tokens, in %, and the standard error of that
    figure from the spread of their per-token NLL differences (tokens taken as independent): a
    difference a few standard errors wide is one the text is long enough to resolve."""
    d = nll - reference
    se = d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return (math.exp(d.mean()) - 1) * 100, se * 100


@dataclass
class PerplexityReport:
    model: str
    rows: list[PerplexityRow]
    command: str = ""

    def row(self, weights: str, dtype: str) -> PerplexityRow | None:
        return next((r for r in self.rows if r.weights == weights and r.dtype == dtype), None)

    def markdown(self) -> str:
        table = markdown_table(
            ["model", "weights", "dtype", "tokens", "ppl prefill", "ppl decode"],
            [[self.model, r.weights, r.dtype, r.tokens, f"{r.prefill:.6g}", f"{r.decode:.6g}"] for r in self.rows],
            "lllrrr")
        ratios = []
        for dtype in dict.fromkeys(r.dtype for r in self.rows):
            mapped, dense = self.row("mapped", dtype), self.row("dense", dtype)
            if mapped and dense:
                prefill = paired_ratio(mapped.prefill_nll, dense.prefill_nll)
                decode = paired_ratio(mapped.decode_nll, dense.decode_nll)
                ratios.append([dtype, f"{prefill[0]:+.3f}%", f"{decode[0]:+.3f}%", f"{prefill[1]:.3f}%",
                               f"{decode[1]:.3f}%"])
        parts = [table]
        if ratios:
            parts.append(markdown_table(["dtype", "mapped/dense − 1, prefill", "mapped/dense − 1, decode",
                                         "standard error, prefill", "standard error, decode"], ratios, "lrrrr"))
        if self.command:
            parts.append(f"Command: `{self.command}`")
        return "\n\n".join(parts)


def run_perplexity(name: str, path: str, text: str | None = None, tokens: int = DEFAULT_TOKENS,
                   weights: Sequence[str] = DEFAULT_WEIGHTS, dtypes: Sequence[str] = DTYPES, progress: bool = True,
                   command: str = "") -> PerplexityReport:
    """Perplexity of the model at `path` on the first `tokens` tokens of `text` (default: default_text())
    for every weights mode × dtype, through prefill and through decode steps."""
    import pagelm
    from pagelm.chat.tokenizer import Tokenizer
    from pagelm.models import hf_layouts
    from pagelm.weights.loader import open_checkpoint

    for mode in weights:
        if mode not in WEIGHTS:
            raise PagelmError(f"weights mode must be one of {', '.join(WEIGHTS)}, got {mode!r}")
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise PagelmError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if tokens < 2:
        raise PagelmError(f"--tokens must be at least 2 (one prediction), got {tokens}")
    with open_checkpoint(path, hf_layouts) as file:
        tokenizer = Tokenizer.open(file)
    ids = text_tokens(tokenizer, default_text() if text is None else text, tokens)
    if len(ids) < 2:
        raise PagelmError(f"the text gives {len(ids)} token(s); perplexity needs at least 2")
    rows = []
    for mode in weights:
        for dtype in dtypes:
            if progress:
                print(f"pagelm bench perplexity: {name}, weights {mode}, {dtype}, {len(ids)} tokens",
                      file=sys.stderr, flush=True)
            model = pagelm.load(path, weights=mode, dtype=dtype)
            via_prefill = prefill_nll(model, ids, progress)
            via_decode = decode_nll(model, ids, progress)
            rows.append(PerplexityRow(mode, dtype, via_prefill, via_decode))
            del model
            gc.collect()
    return PerplexityReport(name, rows, command)


__all__ = ["DEFAULT_TOKENS", "PerplexityReport", "PerplexityRow", "decode_nll", "default_text", "paired_ratio",
           "prefill_nll", "run_perplexity", "text_tokens"]
