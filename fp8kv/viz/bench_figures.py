"""Figures of benchmarks and of the backend matrix: latency and bandwidth lines, FP8 speed-ups,
the roofline, checks against tolerances, head layouts."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go

from .. import checks
from ..formats import is_fp8
from ..results import check_rows
from .style import (
    FRACTION_COLUMNS,
    add_line,
    axis_title,
    axis_titles,
    measured_ticks,
    name_facets,
    percent_axis,
    readable_axes,
    require_columns,
    require_values,
    style_by_label,
    tokens_label,
    written_log_ticks,
)

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

    Points are sorted by ``x`` within each line so lines run left to right; panels are titled "B = 1" or
    "16k tokens"; the title defaults to "<y's title> vs <x's title>".
    """
    import plotly.express as px

    require_columns(df, [x, y, color, facet, *(hover or [])])
    require_values(df, y, positive=log_y)
    require_columns(df, [color, facet], rows=True)  # a NaN label or panel: a "nan" line or a blank figure
    data = df.sort_values([c for c in (facet, color, x) if c is not None])
    names = axis_titles([x, y, color, facet, *(hover or [])], labels)
    fig = px.line(data, x=x, y=y, color=color, facet_col=facet, log_x=log_x, log_y=log_y, markers=True,
                  title=title or f"{names[y]} vs {names[x]}", labels=names, hover_data=hover)
    if facet is not None:
        name_facets(fig, {facet: names[facet]})
    style_by_label(fig, data[color].unique())
    if ceiling is not None:
        if not isinstance(ceiling, (int, float)) or not math.isfinite(ceiling):
            raise ValueError(f"ceiling must be a finite number or None, got {ceiling!r}")
        add_line(fig, "y", ceiling, line_dash="dash", line_color="gray", annotation_text=ceiling_label,
                 annotation_position="top left")
    if log_y:
        written_log_ticks(fig, "y", data[y])
    if log_x:
        measured_ticks(fig, "x", data[x], x)
    if y in FRACTION_COLUMNS:
        percent_axis(fig, "y")
    return readable_axes(fig)


def bench_metric(df, metric: str, x: str) -> go.Figure:
    """:func:`bench_lines` of one ``metric`` (time_us: log scale) against ``x`` (context or batch), a
    panel per value of the other, both axes of sizes on log scales."""
    checks.one_of(x, "x", ("context", "batch"))
    return bench_lines(df, x=x, y=metric, facet="batch" if x == "context" else "context", log_x=True,
                       log_y=metric == "time_us", title=f"{axis_title(metric)} vs {axis_title(x)}")


def _head_layout(r) -> str:
    return f"{r['num_q_heads']}/{r['num_kv_heads']}/{r['head_dim']}"


def _window(r) -> str:
    w = r["window"]
    return "no window" if w is None or w != w else f"window {int(w)}"  # None or NaN: the whole context


# What else tells a heatmap's rows apart besides batch and context (its columns): where any of these differ
# among the rows, it joins the row label, so that no cell is a median across GPUs, head layouts, pages,
# windows or runs. (columns, how a row says it)
_APART = ((("gpu_slug",), lambda r: str(r["gpu_slug"])),
          (("num_q_heads", "num_kv_heads", "head_dim"), _head_layout),
          (("block_size",), lambda r: f"page {r['block_size']}"),
          (("window",), _window),
          (("layout",), lambda r: f"{r['layout']} pages"),
          (("timestamp",), lambda r: f"run {_run_date(r['timestamp'])}"))


def _rows_kept_apart(sp, row: str) -> list[str]:
    """``sp[row]`` with " · " and whatever differs among the rows besides batch and context (:data:`_APART`)."""
    parts = [sp[row].map(str).tolist()]
    for cols, say in _APART:
        if all(c in sp.columns for c in cols) and len(sp[list(cols)].astype(str).drop_duplicates()) > 1:
            parts.append([say(r) for _, r in sp.iterrows()])
    return [" · ".join(p) for p in zip(*parts, strict=True)]


