"""Plotly figure builders for the notebooks: each function takes data and returns a Figure.

Nothing here shows a figure or computes a measurement; notebooks display what these return
(``fig`` as a cell's last expression, or ``fig.show()``). Call :func:`setup_plotly` once per
notebook, before the first figure, so figures survive the HTML export of headless runs.

Data arguments are tidy pandas DataFrames (one measurement per row, conditions as columns) or
plain fp8kv objects, so results of several GPUs can be concatenated and drawn by the same function.
"""

from __future__ import annotations

import hashlib
import math
import re

import plotly.graph_objects as go
import plotly.io as pio
from plotly.colors import qualitative as _qualitative

__all__ = [
    "DEFAULT_RENDERER",
    "setup_plotly",
    "line",
    "add_ceiling",
    "fp8_code_values",
    "relative_error_vs_magnitude",
    "cast_comparison",
    "capability_matrix",
    "bench_lines",
    "speedup_heatmap",
    "bandwidth_roofline",
    "backend_check_matrix",
    "error_vs_tolerance",
    "quant_error_heatmap",
    "grouped_bars",
    "PALETTE",
    "AXIS_TITLES",
    "axis_title",
    "series_color",
    "color_map",
    "mode_dash",
    "mode_symbol",
    "per_layer",
]

# The plotly mimetype is what JupyterLab / VS Code render (interactive, through the bundled
# jupyterlab-plotly extension); the "notebook" renderer adds a text/html copy that nbconvert keeps.
# Its first use embeds the whole plotly.js once into the notebook, so the exported HTML views offline.
DEFAULT_RENDERER = "plotly_mimetype+notebook"
FORMAT_COLORS = {"e4m3": "#1f77b4", "e5m2": "#d62728", "e4m3fnuz": "#17becf", "e5m2fnuz": "#ff7f0e"}


def _rgb(hex_colour: str) -> list[int]:
    """``#rrggbb`` -> ``[r, g, b]`` (0-255)."""
    return [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]


def _contrast_on_white(hex_colour: str) -> float:
    """WCAG contrast ratio of an ``#rrggbb`` colour against white (1 to 21)."""
    rgb = [c / 255 for c in _rgb(hex_colour)]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    luminance = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return 1.05 / (luminance + 0.05)


MIN_CONTRAST = 3.0  # WCAG's minimum for graphics: pale yellows and greys vanish on a white page
# Distinct colours (plotly's Dark24, then Alphabet's that are not in it) that stand out on white:
# enough for every series of a figure to have its own, and for a label to keep its colour from
# figure to figure and GPU to GPU.
PALETTE = tuple(c for c in dict.fromkeys(c.lower() for c in (*_qualitative.Dark24, *_qualitative.Alphabet))
                if _contrast_on_white(c) >= MIN_CONTRAST)
# Line dash and marker per decode mode, so a mode reads the same in every figure.
MODE_DASH = {"dequant": "solid", "fp8": "dash"}
MODE_SYMBOL = {"dequant": "circle", "fp8": "diamond"}
# Axis and legend titles of the columns the notebooks draw: words with units, never the column name.
AXIS_TITLES = {
    "time_us": "time per decode step (µs)", "context": "context (tokens)", "batch": "batch (sequences)",
    "gbps": "achieved bandwidth (GB/s)", "pct_copy_bw": "share of the copy bandwidth (%)",
    "bytes": "bytes moved per call", "num_splits": "KV splits", "label": "backend · KV dtype · mode",
    "rel_err": "relative error", "rel_error": "relative error", "tol": "tolerance", "sigma": "spread σ of the tensor",
    "saturated_fraction": "saturated fraction", "underflow_fraction": "underflow fraction",
    "setup": "setup", "k_rel_err": "K relative error", "v_rel_err": "V relative error",
    "out_rel_err": "attention output relative error", "context_len": "context (tokens)",
    "granularity": "scale granularity", "scale_method": "scale method", "quantize": "quantized",
    "fraction": "fraction of elements", "kind": "kind", "tensor": "tensor", "channel": "channel",
    "amax": "largest |value| over tokens", "kv_dtype": "KV dtype", "gpu": "GPU", "model": "model",
    "tokens": "KV tokens", "blocks": "KV blocks", "max_concurrency": "full-length requests at once",
    "ratio": "FP8 tokens / bf16 tokens", "ratio_upper": "ratio bound (whole blocks)",
    "tokens_fp8_e4m3": "tokens, FP8 e4m3", "tokens_bf16": "tokens, bf16",
    "scale_fraction": "share of KV memory holding scales", "config": "KV configuration",
    "kl_mean": "mean KL (nats/token)", "kl_p99": "KL p99 (nats/token)", "ppl_delta_pct": "perplexity change (%)",
    "top1_agree": "top-1 agreement", "k_sat_frac": "K saturated fraction", "v_sat_frac": "V saturated fraction",
    "k_underflow_frac": "K underflow fraction", "v_underflow_frac": "V underflow fraction",
    "attn_rel_err": "attention output relative error", "k_amax": "largest |K|", "v_amax": "largest |V|",
    "layer": "layer", "layer_type": "layer type", "source": "source", "format": "format", "status": "status",
    "share": "output error / its tolerance", "combination": "", "time_ms": "time (ms)",
}


