"""Every figure a page shows can be read: each builder of fp8kv.viz and fp8kv.step's figures, drawn from
small synthetic data, has a title, axis titles (with units where the axis is a quantity), small numbers
written as percent or powers of ten (never plotly's SI "800µ" / "1n"), series colours a reader tells
apart (CIEDE2000, :func:`fp8kv.viz.style.colours_alike`), no object repr in any text, and facet panels
titled "B = 1", not "batch (sequences)=1". The checks themselves are shown to fail on figures that
break each rule.
"""

from __future__ import annotations

import inspect
import math
import re

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import pytest

from fp8kv import step, viz
from fp8kv.capability import ARCHS, capability
from fp8kv.formats import KV_DTYPES
from fp8kv.kv_formats import KV_FORMAT_NAMES
from fp8kv.step import multi_report
from fp8kv.viz import analysis_figures, bench_figures, deciding_figures, format_figures, format_pareto, style

# --------------------------------------------------------------------------- synthetic data


def _bench_rows():
    rows = []
    for label, scale in (("triton bf16 dequant", 2.0), ("triton fp8_e4m3 dequant", 1.0),
                         ("flashinfer-tc fp8_e4m3 dequant", 1.1), ("triton fp8_e4m3 fp8", 0.9),
                         ("flashinfer-tc bf16 dequant", 2.1)):
        for b in (1, 16):
            for ctx in (1024, 16384):
                t = scale * b * ctx / 1000
                rows.append(dict(label=label, batch=b, context=ctx, time_us=t, bytes=int(t * 3e3), gbps=3e-4 * b,
                                 pct_copy_bw=0.07 * b, num_splits=4))
    return pd.DataFrame(rows)


def _speedups():
    return pd.DataFrame([dict(label=lab, batch=b, context=c, time_us=1.0, bf16_us=v, speedup_vs_bf16=v)
                         for lab in ("triton fp8_e4m3 dequant", "triton fp8_e4m3 fp8")
                         for (b, c), v in {(1, 4096): 1.2, (16, 4096): 1.9, (16, 65536): 0.8}.items()])


def _matrix_rows():
    rows = []
    for backend in ("triton", "flashinfer", "vllm"):
        for kv, gran in (("bf16", "tensor"), ("fp8_e4m3", "head"), ("fp8_e5m2", "token_head")):
            rows.append(dict(backend=backend, mode="dequant", kv_dtype=kv, granularity=gran, status="passed",
                             rel_err=2e-4, tol=4e-3, lse_err=1e-6, lse_tol=1e-3, reason="runs", error=""))
    return pd.DataFrame(rows)


def _layouts():
    return pd.DataFrame(dict(num_q_heads=[32, 8, 64], num_kv_heads=[8, 8, 8], head_dim=[128, 64, 128], batch=[64] * 3,
                             context=[16384] * 3, fp8_x_bf16=[1.8, 1.9, 1.7], fp8_x_peer=[1.2, 2.5, 0.9],
                             fp8_us=[10.0, 20.0, 30.0], bf16_us=[18.0, 38.0, 51.0], peer_us=[12.0, 50.0, 27.0],
                             pct_of_limit=[80.0, 90.0, 70.0], peer=["flashinfer-tc bf16"] * 3))


def _quant_rows():
    return pd.DataFrame([dict(format=f, granularity=g, scale_method=m, quantize=q, out_rel_err=b * (1 + i + 2 * j),
                              k_rel_err=b, saturated_fraction=1e-4 * (i + j), underflow_fraction=3e-6)
                         for f, b in (("e4m3", 2e-4), ("e5m2", 4e-4))
                         for i, g in enumerate(("tensor", "head"))
                         for j, m in enumerate(("amax", "1.0"))
                         for q in ("k", "v", "kv")])


def _layers():
    return pd.DataFrame([dict(model="m", config=c, layer=i, layer_type="full", attn_rel_err=1e-4 * (i + 1),
                              k_sat_frac=1e-5 * i, k_amax=10.0 + i)
                         for c in ("bf16", "e4m3 tensor amax", "e5m2 tensor amax", "e4m3 head amax") for i in range(4)])


FORMAT_SERIES = ("int8_token_head", "int4_token_head", "nvfp4", "mxfp4")  # beside bf16 and FP8: six lines


def _step_rows(formats=()):
    rows = []
    series = [("bf16", 64, 1.0), ("fp8_e4m3", 128, 1.3)] + [(f, 128 + 16 * i, 1.2) for i, f in enumerate(formats)]
    for kv, ceiling, speed in series:
        for b in (1, 4, 16, 64, 128):
            if b > ceiling:
                continue
            step_us = 1000.0 + 5.0 * b / speed
            rows.append(dict(status="ok", model="Qwen3-8B", context=16384, kv_dtype=kv, batch=b, ceiling=ceiling,
                             step_us=step_us, tokens_per_s=b / step_us * 1e6, attention_us=5.0 * b / speed,
                             attention_share=5.0 * b / speed / step_us))
    return pd.DataFrame(rows)


