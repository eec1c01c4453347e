#!/usr/bin/env python
"""Interleaved A/B of two copies of the fp8kv package on one GPU: does a refactor change performance?

Runs the same command (by default a decode bench grid; ``--step`` adds a model step) alternately under
package root A and package root B, ``--rounds`` times each (A B A B ...), each in a fresh process with
its own ``--out`` folder, then pairs every row of A with the same case in B and reports, per case, the
median time under each and B / A. The rows of every run are kept under ``--out``.

Usage (repository root; the other package's root holds its ``fp8kv/`` folder):
    git worktree add /tmp/old <commit>            # or: git archive <commit> fp8kv | tar -x -C /tmp/old
    python scripts/ab_packages.py --a /tmp/old --b . --out results/ab/<name>
Options: --grid {decode,layouts} (repeatable; default: both, unless --step or --bench-args is given), --step,
--rounds N, --bench-args '...'.
Exit status 0; the JSON summary is ``<out>/ab.json`` and a table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd

GRIDS = {
    # the target layout at the batch and latency points, bf16 and FP8, fp8kv's Triton backend
    "decode": ["-m", "fp8kv.bench", "--heads", "32:8", "--head-dims", "128", "--batches", "1", "64",
               "--contexts", "4096", "16384", "--kv-dtypes", "bf16", "fp8_e4m3", "--backends", "triton"],
    # head layouts beside it at B = 64 x 16k
    "layouts": ["-m", "fp8kv.bench", "--heads", "14:2", "32:32", "--head-dims", "64", "--batches", "64",
                "--contexts", "16384", "--kv-dtypes", "bf16", "fp8_e4m3", "--backends", "triton"],
}
STEP = ["-m", "fp8kv.step", "--model", "Qwen3-0.6B", "--contexts", "4096", "--batches", "16", "64",
        "--weights", "random"]
KEYS = ["backend", "kv_dtype", "mode", "num_q_heads", "num_kv_heads", "head_dim", "batch", "context"]
STEP_KEYS = ["model", "kv_dtype", "batch", "context"]


def run_one(root: Path, args: list[str], out: Path, extra: list[str]) -> pd.DataFrame:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *args, "--out", str(out), "--quiet", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    frames = [pd.read_csv(p) for p in sorted(out.rglob("*.csv"))]
    if proc.returncode != 0 or not frames:
        raise SystemExit(f"{' '.join(cmd)} under {root} exited {proc.returncode}; see {out / 'log.txt'}")
    return pd.concat(frames, ignore_index=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", type=Path, required=True, help="package root A (the baseline)")
    p.add_argument("--b", type=Path, required=True, help="package root B (the change)")
    p.add_argument("--grid", action="append", choices=sorted(GRIDS), help="bench grids (default: all)")
    p.add_argument("--step", action="store_true", help="also a model step (Qwen3-0.6B, random weights)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each package, interleaved (default 2)")
    p.add_argument("--rep", type=int, help="ms of repetitions per case, passed to each command")
    p.add_argument("--bench-args", help="a bench command line of your own instead of the grids, e.g. "
                   "'--preset smoke --interpret' (split on spaces)")
    p.add_argument("--out", type=Path, required=True, help="folder for every run's rows and ab.json")
    a = p.parse_args(argv)
    grids = a.grid or ([] if a.step or a.bench_args else sorted(GRIDS))
    jobs = [(g, GRIDS[g], KEYS, "time_us") for g in grids]
    if a.bench_args:
        jobs = [("bench", ["-m", "fp8kv.bench", *a.bench_args.split()], KEYS, "time_us")]
    if a.step:
        jobs.append(("step", STEP, STEP_KEYS, "step_us"))
    summary = []
    for name, args, keys, col in jobs:
        times: dict[str, dict[tuple, list[float]]] = {"A": {}, "B": {}}
        cases: dict[tuple, dict] = {}
        for r in range(a.rounds):
            for side, root in (("A", a.a), ("B", a.b)):
                df = run_one(root.resolve(), args, a.out / f"{name}-{side}{r}", [] if a.rep is None else ["--rep", str(a.rep)])
                keep = [k for k in keys if k in df.columns]
                if "status" in df.columns:
                    df = df[df["status"].isin(["ok", "passed"])]
                for key, rows in df.groupby(keep, dropna=False):
                    key = tuple(key)
                    cases[key] = dict(zip(keep, key, strict=True))
                    times[side].setdefault(key, []).extend(rows[col].tolist())
        for key in sorted(set(times["A"]) & set(times["B"]), key=str):
            ta, tb = statistics.median(times["A"][key]), statistics.median(times["B"][key])
            summary.append(dict(grid=name, case=cases[key], a_us=ta, b_us=tb, b_over_a=tb / ta,
                                a_runs=len(times["A"][key]), b_runs=len(times["B"][key])))
    (a.out / "ab.json").write_text(json.dumps(summary, indent=1, default=str))
    for s in summary:
        print(f"{s['grid']:8s} {s['case']}  A {s['a_us']:9.1f} us  B {s['b_us']:9.1f} us  B/A {s['b_over_a']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