TOKEN_COLUMNS = ("context", "context_len", "tokens", "window")  # columns that count tokens


def tokens_label(n: int) -> str:
    """A token count as people write it: ``16k`` for 16384, ``1000`` for 1000."""
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def axis_title(column: str) -> str:
    """Human title of a column: :data:`AXIS_TITLES`, else the name with spaces for underscores."""
    return AXIS_TITLES.get(column, str(column).replace("_", " "))


def _titles(columns, labels: dict | None) -> dict:
    out = {c: axis_title(c) for c in columns if c is not None}
    out.update(labels or {})
    return out


def _preferred_slot(label: str) -> int:
    return int(hashlib.sha1(str(label).encode("utf-8")).hexdigest(), 16) % len(PALETTE)


def series_color(label: str) -> str:
    """The colour of a series label, the same in every figure, page and GPU.

    FP8 format names keep :data:`FORMAT_COLORS`; any other label a colour of :data:`PALETTE`
    chosen by a hash of the label (not by its position among the traces).
    """
    return FORMAT_COLORS.get(str(label)) or PALETTE[_preferred_slot(label)]


MIN_COLOUR_DISTANCE = 100.0  # RGB distance (0-441) below which two series of one figure look alike


def _rgb_distance(a: str, b: str) -> float:
    return math.dist(_rgb(a), _rgb(b))


def color_map(labels) -> dict:
    """``{label: colour}`` for the labels of one figure: each its :func:`series_color`, no two alike.

    When a label's colour is taken or close to a taken one (:data:`MIN_COLOUR_DISTANCE`: three
    magentas side by side read as one), the label later in sorted order takes the next colour of
    :data:`PALETTE` that is far from all taken ones (else the next free one), so the result depends
    only on the set of labels, never on trace order.
    """
    taken: list[str] = []
    out = {}
    for label in sorted({str(x) for x in labels}):
        colour = series_color(label)
        if any(_rgb_distance(colour, t) < MIN_COLOUR_DISTANCE for t in taken):
            start = _preferred_slot(label)
            order = [PALETTE[(start + i) % len(PALETTE)] for i in range(1, len(PALETTE) + 1)]
            colour = next((c for c in order if all(_rgb_distance(c, t) >= MIN_COLOUR_DISTANCE for t in taken)),
                          next((c for c in order if c not in taken), colour))
        taken.append(colour)
        out[label] = colour
    return out


def _mode_of(name: str) -> str | None:
    words = re.split(r"[\s·,]+", str(name))
    return next((m for m in MODE_DASH if m in words), None)


def mode_dash(name: str) -> str:
    """Line dash of a series by the decode mode named in it (``dequant`` solid, ``fp8`` dashed)."""
    return MODE_DASH.get(_mode_of(name), "solid")


def mode_symbol(name: str) -> str:
    """Marker of a series by the decode mode named in it (``dequant`` circle, ``fp8`` diamond)."""
    return MODE_SYMBOL.get(_mode_of(name), "circle")


def _style_by_label(fig: go.Figure, labels) -> go.Figure:
    """Colour every trace by its name (:func:`color_map`), dash and marker by the mode it names."""
    colours = color_map(labels)
    for trace in fig.data:
        name = str(trace.name) if trace.name is not None else None
        if name not in colours:
            continue
        if trace.type == "scatter":
            trace.update(line=dict(color=colours[name], dash=mode_dash(name)),
                         marker=dict(color=colours[name], symbol=mode_symbol(name)))
        elif trace.type == "bar":
            trace.update(marker=dict(color=colours[name]))
    return fig


def _is_log(fig: go.Figure, axis: str) -> bool:
    """Whether the figure's first ``x``/``y`` axis is logarithmic."""
    return getattr(fig.layout, f"{axis}axis").type == "log"


