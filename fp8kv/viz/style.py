"""The look every figure shares: colours (a palette readable on white, distinct series), line
styles per mode, axis titles, token-count labels, the renderer; line charts and reference lines."""

from __future__ import annotations

import functools
import hashlib
import math
import re

import plotly.graph_objects as go
import plotly.io as pio

from ..results import source_of

# The plotly mimetype is what JupyterLab / VS Code render (the bundled jupyterlab-plotly extension); the
# "notebook" renderer adds a text/html copy nbconvert keeps, its first use embedding plotly.js once.
DEFAULT_RENDERER = "plotly_mimetype+notebook"


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
# Two series of one figure must differ by at least this CIEDE2000 difference (ΔE00): ~2 is "just noticeable",
# 20 told apart at a glance in a legend and in thin lines (02's old magenta / crimson bars were 6 to 12 apart).
MIN_COLOUR_DISTANCE = 20.0
# The colours of every figure: each stands out on white (MIN_CONTRAST) and every two of them are at least
# MIN_COLOUR_DISTANCE apart, so any set of distinct entries is a readable legend (test_figures_readable).
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#b68100", "#00a08b", "#fc0080", "#6c4516",
           "#0d2a63", "#7f7f7f", "#004422", "#750d86")
# FP8 formats keep their colour in every figure (members of PALETTE: far from each other and the rest).
FORMAT_COLORS = {"e4m3": "#1f77b4", "e5m2": "#d62728", "e4m3fnuz": "#00a08b", "e5m2fnuz": "#b68100"}
# KV dtypes and formats likewise (16-bit caches one baseline colour, FP8 per tensor fp8_e4m3's, INT8 / INT4 two hues)
KV_DTYPE_COLORS = {"bf16": "#1f77b4", "fp16": "#1f77b4", "fp8_e4m3": "#d62728", "fp8_e5m2": "#b68100", "nvfp4": "#fc0080",
                   "fp8_e4m3_tensor": "#d62728", "fp8_e4m3_token_head": "#6c4516", "int8_token_head": "#2ca02c",
                   "int4_token_head": "#9467bd", "kivi4_g32": "#b68100", "kivi4_g128": "#004422", "mxfp4": "#0d2a63"}


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """``#rrggbb`` (sRGB) -> CIELAB (D65 white)."""
    rgb = [c / 255 for c in _rgb(hex_colour)]
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb)
    xyz = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b, 0.2126729 * r + 0.7151522 * g + 0.0721750 * b,
           0.0193339 * r + 0.1191920 * g + 0.9503041 * b)

    def f(t):
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    fx, fy, fz = (f(v / w) for v, w in zip(xyz, (0.95047, 1.0, 1.08883), strict=True))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def ciede2000(lab1, lab2) -> float:
    """CIEDE2000 colour difference of two CIELAB colours (Sharma, Wu and Dalal 2005, eqs. 1-17)."""
    (l1, a1, b1), (l2, a2, b2) = lab1, lab2
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean ** 7 / (c_mean ** 7 + 25 ** 7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    dh = 0.0 if c1p * c2p == 0 else (h2p - h1p + 180) % 360 - 180
    d_l, d_c = l2 - l1, c2p - c1p
    d_h = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dh / 2))
    l_mean, cp_mean = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        h_mean = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        h_mean = (h1p + h2p) / 2
    else:
        h_mean = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(h_mean - 30)) + 0.24 * math.cos(math.radians(2 * h_mean))
         + 0.32 * math.cos(math.radians(3 * h_mean + 6)) - 0.20 * math.cos(math.radians(4 * h_mean - 63)))
    d_theta = 30 * math.exp(-(((h_mean - 275) / 25) ** 2))
    r_c = 2 * math.sqrt(cp_mean ** 7 / (cp_mean ** 7 + 25 ** 7))
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    s_c, s_h = 1 + 0.045 * cp_mean, 1 + 0.015 * cp_mean * t
    r_t = -math.sin(math.radians(2 * d_theta)) * r_c
    return math.sqrt((d_l / s_l) ** 2 + (d_c / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (d_c / s_c) * (d_h / s_h))


@functools.lru_cache(maxsize=4096)
def colour_distance(a: str, b: str) -> float:
    """CIEDE2000 difference of two ``#rrggbb`` colours (0: the same; :data:`MIN_COLOUR_DISTANCE` apart: distinct)."""
    return ciede2000(_lab(a), _lab(b))


def colours_alike(colours, min_distance: float = MIN_COLOUR_DISTANCE) -> list[tuple[str, str, float]]:
    """The pairs of ``colours`` (``#rrggbb``) closer than ``min_distance`` (CIEDE2000), with their distance:
    empty when every two of them can be told apart (the rule every figure's series keep)."""
    colours = [str(c).lower() for c in colours]
    for c in colours:
        if not re.fullmatch(r"#[0-9a-f]{6}", c):
            raise ValueError(f"colours holds {c!r}; expected '#rrggbb' colours")
    return [(a, b, d) for i, a in enumerate(colours) for b in colours[i + 1:]
            if (d := colour_distance(a, b)) < min_distance]


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
    if n != n or n in (math.inf, -math.inf):  # NaN: a row without its context; inf: no count of tokens
        raise ValueError(f"a token count (context, window) is {n}; each row needs a finite number there")
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


def measured_ticks(fig: go.Figure, axis: str, values, column: str, **where) -> go.Figure:
    """Ticks of ``axis`` ("x"/"y"; ``where``: a subplot's row/col) at the measured ``values`` of ``column`` only,
    not decades; token counts written as people write them ("16k", not "16.384k": :func:`tokens_label`)."""
    ticks = sorted(set(values))
    text = [tokens_label(t) for t in ticks] if column in TOKEN_COLUMNS else [f"{t:g}" for t in ticks]
    getattr(fig, f"update_{axis}axes")(tickvals=ticks, ticktext=text, **where)
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

    FP8 format names keep :data:`FORMAT_COLORS`, KV dtypes :data:`KV_DTYPE_COLORS`; any other label a
    colour of :data:`PALETTE` chosen by a hash of the label (not by its position among the traces).
    """
    label = str(label)
    return FORMAT_COLORS.get(label) or KV_DTYPE_COLORS.get(label) or PALETTE[_preferred_slot(label)]


def color_map(labels) -> dict:
    """``{label: colour}`` for the labels of one figure: each its :func:`series_color`, no two alike.

    When a label's colour is taken or close to a taken one (CIEDE2000 below :data:`MIN_COLOUR_DISTANCE`:
    three magentas side by side read as one), the label later in sorted order takes the next colour of
    :data:`PALETTE` that is far from all taken ones (else, past the palette's size, the next free one),
    so the result depends only on the set of labels, never on trace order.
    """
    taken: list[str] = []
    out = {}
    for label in sorted({str(x) for x in labels}):
        colour = series_color(label)
        if any(colour_distance(colour, t) < MIN_COLOUR_DISTANCE for t in taken):
            start = _preferred_slot(label)
            order = [PALETTE[(start + i) % len(PALETTE)] for i in range(1, len(PALETTE) + 1)]
            colour = next((c for c in order if all(colour_distance(c, t) >= MIN_COLOUR_DISTANCE for t in taken)),
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


# Columns that hold a share of a whole (0 to 1): their axes tick in percent ("0.1%"), never "1m".
FRACTION_COLUMNS = ("saturated_fraction", "underflow_fraction", "fraction", "scale_fraction", "k_sat_frac",
                    "v_sat_frac", "k_underflow_frac", "v_underflow_frac", "top1_agree", "attention_share")
# How a facet panel names its value: "B = 1", "16k tokens", not px's "batch (sequences)=1".
FACET_NAMES = {"batch": "B", "num_splits": "splits", "gpu": "GPU"}
# Tick formats that never write SI prefixes: percent, exponent, general (d3 types %, e, g, f, r).
SAFE_TICKFORMAT = re.compile(r"^[^a-zA-Z%]*[%efgr]$")


def facet_label(column: str, value) -> str:
    """A facet panel's title: ``B = 64`` for batch, ``16k tokens`` for a token count, ``format: e4m3``
    otherwise (never px's ``column title=value``)."""
    if column in TOKEN_COLUMNS:
        try:
            return f"{tokens_label(float(value))} tokens"
        except (TypeError, ValueError):
            return f"{value} tokens"
    if column in FACET_NAMES:
        return f"{FACET_NAMES[column]} = {value}"
    return f"{axis_title(column)}: {value}"


def name_facets(fig: go.Figure, titles: dict) -> go.Figure:
    """Rewrite plotly express's facet titles (``"<title>=<value>"``) as :func:`facet_label` writes them.

    ``titles``: ``{column: the label px was given for it}`` of the facet columns."""
    for note in fig.layout.annotations:
        text = str(note.text or "")
        for column, title in titles.items():
            if column is not None and text.startswith(f"{title}="):
                note.text = facet_label(column, text[len(title) + 1:])
                break
    return fig


def _numbers(values) -> list[float]:
    """The finite numbers among ``values`` (None, strings and categories left out)."""
    import numpy as np

    if values is None:
        return []
    try:
        arr = np.asarray(values, dtype=float).ravel()
    except (TypeError, ValueError):
        return []
    return [float(v) for v in arr[np.isfinite(arr)]]


def _axis_values(fig: go.Figure) -> dict[str, list[float]]:
    """``{"xaxis": [...], "yaxis2": [...]}``: the numbers each axis of ``fig`` holds (heat-maps' x/y are cells)."""
    out: dict[str, list[float]] = {}
    for trace in fig.data:
        if trace.type not in ("scatter", "scattergl", "bar", "box", "histogram"):
            continue
        for letter in ("x", "y"):
            ref = getattr(trace, f"{letter}axis", None) or letter
            out.setdefault(f"{letter}axis{ref[1:]}", []).extend(_numbers(getattr(trace, letter, None)))
    return out


def percent_axis(fig: go.Figure, axis: str) -> go.Figure:
    """Tick ``axis`` ("y", "x", every panel) in percent of a fraction: ``25%``, ``0.01%``."""
    getattr(fig, f"update_{axis}axes")(tickformat="~%")
    return fig


def readable_axes(fig: go.Figure) -> go.Figure:
    """Make every numeric axis and colour bar of ``fig`` write small numbers without SI prefixes.

    plotly's default ``exponentformat`` writes 8e-4 as "800µ" and 1e-9 as "1n": an axis or colour bar
    that holds a number below 1 (a fraction, an error) and has no format of its own (or the SI one
    "~s") gets ``exponentformat="power"`` (8×10⁻⁴). Axes whose ticks are written out (``ticktext``),
    percent or exponent formats are left as they are. Returns ``fig``.
    """
    for name, values in _axis_values(fig).items():
        axis = fig.layout[name] if name in fig.layout else None
        if axis is None or not any(0 < abs(v) < 1 for v in values) or axis.ticktext is not None:
            continue
        if axis.tickformat and SAFE_TICKFORMAT.match(axis.tickformat):
            continue
        fig.layout[name].update(tickformat=None, exponentformat="power")
    for trace in fig.data:
        if trace.type == "heatmap" and trace.showscale is not False and trace.colorbar.ticktext is None:
            z = _numbers(trace.z)
            if any(0 < abs(v) < 1 for v in z) and not (trace.colorbar.tickformat
                                                        and SAFE_TICKFORMAT.match(trace.colorbar.tickformat)):
                trace.colorbar.update(tickformat=None, exponentformat="power")
    return fig


def log_colour_ticks(lo: float, hi: float, base: float, write) -> dict:
    """Colour-bar ticks of a colour scale in log units (``log_base`` of the value) from ``lo`` to ``hi``,
    written as the values themselves: ``dict(tickvals=[...], ticktext=[write(value), ...])``."""
    first, last = math.floor(lo), math.ceil(hi)
    step = max(1, math.ceil((last - first) / 8))  # at most about 9 ticks
    vals = [float(e) for e in range(first, last + 1, step) if lo - 1e-9 <= e <= hi + 1e-9] or [lo, hi]
    return dict(tickvals=vals, ticktext=[write(base ** v) for v in vals])


def power_of_ten(value: float) -> str:
    """``1e-3`` -> ``10⁻³`` (a decade), else ``2.5e-03``."""
    e = math.log10(value) if value > 0 else float("nan")
    if e == e and abs(e - round(e)) < 1e-9:
        sup = str(int(round(e))).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))
        return f"10{sup}"
    return f"{value:.1e}"


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
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"{arg} must be a pandas DataFrame, got {type(df).__name__}")
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


