"""Reading the multi-token runs: whether FP8 KV still pays with speculative decoding (accepted tokens per second)
and with chunked prefill (time to first token), in numbers and sentences; their figures; the text summaries; and
the figure of the attention kernel's own FP8 / 16-bit speed-up (rows of :func:`fp8kv.bench.attend_run`)."""

from __future__ import annotations

from .. import checks
from ..results import check_rows
from ..sweeps import timing_notes

VERIFY_ROWS = "the rows of fp8kv.step.verify_sweep() (a CSV fp8kv step --draft-lens saved)"
PREFILL_ROWS = "the rows of fp8kv.step.prefill_sweep() (a CSV fp8kv step --prompt-lens saved)"
ATTEND_ROWS = "the rows of fp8kv.bench.attend_run()"
_ATTEND_CELL = ["backend", "batch", "context", "q_len", "num_q_heads", "num_kv_heads", "head_dim"]  # a baseline's cell
VERIFY_READ = ["status", "model", "context", "kv_dtype", "draft_len", "acceptance", "batch", "ceiling",
               "accepted_tokens_per_s", "verify_us"]
PREFILL_READ = ["status", "model", "kv_dtype", "prompt", "chunk", "ttft_us"]


# ------------------------------------------------------------------------------------------------ reading
def verify_reading(df, baseline: str = "bf16", fp8: str = "fp8_e4m3") -> dict:
    """Per (model, context, draft_len, acceptance): each KV dtype's best accepted tokens/s (any batch up to its
    ceiling) and the batch it came at, ``ratio`` (FP8 ÷ baseline), and a ``sentence``."""
    check_rows(df, "verify_reading", VERIFY_READ, values=VERIFY_READ[1:], expected=VERIFY_ROWS)
    ok = df[df["status"] == "ok"]
    out = {}
    for (model, ctx, k, a), g in ok.groupby(["model", "context", "draft_len", "acceptance"], sort=False):
        best = {}
        for kv in (baseline, fp8):
            s = g[g["kv_dtype"] == kv]
            if len(s):
                best[kv] = s.loc[s["accepted_tokens_per_s"].idxmax()]
        if len(best) < 2:
            continue
        ratio = float(best[fp8]["accepted_tokens_per_s"] / best[baseline]["accepted_tokens_per_s"])
        what = "the decode step (no drafts)" if k == 0 else f"{int(k)} draft tokens accepted at {a:g} each"
        text = (f"{model} at {ctx} tokens, {what}: FP8 KV's best is "
                f"{best[fp8]['accepted_tokens_per_s']:,.0f} accepted tokens/s (batch {int(best[fp8]['batch'])}) "
                f"against {best[baseline]['accepted_tokens_per_s']:,.0f} for {baseline} (batch "
                f"{int(best[baseline]['batch'])}), {ratio:.2f}×.")
        out[f"{model} @ {ctx} k={int(k)} a={a:g}"] = {
            "model": model, "context": int(ctx), "draft_len": int(k), "acceptance": float(a),
            "best_accepted_tokens_per_s": {kv: float(r["accepted_tokens_per_s"]) for kv, r in best.items()},
            "best_batch": {kv: int(r["batch"]) for kv, r in best.items()}, "ratio": ratio, "sentence": text}
    return out


def prefill_reading(df, baseline: str = "bf16", fp8: str = "fp8_e4m3") -> dict:
    """Per (model, prompt, chunk): each KV dtype's time to first token, ``speedup`` (baseline ÷ FP8: above 1,
    FP8 is faster) and a ``sentence``."""
    check_rows(df, "prefill_reading", PREFILL_READ, values=PREFILL_READ[1:], expected=PREFILL_ROWS)
    ok = df[df["status"] == "ok"]
    out = {}
    for (model, n, c), g in ok.groupby(["model", "prompt", "chunk"], sort=False):
        t = {kv: float(g[g["kv_dtype"] == kv]["ttft_us"].iloc[0]) for kv in (baseline, fp8)
             if (g["kv_dtype"] == kv).any()}
        if len(t) < 2:
            continue
        speedup = t[baseline] / t[fp8]
        out[f"{model} prompt={n} chunk={c}"] = {
            "model": model, "prompt": int(n), "chunk": int(c), "ttft_us": t, "speedup": speedup,
            "sentence": f"{model}, a {n}-token prompt in chunks of {c}: time to first token {t[fp8] / 1e3:,.2f} ms "
                        f"with FP8 KV against {t[baseline] / 1e3:,.2f} ms with {baseline}: FP8 runs at {speedup:.2f}× "
                        f"{baseline}'s speed."}
    return out


