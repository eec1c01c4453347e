"""The measurement behind ``fp8kv.ops.choose_num_splits``'s latency rule and ``latency_waves`` (GPU only):

    python scripts/split_rule_probe.py              # min_waves 2 and 4 at B 1/4 x 1000/4096 tokens
    python scripts/split_rule_probe.py --shapes 32/32/80 32/32/96 32/32/128 32/8/112 16/2/96

Runs the same latency-bound grid (seven head layouts, or ``--shapes``; FP8 e4m3 with a tensor scale,
page 16, bf16 queries, the default decode dispatch) once per ``min_waves`` value in one process, through
``fp8kv.bench.run`` (CUDA graphs, every row checked against the fp32 oracle first), and writes the
rows, a ``min_waves`` column added, to ``results/bench/<gpu-slug>/<stamp>-split-rule.csv`` (and its
metadata beside it); prints the two side by side.
"""

from __future__ import annotations

import argparse

from fp8kv.bench import run, save_comparison, sweep
from fp8kv.ops.decode import splits

SHAPES = [(32, 8, 128), (32, 32, 128), (8, 1, 256), (14, 2, 64), (28, 4, 128), (71, 1, 64), (40, 8, 128)]
# FP8 e4m3, tensor scale, the default dispatch of fp8kv's own decode (scripts/pdl_probe.py times the same grid)
FP8_DEFAULT = dict(kv_dtypes=["fp8_e4m3"], modes=["dequant"], backends=["triton"], granularities=["tensor"])


def latency_cases(shapes=SHAPES) -> list:
    """The latency-bound grid: ``shapes`` at B 1 / 4 x 1000 / 4096 tokens."""
    return sweep([1, 4], [1000, 4096], shapes=shapes, **FP8_DEFAULT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-waves", type=float, nargs="+", default=[2.0, 4.0], help="values to compare")
    p.add_argument("--shapes", nargs="+", default=None, metavar="HQ/HKV/D",
                   help="head layouts (default: the seven of SHAPES)")
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("/")) for s in args.shapes] if args.shapes else SHAPES
    rule, runs = splits.latency_waves, {}
    try:
        for waves in args.min_waves:
            splits.latency_waves = lambda head_dim, waves=waves: waves  # the same at every head_dim
            runs[waves] = run(latency_cases(shapes), progress=False, rep=50)
    finally:
        splits.latency_waves = rule
    save_comparison(runs, "min_waves", "split-rule", args.out)


if __name__ == "__main__":
    main()
