"""Benchmark: the real models from the package index, pagelm (dense and mapped) vs llama.cpp.

SmolLM2-135M-Instruct and Gemma 3 270M (both with a tied Q8_0 embedding), one fresh process per
configuration and run, interleaved: prompt tok/s, decode tok/s, anonymous memory after the
request, peak RSS; the same worker code as bench/generate.py.

    python bench/real_models.py [--runs 3] [--prompt-tokens 512]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from generate import main  # noqa: E402

if __name__ == "__main__":
    main(__doc__, default_shapes=(), default_models=("smollm2-135m", "gemma3-270m"), prompt_tokens=512)