def _roundtrip():
    rows = []
    for name in ("e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"):
        for m in (1e-6, 1e-3, 1.0, 300.0, 1e5):
            rows.append({"format": name, "magnitude": m, "rel_error": 0.01 * (1 + m % 3)})
    return pd.DataFrame(rows)


def _casts():
    from fp8kv.analysis import cast_comparison

    return cast_comparison(["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz"])[0]


def _breakeven_points():
    """Bench rows on near-exact lines (16-bit 10 µs + 0.02 µs a token, FP8 30 + 0.01), two batches, two backends,
    read into line points by fp8kv.analysis."""
    from fp8kv.analysis import breakeven as be

    rows = [dict(gpu="NVIDIA H200", backend=backend, variant=variant, kv_dtype=kv, mode=mode, granularity="tensor",
                 batch=b, context=c, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                 time_us=(a + s * c) * b ** 0.5 * (1 + 0.01 * (-1) ** i), status="ok")
            for backend, variant in (("triton", ""), ("flashinfer", "tc")) for b in (1, 16)
            for (kv, mode), (a, s) in {("bf16", "dequant"): (10.0, 0.02), ("fp8_e4m3", "dequant"): (30.0, 0.01),
                                       ("fp8_e4m3", "fp8"): (40.0, 0.012)}.items()
            for i, c in enumerate((512, 1456, 4096, 11584, 32768))]
    rows = pd.DataFrame(rows)
    return be.line_points(rows), be.breakeven_context(rows)[1]


def _scale_heads():
    return pd.DataFrame([dict(layer=layer, head=h, side=side, method=m, saturated_frac=1e-4 * (layer + h),
                              underflow_frac=2e-3 * (h + 1))
                         for m in ("1.0", "amax") for layer in range(3) for side in ("k", "v") for h in range(2)])


def _advice():
    return pd.DataFrame(dict(method=["amax", "vllm"], error_all_fp8=[0.012, 0.03], error_after=[0.009, 0.01],
                             tolerance=[0.01, 0.01], n_layers_bf16=[1, 4], n_layers=[30, 30], tokens_lost=[1000, 4000],
                             heldout_all_fp8=[0.013, 0.031], heldout_after=[0.01, 0.012]))


def _long_errors():
    return pd.DataFrame([dict(context=c, entry=entry, mode=mode, error=error, rel_err_median=e, rel_err_max=3 * e)
                         for entry in ("decode", "attend") for mode in ("dequant", "fp8") for c in (4096, 16384, 131072)
                         for error, e in (("kernel", 2e-4), ("quantization", 0.002), ("total", 0.0021))])


def _needles():
    """Margins in logits of a few hundredths (the size a real model's needle has), one point lost at 128k."""
    return pd.DataFrame([dict(context=c, entry=e, mode=m, margin_exact=0.031, margin_fp8=-0.004 if c == 131072 else 0.027,
                              needle_top1=c != 131072, needle_weight_exact=0.003, needle_weight_kernel=0.0029)
                         for e in ("decode", "attend") for m in ("dequant", "fp8") for c in (4096, 16384, 131072)])


def _format_table(timed=True):
    rows = [("int8_token_head", 12240.0, 720.0, 6_266_304, 1e-3, 0.02, 40_000.0),
            ("int4_token_head", 6480.0, 720.0, 11_836_368, 0.05, 0.2, 60_000.0),
            ("nvfp4", 6480.0, 720.0, 11_836_368, 0.08, 0.25, 58_000.0),
            ("mxfp4", 6120.0, 360.0, 12_532_624, 0.2, 0.35, 61_000.0),
            ("kivi4_g32", 7200.0, 1440.0, 10_652_720, 0.06, 0.12, math.nan)]
    df = pd.DataFrame([dict(format=f, bytes_per_token=b, code_bytes_per_token=b - sc, scale_bytes_per_token=sc, tokens=t,
                            kl_mean=kl, top1_agree=0.9, out_rel_err=err, tokens_per_s=tps if timed else math.nan)
                       for f, b, sc, t, kl, err, tps in rows])
    df["timing"] = [None if v != v else "cuda-graph" for v in df["tokens_per_s"]]
    df["timed_batch"], df["timed_context"] = 64, 16384
    return df


