"""Where an FP8 KV cache starts to pay: decode latency as a line in the context, 16-bit against FP8.

The method (vLLM's): for each line — one GPU, backend (and variant), head layout, batch, KV dtype
and mode — fit ``time_us = intercept + slope x tokens`` by least squares over the measured contexts
(``tokens``: tokens attended per sequence, the context, or the window where a row has one). Each
point is weighted by ``1 / time²`` (``relative=True``, the default): timing noise is proportional to
the time (a replayed CUDA graph varies by a percent, not by a fixed number of µs), so every point
counts by its relative error, the measure the refusal below uses too; with unit weights (plain
least squares, ``relative=False``) the long contexts' larger absolute scatter tilts the line and
pushes the short contexts' relative residuals past the threshold.
FP8 reads half the bytes per token, so its slope is lower, while its intercept (launch, dequant
set-up, split combine) may be higher; the two lines cross at::

    tokens* = (intercept_fp8 - intercept_16) / (slope_16 - slope_fp8)

and FP8 pays beyond ``tokens*`` (when its slope is the lower one).

Uncertainty: the fit's covariance propagated to ``tokens*`` (first-order, the delta method; the two
lines are independent fits, so their covariances add). The interval is ``tokens* ± t x se`` with
Student's t at 97.5 % for the smaller of the two lines' residual degrees of freedom (conservative).
It is a linearization: when the slopes differ by less than two of their standard errors
(``slope_gap_z < 2``) the lines are nearly parallel, the crossing is ill-determined and the
interval means little; the answer then says so.

A line is refused (status ``"no fit"`` with the reason; :func:`fit_line` raises :class:`LineFitError`)
when it does not hold: fewer than :data:`MIN_CONTEXTS` distinct contexts, R² below :data:`MIN_R2`
(0.98), or a point further than :data:`MAX_REL_RESIDUAL` (5 %) from the line, relative to its
measured time. R² also refuses a line that does not rise beyond its scatter (a flat, noisy line
has no slope to compare).

A launch floor bends the short end: below a few thousand tokens a decode's time is its launch and set-up,
not its bytes. With ``trim`` (the default) a line refused over all its contexts is fitted again without its
shortest contexts, one at a time, while at least :data:`MIN_TRIMMED_CONTEXTS` contexts (and half of them)
remain, and the contexts left out lie above it (slower than the line says: a floor, never a shortcut); the
first that holds is the line, over the range it was fitted on (``tokens_min``, ``left_out`` the
contexts below it). Its pair's crossing is read in that range only, and what the left-out contexts measured is
said beside it (:mod:`.measured`). Only the short end is ever left out: a line that bends anywhere else stays
refused.

:data:`BREAKEVEN_GRID` is the bench grid that measures it (:func:`fp8kv.bench.sweep` arguments).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .. import checks
from ..formats import KV_DTYPE_NAMES, is_fp8
from ..kv_formats import KV_FORMAT_NAMES
from .linefit import (
    MAX_REL_RESIDUAL,
    MIN_CONTEXTS,
    MIN_R2,
    LineFit,
    LineFitError,
    fit_line,
    least_squares,
    t975,
)
from .measured import Measured, count_text, kernel_names, kernel_spans, measured_summary

__all__ = ["BREAKEVEN_GRID", "MIN_CONTEXTS", "MIN_TRIMMED_CONTEXTS", "MIN_R2", "MAX_REL_RESIDUAL", "LINE_KEYS", "LineFit", "LineFitError",
           "fit_line", "fit_lines", "line_points", "crossings", "VERDICTS", "check_answered", "answer_text", "breakeven_context", "breakeven_answers",
           "kernel_spans", "PER_KERNEL"]

# A pair's verdict where both lines held (crossings' docstring); "" where they did not
VERDICTS = ("beyond", "every", "never", "below")
PER_KERNEL = "fitted per kernel: "  # what leads breakeven_context's by_kernel clauses wherever they are printed
MIN_TRIMMED_CONTEXTS = 5  # a line fitted without its shortest contexts keeps at least these (and half of them)

# The bench grid (fp8kv.bench.sweep's arguments): nine contexts log-spaced from 512 to 32k (multiples of
# 16, the block size), B 1/16/64, Llama-3-8B's GQA layout, both modes and FlashInfer's two variants.
BREAKEVEN_GRID = dict(batches=[1, 16, 64], contexts=[512, 864, 1456, 2432, 4096, 6896, 11584, 19488, 32768],
                      heads=[(32, 8)], head_dims=[128], block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"],
                      modes=["dequant", "fp8"], backends=["triton", "flashinfer"], granularities=["tensor"],
                      flashinfer_tensor_cores=[False, True])

# What makes one line: the bench row's columns, those beyond REQUIRED only where the rows have them.
REQUIRED = ("gpu", "backend", "kv_dtype", "mode", "batch", "context", "num_q_heads", "num_kv_heads", "head_dim",
            "time_us")
PAIR_KEYS = ("gpu", "backend", "variant", "num_q_heads", "num_kv_heads", "head_dim", "batch", "block_size",
             "q_dtype", "layout", "window", "timing")  # an FP8 line and its 16-bit partner share these
LINE_KEYS = PAIR_KEYS + ("kv_dtype", "mode", "granularity")
ANSWER_KEYS = ("gpu", "backend", "kv_dtype", "mode", "num_q_heads", "num_kv_heads", "head_dim", "batch", "status", "reason",
               "tokens_lo", "tokens_hi", "crossing_tokens", "crossing_lo", "crossing_hi", "slope_gap_z", "verdict")
_INT_KEYS = ("num_q_heads", "num_kv_heads", "head_dim", "batch", "block_size")  # block_size 0: not recorded
_KV_NAMES = (*KV_DTYPE_NAMES, *KV_FORMAT_NAMES)  # what a row's kv_dtype may name (fp8kv.formats, fp8kv.kv_formats)
_EXPECTED = "bench rows (fp8kv.bench.run() or a saved run under results/bench/<gpu>/)"
# ------------------------------------------------------------------------------------ bench rows
def _rows(df, min_tokens, max_tokens):
    """The bench rows that ran, checked, with ``tokens`` (attended per sequence) and every key column."""
    import pandas as pd

    from ..results import check_rows

    check_rows(df, "breakeven", REQUIRED, values=["time_us"], numeric=_INT_KEYS, expected=_EXPECTED)
    ran = df[df["status"] == "ok"] if "status" in df.columns else df
    if ran.empty:
        checks.fail(f"breakeven: {len(df)} rows but none ran (status 'ok'); expected {_EXPECTED}")
    ran = ran.copy()
    for col in (*_INT_KEYS, "window"):  # counts: whole and positive where given (NaN: not recorded, never required)
        if col in ran.columns:
            given = ran[col].replace("", np.nan)  # "": no window, as the line keys below write it
            v = pd.to_numeric(given, errors="coerce")
            least = 0 if col == "block_size" else 1  # block_size 0: not recorded, as the line keys below write it
            bad = ((v.isna() & (col in REQUIRED)) | (v.isna() & given.notna())
                   | (v.notna() & ~(np.isfinite(v) & (v >= least) & (v == np.floor(v)))))
            if bad.any():
                i = bad.to_numpy().nonzero()[0][0]
                checks.fail(f"breakeven: row {ran.index[i]} of rows that ran has {col}={ran[col].iloc[i]!r}; expected "
                            f"a positive whole number{'' if col in REQUIRED else ' (or none)'}; expected {_EXPECTED}")
    for col in ("gpu", "backend", "kv_dtype", "mode"):  # named in every answer ("on , with triton"), never blank
        bad = ran[col].isna() | (ran[col].astype(str).str.strip() == "")
        if col == "kv_dtype":  # a misspelt one would pair with nothing, or pass for FP8 by its prefix
            bad |= ~ran[col].isin(_KV_NAMES)
        if bad.any():
            i = bad.to_numpy().nonzero()[0][0]
            checks.fail(f"breakeven: row {ran.index[i]} of rows that ran has {col}={ran[col].iloc[i]!r}; expected "
                        + (f"a KV dtype or format among {_KV_NAMES}" if col == "kv_dtype" else "a name") + f" ({_EXPECTED})")
    window = pd.to_numeric(ran["window"].replace("", np.nan)) if "window" in ran.columns else None
    for col in LINE_KEYS:  # keys with a value in every row (NaN never equals itself, so never pairs)
        if col in _INT_KEYS:
            ran[col] = pd.to_numeric(ran[col]).fillna(0).astype(int) if col in ran.columns else 0
        elif col == "window":
            ran[col] = "" if window is None else [("" if np.isnan(w) else str(int(w))) for w in window]
        else:
            ran[col] = ran[col].fillna("").astype(str) if col in ran.columns else ""
    t, ctx = pd.to_numeric(ran["time_us"], errors="coerce"), pd.to_numeric(ran["context"], errors="coerce")
    bad = ~np.isfinite(t) | (t <= 0) | ~np.isfinite(ctx) | (ctx <= 0)
    if bad.any():
        i = bad.to_numpy().nonzero()[0][0]
        checks.fail(f"breakeven: row {ran.index[i]} of rows that ran has time_us={ran['time_us'].iloc[i]!r}, "
                    f"context={ran['context'].iloc[i]!r}; expected positive numbers")
    tokens = ctx.astype(float)
    if window is not None:  # a windowed row attends min(context, window) tokens
        tokens = tokens.where(window.isna(), np.minimum(tokens, window))
    ran["tokens"], ran["time_us"] = tokens, t.astype(float)
    keep = np.ones(len(ran), dtype=bool)
    if min_tokens is not None:
        keep &= ran["tokens"].to_numpy() >= checks.real(min_tokens, "min_tokens", minimum=0.0)
    if max_tokens is not None:
        keep &= ran["tokens"].to_numpy() <= checks.real(max_tokens, "max_tokens", minimum=0.0)
    if not keep.any():
        checks.fail(f"breakeven: no row attends tokens in [{min_tokens}, {max_tokens}]; the rows hold "
                    f"{sorted(set(ran['tokens']))}")
    return ran[keep]


def _trimmed_fit(x: np.ndarray, y: np.ndarray, thresholds: dict) -> tuple[LineFit, float] | None:
    """The first line that holds without the shortest contexts (module docstring), and where it starts."""
    contexts = np.unique(x)
    keep_at_least = max(MIN_TRIMMED_CONTEXTS, math.ceil(len(contexts) / 2))
    for start in contexts[1:len(contexts) - keep_at_least + 1]:
        kept = x >= start
        try:
            fit = fit_line(x[kept], y[kept], **thresholds)
        except LineFitError:
            continue
        # A launch floor or a set-up cost only makes short contexts slower than the line: never below it.
        if (y[~kept] >= fit.intercept + fit.slope * x[~kept]).all():
            return fit, float(start)
    return None


def _fit_groups(df, min_tokens, max_tokens, thresholds, trim):
    """(key columns, the line's rows, its fit or None, why it was refused or "", the start of its fitted range)
    per line."""
    rows = _rows(df, min_tokens, max_tokens)
    for key, g in rows.groupby(list(LINE_KEYS), sort=True, dropna=False):
        g = g.sort_values("tokens", kind="stable")
        head = dict(zip(LINE_KEYS, key, strict=True))
        yield (head, g, *_fit_one(g, thresholds, trim))


def _fit_one(g, thresholds, trim):
    """(the fit or None, why it was refused or "", the start of its fitted range) of one line's rows."""
    x, y = g["tokens"].to_numpy(float), g["time_us"].to_numpy(float)
    start = float(x.min())
    try:
        fit, reason = fit_line(x, y, **thresholds), ""
    except LineFitError as exc:
        fit, reason = None, str(exc)
        trimmed = _trimmed_fit(x, y, thresholds) if trim else None
        if trimmed is not None:
            (fit, start), reason = trimmed, ""
        elif len(np.unique(x)) >= 3:  # the refused line's numbers, to show what was refused
            fit = least_squares(x, y, thresholds["relative"])
    return fit, reason, start


def fit_lines(df, *, min_tokens: float | None = None, max_tokens: float | None = None,
              min_contexts: int = MIN_CONTEXTS, min_r2: float = MIN_R2, max_rel_residual: float = MAX_REL_RESIDUAL,
              relative: bool = True, trim: bool = True):
    """One least-squares latency line per (GPU, backend, variant, head layout, batch, ..., KV dtype, mode).

    ``df``: bench rows (columns :data:`REQUIRED`, and ``variant``, ``block_size``, ``q_dtype``, ``layout``,
    ``timing``, ``granularity``, ``window`` where present); only rows with ``status == "ok"`` count.
    ``min_tokens`` / ``max_tokens`` keep the points in that range of tokens per sequence; the thresholds and
    ``relative`` (the weights) are :func:`fit_line`'s; ``trim`` fits a line refused over all its contexts
    without its shortest ones (module docstring).

    Returns a DataFrame, one row per line: the :data:`LINE_KEYS`, ``n_points``, ``n_contexts`` (those fitted),
    ``tokens_min``, ``tokens_max`` (the range fitted), ``left_out`` (the short contexts a trimmed line left out,
    0 for a line over all of them), ``intercept_us``, ``slope_us_per_token`` (µs per token per sequence),
    ``intercept_se``, ``slope_se``, ``cov_intercept_slope``, ``dof``, ``r2``, ``max_rel_residual``,
    ``kernels`` (the kernels the rows name), ``status`` (``"ok"`` or ``"no fit"``) and ``reason``. A refused
    line keeps its numbers where it has three contexts (to show what was refused) but is never used.

    Raises ValueError (naming where the rows came from) on rows fp8kv's bench does not write: columns
    missing, no row that ran, a time or context that is not a positive number.
    """
    import pandas as pd

    checks.flag(trim, "trim")
    thresholds = dict(min_contexts=min_contexts, min_r2=min_r2, max_rel_residual=max_rel_residual, relative=relative)
    out = []
    for head, g, fit, reason, start in _fit_groups(df, min_tokens, max_tokens, thresholds, trim):
        fitted = g[g["tokens"] >= start]
        row = dict(head, n_points=len(fitted), n_contexts=int(fitted["tokens"].nunique()), tokens_min=start,
                   tokens_max=float(g["tokens"].max()), left_out=int(g.loc[g["tokens"] < start, "tokens"].nunique()))
        nan = float("nan")
        row.update(intercept_us=fit.intercept if fit else nan, slope_us_per_token=fit.slope if fit else nan,
                   intercept_se=fit.intercept_se if fit else nan, slope_se=fit.slope_se if fit else nan,
                   cov_intercept_slope=fit.cov[0][1] if fit else nan, dof=fit.dof if fit else 0,
                   r2=fit.r2 if fit else nan, max_rel_residual=fit.max_rel_residual if fit else nan)
        kernels = sorted(set(g["kernel"].dropna().astype(str))) if "kernel" in g.columns else []
        row.update(kernels=",".join(kernels), status="no fit" if reason else "ok", reason=reason)
        out.append(row)
    return pd.DataFrame(out)


def line_points(df, *, min_tokens: float | None = None, max_tokens: float | None = None, relative: bool = True,
                trim: bool = True):
    """Every point of every line with its fit: the :data:`LINE_KEYS`, ``tokens``, ``time_us``, ``fitted_us``,
    ``residual_us``, ``rel_residual`` (NaN for a line with fewer than three contexts) and ``in_fit`` (False for
    the shortest contexts a trimmed line left out, measured against the line all the same) and ``kernel`` (""
    elsewhere; where a refused line's rows ran several kernels, :func:`kernel_spans`, each kernel's points are
    measured against that kernel's own line, as in :func:`breakeven_context`'s ``by_kernel``). A refused line's
    points are here too: they show why it was refused."""
    import pandas as pd

    # A refused line is fitted all the same (where it has three contexts): its points show why.
    checks.flag(trim, "trim")
    loose = dict(min_contexts=MIN_CONTEXTS, min_r2=MIN_R2, max_rel_residual=MAX_REL_RESIDUAL, relative=relative)
    frames = []
    for head, g, fit, reason, start in _fit_groups(df, min_tokens, max_tokens, loose, trim):
        spans = kernel_spans(g["kernel"], g["tokens"]) if reason and "kernel" in g.columns else None
        parts = [("", g, fit, start)] if spans is None else [  # as breakeven_context's by_kernel: never trimmed
            (k, part, *_fit_one(part, loose, False)[::2]) for k, part in g.groupby(g["kernel"], sort=False)]
        for k, part, fit, start in parts:
            pts = part[["tokens", "time_us"]].reset_index(drop=True)
            fitted = fit.intercept + fit.slope * pts["tokens"] if fit else np.nan
            pts = pts.assign(fitted_us=fitted, residual_us=pts["time_us"] - fitted, in_fit=pts["tokens"] >= start,
                             kernel=k)
            pts["rel_residual"] = pts["residual_us"] / pts["time_us"]
            frames.append(pts.assign(**head)[[*LINE_KEYS, "tokens", "time_us", "fitted_us", "residual_us",
                                              "rel_residual", "in_fit", "kernel"]])
    return pd.concat(frames, ignore_index=True)


# ------------------------------------------------------------------------------------ crossings
def _verdict(d_int: float, d_slope: float, lo: float, hi: float) -> tuple[str, float]:
    """Where FP8 (time difference ``d_int - d_slope x tokens`` over 16-bit) pays within [lo, hi]."""
    if d_slope == 0:
        return ("every" if d_int < 0 else "never"), float("nan")
    cross = d_int / d_slope
    if d_slope > 0:  # FP8's line is the flatter one: it pays beyond the crossing
        return ("every" if cross <= lo else "never" if cross >= hi else "beyond"), cross
    return ("never" if cross <= lo else "every" if cross >= hi else "below"), cross


def crossings(lines, *, baseline: str = "bf16"):
    """Where each FP8 line crosses its ``baseline`` (16-bit) partner of the same GPU, backend, variant,
    head layout and batch (:data:`PAIR_KEYS`).

    ``lines``: :func:`fit_lines`' table. Returns one row per FP8 line: the pair keys, ``kv_dtype``, ``mode``,
    ``granularity``, ``kernels`` (those the FP8 line's rows ran: two where the decode changes kernel within
    the range, a step no single line follows), ``tokens_lo`` / ``tokens_hi`` (the range both lines hold over), ``left_out`` (the most
    short contexts either line left out), ``crossing_tokens``,
    ``crossing_se`` (delta method), ``crossing_lo`` / ``crossing_hi`` (95 %), ``slope_gap_z`` (the slopes'
    difference over its standard error), ``fp8_speedup_at_hi`` (16-bit time over FP8 time at
    ``tokens_hi``, on the lines), ``verdict`` (``"beyond"``: FP8 pays beyond the crossing; ``"every"``:
    at every measured context; ``"never"``: at none; ``"below"``: only below the crossing; ``""`` with
    no fit), ``status`` (``"ok"`` / ``"no fit"``), ``reason``, ``baseline_held`` and ``answer`` (:func:`answer_text`).
    """
    import pandas as pd

    from ..results import check_rows

    checks.one_of(baseline, "baseline", ("bf16", "fp16"))
    need = {*PAIR_KEYS, "kv_dtype", "mode", "status", "intercept_us", "slope_us_per_token", "tokens_min", "tokens_max",
            "intercept_se", "slope_se", "cov_intercept_slope", "dof"}
    check_rows(lines, "crossings", need, whole=("dof", "left_out"), expected="fit_lines()' table")
    unknown = sorted(set(map(str, lines["kv_dtype"])) - set(_KV_NAMES))  # an FP8 line is known by name, not prefix
    if unknown:
        checks.fail(f"crossings: lines has kv_dtype {unknown}; expected KV dtypes or formats among {_KV_NAMES}")
    base = {tuple(r[k] for k in PAIR_KEYS): r for _, r in lines[lines["kv_dtype"] == baseline].iterrows()}
    out = []
    for _, f in lines[lines["kv_dtype"].map(is_fp8)].iterrows():
        key = tuple(f[k] for k in PAIR_KEYS)
        row = {**{k: f[k] for k in PAIR_KEYS}, "kv_dtype": f["kv_dtype"], "mode": f["mode"],
               "granularity": f.get("granularity", ""), "kernels": f.get("kernels", "")}
        b = base.get(key)
        row.update(_crossing(f, b, baseline))
        row["answer"] = answer_text(row)
        out.append(row)
    if not out:
        checks.fail(f"crossings: the lines hold no FP8 line (kv_dtypes {sorted(set(lines['kv_dtype']))}); "
                    "expected fp8_e4m3 / fp8_e5m2 lines beside their 16-bit partners")
    return pd.DataFrame(out)


def _crossing(f, b, baseline: str) -> dict:
    nan = float("nan")
    row = dict(tokens_lo=nan, tokens_hi=nan, left_out=0, crossing_tokens=nan, crossing_se=nan, crossing_lo=nan,
               crossing_hi=nan, slope_gap_z=nan, fp8_speedup_at_hi=nan, verdict="", status="no fit", reason="",
               baseline_held=b is not None and b["status"] == "ok")
    if b is None:
        row["reason"] = f"no {baseline} line was measured beside it"
        return row
    refused = [f"the {name} line: {r['reason']}" for name, r in (("FP8", f), (baseline, b)) if r["status"] != "ok"]
    if refused:
        row["reason"] = "; ".join(refused)
        return row
    lo, hi = max(f["tokens_min"], b["tokens_min"]), min(f["tokens_max"], b["tokens_max"])
    if lo >= hi:
        row["reason"] = (f"the lines share no range of contexts (FP8 {f['tokens_min']:g}-{f['tokens_max']:g}, "
                         f"{baseline} {b['tokens_min']:g}-{b['tokens_max']:g})")
        return row
    d_int = f["intercept_us"] - b["intercept_us"]
    d_slope = b["slope_us_per_token"] - f["slope_us_per_token"]
    var_int = f["intercept_se"] ** 2 + b["intercept_se"] ** 2
    var_slope = f["slope_se"] ** 2 + b["slope_se"] ** 2
    cov = -(f["cov_intercept_slope"] + b["cov_intercept_slope"])  # Cov(d_int, d_slope), independent fits
    verdict, cross = _verdict(d_int, d_slope, lo, hi)
    if d_slope != 0:
        var = var_int / d_slope ** 2 + d_int ** 2 * var_slope / d_slope ** 4 - 2 * d_int * cov / d_slope ** 3
        se = math.sqrt(max(var, 0.0))
        t = t975(int(min(f["dof"], b["dof"])))
        row.update(crossing_tokens=cross, crossing_se=se, crossing_lo=cross - t * se, crossing_hi=cross + t * se)
    row["slope_gap_z"] = abs(d_slope) / math.sqrt(var_slope) if var_slope > 0 else math.inf
    t16, t8 = (r["intercept_us"] + r["slope_us_per_token"] * hi for r in (b, f))
    row.update(tokens_lo=lo, tokens_hi=hi, left_out=int(max(f.get("left_out", 0), b.get("left_out", 0))),
               fp8_speedup_at_hi=t16 / t8, verdict=verdict, status="ok")
    return row


def answer_text(row) -> str:
    """One line for a :func:`crossings` row: "on <gpu>, with <backend>, FP8 KV pays beyond N tokens per
    sequence at batch B", "... at every measured context ...", "... never within the measured range ...",
    "... only below N ...", or "no answer ...: <reason>"."""
    if not (hasattr(row, "keys") and hasattr(row, "get")):  # a dict or a pandas Series
        checks.fail(f"row={checks.show_value(row)} ({type(row).__name__}); expected a row of crossings() (a dict "
                    "or a pandas Series)", TypeError)
    missing = [k for k in ANSWER_KEYS if k not in row]
    if missing:
        checks.fail(f"row lacks {missing}; expected a row of crossings() (it has {sorted(map(str, row.keys()))[:12]})")
    if row["status"] == "ok":
        check_answered(row, lambda col: f"row[{col!r}]")
    backend = row["backend"] + (f"-{row['variant']}" if row.get("variant") else "")
    where = f"on {row['gpu']}, with {backend}"
    what = (f"({row['kv_dtype']} {row['mode']} against the 16-bit cache; heads {row['num_q_heads']}:"
            f"{row['num_kv_heads']}, D {row['head_dim']})")
    b = row["batch"]
    if row["status"] != "ok":
        names = kernel_names(row.get("kernels", ""))  # two: a step no single line follows
        step = f"; its rows ran the {' and '.join(names)} kernels (the decode changes kernel)" if len(names) > 1 else ""
        return f"{where}, batch {b}: no answer {what}: {row['reason']}{step}"
    measured = f"{count_text(row['tokens_lo'])}-{count_text(row['tokens_hi'])} tokens per sequence"
    span = "measured context"
    if row.get("left_out", 0):
        span = "context where both lines hold"
    interval = ""
    if math.isfinite(row["crossing_tokens"]):
        interval = f"95 % {count_text(row['crossing_lo'])} to {count_text(row['crossing_hi'])}"
        if row["slope_gap_z"] < 2:
            interval += "; ill-determined: the slopes differ by under 2 standard errors"
    v, n = row["verdict"], count_text(row["crossing_tokens"]) if math.isfinite(row["crossing_tokens"]) else ""
    outside = f"; the lines cross at {n} ({interval}), outside it" if n else ""
    if v == "beyond":
        text = f"FP8 KV pays beyond {n} tokens per sequence at batch {b} ({interval})"
    elif v == "below":
        text = f"FP8 KV pays only below {n} tokens per sequence at batch {b} (its line is the steeper one; {interval})"
    elif v == "every":
        text = f"FP8 KV pays at every {span} ({measured}{outside}) at batch {b}"
    else:
        within = "measured range" if span.startswith("measured") else "range where both lines hold"
        text = f"FP8 KV never pays within the {within} ({measured}{outside}) at batch {b}"
    return f"{where}, {text} {what}"


def check_answered(row, label) -> None:
    """An answered (``status`` "ok") row of :func:`crossings`: its verdict one of :data:`VERDICTS` and the token counts
    its sentence names finite, else a ValueError naming ``label(column)`` (an answer read "pays beyond  tokens")."""
    checks.one_of(row["verdict"], label("verdict"), VERDICTS)
    for col in ("tokens_lo", "tokens_hi", *(("crossing_tokens",) if row["verdict"] in ("beyond", "below") else ())):
        if not (isinstance(row[col], numbers.Real) and math.isfinite(row[col])):
            checks.fail(f"{label(col)}={checks.show_value(row[col])} with verdict {row['verdict']!r}; expected a "
                        "finite number of tokens")


def breakeven_context(df, *, baseline: str = "bf16", **fit_kw):
    """:func:`crossings` of :func:`fit_lines` of bench rows ``df``: ``(lines, crossings)``.
    ``fit_kw`` (``min_tokens``, ``max_tokens``, thresholds, ``trim``) go to :func:`fit_lines`.

    A pair whose lines hold over a range that leaves out its shortest contexts gets what those contexts measured
    added to its answer. A pair with no answer (a line does not hold) gets ``measured``,
    :func:`.measured.measured_summary` of its points, added to its answer, ``measured_faster_from`` (the context from which FP8 is faster at every longer one; inf:
    not at the longest) and ``measured_best_speedup``; the others get "" and NaN (their answer is the fit's).
    Where a pair has no answer and its FP8 rows ran several kernels (the decode changes kernel with the context),
    each kernel gets a line of its own over the contexts it ran, crossed with the pair's 16-bit line where that
    held, else with one refitted over the same contexts: ``by_kernel`` (a clause per kernel, also added to the
    answer after :data:`PER_KERNEL`) and ``kernel_verdicts`` (``"triton:every,gluon:every"``); "" elsewhere."""
    lines = fit_lines(df, **fit_kw)
    cross = crossings(lines, baseline=baseline)
    rows = _rows(df, fit_kw.get("min_tokens"), fit_kw.get("max_tokens"))
    got, below, segments = [], [], []
    for _, r in cross.iterrows():
        pair = np.ones(len(rows), dtype=bool)
        for k in PAIR_KEYS:
            pair &= (rows[k] == r[k]).to_numpy()
        own = pair & (rows["kv_dtype"] == r["kv_dtype"]).to_numpy() & (rows["mode"] == r["mode"]).to_numpy() & \
            (rows["granularity"] == r["granularity"]).to_numpy()
        base = pair & (rows["kv_dtype"] == baseline).to_numpy()
        segments.append(_per_kernel(rows, own, base, r, lines, baseline, fit_kw))
        if r["status"] == "ok":  # the lines' answer; what the contexts below their range measured, if any
            short = (rows["tokens"] < r["tokens_lo"]).to_numpy()
            own, base = own & short, base & short
        summary = measured_summary(zip(rows["tokens"][own], rows["time_us"][own], strict=True),
                                   zip(rows["tokens"][base], rows["time_us"][base], strict=True))
        if r["status"] == "ok":
            got.append(Measured("", math.nan, math.nan))
            below.append(f"; below {count_text(r['tokens_lo'])} tokens, off the lines, measured: {summary.text}"
                         if summary.text else "")
        else:
            got.append(summary)
            below.append(f"; measured, without a line: {summary.text}" if summary.text else "")
    cross["measured"], cross["measured_faster_from"] = [g.text for g in got], [g.faster_from for g in got]
    cross["measured_best_speedup"] = [g.best_speedup for g in got]
    cross["by_kernel"], cross["kernel_verdicts"] = [t for t, _ in segments], [v for _, v in segments]
    cross["answer"] = [a + b + (f"; {PER_KERNEL}{t}" if t else "")
                       for a, b, (t, _) in zip(cross["answer"], below, segments, strict=True)]
    return lines, cross


def _per_kernel(rows, own, base, r, lines, baseline: str, fit_kw: dict) -> tuple[str, str]:
    """Where a pair's line is refused and its FP8 rows ran several kernels (:func:`kernel_spans`), each kernel's own
    FP8 line (never trimmed: its first context is where the kernel takes over, not a launch floor) crossed with the
    16-bit line: the pair's own where it held, read over the kernel's contexts, else one refitted over them.
    Returns (a clause per kernel, ``kernel:verdict`` per kernel); ("", "") elsewhere."""
    import pandas as pd

    kernel = rows["kernel"].to_numpy(object) if "kernel" in rows.columns else None
    spans = kernel_spans(kernel[own], rows["tokens"][own]) if kernel is not None and r["status"] != "ok" else None
    if spans is None:
        return "", ""
    held = lines[(lines["kv_dtype"] == baseline) & (lines["status"] == "ok")]
    for k in PAIR_KEYS:
        held = held[held[k] == r[k]]
    clauses, verdicts = [], []
    seg_kw = dict(fit_kw, trim=False)
    tokens = rows["tokens"].to_numpy()
    for k, lo, hi in spans:
        mine = own & (kernel == k)
        if len(held):
            seg, note = pd.concat([fit_lines(rows[mine], **seg_kw), held.iloc[:1]], ignore_index=True), ""
        else:
            span = (tokens >= lo) & (tokens <= hi)
            seg, note = fit_lines(rows[mine | (base & span)], **seg_kw), f" ({baseline} line refitted over them)"
        c = crossings(seg, baseline=baseline).iloc[0]
        clauses.append(f"{k} kernel, {count_text(lo)}-{count_text(hi)} tokens{note}: {_segment_text(c)}")
        verdicts.append(f"{k}:{c['verdict'] or 'no fit'}")
    return "; ".join(clauses), ",".join(verdicts)


def _segment_text(r) -> str:
    """A :func:`crossings` row in a clause: the verdict, the crossing with its interval where it decides, the gain
    at the longest context and a warning where the lines are nearly parallel; or why no line held."""
    if r["status"] != "ok":
        return "no line holds (" + r["reason"].replace("; ", ", ") + ")"
    gain = f"{r['fp8_speedup_at_hi']:.2f}x at {count_text(r['tokens_hi'])}"
    n = count_text(r["crossing_tokens"]) if math.isfinite(r["crossing_tokens"]) else ""
    interval = (f"95 % {count_text(r['crossing_lo'])} to {count_text(r['crossing_hi'])}, "
                if r["verdict"] in ("beyond", "below") else "")
    parallel = ", ill-determined: the lines are nearly parallel" if r["slope_gap_z"] < 2 else ""
    lead = {"every": "FP8 pays at every context", "never": "FP8 never pays", "beyond": f"FP8 pays beyond {n}",
            "below": f"FP8 pays only below {n}"}[r["verdict"]]
    return f"{lead} ({interval}{gain}{parallel})"


def breakeven_answers(df, **kw) -> list[str]:
    """The one-line answers of :func:`breakeven_context` (one per FP8 line), in its order."""
    return list(breakeven_context(df, **kw)[1]["answer"])