def _coord(fig: go.Figure, axis: str, value: float) -> float:
    """A data coordinate for a shape or annotation: plotly reads those as exponents on a log axis."""
    if _is_log(fig, axis):
        if value <= 0:
            raise ValueError(f"{axis}={value!r} cannot be placed on a log axis (needs a positive value)")
        return math.log10(value)
    return value


def setup_plotly(renderer: str = DEFAULT_RENDERER, template: str = "plotly_white") -> None:
    """Set plotly's default renderer and template.

    With the default renderer the first figure displayed afterwards embeds plotly.js (about
    4 MB, once per notebook) in an ``text/html`` output, which nbconvert's HTML export keeps;
    plotly >= 6's own default emits only ``application/vnd.plotly.v1+json``, which the export
    drops. Idempotent: calling it again with the same renderer does not embed plotly.js twice.
    """
    if not isinstance(renderer, str) or not renderer:
        raise ValueError(f"renderer must be a plotly renderer name such as {DEFAULT_RENDERER!r}, got {renderer!r}")
    if pio.renderers.default != renderer:
        pio.renderers.default = renderer  # validates the names; plotly raises ValueError listing valid ones
    pio.templates.default = template


def _require_columns(df, columns, arg="df"):
    missing = [c for c in columns if c is not None and c not in df.columns]
    if missing:
        raise ValueError(f"{arg} lacks column(s) {missing}; it has {list(df.columns)}")


def line(df, x: str, y: str, color: str | None = None, *, log_x: bool = False, log_y: bool = False,
         markers: bool = True, title: str | None = None, labels: dict | None = None,
         hover: list[str] | None = None) -> go.Figure:
    """Generic line plot of a tidy DataFrame: one line per value of ``color``.

    Parameters
    ----------
    df : pandas.DataFrame with columns ``x``, ``y`` (and ``color``, ``hover`` if given).
    log_x, log_y : log axes.
    labels : axis/legend titles by column name.
    hover : extra columns shown on hover.
    """
    import plotly.express as px

    _require_columns(df, [x, y, color, *(hover or [])])
    fig = px.line(df, x=x, y=y, color=color, log_x=log_x, log_y=log_y, markers=markers, title=title,
                  labels=_titles([x, y, color, *(hover or [])], labels), hover_data=hover)
    if color is not None:
        _style_by_label(fig, df[color].unique())
    return fig


def add_ceiling(fig: go.Figure, value: float, label: str = "copy bandwidth", *, dash: str = "dash",
                color: str = "gray") -> go.Figure:
    """Draw a horizontal reference line (e.g. the measured copy-bandwidth ceiling) on ``fig``.

    Returns the same figure, modified, so calls chain.
    """
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"value must be a finite number, got {value!r}")
    fig.add_hline(y=_coord(fig, "y", value), line_dash=dash, line_color=color,
                  annotation_text=f"{label}: {value:.4g}", annotation_position="top left")
    return fig


def _formats(formats):
    from .formats import FORMATS
    from .formats import format as get_format

    if formats is None:
        return list(FORMATS.values())
    if isinstance(formats, str):
        formats = [formats]
    return [get_format(f) for f in formats]


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
    return fig


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
    from .formats import format as get_format

    _require_columns(df, [x, y, fmt_col])
    fig = go.Figure()
    # Log axes first: shapes and annotations below are placed in log10 units (what plotly reads there).
    fig.update_xaxes(type="log", exponentformat="power", title="|input|")
    fig.update_yaxes(type="log", exponentformat="power", title="relative error of the round trip")
    lo, hi = float(df[x].min()), float(df[x].max())
    for name, part in df.groupby(fmt_col, sort=False):
        part = part[part[y] > 0]
        color = series_color(str(name))
        fig.add_trace(go.Scatter(x=part[x], y=part[y], mode="lines", name=str(name), line=dict(color=color, width=1)))
        if show_regions:
            f = get_format(str(name))
            fig.add_hline(y=_coord(fig, "y", f.unit_roundoff), line_dash="dot", line_color=color,
                          annotation_text=f"{f.name} unit roundoff 2^-{f.mantissa_bits + 1}",
                          annotation_position="bottom right")
            if lo < f.min_normal:
                fig.add_vrect(x0=_coord(fig, "x", lo), x1=_coord(fig, "x", f.min_normal), fillcolor=color,
                              opacity=0.07, line_width=0)
            fig.add_vline(x=_coord(fig, "x", f.min_normal), line_dash="dot", line_color=color)
            if f.max < hi:
                fig.add_vrect(x0=_coord(fig, "x", f.max), x1=_coord(fig, "x", hi), fillcolor=color, opacity=0.07,
                              line_width=0)
            fig.add_vline(x=_coord(fig, "x", f.max), line_dash="dash", line_color=color,
                          annotation_text=f"{f.name} max {f.max:g}", annotation_position="top left")
    fig.update_layout(title="Relative error vs magnitude: subnormal (left shade), normal, saturated (right shade)",
                      legend_title="format")
    return fig


