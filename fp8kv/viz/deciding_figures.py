"""Figures of "will FP8 KV pay for me?": the break-even lines and their residuals, scale health per layer and
head, the keep-16-bit advice and its price, error against context and the needle's margin.

Each takes the tidy tables of :mod:`fp8kv.analysis.breakeven`, :mod:`~fp8kv.analysis.scale_health` and
:mod:`~fp8kv.analysis.long_context` and returns a Figure; fractions are drawn as percentages.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ..results import check_rows
from .style import add_line, axis_title, color_map, measured_ticks, mode_dash, mode_symbol, require_columns

__all__ = ["PERCENT", "breakeven_lines", "breakeven_residuals", "scale_health_map", "advice_bars",
           "long_context_errors", "needle_margins"]

PERCENT = ".3~%"  # d3 format: 0.0215 -> "2.15%", 0.5 -> "50%" (never an SI prefix such as "21.5m")
ERROR_NAMES = {"kernel": "kernel vs fp32 oracle, same FP8 cache", "quantization": "FP8 storage: oracle vs exact",
               "total": "kernel vs exact (what a user gets)"}


def _grid(rows: list, cols: list, row_title, col_title, **kw):
    from plotly.subplots import make_subplots

    titles = [f"{col_title(c)} · {row_title(r)}" if len(rows) > 1 else col_title(c) for r in rows for c in cols]
    return make_subplots(rows=len(rows), cols=len(cols), subplot_titles=titles, **kw)


def _backend_name(backend, variant) -> str:
    return f"{backend}-{variant}" if isinstance(variant, str) and variant else str(backend)


def _series(kv_dtype, mode) -> str:
    return f"{kv_dtype} {mode}"


# ------------------------------------------------------------------------------------ break-even
_POINT_COLUMNS = ["backend", "batch", "kv_dtype", "mode", "tokens", "time_us", "fitted_us", "rel_residual"]


# Besides backend and batch, what keeps one line apart from another (fp8kv.analysis.breakeven's PAIR_KEYS): where
# the points hold several values of one, each gets its own column of panels (two head layouts in one panel drew
# one trace through both and marked each crossing twice)
_PANEL_KEYS = ("gpu", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "q_dtype", "layout", "window", "timing")
_HEADS = ("num_q_heads", "num_kv_heads", "head_dim")


def _panel_name(get, varying) -> str:
    """The panel column of a row (``get(column)`` reads it): its backend, and the keys in ``varying`` (the head
    layout as "32:8, D 128")."""
    name = _backend_name(get("backend"), get("variant"))
    parts = [f"{int(get('num_q_heads'))}:{int(get('num_kv_heads'))}, D {int(get('head_dim'))}"] \
        if set(_HEADS) & set(varying) else []
    parts += [f"{k} {get(k)}" for k in varying if k not in _HEADS]
    return " · ".join([name, ", ".join(parts)]) if parts else name


def _panels(points):
    """The points with their series and panel column, the batches (rows) and the panel columns, and the keys that
    set panels apart besides backend and batch."""
    data = points.copy()
    if "variant" not in data.columns:
        data["variant"] = ""
    varying = [k for k in _PANEL_KEYS if k in data.columns and data[k].nunique(dropna=False) > 1]
    data["_series"] = [_series(k, m) for k, m in zip(data["kv_dtype"], data["mode"], strict=True)]
    data["_panel"] = [_panel_name(r.get, varying) for _, r in data.iterrows()]
    order = data.sort_values(["backend", "variant", *varying], kind="stable")["_panel"]
    return data, sorted(set(data["batch"])), list(dict.fromkeys(order)), varying


def _symbols(g, name: str) -> list[str]:
    """The series' marker at each point, open where a trimmed line left the point out of its fit."""
    shape = mode_symbol(name)
    kept = g["in_fit"] if "in_fit" in g.columns else [True] * len(g)
    return [shape if bool(k) else f"{shape}-open" for k in kept]