def _format_layers():
    return pd.DataFrame([dict(format=f, layer=layer, k_rel_err=0.001 * (i + 1) * (layer + 1),
                              v_rel_err=0.002 * (i + 1)) for i, f in enumerate(("int8_token_head", "nvfp4", "mxfp4"))
                         for layer in range(4)])


def _verify_rows():
    return pd.DataFrame([dict(status="ok", model=m, context=16384, kv_dtype=kv, draft_len=k, acceptance=0.7, batch=b,
                              ceiling=ceil, accepted_tokens_per_s=b * (1 + 0.6 * k) * (1.8 if kv != "bf16" else 1.0) * 50,
                              verify_us=1000.0 + 10 * b)
                         for m in ("Qwen3-8B", "Llama-3.1-8B") for kv, ceil in (("bf16", 49), ("fp8_e4m3", 98))
                         for k in (0, 2, 4) for b in (1, 4, 16, 49, 98) if b <= ceil])


def _prefill_rows():
    return pd.DataFrame([dict(status="ok", model=m, kv_dtype=kv, prompt=n, chunk=c,
                              ttft_us=n * (1.1 if kv == "bf16" else 1.2) * (1 + 256 / c))
                         for m in ("Qwen3-8B",) for kv in ("bf16", "fp8_e4m3") for n in (1024, 4096, 16384)
                         for c in (512, 2048)])


def _attend_rows():
    return pd.DataFrame([dict(backend="triton", mode="dequant", batch=16, context=c, q_len=q, num_q_heads=32,
                              num_kv_heads=8, head_dim=128, kv_dtype=kv, status="ok",
                              time_us=c * (2.0 if kv == "bf16" else 1.1) * (1 + q / 64) / 100)
                         for kv in ("bf16", "fp8_e4m3") for c in (4096, 16384) for q in (1, 2, 4, 8)])


# Every public figure builder of fp8kv.viz's modules and fp8kv.step's report, drawn on the data above.
# Fraction axes: which axes must tick in percent.
BUILDERS = {
    "line": (lambda: viz.line(_quant_rows()[lambda d: d.quantize == "kv"].assign(
        setup=lambda d: d.format + " · " + d.granularity), x="scale_method", y="saturated_fraction", color="setup"),
        ("yaxis",)),
    "bench_lines": (lambda: viz.bench_lines(_bench_rows(), x="context", y="time_us", facet="batch", log_x=True,
                                            log_y=True), ()),
    "bench_lines_fraction": (lambda: viz.bench_lines(_bench_rows().assign(attention_share=0.004), x="batch",
                                                     y="attention_share", facet="context", log_x=True), ("yaxis",)),
    "bench_metric": (lambda: viz.bench_metric(_bench_rows(), "gbps", "batch"), ()),
    "speedup_heatmap": (lambda: viz.speedup_heatmap(_speedups()), ()),
    "bandwidth_roofline": (lambda: viz.bandwidth_roofline(_bench_rows(), 0.05), ()),
    "backend_check_matrix": (lambda: viz.backend_check_matrix(_matrix_rows()), ()),
    "error_vs_tolerance": (lambda: viz.error_vs_tolerance(_matrix_rows()), ()),
    "layout_speedups": (lambda: viz.layout_speedups(_layouts()), ()),
    "fp8_code_values": (lambda: viz.fp8_code_values(), ()),
    "relative_error_vs_magnitude": (lambda: viz.relative_error_vs_magnitude(_roundtrip()), ()),
    "cast_comparison": (lambda: viz.cast_comparison(_casts()), ()),
    "capability_matrix": (lambda: viz.capability_matrix([capability(a) for a in ARCHS[:3]]), ()),
    "quant_error_heatmap": (lambda: viz.quant_error_heatmap(_quant_rows()[lambda d: d.quantize == "kv"]), ()),
    "grouped_bars": (lambda: viz.grouped_bars(_quant_rows(), x="granularity", y="out_rel_err", color="quantize",
                                              facet_col="format"), ()),
    "grouped_bars_fraction": (lambda: viz.grouped_bars(_quant_rows(), x="scale_method", y="saturated_fraction",
                                                       color="quantize", facet_col="format", log_y=True), ("yaxis",)),
    "per_layer": (lambda: viz.per_layer(_layers(), "m", "attn_rel_err"), ()),
    "per_layer_fraction": (lambda: viz.per_layer(_layers(), "m", "k_sat_frac"), ()),
    "tokens_per_s_figure": (lambda: step.tokens_per_s_figure(_step_rows()), ()),
    "attention_share_figure": (lambda: step.attention_share_figure(_step_rows()), ()),
    "tokens_per_s_figure_formats": (lambda: step.tokens_per_s_figure(_step_rows(FORMAT_SERIES)), ()),
    "attention_share_figure_formats": (lambda: step.attention_share_figure(_step_rows(FORMAT_SERIES)), ()),
    # notebook 09's figures (fp8kv.viz.deciding_figures)
    "breakeven_lines": (lambda: viz.breakeven_lines(*_breakeven_points()), ()),
    "breakeven_residuals": (lambda: viz.breakeven_residuals(_breakeven_points()[0]), ("yaxis",)),
    "scale_health_map": (lambda: viz.scale_health_map(_scale_heads()), ()),
    "scale_health_map_fraction": (lambda: viz.scale_health_map(_scale_heads(), "underflow_frac"), ()),
    "advice_bars": (lambda: viz.advice_bars(_advice()), ("yaxis",)),
    "long_context_errors": (lambda: viz.long_context_errors(_long_errors()), ("yaxis",)),
    "needle_margins": (lambda: viz.needle_margins(_needles()), ("yaxis2",)),
    # notebook 10's figures (fp8kv.viz.format_pareto)
    "pareto_figure": (lambda: viz.pareto_figure(_format_table(), tolerance=0.01, model="SmolLM2-135M"), ()),
    "pareto_figure_fraction": (lambda: viz.pareto_figure(_format_table(timed=False), error="out_rel_err"), ()),
    "format_bytes": (lambda: viz.format_bytes(_format_table(), baseline_bytes=23040), ()),
    "format_layer_errors": (lambda: viz.format_layer_errors(_format_layers()), ()),
    # notebook 08's figures (fp8kv.step.multi_report)
    "accepted_tokens_figure": (lambda: step.accepted_tokens_figure(_verify_rows()), ()),
    "ttft_figure": (lambda: step.ttft_figure(_prefill_rows()), ()),
    "attend_speedup_figure": (lambda: step.attend_speedup_figure(_attend_rows()), ()),
}

