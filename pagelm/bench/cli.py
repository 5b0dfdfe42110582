"""The `pagelm bench` command: its arguments and what each subcommand prints; the
measurements live in the sibling modules. Tables go to stdout, progress to stderr."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from datetime import datetime, timezone

from pagelm.bench.inputs import DEFAULT_MODELS_DIR, model_path, tower_path
from pagelm.errors import PagelmError

SCENARIO_MODELS = ("qwen3.5-tiny-chat", "smollm2-135m")
BATCH_MODELS = ("smollm2-135m", "gemma3-270m", "qwen3.5-0.8b")
BATCH_SIZES = (1, 4, 8)
VISION_SHAPES = ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b")
DEFAULT_RUNS = 3
RESULTS = "results.md"
CHARTS = {"memory": "bench-memory.png", "pressure": "bench-pressure.png", "shared": "bench-shared.png"}


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise PagelmError(f"{flag} must be at least 1, got {value}")


def _scenarios(args: argparse.Namespace) -> int:
    """Start one `pagelm serve` per configuration (embedding dense or mapped, prefix cache on or off) and run
    11 fixed, seeded scenarios: thinking on, thinking off, a 2,600-token prompt, a 4-turn conversation, a
    new chat with the same system prompt, an image and the same image again (skipped, with the server's
    reason, while there is no vision), a stream cancelled by id then a normal request, the Ollama route
    streamed, seeded sampling, a raw completion. Content, reasoning, token counts and finish reasons are
    compared across all configurations; prefix-cache lookups/hits only among those with the same cache
    setting. Prints a table per scenario and 'differing scenarios: D of S in N runs'; exit 1 if D > 0."""
    from pagelm.bench.scenarios import run_scenarios

    _positive("--runs", args.runs)
    report = run_scenarios(args.model, model_path(args.model, args.models_dir), args.runs, args.weights,
                           mmproj=args.mmproj or tower_path(args.model, args.models_dir))
    print(report.markdown())
    return 1 if report.differing else 0


def _memory_report(args: argparse.Namespace, models: list[str]):
    from pagelm.bench.memory import run_memory

    for flag in ("runs", "prompt_tokens", "new_tokens"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    paths = [(name, model_path(name, args.models_dir)) for name in models]
    return run_memory(paths, args.runs, args.prompt_tokens, args.new_tokens, getattr(args, "mmproj", None))


def _memory(args: argparse.Namespace) -> int:
    """For each model, one fresh `pagelm serve` per mode and run (modes interleaved): all dense (--embedding
    dense --weights dense), embedding mapped (--weights dense), all mapped (the defaults). A short chat,
    then anonymous memory and its parts (prefix cache, weights, tokenizer, state, runtime), file-backed
    RSS; then a long prompt for TTFT and decode tok/s; peak RSS. Prints a markdown table of medians and,
    per model, what mapping the embedding and then the layers saves."""
    report = _memory_report(args, args.models)
    print(report.markdown())
    if args.png:
        print(f"chart: {report.chart(args.png)}")
    return 0


def _pressure(args: argparse.Namespace) -> int:
    """In process, mapped embedding: TTFT of a prompt of many distinct tokens with the page cache warm, and
    after evicting the model file (MADV_DONTNEED on its map, then posix_fadvise DONTNEED), each with the
    prefetch hint on and off. Prints the cold penalty and what the hint saves."""
    from pagelm.bench.pressure import run_pressure

    _positive("--runs", args.runs)
    _positive("--prompt-tokens", args.prompt_tokens)
    report = run_pressure(args.model, model_path(args.model, args.models_dir), args.runs, args.prompt_tokens,
                          args.weights)
    print(report.markdown())
    if args.png:
        print(f"chart: {report.chart(args.png)}")
    return 0


def _shared(args: argparse.Namespace) -> int:
    """Start two `pagelm serve` processes on the same file (both alive, one chat each) and read the second
    one's anonymous memory, PSS and file-backed RSS from /proc: mapped pages are shared between the
    processes, unpacked tables are not."""
    from pagelm.bench.shared import run_shared

    _positive("--runs", args.runs)
    report = run_shared(args.model, model_path(args.model, args.models_dir), args.runs, args.mmproj)
    print(report.markdown())
    if args.png:
        print(f"chart: {report.chart(args.png)}")
    return 0


def _image_sizes(value: str | None) -> tuple[tuple[str, int, int], ...]:
    """--sizes WxH,…: those images; without it the standard four."""
    from pagelm.bench.vision import SIZES

    if value is None:
        return SIZES
    sizes = []
    for item in (v.strip() for v in value.split(",")):
        width, _, height = item.lower().partition("x")
        if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise PagelmError(f"--sizes takes a comma-separated list of WIDTHxHEIGHT, got {item!r}")
        sizes.append((f"{int(width)}×{int(height)}", int(width), int(height)))
    return tuple(dict.fromkeys(sizes))


def _vision(args: argparse.Namespace) -> int:
    """For each synthetic Qwen3.5 shape (its model and a random vision tower of the real geometry, written
    with `pagelm synth` when missing), one `pagelm serve --mmproj`: a warm-up image, then seeded
    photograph-like JPEGs of 640×480, 1080×720, 1920×1080 and 4032×3024 (resized to the 1,024-token cap),
    each sent as it is, again, and with a new question. Prints per geometry and size the image's prompt
    tokens, the tower's seconds, TTFT, TTFT of the same request again and with the new question, the peak
    anonymous memory the request added (and per megapixel) and what stays after it."""
    from pagelm.bench.vision import run_vision

    _positive("--runs", args.runs)
    _positive("--image-cache-mib", args.image_cache_mib)
    models = []
    for name in args.models:
        tower = tower_path(name, args.models_dir)
        if tower is None:
            raise PagelmError(f"model '{name}': bench vision takes a synthetic Qwen3.5 shape with a vision tower "
                              f"({', '.join(VISION_SHAPES)})")
        models.append((name, model_path(name, args.models_dir), tower))
    report = run_vision(models, args.runs, args.image_cache_mib, _image_sizes(args.sizes))
    print(report.markdown())
    if args.png:
        print(f"chart: {report.chart(args.png)}")
    return 0


def _list_of(flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        raise PagelmError(f"{flag} takes a comma-separated list of {', '.join(allowed)}, got {value!r}")
    return list(dict.fromkeys(items))


def _perplexity(args: argparse.Namespace) -> int:
    """Tokenize the text with the model's tokenizer (its BOS first when it adds one), take the first --tokens
    tokens, and for each weights mode × dtype load the model in process and compute the perplexity twice:
    through one prefill over the whole text (the head on every position) and teacher-forced through decode
    steps. Prints a markdown table, per dtype the ratio mapped/dense − 1 in % with its standard error (from
    the per-token differences: a ratio within about two standard errors of 0 is one this text is too short
    to tell from noise; raise --tokens), and the command line. The default text is the English
    documentation bundled with Python (pydoc_data.topics, topics in sorted key order)."""
    from pagelm.bench.perplexity import DTYPES, WEIGHTS, run_perplexity

    _positive("--tokens", args.tokens)
    weights = _list_of("--weights", args.weights, WEIGHTS)
    dtypes = _list_of("--dtype", args.dtype, DTYPES)
    text = None
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    argv = sys.argv[sys.argv.index("perplexity"):] if "perplexity" in sys.argv else ["perplexity", args.model]
    report = run_perplexity(args.model, model_path(args.model, args.models_dir), text, args.tokens, weights, dtypes,
                            command=shlex.join(["pagelm", "bench", *argv]))
    print(report.markdown())
    return 0


def _sizes(value: str) -> list[int]:
    from pagelm.engine.batch import MAX_BATCH

    try:
        sizes = [int(part) for part in value.split(",")]
    except ValueError:
        raise PagelmError(f"--sizes must be comma-separated batch sizes, got {value!r}") from None
    if not sizes or any(not 1 <= n <= MAX_BATCH for n in sizes) or len(set(sizes)) != len(sizes):
        raise PagelmError(f"--sizes must be distinct batch sizes from 1 to {MAX_BATCH}, got {value!r}")
    return sorted(sizes)


def _batch(args: argparse.Namespace) -> int:
    """In process, weights mapped: for each batch size N, N sessions with their own seeded prompts (of
    different lengths) decode --tokens greedy steps together, one decode_batch call a step. Prints per size
    the aggregate and per-sequence tokens per second, ms per step split into matmuls + head + rest (llama's
    one-token layers run as compiled calls: the matmuls are those calls, with their norms, rope and
    attention), the matmuls' and head's GFLOP/s as a share of this machine's float32 FMA peak (measured in
    the same run on FMA chains in registers), and the ratio to batch size 1 (medians of --runs runs, sizes
    interleaved), then one line 'batch N: R× batch 1' per size. The first run's sequences are decoded again
    alone and every step's logits compared bit for bit: the last line is 'differing sequences: D of S';
    exit 1 if D > 0. With llama_cpp installed, llama.cpp decodes the same sequences of the same file, N per
    llama_batch, right after pagelm's turn at each size and run."""
    from pagelm.bench.batch import run_batch

    sizes = _sizes(args.sizes)
    _positive("--tokens", args.tokens)
    _positive("--runs", args.runs)
    report = run_batch(args.model, model_path(args.model, args.models_dir), sizes, args.tokens, args.runs,
                       args.threads)
    print(report.markdown())
    if args.png:
        print(f"chart: {report.chart(args.png)}")
    return 1 if report.differing else 0


