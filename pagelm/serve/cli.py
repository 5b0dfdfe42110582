"""The `pagelm serve` command: its flags, checked, into the server's settings; one server here or
replicas on Ray Serve (`cluster.run`)."""

from __future__ import annotations

import argparse
import sys

from pagelm.chat.cli import SPECULATE_MODES, add_compute_options, add_draft_option, check_draft
from pagelm.errors import PagelmError
from pagelm.sources.cli import locate

def _serve(args: argparse.Namespace) -> int:
    """Serve one model on /v1/chat/completions, /v1/completions, /v1/models (OpenAI) and /api/chat,
    /api/generate, /api/tags, /api/ps, /api/show, /api/version, /api/cancel (Ollama), plus /health and
    /metrics, and a chat page on GET / for a browser (--no-ui turns it off). Up to --parallel requests run
    at once (one batched decode step advances them all, a long prompt is prefilled in chunks between
    steps), more wait in arrival order; each answer is the one the request gets alone. A prefix cache,
    shared by all slots, of checkpoints (message boundaries, ends of answers) lets a growing chat, or
    another one with the same system prompt, prefill only its new tokens."""
    import uvicorn

    from pagelm.sources import store
    from pagelm.serve.app import create_app
    from pagelm.serve.core import ServeSettings
    from pagelm.serve.guard import is_loopback

    for flag, value, low in [("--ctx-len", args.ctx_len, 16), ("--prefix-slots", args.prefix_slots, 0),
                             ("--prefix-cache-mib", args.prefix_cache_mib, 0),
                             ("--checkpoint-interval", args.checkpoint_interval, 0),
                             ("--queue-size", args.queue_size, 1), ("--parallel", args.parallel, 1),
                             ("--max-body-mib", args.max_body_mib, 1),
                             ("--image-cache-mib", args.image_cache_mib, 0),
                             ("--image-min-tokens", args.image_min_tokens, 1),
                             ("--max-tokens", args.max_tokens, 1), ("--port", args.port, 0),
                             ("--reasoning-budget", 0 if args.reasoning_budget is None else args.reasoning_budget, 0)]:
        if value < low:
            raise PagelmError(f"{flag} must be >= {low}, got {value}")
    model = args.model or store.DEFAULT_MODEL
    path, tower = locate(model)
    if args.draft is not None:
        check_draft(args)
    name = model if store.is_model_name(model) else store.display_name(path)
    settings = ServeSettings(model_path=str(path), model_name=name, ctx_len=args.ctx_len,
                             prefix_slots=args.prefix_slots, prefix_cache_mib=args.prefix_cache_mib,
                             checkpoint_interval=args.checkpoint_interval, embedding=args.embedding,
                             weights=args.weights, dtype=args.dtype, threads=args.threads, api_key=args.api_key,
                             queue_size=args.queue_size, parallel=args.parallel,
                             max_body_mib=args.max_body_mib, max_tokens=args.max_tokens, mmproj=args.mmproj or tower,
                             image_cache_mib=args.image_cache_mib,
                             image_tokens=(args.image_min_tokens, args.image_max_tokens), ui=not args.no_ui,
                             host=args.host, allowed_hosts=tuple(args.allowed_host),
                             allowed_origins=tuple(args.allowed_origin), reasoning_budget=args.reasoning_budget,
                             speculate=args.speculate, draft=None if args.draft is None else str(locate(args.draft)[0]))
    if not is_loopback(args.host) and args.api_key is None:
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


def register(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI- and Ollama-compatible HTTP API",
        description=_serve.__doc__)
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
    add_compute_options(serve)
    serve.add_argument("--api-key", help="require Authorization: Bearer KEY on every route but /health")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="on a loopback --host, also answer requests whose Host is NAME (repeatable; by default "
                            "only localhost, 127.0.0.1 and [::1]: a foreign name is a DNS-rebinding page, 403)")
    serve.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN",
                       help="let browser pages of ORIGIN (e.g. https://app.example.com; * for any) call the API, "
                            "with CORS headers (repeatable; by default only the server's own pages and loopback "
                            "origins: others get 403)")
    serve.add_argument("--parallel", type=int, default=4, metavar="N",
                       help="requests answered at once, each in a slot with its own state (allocated while in use); "
                            "1 = one at a time (default 4)")
    serve.add_argument("--speculate", choices=SPECULATE_MODES, default="auto",
                       help="while one request decodes, check tokens guessed from what its prompt and answer repeat "
                            "several at a time (auto, the default: where the measured step costs say it pays; mtp: "
                            "guessed by the model file's multi-token-prediction layer; off); answers stay the same. "
                            "A request's OpenAI `prediction` is drafted from in any mode")
    add_draft_option(serve)
    serve.add_argument("--queue-size", type=int, default=64,
                       help="requests waiting for a slot before 503 with Retry-After (default 64)")
    serve.add_argument("--max-body-mib", type=int, default=32, help="largest request body in MiB (default 32)")
    serve.add_argument("--max-tokens", type=int, default=2048,
                       help="tokens generated when a request sets no limit (default 2048)")
    serve.add_argument("--reasoning-budget", type=int, metavar="N",
                       help="close a thinking model's reasoning after N tokens when a request sets no "
                            "reasoning_budget (default: no bound; a forced tool call or JSON answer always keeps "
                            "room: half of its max_tokens, at most 256)")
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
