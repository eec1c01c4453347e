"""``python -m fp8kv.bench.tune``: measure the decode kernel's launch parameters on this GPU and write
its launch table (:mod:`fp8kv.launch_table`), which :func:`fp8kv.ops.default_config` then uses.

For each compiled shape of the tensor-core kernel (KV kind, head dim, padded query rows), on one
head layout that has it (:data:`SHAPES`):

1. every candidate launch (:func:`candidates`: tiles of half, the same and twice the rule's tokens,
   4 or 8 warps, 2 or 3 pipeline stages) is timed at a bandwidth-bound point (:data:`POINT`), each
   row checked against the fp32 oracle first, as every benchmark row is;
2. the fastest candidate that passed replaces the rule's launch only where it is at least
   :data:`MARGIN` faster, and
3. only if it is not more than :data:`MARGIN` slower than the rule at the confirmation points
   (:data:`CONFIRM`: a batch that runs in one split, and a latency-bound one).

Every row timed is saved as a benchmark run (``results/bench/<gpu>/``, preset ``tune``-table), and
each table entry keeps its shape, point and the two times, so the table can be traced to them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import pandas as pd
import torch

from .. import checks, launch_table
from ..capability import interpreter_on, use_interpreter
from ..formats import is_fp8
from ..interrupts import signals_ignored, stop_signals_as_keyboard_interrupt
from ..results import save_or_fallback, utc_stamp
from ..sweeps import interruptible
from .cases import Case, sweep
from .measure import run
from .report import save

# (Hq, Hkv, D): one layout per compiled shape: GQA groups of 4 (16 padded rows) at each head dim a
# model family uses, and the MQA groups cut into programs of 36 (Falcon-7B) and 48 (StarCoder) rows.
SHAPES = ((32, 8, 64), (32, 8, 80), (32, 8, 96), (32, 8, 112), (32, 8, 128), (32, 8, 256), (71, 1, 64),
          (48, 1, 128))
POINT = (64, 16384)  # (batch, context) where the candidates are ranked: 1M tokens, bandwidth-bound
CONFIRM = ((256, 4096), (2, 4096))  # a winner must also hold here: one split per sequence; latency-bound
MARGIN = 0.03  # a candidate replaces the rule when at least 3 % faster (well above replay-to-replay noise)


def group_pad(hq: int, hkv: int, head_dim: int = 128, point: tuple[int, int] = POINT, *, kv_dtype: str = "fp8_e4m3",
              mode: str = "dequant", num_sms: int = 132) -> int:
    """The padded query rows of the kernel's programs for this layout at ``point`` (batch, context) on a GPU of
    ``num_sms`` SMs: its default head tiles there (a large group is one program where the launch streams)."""
    from ..cache import PagedKVCache
    from ..ops import launch_config, padded_rows

    cache = PagedKVCache.empty(1, point[1], hkv, head_dim, kv_dtype=kv_dtype)  # only its shape is read
    cfg = launch_config(point[0], cache, mode, group=hq // hkv, num_sms=num_sms, device=torch.device("cpu"))
    return padded_rows(cfg["heads_per_program"])


def candidates(kv_fp8: bool, mode: str, head_dim: int, group_pad: int = 16) -> list[dict]:
    """The launches tried for one shape (``group_pad`` rows a program): the rule's tile halved, kept and
    doubled (16-256 tokens; 32+ in fp8 mode), times 4 / 8 warps and 2 / 3 stages; and the rule's launch itself."""
    from ..launch_options import MAX_BLOCK_N, least_block_n
    from ..ops import default_config

    rule = default_config(mode, kv_fp8, head_dim, group_pad=group_pad)
    least = least_block_n(mode)
    tiles = sorted({n for n in (rule["block_n"] // 2, rule["block_n"], rule["block_n"] * 2) if least <= n <= MAX_BLOCK_N})
    tried = [dict(block_n=n, num_warps=w, num_stages=s) for n in tiles for w in (4, 8) for s in (2, 3)]
    return tried if rule in tried else [rule, *tried]  # the rule's own launch is always timed


def _cases(shape, kv_dtype: str, mode: str, point, options: list[dict], device) -> list[Case]:
    b, ctx = point
    # a bf16 cache takes only bf16 queries (sweep's CPU default is fp16: the --interpret check of the command)
    return sweep(batches=[b], contexts=[ctx], shapes=[shape], kv_dtypes=[kv_dtype], modes=[mode],
                 backends=["triton"], granularities=["tensor"], triton_options=options, device=device,
                 q_dtype="bf16" if kv_dtype == "bf16" else None)


def choose(rows: pd.DataFrame, rule: dict, margin: float = MARGIN) -> dict | None:
    """The fastest row that ran and passed its check, as a launch, if it beats the ``rule``'s row by
    at least ``margin``; None otherwise (or when the rule's row did not run: nothing to compare)."""
    ok = rows[(rows["status"] == "ok") & (rows["check_passed"] == True)]  # noqa: E712 (a column of objects)
    keys = list(launch_table.LAUNCH_KEYS)
    is_rule = (ok[keys] == pd.Series(rule)[keys]).all(axis=1)
    if ok.empty or not is_rule.any():
        return None
    best = ok.loc[ok["time_us"].idxmin()]
    rule_us = float(ok.loc[is_rule, "time_us"].min())
    if float(best["time_us"]) > (1 - margin) * rule_us:
        return None
    return {k: int(best[k]) for k in keys} | {"us": round(float(best["time_us"]), 2), "rule_us": round(rule_us, 2)}


def check_kv_dtypes(kv_dtypes, name: str = "kv_dtypes") -> None:
    """One FP8 format and one 16-bit type at most: the table keys a shape by FP8 or 16-bit, not by format."""
    kinds = [is_fp8(kv) for kv in kv_dtypes]
    if len(set(kinds)) != len(kinds):
        checks.fail(f"{name}={list(kv_dtypes)}: tune one FP8 format and one 16-bit type at most; the "
                    "table holds one launch per kind")


def tune(shapes: Sequence[tuple[int, int, int]] = SHAPES, kv_dtypes: Sequence[str] = ("fp8_e4m3",),
         mode: str = "dequant", point=POINT, confirm=CONFIRM, margin: float = MARGIN, *, device=None,
         rep: int = 50, progress: bool = False, keep_partial: bool = False) -> tuple[dict, pd.DataFrame]:
    """Measure; return the table entries (key -> launch and evidence) and every row timed.

    An entry is written for every shape measured: the winner's launch, or the rule's own launch
    (``"kept": "rule"``) where no candidate beat it, so the table says the rule was checked there. A shape
    where not even the rule's row ran and passed gets no entry. ``keep_partial``: on KeyboardInterrupt (Ctrl-C,
    or a stop signal the CLI turns into one) the rows timed so far come back (``rows.attrs["tune"]
    ["interrupted"]`` True) with the entries of the shapes finished before it.
    """
    from ..device import resolve_device
    from ..ops import default_config
    from ..ops.decode.splits import sm_count

    checks.one_of(mode, "mode", ("dequant", "fp8"))
    checks.rep_ms(rep, "rep")  # before any shape is measured
    checks.flag(keep_partial, "keep_partial")
    checks.positive_float(margin, "margin")
    check_kv_dtypes(kv_dtypes)
    entries, frames, stopped = {}, [], False

    def timed(cases, point: str) -> pd.DataFrame:  # run, its rows kept; stopped: an interrupt ended it
        nonlocal stopped
        rows = run(cases, rep=rep, device=device, progress=progress, keep_partial=keep_partial)
        frames.append(rows.assign(tune_point=point))
        stopped = bool(rows.attrs.get("bench", {}).get("interrupted"))
        return rows

    def measure():
        for shape in shapes:
            hq, hkv, d = shape
            for kv in kv_dtypes:
                if stopped:
                    break
                fp8 = is_fp8(kv)
                sms = sm_count(resolve_device(device))
                rows_pad = group_pad(hq, hkv, d, point, kv_dtype=kv, mode=mode, num_sms=sms)
                rule = default_config(mode, fp8, d, group_pad=rows_pad)
                rows = timed(_cases(shape, kv, mode, point, candidates(fp8, mode, d, rows_pad), device), "rank")
                if stopped:
                    break
                won = choose(rows, rule, margin)
                if won is not None:
                    launch = {k: won[k] for k in launch_table.LAUNCH_KEYS}
                    for p in confirm:  # the rule's row first, then the winner's; where the entry's shape runs
                        if group_pad(hq, hkv, d, p, kv_dtype=kv, mode=mode, num_sms=sms) != rows_pad:
                            continue
                        both = timed(_cases(shape, kv, mode, p, [rule, launch], device), f"confirm B={p[0]} ctx={p[1]}")
                        if stopped:
                            break
                        ran = both["status"].eq("ok").all() and both["check_passed"].eq(True).all()
                        if not ran or float(both["time_us"].iloc[1]) > (1 + margin) * float(both["time_us"].iloc[0]):
                            won = None
                            break
                if stopped:  # this shape's confirmation was cut short: no entry for it
                    break
                key = launch_table.entry_key(fp8, mode, d, rows_pad)
                base = {"shape": [hq, hkv, d], "batch": point[0], "context": point[1]}
                if won is None:
                    rule_rows = rows[(rows[list(rule)] == pd.Series(rule)).all(axis=1) & (rows["status"] == "ok")
                                     & (rows["check_passed"] == True)]  # noqa: E712
                    if not len(rule_rows):  # nothing ran and passed here: no evidence, so no entry
                        continue
                    entries[key] = {**rule, **base, "kept": "rule", "us": round(float(rule_rows["time_us"].min()), 2)}
                else:
                    entries[key] = {**won, **base, "kept": "measured"}

    # an interrupt outside run()'s loop (its copy-bandwidth timing, a plan) keeps the frames too
    if interruptible(measure, keep_partial=keep_partial, dev=resolve_device(device)):
        stopped = True
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    rows.attrs["tune"] = {"interrupted": stopped}
    return entries, rows


def build_parser() -> argparse.ArgumentParser:
    p = checks.ArgumentParser(
        prog="python -m fp8kv.bench.tune",
        description="Measure the Triton decode kernel's launch parameters on this GPU and write its launch "
                    "table (fp8kv/data/launch_<gpu>.json), which fp8kv's decode then uses. Every row timed is "
                    "also saved under --out as a benchmark run.")
    p.add_argument("--head-dims", type=int, nargs="+", metavar="D",
                   help=f"only the layouts of these head dims (default: all of {sorted({s[2] for s in SHAPES})})")
    p.add_argument("--kv-dtypes", nargs="+", default=["fp8_e4m3"], choices=("bf16", "fp16", "fp8_e4m3", "fp8_e5m2"),
                   help="cache types to tune (default fp8_e4m3)")
    p.add_argument("--table-dir", default=None, help="where the table is written (default: the package's data)")
    p.add_argument("--out", default="results/bench", help="results folder for the rows (a sub-folder per GPU)")
    p.add_argument("--rep", type=int, default=50,
                   help=f"ms of repetitions per case, 1-{checks.MAX_REP_MS} (default 50)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run under Triton's interpreter at tiny sizes (a check of the command, not a tuning)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 written, 1 nothing ran and passed (no table written), 2 bad
    arguments or no GPU, 130 interrupted)."""
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        checks.rep_ms(args.rep, "--rep")
        for d in args.head_dims or ():
            checks.one_of(d, "--head-dims", tuple(sorted({s[2] for s in SHAPES})))
        check_kv_dtypes(args.kv_dtypes, "--kv-dtypes")
        checks.output_folder(args.out, "--out")
        if args.table_dir is not None:
            checks.output_folder(args.table_dir, "--table-dir")
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if args.interpret:
        if args.table_dir is None:
            parser.error("--interpret checks the command on CPU: give --table-dir (the package's tables are per GPU)")
        if not use_interpreter():  # python -m fp8kv.bench.tune restarts itself instead
            parser.error("--interpret has to take effect before triton is imported: run `python -m "
                         "fp8kv.bench.tune --interpret ...`, or set TRITON_INTERPRET=1 before starting Python")
    elif not torch.cuda.is_available():
        parser.error("no GPU here: the table is per GPU (add --interpret to check the command on CPU)")
    shapes = [s for s in SHAPES if args.head_dims is None or s[2] in args.head_dims]
    kw = {}
    if args.interpret or interpreter_on():  # tiny sizes: the interpreter runs every program in Python
        shapes, kw = [(4, 2, 32)], dict(point=(2, 64), confirm=((1, 32),))
    from ..device import gpu_slug

    gpu = gpu_slug()
    with stop_signals_as_keyboard_interrupt():
        entries, rows = tune(shapes, args.kv_dtypes, device=None, rep=args.rep, progress=not args.quiet,
                             keep_partial=True, **kw)
        if rows.empty and rows.attrs["tune"]["interrupted"]:
            print("interrupted before a row was measured: nothing to save", file=sys.stderr)
            return 130
        with signals_ignored():
            stamp = utc_stamp()
            csv, _ = save_or_fallback(save, rows, args.out, {"argv": argv, "preset": "tune-table"})
            if rows.attrs["tune"]["interrupted"]:  # a table is written from a whole run only
                print(f"interrupted: the rows measured are in {csv}; the table is not written", file=sys.stderr)
                return 130
            if not entries:  # every row unsupported or failed: a table entry would claim a check that never ran
                reasons = sorted(set(rows["reason"].dropna().astype(str)))[:3]
                print(f"error: no launch ran and passed its check, so the table is not written "
                      f"({'; '.join(reasons)}); the rows are in {csv}", file=sys.stderr)
                return 1
            command = " ".join(["python -m fp8kv.bench.tune", *argv])
            versions = {k: rows.iloc[0][k] for k in ("torch", "triton")}
            # each entry names the run it came from: a table is merged from several runs
            entries = {k: {**e, "rows": str(csv), "command": command, "measured": rows.iloc[0]["timestamp"], **versions}
                       for k, e in entries.items()}
            path = launch_table.write(gpu, entries, {"written": stamp}, table_dir=args.table_dir)
    for key, e in entries.items():
        print(f"{key:<24} {e['kept']:<8} block_n={e['block_n']:<4} warps={e['num_warps']} stages={e['num_stages']}"
              f"  {e.get('us')} us" + (f" (rule {e['rule_us']} us)" if "rule_us" in e else ""))
    print(f"wrote {path} and {csv}")
    return 0


if __name__ == "__main__":
    from .cli import restart_interpreted

    restart_interpreted("fp8kv.bench.tune")
    sys.exit(main())
