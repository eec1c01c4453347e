"""``fp8kv notebooks`` / ``python -m fp8kv.notebooks``: run, list, index and render."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from .index import build_index, report_folders
from .pages import INDEX, default_notebook_dir, discover_notebooks, render_report
from .runner import DEFAULT_TIMEOUT_S, RunInterrupted, check_out_folder, run_notebooks

# --------------------------------------------------------------------------- command line


def _positive_seconds(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number of seconds")
    return int(value)


def _device_here(text: str) -> str:
    from ..device import resolve_device

    try:
        resolve_device(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _parameter(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` -> (NAME, the Python literal VALUE)."""
    import ast
    import textwrap

    from ..checks import show_value

    name, eq, value = text.partition("=")
    name = name.strip()
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--param {show_value(text)}: expected NAME=VALUE, e.g. "
                                         "VERIFY_BATCHES=[1,16,64]")
    try:
        return name, ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, RecursionError) as exc:  # the value is cut: it may be huge
        raise argparse.ArgumentTypeError(f"--param {name}={show_value(value.strip())} is not a Python literal "
                                         f"(numbers, strings in quotes, lists, None, True/False): "
                                         f"{textwrap.shorten(str(exc), 100)}") from None


def _out_folder(text: str) -> str:
    try:
        check_out_folder(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _one_line_error(parser: argparse.ArgumentParser):
    """``parser.error`` that prints one line, ``PROG: error: MESSAGE`` (the usage is in --help), exit 2."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(message).split())}\n")

    return error


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` options, shared by ``python -m fp8kv.notebooks`` and ``fp8kv notebooks run``.

    Values are checked while parsing (a bad one exits with status 2 and one line on stderr).
    """
    parser.error = _one_line_error(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                      help="small sizes (default unless DEVICE is a CUDA device)")
    mode.add_argument("--full", dest="smoke", action="store_false", help="full sizes (default on a CUDA device)")
    # "extend": a repeated --only adds its names (store kept only the last)
    parser.add_argument("--only", nargs="+", action="extend", metavar="NAME",
                        help="run only these notebooks (stem, file name or number prefix such as 01); repeatable")
    parser.add_argument("--timeout", type=_positive_seconds, default=None, metavar="S",
                        help="per-cell timeout, a positive whole number of seconds (default: "
                        + ", ".join(f"{v} in {k} mode" for k, v in DEFAULT_TIMEOUT_S.items()) + ")")
    parser.add_argument("--out", type=_out_folder, default="reports",
                        help="reports root folder; results go to OUT/<gpu-slug>/ (default: reports)")
    parser.add_argument("--notebooks", default=None, metavar="DIR", help="notebook folder (default: ./notebooks)")
    parser.add_argument("--device", type=_device_here, default="auto",
                        help="DEVICE parameter: auto, cpu, cuda, cuda:N; must exist here (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="SEED parameter (default: 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no per-cell progress bar")
    parser.add_argument("--param", dest="params", action="append", type=_parameter, default=[], metavar="NAME=VALUE",
                        help="override a notebook parameter in a full-size run (a Python literal: a number, a "
                             "quoted string, None, True/False, or a list or dict of them, e.g. "
                             "'VERIFY_BATCHES=[1,16,64]'); repeatable; every notebook run must declare NAME")


def add_actions(parser: argparse.ArgumentParser) -> None:
    """The ``run`` and ``list`` actions under ``parser`` (``fp8kv notebooks`` / ``python -m fp8kv.notebooks``),
    and ``index`` and ``render`` named for ``--help`` (:func:`main` hands those to their own parsers).

    Parse with them, then call :func:`run_action` on the result.
    """
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="execute notebooks/*.ipynb, render HTML, write reports/<gpu-slug>/")
    add_run_arguments(run)
    run.set_defaults(parser=run)
    ls = actions.add_parser("list", help="list the notebooks a run would execute, in order")
    ls.add_argument("--notebooks", default=None, metavar="DIR", help="notebook folder (default: ./notebooks)")
    ls.set_defaults(parser=ls)
    # listed for --help only: their arguments are parsed by index_main / render_main, which main() calls first
    actions.add_parser("index", help="rebuild OUT/index.html across every GPU's report (index --help)", add_help=False)
    actions.add_parser("render", help="render the HTML pages of a report folder whose export failed (render --help)",
                       add_help=False)


def run_action(args: argparse.Namespace) -> int:
    """Carry out the parsed ``run`` or ``list`` action (see :func:`add_actions`); return the exit status."""
    if args.action == "list":
        try:
            books = discover_notebooks(args.notebooks)
        except ValueError as exc:
            args.parser.error(str(exc))
        for book in books:
            print(book.stem)
        return 0
    try:
        check_run_args(args)
    except (TypeError, ValueError) as exc:
        args.parser.error(str(exc))
    return run_from_args(args)


def check_run_args(args: argparse.Namespace) -> None:
    """What ``notebooks run`` would otherwise find only after starting: the seed, the notebooks named by
    --only and the --param overrides (the device, the timeout and the reports folder are checked as they are
    parsed).
    Raises ValueError naming the flag."""
    from ..checks import run_seed
    from .parameters import check_parameters

    run_seed(args.seed, "--seed")

    names = [n for n, _ in args.params]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--param names {twice} more than once; give each parameter one value")
    books = discover_notebooks(args.notebooks, args.only)
    if args.params:
        from ..device import resolve_device
        from .setup import machine_defaults

        smoke = machine_defaults(resolve_device(args.device))[0] if args.smoke is None else args.smoke
        check_parameters(books, dict(args.params), smoke=smoke)


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed ``run`` options; print the summary; return the exit status.

    0: every notebook ran; 1: some failed (the report is published with them); 2: bad arguments
    (one line on stderr); 128 + N: stopped by signal N (SIGHUP 129, SIGINT 130, SIGTERM 143), only the
    notebooks that finished published.
    """
    prog = "fp8kv notebooks run"
    print(f"{prog}: device {args.device}, notebooks from {args.notebooks or default_notebook_dir()}, "
          f"out {args.out}", flush=True)
    try:
        manifest = run_notebooks(args.notebooks, args.out, smoke=args.smoke, only=args.only, timeout=args.timeout,
                                 device=args.device, seed=args.seed, progress=args.progress,
                                 parameters=dict(args.params))
    except (TypeError, ValueError) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:
        print(f"{prog}: {exc}; " + ("the notebooks that finished were published, the others keep their previous "
                                    "pages" if exc.published else "nothing had finished: the previous report (if "
                                    "any) is unchanged"), file=sys.stderr)
        return 128 + exc.signum
    folder = Path(args.out) / manifest["report_dir"]
    print(f"\nreport: {folder}  ({manifest['mode']}, {manifest['duration_s']:.0f} s); "
          f"all GPUs: {Path(args.out) / INDEX}")
    for e in manifest["notebooks"]:
        kept = "" if e["name"] in manifest["ran"] else "  (kept from the previous run)"
        print(f"  {e['status']:>6}  {e['name']}  {e['html'] or '(no html)'}{kept}")
    failed_now = [n for n in manifest["failed"] if n in manifest["ran"]]
    if failed_now:
        print(f"FAILED: {', '.join(failed_now)} (see their .html / .ipynb in the report)", file=sys.stderr)
        return 1
    return 0


def index_main(argv: Sequence[str]) -> int:
    """``python -m fp8kv.notebooks index [--out reports]``: rebuild ``<out>/index.html`` from the folders there."""
    parser = argparse.ArgumentParser(prog="fp8kv notebooks index",
                                     description="Build OUT/index.html, one page across every GPU's report.")
    parser.error = _one_line_error(parser)
    parser.add_argument("--out", type=_out_folder, default="reports",
                        help="reports root holding the <gpu-slug>/ folders (default: reports)")
    args = parser.parse_args(list(argv))
    root = Path(args.out)
    if not root.is_dir():
        print(f"{parser.prog}: error: out={args.out!r} is not a folder; run the notebooks first", file=sys.stderr)
        return 2
    try:
        path = build_index(root)
    except ValueError as exc:  # a path it writes is a folder: one line naming it
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"index: {path} ({len(report_folders(root))} report folder(s))")
    return 0


def render_main(argv: Sequence[str]) -> int:
    """``python -m fp8kv.notebooks render FOLDER``: the HTML pages of a run whose export failed."""
    parser = argparse.ArgumentParser(prog="fp8kv notebooks render",
                                     description="Render the pages of a report folder whose notebooks ran but "
                                                 "whose HTML export failed (e.g. nbconvert without its templates).")
    parser.error = _one_line_error(parser)
    parser.add_argument("folder", help="a report folder, such as reports/nvidia-h200")
    args = parser.parse_args(list(argv))
    try:
        names = render_report(args.folder)
    except ValueError as exc:  # a foreign or damaged report folder: one line naming the file
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"rendered {len(names)} page(s) in {args.folder}: {', '.join(names) or 'none needed'}")
    try:
        build_index(Path(args.folder).parent)
    except ValueError as exc:  # the pages are rendered; the index, a path of which is a folder, is not
        print(f"{parser.prog}: error: the index was not rebuilt: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fp8kv.notebooks [run|list|index|render] [options]``, the same as ``fp8kv notebooks ...``.

    Without an action, ``run`` is meant: ``python -m fp8kv.notebooks --smoke`` runs the notebooks.
    """
    from ..checks import ArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "index":
        return index_main(argv[1:])
    if argv and argv[0] == "render":
        return render_main(argv[1:])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    parser = ArgumentParser(prog="fp8kv notebooks", description="Run the notebooks headless and publish "
                                                                "reports/<gpu>/.")
    add_actions(parser)
    return run_action(parser.parse_args(argv))