# ------------------------------------------------------------------------------------------------ figures
def accepted_tokens_figure(df, *, draft_len: int | None = None, acceptance: float | None = None,
                           title: str | None = None):
    """Accepted tokens per second against batch (log-log), one panel per model × context, one line per KV dtype
    and draft length (dashed: draft length 0, the decode step); ``draft_len`` / ``acceptance`` pick one (the
    acceptance default: the first in the rows)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from ..viz.style import color_map, readable_axes  # plotly only where a figure is drawn

    check_rows(df, "accepted_tokens_figure", VERIFY_READ, values=VERIFY_READ[1:], expected=VERIFY_ROWS)
    ok = df[df["status"] == "ok"]
    if acceptance is None and len(ok):
        acceptance = ok["acceptance"].iloc[0]
    ok = ok[ok["acceptance"] == acceptance] if acceptance is not None else ok
    if draft_len is not None:
        ok = ok[ok["draft_len"].isin([0, draft_len])]
    panels = list(dict.fromkeys(zip(ok["model"], ok["context"], strict=True)))
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=[f"{m}, context {c}" for m, c in panels])
    colours = color_map(f"{kv} KV, " + ("decode" if k == 0 else f"k={int(k)}")
                        for kv, k in zip(ok["kv_dtype"], ok["draft_len"], strict=True))
    for i, (model, ctx) in enumerate(panels, start=1):
        g = ok[(ok["model"] == model) & (ok["context"] == ctx)]
        for (kv, k), s in g.groupby(["kv_dtype", "draft_len"], sort=False):
            s = s.sort_values("batch")
            name = f"{kv} KV, " + ("decode" if k == 0 else f"k={int(k)}")
            fig.add_trace(go.Scatter(x=s["batch"], y=s["accepted_tokens_per_s"], mode="lines+markers", name=name,
                                     legendgroup=name, showlegend=i == 1,
                                     line=dict(color=colours[name], dash="dash" if k == 0 else "solid"),
                                     customdata=s[["verify_us", "ceiling"]],
                                     hovertemplate="B=%{x}<br>%{y:,.0f} accepted tokens/s<br>verify %{customdata[0]:.1f}"
                                                   " µs<br>ceiling %{customdata[1]}<extra></extra>"), row=1, col=i)
    fig.update_xaxes(type="log", title="batch (concurrent sequences)", dtick=1, tickformat="~g")
    fig.update_yaxes(type="log", title="accepted tokens per second")
    fig.update_layout(title=title or f"Speculative decoding: accepted tokens/s, acceptance {acceptance}, to each "
                                     "KV dtype's ceiling", height=420, legend_title_text="KV dtype, drafts")
    readable_axes(fig)
    return fig


def ttft_figure(df, *, title: str | None = None):
    """Time to first token (ms) against prompt length (log-log), one panel per model, one line per KV dtype and
    chunk size."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from ..viz.style import color_map, readable_axes  # plotly only where a figure is drawn

    check_rows(df, "ttft_figure", PREFILL_READ, values=PREFILL_READ[1:], expected=PREFILL_ROWS)
    ok = df[df["status"] == "ok"]
    models = list(dict.fromkeys(ok["model"]))
    fig = make_subplots(rows=1, cols=max(1, len(models)), subplot_titles=list(models))
    dashes = ["solid", "dot", "dash", "longdash", "dashdot"]
    chunks = sorted(set(ok["chunk"]))
    colours = color_map(f"{kv} KV, chunk {int(c)}" for kv, c in zip(ok["kv_dtype"], ok["chunk"], strict=True))
    for i, model in enumerate(models, start=1):
        g = ok[ok["model"] == model]
        for (kv, c), s in g.groupby(["kv_dtype", "chunk"], sort=False):
            s = s.sort_values("prompt")
            name = f"{kv} KV, chunk {int(c)}"
            fig.add_trace(go.Scatter(x=s["prompt"], y=s["ttft_us"] / 1e3, mode="lines+markers", name=name,
                                     legendgroup=name, showlegend=i == 1,
                                     line=dict(color=colours[name], dash=dashes[chunks.index(c) % len(dashes)]),
                                     hovertemplate="prompt %{x}<br>TTFT %{y:,.2f} ms<extra></extra>"), row=1, col=i)
    fig.update_xaxes(type="log", title="prompt length (tokens)", tickformat="~g")
    fig.update_yaxes(type="log", title="time to first token (ms)")
    fig.update_layout(title=title or "Chunked prefill: time to first token", height=420,
                      legend_title_text="KV dtype, chunk")
    readable_axes(fig)
    return fig


