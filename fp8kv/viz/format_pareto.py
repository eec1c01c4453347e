"""Which KV format to pick: the Pareto front of error against bytes per token, the bytes of each format split
into codes and scales, the error per layer of K and V, and the answer in words.

The figures take :func:`fp8kv.analysis.format_errors.format_table`'s table (one row per format: ``bytes_per_token``
from ``kv_footprint`` through the capacity planner, ``tokens`` that fit, ``out_rel_err`` / ``kl_mean`` /
``top1_agree``, ``tokens_per_s`` and its ``timing``) or :func:`~fp8kv.analysis.format_errors.model_format_errors`'
per-layer rows. Errors span decades, so they sit on log axes written in powers of ten. :func:`join_step_ceilings`
adds a whole decode step's tokens/s per format (:func:`fp8kv.step.ceiling_table`) as the columns of
:data:`STEP_COLUMNS`, which :func:`format_answer` quotes against the 16-bit KV's and FP8's.
"""

from __future__ import annotations

import math
import numbers

import plotly.graph_objects as go

from .. import checks
from ..results import check_rows
from .style import add_line, axis_title, color_map, require_columns

__all__ = ["ERROR_METRICS", "STEP_COLUMNS", "STEP_FP8", "pareto_front", "error_metric", "pareto_figure",
           "format_bytes", "format_layer_errors", "join_step_ceilings", "error_digits", "format_pick", "format_answer"]

# The error a format is judged by, best first: next-token KL on a model, else the attention output's error.
ERROR_METRICS = ("kl_mean", "out_rel_err")
_METRIC_TEXT = {"kl_mean": "mean KL to bf16 K/V (nats/token)",
                "out_rel_err": "attention-output relative error (mean over layers)"}
_MIN_ON_LOG = 1e-12  # a zero error (a lossless format) still sits on the log axis
_MAX_MARKER = 44  # px: the largest marker's diameter; the smallest is _MIN_MARKER
_MIN_MARKER = 9
_TABLE = "format_table()'s table (one row per format)"
# What join_step_ceilings adds: the step's model and context, the format's best tokens/s in a whole decode step, the
# batch of it and the format's ceiling (sequences that fit), and the 16-bit KV's name and best tokens/s in that step.
STEP_COLUMNS = ("step_model", "step_context", "step_tokens_per_s", "step_batch", "step_ceiling", "step_baseline",
                "step_baseline_tokens_per_s")
STEP_FP8 = "fp8_e4m3_tensor"  # the FP8 format a step's FP8 KV stores (one scale per layer and tensor), quoted beside
_CEILINGS = "fp8kv.step.ceiling_table()'s rows (with kv_format)"


def _frame(rows, arg: str):
    import pandas as pd

    if isinstance(rows, pd.DataFrame):
        return rows
    if isinstance(rows, (list, tuple)) and all(isinstance(r, dict) for r in rows):
        return pd.DataFrame(list(rows))
    checks.fail(f"{arg}={checks.show_value(rows)} ({type(rows).__name__}); expected a pandas DataFrame or a list "
                "of row dicts", TypeError)


def _numeric(df, column: str, arg: str):
    values = df[column]
    bad = [v for v in values if not isinstance(v, numbers.Real) or isinstance(v, bool)]
    if bad:
        checks.fail(f"{arg} column {column!r} holds {bad[0]!r} ({type(bad[0]).__name__}); expected numbers "
                    "(NaN where a row was not measured)", TypeError)
    return values.astype(float)


