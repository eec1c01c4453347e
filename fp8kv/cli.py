"""The ``fp8kv`` command: one front end for the package's commands.

::

    fp8kv notebooks run [--smoke | --full] [--only NAME ...] [--timeout S] [--out reports] ...
    fp8kv notebooks list | index | render FOLDER
    fp8kv bench ARGS...        # forwarded unparsed to fp8kv.bench.main(ARGS)
    fp8kv step ARGS...         # forwarded unparsed to fp8kv.step.main(ARGS)

Each is the same as ``python -m fp8kv.<command>`` (see :mod:`fp8kv.notebooks`, :mod:`fp8kv.bench`,
:mod:`fp8kv.step`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .checks import ArgumentParser

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of ``fp8kv`` (``bench`` and ``step`` are listed for ``--help``; their arguments
    are their own)."""
    from .notebooks import add_actions

    parser = ArgumentParser(prog="fp8kv", description="FP8 KV-cache workbench.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    nb = sub.add_parser("notebooks", help="run the notebooks headless and publish reports/<gpu>/ "
                                          "(run, list, index, render)")
    add_actions(nb)

    sub.add_parser("bench", help="decode benchmarks (fp8kv bench --help for its options)", add_help=False)
    sub.add_parser("step", help="a model's whole decode step (fp8kv step --help for its options)", add_help=False)
    return parser


def _forward(command: str, argv: list[str]) -> int:
    """Hand ``argv`` to a command's own parser (imported lazily: bench and step import kernels)."""
    if command == "bench" and "--interpret" in argv:
        from .capability import use_interpreter

        use_interpreter()  # before fp8kv.bench imports triton, which reads it once
    try:
        if command == "bench":
            from .bench import main as command_main
        elif command == "step":
            from .step import main as command_main
        else:
            from .notebooks import main as command_main
    except ModuleNotFoundError as exc:
        if exc.name != f"fp8kv.{command}":  # a dependency of the command is missing: that error is the useful one
            raise
        print(f"error: fp8kv.{command} is not available in this installation", file=sys.stderr)
        return 2
    return int(command_main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fp8kv`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and step parse their own options (so their --help works); notebooks' index and render
    # actions are parsed by fp8kv.notebooks.main
    if argv and (argv[0] in ("bench", "step") or argv[:2] in (["notebooks", "index"], ["notebooks", "render"])):
        return _forward(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    from .notebooks import run_action

    return run_action(args)


if __name__ == "__main__":
    sys.exit(main())