def _speculate(args: argparse.Namespace) -> int:
    """In process, weights mapped: built-in tasks made of texts that ship with Python: edit (a ~100-line
    function with one name changed, also with the original given as a prediction), extract (fields of a
    docstring as JSON), summarize (with quotes), chat (a free answer). For each, greedy and seeded
    (temperature 0.7) decoding of --tokens tokens, plain then speculative (prompt lookup, or --draft
    MODEL's greedy tokens, or with --mtp the file's multi-token-prediction layer's; a prediction where given), --runs times from the same prefilled prompt; and
    each task's plain greedy answer given back as its own prediction ('TASK + its answer': every draft
    right, what a verify pass and its rollback cost against plain steps). Prints per task the medians of plain and
    speculative decode tokens per second and of tokens per verify pass, one line 'TASK: R× plain' each,
    then 'differing answers: D of S' comparing every speculative answer with its plain one; exit 1 if D > 0.
    With a `llama-server` binary on PATH, llama.cpp's greedy decode tokens per second on the same file and
    prompt tokens, plain and speculating (its n-gram drafts, `--spec-type ngram-simple`, or with --draft the same
    draft model, `--spec-type draft-simple -md MODEL`), each server in turn, pagelm's speculative tokens per second
    over llama.cpp's, and how many of llama.cpp's speculative answers differ from its plain ones. With --parallel
    N: `pagelm serve --parallel N` with --speculate off, then auto, N clients at once each asking for the edit
    (a different new name each), --runs times: aggregate tokens per second of each, the extra anonymous memory
    per speculating sequence (the most seen with every slot busy), and 'served answers differing with
    speculation: D of S' (counted in the exit status too)."""
    from pagelm.bench.speculate import TASKS, run_speculate

    names = args.tasks.split(",")
    if not names or any(n not in TASKS for n in names) or len(set(names)) != len(names):
        raise PagelmError(f"--tasks must be distinct names among {','.join(TASKS)}, got {args.tasks!r}")
    _positive("--tokens", args.tokens)
    _positive("--runs", args.runs)
    if args.parallel and not 2 <= args.parallel <= 8:
        raise PagelmError(f"--parallel must be 2 to 8 (clients at once), got {args.parallel}")
    draft = None if args.draft is None else str(model_path(args.draft, args.models_dir))
    path = str(model_path(args.model, args.models_dir))
    report = run_speculate(args.model, path, names, args.tokens, args.runs, draft, args.mtp)
    print(report.markdown())
    differing = report.differing
    if args.parallel:
        from pagelm.bench.served_speculation import run_served
        from pagelm.bench.speculate import tasks

        served = run_served(path, tasks()["edit"].prediction, args.parallel, args.tokens, args.runs)
        print("\n" + "\n".join(served.lines()))
        differing += served.differing
    return 1 if differing else 0


