"""What the benchmarks feed a model: model files (synthesised or pulled when missing) and
seeded prompt text of a given token length.

Owns names → paths and prompt text; it never starts servers or measures anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from pagelm.errors import PagelmError

DEFAULT_MODELS_DIR = "bench/models"
MIB = 1024 * 1024
# pseudo-word syllables: seeded words of these give many distinct tokens in any tokenizer
_SYLLABLES = ("ka", "lo", "mi", "te", "ru", "sa", "no", "vi", "pe", "da", "zu", "ri", "mo", "be", "fa",
              "shi", "tor", "gan", "lem", "wex", "qua", "ine", "ost", "ure", "pra", "sel", "dor", "ith")


def synthetic_shapes() -> list[str]:
    from pagelm.tools.synth import SHAPES

    return [name for name, shape in SHAPES.items() if shape.full]


def _synth(name: str, path: str, *flags: str) -> None:
    """`pagelm synth --shape NAME [FLAGS] PATH`, unless PATH exists."""
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    command = ["synth", "--shape", name, *flags, path]
    print(f"pagelm bench: writing {path} (pagelm {' '.join(command)})", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pagelm", *command], check=True, stdout=sys.stderr)


def model_path(name: str, models_dir: str = DEFAULT_MODELS_DIR) -> str:
    """A .gguf path for a synthetic shape (written to MODELS_DIR/SHAPE-q8_0.gguf with `pagelm synth`
    when missing), a store or Hub name (pulled when missing) or an existing .gguf path."""
    from pagelm.sources import store

    if name in synthetic_shapes():
        path = os.path.join(models_dir, f"{name}-q8_0.gguf")
        _synth(name, path)
        return path
    if name in store.KNOWN_MODELS:
        return str(store.pull(name))
    if store.hub_name(name) is not None:
        return str(store.resolve(name))
    if store.is_model_path(Path(name)):
        return name
    raise PagelmError(f"model '{name}': not a synthetic shape ({', '.join(synthetic_shapes())}), "
                      f"a known model ({', '.join(store.KNOWN_MODELS)}), a Hub model (hf.co/USER/REPO[:QUANT]), "
                      f"a .gguf file or a model directory")


def tower_path(name: str, models_dir: str = DEFAULT_MODELS_DIR) -> str | None:
    """The vision tower of a synthetic Qwen3.5 shape (written to MODELS_DIR/SHAPE-tower.gguf with
    `pagelm synth --mmproj` when missing), for the benchmarks that send images; None for any other
    model. Not named mmproj*.gguf, so the other benchmarks' servers do not find it beside the models."""
    from pagelm.tools.synth_tower import SHAPES as TOWERS

    if name not in TOWERS or name not in synthetic_shapes():
        return None
    path = os.path.join(models_dir, f"{name}-tower.gguf")
    _synth(name, path, "--mmproj")
    return path


def display_name(name: str) -> str:
    return Path(name).stem if name.endswith(".gguf") else Path(name).name


def embedding_table_mib(path: str) -> float:
    """Size of the token embedding unpacked to bf16 (vocab × dim × 2 bytes): what dense adds."""
    from pagelm.models import hf_layouts
    from pagelm.weights import TOKEN_EMBEDDING, table_tensor
    from pagelm.weights.loader import open_checkpoint

    with open_checkpoint(path, hf_layouts) as model:
        table = table_tensor(model, TOKEN_EMBEDDING)
        return table.rows * table.row_values * 2 / MIB


@lru_cache(maxsize=8)
def _tokenizer(path: str):
    from pagelm.chat.tokenizer import Tokenizer
    from pagelm.models import hf_layouts
    from pagelm.weights.loader import open_checkpoint

    return Tokenizer.open(open_checkpoint(path, hf_layouts))


def text_of_tokens(path: str, n_tokens: int, seed: int = 0) -> str:
    """Seeded pseudo-word sentences that the model's tokenizer encodes to about `n_tokens` tokens
    (the chat template adds its own few)."""
    tokenizer = _tokenizer(path)
    rng = np.random.default_rng(seed)
    words: list[str] = []
    while True:
        for _ in range(max(64, n_tokens // 2)):
            word = "".join(rng.choice(_SYLLABLES, rng.integers(1, 4)))
            words.append(word.capitalize() + "." if rng.random() < 0.08 else word)
        ids = tokenizer.encode(" ".join(words))
        if len(ids) >= n_tokens:
            break
    text = tokenizer.decode(ids[:n_tokens])
    return text.strip()
