"""Figures of the FP8 formats and of what runs where: code values, rounding error against
magnitude, casts compared, the capability matrix."""

from __future__ import annotations

import plotly.graph_objects as go

from .style import (
    FORMAT_COLORS,
    add_line,
    color_map,
    readable_axes,
    require_columns,
    require_values,
    series_color,
)


def _formats(formats):
    from ..formats import FORMATS
    from ..formats import format as get_format

    if formats is None:
        return list(FORMATS.values())
    if isinstance(formats, str):
        formats = [formats]
    return [get_format(f, arg=f"formats[{i}]") for i, f in enumerate(formats)]


def fp8_code_values(formats=None, *, log_y: bool = True) -> go.Figure:
    """Value of every non-negative FP8 code (0x00..0x7F) of each format: the FP8 number line.

    Parameters
    ----------
    formats : format names / FP8Format objects, default all of ``fp8kv.formats.FORMATS``.
    log_y : log value axis (zero is then not drawn); the spacing of the codes is uniform in
        log scale within a binade, which is what "floating point" means.

    Negative codes mirror these. NaN/Inf codes are listed in each trace's legend name.
    """
    fig = go.Figure()
    for f in _formats(formats):
        table = f.codes()
        pos = table[table["code"] < 128]
        finite = pos[pos["kind"].isin(["zero", "subnormal", "normal"])]
        if log_y:
            finite = finite[finite["value"] > 0]
        special = pos[pos["kind"].isin(["inf", "nan"])]
        note = f" ({len(special)} inf/nan codes in 0x00-0x7F)" if len(special) else ""
        symbols = ["circle-open" if k == "subnormal" else "circle" for k in finite["kind"]]
        fig.add_trace(go.Scatter(
            x=finite["code"], y=finite["value"], mode="markers", name=f"{f.name}{note}",
            marker=dict(symbol=symbols, size=6, color=FORMAT_COLORS.get(f.name)),
            customdata=finite[["bits", "kind"]].to_numpy(),
            hovertemplate="code %{x} (%{customdata[0]})<br>value %{y:.6g}<br>%{customdata[1]}<extra>"
                          + f.name + "</extra>",
        ))
    fig.update_layout(title="FP8 code values (non-negative half; open markers = subnormals)",
                      xaxis_title="code (uint8)", yaxis_title="value", legend_title="format")
    if log_y:
        fig.update_yaxes(type="log", exponentformat="power")
    return readable_axes(fig)


def relative_error_vs_magnitude(df, *, x: str = "magnitude", y: str = "rel_error", fmt_col: str = "format",
                                show_regions: bool = True) -> go.Figure:
    """Round-trip relative error against input magnitude, log-log, one line per format.

    Parameters
    ----------
    df : DataFrame with columns ``x`` (input magnitude > 0), ``y`` (|Q(v) - v| / |v|) and ``fmt_col``
        (FP8 format names).
    show_regions : shade, per format, the subnormal range (below ``min_normal``; precision decays)
        and the saturation range (above ``max``; the value is clamped), and draw the unit roundoff
        (the bound in the normal range) as a dotted line.

    Zero errors (exactly representable inputs) cannot be drawn in log scale and are left out.
    """
    from ..formats import format as get_format

    require_columns(df, [x, y, fmt_col])
    require_values(df, x, positive=True)  # log-log axes: zeros are left out, and nothing else is drawn
    require_values(df, y, positive=True)
    fig = go.Figure()
    # Log axes first: shapes and annotations below are placed in log10 units (what plotly reads there).
    fig.update_xaxes(type="log", exponentformat="power", title="|input|")
    fig.update_yaxes(type="log", exponentformat="power", title="relative error of the round trip")
    lo, hi = float(df[x].min()), float(df[x].max())
    roundoffs: dict[float, list] = {}  # formats sharing a threshold share one line label, never two on top
    maxima: dict[float, list] = {}
    for name, part in df.groupby(fmt_col, sort=False):
        part = part[part[y] > 0]
        color = series_color(str(name))
        fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines", name=str(name), line=dict(color=color, width=1)))
        if show_regions:
            f = get_format(str(name))
            roundoffs.setdefault(f.unit_roundoff, []).append(f)
            maxima.setdefault(f.max, []).append(f)
            if lo < f.min_normal:  # shapes take data values on log axes too
                fig.add_vrect(x0=lo, x1=f.min_normal, fillcolor=color, opacity=0.07, line_width=0)
            add_line(fig, "x", f.min_normal, line_dash="dot", line_color=color)
            if f.max < hi:
                fig.add_vrect(x0=f.max, x1=hi, fillcolor=color, opacity=0.07, line_width=0)
    for u, fs in roundoffs.items():
        add_line(fig, "y", u, line_dash="dot", line_color=series_color(fs[0].name),
                 annotation_text=f"{', '.join(f.name for f in fs)}: unit roundoff 2^-{fs[0].mantissa_bits + 1}",
                 annotation_position="bottom right")
    # Maxima close on the log axis (240 and 448) would print their labels over each other: each lower one
    # steps down a line.
    for i, (m, fs) in enumerate(sorted(maxima.items())):
        add_line(fig, "x", m, line_dash="dash", line_color=series_color(fs[0].name),
                 annotation_text=f"{', '.join(f.name for f in fs)} max {m:g}", annotation_position="top left",
                 annotation_yshift=-18 * (len(maxima) - 1 - i))
    fig.update_layout(title="Relative error vs magnitude: subnormal (left shade), normal, saturated (right shade)",
                      legend_title="format")
    return readable_axes(fig)