def cast_comparison(df, *, x: str = "input", y: str = "output", method_col: str = "method",
                    fmt_col: str = "format") -> go.Figure:
    """Output of different FP8 casts against their input near the top of the range.

    Parameters
    ----------
    df : DataFrame with columns ``x``, ``y`` (the cast result as float; may be inf/NaN),
        ``method_col`` (e.g. "bare .to()" / "fp8kv saturating") and ``fmt_col``.

    Finite outputs are drawn as lines; inf and NaN outputs are drawn as ``x`` markers placed just
    above the largest finite output and labelled, since they cannot sit on a value axis.
    """
    import numpy as np

    _require_columns(df, [x, y, method_col, fmt_col])
    finite_y = df[y][np.isfinite(df[y].to_numpy(dtype=float))]
    top = float(finite_y.abs().max()) * 1.15 if len(finite_y) else 1.0
    fig = go.Figure()
    dashes = ["solid", "dash", "dot", "dashdot"]
    methods = list(dict.fromkeys(df[method_col]))
    groups = list(df.groupby([fmt_col, method_col], sort=False))
    colours = color_map(f"{fmt}: {method}" for (fmt, method), _ in groups)
    for (fmt, method), part in groups:
        vals = part[y].to_numpy(dtype=float)
        ok = np.isfinite(vals)
        name = f"{fmt}: {method}"
        color = colours[name]
        fig.add_trace(go.Scatter(x=part[x][ok], y=vals[ok], mode="lines+markers", name=name, legendgroup=name,
                                 line=dict(color=color, dash=dashes[methods.index(method) % len(dashes)])))
        if (~ok).any():  # the same series, drawn where its values are not finite
            labels = ["inf" if np.isinf(v) else "NaN" for v in vals[~ok]]
            fig.add_trace(go.Scatter(x=part[x][~ok], y=[top] * int((~ok).sum()), mode="markers+text",
                                     text=labels, textposition="top center", name=f"{name} (non-finite)",
                                     legendgroup=name, marker=dict(symbol="x", size=10, color=color)))
    fig.update_layout(title="Casting values beyond the format's max", xaxis_title="input", yaxis_title="output",
                      legend_title="format: cast")
    return fig


def capability_matrix(tables, *, highlight: str | None = None) -> go.Figure:
    """Supported/unsupported grid: arch (rows) × backend/kv_dtype/mode (columns), reason on hover.

    Parameters
    ----------
    tables : a DataFrame from ``fp8kv.capability.capability()`` or a list of them (concatenated), with
        columns arch, backend, kv_dtype, mode, supported, reason.
    highlight : an arch label to mark (e.g. this device's ``"sm90"``) with a ▶ in front.
    """
    import pandas as pd

    df = pd.concat(list(tables), ignore_index=True) if isinstance(tables, (list, tuple)) else tables
    _require_columns(df, ["arch", "backend", "kv_dtype", "mode", "supported", "reason"], "tables")
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
    fig.update_xaxes(tickangle=-45)
    fig.update_yaxes(autorange="reversed")
    return fig


# --------------------------------------------------------------------------- benchmarks and the backend matrix