def _peer(args: argparse.Namespace) -> int:
    """One sequence of one file as a user runs it, pagelm and llama.cpp (llama-cpp-python) each in a fresh
    process of its own, in turn, --runs times: each loads the file, warms up on an 8-token prompt, prefills a
    seeded --prompt-tokens prompt into a --ctx-token context, then decodes --tokens greedy tokens. Prints
    per runtime the medians of the time to the first token, decode tokens per second, and the process's
    anonymous and file-backed memory after; then pagelm / llama.cpp for each, how many greedy tokens
    the two agree on, and each one's first answer from its process's start (load, warmup, prompt). With
    --cold, the file is evicted from the page cache before each process (a cold start). llama.cpp's turn
    prints its error when it cannot run (not installed, or the file)."""
    from pagelm.bench.peer import run_peer
    from pagelm.bench.server import progress

    for flag in ("prompt_tokens", "tokens", "runs", "threads"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    ctx = max(args.ctx, args.prompt_tokens + args.tokens)
    report = run_peer(args.model, model_path(args.model, args.models_dir), args.prompt_tokens, args.tokens,
                      ctx, args.runs, args.threads, args.weights, progress, args.cold)
    print(report.markdown())
    return 0


def _embed(args: argparse.Namespace) -> int:
    """In process, weights mapped: --inputs counts of seeded inputs of --tokens pseudo-random token ids
    each, embedded together (Embedder.embed_all: passes of many inputs). Prints per count pagelm's inputs
    and tokens per second (medians of --runs runs, counts interleaved, the first of each count warmed
    once) and, with llama_cpp installed, llama.cpp's embedding mode on the same file and inputs (one
    llama_batch, a sequence per input, pooled as the file says, --threads threads) right after pagelm's
    turn, the ratio, and the lowest cosine between the two runtimes' vectors of an input; then one line
    'inputs N: pagelm P inputs/s[, llama.cpp L inputs/s, R×]' per count. llama.cpp's failure to run
    the file is printed, not fatal."""
    from pagelm.bench.embed import run_embed

    counts = sorted(set(_counts("--inputs", args.inputs)))
    for flag in ("tokens", "runs", "threads"):
        _positive(f"--{flag}", getattr(args, flag))
    report = run_embed(args.model, model_path(args.model, args.models_dir), counts, args.tokens, args.runs,
                       args.threads)
    print(report.markdown())
    return 0


def _counts(flag: str, value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        raise PagelmError(f"{flag} must be comma-separated numbers, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise PagelmError(f"{flag} must be numbers of at least 1, got {value!r}")
    return counts


def _concurrency(args: argparse.Namespace) -> int:
    """Starts `pagelm serve MODEL --parallel P` (P: the most clients, at least 5; prefix cache off) and sends
    --requests seeded prompts of --prompt-tokens LOW,HIGH tokens as greedy streamed /v1/completions of
    --new-tokens tokens, from each number of concurrent clients in turn over loopback. Prints per level:
    aggregate completion tokens per second, its ratio to one client, time to first token and inter-token
    latency p50/p95, mean queue wait and how many answers differ from one client's (the request alone);
    then a 2,600-token prompt is sent while 4 streams decode, and their inter-token p95 before and during
    its prefill is printed, and the anonymous memory of the busiest moment against the idle server (bound:
    busy slots × (slot state + 4 MiB)). Last line: 'differing answers: D of N'; exit 1 if D > 0. With a
    llama-server binary on PATH, the same clients run against `llama-server -np` on the same file."""
    from pagelm.bench.concurrency import run_concurrency

    clients = _counts("--clients", args.clients)
    lengths = _counts("--prompt-tokens", args.prompt_tokens)
    if len(lengths) != 2 or lengths[0] > lengths[1]:
        raise PagelmError(f"--prompt-tokens must be LOW,HIGH with LOW <= HIGH, got {args.prompt_tokens!r}")
    for flag in ("requests", "new_tokens", "threads"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    argv = sys.argv[sys.argv.index("concurrency"):] if "concurrency" in sys.argv else ["concurrency", args.model]
    command = shlex.join(["pagelm", "bench", *argv])
    report = run_concurrency(args.model, model_path(args.model, args.models_dir), command, clients, args.requests,
                             (lengths[0], lengths[1]), args.new_tokens, args.threads, not args.no_long_prompt)
    print(report.markdown())
    if args.png:
        print(f"chart: {report.chart(args.png)}")
    return 1 if report.differing else 0


def _all(args: argparse.Namespace) -> int:
    """Run scenarios, memory, pressure, shared and batched decode (beside llama.cpp when it is installed),
    then replace the block between '<!-- pagelm bench all: begin -->' and '<!-- pagelm bench all: end -->'
    in OUT/results.md (appended if absent; the rest of the file is kept) and write the charts next to it.
    Exit 1 if any scenario or batched sequence differs. With the defaults this takes roughly 40 minutes on
    2 quiet cores, of which the batched decode about 1 (without llama.cpp), plus ~5 minutes to write the
    qwen3.5-4b model the first time; --models, --runs and the other flags size it."""
    from pagelm.bench.batch import run_batch
    from pagelm.bench.memory import run_memory
    from pagelm.bench.pressure import run_pressure
    from pagelm.bench.report import machine_description, replace_generated_block
    from pagelm.bench.scenarios import run_scenarios
    from pagelm.bench.server import progress
    from pagelm.bench.shared import run_shared

    for flag in ("runs", "scenario_runs", "prompt_tokens", "new_tokens", "batch_tokens"):
        _positive(f"--{flag.replace('_', '-')}", getattr(args, flag))
    os.makedirs(args.out, exist_ok=True)
    started, start = datetime.now(timezone.utc), time.perf_counter()
    resolve = lambda name: model_path(name, args.models_dir)  # noqa: E731
    models_dir = [] if args.models_dir == DEFAULT_MODELS_DIR else ["--models-dir", args.models_dir]

    def section(title: str, argv: list[str], body: str, chart: str | None = None, alt: str = "") -> str:
        """One benchmark's part of the block, with the command that reruns it alone."""
        figure = f"\n![{alt}]({os.path.basename(chart)})\n" if chart else ""
        return (f"### {title}\n\nAlone: `{shlex.join(['pagelm', 'bench', *argv, *models_dir])}`\n\n"
                f"{body}{figure}")

    sections, differing = [], 0
    for name in args.scenario_models:
        report = run_scenarios(name, resolve(name), args.scenario_runs, mmproj=tower_path(name, args.models_dir))
        differing += report.differing
        sections.append(section(f"Scenarios: {report.model}", ["scenarios", name, "--runs", str(args.scenario_runs)],
                                report.markdown()))
    sizes = ["--prompt-tokens", str(args.prompt_tokens)]
    if args.models:
        report = run_memory([(name, resolve(name)) for name in args.models], args.runs, args.prompt_tokens,
                            args.new_tokens)
        chart = report.chart(os.path.join(args.out, CHARTS["memory"]))
        sections.append(section("Memory: dense vs mapped, one server each",
                                ["memory", *args.models, "--runs", str(args.runs), *sizes, "--new-tokens",
                                 str(args.new_tokens), "--png", chart], report.markdown(), chart,
                                "anonymous memory and peak RSS, dense vs mapped"))
    if args.pressure_model:
        report = run_pressure(args.pressure_model, resolve(args.pressure_model), args.runs, args.prompt_tokens)
        chart = report.chart(os.path.join(args.out, CHARTS["pressure"]))
        sections.append(section("Memory pressure: page cache warm vs evicted",
                                ["pressure", args.pressure_model, "--runs", str(args.runs), *sizes, "--png", chart],
                                report.markdown(), chart, "TTFT warm and cold, prefetch hint on and off"))
    if args.shared_model:
        report = run_shared(args.shared_model, resolve(args.shared_model), args.runs)
        chart = report.chart(os.path.join(args.out, CHARTS["shared"]))
        sections.append(section("Shared pages: two servers on one file",
                                ["shared", args.shared_model, "--runs", str(args.runs), "--png", chart],
                                report.markdown(), chart, "the second server's memory, dense vs mapped"))

    for name in args.batch_models:
        report = run_batch(name, resolve(name), list(BATCH_SIZES), args.batch_tokens, args.runs)
        differing += report.differing
        sizes = ",".join(map(str, BATCH_SIZES))
        sections.append(section(f"Decode speed: {report.model}", ["batch", name, "--sizes", sizes, "--tokens",
                                                                  str(args.batch_tokens), "--runs", str(args.runs)],
                                report.markdown()))

    minutes = (time.perf_counter() - start) / 60
    argv = sys.argv[sys.argv.index("all"):] if "all" in sys.argv else ["all"]
    block = (f"## Generated by `pagelm bench all`\n\n"
             f"Command ({started:%Y-%m-%d %H:%M} UTC, {minutes:.0f} min):\n\n"
             f"```sh\n{shlex.join(['pagelm', 'bench', *argv])}\n```\n\n"
             f"**Machine**: {machine_description()}. Synthetic models are written by `pagelm synth` into "
             f"`{args.models_dir}` when missing; SmolLM2 and Gemma 3 come from `pagelm pull`. What the "
             f"figures mean: [memory.md](memory.md).\n\n" + "\n".join(sections))
    results = os.path.join(args.out, RESULTS)
    document = open(results, encoding="utf-8").read() if os.path.exists(results) else "# Measured results\n"
    with open(results + ".part", "w", encoding="utf-8") as f:
        f.write(replace_generated_block(document, block))
    os.replace(results + ".part", results)
    progress(f"wrote {results} and its charts in {minutes:.1f} min")
    print(block)
    return 1 if differing else 0


def _mmproj(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mmproj", metavar="FILE",
                        help="the vision tower (mmproj GGUF) for every Qwen3.5 server this starts, as "
                             "`pagelm serve --mmproj`; default: one found beside the model")


def _models_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR,
                        help=f"where synthetic models are found or written (default {DEFAULT_MODELS_DIR})")


def _add_scenarios(subcommands, model_help: str) -> None:
    scenarios = subcommands.add_parser(
        "scenarios", help="the same 11 seeded scenarios on dense/mapped × prefix cache on/off; exit 1 if any differ",
        description=_scenarios.__doc__)
    scenarios.add_argument("model", metavar="MODEL", help=model_help)
    _mmproj(scenarios)
    scenarios.add_argument("--runs", type=int, default=2, help="runs of every configuration (default 2)")
    scenarios.add_argument("--weights", choices=["mapped", "mapped-int8", "dense"], default="mapped",
                           help="layer weights of every configuration (default mapped)")
    _models_dir(scenarios)
    scenarios.set_defaults(run=_scenarios)


def _add_memory(subcommands) -> None:
    from pagelm.bench.memory import DEFAULT_MODELS

    memory = subcommands.add_parser(
        "memory", help="anonymous memory, peak RSS, TTFT and decode speed: dense vs mapped, one server each",
        description=_memory.__doc__)
    memory.add_argument("models", nargs="*", metavar="MODEL", default=list(DEFAULT_MODELS),
                        help=f"models to measure (default: {' '.join(DEFAULT_MODELS)})")
    memory.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"runs per mode (default {DEFAULT_RUNS})")
    memory.add_argument("--prompt-tokens", type=int, default=2600, help="long prompt length (default 2600)")
    memory.add_argument("--new-tokens", type=int, default=128, help="greedy tokens after it (default 128)")
    memory.add_argument("--png", metavar="PATH", help="also write a bar chart of anonymous memory and peak RSS")
    _mmproj(memory)
    _models_dir(memory)
    memory.set_defaults(run=_memory)


def _add_pressure(subcommands, model_help: str) -> None:
    pressure = subcommands.add_parser(
        "pressure", help="TTFT with the model file's pages evicted, with and without the prefetch hint",
        description=_pressure.__doc__)
    pressure.add_argument("model", nargs="?", default="qwen3.5-0.8b", metavar="MODEL",
                          help="default qwen3.5-0.8b; " + model_help)
    pressure.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"runs (default {DEFAULT_RUNS})")
    pressure.add_argument("--prompt-tokens", type=int, default=2600, help="distinct prompt tokens (default 2600)")
    pressure.add_argument("--png", metavar="PATH", help="also write a bar chart")
    pressure.add_argument("--weights", choices=["mapped", "dense"], default="mapped",
                          help="layer weights (default mapped: evicting the file evicts them too)")
    _models_dir(pressure)
    pressure.set_defaults(run=_pressure)


def _add_shared(subcommands, model_help: str) -> None:
    shared = subcommands.add_parser(
        "shared", help="two servers on one model file: the second one's anonymous memory and PSS, dense vs mapped",
        description=_shared.__doc__)
    shared.add_argument("model", nargs="?", default="qwen3.5-0.8b", metavar="MODEL",
                        help="default qwen3.5-0.8b; " + model_help)
    shared.add_argument("--runs", type=int, default=1, help="runs per mode (default 1)")
    shared.add_argument("--png", metavar="PATH", help="also write a bar chart")
    _mmproj(shared)
    _models_dir(shared)
    shared.set_defaults(run=_shared)


def _add_vision(subcommands) -> None:
    vision = subcommands.add_parser(
        "vision", help="what one image costs a Qwen3.5 server: tokens, tower time, TTFT, TTFT again, peak memory",
        description=_vision.__doc__)
    vision.add_argument("models", nargs="*", metavar="SHAPE", default=list(VISION_SHAPES[:3]),
                        help=f"Qwen3.5 shapes with a tower ({', '.join(VISION_SHAPES)}; default: "
                             f"{' '.join(VISION_SHAPES[:3])})")
    vision.add_argument("--runs", type=int, default=1, help="images per size (default 1)")
    vision.add_argument("--sizes", metavar="WxH,…",
                        help="other image sizes, e.g. 1080x720,4032x3024 (default: the four above)")
    vision.add_argument("--image-cache-mib", type=int, default=256,
                        help="the servers' image-embedding cache bound (default 256, as pagelm serve)")
    vision.add_argument("--png", metavar="PATH", help="also write a bar chart of peak memory and TTFT")
    _models_dir(vision)
    vision.set_defaults(run=_vision)


def _add_perplexity(subcommands, model_help: str) -> None:
    perplexity = subcommands.add_parser(
        "perplexity", help="perplexity on a fixed English text per weights mode and dtype, via prefill and via decode",
        description=_perplexity.__doc__)
    perplexity.add_argument("model", metavar="MODEL", help=model_help)
    perplexity.add_argument("--text", metavar="FILE", help="a UTF-8 text file instead of Python's documentation")
    perplexity.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score (default 2048)")
    perplexity.add_argument("--weights", default="mapped,dense", metavar="MODES",
                            help="comma-separated weights modes: mapped, mapped-int8, dense (default mapped,dense)")
    perplexity.add_argument("--dtype", default="bfloat16,float32", metavar="DTYPES",
                            help="comma-separated compute dtypes (default bfloat16,float32)")
    _models_dir(perplexity)
    perplexity.set_defaults(run=_perplexity)


def _add_batch(subcommands, model_help: str) -> None:
    batch = subcommands.add_parser(
        "batch", help="decode throughput of 1..16 sequences per step (weights mapped); exit 1 if any sequence's "
                      "logits differ from decoding it alone",
        description=_batch.__doc__)
    batch.add_argument("model", metavar="MODEL", help=model_help)
    batch.add_argument("--sizes", default="1,2,4,8,16", metavar="N,…",
                       help="batch sizes, 1 to 16 (default 1,2,4,8,16)")
    batch.add_argument("--tokens", type=int, default=32, help="decode steps per batch size and run (default 32)")
    batch.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"runs (default {DEFAULT_RUNS})")
    batch.add_argument("--threads", type=int, default=2, help="threads for torch and the kernels (default 2)")
    batch.add_argument("--png", metavar="PATH", help="also write a bar chart of aggregate and per-sequence tok/s")
    _models_dir(batch)
    batch.set_defaults(run=_batch)