def attend_speedup(rows, baseline: str = "bf16", fp8: str = "fp8_e4m3"):
    """The attention kernel's FP8 speed-up (baseline time ÷ FP8 time) per cell of :func:`fp8kv.bench.attend_run`'s
    rows that ran in both KV dtypes: each FP8 row (each mode, each launch variant) over the baseline's row of its
    cell (backend, batch, context, q_len, head layout; page size, layout and query type where the rows have them).

    The 16-bit baseline runs in dequant mode only (fp8 mode is FP8 arithmetic over an FP8 cache), so one baseline
    row is the baseline of both FP8 modes; a variant the baseline did not run (gluon=False, say, which 16-bit pages
    skip) is compared with the baseline's default launch. Columns backend, mode, variant, batch, context, q_len,
    num_q_heads, num_kv_heads, head_dim (and those of the cell the rows have), ``base_us``, ``fp8_us`` and
    ``speedup``. Two baseline rows of one cell and variant (two runs' rows together) are a ValueError."""
    import pandas as pd

    check_rows(rows, "attend_speedup", [*_ATTEND_CELL, "mode", "kv_dtype", "time_us", "status"], expected=ATTEND_ROWS)
    cell = [*_ATTEND_CELL, *(c for c in ("block_size", "layout", "q_dtype") if c in rows.columns)]
    ok = rows[rows["status"] == "ok"]
    variant = ok["variant"].fillna("").astype(str) if "variant" in ok.columns else pd.Series("", index=ok.index)
    ok = ok.assign(variant=variant)  # a CSV reads the default launch's "" as NaN
    base = ok[ok["kv_dtype"] == baseline][[*cell, "variant", "time_us"]].rename(columns={"time_us": "base_us"})
    twice = base[base.duplicated([*cell, "variant"], keep=False)]
    if len(twice):
        where = ", ".join(f"{k}={v}" for k, v in twice.iloc[0][[*cell, "variant"]].items())
        checks.fail(f"attend_speedup: the rows hold {len(twice)} {baseline} rows of one cell ({where}); expected one "
                    "baseline row a cell and variant (pass the rows of one run)")
    fp = ok[ok["kv_dtype"] == fp8][[*cell, "mode", "variant", "time_us"]].rename(columns={"time_us": "fp8_us"})
    default = base[base["variant"] == ""].drop(columns="variant").rename(columns={"base_us": "default_us"})
    both = fp.merge(base, on=[*cell, "variant"], how="left").merge(default, on=cell, how="left")
    both["base_us"] = both["base_us"].fillna(both.pop("default_us"))
    both = both.dropna(subset=["base_us"])
    columns = ["backend", "mode", "variant", *cell[1:], "base_us", "fp8_us"]
    return both[columns].assign(speedup=both["base_us"] / both["fp8_us"]).reset_index(drop=True)


