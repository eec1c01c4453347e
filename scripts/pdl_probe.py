"""The measurement behind ``fp8kv.ops.combine_as_dependent`` (GPU only, sm90+):

    python scripts/pdl_probe.py          # the split combine with and without programmatic dependent launch

Runs the same grid (seven head layouts at B 1/4 x 1000/4096 tokens, where the combine's launch weighs,
and 32/8/128 at B = 64 x 16k, where it should not; FP8 e4m3 with a tensor scale, page 16, bf16 queries,
the default decode dispatch) once with ``COMBINE_PDL`` off and once on, in one process, through
``fp8kv.bench.run`` (CUDA graphs, every row checked against the fp32 oracle first), and writes the rows,
a ``pdl`` column added, to ``results/bench/<gpu-slug>/<stamp>-pdl.csv``; prints the two side by side.

``…20261204T145216Z-pdl.csv`` also holds placements of the decode's trigger that the rule weighed:
``start`` (the trigger at every split decode, whatever its program count), ``end`` (after its stores),
``exit`` (no trigger: the combine launches as the decode exits) and ``auto`` (start up to one program
per SM, end above).
"""

from __future__ import annotations

import argparse

from split_rule_probe import FP8_DEFAULT, latency_cases  # the same latency grid (scripts/ is on sys.path)

from fp8kv.bench import run, save_comparison, sweep
from fp8kv.ops.decode import combine

STREAMING = [(32, 8, 128)]


def cases():
    return latency_cases() + sweep([64], [16384], shapes=STREAMING, **FP8_DEFAULT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    args = p.parse_args()
    runs, default = {}, combine.COMBINE_PDL
    try:
        for pdl in (False, True):
            combine.COMBINE_PDL = pdl
            runs[pdl] = run(cases(), progress=False, rep=50)
    finally:
        combine.COMBINE_PDL = default
    save_comparison(runs, "pdl", "pdl", args.out)


if __name__ == "__main__":
    main()