def breakeven_lines(points, crossings=None, *, title: str | None = None) -> go.Figure:
    """Latency against KV tokens per sequence, one panel per backend (column) x batch (row), and per head layout
    (or another of the keys a line is fitted apart by, where the points hold several; named in the title): the measured
    points (markers) and their fitted lines (``fp8kv.analysis.line_points``), a colour per KV dtype and mode
    (FP8 mode dashed). With ``crossings`` (``fp8kv.analysis.crossings``), a dotted vertical line where each
    FP8 line crosses its 16-bit partner inside the measured range. Log-log axes (contexts span decades). Open
    markers: the short contexts a trimmed line left out of its fit (its line is drawn over the rest only). Where a
    line's points name several kernels (``kernel``), each kernel's part is drawn with its own line."""
    require_columns(points, _POINT_COLUMNS, "points", rows=True)
    data, batches, backends, varying = _panels(points)
    fig = _grid(batches, backends, lambda b: f"batch {b}", lambda c: c, shared_xaxes=True,
                vertical_spacing=0.08, horizontal_spacing=0.06)
    colours = color_map(data["_series"].unique())
    for i, b in enumerate(batches):
        for j, be in enumerate(backends):
            panel = data[(data["batch"] == b) & (data["_panel"] == be)]
            for name, g in panel.groupby("_series", sort=True):
                g = g.sort_values("tokens")
                style = dict(color=colours[name])
                first = i == 0 and j == 0
                fig.add_trace(go.Scatter(x=g["tokens"], y=g["time_us"], mode="markers", name=name, legendgroup=name,
                                         showlegend=first, marker=dict(symbol=_symbols(g, name), size=7, **style),
                                         hovertemplate="%{x:,} tokens: %{y:.1f} µs measured<extra>" + name
                                                       + "</extra>"), row=i + 1, col=j + 1)
                fit = g[g["in_fit"].astype(bool)] if "in_fit" in g.columns else g
                for kernel, part in _kernel_parts(fit):  # a line per kernel where the rows ran several
                    label = name + (f", {kernel} kernel" if kernel else "")
                    fig.add_trace(go.Scatter(x=part["tokens"], y=part["fitted_us"], mode="lines",
                                             name=f"{label} (fit)", legendgroup=name, showlegend=False,
                                             line=dict(dash=mode_dash(name), **style),
                                             hovertemplate="%{x:,} tokens: %{y:.1f} µs on the line<extra>" + label
                                                           + "</extra>"), row=i + 1, col=j + 1)
            if crossings is not None:
                _mark_crossings(fig, crossings, b, be, varying, colours, i + 1, j + 1)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log")
    measured_ticks(fig, "x", data["tokens"].unique(), "tokens")
    fig.update_xaxes(title_text="KV tokens per sequence (context)", row=len(batches))
    fig.update_yaxes(title_text="µs per decode step", col=1)
    fig.update_layout(title=title or ("Decode latency against context (µs, log-log): measured points and fitted "
                                      "lines (open markers: left out of the fit)"),
                      height=max(360, 280 * len(batches)), legend_title_text="KV dtype · mode")
    return fig


def _kernel_parts(points):
    """``(kernel, its points)`` in order of context: one part ("") where the points carry no kernel or one."""
    if "kernel" not in points.columns or points["kernel"].fillna("").nunique() < 2:
        return [("", points)]
    kernel = points["kernel"].fillna("")
    return [(k, points[kernel == k]) for k in kernel.loc[points["tokens"].sort_values().index].unique()]