def _add_peer(subcommands, model_help: str) -> None:
    peer = subcommands.add_parser(
        "peer", help="one sequence beside llama.cpp, each in a fresh process: TTFT, decode tok/s, anonymous memory",
        description=_peer.__doc__)
    peer.add_argument("model", metavar="MODEL", help=model_help)
    peer.add_argument("--prompt-tokens", type=int, default=500, help="prompt length (default 500)")
    peer.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded (default 64)")
    peer.add_argument("--ctx", type=int, default=4096,
                      help="context both runtimes hold (default 4096; at least prompt + tokens)")
    peer.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"runs (default {DEFAULT_RUNS})")
    peer.add_argument("--threads", type=int, default=2, help="threads of each runtime (default 2)")
    peer.add_argument("--weights", choices=["mapped", "mapped-int8", "dense"], default="mapped",
                      help="pagelm's weights mode (default mapped; mapped-int8 quantizes decode's activations)")
    peer.add_argument("--cold", action="store_true",
                      help="evict the file from the page cache before each process: a cold start")
    _models_dir(peer)
    peer.set_defaults(run=_peer)


def _add_speculate(subcommands, model_help: str) -> None:
    from pagelm.bench.speculate import TASKS

    speculate = subcommands.add_parser(
        "speculate", help="plain against speculative decoding on built-in tasks; exit 1 if any answer differs",
        description=_speculate.__doc__)
    speculate.add_argument("model", metavar="MODEL", help=model_help)
    speculate.add_argument("--tasks", default=",".join(TASKS), metavar="TASK,…",
                           help=f"tasks among {','.join(TASKS)} (default all)")
    speculate.add_argument("--tokens", type=int, default=128, help="tokens decoded per answer (default 128)")
    speculate.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"runs (default {DEFAULT_RUNS})")
    source = speculate.add_mutually_exclusive_group()
    source.add_argument("--draft", metavar="MODEL",
                        help="drafts from this smaller model of the same vocabulary instead of prompt lookup")
    source.add_argument("--mtp", action="store_true",
                        help="drafts from the file's multi-token-prediction layer instead of prompt lookup "
                             "(llama-server not compared)")
    speculate.add_argument("--parallel", type=int, default=0, metavar="N",
                           help="also serve N edits at once with speculation off and auto (2 to 8; default: not)")
    _models_dir(speculate)
    speculate.set_defaults(run=_speculate)


