"""Figures of quantization error and KV capacity: error heatmaps, grouped bars, per-layer
statistics."""

from __future__ import annotations

import plotly.graph_objects as go

from .style import (
    FRACTION_COLUMNS,
    axis_title,
    axis_titles,
    facet_label,
    line,
    log_colour_ticks,
    name_facets,
    percent_axis,
    power_of_ten,
    readable_axes,
    require_columns,
    require_values,
    style_by_label,
)

# --------------------------------------------------------------------------- quantization error and KV capacity


def quant_error_heatmap(df, value: str = "out_rel_err", *, row: str = "granularity", col: str = "scale_method",
                        facet: str | None = "format", log_color: bool = True, title: str | None = None) -> go.Figure:
    """Heat-maps of one error column: ``row`` × ``col`` cells, one panel per ``facet`` value.

    Parameters
    ----------
    df : tidy rows (``fp8kv.analysis.quantization_error``), one row per (facet, row, col) cell;
        filter other conditions (e.g. ``quantize == "kv"``) first. Duplicates are averaged, and the title
        then says over how many rows.
    value : the column coloured and printed in each cell (e.g. ``k_rel_err``, ``out_rel_err``).
    log_color : colour by log10 of the value (errors span decades); the text and the colour bar's
        ticks show the value (``10⁻³``), never its logarithm.

    Every panel shares one colour scale, so colours compare across panels.
    """
    import numpy as np
    from plotly.subplots import make_subplots

    require_columns(df, [row, col, facet], rows=True)
    require_columns(df, [value])
    require_values(df, value, positive=log_color)
    if log_color and (df[value] < 0).any():  # log10 of it is NaN: a blank cell
        raise ValueError(f"df has a negative {value} ({float(df[value].min()):g}); log_color=True colours by "
                         "log10 of the value: pass log_color=False for signed values")
    panels = list(dict.fromkeys(df[facet])) if facet else [None]
    rows = list(dict.fromkeys(df[row]))
    cols = list(dict.fromkeys(df[col]))
    vals = df[value].to_numpy(dtype=float)
    pos = vals[np.isfinite(vals) & (vals > 0)] if log_color else vals[np.isfinite(vals)]
    tf = (lambda a: np.log10(np.where(a > 0, a, np.nan))) if log_color else (lambda a: a)
    lo, hi = (float(tf(pos).min()), float(tf(pos).max())) if pos.size else (0.0, 1.0)
    bar = dict(title=axis_title(value))
    if log_color:
        bar.update(log_colour_ticks(lo, hi, 10.0, power_of_ten))
    fig = make_subplots(rows=1, cols=len(panels), shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=[facet_label(facet, p) for p in panels] if facet else None)
    for i, p in enumerate(panels):
        part = df if p is None else df[df[facet] == p]
        z = part.pivot_table(index=row, columns=col, values=value, aggfunc="mean", sort=False)
        z = z.reindex(index=rows, columns=cols).to_numpy(dtype=float)
        text = [[f"{v:.3g}" if np.isfinite(v) else "" for v in line] for line in z]
        fig.add_trace(go.Heatmap(
            z=tf(z), x=[str(c) for c in cols], y=[str(r) for r in rows], text=text, texttemplate="%{text}",
            customdata=z, zmin=lo, zmax=hi, colorscale="Viridis", showscale=i == len(panels) - 1,
            colorbar=bar, xgap=2, ygap=2,
            hovertemplate=f"{axis_title(row)} %{{y}}<br>{axis_title(col)} %{{x}}<br>{axis_title(value)} "
                          f"%{{customdata:.4g}}<extra>{p or ''}</extra>",
        ), row=1, col=i + 1)
        fig.update_xaxes(title_text=axis_title(col), row=1, col=i + 1)
    fig.update_yaxes(title_text=axis_title(row), autorange="reversed", row=1, col=1)
    per_cell = int(df.groupby([c for c in (facet, row, col) if c]).size().max())
    mean = f"; a cell is the mean of up to {per_cell} rows" if per_cell > 1 else ""
    fig.update_layout(title=(title or f"{axis_title(value)} by {axis_title(row)} × {axis_title(col)}") + mean,
                      height=max(300, 50 * len(rows) + 200))
    return readable_axes(fig)


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
    title : default "<y's title> by <x's title>".

    Panels are titled "B = 1" / "format: e4m3" (:func:`~fp8kv.viz.style.facet_label`); a fraction
    (:data:`~fp8kv.viz.style.FRACTION_COLUMNS`) ticks in percent, small numbers as powers of ten.
    """
    import plotly.express as px

    require_columns(df, [x, y, color, facet_col, facet_row, text, *(hover or [])])
    require_values(df, y, positive=log_y)
    require_columns(df, [facet_col, facet_row], rows=True)  # a NaN panel: titled "nan"
    data = df.copy()
    if color is not None:
        data[color] = data[color].astype(str)  # categories, not a continuous colour bar
    names = axis_titles([x, y, color, facet_col, facet_row, text, *(hover or [])], labels)
    fig = px.bar(data, x=x, y=y, color=color, facet_col=facet_col, facet_row=facet_row, barmode="group",
                 log_y=log_y, title=title or f"{names[y]} by {names[x]}", labels=names, hover_data=hover, text=text)
    name_facets(fig, {c: names[c] for c in (facet_col, facet_row) if c is not None})
    if color is not None:
        style_by_label(fig, data[color].unique())
    if text is not None:
        fig.update_traces(textposition="outside", cliponaxis=False)
    if y in FRACTION_COLUMNS:
        percent_axis(fig, "y")
    return readable_axes(fig)


def per_layer(layers, model: str, metric: str) -> go.Figure:
    """One metric of ``fp8kv.models.evaluate(..., per_layer=True)`` rows against the layer, a line per config.

    ``layers``: rows with columns model, config, layer, layer_type and ``metric``. The magnitudes
    (``k_amax``, ``v_amax``) are drawn from the bf16 run, the errors and fractions from the others;
    the attention error on a log axis.
    """
    require_columns(layers, ["model", "config", "layer", "layer_type", metric], "layers")
    models = list(dict.fromkeys(layers["model"]))
    if model not in models:
        raise ValueError(f"model={model!r} is not in layers; it has {models}")
    magnitude = metric in ("k_amax", "v_amax")
    rows = layers[(layers["model"] == model) & ((layers["config"] == "bf16") == magnitude)]
    require_values(rows, metric, f"layers of model {model!r} ({'the bf16 run' if magnitude else 'the FP8 configs'})",
                   positive=metric == "attn_rel_err")
    return line(rows, x="layer", y=metric, color="config", log_y=metric == "attn_rel_err",
                title=f"{model}: {axis_title(metric)} per layer", hover=["layer_type"])
