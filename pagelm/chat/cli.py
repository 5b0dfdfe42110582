"""The `pagelm run` command: one answer for a prompt, or the interactive chat; `pagelm embed`: the
vectors of texts from an embedding model; and the options of how a model is held and computed,
which `serve` shares (`add_compute_options`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagelm.errors import PagelmError
from pagelm.sources.cli import locate

SPECULATE_MODES = ("auto", "off", "lookup", "mtp")  # engine.speculate.MODES, whose import would load torch for --help

def add_compute_options(parser: argparse.ArgumentParser, images: bool = True) -> None:
    """How a model is held and computed: the flags `run`, `serve` and (without images) `embed` share."""
    if images:
        parser.add_argument("--mmproj", metavar="FILE",
                            help="the vision tower (llama.cpp's mmproj GGUF) of a Qwen3.5 model (default: an "
                                 "mmproj*.gguf beside the model file, or mmproj.gguf in a model directory)")
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
    from pagelm.chat.conversation import Conversation
    from pagelm.chat.model import ChatModel
    from pagelm.engine.sampling import SamplingParams
    from pagelm.weights.pooling import embedding_head

    path, tower = locate(args.model)
    print(f"loading {path} (embedding {args.embedding}, weights {args.weights}, {args.dtype})", file=sys.stderr)
    chat = ChatModel.open(path, name=args.model, embedding=args.embedding, weights=args.weights, dtype=args.dtype,
                          threads=args.threads, mmproj=args.mmproj or tower,
                          image_tokens=(args.image_min_tokens, args.image_max_tokens))
    if embedding_head(chat.model.loader) is not None:
        raise PagelmError(f"{args.model} is an embedding model: it makes vectors, not text (pagelm embed MODEL TEXT)")
    draft = None
    if args.draft is not None:
        check_draft(args)
        draft = chat.open_draft(locate(args.draft)[0], args.weights, args.dtype, args.threads)
    conversation = Conversation(chat.model, chat.tokenizer, chat.template, max_len=args.ctx_len, think=args.think,
                                speculate=args.speculate, draft=draft)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_tokens, reasoning_budget=args.reasoning_budget)
    return chat, conversation, params


def add_draft_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", metavar="MODEL",
                        help="draft with this smaller model of the same vocabulary (e.g. Qwen3.5-0.8B for 4B): its "
                             "greedy tokens are checked several at a time; the answer is the same")


def check_draft(args: argparse.Namespace) -> None:
    if args.speculate in ("off", "mtp"):
        raise PagelmError(f"--draft drafts tokens to check: it needs --speculate auto or lookup, not {args.speculate}")


def _open_compiled(args: argparse.Namespace):
    """_open_chat with a line on stderr while kernels compile (the first decode step's too: loading runs
    one), so that the line ends before the answer starts."""
    from pagelm.quant.compile_progress import CompileProgress

    with CompileProgress():
        return _open_chat(args)


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
    s = turn.speculation
    if s is not None:
        print(f"[speculation: {s.drafted} drafted, {s.accepted} accepted in {s.passes} verify passes]", file=sys.stderr)


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
    from pagelm.sources import store

    if args.prompt is None and args.model is not None and not store.is_model_name(args.model) \
            and not os.path.exists(args.model):
        args.model, args.prompt = None, args.model  # `pagelm run "Why is the sky blue?"`
    args.model = args.model or store.DEFAULT_MODEL
    schema = _read_schema(args.json_schema) if args.json_schema else None
    chat, conversation, params = _open_compiled(args)
    images = [_read_image(chat, path) for path in args.image]
    grammar = None
    if args.format or args.json_schema:
        from pagelm.chat.grammar import Grammar, GrammarError

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


def _embed(args: argparse.Namespace) -> int:
    """The vector of each TEXT from an embedding model (EmbeddingGemma, Qwen3-Embedding): one JSON line
    per text on stdout, {"index", "tokens", "embedding"}, in the order given. The texts are computed
    together, each vector the same bits as its text's alone."""
    from pagelm.chat.model import ChatModel
    from pagelm.engine.embed import Embedder

    if args.dimensions is not None and args.dimensions < 1:
        raise PagelmError(f"--dimensions must be >= 1, got {args.dimensions}")
    path, _ = locate(args.model)
    print(f"loading {path} (embedding {args.embedding}, weights {args.weights}, {args.dtype})", file=sys.stderr)
    chat = ChatModel.open(path, name=args.model, embedding=args.embedding, weights=args.weights, dtype=args.dtype,
                          threads=args.threads)
    embedder = Embedder.of(chat.model)
    prefix = embedder.head.prompts.get(args.prompt_name, "") if args.prompt_name else ""
    if args.prompt_name and args.prompt_name not in embedder.head.prompts:
        known = ", ".join(embedder.head.prompts) or "none"
        raise PagelmError(f"--prompt-name {args.prompt_name!r}: the model names no such prompt (it has: {known})")
    inputs = [chat.tokenizer.encode_input(prefix + text) for text in args.texts]
    for i, tokens in enumerate(inputs):
        if len(tokens) > args.ctx_len:
            raise PagelmError(f"text {i + 1} is {len(tokens)} tokens long, more than --ctx-len {args.ctx_len}")
    for i, (tokens, vector) in enumerate(zip(inputs, embedder.embed_all(inputs, args.dimensions))):
        print(json.dumps({"index": i, "tokens": len(tokens), "embedding": vector.tolist()}), flush=True)
    return 0