# Modules whose public functions are all figure builders, and modules that also hold readers, tables and answers:
# of these, a builder is a public function that returns a Figure or is named ``*_figure``.
FIGURE_MODULES = (analysis_figures, bench_figures, format_figures)
MIXED_MODULES = (deciding_figures, format_pareto, multi_report)


def _public(mod):
    return {name: fn for name, fn in vars(mod).items()
            if inspect.isfunction(fn) and fn.__module__ == mod.__name__ and not name.startswith("_")}


def figure_builders() -> set[str]:
    found = {name for mod in FIGURE_MODULES for name in _public(mod)}
    for mod in MIXED_MODULES:
        for name, fn in _public(mod).items():
            returns = inspect.signature(fn).return_annotation
            if name.endswith("_figure") or "Figure" in str(returns):
                found.add(name)
    return found | {"tokens_per_s_figure", "attention_share_figure", "line"}


def test_every_figure_builder_is_checked():
    """A builder added to the figure modules without an entry here is not checked for readability: fail."""
    public = figure_builders()
    assert public <= {name.removesuffix("_fraction") for name in BUILDERS}, public - set(BUILDERS)


def test_the_builders_of_the_mixed_modules_are_found():
    """The readers, tables and answers beside them are not figures; every figure builder there is."""
    found = figure_builders()
    assert {"breakeven_lines", "needle_margins", "pareto_figure", "format_bytes", "format_layer_errors",
            "accepted_tokens_figure", "ttft_figure", "attend_speedup_figure"} <= found
    assert not {"pareto_front", "format_answer", "format_pick", "verify_reading", "attend_speedup"} & found


# --------------------------------------------------------------------------- the rules


REPRS = re.compile(r"DataFrame\(|DecodeGrid\(|Series\(|object at 0x|<fp8kv\.|dtype: (?:object|float64|int64)")
# What a quantity axis's title says to be read: a unit in parentheses, or a word naming a dimensionless quantity.
UNIT_OR_RATIO = re.compile(r"\(.+\)|×|bytes|error|fraction|share|agreement|ratio|value|input|output|code|layer|%|tokens|"
                           r"batch|context|shape|configuration|architecture|backend|KV dtype", re.IGNORECASE)