def _add_embed(subcommands, model_help: str) -> None:
    embed = subcommands.add_parser(
        "embed", help="inputs per second of an embedding model, many inputs computed together, beside "
                      "llama.cpp's embedding mode", description=_embed.__doc__)
    embed.add_argument("model", metavar="MODEL", help=model_help)
    embed.add_argument("--inputs", default="1,32", metavar="N,…", help="counts of inputs per call (default 1,32)")
    embed.add_argument("--tokens", type=int, default=100, help="tokens of each input (default 100)")
    embed.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"runs (default {DEFAULT_RUNS})")
    embed.add_argument("--threads", type=int, default=2, help="threads of pagelm and of llama.cpp (default 2)")
    _models_dir(embed)
    embed.set_defaults(run=_embed)


def _add_concurrency(subcommands, model_help: str) -> None:
    concurrency = subcommands.add_parser(
        "concurrency", help="a pagelm serve --parallel process under 1, 2, 4, 8 concurrent clients; exit 1 if any "
                            "answer differs from the same request alone",
        description=_concurrency.__doc__)
    concurrency.add_argument("model", metavar="MODEL", help=model_help)
    concurrency.add_argument("--clients", default="1,2,4,8", metavar="N,…",
                             help="numbers of concurrent clients (default 1,2,4,8; 1 is always run)")
    concurrency.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    concurrency.add_argument("--prompt-tokens", default="100,400", metavar="LOW,HIGH",
                             help="prompt lengths, drawn uniformly (default 100,400)")
    concurrency.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    concurrency.add_argument("--threads", type=int, default=2, help="the server's compute threads (default 2)")
    concurrency.add_argument("--no-long-prompt", action="store_true",
                             help="skip the 2,600-token prompt sent while 4 streams decode")
    concurrency.add_argument("--png", metavar="PATH", help="also write charts of tok/s, TTFT and inter-token p95")
    _models_dir(concurrency)
    concurrency.set_defaults(run=_concurrency)