def pareto_front(rows, x: str, y: str):
    """The rows no other row beats on both ``x`` and ``y`` (smaller is better on both), sorted by ``x`` then ``y``.

    A row is dominated when another is no worse on both and better on one; rows with equal ``(x, y)`` do not
    dominate each other, so ties are all kept. Rows with NaN in ``x`` or ``y`` (not measured) are neither on the
    front nor dominating. ``rows``: a DataFrame or a list of row dicts; the result is a DataFrame of those rows
    (their index kept). Missing columns are a ValueError, non-numeric values a TypeError.
    """
    df = _frame(rows, "rows")
    require_columns(df, [x, y], "rows")
    xs, ys = _numeric(df, x, "rows").tolist(), _numeric(df, y, "rows").tolist()
    pts = [(i, a, b) for i, (a, b) in enumerate(zip(xs, ys, strict=True)) if a == a and b == b]  # NaN != NaN
    keep = [(px, py, i) for i, px, py in pts
            if not any(a <= px and b <= py and (a < px or b < py) for _, a, b in pts)]
    return df.iloc[[i for _, _, i in sorted(keep)]]


def error_metric(table) -> str:
    """The column the table's formats are judged by: ``kl_mean`` where every format has it (a model's next-token
    KL), else ``out_rel_err`` where every format has that; a ValueError naming the columns otherwise."""
    for metric in ERROR_METRICS:
        if metric in table.columns and len(table) and table[metric].notna().all():
            return metric
    checks.fail(f"table has no error measured for every format: expected one of {list(ERROR_METRICS)} without NaN; "
                f"its columns are {list(table.columns)}")


def _resolve_metric(table, error):
    if error is None:
        return error_metric(table)
    checks.one_of(error, "error", ERROR_METRICS)
    require_columns(table, [error], "table", rows=True)
    return error


def _timed(table, reader: str) -> bool:
    """Whether any format has its decode tokens/s; then the columns saying how it was timed are required, whole
    numbers where timed."""
    timed = "tokens_per_s" in table.columns and bool(table["tokens_per_s"].notna().any())
    if timed:
        require_columns(table, ["timing", "timed_batch", "timed_context"], "table (timed: it has tokens_per_s)")
        check_rows(table[table["tokens_per_s"].notna()], reader, (), whole=("timed_batch", "timed_context"),
                   expected=_TABLE)
    return timed


def _formats(table, reader: str) -> None:
    require_columns(table, ["format", "bytes_per_token", "tokens"], "table", rows=True)
    check_rows(table, reader, (), whole=("tokens",), expected=_TABLE)


def _sizes(values, largest) -> list[float]:
    """Marker diameters whose area is proportional to ``values`` (the largest ``_MAX_MARKER`` px)."""
    return [max(_MIN_MARKER, _MAX_MARKER * math.sqrt(v / largest)) if v == v and largest > 0 else _MIN_MARKER
            for v in values]


