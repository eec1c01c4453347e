"""Reading a run's rows: :func:`speedup_table` (FP8 over the best 16-bit decode and FlashInfer's FP8),
:func:`layout_table` (one line per head layout and shape: peers, own BF16, FP8, rates, % of the limit),
:func:`summary` (a text table; :func:`preset_summary` adds what a preset's rows answer), :func:`results_markdown` (the
side-by-side Markdown table) and :func:`save` (CSV + JSON through :mod:`fp8kv.results`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pandas as pd

from ..checks import fail as _fail
from ..formats import is_fp8
from ..results import PartialResultWarning, check_rows, source_of, warn_partial
from ..sweeps import save_run, timing_notes

RUN_ROWS = "the rows of fp8kv.bench.run() (a CSV fp8kv bench saved)"


# ---------------------------------------------------------------------------------------- analysis
def check_failed(v) -> bool:
    """A check_passed cell that says the check ran and failed (None/NaN: not checked)."""
    return v is not None and not pd.isna(v) and not bool(v)


SHAPE_KEYS = ["gpu_slug", "batch", "context", "window", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
              "layout"]


def _with_page_layout(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its ``layout`` column filled: rows saved before the page layout was recorded were NHD
    (the benchmark's default)."""
    return df.assign(layout=df["layout"].astype(object).fillna("NHD") if "layout" in df.columns else "NHD")


RUN_KEY = "timestamp"  # each row's run (fp8kv.bench.run stamps one time on all the rows it returns)


def _run_keys(df: pd.DataFrame) -> list[str]:
    """[:data:`RUN_KEY`] where ``df`` records its runs: rows of different runs (other code, other machines,
    another day) are never pooled into one median."""
    return [RUN_KEY] if RUN_KEY in df.columns else []


def speedup_table(df: pd.DataFrame, baseline_kv_dtype: str = "bf16") -> pd.DataFrame:
    """FP8 rows against the best 16-bit decode and the best FlashInfer FP8 decode of the same shape.

    Uses rows with ``status == "ok"`` whose check did not fail (repeated measurements of one
    condition are reduced to their median first). For every FP8 row (backend, variant, mode,
    kv_dtype, granularity, shape): ``bf16_us`` = the fastest ``baseline_kv_dtype`` row of the shape
    over all backends (``bf16_best`` names it), ``speedup_vs_bf16 = bf16_us / time_us``;
    ``flashinfer_fp8_us`` = the fastest FlashInfer row of the shape with the same kv_dtype,
    ``speedup_vs_flashinfer_fp8 = flashinfer_fp8_us / time_us`` (NaN where there is none).
    Saved runs concatenated (:func:`fp8kv.results.load_tables`) stay apart: each run's FP8 rows are compared
    with that run's baseline, one output row per run (its ``timestamp``), never a median across runs.
    """
    need = (set(SHAPE_KEYS) - {"window", "layout"}) | {"backend", "variant", "label", "mode", "kv_dtype",
                                                        "granularity", "time_us", "status", "check_passed"}
    check_rows(df, "speedup_table", need, values=["time_us", "kv_dtype", "backend", "label", "batch", "context"],
               expected=RUN_ROWS)
    if "window" not in df.columns:  # results saved before windows were benchmarked: whole contexts
        df = df.assign(window=float("nan"))
    df = _with_page_layout(df)
    good = df[(df["status"] == "ok") & ~df["check_passed"].map(check_failed)]
    good = good[good["time_us"].notna()]
    keys = SHAPE_KEYS + _run_keys(df)
    cond = keys + ["backend", "variant", "label", "mode", "kv_dtype", "granularity"]
    med = good.groupby(cond, dropna=False, as_index=False)["time_us"].median()

    base = med[med["kv_dtype"] == baseline_kv_dtype].sort_values("time_us")
    base = base.drop_duplicates(keys)[keys + ["time_us", "label"]]
    base = base.rename(columns={"time_us": "bf16_us", "label": "bf16_best"})
    fp8_rows = med["kv_dtype"].map(is_fp8).astype(bool)  # bool even when empty: else [] selects no columns
    fi = med[(med["backend"] == "flashinfer") & fp8_rows].sort_values("time_us")
    fi = fi.drop_duplicates(keys + ["kv_dtype"])[keys + ["kv_dtype", "time_us", "label"]]
    fi = fi.rename(columns={"time_us": "flashinfer_fp8_us", "label": "flashinfer_fp8_best"})

    fp8 = med[fp8_rows]
    out = fp8.merge(base, on=keys, how="left").merge(fi, on=keys + ["kv_dtype"], how="left")
    out["speedup_vs_bf16"] = out["bf16_us"] / out["time_us"]
    out["speedup_vs_flashinfer_fp8"] = out["flashinfer_fp8_us"] / out["time_us"]
    out = out.sort_values(keys + ["backend", "variant", "mode"]).reset_index(drop=True)
    if len(med) and not len(fp8):
        out.attrs["partial"] = warn_partial("speedup_table", df, f"holds no FP8 rows that ran (kv_dtypes "
                                            f"{sorted(map(str, med['kv_dtype'].unique()))}): the table is empty")
    elif len(fp8) and not len(base):
        out.attrs["partial"] = warn_partial(
            "speedup_table", df, f"holds no {baseline_kv_dtype} rows that ran (an FP8-only run; kv_dtypes "
            f"{sorted(map(str, med['kv_dtype'].unique()))}): bf16_us and speedup_vs_bf16 are NaN, only the "
            "speed-up over FlashInfer's FP8 is filled; pass baseline_kv_dtype= the 16-bit dtype the run has")
    return out