def _strings(obj):
    """Every string anywhere in a plotly JSON object."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)
    elif hasattr(obj, "tolist"):
        yield from _strings(obj.tolist())


def _trace_colour(trace) -> str | None:
    for part in ("line", "marker"):
        colour = getattr(getattr(trace, part, None), "color", None)
        if isinstance(colour, str):
            return colour
    return None


# A KV dtype or format written as the project names it everywhere (legends, tables): fp8_e4m3 in a title is a
# name, not a column.
KV_NAME = re.compile(r"(?<![\w])(?:" + "|".join(re.escape(n) for n in sorted({*KV_DTYPES, *KV_FORMAT_NAMES}, key=len,
                                                                                reverse=True)) + r")(?![\w])")


def _y_bottom(fig: go.Figure, xname: str) -> float:
    """Where the panel of x axis ``xname`` starts vertically (its anchor y axis's domain), 0 at the bottom."""
    anchor = fig.layout[xname].anchor or "y"
    yaxis = fig.layout["yaxis" + anchor[1:]]
    return float(yaxis.domain[0]) if yaxis is not None and yaxis.domain is not None else 0.0


def titled_below(fig: go.Figure, name: str) -> bool:
    """A facet grid titles its x axes on the bottom row only: an untitled x axis is read by a titled x axis of the
    same column (the same horizontal domain) lower down. Only x axes, and only in the same column."""
    if not name.startswith("xaxis"):
        return False
    domain = tuple(fig.layout[name].domain or (0, 1))
    return any(other != name and fig.layout[other].title.text and tuple(fig.layout[other].domain or (0, 1)) == domain
               and _y_bottom(fig, other) < _y_bottom(fig, name)
               for other in fig.layout if other.startswith("xaxis"))


def readability_problems(fig: go.Figure, percent_axes=()) -> list[str]:
    """What makes ``fig`` hard to read, one line each (empty: readable)."""
    problems = []
    if not (fig.layout.title and fig.layout.title.text):
        problems.append("no title")
    for name, values in style._axis_values(fig).items():
        axis = fig.layout[name] if name in fig.layout else None
        if axis is None or not values:
            continue
        title = axis.title.text if axis.title else None
        panels = [a for a in fig.layout if a.startswith(name[0] + "axis")]
        first = name in (f"{name[0]}axis", f"{name[0]}axis1") or len(panels) == 1
        if first and not title and not titled_below(fig, name):
            problems.append(f"{name} holds numbers and has no title")
        elif title and not UNIT_OR_RATIO.search(title):
            problems.append(f"{name} title {title!r} names no unit")
        if title and "_" in KV_NAME.sub("", title):
            problems.append(f"{name} title {title!r} is a column name")
        if any(0 < abs(v) < 1 for v in values) and axis.ticktext is None:
            fmt = axis.tickformat or ""
            if not (style.SAFE_TICKFORMAT.match(fmt) or (not fmt and axis.exponentformat in ("power", "e", "E"))):
                problems.append(f"{name} holds numbers below 1 with tick format {fmt!r} / exponentformat "
                                f"{axis.exponentformat!r}: plotly writes them with SI prefixes (800µ)")
        if name in percent_axes and "%" not in (axis.tickformat or ""):
            problems.append(f"{name} holds fractions and does not tick in percent")
    for trace in fig.data:
        if trace.type == "heatmap" and trace.showscale is not False:
            bar = trace.colorbar
            z = style._numbers(trace.z)
            if bar.ticktext is None and any(0 < abs(v) < 1 for v in z) and not (
                    style.SAFE_TICKFORMAT.match(bar.tickformat or "") or bar.exponentformat in ("power", "e", "E")):
                problems.append("a colour bar holds numbers below 1 in plotly's SI format")
            if bar.title and re.search(r"log\d*\s*\(|log\d+ of", str(bar.title.text)):
                problems.append(f"colour bar in log units ({bar.title.text!r}): show the value itself")
    colours = sorted({c.lower() for c in map(_trace_colour, fig.data) if c and c.startswith("#")})
    groups: dict[str, set] = {}  # one colour for two series (a trace's legend group, else its name): unreadable
    for trace in fig.data:
        c, series = _trace_colour(trace), getattr(trace, "legendgroup", None) or trace.name
        if c and c.startswith("#") and series:
            groups.setdefault(c.lower(), set()).add(series)
    for c, series in groups.items():
        if len(series) > 1:
            problems.append(f"series {sorted(series)} share the colour {c}")
    for a, b, d in style.colours_alike(colours):
        problems.append(f"series colours {a} and {b} are alike (CIEDE2000 {d:.1f} < {style.MIN_COLOUR_DISTANCE})")
    for text in _strings(fig.to_plotly_json()):
        if REPRS.search(text):
            problems.append(f"object repr in the figure: {text[:80]!r}")
    for note in fig.layout.annotations:
        if re.search(r"\S=\S", str(note.text or "")):
            problems.append(f"panel label {note.text!r} is 'column=value'")
    return problems


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_figure_reads(name):
    build, percent_axes = BUILDERS[name]
    fig = build()
    assert readability_problems(fig, percent_axes) == []


# --------------------------------------------------------------------------- the rules can fail


def _magenta_bars():
    fig = go.Figure()
    for name, colour in (("k", "#e377c2"), ("v", "#fb00d1"), ("kv", "#b00068")):
        fig.add_bar(x=["a"], y=[1.0], name=name, marker_color=colour)
    return fig.update_layout(title="t", yaxis_title="share (%)")


BROKEN = {
    "no title": lambda: go.Figure(go.Scatter(x=[1, 2], y=[3, 4])).update_layout(xaxis_title="x (s)",
                                                                                yaxis_title="y (s)"),
    "SI prefixes": lambda: go.Figure(go.Scatter(x=[1, 2], y=[8e-4, 1e-9])).update_layout(
        title="t", xaxis_title="batch", yaxis_title="relative error"),
    "SI prefixes on a colour bar": lambda: go.Figure(go.Heatmap(z=[[1e-4, 2e-4]], colorbar=dict(title="error"))
                                                     ).update_layout(title="t"),
    "log colour bar": lambda: go.Figure(go.Heatmap(z=[[-1, 1]], colorbar=dict(title="log2(×)"))).update_layout(title="t"),
    "alike colours": _magenta_bars,
    "repr": lambda: go.Figure(go.Scatter(x=[1, 2], y=[3, 4], name="DecodeGrid(batches=(1,))")).update_layout(
        title="t", xaxis_title="batch", yaxis_title="time (µs)"),
    "facet label": lambda: px.bar(pd.DataFrame(dict(batch=[1, 2], t=[3.0, 4.0], c=["a", "b"])), x="c", y="t",
                                  facet_col="batch", title="t", labels={"batch": "batch (sequences)",
                                                                        "t": "time (µs)"}),
    "no unit": lambda: go.Figure(go.Scatter(x=[1, 2], y=[3, 4])).update_layout(
        title="t", xaxis_title="batch", yaxis_title="time_us"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_the_rules_catch_an_unreadable_figure(name):
    percent = ("yaxis",) if name == "alike colours" else ()
    assert readability_problems(BROKEN[name](), percent)


def _grid(titled: dict) -> go.Figure:
    """A 2 × 2 facet grid of latency lines; ``titled``: {(row, col): x title}, the y axes titled on column 1."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, shared_xaxes=True)
    for r in (1, 2):
        for c in (1, 2):
            fig.add_trace(go.Scatter(x=[512, 4096], y=[10.0, 20.0], name=f"p{r}{c}", line=dict(color="#1f77b4"),
                                     legendgroup="one"), row=r, col=c)
    for (r, c), text in titled.items():
        fig.update_xaxes(title_text=text, row=r, col=c)
    return fig.update_yaxes(title_text="µs per decode", col=1).update_layout(title="t")


@pytest.mark.parametrize("titled, untitled", [
    ({(2, 1): "context (tokens)", (2, 2): "context (tokens)"}, False),  # the bottom row: read from below
    ({(2, 2): "context (tokens)"}, True),  # column 2's title does not title column 1
    ({}, True),
    ({(1, 1): "context (tokens)"}, False),
])
def test_a_facet_grid_may_title_its_x_axes_on_the_bottom_row_only(titled, untitled):
    problems = readability_problems(_grid(titled))
    assert ("xaxis holds numbers and has no title" in problems) is untitled, problems


def test_an_untitled_y_axis_is_not_excused_by_a_titled_one_below():
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1).update_layout(title="t")
    for r in (1, 2):
        fig.add_trace(go.Scatter(x=[1, 2], y=[3.0, 4.0], line=dict(color="#1f77b4"), legendgroup="one", name="a"),
                      row=r, col=1)
    fig.update_xaxes(title_text="batch").update_yaxes(title_text="time (µs)", row=2, col=1)
    assert "yaxis holds numbers and has no title" in readability_problems(fig)


@pytest.mark.parametrize("title, column", [("attention speed-up, fp8_e4m3 over bf16 (×)", False),
                                           ("int4_token_head time (µs)", False), ("time_us of fp8_e4m3", True),
                                           ("fp8_e4m3x (µs)", True)])
def test_a_kv_dtype_in_a_title_is_a_name_not_a_column(title, column):
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4])).update_layout(title="t", xaxis_title="batch", yaxis_title=title)
    assert any("is a column name" in p for p in readability_problems(fig)) is column


def test_fraction_axes_without_percent_are_caught():
    fig = px.line(pd.DataFrame(dict(b=[1, 2], f=[0.1, 0.2])), x="b", y="f", title="t",
                  labels={"b": "batch", "f": "saturated fraction"})
    assert any("percent" in p for p in readability_problems(fig, ("yaxis",)))


# --------------------------------------------------------------------------- the colour rule


def test_ciede2000_matches_sharmas_reference_pairs():
    """Pairs 1, 7 and 17 of Sharma, Wu and Dalal's test data (2005), to their 4 decimals."""
    pairs = [((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425), ((50, 0, 0), (50, -1, 2), 2.3669),
             ((50, 2.5, 0), (73, 25, -18), 27.1492), ((50, 2.5, 0), (50, 0, -2.5), 4.3065)]
    for a, b, want in pairs:
        assert style.ciede2000(a, b) == pytest.approx(want, abs=1e-4)
        assert style.ciede2000(b, a) == pytest.approx(want, abs=1e-4)


def test_the_palette_is_distinct_and_readable_on_white():
    assert style.colours_alike(style.PALETTE) == []
    assert all(style._contrast_on_white(c) >= style.MIN_CONTRAST for c in style.PALETTE)
    for fixed in (style.FORMAT_COLORS, style.KV_DTYPE_COLORS):
        assert set(fixed.values()) <= set(style.PALETTE)


@pytest.mark.parametrize("alike", [("#e377c2", "#fb00d1"), ("#d62728", "#e0282a"), ("#1f77b4", "#1f78b6"),
                                   ("#7f7f7f", "#808080")])
def test_colours_alike_names_near_shades(alike):
    assert [(a, b) for a, b, _ in style.colours_alike(alike)] == [alike]


@pytest.mark.parametrize("bad", ["red", "#12345", "#gggggg", None])
def test_colours_alike_refuses_what_is_not_a_colour(bad):
    with pytest.raises(ValueError, match="colours holds"):
        style.colours_alike(["#000000", bad])


@pytest.mark.parametrize("n", [2, 5, 8, len(style.PALETTE)])
def test_any_labels_of_one_figure_get_distinct_colours(n):
    """Up to the palette's size, the labels of one figure (here the series 02 and 04 draw) are told apart."""
    labels = ["k", "v", "kv", "triton bf16 dequant", "triton fp8_e4m3 dequant", "triton fp8_e4m3 fp8",
              "flashinfer-tc bf16 dequant", "flashinfer-tc fp8_e4m3 dequant", "vllm bf16 dequant",
              "vllm fp8_e4m3 dequant", "reference fp16 dequant", "reference fp8_e4m3 dequant", "x"][:n]
    colours = viz.color_map(labels)
    assert style.colours_alike(colours.values()) == []
    assert viz.color_map(labels[::-1]) == colours


def test_the_compared_kv_formats_keep_their_colours_apart_in_every_figure():
    """Notebooks 02 and 10 draw the compared formats beside bf16: each keeps its own colour in every figure (no
    reassignment), all told apart, and INT8 / INT4 (once near-black and navy thin lines) of different hues."""
    from fp8kv.analysis import COMPARED_FORMATS

    labels = ["bf16", *COMPARED_FORMATS]
    colours = viz.color_map(labels)
    assert style.colours_alike(colours.values()) == []
    assert all(colours[x] == style.KV_DTYPE_COLORS[x] for x in labels)
    assert style.KV_DTYPE_COLORS["fp8_e4m3_tensor"] == style.KV_DTYPE_COLORS["fp8_e4m3"]  # one format, one colour
    assert style.colour_distance(colours["int8_token_head"], colours["int4_token_head"]) > 40


# --------------------------------------------------------------------------- specific defects


def test_threshold_labels_never_print_over_each_other():
    """e4m3 and e4m3fnuz share a unit roundoff, e5m2 and e5m2fnuz a max: one label each; the maxima 240 and
    448, close on the log axis, sit on different lines."""
    fig = viz.relative_error_vs_magnitude(_roundtrip())
    where = [(a.x, a.y, a.xref, a.yref, a.xanchor, a.yanchor, a.yshift or 0) for a in fig.layout.annotations]
    assert len(where) == len(set(where))
    texts = [a.text for a in fig.layout.annotations]
    assert "e4m3, e4m3fnuz: unit roundoff 2^-4" in texts and "e5m2, e5m2fnuz max 57344" in texts
    maxima = sorted((a for a in fig.layout.annotations if " max " in a.text), key=lambda a: a.x)
    assert len({a.yshift for a in maxima}) == len(maxima)


def test_casts_of_each_format_have_their_own_axes():
    """e4m3's inputs (400-1800) are not squashed at 0 by e5m2's (57344 x 4): a panel per format."""
    fig = viz.cast_comparison(_casts())
    axes = {t.xaxis for t in fig.data}
    assert len(axes) == 4
    for ref in axes:
        xs = [x for t in fig.data if t.xaxis == ref for x in t.x]
        assert max(xs) / min(xs) < 10


def test_speedup_colour_bar_reads_in_ratios_and_shapes_in_words():
    fig = viz.speedup_heatmap(_speedups())
    bar = fig.data[0].colorbar
    assert "1×" in bar.ticktext and all(t.endswith("×") for t in bar.ticktext)
    assert [2 ** v for v in bar.tickvals] == pytest.approx([float(t[:-1]) for t in bar.ticktext], rel=1e-2)
    assert list(fig.data[0].x) == ["B = 1 · 4k tokens", "B = 16 · 4k tokens", "B = 16 · 64k tokens"]
    assert "median" not in fig.layout.title.text  # one row per cell: nothing is a median


def test_speedup_heatmap_says_when_a_cell_is_a_median():
    twice = pd.concat([_speedups(), _speedups().assign(speedup_vs_bf16=2.0)], ignore_index=True)
    assert "median of up to 2 rows" in viz.speedup_heatmap(twice).layout.title.text


@pytest.mark.parametrize("column, value, exc, words", [
    # int() wrote 2.5 as "B = 2" and 1.5 as "window 1", refused a NaN batch or an inf window without naming it
    ("batch", 2.5, ValueError, "speedup_heatmap: column 'batch' of df holds 2.5 in row 0; expected a finite whole number"),
    ("batch", math.nan, ValueError, "speedup_heatmap: column 'batch' of df holds nan in row 0"),
    ("batch", "1", ValueError, "speedup_heatmap: column 'batch' of df holds object values, not numbers"),
    ("context", 4096.5, ValueError, "speedup_heatmap: column 'context' of df holds 4096.5 in row 0"),
    ("window", 1.5, ValueError, "speedup_heatmap: column 'window' of df holds 1.5 in row 0"),
    ("window", math.inf, ValueError, "speedup_heatmap: column 'window' of df holds inf in row 0"),
])
def test_speedup_heatmap_refuses_shapes_its_labels_would_misread(column, value, exc, words):
    sp = _speedups().assign(window=math.nan)  # a window in row 0 only: the rows differ there, so it is written
    sp[column] = sp[column].astype(object)
    sp.loc[0, column] = value
    with pytest.raises(exc, match=re.escape(words)):
        viz.speedup_heatmap(sp)


def test_speedup_heatmap_writes_whole_windows_and_no_window():
    sp = _speedups().assign(window=[128.0] + [math.nan] * 5)
    assert "triton fp8_e4m3 dequant · window 128" in viz.speedup_heatmap(sp).data[0].y


def test_layout_speedups_refuses_a_context_its_label_would_round():
    with pytest.raises(ValueError, match=re.escape("layout_speedups: column 'context' of df holds 16384.5 in row 0")):
        viz.layout_speedups(_layouts().assign(context=[16384.5, 16384, 16384]))  # "16k" before


def test_quant_error_heatmap_says_when_a_cell_is_a_mean():
    rows = _quant_rows()
    assert "mean of up to 3 rows" in viz.quant_error_heatmap(rows).layout.title.text  # k, v and kv rows
    assert "mean" not in viz.quant_error_heatmap(rows[rows.quantize == "kv"]).layout.title.text


def test_half_the_bytes_line_is_drawn_only_over_the_own_bf16_bars():
    fig = viz.layout_speedups(_layouts())
    at_two = [s for s in fig.layout.shapes if s.y0 == 2.0]
    assert len(at_two) == 1 and at_two[0].yref == "y"  # the first panel: × fp8kv's BF16 decode
    panels = {t.name: t.xaxis for t in fig.data}
    assert panels["× fp8kv's BF16 decode"] == "x" and panels["× best peer decode"] == "x2"
    assert {a.text for a in fig.layout.annotations} >= {"× fp8kv's BF16 decode", "× best peer decode"}


@pytest.mark.parametrize("column, value, want", [("batch", 1, "B = 1"), ("context", 16384, "16k tokens"),
                                                 ("context", "1000", "1000 tokens"), ("format", "e4m3", "format: e4m3")])
def test_facet_labels_read_as_words(column, value, want):
    assert style.facet_label(column, value) == want


def test_small_numbers_are_powers_of_ten_and_fractions_percent():
    fig = viz.bench_lines(_bench_rows(), x="batch", y="gbps", log_x=True)
    assert fig.layout.yaxis.exponentformat == "power"
    frac = viz.line(_quant_rows(), x="scale_method", y="underflow_fraction", color="format")
    assert frac.layout.yaxis.tickformat == "~%"
    assert style.power_of_ten(1e-3) == "10⁻³" and style.power_of_ten(2.5e-3) == "2.5e-03"
    ticks = style.log_colour_ticks(-3.2, -0.5, 10.0, style.power_of_ten)
    assert ticks == dict(tickvals=[-3.0, -2.0, -1.0], ticktext=["10⁻³", "10⁻²", "10⁻¹"])
    assert math.isclose(10 ** ticks["tickvals"][0], 1e-3)