def pareto_figure(table, *, error: str | None = None, tolerance: float | None = None, model: str | None = None,
                  title: str | None = None) -> go.Figure:
    """Error against KV bytes per token, one marker per format (its own colour), the Pareto front joined by a
    grey line and its formats' names in bold. Marker area is proportional to the decode tokens/s where the
    table has timings (an open marker: a format not timed), else to the tokens that fit. ``error``: the column
    of :data:`ERROR_METRICS` drawn (default :func:`error_metric`); ``tolerance``: the error the answer allows,
    dashed (:func:`format_answer`). Log error axis in powers of ten."""
    _formats(table, "pareto_figure")
    metric = _resolve_metric(table, error)
    if tolerance is not None:
        tolerance = checks.positive_float(tolerance, "tolerance")
    data = table.dropna(subset=[metric, "bytes_per_token"])
    if data.empty:
        checks.fail(f"table has no format with both bytes_per_token and {metric!r}: nothing to draw")
    front = pareto_front(data, "bytes_per_token", metric)
    on_front = set(front["format"])
    timed = _timed(data, "pareto_figure")
    size_by = "tokens_per_s" if timed else "tokens"
    largest = float(data[size_by].max())
    colours = color_map(data["format"])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=front["bytes_per_token"], y=front[metric].clip(lower=_MIN_ON_LOG), mode="lines",
                             name="Pareto front", line=dict(color="gray", width=2, dash="dot"), hoverinfo="skip"))
    for r in data.itertuples(index=False):
        speed = getattr(r, "tokens_per_s", math.nan)
        measured = speed == speed
        how = (f"{speed:,.0f} decode tokens/s ({r.timing})" if measured else "not timed") if timed else ""
        hover = (f"<b>{r.format}</b><br>{r.bytes_per_token:,.6g} bytes/token<br>{axis_title(metric)}: "
                 f"{error_digits(getattr(r, metric), tolerance)}<br>{int(r.tokens):,} tokens fit"
                 + (f"<br>{how}" if how else ""))
        fig.add_trace(go.Scatter(
            x=[r.bytes_per_token], y=[max(getattr(r, metric), _MIN_ON_LOG)], mode="markers+text", name=r.format,
            text=[f"<b>{r.format}</b>" if r.format in on_front else r.format], textposition="top center",
            marker=dict(size=_sizes([getattr(r, size_by)], largest), color=colours[r.format], opacity=0.8,
                        symbol="circle" if (measured or not timed) else "circle-open", line=dict(width=1)),
            hovertext=[hover], hoverinfo="text"))
    fig.update_yaxes(type="log", exponentformat="power", dtick="D2", title_text=f"{_METRIC_TEXT[metric]}, log")
    if tolerance is not None:
        add_line(fig, "y", tolerance, line_dash="dash", line_color="gray", annotation_text=f"tolerance {tolerance:g}{' nats/token' if metric == 'kl_mean' else ''}",
                 annotation_position="bottom left")
    fig.update_xaxes(tickformat=",", title_text="KV bytes per token (all layers, K + V, codes + scales)")
    if timed:
        point = data.dropna(subset=["tokens_per_s"]).iloc[0]
        size_text = (f"area ∝ decode tokens/s at batch {int(point.timed_batch)}, context {int(point.timed_context):,}"
                     + (" (CPU smoke timing, meaningless for a GPU)" if point.timing == "cpu-wallclock" else "")
                     + "; open marker: not timed")
    else:
        size_text = "area ∝ tokens that fit"
    fig.update_layout(title=title or f"Error against bytes per token{', ' + model if model else ''}: the Pareto "
                                     f"front (bold)<br><sup>bytes per token; {_METRIC_TEXT[metric]}, log; marker "
                                     f"{size_text}</sup>", legend_title_text="format")
    return fig


def format_bytes(table, *, baseline_bytes: float | None = None, baseline: str = "bf16", model: str | None = None,
                 title: str | None = None) -> go.Figure:
    """Bytes per token of each format (fewest first), stacked: the codes, then the scales and zero points stored
    with each token (``code_bytes_per_token``, ``scale_bytes_per_token``); with ``baseline_bytes``, the 16-bit
    cache's bytes per token dashed."""
    require_columns(table, ["format", "code_bytes_per_token", "scale_bytes_per_token", "bytes_per_token"], "table",
                    rows=True)
    data = table.sort_values("bytes_per_token", kind="stable")
    parts = [("code_bytes_per_token", "codes"), ("scale_bytes_per_token", "scales (and zero points)")]
    colours = color_map([name for _, name in parts])
    fig = go.Figure()
    for col, name in parts:
        fig.add_trace(go.Bar(x=data["format"], y=data[col], name=name, marker_color=colours[name],
                             hovertemplate="%{x}: %{y:,.6g} bytes/token<extra>" + name + "</extra>"))
    fig.add_trace(go.Scatter(x=data["format"], y=data["bytes_per_token"], mode="text", showlegend=False,
                             text=[f"{v:,.6g}" for v in data["bytes_per_token"]], textposition="top center",
                             hoverinfo="skip"))
    if baseline_bytes is not None:
        value = checks.positive_float(baseline_bytes, "baseline_bytes")
        add_line(fig, "y", value, line_dash="dash", line_color="gray", annotation_text=f"{baseline}: {value:,.6g}",
                 annotation_position="top left")
    fig.update_yaxes(tickformat=",", rangemode="tozero", title_text="bytes per token (all layers, K + V)")
    fig.update_xaxes(title_text="format")
    fig.update_layout(barmode="stack", legend_title_text="stored",
                      title=title or f"KV bytes per token by format{', ' + model if model else ''} (bytes; codes, "
                                     "then scales and zero points)")
    return fig