def register(commands) -> None:
    run = commands.add_parser(
        "run", help="chat with a model: one answer for PROMPT, or an interactive session",
        description="Chat with a model. With PROMPT, stream the answer to stdout and exit (progress, "
                    "reasoning and stats go to stderr); without, start an interactive session "
                    f"({_REPL_HELP}). MODEL is a known name, a Hugging Face Hub model (hf.co/USER/REPO[:QUANT][@REVISION], "
                    "pulled on first use with its vision tower), a .gguf file or a model directory; without one, "
                    "smollm2-135m is pulled and used, and a lone argument that is not a model is the prompt.")
    run.add_argument("model", nargs="?", metavar="MODEL")
    run.add_argument("prompt", nargs="?", metavar="PROMPT")
    add_compute_options(run)
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
    run.add_argument("--reasoning-budget", type=int, metavar="N",
                     help="with --think: close the reasoning after N tokens and answer (default: no bound; a "
                          "--format/--json-schema answer always keeps room: half of --max-tokens, at most 256)")
    run.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image (PNG, JPEG, WebP, GIF) to ask about, before PROMPT's text; repeatable. Needs a "
                          "model with a vision tower (--mmproj)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object (content, reasoning, token ids, counts) as the last line")
    run.add_argument("--stats", action="store_true",
                     help="prompt/decode tok/s, memory and speculation's drafted/accepted tokens to stderr")
    run.add_argument("--speculate", choices=SPECULATE_MODES, default="auto",
                     help="check guessed tokens several at a time, from what the prompt and answer repeat (lookup; "
                          "auto, the default: lookup where the measured step costs say it pays; mtp: from the model "
                          "file's multi-token-prediction layer, as Qwen3.5's MTP files carry; off: one token a "
                          "step); the answer is the same")
    add_draft_option(run)
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
    embed = commands.add_parser("embed", help="the vectors of texts from an embedding model",
                                description=_embed.__doc__)
    embed.add_argument("model", metavar="MODEL", help="an embedding model: a pulled name, a Hub model, a .gguf file or a "
                                                      "directory (sentence-transformers layout)")
    embed.add_argument("texts", nargs="+", metavar="TEXT")
    embed.add_argument("--dimensions", type=int, metavar="N",
                       help="keep the first N values of each vector and normalize them again (Matryoshka models)")
    embed.add_argument("--prompt-name", metavar="NAME",
                       help="put the model's named prompt before each text (e.g. query, document: "
                            "config_sentence_transformers.json's prompts)")
    embed.add_argument("--ctx-len", type=int, default=2048, help="longest text in tokens (default 2048)")
    add_compute_options(embed, images=False)
    embed.set_defaults(run=_embed)
