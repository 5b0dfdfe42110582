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
    from pagelm.quant.types import GGMLType
    from pagelm.synth import SHAPES, SYNTH_TYPES, write_embedding_model

    if not args.embedding_only:
        raise PagelmError(
            "full synthetic models (with layers) need the qwen35 engine, which is not built yet; "
            "pass --embedding-only to write the embedding geometry alone"
        )
    shape = SHAPES[args.shape]
    if args.embedding_type:
        ggml_type = GGMLType[args.embedding_type]
        if ggml_type not in SYNTH_TYPES:
            raise PagelmError(f"--embedding-type {ggml_type.name} is not one pagelm can synthesise")
        shape = type(shape)(shape.vocab, shape.dim, ggml_type, shape.output_type)
    total = sum(_table_nbytes(shape, t) for t in (shape.embedding_type, shape.output_type) if t is not None)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {os.path.basename(args.out)}",
              file=sys.stderr, disable=args.quiet) as bar:
        write_embedding_model(args.out, shape, seed=args.seed, name=f"synthetic {args.shape}", progress=bar.update)
    print(f"wrote {args.out}: {args.shape}, vocab {shape.vocab}, dim {shape.dim}, "
          f"token_embd {shape.embedding_type.name}, "
          + (f"output {shape.output_type.name}" if shape.output_type else "tied output head")
          + f", {os.path.getsize(args.out)} bytes")
    return 0


def _table_nbytes(shape, ggml_type) -> int:
    from pagelm.quant.types import row_nbytes

    return row_nbytes(ggml_type, shape.dim) * shape.vocab


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


def build_parser() -> argparse.ArgumentParser:
    from pagelm import __version__
    from pagelm.synth import SHAPES

    parser = argparse.ArgumentParser(
        prog="pagelm",
        description="pagelm: small language models whose weights stay in the model file.",
    )
    parser.add_argument("--version", action="version", version=f"pagelm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    synth = commands.add_parser(
        "synth", help="write a synthetic GGUF with a real model's geometry and random values",
        description="Write a GGUF whose embedding geometry is a real model's (random, seeded values). "
                    "The Qwen3.5 0.8b/2b/4b shapes have a tied Q8_0 token_embd and no output.weight; "
                    "the 9b has a BF16 token_embd and a Q8_0 output.weight.")
    synth.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the geometry to copy")
    synth.add_argument("out", metavar="OUT.gguf", help="file to write (written to OUT.part, then renamed)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--embedding-only", action="store_true",
                       help="write only the embedding tables (required until the engine lands)")
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
