"""Reading a sweep: whether FP8 KV (or a quantized format) pays per model and context, in numbers and a
sentence; each KV dtype's tokens/s up to its ceiling (:func:`ceiling_table`); the figures; a text summary."""

from __future__ import annotations

import warnings

from ..results import PartialResultWarning, check_rows, source_of, warn_partial
from ..sweeps import timing_notes

SWEEP_ROWS = "the rows of fp8kv.step.sweep() (a CSV fp8kv step saved)"
READING_COLUMNS = ["status", "model", "context", "kv_dtype", "batch", "ceiling", "tokens_per_s", "step_us",
                   "attention_share"]


# ----------------------------------------------------------------------------------------- reading
def _best(sub):
    ok = sub[sub["status"] == "ok"]
    return ok.loc[ok["tokens_per_s"].idxmax()] if len(ok) else None


def _pair_at(a, b, batch: int, baseline: str, fp8: str) -> dict | None:
    """The two dtypes' rows at ``batch``: FP8's speedup and each step's attention share (None if one is missing)."""
    ra, rb = a[a["batch"] == batch], b[b["batch"] == batch]
    if ra.empty or rb.empty:
        return None
    ra, rb = ra.iloc[0], rb.iloc[0]
    return {"batch": int(batch), "speedup": float(ra["step_us"] / rb["step_us"]),
            "attention_share": {baseline: float(ra["attention_share"]), fp8: float(rb["attention_share"])}}


def reading(df, baseline: str = "bf16", fp8: str = "fp8_e4m3") -> dict:
    """Per (model, context): the numbers that say whether FP8 KV pays, and a sentence reading them.

    Keys of each entry: ``best_tokens_per_s`` per dtype and the batch it came at, ``best_ratio``
    (FP8 best ÷ baseline best), ``at_baseline_ceiling`` (batch = the baseline's ceiling:
    ``speedup`` of the FP8 step there and each step's ``attention_share``), ``batch1`` (same at batch 1),
    and ``sentence``.
    """
    check_rows(df, "reading", READING_COLUMNS, values=READING_COLUMNS[1:], expected=SWEEP_ROWS)
    out = {}
    ok = df[df["status"] == "ok"]
    for side in (baseline, fp8):
        if len(ok) and not (ok["kv_dtype"] == side).any():
            warn_partial("reading", df, f"holds no {side} rows that ran (kv_dtypes "
                         f"{sorted(map(str, ok['kv_dtype'].unique()))}): no reading compares {baseline} with {fp8}")
    for (model, ctx), g in ok.groupby(["model", "context"], sort=False):
        a, b = g[g["kv_dtype"] == baseline], g[g["kv_dtype"] == fp8]
        if a.empty or b.empty:
            continue
        best_a, best_b = _best(a), _best(b)
        ceil_a = int(a["ceiling"].iloc[0])

        hi, one = _pair_at(a, b, ceil_a, baseline, fp8), _pair_at(a, b, 1, baseline, fp8)
        ratio = float(best_b["tokens_per_s"] / best_a["tokens_per_s"])
        name = "FP8" if fp8 == "fp8_e4m3" else fp8
        text = (f"{model} at {ctx} tokens: {name} KV's best is {best_b['tokens_per_s']:,.0f} tokens/s (batch "
                f"{int(best_b['batch'])}) against {best_a['tokens_per_s']:,.0f} for {baseline} KV (batch "
                f"{int(best_a['batch'])}), {ratio:.2f}×")
        if hi is not None:
            text += (f"; at batch {hi['batch']}, {baseline}'s ceiling, attention is "
                     f"{100 * hi['attention_share'][baseline]:.0f} % of the {baseline} step and {name} KV speeds the "
                     f"step up {hi['speedup']:.2f}×")
        if one is not None:
            text += (f"; at batch 1 attention is {100 * one['attention_share'][baseline]:.0f} % of the step, the weights' "
                     f"GEMMs the rest, and {name} changes the step by {one['speedup']:.2f}×")
        out[f"{model} @ {ctx}"] = {"model": model, "context": int(ctx),
                                   "best_tokens_per_s": {baseline: float(best_a["tokens_per_s"]),
                                                         fp8: float(best_b["tokens_per_s"])},
                                   "best_batch": {baseline: int(best_a["batch"]), fp8: int(best_b["batch"])},
                                   "best_ratio": ratio, "at_baseline_ceiling": hi, "batch1": one,
                                   "sentence": text + "."}
    return out


