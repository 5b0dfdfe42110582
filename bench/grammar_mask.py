"""Grammar libraries compared on one JSON schema over a model's vocabulary: the time to build the
library's tokenizer from pagelm's, to compile the schema, and to compute the token mask at every
step of a valid answer (median and p95), each into the library's own preallocated bitmask.

    .venv/bin/python bench/grammar_mask.py [MODEL.gguf] [--passes N]

MODEL defaults to bench/models/qwen3.5-0.8b-q8_0.gguf (any Qwen3.5 file has the same 248,320-token
vocabulary; `pagelm synth --shape qwen3.5-tiny-chat OUT.gguf` writes a small one). A library that is
not importable is listed as missing: pagelm depends only on llguidance; the others can be put
beside it without touching the environment's torch, e.g.
`pip install --target /tmp/gramlibs --no-deps outlines-core==0.2.14 xgrammar==0.2.8 apache-tvm-ffi`
and `PYTHONPATH=/tmp/gramlibs`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from pagelm.chat.tokenizer import Tokenizer
from pagelm.formats.gguf import GGUFFile
from pagelm.chat.grammar import JSON_OPTIONS, token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "score", "status", "tags", "address"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "score": 0.875, "status": "active",
          "tags": ["mathematics", "analytical engine", "poetry"],
          "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"}}


def _walk(ids: list[int], stop: int, fill, allowed, advance) -> list[float]:
    """Seconds of `fill()` before each token of the answer and before the stop token; checks
    that the mask allows each token."""
    times = []
    for token in ids + [stop]:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        if not allowed(token):
            raise AssertionError(f"the mask forbids token {token} of a valid answer")
        if token != stop:
            advance(token)
    return times


def _bit(bits: np.ndarray):
    return lambda token: bool((int(bits[token // 32]) >> (token % 32)) & 1)


def llguidance_run(tokenizer: Tokenizer, ids: list[int], passes: int) -> dict:
    import llguidance

    from pagelm.chat.grammar import ll_tokenizer

    start = time.perf_counter()
    lltok = ll_tokenizer(tokenizer)
    built = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS)
    compiled = llguidance.LLMatcher(lltok, grammar, log_level=0)
    compile_s = time.perf_counter() - start
    assert not compiled.is_error(), compiled.get_error()
    bits = np.zeros((lltok.vocab_size + 31) // 32, np.int32)
    times = []
    for _ in range(passes):
        m = compiled.deep_copy()
        times += _walk(ids, tokenizer.eos_ids[0], lambda: m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes),
                       _bit(bits), m.consume_token)
    return {"version": llguidance.__version__, "tokenizer_s": built, "compile_s": compile_s, "times": times}


def outlines_run(tokenizer: Tokenizer, ids: list[int], passes: int) -> dict:
    from importlib.metadata import version

    import outlines_core

    start = time.perf_counter()
    by_bytes: dict[bytes, list[int]] = {}
    eos = tokenizer.eos_ids[0]
    for i, raw in enumerate(token_bytes(tokenizer)):
        if not tokenizer.is_special(i):
            by_bytes.setdefault(raw, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    built = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - start
    bits = np.zeros((tokenizer.vocab_size + 31) // 32, np.int32)
    times = []
    for _ in range(passes):
        guide = outlines_core.Guide(index)
        times += _walk(ids, eos, lambda: guide.write_mask_into(bits.ctypes.data, bits.size, 4), _bit(bits),
                       lambda t: guide.advance(t, return_tokens=False))
    return {"version": version("outlines-core"), "tokenizer_s": built, "compile_s": compile_s, "times": times}


def xgrammar_run(tokenizer: Tokenizer, ids: list[int], passes: int) -> dict:
    from importlib.metadata import version

    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(token_bytes(tokenizer), xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                                  stop_token_ids=list(tokenizer.eos_ids))
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    built = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)
    bits = bitmask[0].numpy()  # shares the tensor's memory
    times = []
    for _ in range(passes):
        matcher = xgrammar.GrammarMatcher(compiled)
        times += _walk(ids, tokenizer.eos_ids[0], lambda: matcher.fill_next_token_bitmask(bitmask), _bit(bits),
                       matcher.accept_token)
    return {"version": version("xgrammar"), "tokenizer_s": built, "compile_s": compile_s, "times": times}


LIBRARIES = {"llguidance": llguidance_run, "outlines-core": outlines_run, "xgrammar": xgrammar_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="bench/models/qwen3.5-0.8b-q8_0.gguf")
    parser.add_argument("--passes", type=int, default=5, help="walks of the answer per library (default 5)")
    args = parser.parse_args()
    with GGUFFile.open(args.model) as file:
        tokenizer = Tokenizer.from_gguf(file)
    text = json.dumps(ANSWER, separators=(",", ":"))
    ids = tokenizer.encode(text)
    print(f"{Path(args.model).name}: vocab {tokenizer.vocab_size}; answer {len(text)} bytes, {len(ids)} tokens "
          f"+ stop, {args.passes} passes")
    print(f"{'library':<14} {'version':<9} {'tokenizer s':>11} {'compile s':>10} {'mask median µs':>15} "
          f"{'mask p95 µs':>12} {'mask max µs':>12}")
    for name, run in LIBRARIES.items():
        try:
            r = run(tokenizer, ids, args.passes)
        except ImportError as e:
            print(f"{name:<14} not installed ({e})")
            continue
        us = sorted(t * 1e6 for t in r["times"])
        p95 = us[min(len(us) - 1, int(0.95 * len(us)))]
        print(f"{name:<14} {r['version']:<9} {r['tokenizer_s']:>11.2f} {r['compile_s']:>10.3f} "
              f"{statistics.median(us):>15.1f} {p95:>12.1f} {us[-1]:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