def bench_lines(df, x: str, y: str, *, color: str = "label", facet: str | None = None, log_x: bool = False,
                log_y: bool = False, title: str | None = None, labels: dict | None = None,
                hover: list[str] | None = None, ceiling: float | None = None,
                ceiling_label: str = "copy bandwidth") -> go.Figure:
    """One benchmark metric against one condition: a line per ``color`` value, a panel per ``facet``.

    Parameters
    ----------
    df : tidy rows (``fp8kv.bench.run``), e.g. x="context", y="time_us", facet="batch".
    ceiling : a horizontal line drawn in every panel (e.g. 100 for ``pct_copy_bw``).
    labels, hover : axis/legend titles by column; extra columns on hover.

    Points are sorted by ``x`` within each line so lines run left to right.
    """
    import plotly.express as px

    _require_columns(df, [x, y, color, facet, *(hover or [])])
    data = df.sort_values([c for c in (facet, color, x) if c is not None])
    fig = px.line(data, x=x, y=y, color=color, facet_col=facet, log_x=log_x, log_y=log_y, markers=True,
                  title=title, labels=_titles([x, y, color, facet, *(hover or [])], labels), hover_data=hover)
    _style_by_label(fig, data[color].unique())
    if ceiling is not None:
        if not isinstance(ceiling, (int, float)) or not math.isfinite(ceiling):
            raise ValueError(f"ceiling must be a finite number or None, got {ceiling!r}")
        fig.add_hline(y=_coord(fig, "y", ceiling), line_dash="dash", line_color="gray", annotation_text=ceiling_label,
                      annotation_position="top left")
    if log_x:
        ticks = sorted(data[x].unique())  # the measured sizes, not decades; token counts as "16k", not "16.384k"
        text = [tokens_label(t) for t in ticks] if x in TOKEN_COLUMNS else [f"{t:g}" for t in ticks]
        fig.update_xaxes(tickvals=ticks, ticktext=text)
    return fig


def speedup_heatmap(sp, value: str = "speedup_vs_bf16", *, row: str = "label", baseline: str = "bf16",
                    title: str | None = None) -> go.Figure:
    """Heat-map of a speedup (× faster; > 1 is faster): rows = ``row`` (each FP8 configuration),
    columns = shape (batch, context), a diverging colour scale centred on 1.

    Parameters
    ----------
    sp : rows of ``fp8kv.bench.speedup_table`` (columns ``row``, ``value``, batch, context, time_us;
        bf16_us and bf16_best are shown on hover when present).
    baseline : the name of the baseline in the title.
    """
    import numpy as np

    _require_columns(sp, [row, value, "batch", "context", "time_us"], "sp")
    data = sp.sort_values(["batch", "context"])
    data = data.assign(shape=[f"B={b} · ctx={c}" for b, c in zip(data["batch"], data["context"], strict=True)])
    cols = list(dict.fromkeys(data["shape"]))
    rows = list(dict.fromkeys(sp.sort_values(row)[row]))
    z = data.pivot_table(index=row, columns="shape", values=value, aggfunc="median").reindex(index=rows, columns=cols)
    t = data.pivot_table(index=row, columns="shape", values="time_us", aggfunc="median").reindex(index=rows,
                                                                                                 columns=cols)
    if "bf16_us" in data.columns:
        b = data.pivot_table(index=row, columns="shape", values="bf16_us", aggfunc="median")
        b = b.reindex(index=rows, columns=cols)
    else:
        b = t * np.nan
    zz = z.to_numpy(dtype=float)
    text = [[f"{v:.2f}×" if np.isfinite(v) else "" for v in line] for line in zz]
    finite = zz[np.isfinite(zz)]
    span = float(np.abs(np.log2(finite)).max()) if finite.size and (finite > 0).all() else 1.0
    span = max(span, 0.25)
    fig = go.Figure(go.Heatmap(
        z=np.log2(np.where(zz > 0, zz, np.nan)), x=cols, y=rows, text=text, texttemplate="%{text}",
        customdata=np.stack([t.to_numpy(dtype=float), b.to_numpy(dtype=float), zz], axis=-1),
        colorscale="RdBu", zmid=0, zmin=-span, zmax=span,
        colorbar=dict(title="log2(×)"), xgap=2, ygap=2,
        hovertemplate="%{y}<br>%{x}<br>%{customdata[2]:.3f}×<br>%{customdata[0]:.4g} µs vs "
                      "%{customdata[1]:.4g} µs<extra></extra>",
    ))
    fig.update_layout(title=title or f"FP8 decode over the best {baseline} decode of the same shape "
                                     "(× faster; blue > 1)",
                      height=max(250, 40 * len(rows) + 200))
    fig.update_yaxes(autorange="reversed")
    return fig