def _mark_crossings(fig, crossings, batch, panel, varying, colours, row, col):
    require_columns(crossings, ["backend", "batch", "kv_dtype", "mode", "crossing_tokens", "tokens_lo", "tokens_hi",
                                *varying], "crossings")
    for _, r in crossings.iterrows():
        get = lambda k, r=r: r.get(k, "")  # noqa: E731  (a table without variants has none)
        if r["batch"] != batch or _panel_name(get, varying) != panel:
            continue
        x = r["crossing_tokens"]
        if not (isinstance(x, float) and math.isfinite(x) and r["tokens_lo"] <= x <= r["tokens_hi"]):
            continue
        name = _series(r["kv_dtype"], r["mode"])
        fig.add_vline(x=x, line_dash="dot", line_color=colours.get(name, "gray"), row=row, col=col)
        fig.add_annotation(x=math.log10(x), y=1, yref=f"{_axis(fig, row, col, 'y')} domain",
                           xref=_axis(fig, row, col, "x"), text=f"{name}: {x:,.0f}", showarrow=False,
                           font=dict(size=10, color=colours.get(name, "gray")), yanchor="bottom")


def _axis(fig, row, col, letter) -> str:
    """The axis reference ("x", "x2", ...) of subplot (row, col)."""
    ref = fig.get_subplot(row, col)
    anchor = ref.xaxis.anchor if letter == "y" else ref.yaxis.anchor
    return anchor