def best_per_configuration(df: pd.DataFrame) -> pd.DataFrame:
    """The row with the highest share of the copy bandwidth of each backend × variant × KV dtype × mode
    among ``status == "ok"`` rows: where each configuration came closest to the ceiling."""
    cols = ["label", "backend", "variant", "kv_dtype", "mode", "batch", "context", "time_us", "gbps", "pct_copy_bw"]
    check_rows(df, "best_per_configuration", [*cols, "status"], values=["pct_copy_bw", "time_us", "label"],
               expected=RUN_ROWS)
    ok = df[df["status"] == "ok"]
    return (ok.sort_values("pct_copy_bw", ascending=False)
            .drop_duplicates(["backend", "variant", "kv_dtype", "mode"])[cols].reset_index(drop=True))


LAYOUT_KEYS = ["num_q_heads", "num_kv_heads", "head_dim", "batch", "context"]
PEER_BACKENDS = ("flashinfer", "vllm")  # the decodes fp8kv's kernel is measured against
PEER_NAMES = {"flashinfer-": "FlashInfer ", "vllm ": "vLLM "}  # row label prefix -> as tables print it


def page_size_table(df: pd.DataFrame, baseline_page: int = 16, fp8: str = "fp8_e4m3",
                    base: str = "bf16") -> pd.DataFrame:
    """One line per decode (backend, variant, FlashInfer's tensor-core choice) × batch × context × page size (the
    ``page-sizes`` preset's question), from checked rows (medians of repeats): ``fp8_us``, ``bf16_us``,
    ``fp8_x_bf16 = bf16_us / fp8_us`` and ``fp8_rate_of_page_<baseline_page>``, the same decode's FP8 time at
    ``baseline_page`` over its time at this page size (1.0: as fast as at 16-token pages). NaN where a side is
    missing."""
    need = ["backend", "kv_dtype", "batch", "context", "block_size", "time_us", "status", "check_passed"]
    check_rows(df, "page_size_table", need, values=need[:6], numeric=["time_us", "block_size"], expected=RUN_ROWS)
    good = df[(df["status"] == "ok") & ~df["check_passed"].map(check_failed) & df["time_us"].notna()]
    if not len(good):
        _fail(f"page_size_table: {source_of(df)} has no row that ran and passed its check against the oracle; "
              f"expected {RUN_ROWS}")
    decode = [c for c in ("backend", "variant", "tensor_cores") if c in good.columns]
    good = good.assign(**{c: good[c].map(lambda v: "" if v is None or v != v else str(v)) for c in decode[1:]})
    keys = [*decode, "batch", "context", "block_size"]
    t = good.groupby([*keys, "kv_dtype"], dropna=False)["time_us"].median().unstack("kv_dtype")
    out = pd.DataFrame({"fp8_us": t.get(fp8), "bf16_us": t.get(base)}, index=t.index)
    out["fp8_x_bf16"] = out["bf16_us"] / out["fp8_us"]
    pages = sorted(set(out.index.get_level_values("block_size")))
    if baseline_page not in pages:
        _fail(f"page_size_table: baseline_page={baseline_page!r}, but {source_of(df)} holds pages of {pages} tokens; "
              "expected one of those")
    at_base = out["fp8_us"].xs(baseline_page, level="block_size").rename("at_base")
    out = out.reset_index().merge(at_base.reset_index(), on=[*decode, "batch", "context"], how="left")
    out[f"fp8_rate_of_page_{baseline_page}"] = out.pop("at_base") / out["fp8_us"]
    return out.sort_values(keys, kind="stable").reset_index(drop=True)