def bandwidth_roofline(df, copy_gbps: float, *, x: str = "bytes", y: str = "gbps", color: str = "label",
                       hover: list[str] | None = None, title: str | None = None) -> go.Figure:
    """Achieved bandwidth against bytes moved per call (log-log), with the copy bandwidth as the roof.

    Decode attention does a few FLOPs per byte of KV read (2 × GQA group ÷ element size), far below
    any GPU's ridge point, so its roof is memory bandwidth: small calls sit low (launch and latency
    bound), large ones approach the dashed line. ``df``: rows of ``fp8kv.bench.run`` with status ok (columns ``x``, ``y``, ``color``;
    batch, context, time_us, pct_copy_bw on hover when present).
    """
    import plotly.express as px

    if not isinstance(copy_gbps, (int, float)) or not math.isfinite(copy_gbps) or copy_gbps <= 0:
        raise ValueError(f"copy_gbps must be a positive finite number (GB/s), got {copy_gbps!r}")
    _require_columns(df, [x, y, color, *(hover or [])])
    extra = [c for c in ("batch", "context", "time_us", "pct_copy_bw") if c in df.columns and c not in (x, y)]
    fig = px.scatter(df, x=x, y=y, color=color, log_x=True, log_y=True, hover_data=extra + list(hover or []),
                     title=title or "Achieved bandwidth vs bytes moved per decode call",
                     labels=_titles([x, y, color, *extra, *(hover or [])], None))
    _style_by_label(fig, df[color].unique())
    fig.update_traces(marker=dict(size=9))
    fig.add_hline(y=_coord(fig, "y", copy_gbps), line_dash="dash", line_color="gray",
                  annotation_text=f"copy bandwidth {copy_gbps:.4g} GB/s", annotation_position="bottom right")
    return fig


MATRIX_STATUS_COLORS = {"failed": "#e06666", "error": "#f6b26b", "unsupported": "#e8e8e8", "passed": "#93c47d"}


def backend_check_matrix(df, *, title: str | None = None) -> go.Figure:
    """Pass / fail / error / unsupported grid of ``fp8kv.matrix.backend_matrix`` rows.

    Rows: backend · mode; columns: KV dtype · granularity (16-bit caches: the dtype alone). Each cell
    shows the output's relative error (ran) or "n/a" (unsupported); hover gives the error against
    its tolerance, the LSE error, and the capability reason or the exception.
    """
    need = ["backend", "mode", "kv_dtype", "granularity", "status", "rel_err", "tol", "reason"]
    _require_columns(df, need)
    unknown = sorted(set(df["status"]) - set(MATRIX_STATUS_COLORS))
    if unknown:
        raise ValueError(f"df has status values {unknown}; expected {list(MATRIX_STATUS_COLORS)}")
    order = list(MATRIX_STATUS_COLORS)
    data = df.assign(
        row=df["backend"] + " · " + df["mode"],
        col=[kv if not str(kv).startswith("fp8") else f"{kv} · {g}"
             for kv, g in zip(df["kv_dtype"], df["granularity"], strict=True)],
        code=df["status"].map(order.index).astype(float),
    )

    def fmt(v):
        return f"{v:.1e}" if isinstance(v, (int, float)) and math.isfinite(v) else "–"

    data["cell"] = [fmt(e) if s != "unsupported" else "n/a" for s, e in zip(data["status"], data["rel_err"], strict=True)]
    lse = data["lse_err"] if "lse_err" in data.columns else [math.nan] * len(data)
    lse_tol = data["lse_tol"] if "lse_tol" in data.columns else [math.nan] * len(data)
    err = data["error"].fillna("") if "error" in data.columns else [""] * len(data)
    data["hover"] = [
        f"<b>{s}</b><br>rel err {fmt(e)} (tol {fmt(t)})<br>lse err {fmt(le)} (tol {fmt(lt)})<br>{r}"
        + (f"<br>{x}" if x else "")
        for s, e, t, le, lt, r, x in zip(data["status"], data["rel_err"], data["tol"], lse, lse_tol,
                                         data["reason"], err, strict=True)
    ]
    rows = list(dict.fromkeys(data["row"]))
    cols = list(dict.fromkeys(data["col"]))

    def grid(v):
        return data.pivot(index="row", columns="col", values=v).reindex(index=rows, columns=cols)

    n = len(order)
    scale = []
    for i, status in enumerate(order):  # one flat colour band per status code 0..n-1
        scale += [[i / n, MATRIX_STATUS_COLORS[status]], [(i + 1) / n, MATRIX_STATUS_COLORS[status]]]
    fig = go.Figure(go.Heatmap(
        z=grid("code").to_numpy(dtype=float), x=cols, y=rows, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        showscale=False, text=grid("cell").fillna("").to_numpy(), texttemplate="%{text}",
        customdata=grid("hover").fillna("").to_numpy(), hovertemplate="%{y} · %{x}<br>%{customdata}<extra></extra>",
        xgap=2, ygap=2,
    ))
    counts = data["status"].value_counts()
    legend = " · ".join(f"{s} {int(counts.get(s, 0))}" for s in order)
    fig.update_layout(title=title or f"Every backend against the fp32 reference: {legend}",
                      height=max(250, 45 * len(rows) + 220))
    fig.update_xaxes(tickangle=-45)
    fig.update_yaxes(autorange="reversed")
    return fig


