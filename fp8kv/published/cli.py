"""``python -m fp8kv.published readme [--check]``.

``readme`` rewrites README.md's generated tables and numbers from the results files they cite;
``--check`` rewrites nothing and exits 1 with a unified diff when README.md differs from what the
files give, 2 when a cited file is missing or cannot be read (the message names it). ``values``
prints every generated name and its text.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import checks
from ..results import write_atomic
from .readme import check, compute, generate
from .sources import REPO, MissingSourceError, Sources

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = checks.ArgumentParser(prog="python -m fp8kv.published", description=__doc__.split("\n\n")[1])
    parser.add_argument("what", choices=["readme", "values"])
    parser.add_argument("--check", action="store_true", help="readme: exit 1 with a diff when README.md is not current")
    parser.add_argument("--readme", help="readme: the README to regenerate (default: the repository's README.md)")
    parser.add_argument("--root", default=str(REPO), help="the repository whose results files it cites")
    args = parser.parse_args(argv)
    if args.what == "values":  # it reads the results files only: a readme flag would be ignored
        unused = [flag for flag, given in (("--check", args.check), ("--readme", args.readme is not None)) if given]
        if unused:
            parser.error(f"{' and '.join(unused)} {'applies' if len(unused) == 1 else 'apply'} to readme only; values "
                         "prints the generated values of --root")
    if args.readme is None:
        args.readme = str(REPO / "README.md")
    try:
        if args.what == "values":
            for name, text in compute(Sources(args.root)).items():
                print(f"{name}: {text}")
            return 0
        if args.check:
            diff = check(args.readme, args.root)
            if diff:
                sys.stdout.write(diff)
                print(f"\n{args.readme} differs from its results files: run python -m fp8kv.published readme",
                      file=sys.stderr)
                return 1
            return 0
        old, new = generate(args.readme, args.root)
        if new != old:
            write_atomic(Path(args.readme), new)
            print(f"rewrote {args.readme}")
        return 0
    except (MissingSourceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError) as e:  # a cited file of another version or shape: not "the README is out of date" (1)
        print(f"error: a cited results file lacks what the README reads from it ({type(e).__name__}: {e}); "
              "regenerate it with the script that wrote it", file=sys.stderr)
        return 2