def breakeven_residuals(points, *, max_rel_residual: float = 0.05, title: str | None = None) -> go.Figure:
    """Each point's distance from its fitted line, ``(measured - fitted) / measured`` (%), against KV tokens,
    panels as :func:`breakeven_lines`; dashed lines at ``± max_rel_residual`` (the fit's refusal threshold). Open
    markers: short contexts a trimmed line left out, measured against the line fitted without them."""
    require_columns(points, _POINT_COLUMNS, "points", rows=True)
    if not (isinstance(max_rel_residual, (int, float)) and 0 < max_rel_residual < 1):
        raise ValueError(f"max_rel_residual={max_rel_residual!r}; expected a fraction in (0, 1)")
    data, batches, backends, _ = _panels(points)
    fig = _grid(batches, backends, lambda b: f"batch {b}", lambda c: c, shared_xaxes=True, shared_yaxes=True,
                vertical_spacing=0.08, horizontal_spacing=0.04)
    colours = color_map(data["_series"].unique())
    for i, b in enumerate(batches):
        for j, be in enumerate(backends):
            panel = data[(data["batch"] == b) & (data["_panel"] == be)]
            for name, g in panel.groupby("_series", sort=True):
                for n, (kernel, part) in enumerate(_kernel_parts(g.sort_values("tokens"))):
                    label = name + (f", {kernel} kernel" if kernel else "")
                    fig.add_trace(go.Scatter(x=part["tokens"], y=part["rel_residual"], mode="lines+markers",
                                             name=name, legendgroup=name, showlegend=i == 0 and j == 0 and n == 0,
                                             line=dict(color=colours[name], dash=mode_dash(name)),
                                             marker=dict(color=colours[name], symbol=_symbols(part, name)),
                                             hovertemplate="%{x:,} tokens: %{y:.2%} off the line<extra>" + label
                                                           + "</extra>"), row=i + 1, col=j + 1)
            for sign in (1, -1):
                fig.add_hline(y=sign * max_rel_residual, line_dash="dash", line_color="gray", row=i + 1, col=j + 1)
    fig.update_xaxes(type="log")
    measured_ticks(fig, "x", data["tokens"].unique(), "tokens")
    fig.update_xaxes(title_text="KV tokens per sequence (context)", row=len(batches))
    fig.update_yaxes(tickformat=PERCENT)
    # one title for the column, on its middle row: repeated on rows 240 px apart the titles run into each other
    fig.update_yaxes(title_text="(measured − fitted) / measured (%)", row=(len(batches) + 1) // 2, col=1)
    fig.update_layout(title=title or f"Residuals of the latency lines (% of the measured time; refused beyond "
                                     f"±{max_rel_residual:.0%}; open markers: left out of the fit)",
                      height=max(320, 240 * len(batches)),
                      legend_title_text="KV dtype · mode")
    return fig


# ------------------------------------------------------------------------------------ scale health
def scale_health_map(heads, metric: str = "saturated_frac", *, title: str | None = None) -> go.Figure:
    """``metric`` (``saturated_frac`` or ``underflow_frac``, a fraction of the head's values) per layer (rows)
    x side and KV head (columns), one panel per scale method (``ScaleHealth.heads``); the colour and the hover
    in percent, one colour scale for every panel."""
    import numpy as np
    from plotly.subplots import make_subplots

    if metric not in ("saturated_frac", "underflow_frac"):
        raise ValueError(f"metric={metric!r}; expected 'saturated_frac' or 'underflow_frac'")
    require_columns(heads, ["layer", "head", "side", "method", metric], "heads")
    kv = heads[heads["side"].isin(["k", "v"])]
    require_columns(kv, ["layer", "head", "side", "method", metric], "heads (K and V rows)", rows=True)
    check_rows(kv, "scale_health_map", (), whole=("layer", "head"), expected="ScaleHealth.heads' K and V rows")
    methods = list(dict.fromkeys(kv["method"]))
    layers = sorted(set(int(x) for x in kv["layer"]))
    cols = [(s, int(h)) for s in ("k", "v") for h in sorted(set(kv["head"]))]
    names = [f"{s.upper()} h{h}" for s, h in cols]
    zmax = max(float(kv[metric].max()), 1e-6)
    fig = make_subplots(rows=1, cols=len(methods), shared_yaxes=True, horizontal_spacing=0.02,
                        subplot_titles=[f"scale {m}" for m in methods])
    for i, m in enumerate(methods):
        part = kv[kv["method"] == m]
        z = np.full((len(layers), len(cols)), np.nan)
        for r in part.itertuples(index=False):
            z[layers.index(int(r.layer)), cols.index((r.side, int(r.head)))] = getattr(r, metric)
        fig.add_trace(go.Heatmap(z=z, x=names, y=layers, zmin=0, zmax=zmax, colorscale="Viridis",
                                 showscale=i == len(methods) - 1, xgap=1, ygap=1,
                                 colorbar=dict(title=f"{axis_title(metric)} (%)", tickformat=PERCENT),
                                 hovertemplate="layer %{y}, %{x}: %{z:.3%}<extra>scale " + str(m) + "</extra>"),
                      row=1, col=i + 1)
        fig.update_xaxes(title_text="side · KV head", row=1, col=i + 1)
    fig.update_yaxes(title_text="layer", autorange="reversed", row=1, col=1)
    what = "saturated" if metric == "saturated_frac" else "flushed to zero (underflow)"
    fig.update_layout(title=title or f"Share of K and V values {what} (%), per layer and KV head, by scale method",
                      height=max(360, 18 * len(layers) + 160))
    return fig


def advice_bars(advice, *, title: str | None = None) -> go.Figure:
    """Per scale method, the model's RMS relative error (%) all-FP8 and with the advised layers 16-bit
    (``keep_bf16_advice`` / ``advice_capacity``), the held-out measurement beside where the table has
    ``heldout_all_fp8`` / ``heldout_after`` (``fp8kv.analysis.heldout_advice``), the tolerance dashed; each
    bar's hover names the layers kept and, with ``tokens_lost``, what they cost in tokens."""
    require_columns(advice, ["method", "error_all_fp8", "error_after", "tolerance", "n_layers_bf16", "n_layers"],
                    "advice", rows=True)
    check_rows(advice, "advice_bars", (), whole=("n_layers_bf16", "n_layers", "tokens_lost"),
               expected="keep_bf16_advice()'s or advice_capacity()'s table")
    bars = [("error_all_fp8", "all layers FP8"), ("error_after", "advised layers 16-bit")]
    if {"heldout_all_fp8", "heldout_after"} <= set(advice.columns):
        bars += [("heldout_all_fp8", "all FP8, held-out text"), ("heldout_after", "advised, held-out text")]
    colours = color_map([name for _, name in bars])
    methods = [str(m) for m in advice["method"]]
    cost = [f"{int(r.n_layers_bf16)} of {int(r.n_layers)} layers 16-bit"
            + (f", {int(r.tokens_lost):,} tokens fewer than all-FP8" if hasattr(r, "tokens_lost") else "")
            for r in advice.itertuples(index=False)]
    fig = go.Figure()
    for col, name in bars:
        fig.add_trace(go.Bar(x=methods, y=advice[col], name=name, marker_color=colours[name], customdata=cost,
                             texttemplate="%{y:.2%}", textposition="outside", cliponaxis=False,
                             hovertemplate="scale %{x}: %{y:.3%}<br>%{customdata}<extra>" + name + "</extra>"))
    tol = float(advice["tolerance"].iloc[0])
    add_line(fig, "y", tol, line_dash="dash", line_color="gray", annotation_text=f"tolerance {tol:.0%}",
             annotation_position="top left")
    fig.update_yaxes(title_text="RMS over layers of the relative error (%)", tickformat=PERCENT, rangemode="tozero")
    fig.update_xaxes(title_text="scale method")
    fig.update_layout(barmode="group", title=title or "Does keeping layers 16-bit bring the error under the "
                                                      "tolerance? (RMS relative error, %)")
    return fig


# ------------------------------------------------------------------------------------ long context
def long_context_errors(errors, *, statistic: str = "rel_err_median", title: str | None = None) -> go.Figure:
    """``fp8kv.analysis.long_context_error``'s errors against the context: one panel per mode (column) x entry
    (row), a line per error (the kernel's own, FP8 storage's, the total), the statistic (median over heads) with
    a bar up to the maximum over heads. Log axes (contexts double, errors span decades), errors in percent."""
    if statistic not in ("rel_err_median", "rel_err_max"):
        raise ValueError(f"statistic={statistic!r}; expected 'rel_err_median' or 'rel_err_max'")
    require_columns(errors, ["context", "entry", "mode", "error", statistic, "rel_err_max"], "errors", rows=True)
    entries, modes = list(dict.fromkeys(errors["entry"])), list(dict.fromkeys(errors["mode"]))
    fig = _grid(entries, modes, lambda e: f"fp8kv.{e}", lambda m: f"{m} mode", shared_xaxes=True, shared_yaxes=True,
                vertical_spacing=0.1, horizontal_spacing=0.04)
    names = {e: ERROR_NAMES.get(e, str(e)) for e in errors["error"].unique()}
    colours = color_map(names.values())
    for i, entry in enumerate(entries):
        for j, mode in enumerate(modes):
            panel = errors[(errors["entry"] == entry) & (errors["mode"] == mode)]
            for err, g in panel.groupby("error", sort=False):
                g = g.sort_values("context")
                name = names[err]
                y = g[statistic].clip(lower=1e-9)  # a zero error (the reference) still sits on the log axis
                fig.add_trace(go.Scatter(
                    x=g["context"], y=y, mode="lines+markers", name=name, legendgroup=name,
                    showlegend=i == 0 and j == 0, line=dict(color=colours[name]), marker=dict(color=colours[name]),
                    error_y=dict(type="data", symmetric=False, array=(g["rel_err_max"] - g[statistic]).clip(lower=0),
                                 arrayminus=[0] * len(g), color=colours[name], thickness=1),
                    customdata=g["rel_err_max"],
                    hovertemplate="%{x:,} tokens: %{y:.3%} (max over heads %{customdata:.3%})<extra>" + name
                                  + "</extra>"), row=i + 1, col=j + 1)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log", tickformat=PERCENT)
    measured_ticks(fig, "x", errors["context"].unique(), "context")
    fig.update_xaxes(title_text="context (tokens)", row=len(entries))
    fig.update_yaxes(title_text="relative error of the output (%)", col=1)
    stat = "median" if statistic == "rel_err_median" else "maximum"
    fig.update_layout(title=title or f"Attention-output error against context ({stat} over heads, bars to the "
                                     "maximum; %, log-log)", height=max(360, 300 * len(entries)),
                      legend_title_text="error")
    return fig


def needle_margins(needles, *, title: str | None = None) -> go.Figure:
    """The needle test of ``fp8kv.analysis.long_context_error`` against the context, two panels.

    Left: the needle's score margin over the runner-up (logits, the smallest over heads and queries), exact and on
    the dequantized FP8 cache, a line per entry (the scores do not depend on the mode); below the dashed zero
    line the needle lost top-1, and such points are crosses. Right: the weight the kernel gave the needle (from
    its LSE, median over heads, %) per entry and mode (FP8 mode dashed), exact attention's weight in grey."""
    from plotly.subplots import make_subplots

    require_columns(needles, ["context", "entry", "mode", "margin_exact", "margin_fp8", "needle_top1",
                              "needle_weight_exact", "needle_weight_kernel"], "needles", rows=True)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=["score margin over the runner-up (logits)", "weight on the needle (%)"])
    entries = list(dict.fromkeys(needles["entry"]))
    pairs = list(dict.fromkeys(zip(needles["entry"], needles["mode"], strict=True)))
    labels = ["exact (fp32 K/V)"] + [f"FP8 cache, fp8kv.{e}" for e in entries] + [f"fp8kv.{e} {m}" for e, m in pairs]
    colours = color_map(labels)
    exact = needles.groupby("context", as_index=False)[["margin_exact", "needle_weight_exact"]].min()
    fig.add_trace(go.Scatter(x=exact["context"], y=exact["margin_exact"], mode="lines+markers", name=labels[0],
                             line=dict(color="gray", width=3), legendgroup="exact",
                             hovertemplate="%{x:,} tokens: margin %{y:.3f} logits<extra>exact</extra>"), row=1, col=1)
    for entry in entries:
        g = needles[needles["entry"] == entry].groupby("context", as_index=False).agg(
            margin_fp8=("margin_fp8", "min"), needle_top1=("needle_top1", "all")).sort_values("context")
        name = f"FP8 cache, fp8kv.{entry}"
        fig.add_trace(go.Scatter(x=g["context"], y=g["margin_fp8"], mode="lines+markers", name=name,
                                 line=dict(color=colours[name]),
                                 marker=dict(color=colours[name], size=9,
                                             symbol=["circle" if ok else "x" for ok in g["needle_top1"]]),
                                 hovertemplate="%{x:,} tokens: margin %{y:.3f} logits<extra>" + name + "</extra>"),
                      row=1, col=1)
    fig.add_hline(y=0, line_dash="dash", line_color="gray", row=1, col=1)
    fig.add_trace(go.Scatter(x=exact["context"], y=exact["needle_weight_exact"], mode="lines", showlegend=False,
                             line=dict(color="gray", width=3), legendgroup="exact",
                             hovertemplate="%{x:,} tokens: %{y:.2%}<extra>exact</extra>"), row=1, col=2)
    for (entry, mode), g in needles.groupby(["entry", "mode"], sort=False):
        g = g.sort_values("context")
        name = f"fp8kv.{entry} {mode}"
        fig.add_trace(go.Scatter(x=g["context"], y=g["needle_weight_kernel"], mode="lines+markers", name=name,
                                 line=dict(color=colours[name], dash=mode_dash(name)),
                                 marker=dict(color=colours[name], symbol=mode_symbol(name)),
                                 hovertemplate="%{x:,} tokens: %{y:.2%} through the kernel<extra>" + name
                                               + "</extra>"), row=1, col=2)
    fig.update_xaxes(type="log", title_text="context (tokens)")
    measured_ticks(fig, "x", needles["context"].unique(), "context")
    fig.update_yaxes(title_text="margin (logits)", tickformat="~g", row=1, col=1)  # ~g: 0.004, never "4m"
    fig.update_yaxes(title_text="attention weight (%)", tickformat=PERCENT, rangemode="tozero", row=1, col=2)
    fig.update_layout(title=title or "Needle: still the top position after FP8? (margin in logits; below 0 it is "
                                     "not; weight in %)", legend_title_text="scores / weights")
    return fig