def error_vs_tolerance(df, *, title: str | None = None) -> go.Figure:
    """Share of its tolerance each combination's error uses (``rel_err / tol``; ≤ 1 passes).

    ``df``: rows of ``fp8kv.matrix.backend_matrix`` (unsupported rows are left out). One bar per
    combination, coloured by backend · mode; the dashed line at 1 is the tolerance.
    """
    import plotly.express as px

    _require_columns(df, ["backend", "mode", "kv_dtype", "granularity", "status", "rel_err", "tol"])
    ran = df[df["status"] != "unsupported"]
    ran = ran.assign(share=ran["rel_err"] / ran["tol"], setup=ran["backend"] + " · " + ran["mode"],
                     combination=ran["backend"] + " · " + ran["mode"] + " · " + ran["kv_dtype"] + " · "
                     + ran["granularity"])
    fig = px.bar(ran, x="combination", y="share", color="setup", hover_data=["rel_err", "tol", "status"],
                 title=title or "Output error as a share of its tolerance (≤ 1 passes)",
                 labels={**_titles(["share", "rel_err", "tol", "status"], None), "combination": "",
                         "setup": "backend · mode"})
    _style_by_label(fig, ran["setup"].unique())
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="tolerance",
                  annotation_position="top left")
    fig.update_xaxes(tickangle=-45)
    return fig


# --------------------------------------------------------------------------- quantization error and KV capacity


def quant_error_heatmap(df, value: str = "out_rel_err", *, row: str = "granularity", col: str = "scale_method",
                        facet: str | None = "format", log_color: bool = True, title: str | None = None) -> go.Figure:
    """Heat-maps of one error column: ``row`` × ``col`` cells, one panel per ``facet`` value.

    Parameters
    ----------
    df : tidy rows (``fp8kv.analysis.quantization_error``), one row per (facet, row, col) cell;
        filter other conditions (e.g. ``quantize == "kv"``) first. Duplicates are averaged.
    value : the column coloured and printed in each cell (e.g. ``k_rel_err``, ``out_rel_err``).
    log_color : colour by log10 of the value (errors span decades); the text shows the value.

    Every panel shares one colour scale, so colours compare across panels.
    """
    import numpy as np
    from plotly.subplots import make_subplots

    _require_columns(df, [value, row, col, facet])
    panels = list(dict.fromkeys(df[facet])) if facet else [None]
    rows = list(dict.fromkeys(df[row]))
    cols = list(dict.fromkeys(df[col]))
    vals = df[value].to_numpy(dtype=float)
    pos = vals[np.isfinite(vals) & (vals > 0)] if log_color else vals[np.isfinite(vals)]
    tf = (lambda a: np.log10(np.where(a > 0, a, np.nan))) if log_color else (lambda a: a)
    lo, hi = (float(tf(pos).min()), float(tf(pos).max())) if pos.size else (0.0, 1.0)
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[f"{axis_title(facet)} = {p}" for p in panels] if facet else None)
    for i, p in enumerate(panels):
        part = df if p is None else df[df[facet] == p]
        z = part.pivot_table(index=row, columns=col, values=value, aggfunc="mean", sort=False)
        z = z.reindex(index=rows, columns=cols).to_numpy(dtype=float)
        text = [[f"{v:.3g}" if np.isfinite(v) else "" for v in line] for line in z]
        fig.add_trace(go.Heatmap(
            z=tf(z), x=[str(c) for c in cols], y=[str(r) for r in rows], text=text, texttemplate="%{text}",
            customdata=z, zmin=lo, zmax=hi, colorscale="Viridis", showscale=i == len(panels) - 1,
            colorbar=dict(title=f"log10 of {axis_title(value)}" if log_color else axis_title(value)), xgap=2, ygap=2,
            hovertemplate=f"{axis_title(row)} %{{y}}<br>{axis_title(col)} %{{x}}<br>{axis_title(value)} "
                          f"%{{customdata:.4g}}<extra>{p or ''}</extra>",
        ), row=1, col=i + 1)
        fig.update_xaxes(title_text=axis_title(col), row=1, col=i + 1)
    fig.update_yaxes(title_text=axis_title(row), autorange="reversed", row=1, col=1)
    fig.update_layout(title=title or f"{axis_title(value)} by {axis_title(row)} × {axis_title(col)}",
                      height=max(300, 50 * len(rows) + 200))
    return fig


