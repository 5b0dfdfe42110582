"""`pagelm warm [MODEL]`: fills the kernel cache ahead of time (an image, a container, CI), so that
the first `run` or `serve` loads its kernels instead of compiling them. Computes nothing else."""

from __future__ import annotations

import argparse
import os
import sys


def warm_model(path: str, weights: str, mmproj: str | None) -> None:
    """Compiles what `path`'s tensor types and architecture need: its load (the kernels of its block
    types, tiles and head, and, in loading's warmup step, its layers' one-token kernels)."""
    from pagelm.engine.load import load_model

    load_model(path, weights=weights, mmproj=mmproj)


def _warm(args: argparse.Namespace) -> int:
    """Compile kernels into the per-user cache ahead of time, so that the first run or server of this
    install loads them instead of compiling (for images and containers). Without MODEL: every kernel of
    every block type, and every architecture's layer kernels (a first step of a tiny model of each); with MODEL: those its tensor types and architecture need (with --weights, its
    weights mode's). The cache is $PAGELM_CACHE, else $XDG_CACHE_HOME/pagelm/kernels or
    ~/.cache/pagelm/kernels, one directory per pagelm, numba, llvmlite and Python version (numba keys
    each entry by the CPU too); NUMBA_CACHE_DIR, when set, is used instead. A kernel already cached
    is not compiled again; a damaged entry is rebuilt."""
    from pagelm.quant.compile_progress import CompileProgress

    with CompileProgress():
        _compile(args)
    where = os.environ.get("NUMBA_CACHE_DIR", "the __pycache__ folders beside pagelm's sources")
    print(f"pagelm warm: kernels cached in {where}", file=sys.stderr)
    return 0


def tiny_shapes() -> dict[str, str]:
    """Architecture -> the `pagelm synth` shape warm runs for it: the first tiny one of each (name ending in -tiny)."""
    from pagelm.tools.synth_shapes import SHAPES

    shapes: dict[str, str] = {}
    for name, shape in SHAPES.items():
        if name.endswith("-tiny"):
            shapes.setdefault(shape.arch, name)
    return shapes


def warm_architectures(weights: str) -> None:
    """Every architecture's one-token kernels (norms, rope, attention, recurrent and conv steps, the compiled
    layers): a first step of each tiny synthetic shape (tiny_shapes), written to a temporary folder."""
    import tempfile

    from pagelm.tools.synth import write_model
    from pagelm.tools.synth_shapes import SHAPES

    with tempfile.TemporaryDirectory(prefix="pagelm-warm-") as folder:
        for name in tiny_shapes().values():
            path = os.path.join(folder, f"{name}.gguf")
            write_model(path, SHAPES[name], name=f"synthetic {name}")
            warm_model(path, weights, None)
            os.remove(path)


def _compile(args: argparse.Namespace) -> None:
    if args.model is None:
        from pagelm.quant.precompile import precompile

        precompile()
        warm_architectures(args.weights)
    else:
        from pagelm.sources.cli import locate

        path, tower = locate(args.model)
        warm_model(str(path), args.weights, tower)


def register(commands) -> None:
    warm = commands.add_parser("warm", help="compile kernels ahead of time into the per-user cache (images, containers)",
                               description=_warm.__doc__)
    warm.add_argument("model", nargs="?", metavar="MODEL",
                      help="a known model name, a Hub model (hf.co/USER/REPO[:QUANT][@REVISION]), a .gguf file or a "
                           "model directory; pulled if needed (default: every kernel, and a tiny model of every "
                           "architecture)")
    warm.add_argument("--weights", choices=("mapped", "mapped-int8", "dense"), default="mapped",
                      help="the weights mode whose kernels to compile (default mapped)")
    warm.set_defaults(run=_warm)
