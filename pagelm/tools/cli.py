"""The `pagelm synth` and `pagelm verify-embeddings` commands: their arguments and what they print;
the writing and the checking live in `synth`, `synth_tower`, `convert` and `verify`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tqdm import tqdm

from pagelm.errors import PagelmError

def _synth(args: argparse.Namespace) -> int:
    """Write a complete random llama.cpp model at a real model's geometry (every tensor and metadata key,
    random seeded values scaled to stay numerically healthy, peaked final logits), or with --embedding-only
    just its embedding tables. qwen35: the Qwen3.5 0.8b/2b/4b shapes have a tied Q8_0 token_embd and no
    output.weight, the 9b a BF16 token_embd and a Q8_0 output.weight; qwen3.5-tiny and qwen3.5-tiny-gqa
    (nv != nk) are small shapes for tests; 'tiny' is an embedding-only geometry. The other families, each
    with a tied Q8_0 token_embd: qwen3-0.6b, qwen3-1.7b (qwen3, per-head q/k norms), qwen2.5-1.5b (qwen2,
    q/k/v biases), llama3.2-1b (llama, llama3 rope_freqs), lfm2-1.2b (lfm2: 6 attention and 10
    short-convolution layers), embeddinggemma-300m (gemma-embedding: bidirectional, mean pooling,
    dense_2/dense_3), qwen3-30b-a3b (qwen3moe: 128 experts, 8 per token, an untied output head),
    qwen3.5-35b-a3b (qwen35moe: the Qwen3.5 hybrid with 256 experts, 8 per token, and a shared expert; an
    untied output head), gpt-oss-20b (gpt-oss: 32 MXFP4 experts, 4 per token, sinks, a sliding window every
    other layer, YaRN, an untied output head), and FAMILY-tiny shapes of each for tests. Only the Qwen3.5 shapes of the real
    vocabulary size carry a tokenizer (the real Qwen3.5 one); every other shape is token ids only."""
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
    from pagelm.tools.synth import (SHAPES, SYNTH_TYPES, embedding_nbytes, plan_model, plan_nbytes,
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
    if args.mtp:
        if shape.arch not in ("qwen35", "qwen35moe") or not shape.full:
            raise PagelmError(f"--mtp: shape '{args.shape}' is not a complete Qwen3.5 (only those have an MTP layer)")
        if args.format != "gguf":
            raise PagelmError("--mtp writes the layer as llama.cpp does: GGUF only")
        shape = replace(shape, mtp_layers=1)
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
        print(f"wrote {args.out}: {args.shape} ({shape.arch}), {shape.n_layers} layers, hidden {shape.hidden}, vocab {shape.vocab}, "
              f"{len(plan)} tensors, {layers}, token_embd {plan[0].ggml_type.name}, {head}, "
              f"{os.path.getsize(args.out)} bytes")


def _synth_mmproj(args: argparse.Namespace) -> None:
    from pagelm.tools.synth import plan_nbytes
    from pagelm.tools.synth_tower import SHAPES, plan_mmproj, write_mmproj

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

    from pagelm.tools.convert import write_directory

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
                                      flm_version=args.flm_version, progress=bar.update)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out}: {args.shape} as a {container} directory ({', '.join(sorted(os.listdir(args.out)))}), "
          f"{size} bytes")
    if rounded:
        print(f"note: {rounded} fp16 scales were rounded to bf16 for the tiles; their values differ from the GGUF's")


def _verify_embeddings(args: argparse.Namespace) -> int:
    """Compare every row (or --rows N spread evenly) of the mapped token embedding against the fully unpacked
    bf16 table, and against gguf.quants when installed. The last line is 'rows: <N> checked, <D>
    differing'; exit status 1 if D > 0."""
    from pagelm.tools.verify import select_rows, verify_copies, verify_embedding
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


def register(commands) -> None:
    from pagelm.tools.synth import LAYER_TYPES, MIXES, SHAPES

    synth = commands.add_parser(
        "synth", help="write a synthetic GGUF with a real model's geometry and random values",
        description=_synth.__doc__)
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
                             help="type of the layers' 2-D matrices (default Q8_0); norms, biases, ssm_a, "
                                  "ssm_dt.bias, ssm_conv1d, shortconv.conv and rope_freqs are always F32")
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
    synth.add_argument("--mtp", action="store_true",
                       help="Qwen3.5 shapes: add the multi-token-prediction layer (blk.N.nextn.*, as the -MTP-GGUF "
                            "releases carry it), which --speculate mtp drafts with")
    synth.add_argument("--quiet", action="store_true", help="no progress bar")
    synth.set_defaults(run=_synth)

    verify = commands.add_parser(
        "verify-embeddings", help="prove mapped embedding rows are bit-identical to the dense table",
        description=_verify_embeddings.__doc__)
    verify.add_argument("model", metavar="MODEL",
                        help="a .gguf file, a Hugging Face checkpoint directory or a FastFlowLM model directory")
    verify.add_argument("--rows", type=int, help="check N rows spread from first to last (default: all)")
    verify.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    verify.add_argument("--no-oracle", action="store_true", help="skip the gguf.quants comparison")
    verify.set_defaults(run=_verify_embeddings)
