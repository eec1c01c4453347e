"""The look every figure shares: colours (a palette readable on white, distinct series), line
styles per mode, axis titles, token-count labels, the renderer; line charts and reference lines."""

from __future__ import annotations

import hashlib
import math
import re

import plotly.graph_objects as go
import plotly.io as pio
from plotly.colors import qualitative as _qualitative

from ..results import source_of

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
    if n != n:  # NaN: a row without its context
        raise ValueError("a token count (context, window) is NaN; each row needs a number there")
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def written_log_ticks(fig: go.Figure, axis: str, values, dtick="D2") -> go.Figure:
    """Label the log ``axis`` ("x" or "y", every panel) in full, "2k" and "10M" rather than a bare "2",
    at 1-2-5 steps (``dtick="D2"``) or decades (``dtick=1``). SI prefixes below 1 would read "300µ" for
    3e-4: where ``values`` go below 1, plotly's own ticks stay."""
    values = list(values)
    if values and min(values) >= 1:
        getattr(fig, f"update_{axis}axes")(dtick=dtick, tickformat="~s")
    return fig


def measured_ticks(fig: go.Figure, axis: str, values, column: str) -> go.Figure:
    """Ticks of ``axis`` ("x" or "y") at the measured ``values`` of ``column`` only, not at decades; token
    counts written as people write them ("16k", not "16.384k": :func:`tokens_label`)."""
    ticks = sorted(set(values))
    text = [tokens_label(t) for t in ticks] if column in TOKEN_COLUMNS else [f"{t:g}" for t in ticks]
    getattr(fig, f"update_{axis}axes")(tickvals=ticks, ticktext=text)
    return fig


def axis_title(column: str) -> str:
    """Human title of a column: :data:`AXIS_TITLES`, else the name with spaces for underscores."""
    return AXIS_TITLES.get(column, str(column).replace("_", " "))


def axis_titles(columns, labels: dict | None) -> dict:
    """Column -> axis title (:func:`axis_title`) for ``columns`` (None skipped), overridden by ``labels``."""
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


def style_by_label(fig: go.Figure, labels) -> go.Figure:
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


def _is_log(fig: go.Figure, ref: str) -> bool:
    """Whether the axis that ``ref`` ("x", "y2", ...) names is logarithmic."""
    name = f"{ref[0]}axis{ref[1:]}"
    return getattr(fig.layout, name, None) is not None and fig.layout[name].type == "log"


def _positive_on_log(fig: go.Figure, axis: str, *values: float) -> None:
    if _is_log(fig, axis) and min(values) <= 0:
        raise ValueError(f"{axis}={min(values)!r} cannot be placed on a log axis (needs a positive value)")


def add_line(fig: go.Figure, axis: str, value: float, **kwargs) -> go.Figure:
    """``fig.add_hline`` (axis "y") or ``add_vline`` (axis "x") at the data value ``value``, on log axes too.

    On a log axis plotly.js places a shape at its data value but an annotation at the value's
    exponent, while plotly's ``add_hline`` gives the line's label the line's own coordinate: the label
    is moved to ``log10(value)`` here, so line and label both sit at ``value``."""
    _positive_on_log(fig, axis, value)
    first = len(fig.layout.annotations)
    (fig.add_hline if axis == "y" else fig.add_vline)(**{axis: value}, **kwargs)
    for note in fig.layout.annotations[first:]:
        ref = note[f"{axis}ref"] or axis
        if "domain" not in ref and _is_log(fig, ref):
            note[axis] = math.log10(value)
    return fig


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


def require_columns(df, columns, arg="df", *, rows: bool = False):
    """``df`` has ``columns`` (None entries skipped); with ``rows``, at least one row and no NaN in them
    (a figure that draws one cell or panel per value has nothing to draw, or a NaN cell, otherwise)."""
    if source_of(df) != "df":  # rows read from a file (fp8kv.results.load_table): name it
        arg = f"{arg} (from {source_of(df)})"
    missing = [c for c in columns if c is not None and c not in df.columns]
    if missing:
        raise ValueError(f"{arg} lacks column(s) {missing}; it has {list(df.columns)}")
    if rows:
        if not len(df):
            raise ValueError(f"{arg} has no rows: nothing to draw")
        for c in columns:
            if c is not None and df[c].isna().any():
                raise ValueError(f"{arg} has NaN in column {c!r} (row {int(df[c].isna().to_numpy().nonzero()[0][0])}); "
                                 "each row needs a value there")


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

    require_columns(df, [x, y, color, *(hover or [])])
    fig = px.line(df, x=x, y=y, color=color, log_x=log_x, log_y=log_y, markers=markers, title=title,
                  labels=axis_titles([x, y, color, *(hover or [])], labels), hover_data=hover)
    if color is not None:
        style_by_label(fig, df[color].unique())
    return fig


def add_ceiling(fig: go.Figure, value: float, label: str = "copy bandwidth", *, dash: str = "dash",
                color: str = "gray") -> go.Figure:
    """Draw a horizontal reference line (e.g. the measured copy-bandwidth ceiling) on ``fig``.

    Returns the same figure, modified, so calls chain.
    """
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"value must be a finite number, got {value!r}")
    add_line(fig, "y", value, line_dash=dash, line_color=color, annotation_text=f"{label}: {value:.4g}",
             annotation_position="top left")
    return fig