def _run_date(stamp) -> str:
    """A run's ``timestamp`` (``2026-12-02T15:07:36Z``) as a row label prints it: ``2026-12-02 15:07Z``."""
    stamp = str(stamp)
    return f"{stamp[:10]} {stamp[11:16]}Z" if len(stamp) >= 16 and stamp[10] == "T" else stamp


# Colour-bar ticks of a speed-up map: ratios people read, the finest first dropped where many fit.
_RATIO_TICKS = (1 / 8, 1 / 4, 1 / 2, 2 / 3, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)


def _ratio_ticks(span: float) -> dict:
    """Colour-bar ticks for log2 colours within ±``span``, written as the ratio: ``0.5×``, ``1×``, ``2×``."""
    ticks = [r for r in _RATIO_TICKS if abs(math.log2(r)) <= span + 1e-9]
    if len(ticks) > 7:  # wide spans: powers of two only
        ticks = [r for r in ticks if abs(math.log2(r) - round(math.log2(r))) < 1e-9]
    return dict(tickvals=[math.log2(r) for r in ticks], ticktext=[f"{r:.3g}×" for r in ticks])


def _shape_label(batch, context) -> str:
    return f"B = {int(batch)} · {tokens_label(context)} tokens"


def speedup_heatmap(sp, value: str = "speedup_vs_bf16", *, row: str = "label", baseline: str = "bf16",
                    title: str | None = None) -> go.Figure:
    """Heat-map of a speedup (× faster; > 1 is faster): rows = ``row`` (each FP8 configuration; where the
    rows also differ in GPU, head layout, page size, window, page layout or run, such as saved runs
    concatenated, one row per configuration and each of those, named), columns = shape (batch,
    context), a diverging colour scale centred on 1, its colour bar written in ratios (0.5×, 1×, 2×).

    A cell is the median of the rows of its configuration and shape; where any cell holds more than one
    row (repeated measurements), the title says so and over how many. No cell is a median across GPUs,
    head layouts, pages, windows or runs.

    Parameters
    ----------
    sp : rows of ``fp8kv.bench.speedup_table`` (columns ``row``, ``value``, batch, context, time_us;
        bf16_us and bf16_best are shown on hover when present).
    baseline : the name of the baseline in the title.
    """
    require_columns(sp, [row, value, "batch", "context", "time_us"], "sp")
    # whole batches, contexts and windows (NaN: none), as the row and column labels write them: int() read 2.5 as
    # "B = 2" and refused a NaN batch or an inf window without naming it
    expected = "rows of fp8kv.bench.speedup_table()"
    check_rows(sp, "speedup_heatmap", (), whole=("batch", "context"), expected=expected)
    if "window" in sp.columns:
        check_rows(sp[sp["window"].notna()], "speedup_heatmap", (), whole=("window",), expected=expected)
    if not sp[value].notna().any():  # an FP8-only run's speed-ups over BF16, or no FP8 row: a blank map says nothing
        why = sp.attrs.get("partial") or (f"{len(sp)} rows, all NaN there" if len(sp) else "no rows")
        raise ValueError(f"sp has no {value} to draw ({why})")
    sp = sp.assign(**{row: _rows_kept_apart(sp, row)})
    data = sp.sort_values(["batch", "context"])
    data = data.assign(shape=[_shape_label(b, c) for b, c in zip(data["batch"], data["context"], strict=True)])
    cols = list(dict.fromkeys(data["shape"]))
    rows = list(dict.fromkeys(sp.sort_values(row)[row]))

    def cells(column, how="median"):
        return data.pivot_table(index=row, columns="shape", values=column, aggfunc=how).reindex(index=rows,
                                                                                              columns=cols)

    z, t = cells(value), cells("time_us")
    b = cells("bf16_us") if "bf16_us" in data.columns else t * np.nan
    per_cell = int(data.groupby([row, "shape"]).size().max())
    zz = z.to_numpy(dtype=float)
    text = [[f"{v:.2f}×" if np.isfinite(v) else "" for v in line] for line in zz]
    finite = zz[np.isfinite(zz)]
    span = float(np.abs(np.log2(finite)).max()) if finite.size and (finite > 0).all() else 1.0
    span = max(span, 0.25)
    fig = go.Figure(go.Heatmap(
        z=np.log2(np.where(zz > 0, zz, np.nan)), x=cols, y=rows, text=text, texttemplate="%{text}",
        customdata=np.stack([t.to_numpy(dtype=float), b.to_numpy(dtype=float), zz], axis=-1),
        colorscale="RdBu", zmid=0, zmin=-span, zmax=span,
        colorbar=dict(title="× faster", **_ratio_ticks(span)), xgap=2, ygap=2,
        hovertemplate="%{y}<br>%{x}<br>%{customdata[2]:.3f}×<br>%{customdata[0]:.4g} µs vs "
                      "%{customdata[1]:.4g} µs<extra></extra>",
    ))
    median = f"; a cell is the median of up to {per_cell} rows" if per_cell > 1 else ""
    fig.update_layout(title=(title or f"FP8 decode over the best {baseline} decode of the same shape "
                                      "(× faster; blue > 1)") + median,
                      height=max(250, 40 * len(rows) + 200))
    fig.update_xaxes(title="shape (batch · context)")
    fig.update_yaxes(autorange="reversed", title="FP8 configuration")
    return readable_axes(fig)


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
    require_columns(df, [x, y, color, *(hover or [])])
    require_values(df, x, positive=True)  # log-log: nothing else is drawn
    require_values(df, y, positive=True)
    extra = [c for c in ("batch", "context", "time_us", "pct_copy_bw") if c in df.columns and c not in (x, y)]
    fig = px.scatter(df, x=x, y=y, color=color, log_x=True, log_y=True, hover_data=extra + list(hover or []),
                     title=title or "Achieved bandwidth vs bytes moved per decode call",
                     labels=axis_titles([x, y, color, *extra, *(hover or [])], None))
    style_by_label(fig, df[color].unique())
    fig.update_traces(marker=dict(size=9))
    written_log_ticks(fig, "x", df[x], dtick=1)  # decades of bytes: "10M", "1G"
    written_log_ticks(fig, "y", df[y])
    add_line(fig, "y", copy_gbps, line_dash="dash", line_color="gray",
             annotation_text=f"copy bandwidth {copy_gbps:.4g} GB/s", annotation_position="bottom right")
    return readable_axes(fig)