def layout_table(df: pd.DataFrame) -> pd.DataFrame:
    """One line per head layout × batch × context of a run (the ``layouts`` preset's question).

    From checked rows (``status == "ok"``, check not failed; medians of repeats): ``peer_us`` the
    fastest peer decode (:data:`PEER_BACKENDS`: FlashInfer's, vLLM's Triton kernel) of either dtype
    (``peer`` names its row), ``bf16_us`` fp8kv's BF16 decode,
    ``fp8_us`` fp8kv's fastest FP8 decode (``fp8_row`` names its row, ``fp8_kernel`` the kernel
    that ran: the ``kernel`` column of :func:`fp8kv.bench.run`), ``fp8_x_peer = peer_us / fp8_us``,
    ``fp8_x_bf16 = bf16_us / fp8_us``; bytes per second of the K/V each reads (``bf16_gbps``,
    ``fp8_gbps``), ``fp8_rate_of_bf16 = fp8_gbps / bf16_gbps`` (1.0: FP8 streams as fast as BF16,
    which is 2x faster) and ``pct_of_limit``, the FP8 K/V bytes over the copy bandwidth of the same
    run as a share of ``fp8_us`` (100: FP8 at the copy kernel's rate). NaN where a side is missing.
    ``layout``: the rows' page layout (one: rows of several are refused, as are rows of several runs, whose
    copy bandwidths and code differ). Errors against the fp32 oracle on the same cache (medians of the
    rows' ``rel_err``): ``fp8_rel_err`` of the FP8 row named, ``peer_fp8_rel_err`` the lowest of the peers'
    FP8 decodes, ``fp8_err_x_peer`` their ratio (at most 1: fp8kv's FP8 decode no less accurate than the
    most accurate peer on that cache).
    """
    need = set(LAYOUT_KEYS) | {"backend", "label", "kv_dtype", "time_us", "kv_bytes", "copy_gbps", "status",
                               "check_passed"}
    check_rows(df, "layout_table", need, values=[*LAYOUT_KEYS, "backend", "label", "kv_dtype", "time_us", "kv_bytes",
                                                 "copy_gbps"], numeric=["time_us", "kv_bytes", "copy_gbps"],
               expected=RUN_ROWS)
    if not len(df):
        _fail(f"layout_table: {source_of(df)} holds no rows; expected {RUN_ROWS}")
    df = _with_page_layout(df)
    good = df[(df["status"] == "ok") & ~df["check_passed"].map(check_failed) & df["time_us"].notna()]
    if not len(good):
        _fail(f"layout_table: {source_of(df)} has no row that ran and passed its check against the oracle; "
              f"expected {RUN_ROWS}")
    if "kernel" not in good.columns:  # runs saved before the column existed
        good = good.assign(kernel=None)
    if "rel_err" not in good.columns:
        good = good.assign(rel_err=float("nan"))
    for col in ("block_size", "layout", "q_dtype", "window", "granularity", *_run_keys(good)):
        if col in good.columns and good[col].nunique(dropna=False) > 1:
            _fail(f"layout_table: {source_of(df)} mixes {col} values {sorted(map(str, good[col].unique()))}; layout_table compares head layouts "
                  f"at one {col}: select those rows first")
    med = good.groupby(LAYOUT_KEYS + ["backend", "label", "kv_dtype"], as_index=False).agg(
        time_us=("time_us", "median"), kv_bytes=("kv_bytes", "first"), copy_gbps=("copy_gbps", "first"),
        kernel=("kernel", "first"), rel_err=("rel_err", "median"))

    def fastest(rows, name):
        rows = rows.sort_values("time_us").drop_duplicates(LAYOUT_KEYS)
        return rows[LAYOUT_KEYS + ["time_us", "label", "kernel", "kv_bytes", "copy_gbps", "rel_err"]].rename(
            columns={"time_us": f"{name}_us", "label": f"{name}_row", "kernel": f"{name}_kernel",
                     "kv_bytes": f"{name}_kv_bytes", "copy_gbps": f"{name}_copy_gbps", "rel_err": f"{name}_rel_err"})

    own = med[med["backend"] == "triton"]
    peers = med[med["backend"].isin(PEER_BACKENDS)]
    peer = fastest(peers, "peer").rename(columns={"peer_row": "peer"}).drop(columns="peer_rel_err")
    peer_err = peers[peers["kv_dtype"].map(is_fp8).astype(bool)].groupby(LAYOUT_KEYS, as_index=False).agg(
        peer_fp8_rel_err=("rel_err", "min"))
    bf16 = fastest(own[~own["kv_dtype"].map(is_fp8)], "bf16")  # the 16-bit decode (fp16 on CPU smoke)
    fp8 = fastest(own[own["kv_dtype"].map(is_fp8)], "fp8")
    t = fp8.merge(bf16, on=LAYOUT_KEYS, how="outer").merge(peer, on=LAYOUT_KEYS, how="left")
    t = t.merge(peer_err, on=LAYOUT_KEYS, how="left")
    t["fp8_err_x_peer"] = t["fp8_rel_err"] / t["peer_fp8_rel_err"]
    t["fp8_x_peer"] = t["peer_us"] / t["fp8_us"]
    t["fp8_x_bf16"] = t["bf16_us"] / t["fp8_us"]
    t["bf16_gbps"] = t["bf16_kv_bytes"] / t["bf16_us"] / 1e3
    t["fp8_gbps"] = t["fp8_kv_bytes"] / t["fp8_us"] / 1e3
    t["fp8_rate_of_bf16"] = t["fp8_gbps"] / t["bf16_gbps"]
    t["pct_of_limit"] = 100.0 * t["fp8_gbps"] / t["fp8_copy_gbps"]
    cols = LAYOUT_KEYS + ["peer", "peer_us", "bf16_us", "fp8_row", "fp8_kernel", "fp8_us", "fp8_x_peer", "fp8_x_bf16", "bf16_gbps",
                          "fp8_gbps", "fp8_rate_of_bf16", "pct_of_limit", "fp8_rel_err", "peer_fp8_rel_err",
                          "fp8_err_x_peer"]
    # the one page layout of the rows (checked above), so that a table says which pages it measured
    page_layout = good["layout"].iloc[0] if len(good) else "NHD"
    out = t[cols].sort_values(LAYOUT_KEYS).reset_index(drop=True).assign(layout=page_layout)
    sides = {"fp8kv's FP8": len(fp8), "fp8kv's 16-bit": len(bf16)}
    absent = [name for name, n in sides.items() if not n]
    if len(good) and absent:
        out.attrs["partial"] = warn_partial(
            "layout_table", df, f"holds no rows of {' or '.join(absent)} decode that ran (kv_dtypes "
            f"{sorted(map(str, good['kv_dtype'].unique()))}, backends {sorted(map(str, good['backend'].unique()))}): "
            "the speed-ups over it are NaN")
    return out