def attend_speedup_figure(rows, baseline: str = "bf16", fp8: str = "fp8_e4m3", *, title: str | None = None):
    """FP8 ÷ 16-bit attention speed-up against q_len (left; one line per context) and against context (right; one
    line per q_len), at each row's batch, backend (and launch variant) and mode, the modes apart (fp8 mode dashed);
    1 is the dotted line of no gain."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from ..viz.style import color_map, measured_ticks, readable_axes  # plotly only where a figure is drawn

    sp = attend_speedup(rows, baseline, fp8)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["against new tokens per sequence (q_len)", "against context"])

    def who(backend, variant, mode, batch) -> str:
        return f"{backend}{'-' + variant if variant else ''}, {mode} mode, B = {batch}"

    lines = {"q_len": ["backend", "variant", "mode", "batch", "context"],
             "context": ["backend", "variant", "mode", "batch", "q_len"]}
    names = {x: {key: f"{who(*key[:4])}, " + (f"{key[4]} cached tokens" if x == "q_len" else
                                                f"{key[4]} new token{'s' * (key[4] != 1)}")
                 for key, _ in sp.groupby(by)} for x, by in lines.items()}
    # a colour (and legend group) per line but its mode, the mode by the dash: both modes of one context or q_len
    # side by side in one colour, and few enough colours that none repeats
    def group(x, key) -> str:
        return f"{x}: {key[:2] + key[3:]}"  # the line's key less its mode (key[2])

    colours = color_map([group(x, key) for x in lines for key in names[x]])
    for col, (x, by) in enumerate(lines.items(), start=1):
        unit = "new tokens" if x == "q_len" else "cached tokens"
        for key, s in sp.groupby(by, sort=True):
            s = s.sort_values(x)
            name, colour = names[x][key], colours[group(x, key)]
            fig.add_trace(go.Scatter(x=s[x], y=s["speedup"], mode="lines+markers", name=name, legendgroup=group(x, key),
                                     line=dict(color=colour, dash="dash" if key[2] == "fp8" else "solid"),
                                     marker=dict(color=colour),
                                     hovertemplate=f"%{{x}} {unit}<br>%{{y:.2f}}×<extra></extra>"), row=1, col=col)
    for col in (1, 2):
        fig.add_hline(y=1.0, line=dict(dash="dot", color="#7f7f7f"), row=1, col=col)
    fig.update_xaxes(type="log")
    # ticks at the measured values only: a log axis's own minor labels (4000 5000 ... 9000) ran into each other
    for col, x in enumerate(lines, start=1):
        measured_ticks(fig, "x", sp[x], x, row=1, col=col)
    fig.update_xaxes(title="new tokens per sequence", row=1, col=1)
    fig.update_xaxes(title="cached tokens before the new ones", row=1, col=2)
    fig.update_yaxes(title=f"attention speed-up, {fp8} over {baseline} (×)")
    # one legend entry a line, two lines a (mode, context or q_len): below the panels, where it need not scroll
    n = len(fig.data)
    fig.update_layout(title=title or "Multi-token attention: FP8 KV's speed-up over 16-bit KV",
                      height=420 + 20 * ((n + 1) // 2), legend=dict(orientation="h", yanchor="top", y=-0.22))
    readable_axes(fig)
    return fig


# ------------------------------------------------------------------------------------------------ summaries
def verify_summary(df) -> str:
    """The verification rows as a compact text table, then :func:`verify_reading`'s sentences and the failures."""
    cols = ["model", "kv_dtype", "context", "draft_len", "acceptance", "batch", "ceiling", "verify_us", "draft_us",
            "accepted_per_step", "accepted_tokens_per_s", "status"]
    check_rows(df, "verify_summary", [*cols, "reason", "timing"], expected=VERIFY_ROWS)
    lines = [df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")]
    lines += [r["sentence"] for r in verify_reading(df).values()]
    bad = df[df["status"] != "ok"].drop_duplicates(["model", "kv_dtype", "context", "draft_len", "batch"])
    lines += [f"{r.model} {r.kv_dtype} k={r.draft_len} B={r.batch}: {r.status}: {r.reason}" for r in bad.itertuples()]
    return "\n".join(lines + timing_notes(df))


def prefill_summary(df) -> str:
    """The prefill rows as a compact text table, then :func:`prefill_reading`'s sentences and the failures."""
    cols = ["model", "kv_dtype", "prompt", "chunk", "n_chunks", "ttft_us", "attention_share", "status"]
    check_rows(df, "prefill_summary", [*cols, "reason", "timing"], expected=PREFILL_ROWS)
    lines = [df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")]
    lines += [r["sentence"] for r in prefill_reading(df).values()]
    bad = df[df["status"] != "ok"]
    lines += [f"{r.model} {r.kv_dtype} prompt={r.prompt} chunk={r.chunk}: {r.status}: {r.reason}"
              for r in bad.itertuples()]
    return "\n".join(lines + timing_notes(df))