def cast_comparison(df, *, x: str = "input", y: str = "output", method_col: str = "method",
                    fmt_col: str = "format") -> go.Figure:
    """Output of different FP8 casts against their input near the top of the range: one panel per format.

    Parameters
    ----------
    df : DataFrame with columns ``x``, ``y`` (the cast result as float; may be inf/NaN),
        ``method_col`` (e.g. "bare .to()" / "fp8kv saturating") and ``fmt_col``.

    Each format has its own panel and axes (e4m3's 448 and e5m2's 57344 on one linear axis would squash
    the smaller format's points at 0). Finite outputs are drawn as lines, one colour per cast method;
    inf (triangles) and NaN (crosses) outputs, which no value axis holds, as markers just above the
    panel's largest finite output, what they are in the legend and on hover.
    """
    import numpy as np
    from plotly.subplots import make_subplots

    require_columns(df, [x, y, method_col, fmt_col])
    require_columns(df, [method_col, fmt_col], rows=True)  # no rows: a blank figure; NaN: a "nan" panel
    formats = list(dict.fromkeys(df[fmt_col]))
    methods = list(dict.fromkeys(df[method_col]))
    colours = color_map(methods)
    fig = make_subplots(rows=1, cols=max(1, len(formats)), subplot_titles=[str(f) for f in formats],
                        horizontal_spacing=0.06)
    shown = set()
    for col, fmt in enumerate(formats, start=1):
        part_f = df[df[fmt_col] == fmt]
        finite_y = part_f[y][np.isfinite(part_f[y].to_numpy(dtype=float))]
        top = float(finite_y.abs().max()) * 1.15 if len(finite_y) else 1.0
        for method in methods:
            part = part_f[part_f[method_col] == method]
            vals = part[y].to_numpy(dtype=float)
            ok = np.isfinite(vals)
            colour = colours[str(method)]
            fig.add_trace(go.Scatter(x=part[x][ok], y=vals[ok], mode="lines+markers", name=str(method),
                                     legendgroup=str(method), showlegend=str(method) not in shown,
                                     line=dict(color=colour)), row=1, col=col)
            shown.add(str(method))
            for kind, symbol, hit in (("inf", "triangle-up", np.isinf(vals)), ("NaN", "x", np.isnan(vals))):
                if hit.any():  # the same series, drawn where its values are not finite
                    name = f"{method}: {kind} (drawn at the top)"
                    fig.add_trace(go.Scatter(x=part[x][hit], y=[top] * int(hit.sum()), mode="markers", name=name,
                                             legendgroup=str(method), showlegend=name not in shown,
                                             hovertemplate=f"input %{{x:g}}: {kind}<extra>{method}</extra>",
                                             marker=dict(symbol=symbol, size=10, color=colour)), row=1, col=col)
                    shown.add(name)
    fig.update_xaxes(title="input")
    fig.update_yaxes(title="output", row=1, col=1)
    fig.update_layout(title="Casting values beyond the format's max, one panel per format", legend_title="cast")
    return readable_axes(fig)


def capability_matrix(tables, *, highlight: str | None = None) -> go.Figure:
    """Supported/unsupported grid: arch (rows) × backend/kv_dtype/mode (columns), reason on hover.

    Parameters
    ----------
    tables : a DataFrame from ``fp8kv.capability.capability()`` or a list of them (concatenated), with
        columns arch, backend, kv_dtype, mode, supported, reason.
    highlight : an arch label to mark (e.g. this device's ``"sm90"``) with a ▶ in front.
    """
    import pandas as pd

    if isinstance(tables, (list, tuple)):
        if not tables:
            raise ValueError("tables is an empty list; give fp8kv.capability.capability() tables to draw")
        df = pd.concat(list(tables), ignore_index=True)
    else:
        df = tables
    require_columns(df, ["arch", "backend", "kv_dtype", "mode"], "tables", rows=True)
    require_columns(df, ["supported", "reason"], "tables")
    df = df.assign(column=df["backend"] + " · " + df["kv_dtype"] + " · " + df["mode"])
    dup = df.duplicated(["arch", "column"])
    if dup.any():
        raise ValueError(f"tables has more than one row for arch {df['arch'][dup].iloc[0]!r}: give each table its "
                         "own arch label (e.g. 'here: sm90' for this machine beside the sm90 facts)")
    rows = list(dict.fromkeys(df["arch"]))
    cols = list(dict.fromkeys(df["column"]))
    z = df.pivot(index="arch", columns="column", values="supported").reindex(index=rows, columns=cols)
    reason = df.pivot(index="arch", columns="column", values="reason").reindex(index=rows, columns=cols)
    labels = [f"▶ {r}" if r == highlight else r for r in rows]
    fig = go.Figure(go.Heatmap(
        z=z.astype(float).to_numpy(), x=cols, y=labels, customdata=reason.to_numpy(),
        colorscale=[[0, "#f4c7c3"], [1, "#b7e1cd"]], zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
        hovertemplate="%{y} · %{x}<br>%{customdata}<extra></extra>",
    ))
    fig.update_layout(title="What runs where (green: supported; hover for the reason)",
                      height=max(250, 45 * len(rows) + 200))
    fig.update_xaxes(tickangle=-45, title="backend · KV dtype · mode")
    fig.update_yaxes(autorange="reversed", title="architecture")
    return readable_axes(fig)