def layout_markdown(table: pd.DataFrame) -> str:
    """:func:`layout_table` as the README's Markdown table (the FP8 time with the kernel that ran, where
    the run recorded it; the last column ``fp8_err_x_peer``)."""
    from ..viz import tokens_label

    head = ["Hq/Hkv/D", "B × ctx", "best peer (µs)", "fp8kv BF16 (µs)", "fp8kv FP8 (µs)", "FP8 × peer",
            "FP8 × own BF16", "BF16 GB/s", "FP8 GB/s", "FP8 rate ÷ BF16 rate", "% of FP8 limit",
            "FP8 error ÷ peers' lowest"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(v, fmt):
        return "—" if v != v else format(v, fmt)

    for r in table.itertuples():
        peer = "—" if r.peer != r.peer else f"{r.peer_us:.1f} ({_peer_name(r.peer)})"
        fp8 = f(r.fp8_us, ".1f") + (f" ({r.fp8_kernel})" if isinstance(r.fp8_kernel, str) and r.fp8_us == r.fp8_us else "")
        lines.append("| " + " | ".join([
            f"{r.num_q_heads}/{r.num_kv_heads}/{r.head_dim}", f"{r.batch} × {tokens_label(r.context)}", peer,
            f(r.bf16_us, ".1f"), fp8, f(r.fp8_x_peer, ".2f"), f(r.fp8_x_bf16, ".2f"),
            f(r.bf16_gbps, ".0f"), f(r.fp8_gbps, ".0f"), f(r.fp8_rate_of_bf16, ".2f"), f(r.pct_of_limit, ".0f"),
            f(r.fp8_err_x_peer, ".2f")]) + " |")
    return "\n".join(lines)


def _peer_name(label: str) -> str:
    """A peer's row label as the tables print it: ``"flashinfer-tc fp8_e4m3 dequant"`` -> ``"FlashInfer tc
    fp8_e4m3 dequant"``, ``"vllm bf16 dequant"`` -> ``"vLLM bf16 dequant"``."""
    for prefix, name in PEER_NAMES.items():
        if label.startswith(prefix):
            return name + label[len(prefix):]
    return label


# -------------------------------------------------------------------------------------------- save
def save(df: pd.DataFrame, out_dir: str | os.PathLike = "results/bench", meta: dict | None = None) -> Path:
    """Write ``<out_dir>/<gpu-slug>/<timestamp>.csv`` and a ``.json`` of metadata beside it (the run's
    ``df.attrs["bench"]`` updated with ``meta``), never overwriting (:func:`fp8kv.results.save_table`).
    Returns the CSV's path."""
    return save_run(df, out_dir, "bench", meta)


def save_comparison(runs: dict, setting: str, tag: str, out_dir: str | os.PathLike = "results/bench") -> Path:
    """Rows of one grid run once per value of a launch ``setting`` (``{value: rows}``), written with a
    ``setting`` column to ``<out_dir>/<gpu-slug>/<stamp>-<tag>.csv`` (:func:`fp8kv.results.save_table`:
    never overwriting); prints each shape's split count and time under every value side by side.
    Returns the CSV's path."""
    from ..results import save_table

    rows = pd.concat([r.assign(**{setting: str(v)}) for v, r in runs.items()], ignore_index=True)
    path = save_table(rows, out_dir, meta={"setting": setting, "values": [str(v) for v in runs]}, tag=tag)
    side = rows[rows["status"] == "ok"].pivot_table(index=LAYOUT_KEYS, columns=setting, values=["num_splits", "time_us"])
    print(side.to_string(float_format=lambda v: f"{v:.2f}"))
    print(f"wrote {path}")
    return path


def case_counts(cases) -> str:
    """``"24 cases: 20 ready, 4 unsupported"``: a grid's cases by status, most first."""
    counts = pd.Series([c.status for c in cases], dtype=object).value_counts()
    return f"{len(cases)} cases: " + ", ".join(f"{n} {status}" for status, n in counts.items())


def all_checks_passed(rows: pd.DataFrame, *more: pd.DataFrame) -> bool:
    """True when ``rows`` has at least one row that ran, every row that ran passed its check against
    the oracle, and neither ``rows`` nor any of ``more`` holds an error or a failed check."""
    for frame in (rows, *more):
        check_rows(frame, "all_checks_passed", ["status", "check_passed"], expected=RUN_ROWS)
    ok = rows[rows["status"] == "ok"]
    if not len(ok) or not ok["check_passed"].eq(True).all():
        return False
    return not any(f["status"].eq("error").any() or f["check_passed"].eq(False).any() for f in (rows, *more))


def summary(df: pd.DataFrame) -> str:
    """A compact text table of a run: µs, GB/s, % of copy bandwidth, check, and what did not run."""
    check_rows(df, "summary", ["label", "status", "reason"], expected=RUN_ROWS)
    ok = df[df["status"] == "ok"]
    if len(ok):
        check_rows(df, "summary", ["batch", "context", "num_splits", "time_us", "gbps", "pct_copy_bw", "rel_err",
                                   "check_passed", "copy_gbps", "gpu", "timing"], values=["time_us"], expected=RUN_ROWS)
    lines = []
    if len(ok):
        t = ok[["label", "batch", "context", "num_splits", "time_us", "gbps", "pct_copy_bw", "rel_err",
                "check_passed"]].copy()
        t.columns = ["case", "B", "ctx", "splits", "us", "GB/s", "%copy", "rel_err", "check"]
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        copy = ok["copy_gbps"].iloc[0]
        lines.append(f"copy bandwidth: {copy:.0f} GB/s on {ok['gpu'].iloc[0]}")
        lines += timing_notes(ok)
    with warnings.catch_warnings():  # a run without bf16 (CPU: fp16) rows has no speed-up table: nothing to say
        warnings.simplefilter("ignore", PartialResultWarning)
        sp = speedup_table(df) if len(ok) else pd.DataFrame()
    if len(sp) and sp["speedup_vs_bf16"].notna().any():
        t = sp[["label", "layout", "batch", "context", "time_us", "bf16_us", "speedup_vs_bf16",
                "speedup_vs_flashinfer_fp8"]]
        t.columns = ["fp8 case", "pages", "B", "ctx", "us", "best bf16 us", "x bf16", "x flashinfer fp8"]
        if t["x flashinfer fp8"].isna().all():  # a run without FlashInfer rows has no such ratio to show
            t = t.drop(columns="x flashinfer fp8")
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for status in ("unsupported", "skipped", "error"):
        rest = df[df["status"] == status]
        if len(rest):
            lines.append(f"{status} ({len(rest)}):")
            for (label, reason), grp in rest.groupby(["label", "reason"], sort=False):
                lines.append(f"  {label} x{len(grp)}: {reason}")
    return "\n".join(lines)


def preset_summary(df: pd.DataFrame, preset: str | None) -> str:
    """:func:`summary`, and for ``preset`` ``"breakeven"`` the break-even answers of its rows
    (:func:`fp8kv.analysis.breakeven_answers`: per FP8 line, the context beyond which it pays); where the rows
    answer nothing (too few contexts, a refused table), the reason, not an error: the rows are still saved."""
    text = summary(df)
    if preset != "breakeven":
        return text
    from ..analysis.breakeven import breakeven_answers

    ok = df[df["status"] == "ok"]
    try:
        answers = breakeven_answers(ok) if len(ok) else []
    except (ValueError, TypeError) as exc:  # the analysis refuses these rows: say why, keep the run
        return f"{text}\nbreak-even: no answer from these rows: {' '.join(str(exc).split())}"
    return "\n".join([text, "break-even (fp8kv.analysis.breakeven_answers):"] + [f"  {a}" for a in answers]
                      if answers else [text, "break-even: no row ran"])


def results_markdown(df: pd.DataFrame) -> str:
    """The side-by-side decode table (one line per batch × context) as Markdown, for READMEs and notes.

    Columns: median µs of each backend × KV dtype × mode (vLLM's kernel as "vLLM"); FP8 GB/s and % of
    the copy bandwidth for the Triton dequant kernel; its speedup over the best BF16 decode and over
    FlashInfer's best FP8; "–" where the run has no such row (an FP8-only run has no BF16 column, said
    by a :class:`~fp8kv.results.PartialResultWarning`).
    """
    check_rows(df, "results_markdown", ["status", "check_passed", "variant", "backend", "kv_dtype", "mode", "time_us",
                                        "gbps", "pct_copy_bw", "batch", "context"],
               values=["time_us", "kv_dtype", "backend", "batch", "context"], expected=RUN_ROWS)
    ok = df[(df["status"] == "ok") & ~df["check_passed"].map(check_failed)].copy()
    ok["variant"] = ok["variant"].astype(object).fillna("")  # read back from a CSV, an all-empty column is float
    ok["column"] = [f"FlashInfer{'' if v == 'tc' else ' (no TC)'} {k}" if b == "flashinfer"
                    else f"vLLM {k}" if b == "vllm"
                    else f"Triton {k}{' fp8-mode' if m == 'fp8' else ''}"
                    for b, v, k, m in zip(ok["backend"], ok["variant"], ok["kv_dtype"].str.replace("fp8_e4m3", "fp8"),
                                          ok["mode"], strict=True)]
    t = ok.pivot_table(index=["batch", "context"], columns="column", values="time_us", aggfunc="median")
    fp8 = ok[(ok["backend"] == "triton") & (ok["kv_dtype"] != "bf16") & (ok["mode"] == "dequant")]
    fp8 = fp8.groupby(["batch", "context"])[["gbps", "pct_copy_bw"]].median()
    bf16 = ok[ok["kv_dtype"] == "bf16"].groupby(["batch", "context"])["time_us"].min()
    fi8 = ok[(ok["backend"] == "flashinfer") & (ok["kv_dtype"] != "bf16")].groupby(["batch", "context"])["time_us"].min()
    order = [c for c in ("Triton fp8", "Triton fp8 fp8-mode", "Triton bf16", "FlashInfer fp8", "FlashInfer bf16",
                         "FlashInfer (no TC) fp8", "FlashInfer (no TC) bf16", "vLLM fp8", "vLLM bf16")
             if c in t.columns]
    head = ["B", "ctx", *[f"{c} µs" for c in order], "Triton fp8 GB/s", "% copy", "× best BF16", "× FlashInfer FP8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if len(ok) and not len(bf16):
        warn_partial("results_markdown", df, "holds no bf16 rows that ran (an FP8-only run): the × best BF16 "
                     "column is '–'")

    def cell(v, fmt):
        return "–" if v is None or v != v else format(v, fmt)

    for (b, ctx), row in t.iterrows():
        tri = row.get("Triton fp8", float("nan"))
        ours = fp8.loc[(b, ctx)] if (b, ctx) in fp8.index else {"gbps": None, "pct_copy_bw": None}
        cells = [str(b), str(ctx), *[cell(row[c], ".1f") for c in order], cell(ours["gbps"], ".0f"),
                 cell(ours["pct_copy_bw"], ".0f"), cell(bf16.get((b, ctx), float("nan")) / tri, ".2f"),
                 cell(fi8.get((b, ctx), float("nan")) / tri, ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

