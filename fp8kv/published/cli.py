"""``python -m fp8kv.published readme [--check]``.

``readme`` rewrites README.md's generated tables and numbers from the results files they cite;
``--check`` rewrites nothing and exits 1 with a unified diff when README.md differs from what the
files give, 2 when a cited file is missing or cannot be read (the message names it). ``values``
prints every generated name and its text.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..results import write_atomic
from .readme import check, compute, generate
from .sources import REPO, MissingSourceError, Sources

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8kv.published", description=__doc__.split("\n\n")[1])
    parser.add_argument("what", choices=["readme", "values"])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff when README.md is not current")
    parser.add_argument("--readme", default=str(REPO / "README.md"), help="the README to regenerate")
    parser.add_argument("--root", default=str(REPO), help="the repository whose results files it cites")
    args = parser.parse_args(argv)
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