def format_layer_errors(errors, *, model: str | None = None, title: str | None = None) -> go.Figure:
    """Relative error of K (left) and V (right) per layer, a line per format (``model_format_errors``' rows;
    formats that could not store the head_dim, NaN, are left out). Log error axis in powers of ten."""
    from plotly.subplots import make_subplots

    require_columns(errors, ["format", "layer", "k_rel_err", "v_rel_err"], "errors", rows=False)
    data = errors.dropna(subset=["k_rel_err", "v_rel_err"])
    if data.empty:
        checks.fail("errors has no row with both k_rel_err and v_rel_err: nothing to draw")
    check_rows(data, "format_layer_errors", (), whole=("layer",), expected="model_format_errors()' rows")
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.05,
                        subplot_titles=["K: ‖K̂ − K‖ / ‖K‖", "V: ‖V̂ − V‖ / ‖V‖"])
    colours = color_map(data["format"])
    for fmt, g in data.groupby("format", sort=False):
        g = g.sort_values("layer")
        for col, column in enumerate(("k_rel_err", "v_rel_err"), start=1):
            fig.add_trace(go.Scatter(x=g["layer"], y=g[column].clip(lower=_MIN_ON_LOG), mode="lines+markers",
                                     name=fmt, legendgroup=fmt, showlegend=col == 1,
                                     line=dict(color=colours[fmt]), marker=dict(color=colours[fmt], size=5),
                                     hovertemplate="layer %{x}: %{y:.3g}<extra>" + fmt + "</extra>"), row=1, col=col)
    fig.update_yaxes(type="log", exponentformat="power", dtick="D2")
    fig.update_yaxes(title_text="relative error (log)", col=1)
    fig.update_xaxes(title_text="layer", dtick=max(1, int(data["layer"].max()) // 10 or 1))
    name = model or (str(data["source"].iloc[0]).rstrip("/").rsplit("/", 1)[-1] if "source" in data.columns else None)
    fig.update_layout(legend_title_text="format",
                      title=title or f"K and V error per layer{', ' + name if name else ''} (relative error, "
                                     "‖x̂ − x‖ / ‖x‖, log)")
    return fig


def join_step_ceilings(table, ceilings):
    """``table`` (:func:`fp8kv.analysis.format_errors.format_table`'s) with the columns of :data:`STEP_COLUMNS` from
    ``ceilings`` (:func:`fp8kv.step.ceiling_table` of one model and context): each format's best tokens/s in a whole
    decode step (``step_tokens_per_s``, at ``step_batch``; its ``step_ceiling``), matched by the step's
    ``kv_format`` (FP8 KV is ``fp8_e4m3_tensor``), and the 16-bit KV's (``kv_format`` empty: ``step_baseline``,
    ``step_baseline_tokens_per_s``). A format the step did not run gets NaN; ``ceilings`` without rows leaves every
    step column NaN. A new DataFrame, ``table``'s rows in their order."""
    import pandas as pd

    table = _frame(table, "table")
    require_columns(table, ["format"], "table")
    ceilings = _frame(ceilings, "ceilings")
    check_rows(ceilings, "join_step_ceilings", ("model", "context", "kv_dtype", "kv_format", "best_tokens_per_s",
                                                "best_batch", "ceiling"),
               numeric=("best_tokens_per_s",), whole=("context", "best_batch", "ceiling"), expected=_CEILINGS)
    runs = list(dict.fromkeys(zip(ceilings["model"], ceilings["context"], strict=True)))
    if len(runs) > 1:
        checks.fail(f"ceilings holds {len(runs)} runs (model, context) {runs}; expected one model at one context, the "
                    "step the table's formats are read in")
    out = table.copy()
    for col in STEP_COLUMNS:
        out[col] = math.nan if col not in ("step_model", "step_baseline") else None
    if not runs:
        return out
    fmt = ceilings["kv_format"].where(ceilings["kv_format"].notna(), "").astype(str)
    base = ceilings[fmt == ""]
    by_format = ceilings[fmt != ""].assign(format=fmt[fmt != ""]).drop_duplicates("format").set_index("format")
    (model, context), = runs
    out["step_model"], out["step_context"] = str(model), int(context)
    if len(base):
        out["step_baseline"] = str(base["kv_dtype"].iloc[0])
        out["step_baseline_tokens_per_s"] = float(base["best_tokens_per_s"].iloc[0])
    for col, src in (("step_tokens_per_s", "best_tokens_per_s"), ("step_batch", "best_batch"),
                     ("step_ceiling", "ceiling")):
        out[col] = pd.to_numeric(out["format"].map(by_format[src]), errors="coerce")
    return out


def error_digits(value: float, tolerance: float | None = None) -> str:
    """``value`` to three significant digits, or as many more as tell it apart from ``tolerance`` as printed: a KL of
    0.010007 beside a tolerance of 0.01 reads "0.010007", never "0.01" (which would say it is within)."""
    if tolerance is None or value != value or value == tolerance:
        return f"{value:.3g}"
    for digits in range(3, 18):
        text = f"{value:.{digits}g}"
        if text != f"{tolerance:.{digits}g}" and float(text) != tolerance:
            return text
    return repr(float(value))


def _error_text(metric: str, row, tolerance: float) -> str:
    value = getattr(row, metric)
    side = "within" if value <= tolerance else "above"
    if metric == "kl_mean":
        text = f"mean KL {error_digits(value, tolerance)} nats/token against bf16 K/V, {side} the tolerance"
        top1 = getattr(row, "top1_agree", math.nan)
        return text + (f" (top-1 agreement {top1:.1%})" if top1 == top1 else "")
    return f"attention-output relative error {error_digits(value, tolerance)} (mean over layers), {side} the tolerance"


def _number(row, column: str) -> float:
    value = row.get(column, math.nan)
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan


def _step_text(table, pick) -> str:
    """The pick's tokens/s in a whole decode step against the 16-bit KV's and FP8's (:func:`join_step_ceilings`'
    columns), or "" where the table has none for the pick."""
    speed = _number(pick, "step_tokens_per_s")
    if not all(c in table.columns for c in STEP_COLUMNS) or speed != speed:
        return ""
    against = []
    base = _number(pick, "step_baseline_tokens_per_s")
    if base == base and base > 0:
        against.append(f"{speed / base:.2f}× {pick['step_baseline']} KV's {base:,.0f}")
    fp8 = table[table["format"] == STEP_FP8]
    fp8_speed = _number(fp8.iloc[0], "step_tokens_per_s") if len(fp8) else math.nan
    if pick["format"] != STEP_FP8 and fp8_speed == fp8_speed and fp8_speed > 0:
        against.append(f"{speed / fp8_speed:.2f}× {STEP_FP8} KV's {fp8_speed:,.0f}")
    return (f" In a whole decode step of {pick['step_model']} at context {int(pick['step_context']):,} (each KV format "
            f"to its memory ceiling), {pick['format']} KV reaches {speed:,.0f} tokens/s at batch "
            f"{int(pick['step_batch'])} (its ceiling {int(pick['step_ceiling']):,})"
            + (": " + " and ".join(against) if against else "") + ".")


def _pick(table, tolerance, error, reader):
    tolerance = checks.positive_float(tolerance, "tolerance")
    _formats(table, reader)
    metric = _resolve_metric(table, error)
    fits = table[(table["tokens"] > 0)].dropna(subset=[metric, "bytes_per_token"])
    if fits.empty:
        checks.fail(f"table has no format that fits and has its {metric!r} measured: nothing to pick")
    front = pareto_front(fits, "bytes_per_token", metric)
    within = front[front[metric] <= tolerance]
    pick = within.iloc[0] if len(within) else front.sort_values(metric, kind="stable").iloc[0]
    return pick, front, within, metric


def format_pick(table, *, tolerance: float, error: str | None = None) -> str:
    """The format :func:`format_answer` picks: of the Pareto front (error against bytes per token, formats that
    fit), the one with the fewest bytes per token whose error is within ``tolerance``, else the most accurate."""
    return str(_pick(table, tolerance, error, "format_pick")[0]["format"])


def format_answer(table, *, model: str, gpu: str, tolerance: float, smoke: bool, error: str | None = None,
                  baseline_tokens: int | None = None, baseline: str = "bf16") -> str:
    """The first-screen answer (Markdown): which format to pick for ``model`` on ``gpu``, with its numbers.

    The pick is the format of the Pareto front (error against bytes per token, formats that fit) with the
    fewest bytes per token whose error is within ``tolerance`` (in the ``error`` column's unit, default
    :func:`error_metric`); when none is, the front's most accurate, and the answer says so. Its error, bytes per
    token, the tokens that fit (``baseline_tokens``: ``baseline``'s, for the ratio) and, where timed, its decode
    tokens/s. Errors print with the digits that tell them apart from the tolerance (:func:`error_digits`), and say
    whether they are within it. Where the table has :func:`join_step_ceilings`' columns, the pick's best tokens/s in a
    whole decode step against the 16-bit KV's and :data:`STEP_FP8`'s in that step. ``smoke``: says first that the
    numbers are a smoke run's; a CPU wall-clock timing is called a CPU smoke timing whatever ``smoke`` says.
    """
    for name, value in (("model", model), ("gpu", gpu)):
        if not isinstance(value, str) or not value:
            checks.fail(f"{name}={checks.show_value(value)}; expected a non-empty name", TypeError)
    checks.flag(smoke, "smoke")
    if baseline_tokens is not None:
        baseline_tokens = checks.positive_int(baseline_tokens, "baseline_tokens")
    pick, front, within, metric = _pick(table, tolerance, error, "format_answer")
    unit = "nats/token" if metric == "kl_mean" else "(relative)"
    planned = pick.get("gpu")  # a GPU of the planner's registry: this machine's memory was not measured
    ratio = f"{pick['tokens'] / baseline_tokens:.2f}× {baseline}'s {int(baseline_tokens):,}" if baseline_tokens else ""
    if planned is None or planned != planned:
        memory = f"{gpu}'s memory" + (f" ({ratio})" if ratio else "")
    else:
        memory = f"{planned} memory (planned" + (f"; {ratio}" if ratio else "") + ")"
    parts = [_error_text(metric, pick, tolerance), f"{pick['bytes_per_token']:,.6g} bytes per token (all layers, K + V, scales "
             f"included)", f"{int(pick['tokens']):,} tokens fit in {memory}"]
    speed = pick.get("tokens_per_s", math.nan)
    if _timed(table, "format_answer") and speed == speed:
        at = f"batch {int(pick['timed_batch'])}, context {int(pick['timed_context']):,}"
        parts.append(f"{speed:,.0f} decode tokens/s at {at} from a CPU smoke timing in Triton's interpreter, "
                     "meaningless for any GPU" if pick["timing"] == "cpu-wallclock" else
                     f"{speed:,.0f} decode tokens/s at {at}")
    why = (f"the smallest format on the Pareto front within the tolerance of {tolerance:g} {unit}" if len(within) else
           f"no format on the Pareto front is within the tolerance of {tolerance:g} {unit}: this is the most "
           "accurate of them")
    text = f"For {model} on {gpu}, pick **{pick['format']}**: " + "; ".join(parts) + f". It is {why}."
    smaller = front[front["bytes_per_token"] < pick["bytes_per_token"]]
    if len(within) and len(smaller):
        nxt = smaller.iloc[-1]
        text += (f" The next smaller, {nxt['format']} ({nxt['bytes_per_token']:,.6g} bytes per token), has "
                 f"{_error_text(metric, nxt, tolerance)}.")
    text += _step_text(table, pick)
    if smoke:
        text = ("**Smoke run (no GPU: Triton's interpreter at toy sizes): the numbers below exercise the code and "
                "are not a result for any GPU.** " + text)
    return text
