"""`foveal` command line: each subcommand lives in its own module and
registers its parser; heavy imports (torch) happen only when one runs."""
from __future__ import annotations

import argparse
import importlib
import sys

from foveal.allocator import reexec_with_allocator
from foveal.errors import FovealError

# subcommand modules, each with `register(subparsers)`
_SUBCOMMANDS = (
    "foveal.entrypoints.demo",
    "foveal.entrypoints.env",
    "foveal.entrypoints.offline",
    "foveal.entrypoints.serve",
    "foveal.bench.cli",
    "foveal.loader.tiny_model",
    "foveal.demo_model.cli",
    "foveal.eagle_train.cli",
    "foveal.stages.cli",
    "foveal.disagg.router_cli",
    "foveal.disagg.cluster_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foveal",
        description="Foveal: inference and serving engine for vision language models.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _SUBCOMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """argv None: the command line of this process, which first moves onto tcmalloc
    where it is installed (foveal/allocator.py; the process is replaced)."""
    if argv is None:
        try:
            reexec_with_allocator()
        except FovealError as error:
            print(f"foveal: error: {error}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except FovealError as error:
        print(f"foveal: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