MATRIX_STATUS_COLORS = {"failed": "#e06666", "error": "#f6b26b", "unsupported": "#e8e8e8", "passed": "#93c47d"}


def backend_check_matrix(df, *, title: str | None = None) -> go.Figure:
    """Pass / fail / error / unsupported grid of ``fp8kv.matrix.backend_matrix`` rows.

    Rows: backend · mode; columns: KV dtype · granularity (16-bit caches: the dtype alone). Each cell
    shows the output's relative error (ran) or "n/a" (unsupported); hover gives the error against
    its tolerance, the LSE error, and the capability reason or the exception. A cell the matrix has
    no row for (FP8 arithmetic over a 16-bit cache is not a combination) shows "—" on white, its
    hover saying so.
    """
    need = ["backend", "mode", "kv_dtype", "granularity", "status", "rel_err", "tol", "reason"]
    require_columns(df, need)
    require_columns(df, ["backend", "mode", "kv_dtype", "status"], rows=True)
    unknown = sorted(set(df["status"]) - set(MATRIX_STATUS_COLORS))
    if unknown:
        raise ValueError(f"df has status values {unknown}; expected {list(MATRIX_STATUS_COLORS)}")
    order = list(MATRIX_STATUS_COLORS)
    data = df.assign(
        row=df["backend"] + " · " + df["mode"],
        col=[kv if not is_fp8(str(kv)) else f"{kv} · {g}"
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
    twice = data[data.duplicated(["row", "col"], keep=False)]
    if len(twice):  # e.g. two q dtypes or two GPUs concatenated: one cell cannot show both
        r = twice.iloc[0]
        raise ValueError(f"df has {len(twice)} rows for {r['row']} × {r['col']}; one per combination is drawn: "
                         "select one q_dtype / device first")

    def grid(v):
        return data.pivot(index="row", columns="col", values=v).reindex(index=rows, columns=cols)

    code = grid("code").to_numpy(dtype=float)
    absent = np.isnan(code)
    text = grid("cell").fillna("").to_numpy(copy=True)  # written below: never a read-only view
    hover = grid("hover").fillna("").to_numpy(copy=True)
    text[absent] = "—"
    hover[absent] = "not in the matrix: no such combination"

    n = len(order)
    scale = []
    for i, status in enumerate(order):  # one flat colour band per status code 0..n-1
        scale += [[i / n, MATRIX_STATUS_COLORS[status]], [(i + 1) / n, MATRIX_STATUS_COLORS[status]]]
    fig = go.Figure(go.Heatmap(
        z=code, x=cols, y=rows, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        showscale=False, text=text, texttemplate="%{text}",
        customdata=hover, hovertemplate="%{y} · %{x}<br>%{customdata}<extra></extra>",
        xgap=2, ygap=2,
    ))
    counts = data["status"].value_counts()
    legend = " · ".join(f"{s} {int(counts.get(s, 0))}" for s in order)
    fig.update_layout(title=title or f"Every backend against the fp32 reference: {legend}",
                      height=max(250, 45 * len(rows) + 220))
    fig.update_xaxes(tickangle=-45, title="KV dtype · scale granularity")
    fig.update_yaxes(autorange="reversed", title="backend · mode")
    return readable_axes(fig)


def error_vs_tolerance(df, *, title: str | None = None) -> go.Figure:
    """Share of its tolerance each combination's error uses (``rel_err / tol``; ≤ 1 passes).

    ``df``: rows of ``fp8kv.matrix.backend_matrix`` (unsupported rows are left out, and so are the
    reference's own, whose error is 0 by construction). One bar per combination, coloured by backend ·
    mode, on a log axis (a failure can be hundreds of times its tolerance, a pass a tenth of it); the
    dashed line at 1 is the tolerance.
    """
    import plotly.express as px

    require_columns(df, ["backend", "mode", "kv_dtype", "granularity", "status", "rel_err", "tol"])
    ran = df[(df["status"] != "unsupported") & (df["backend"] != "reference")]
    ran = ran.assign(share=ran["rel_err"] / ran["tol"], setup=ran["backend"] + " · " + ran["mode"],
                     combination=ran["backend"] + " · " + ran["mode"] + " · " + ran["kv_dtype"] + " · "
                     + ran["granularity"])
    require_values(ran, "share", "df (rows that ran, the reference's left out)", positive=True)  # rel_err / tol
    fig = px.bar(ran, x="combination", y="share", color="setup", hover_data=["rel_err", "tol", "status"],
                 title=title or "Output error as a share of its tolerance (≤ 1 passes)",
                 labels={**axis_titles(["share", "rel_err", "tol", "status"], None), "combination": "",
                         "setup": "backend · mode"})
    style_by_label(fig, ran["setup"].unique())
    fig.update_yaxes(type="log", dtick="D2", tickformat="~g")  # ticks 0.1, 0.2, 0.5, 1, ... in plain numbers
    add_line(fig, "y", 1.0, line_dash="dash", line_color="gray", annotation_text="tolerance",
             annotation_position="top left")
    fig.update_xaxes(tickangle=-45, title="backend · mode · KV dtype · scale granularity")
    return readable_axes(fig)


def layout_speedups(table, *, title: str | None = None) -> go.Figure:
    """FP8 decode per head layout, two panels of bars: × fp8kv's own BF16 decode (left) and × the best
    peer decode (right).

    ``table``: rows of :func:`fp8kv.bench.layout_table`. The left panel has a dashed line at 2× (FP8
    reads half the bytes: the most a bandwidth-bound decode can gain over its own BF16); a peer slower
    than fp8kv's BF16 can be beaten by more, so the right panel has only the line at 1× (no gain), as has
    the left. Hover: µs, % of the FP8 copy-bandwidth limit, and where the table has them the peer's row,
    the FP8 kernel that ran and its error over the peers' lowest.
    """
    import plotly.express as px

    require_columns(table, ["num_q_heads", "num_kv_heads", "head_dim", "batch", "context", "fp8_x_bf16",
                             "fp8_x_peer", "fp8_us", "bf16_us", "peer_us", "pct_of_limit"], "table")
    check_rows(table, "layout_speedups", (), whole=("batch", "context"),  # tokens_label read 2.5 as "2"
               expected="rows of fp8kv.bench.layout_table()")
    if not (table["fp8_x_bf16"].notna().any() or table["fp8_x_peer"].notna().any()):  # blank bars say nothing
        why = table.attrs.get("partial") or (f"{len(table)} rows, all NaN there" if len(table) else "no rows")
        raise ValueError(f"table has no fp8_x_bf16 or fp8_x_peer to draw ({why})")
    t = table.assign(shape=[f"{hq}/{hkv}/{d} · {b}×{tokens_label(c)}" for hq, hkv, d, b, c in zip(
        table["num_q_heads"], table["num_kv_heads"], table["head_dim"], table["batch"], table["context"], strict=True)])
    named = [c for c in ("peer", "fp8_kernel", "fp8_err_x_peer") if c in t.columns]
    panels = {"fp8_x_bf16": "× fp8kv's BF16 decode", "fp8_x_peer": "× best peer decode"}
    long = t.melt(id_vars=["shape", "fp8_us", "bf16_us", "peer_us", "pct_of_limit", *named],
                  value_vars=list(panels), var_name="against", value_name="speedup")
    long["against"] = long["against"].map(panels)
    pages = set(table["layout"]) if "layout" in table.columns else set()
    on_pages = f", {'/'.join(sorted(pages))} pages" if pages - {"NHD"} else ""  # NHD, the default, goes unsaid
    labels = {"shape": "head layout · batch × context", "speedup": "FP8 speed-up (×, > 1 is faster)",
              "against": "FP8 decode", "pct_of_limit": "% of FP8 limit", "fp8_us": "FP8 µs", "bf16_us": "BF16 µs",
              "peer_us": "peer µs", "peer": "best peer", "fp8_kernel": "FP8 kernel",
              "fp8_err_x_peer": "FP8 error ÷ peers' lowest"}
    fig = px.bar(long, x="shape", y="speedup", color="against", facet_col="against",
                 category_orders={"against": list(panels.values())}, labels=labels,
                 hover_data=["fp8_us", "bf16_us", "peer_us", "pct_of_limit", *named],
                 title=(title or "FP8 decode speed-up per head layout (Hq/Hkv/D · batch × context)") + on_pages)
    for note in fig.layout.annotations:  # each panel is named by what it divides by
        note.text = str(note.text).split("=", 1)[-1]
    style_by_label(fig, long["against"].unique())
    fig.update_layout(showlegend=False)
    fig.update_xaxes(tickangle=-45)
    add_line(fig, "y", 2.0, line_dash="dash", line_color="gray", annotation_text="half the bytes: 2×",
             annotation_position="top left", row=1, col=1)
    add_line(fig, "y", 1.0, line_dash="dot", line_color="gray", annotation_text="no gain",
             annotation_position="bottom left", row="all", col="all")
    return readable_axes(fig)
