"""Benchmark: generation on a synthetic Qwen3.5 model, pagelm's embedding and weights modes (and llama.cpp).

One fresh process per configuration: load, a 2,600-token prompt (TTFT), 128 greedy decode steps,
then memory. pagelm runs as embedding/weights dense/dense (everything unpacked), mapped/dense
(the embedding mapped) and mapped/mapped (the default: every matrix computed from the file).
Each configuration runs --runs times; the table shows medians. "load adds" is the anonymous
memory loading the model added (kernels already compiled); the decode breakdown splits a decode
step into the layer matmuls, the output head and the rest. Also the output-head GEMV alone:
pagelm's kernel over the mapped table vs torch.mv over an unpacked bf16 copy.

    python bench/generate.py [--shapes qwen3.5-0.8b] [--mix q4_k_m] [--runs 3] [--dtype bfloat16]

Models are written by `pagelm synth --shape S` into --models-dir when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1024 * 1024


def _prompt(vocab: int, n: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, min(vocab, 248_044), n).tolist()


PAGELM_MODES = ("dense/dense", "mapped/dense", "mapped/mapped")  # embedding/weights
OPT_IN_MODES = ("mapped/mapped-int8",)  # run only when asked for


def pagelm_worker(path: str, mode: str, dtype: str, prompt_tokens: int, new_tokens: int) -> dict:
    import pagelm
    from pagelm.measure.memory import read_memory
    from pagelm.bench.batch import timed
    from pagelm.quant import head, matmul
    from pagelm.engine.sampling import SamplingParams
    from pagelm.weights import linear

    head.warmup()
    matmul.warmup()
    before = read_memory().anonymous
    embedding, weights = mode.split("/")
    start = time.perf_counter()
    model = pagelm.load(path, embedding=embedding, weights=weights, dtype=dtype, threads=2)
    load_s = time.perf_counter() - start
    load_mib = (read_memory().anonymous - before) / MIB
    matmul_s, head_s = [0.0], [0.0]
    for cls in (linear.DenseLinear, linear.MappedLinear):
        cls.__call__ = timed(cls.__call__, matmul_s)
    model.head.logits = timed(model.head.logits, head_s)
    session = model.session(max_len=prompt_tokens + new_tokens + 8)
    prompt = _prompt(model.embedding.vocab_size, prompt_tokens)
    params = SamplingParams(max_tokens=new_tokens)
    start = time.perf_counter()
    stream = session.generate(prompt, params)
    tokens = [next(stream)]
    ttft = time.perf_counter() - start
    matmul_s[0] = head_s[0] = 0.0
    start = time.perf_counter()
    tokens.extend(stream)
    decode_s = time.perf_counter() - start
    memory = read_memory()
    steps = len(tokens) - 1
    return {"load_s": load_s, "ttft_s": ttft, "decode_tok_s": steps / decode_s, "load_mib": load_mib,
            "anon_mib": memory.anonymous / MIB, "peak_rss_mib": memory.peak_rss / MIB, "tokens": tokens,
            "matmul_ms": 1e3 * matmul_s[0] / steps, "head_ms": 1e3 * head_s[0] / steps,
            "rest_ms": 1e3 * (decode_s - matmul_s[0] - head_s[0]) / steps}


def llama_cpp_worker(path: str, prompt_tokens: int, new_tokens: int) -> dict:
    import llama_cpp
    import numpy as np

    from pagelm.formats.gguf import GGUFFile
    from pagelm.measure.memory import read_memory

    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def without_amx():  # peers.md: the AMX matmul path crashes on these machines
        params = defaults()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = without_amx
    llama_cpp.llama_model_default_params = without_amx
    with GGUFFile.open(path) as f:
        vocab = f.tensors["token_embd.weight"].shape[0]
    start = time.perf_counter()
    llm = llama_cpp.Llama(path, n_ctx=prompt_tokens + new_tokens + 8, n_threads=2, n_threads_batch=2,
                          n_batch=512, verbose=False)
    load_s = time.perf_counter() - start
    prompt = _prompt(vocab, prompt_tokens)
    start = time.perf_counter()
    n_vocab = llm.n_vocab()

    def last_logits():  # llama-cpp-python keeps no logits itself unless logits_all
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    llm.eval(prompt)
    token = int(last_logits().argmax())
    ttft = time.perf_counter() - start
    tokens = [token]
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval([token])
        token = int(last_logits().argmax())
        tokens.append(token)
    decode_s = time.perf_counter() - start
    memory = read_memory()
    return {"load_s": load_s, "ttft_s": ttft, "decode_tok_s": (new_tokens - 1) / decode_s,
            "anon_mib": memory.anonymous / MIB, "peak_rss_mib": memory.peak_rss / MIB, "tokens": tokens}


def head_worker(path: str, repeats: int = 30) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(2)
    from pagelm.formats.gguf import GGUFFile
    from pagelm.quant import decode_bf16
    from pagelm.weights import load_output_head

    model = GGUFFile.open(path)
    head = load_output_head(model)
    x = np.random.default_rng(1).standard_normal(head.dim).astype(np.float32)
    table = torch.empty((head.vocab_size, head.dim), dtype=torch.bfloat16)
    for lo in range(0, head.vocab_size, 4096):
        rows = decode_bf16(head.tensor.raw[lo : lo + 4096], head.tensor.ggml_type)
        table[lo : lo + rows.shape[0]] = torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    xt = torch.from_numpy(x).to(torch.bfloat16)

    def median_ms(fn):
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    out = np.empty(head.vocab_size, np.float32)
    mapped_ms = median_ms(lambda: head.logits(x, out))
    torch_ms = median_ms(lambda: torch.mv(table, xt))
    return {"type": head.tensor.ggml_type.name, "vocab": head.vocab_size, "dim": head.dim,
            "mapped_ms": mapped_ms, "torch_bf16_ms": torch_ms, "ratio": mapped_ms / torch_ms}


def _run_worker(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def ensure_model(shape: str, models_dir: str, mix: str | None = None) -> str:
    kind = ["--mix", mix] if mix else ["--layer-type", "Q8_0"]
    path = os.path.join(models_dir, f"{shape}-{mix or 'q8_0'}.gguf")
    if not os.path.exists(path):
        os.makedirs(models_dir, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pagelm", "synth", "--shape", shape, *kind, path], check=True)
    return path


def main(doc: str = __doc__, default_shapes=("qwen3.5-0.8b",), default_models=(), prompt_tokens: int = 2600) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=list(default_shapes), help="synthetic shapes (pagelm synth)")
    parser.add_argument("--mix", help="write the synthetic shapes with `pagelm synth --mix MIX` (default: all Q8_0)")
    parser.add_argument("--models", nargs="*", default=list(default_models),
                        help="store names (pulled when missing) or .gguf paths")
    parser.add_argument("--models-dir", default=os.path.join(os.path.dirname(__file__), "models"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", nargs="*", default=list(PAGELM_MODES), choices=PAGELM_MODES + OPT_IN_MODES,
                        help="pagelm's embedding/weights modes to run (default: the first three)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when installed")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, path, *rest = args.worker
        if kind == "pagelm":
            result = pagelm_worker(path, rest[0], args.dtype, args.prompt_tokens, args.new_tokens)
        elif kind == "llama.cpp":
            result = llama_cpp_worker(path, args.prompt_tokens, args.new_tokens)
        else:
            result = head_worker(path)
        print(json.dumps(result))
        return

    try:
        import llama_cpp  # noqa: F401

        have_llama_cpp = not args.no_llama_cpp
    except ImportError:
        have_llama_cpp = False
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} greedy new tokens, 2 threads, "
          f"pagelm dtype {args.dtype}, median of {args.runs} fresh processes\n")
    print("| model | runtime | embedding/weights | load s | load adds MiB | TTFT s | prompt tok/s | decode tok/s "
          "| decode ms/token: matmuls + head + rest | anon MiB after | peak RSS MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
    from pagelm.sources import store

    targets = [(f"{shape}{' ' + args.mix if args.mix else ''}", ensure_model(shape, args.models_dir, args.mix))
               for shape in args.shapes]
    targets += [(name, str(store.pull(name))) for name in args.models]
    head_rows, notes = [], []
    for shape, path in targets:
        configs = [("pagelm", mode) for mode in args.modes] + ([("llama.cpp", "-")] if have_llama_cpp else [])
        runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
        for _ in range(args.runs):  # interleaved, so drift in the machine's load hits every configuration alike
            for runtime, mode in configs:
                runs[(runtime, mode)].append(_run_worker(
                    runtime, path, *([mode] if runtime == "pagelm" else []), "--dtype", args.dtype,
                    "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)))
        med = {c: {k: statistics.median(r[k] for r in results) for k in results[0] if k != "tokens"}
               for c, results in runs.items()}
        for (runtime, mode), m in med.items():
            pagelm_only = runtime == "pagelm"
            breakdown = (f"{m['matmul_ms']:.1f} + {m['head_ms']:.1f} + {m['rest_ms']:.1f}" if pagelm_only else "-")
            load = f"{m['load_mib']:.0f}" if pagelm_only else "-"
            print(f"| {shape} | {runtime} | {mode} | {m['load_s']:.1f} | {load} | {m['ttft_s']:.2f} "
                  f"| {args.prompt_tokens / m['ttft_s']:.0f} | {m['decode_tok_s']:.1f} | {breakdown} "
                  f"| {m['anon_mib']:.0f} | {m['peak_rss_mib']:.0f} |", flush=True)
        tokens = {c: r[0]["tokens"] for c, r in runs.items()}
        if ("pagelm", "mapped/dense") in med and ("pagelm", "mapped/mapped") in med:
            dense, mapped = med[("pagelm", "mapped/dense")], med[("pagelm", "mapped/mapped")]
            ttfts = {mode: [round(r["ttft_s"], 2) for r in runs[("pagelm", mode)]] for mode in args.modes}
            notes.append(f"{shape}: weights mapped/dense (embedding mapped): TTFT {mapped['ttft_s'] / dense['ttft_s']:.3f}, "
                         f"decode {mapped['decode_tok_s'] / dense['decode_tok_s']:.3f}, anonymous memory after the "
                         f"request {dense['anon_mib'] - mapped['anon_mib']:.0f} MiB lower; TTFT per run {ttfts}")
            same = sum(a == b for a, b in zip(tokens[("pagelm", "mapped/dense")], tokens[("pagelm", "mapped/mapped")]))
            notes.append(f"{shape}: weights dense and mapped agree on {same} of {args.new_tokens} greedy tokens")
        if have_llama_cpp and ("pagelm", "mapped/mapped") in med:
            ours, theirs = med[("pagelm", "mapped/mapped")], med[("llama.cpp", "-")]
            agree = sum(a == b for a, b in zip(tokens[("pagelm", "mapped/mapped")], tokens[("llama.cpp", "-")]))
            notes.append(f"{shape}: pagelm (all mapped) / llama.cpp: decode {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x, "
                         f"TTFT {ours['ttft_s'] / theirs['ttft_s']:.2f}x, anonymous memory after {ours['anon_mib']:.0f} "
                         f"vs {theirs['anon_mib']:.0f} MiB; greedy tokens agree on {agree} of {args.new_tokens}")
        if ("pagelm", "mapped/mapped-int8") in med and ("pagelm", "mapped/mapped") in med:
            exact, int8 = med[("pagelm", "mapped/mapped")], med[("pagelm", "mapped/mapped-int8")]
            same = sum(a == b for a, b in zip(tokens[("pagelm", "mapped/mapped")], tokens[("pagelm", "mapped/mapped-int8")]))
            vs = (f", {int8['decode_tok_s'] / med[('llama.cpp', '-')]['decode_tok_s']:.2f}x llama.cpp's"
                  if have_llama_cpp else "")
            notes.append(f"{shape}: weights mapped-int8 (opt-in): decode {int8['decode_tok_s'] / exact['decode_tok_s']:.2f}x "
                         f"mapped's{vs}; greedy tokens agree with mapped's on {same} of {args.new_tokens}")
        head_rows.append((shape, _run_worker("head", path)))
    print()
    for note in notes:
        print(f"- {note}")
    print("\n| model | head table | pagelm mapped head ms | torch.mv bf16 ms | ratio |")
    print("|---|---|---:|---:|---:|")
    for shape, h in head_rows:
        print(f"| {shape} | {h['type']} {h['vocab']} × {h['dim']} | {h['mapped_ms']:.1f} | {h['torch_bf16_ms']:.1f} "
              f"| {h['ratio']:.2f} |")


if __name__ == "__main__":
    main()
