"""The ``fp8kv`` command.

::

    fp8kv notebooks run [--smoke | --full] [--only NAME ...] [--timeout S] [--out reports] ...
    fp8kv notebooks list [--notebooks DIR]
    fp8kv bench ARGS...        # forwarded unparsed to fp8kv.bench.main(ARGS)

``fp8kv notebooks run`` is the same as ``python -m fp8kv.notebooks`` (see :mod:`fp8kv.notebooks`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .checks import ArgumentParser

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of ``fp8kv`` (``bench`` is listed for ``--help``; its arguments are its own)."""
    from .notebooks import add_actions

    parser = ArgumentParser(prog="fp8kv", description="FP8 KV-cache workbench.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    nb = sub.add_parser("notebooks", help="run the notebooks headless and publish reports/<gpu>/")
    add_actions(nb)

    sub.add_parser("bench", help="benchmarks (fp8kv bench --help for its options)", add_help=False)
    return parser


def _bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module("fp8kv.bench")  # lazy: it imports kernels and CUDA state
    except ModuleNotFoundError as exc:
        if exc.name != "fp8kv.bench":  # a dependency of bench is missing: that error is the useful one
            raise
        print("error: fp8kv.bench is not available in this installation", file=sys.stderr)
        return 2
    rc = bench.main(argv)
    return int(rc or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fp8kv`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # forwarded before parsing, so bench's own --help and options work
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    from .notebooks import run_action

    return run_action(args)


if __name__ == "__main__":
    sys.exit(main())