def _add_all(subcommands) -> None:
    from pagelm.bench.memory import DEFAULT_MODELS

    every = subcommands.add_parser(
        "all", help="run every benchmark and rewrite the generated block of OUT/results.md (+ PNGs)",
        description=_all.__doc__)
    every.add_argument("--out", default="docs", help="folder of results.md and the PNGs (default docs)")
    every.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), metavar="MODEL",
                       help=f"memory benchmark models (default: {' '.join(DEFAULT_MODELS)}); none skips it")
    every.add_argument("--scenario-models", nargs="*", default=list(SCENARIO_MODELS), metavar="MODEL",
                       help=f"scenario models (default: {' '.join(SCENARIO_MODELS)}); none skips them")
    every.add_argument("--scenario-runs", type=int, default=2, help="scenario runs (default 2)")
    every.add_argument("--pressure-model", default="qwen3.5-0.8b", metavar="MODEL",
                       help="pressure benchmark model (default qwen3.5-0.8b; '' skips it)")
    every.add_argument("--shared-model", default="qwen3.5-0.8b", metavar="MODEL",
                       help="two-process benchmark model (default qwen3.5-0.8b; '' skips it)")
    every.add_argument("--batch-models", nargs="*", default=list(BATCH_MODELS), metavar="MODEL",
                       help=f"batched decode models, sizes {','.join(map(str, BATCH_SIZES))} (default: "
                            f"{' '.join(BATCH_MODELS)}); none skips them")
    every.add_argument("--batch-tokens", type=int, default=16, help="decode steps per batch size and run (default 16)")
    every.add_argument("--runs", type=int, default=DEFAULT_RUNS,
                       help=f"runs of the memory, pressure, shared and batch benchmarks (default {DEFAULT_RUNS})")
    every.add_argument("--prompt-tokens", type=int, default=2600, help="long prompt length (default 2600)")
    every.add_argument("--new-tokens", type=int, default=128, help="greedy tokens after it (default 128)")
    _models_dir(every)
    every.set_defaults(run=_all)


