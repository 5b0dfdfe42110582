"""The `pagelm` command line: the commands register their own parsers beside their code (chat, serve,
sources, tools, measure, bench); this module dispatches and turns errors into messages and exit codes.

Results go to stdout, progress bars and errors to stderr.
"""

from __future__ import annotations

import argparse
import sys

from pagelm.errors import PagelmError


def build_parser() -> argparse.ArgumentParser:
    from pagelm import __version__
    from pagelm.bench import cli as bench
    from pagelm.chat import cli as chat
    from pagelm.measure import cli as measure
    from pagelm.serve import cli as serve
    from pagelm.sources import cli as sources
    from pagelm.tools import cli as tools
    from pagelm.tools import warm

    parser = argparse.ArgumentParser(
        prog="pagelm",
        description="pagelm: small language models whose weights stay in the model file.",
    )
    parser.add_argument("--version", action="version", version=f"pagelm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (tools, chat, serve, sources, measure, bench, warm):
        command.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "compiles_kernels", False):
            from pagelm.quant.compile_progress import CompileProgress

            with CompileProgress():
                return args.run(args)
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
