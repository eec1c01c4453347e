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

from .checks import ArgumentParser, output_folder, positive_int

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of ``fp8kv`` (``bench`` is listed for ``--help``; its arguments are its own)."""
    from .notebooks import add_run_arguments

    parser = ArgumentParser(prog="fp8kv", description="FP8 KV-cache workbench.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    nb = sub.add_parser("notebooks", help="run the notebooks headless and publish reports/<gpu>/")
    nb_sub = nb.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = nb_sub.add_parser("run", help="execute notebooks/*.ipynb, render HTML, write reports/<gpu-slug>/")
    add_run_arguments(run)
    run.set_defaults(parser=run)
    ls = nb_sub.add_parser("list", help="list the notebooks a run would execute, in order")
    ls.add_argument("--notebooks", default=None, metavar="DIR", help="notebook folder (default: ./notebooks)")
    ls.set_defaults(parser=ls)

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
    from . import notebooks

    if args.action == "list":
        try:
            books = notebooks.discover_notebooks(args.notebooks)
        except ValueError as exc:
            args.parser.error(str(exc))
        for book in books:
            print(book.stem)
        return 0
    try:
        _check_run_args(args)
    except (TypeError, ValueError) as exc:
        args.parser.error(str(exc))
    return notebooks.run_from_args(args)


def _check_run_args(args: argparse.Namespace) -> None:
    """What ``notebooks run`` would otherwise find only after starting: the device, the timeout, the
    notebooks named by --only and the reports folder. Raises ValueError naming the flag."""
    from .device import resolve_device
    from .notebooks import discover_notebooks

    try:
        resolve_device(args.device)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--device {args.device}: {exc}") from None
    if args.timeout is not None:
        positive_int(args.timeout, "--timeout")
    discover_notebooks(args.notebooks, args.only)
    output_folder(args.out, "--out")


if __name__ == "__main__":
    sys.exit(main())