def register(commands) -> None:
    """Add `pagelm bench` and its subcommands to pagelm's argparse subparsers."""
    from pagelm.bench.inputs import synthetic_shapes

    model_help = (f"a synthetic shape ({', '.join(synthetic_shapes())}; written with `pagelm synth` when "
                  f"missing), a known model (smollm2-135m, gemma3-270m; pulled when missing), a .gguf file or a "
                  f"model directory (Hugging Face or FastFlowLM)")
    bench = commands.add_parser(
        "bench", help="measure what the embedding mode changes: outputs (nothing) and memory",
        description="Benchmarks that drive real `pagelm serve` processes: scenarios (identical outputs across "
                    "embedding modes and prefix cache settings), memory (dense vs mapped), pressure (page cache "
                    "evicted) and shared (two servers on one file); `all` runs them and regenerates the marked "
                    "block of docs/results.md. Tables go to stdout, progress to stderr. MODEL is " + model_help + ".")
    bench.set_defaults(compiles_kernels=True)  # pagelm.cli reports kernels compiling in this process
    subcommands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _add_scenarios(subcommands, model_help)
    _add_memory(subcommands)
    _add_pressure(subcommands, model_help)
    _add_shared(subcommands, model_help)
    _add_vision(subcommands)
    _add_perplexity(subcommands, model_help)
    _add_batch(subcommands, model_help)
    _add_peer(subcommands, model_help)
    _add_speculate(subcommands, model_help)
    _add_embed(subcommands, model_help)
    _add_concurrency(subcommands, model_help)
    _add_all(subcommands)