def require_values(df, column: str, arg: str = "df", *, positive: bool = False) -> None:
    """``df[column]`` holds a finite value (a positive one with ``positive``: a log axis); a blank figure is refused."""
    vals = df[column].to_numpy(dtype=float, na_value=math.nan)
    if not any(math.isfinite(v) and (v > 0 or not positive) for v in vals):
        why = f"{len(df)} rows, none {'positive and ' if positive else ''}finite there" if len(df) else "no rows"
        raise ValueError(f"{arg} has no {column} to draw ({why})")


def line(df, x: str, y: str, color: str | None = None, *, log_x: bool = False, log_y: bool = False,
         markers: bool = True, title: str | None = None, labels: dict | None = None,
         hover: list[str] | None = None) -> go.Figure:
    """Generic line plot of a tidy DataFrame (columns ``x``, ``y``, ``color``, ``hover``): a line per ``color`` value;
    ``labels`` titles axes and legend by column; ``title`` defaults to "<y's title> vs <x's title>".

    A fraction (:data:`FRACTION_COLUMNS`) ticks in percent, small numbers as powers of ten
    (:func:`readable_axes`).
    """
    import plotly.express as px

    require_columns(df, [x, y, color, *(hover or [])])
    require_values(df, y, positive=log_y)
    names = axis_titles([x, y, color, *(hover or [])], labels)
    fig = px.line(df, x=x, y=y, color=color, log_x=log_x, log_y=log_y, markers=markers,
                  title=title or f"{names[y]} vs {names[x]}", labels=names, hover_data=hover)
    if color is not None:
        style_by_label(fig, df[color].unique())
    for axis, column in (("x", x), ("y", y)):
        if column in FRACTION_COLUMNS:
            percent_axis(fig, axis)
    return readable_axes(fig)


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