def grouped_bars(df, x: str, y: str, color: str | None = None, *, facet_col: str | None = None,
                 facet_row: str | None = None, log_y: bool = False, title: str | None = None,
                 labels: dict | None = None, hover: list[str] | None = None, text: str | None = None) -> go.Figure:
    """Grouped bar chart of a tidy DataFrame: bars of ``y`` per ``x``, side by side per ``color``.

    Parameters
    ----------
    df : pandas.DataFrame with the named columns.
    facet_col, facet_row : one panel per value of these columns.
    text : a column printed on the bars (e.g. rounded values).
    labels, hover : axis/legend titles by column; extra columns on hover.
    """
    import plotly.express as px

    _require_columns(df, [x, y, color, facet_col, facet_row, text, *(hover or [])])
    data = df.copy()
    if color is not None:
        data[color] = data[color].astype(str)  # categories, not a continuous colour bar
    fig = px.bar(data, x=x, y=y, color=color, facet_col=facet_col, facet_row=facet_row, barmode="group",
                 log_y=log_y, title=title, labels=_titles([x, y, color, facet_col, facet_row, text, *(hover or [])],
                                                          labels), hover_data=hover, text=text)
    if color is not None:
        _style_by_label(fig, data[color].unique())
    if text is not None:
        fig.update_traces(textposition="outside", cliponaxis=False)
    return fig


def layout_speedups(table, *, title: str | None = None) -> go.Figure:
    """FP8 decode per head layout: × own BF16 decode and × the best peer, as grouped bars.

    ``table``: rows of :func:`fp8kv.bench.layout_table`. Dashed lines at 2× (FP8 reads half the
    bytes: the most a bandwidth-bound decode can gain) and 1× (no gain). Hover: µs and % of the
    FP8 copy-bandwidth limit.
    """
    _require_columns(table, ["num_q_heads", "num_kv_heads", "head_dim", "batch", "context", "fp8_x_bf16",
                             "fp8_x_peer", "fp8_us", "bf16_us", "peer_us", "pct_of_limit"], "table")
    t = table.assign(shape=[f"{hq}/{hkv}/{d} · {b}×{tokens_label(c)}" for hq, hkv, d, b, c in zip(
        table["num_q_heads"], table["num_kv_heads"], table["head_dim"], table["batch"], table["context"], strict=True)])
    long = t.melt(id_vars=["shape", "fp8_us", "bf16_us", "peer_us", "pct_of_limit"],
                  value_vars=["fp8_x_bf16", "fp8_x_peer"], var_name="against", value_name="speedup")
    long["against"] = long["against"].map({"fp8_x_bf16": "× fp8kv's BF16 decode", "fp8_x_peer": "× best peer decode"})
    fig = grouped_bars(long, x="shape", y="speedup", color="against",
                       title=title or "FP8 decode speed-up per head layout (Hq/Hkv/D · batch × context)",
                       labels={"shape": "head layout · batch × context", "speedup": "FP8 speed-up (×, > 1 is faster)",
                               "against": "FP8 decode", "pct_of_limit": "% of FP8 limit", "fp8_us": "FP8 µs",
                               "bf16_us": "BF16 µs", "peer_us": "peer µs"},
                       hover=["fp8_us", "bf16_us", "peer_us", "pct_of_limit"])
    add_ceiling(fig, 2.0, "half the bytes", dash="dash")
    add_ceiling(fig, 1.0, "no gain", dash="dot")
    return fig


def per_layer(layers, model: str, metric: str) -> go.Figure:
    """One metric of ``fp8kv.models.evaluate(..., per_layer=True)`` rows against the layer, a line per config.

    ``layers``: rows with columns model, config, layer, layer_type and ``metric``. The magnitudes
    (``k_amax``, ``v_amax``) are drawn from the bf16 run, the errors and fractions from the others;
    the attention error on a log axis.
    """
    _require_columns(layers, ["model", "config", "layer", "layer_type", metric], "layers")
    magnitude = metric in ("k_amax", "v_amax")
    rows = layers[(layers["model"] == model) & ((layers["config"] == "bf16") == magnitude)]
    return line(rows, x="layer", y=metric, color="config", log_y=metric == "attn_rel_err",
                title=f"{model}: {axis_title(metric)} per layer", hover=["layer_type"])
