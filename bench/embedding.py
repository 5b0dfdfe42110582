"""Benchmark: token embedding memory and speed, dense (unpack all) vs mapped (rows on demand).

For each shape, one fresh process per mode: load pagelm's compiled kernels, open the file (the
"empty" baseline), load the embedding, prefetch + look up a 2,600-token prompt, then 256
single-token lookups. Prints one markdown table.

    python bench/embedding.py [--shapes qwen3.5-0.8b ...] [--models-dir bench/models]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = ["qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b"]
MODES = ["dense", "mapped"]
MIB = 1024 * 1024


def worker(model_path: str, mode: str, prompt_tokens: int, single_lookups: int) -> dict:
    import numpy as np

    from pagelm.formats.gguf import GGUFFile
    from pagelm.measure.memory import read_memory
    from pagelm.quant import head
    from pagelm.weights import load_token_embedding

    head.warmup()  # compiled code is the runtime's, not the table's: load it before the baseline
    model = GGUFFile.open(model_path)
    vocab = model.tensors["token_embd.weight"].shape[0]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, prompt_tokens)
    singles = rng.integers(0, vocab, single_lookups).tolist()
    empty = read_memory()

    start = time.perf_counter()
    embedding = load_token_embedding(model, mode)
    load_s = time.perf_counter() - start

    start = time.perf_counter()
    embedding.prefetch(prompt)
    rows = embedding.lookup(prompt)
    prompt_s = time.perf_counter() - start
    del rows  # consumed by prefill in a real run; activations are not the table's cost

    start = time.perf_counter()
    for token in singles:
        embedding.lookup([token])
    single_s = time.perf_counter() - start

    after = read_memory()
    return {
        "mode": mode,
        "anon_empty_mib": empty.anonymous / MIB,
        "anon_after_mib": after.anonymous / MIB,
        "added_mib": (after.anonymous - empty.anonymous) / MIB,
        "peak_rss_mib": after.peak_rss / MIB,
        "file_rss_mib": after.file_rss / MIB,
        "load_ms": load_s * 1e3,
        "prompt_us_per_row": prompt_s * 1e6 / prompt_tokens,
        "single_us_per_row": single_s * 1e6 / single_lookups,
        "table_bf16_mib": vocab * embedding.dim * 2 / MIB,
    }


def ensure_model(shape: str, models_dir: str) -> str:
    path = os.path.join(models_dir, f"{shape}-embedding.gguf")
    if not os.path.exists(path):
        os.makedirs(models_dir, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", shape, "--embedding-only",
                        "--quiet", path], check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, choices=SHAPES)
    parser.add_argument("--models-dir", default=os.path.join(os.path.dirname(__file__), "models"))
    parser.add_argument("--prompt-tokens", type=int, default=2600)
    parser.add_argument("--single-lookups", type=int, default=256)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.prompt_tokens, args.single_lookups)))
        return

    print("| shape | mode | bf16 table MiB | anon empty MiB | anon after MiB | added MiB "
          "| peak RSS MiB | load ms | prompt µs/row | single µs/row |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        path = ensure_model(shape, args.models_dir)
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", path, mode, "--prompt-tokens", str(args.prompt_tokens),
                 "--single-lookups", str(args.single_lookups)],
                check=True, capture_output=True, text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"| {shape} | {mode} | {r['table_bf16_mib']:.0f} | {r['anon_empty_mib']:.1f} "
                  f"| {r['anon_after_mib']:.1f} | {r['added_mib']:.1f} | {r['peak_rss_mib']:.0f} "
                  f"| {r['load_ms']:.1f} | {r['prompt_us_per_row']:.2f} | {r['single_us_per_row']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