class ReadableTable:
    """A DataFrame shown whole in a notebook: long text wraps instead of being cut at pandas' 50 characters
    ("..."), URLs are links; its plain-text form is the frame's own table (never an object repr)."""

    def __init__(self, df, html: str):
        self.df, self.html = df, html

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.df.to_string()


def readable_table(df, *, max_width_em: int = 40) -> ReadableTable:
    """``df`` (a pandas DataFrame, its index as pandas shows it) as a :class:`ReadableTable`: every text cell whole and
    wrapped (at most ``max_width_em`` wide), ``http(s)://`` values as links titled ``nvidia.com/…/h200`` (never wrapped:
    a URL broken anywhere squeezed its column to a character), the whole URL their target and tooltip."""
    import html

    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")

    def cell(value) -> str:
        text = str(value)
        if not re.fullmatch(r"https?://\S+", text):
            return html.escape(text)
        parts = text.split("://", 1)[1].rstrip("/").split("/")
        short = parts[0].removeprefix("www.") + (f"/…/{parts[-1]}" if len(parts) > 1 else "")
        return f'<a href="{html.escape(text)}" title="{html.escape(text)}">{html.escape(short)}</a>'

    texts = [c for c in df.columns if not pd.api.types.is_numeric_dtype(df[c])]  # object, str and bool columns
    with pd.option_context("display.max_colwidth", None):
        body = df.to_html(escape=False, formatters={c: cell for c in texts}, classes="fp8kv-readable", border=0)
    style = (f"<style>table.fp8kv-readable td{{white-space:normal;overflow-wrap:anywhere;max-width:{max_width_em}em;"
             "text-align:left;vertical-align:top}table.fp8kv-readable td a{white-space:nowrap}</style>")
    return ReadableTable(df, style + body)