# ------------------------------------------------------------------------------------------- figures
def reading_markdown(df, baseline: str = "bf16", fp8: str = "fp8_e4m3") -> str:
    """:func:`reading`'s sentences as a Markdown list (a notebook displays it with ``Markdown``)."""
    with warnings.catch_warnings():  # said in the text instead
        warnings.simplefilter("ignore", PartialResultWarning)
        text = "\n\n".join(f"* {r['sentence']}" for r in reading(df, baseline, fp8).values())
    where = "" if source_of(df) == "df" else f" in {source_of(df)}"
    return text or f"no pair of {baseline} and {fp8} rows ran{where}"


def _colors(kv_dtypes) -> dict:
    """One colour per KV dtype of a figure, none alike (:func:`fp8kv.viz.style.color_map`: bf16 and FP8 keep
    the colours every page gives them)."""
    from ..viz.style import color_map

    return color_map(kv_dtypes)


def tokens_per_s_figure(df, *, title: str | None = None):
    """Tokens per second against batch (log-log), one panel per model × context, one line per KV dtype,
    each dtype's ceiling a dashed vertical line of its colour (a trace, so log axes place it right)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from .. import viz

    check_rows(df, "tokens_per_s_figure", READING_COLUMNS, values=READING_COLUMNS[1:], expected=SWEEP_ROWS)
    ok = df[df["status"] == "ok"]
    colors = _colors(ok["kv_dtype"])
    panels = list(dict.fromkeys(zip(ok["model"], ok["context"], strict=True)))
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=[f"{m}, context {c}" for m, c in panels])
    for i, (model, ctx) in enumerate(panels, start=1):
        g = ok[(ok["model"] == model) & (ok["context"] == ctx)]
        lo, hi = g["tokens_per_s"].min(), g["tokens_per_s"].max()
        for kv, s in g.groupby("kv_dtype", sort=False):
            s = s.sort_values("batch")
            fig.add_trace(go.Scatter(x=s["batch"], y=s["tokens_per_s"], mode="lines+markers", name=f"{kv} KV",
                                     legendgroup=kv, showlegend=i == 1, line=dict(color=colors[kv]),
                                     customdata=s[["step_us", "attention_share"]],
                                     hovertemplate="B=%{x}<br>%{y:,.0f} tokens/s<br>step %{customdata[0]:.1f} µs"
                                                   "<br>attention %{customdata[1]:.0%}<extra></extra>"), row=1, col=i)
            c = int(s["ceiling"].iloc[0])
            fig.add_trace(go.Scatter(x=[c, c], y=[lo * 0.8, hi * 1.25], mode="lines", name=f"{kv} ceiling",
                                     legendgroup=kv, showlegend=False, hovertemplate=f"{kv} ceiling: B={c}<extra></extra>",
                                     line=dict(color=colors[kv], dash="dash", width=1)), row=1, col=i)
    # one legend entry a dtype (its ceiling toggles with it), and one that says what the dashes are: a legend of
    # twelve entries outgrew the figure and scrolled
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="dashed: its memory ceiling",
                             line=dict(color="#7f7f7f", dash="dash", width=1), hoverinfo="skip"), row=1, col=1)
    # decades on x, 1-2-5 on y, written out ("20k", not a bare "2" beside "10k")
    fig.update_xaxes(type="log", title="batch (concurrent sequences)", dtick=1, tickformat="~g")
    fig.update_yaxes(type="log", title="tokens per second (generated)")
    viz.written_log_ticks(fig, "y", ok["tokens_per_s"])
    fig.update_layout(title=title or "Decode-step throughput against concurrency, to each KV dtype's memory ceiling",
                      height=420, legend_title_text="KV dtype")
    return viz.style.readable_axes(fig)


def attention_share_figure(df, *, title: str | None = None):
    """Attention's share of the step (%) against batch (log x), one panel per model × context."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from .. import viz

    cols = ["status", "model", "context", "kv_dtype", "batch", "attention_share", "attention_us", "step_us"]
    check_rows(df, "attention_share_figure", cols, values=cols[1:], expected=SWEEP_ROWS)
    ok = df[df["status"] == "ok"]
    colors = _colors(ok["kv_dtype"])
    panels = list(dict.fromkeys(zip(ok["model"], ok["context"], strict=True)))
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=[f"{m}, context {c}" for m, c in panels])
    for i, (model, ctx) in enumerate(panels, start=1):
        g = ok[(ok["model"] == model) & (ok["context"] == ctx)]
        for kv, s in g.groupby("kv_dtype", sort=False):
            s = s.sort_values("batch")
            fig.add_trace(go.Scatter(x=s["batch"], y=100 * s["attention_share"], mode="lines+markers",
                                     name=f"{kv} KV", legendgroup=kv, showlegend=i == 1,
                                     line=dict(color=colors[kv]), customdata=s[["attention_us", "step_us"]],
                                     hovertemplate="B=%{x}<br>attention %{y:.0f} %<br>%{customdata[0]:.1f} of "
                                                   "%{customdata[1]:.1f} µs<extra></extra>"), row=1, col=i)
    fig.update_xaxes(type="log", title="batch (concurrent sequences)", dtick=1, tickformat="~g")
    fig.update_yaxes(title="attention share of the step (%)", range=[0, 100])
    fig.update_layout(title=title or "How much of the step is attention", height=420, legend_title_text="KV dtype")
    return viz.style.readable_axes(fig)


CEILING_COLUMNS = ["status", "model", "context", "kv_dtype", "batch", "ceiling", "tokens_per_s"]


def ceiling_table(df):
    """Tokens/s to each KV dtype's ceiling: one row per model × context × KV dtype that ran, with its
    ``kv_format`` and ``bytes_per_token`` (where the rows carry them), ``ceiling`` (sequences), ``best_tokens_per_s``
    and ``best_batch`` (the fastest batch measured) and ``ceiling_tokens_per_s`` (at the ceiling; NaN where the
    ceiling was not measured), in the rows' order."""
    import pandas as pd

    check_rows(df, "ceiling_table", CEILING_COLUMNS, values=CEILING_COLUMNS[1:], expected=SWEEP_ROWS)
    extra = [c for c in ("kv_format", "bytes_per_token") if c in df.columns]
    rows = []
    ok = df[df["status"] == "ok"]
    for (model, ctx, kv), g in ok.groupby(["model", "context", "kv_dtype"], sort=False):
        best, ceiling = _best(g), int(g["ceiling"].iloc[0])
        at = g[g["batch"] == ceiling]
        rows.append({"model": model, "context": int(ctx), "kv_dtype": kv, **{c: g[c].iloc[0] for c in extra},
                     "ceiling": ceiling, "best_tokens_per_s": float(best["tokens_per_s"]),
                     "best_batch": int(best["batch"]),
                     "ceiling_tokens_per_s": float(at["tokens_per_s"].iloc[0]) if len(at) else float("nan")})
    return pd.DataFrame(rows, columns=["model", "context", "kv_dtype", *extra, "ceiling", "best_tokens_per_s",
                                       "best_batch", "ceiling_tokens_per_s"])


def summary(df) -> str:
    """The rows as a compact text table, then one sentence per model × context (:func:`reading`)."""
    cols = ["model", "kv_dtype", "context", "batch", "ceiling", "step_us", "tokens_per_s", "attention_us",
            "attention_share", "pct_copy_bw", "status"]
    check_rows(df, "summary", [*cols, "reason", "timing"], expected=SWEEP_ROWS)
    cols[2:2] = [c for c in ("bytes_per_token",) if c in df.columns]  # rows saved before it was a column lack it
    lines = [df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")]
    if (df["status"] == "ok").any():
        lines += ["tokens/s to each KV dtype's ceiling:",
                  ceiling_table(df).to_string(index=False, float_format=lambda v: f"{v:,.4g}")]
    with warnings.catch_warnings():  # a run of one KV dtype has rows and no reading: nothing more to say
        warnings.simplefilter("ignore", PartialResultWarning)
        lines += [r["sentence"] for r in reading(df).values()]
    bad = df[df["status"] != "ok"]
    lines += [f"{r.model} {r.kv_dtype} B={r.batch}: {r.status}: {r.reason}" for r in bad.itertuples()]
    lines += timing_notes(df)
    return "\n".join(lines)
