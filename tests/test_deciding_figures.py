"""fp8kv.viz.deciding_figures: the figures of notebook 09 (no kernel needed): what each draws, its titles and
units, percentages for fractions, log axes where contexts span decades, and frames it cannot draw refused by name."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
import torch

from fp8kv import viz
from fp8kv.analysis import breakeven as be
from fp8kv.analysis import measure_scale_health
from fp8kv.viz import deciding_figures as df_

CONTEXTS = [512, 1456, 4096, 11584, 32768]


def _rows(lines=None, batches=(1, 16), backends=(("triton", ""), ("flashinfer", "tc"))):
    """Bench rows on exact lines: 16-bit (10 µs + 0.02 µs/token) and FP8 dequant (30 + 0.01) and fp8 (40 + 0.012)."""
    lines = lines or {("bf16", "dequant"): (10.0, 0.02), ("fp8_e4m3", "dequant"): (30.0, 0.01),
                      ("fp8_e4m3", "fp8"): (40.0, 0.012)}
    out = []
    for backend, variant in backends:
        for b in batches:
            for (kv, mode), (a, s) in lines.items():
                for c in CONTEXTS:
                    out.append(dict(gpu="NVIDIA H200", backend=backend, variant=variant, kv_dtype=kv, mode=mode,
                                    granularity="tensor", batch=b, context=c, num_q_heads=32, num_kv_heads=8,
                                    head_dim=128, block_size=16, time_us=(a + s * c) * b ** 0.5, status="ok"))
    return pd.DataFrame(out)


def _is_percent(axis) -> bool:
    return axis.tickformat is not None and axis.tickformat.endswith("%")


# ------------------------------------------------------------------------------------ break-even
def test_breakeven_lines_panel_per_backend_and_batch_with_fits_and_crossings():
    rows = _rows()
    points = be.line_points(rows)
    lines, cr = be.breakeven_context(rows)
    fig = viz.breakeven_lines(points, cr)
    # 2 batches x 2 backends panels, each 3 series x (points + fitted line)
    assert len(fig.data) == 2 * 2 * 3 * 2
    markers = [t for t in fig.data if t.mode == "markers"]
    assert {t.name for t in markers} == {"bf16 dequant", "fp8_e4m3 dequant", "fp8_e4m3 fp8"}
    assert sum(t.showlegend for t in fig.data) == 3  # one legend entry per series
    assert all(fig.layout[a].type == "log" for a in fig.layout if a.startswith(("xaxis", "yaxis")))
    assert "µs" in fig.layout.title.text and "µs" in fig.layout.yaxis.title.text
    assert any("tokens" in (fig.layout[a].title.text or "") for a in fig.layout if a.startswith("xaxis"))
    # a crossing inside the range: (30 - 10) / (0.02 - 0.01) = 2000 tokens for dequant, in every panel
    crossing = [s for s in fig.layout.shapes if s.type == "line" and s.x0 == pytest.approx(2000)]
    assert len(crossing) == 4
    assert any("2,000" in a.text for a in fig.layout.annotations)
    # the fitted line passes through the exact points
    fit = next(t for t in fig.data if t.mode == "lines")
    assert np.allclose(np.diff(fit.y) / np.diff(fit.x), np.diff(fit.y)[0] / np.diff(fit.x)[0])
    # token ticks written as people write them
    assert "4k" in fig.layout.xaxis.ticktext and "32k" in fig.layout.xaxis.ticktext


def test_breakeven_panels_keep_head_layouts_apart():
    """Two head layouts of one backend and batch are two lines each, never one trace through both: a column of
    panels per layout, named in its title, and each layout's crossing marked once, in its own panel."""
    a = _rows(batches=(1,), backends=(("triton", ""),))
    b = _rows({("bf16", "dequant"): (10.0, 0.04), ("fp8_e4m3", "dequant"): (30.0, 0.02)}, batches=(1,),
              backends=(("triton", ""),)).assign(num_q_heads=8, num_kv_heads=1, head_dim=64)
    rows = pd.concat([a, b], ignore_index=True)
    points = be.line_points(rows)
    _, cr = be.breakeven_context(rows)
    assert len(cr[cr["mode"] == "dequant"]) == 2
    for draw in (lambda: viz.breakeven_lines(points, cr), lambda: viz.breakeven_residuals(points)):
        fig = draw()
        titles = [t.text for t in fig.layout.annotations if "·" in t.text]
        assert titles == ["triton · 8:1, D 64", "triton · 32:8, D 128"]
        series = [t for t in fig.data if t.mode in ("markers", "lines+markers")]
        assert len(series) == 3 + 2 and all(len(t.x) == len(CONTEXTS) for t in series)  # one layout's contexts each
    fig = viz.breakeven_lines(points, cr)
    # dequant crossings: (30 - 10) / (0.02 - 0.01) = 2,000 tokens at 32:8; (30 - 10) / (0.04 - 0.02) = 1,000 at 8:1
    labels = sorted(a.text for a in fig.layout.annotations if "fp8_e4m3 dequant:" in a.text)
    assert labels == ["fp8_e4m3 dequant: 1,000", "fp8_e4m3 dequant: 2,000"]
    # and fp8 mode's (40 + 0.012c) at 3,750 on 32:8 alone (8:1 ran no fp8 mode)
    assert sorted((round(s.x0), s.xref) for s in fig.layout.shapes if s.type == "line") == [
        (1000, "x"), (2000, "x2"), (3750, "x2")]
    with pytest.raises(ValueError, match=r"crossings lacks column\(s\) \['num_q_heads'"):
        viz.breakeven_lines(points, cr.drop(columns="num_q_heads"))


def test_breakeven_lines_leave_out_crossings_outside_the_range():
    # FP8 pays at every context: the lines cross at a negative context, drawn nowhere
    rows = _rows({("bf16", "dequant"): (10.0, 0.02), ("fp8_e4m3", "dequant"): (5.0, 0.01)}, batches=(1,),
                 backends=(("triton", ""),))
    _, cr = be.breakeven_context(rows)
    assert cr["verdict"].iloc[0] == "every"
    fig = viz.breakeven_lines(be.line_points(rows), cr)
    assert not [s for s in fig.layout.shapes if s.type == "line"]


def test_breakeven_residuals_in_percent_with_the_refusal_band():
    rows = _rows()
    rows["time_us"] *= 1 + 0.01 * np.sin(np.arange(len(rows)))
    points = be.line_points(rows)
    fig = viz.breakeven_residuals(points)
    assert len(fig.data) == 2 * 2 * 3
    ys = np.concatenate([t.y for t in fig.data])
    assert np.abs(ys).max() < 0.05 and np.abs(ys).max() > 0  # fractions, drawn as percentages
    assert _is_percent(fig.layout.yaxis) and "%" in fig.layout.yaxis.title.text and "%" in fig.layout.title.text
    band = sorted({s.y0 for s in fig.layout.shapes if s.type == "line"})
    assert band == [-0.05, 0.05]
    assert sorted({s.y0 for s in viz.breakeven_residuals(points, max_rel_residual=0.1).layout.shapes}) == [-0.1, 0.1]
    # the y title once, on the middle row of the first column (repeated on short rows the titles overlapped)
    titled = [k for k in fig.layout if k.startswith("yaxis") and fig.layout[k].title.text]
    assert len(titled) == 1


def test_points_a_trimmed_line_left_out_are_open_and_its_line_starts_after_them():
    from fixtures import breakeven_rows

    points = be.line_points(breakeven_rows({"bf16": (10.0, 0.02), "fp8_e4m3": lambda c: max(40.0, 0.01 * c)}))
    name = "fp8_e4m3 dequant"
    for fig in (viz.breakeven_lines(points), viz.breakeven_residuals(points)):
        assert "open markers: left out of the fit" in fig.layout.title.text
        trace = next(t for t in fig.data if t.name == name and "markers" in t.mode)
        assert [s.endswith("-open") for s in trace.marker.symbol] == [x < 4096 for x in trace.x]
        base = next(t for t in fig.data if t.name == "bf16 dequant" and "markers" in t.mode)
        assert not any(s.endswith("-open") for s in base.marker.symbol)
    line = next(t for t in viz.breakeven_lines(points).data if t.name == f"{name} (fit)")
    assert min(line.x) == 4096


# ------------------------------------------------------------------------------------ scale health
@pytest.fixture(scope="module")
def health():
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(64, 2, 16, generator=g) * s for s in (1.0, 500.0, 1e-4)]  # fine, saturating, underflowing
    v = [torch.randn(64, 2, 16, generator=g) for _ in range(3)]
    return measure_scale_health(k, v, methods=["1.0", "amax"])


@pytest.mark.parametrize("metric", ["saturated_frac", "underflow_frac"])
def test_scale_health_map_cells_per_layer_and_head_in_percent(health, metric):
    fig = viz.scale_health_map(health.heads, metric)
    assert len(fig.data) == 2 and [a.text for a in fig.layout.annotations] == ["scale 1.0", "scale amax"]
    h = fig.data[0]
    assert list(h.x) == ["K h0", "K h1", "V h0", "V h1"] and list(h.y) == [0, 1, 2]
    z = np.array(h.z, dtype=float)
    want = health.heads[(health.heads["method"] == "1.0") & (health.heads["side"] == "k")]
    for r in want.itertuples():
        assert z[r.layer, r.head] == getattr(r, metric)
    if metric == "saturated_frac":  # scale 1.0: layer 1's K (|x| ~ 500 x N(0, 1)) saturates, layer 0's does not
        assert z[1, 0] > 0.1 and z[0, 0] == 0
    else:  # layer 2's K (1e-4 x N(0, 1)) mostly flushes to zero under scale 1.0
        assert z[2, 0] > 0.1
    assert fig.data[0].zmax == fig.data[1].zmax  # one colour scale for every panel
    assert fig.data[-1].colorbar.tickformat.endswith("%") and "(%)" in fig.layout.title.text
    assert "%" in h.hovertemplate


def _advice(**overrides):
    return pd.DataFrame(dict(dict(method=["amax", "vllm"], error_all_fp8=[0.12, 0.3], error_after=[0.09, 0.1],
                                  tolerance=[0.1, 0.1], n_layers_bf16=[1, 4], n_layers=[30, 30],
                                  tokens_lost=[1000, 4000]), **overrides))


def test_advice_bars_before_after_and_held_out_with_the_tolerance():
    advice = _advice()
    fig = viz.advice_bars(advice)
    assert [t.name for t in fig.data] == ["all layers FP8", "advised layers 16-bit"]
    assert list(fig.data[1].y) == [0.09, 0.1] and "4 of 30 layers 16-bit, 4,000 tokens" in fig.data[0].customdata[1]
    assert any(s.type == "line" and s.y0 == 0.1 for s in fig.layout.shapes)
    assert _is_percent(fig.layout.yaxis) and "%" in fig.layout.yaxis.title.text
    held = viz.advice_bars(advice.assign(heldout_all_fp8=[0.13, 0.31], heldout_after=[0.1, 0.12]))
    assert len(held.data) == 4 and len({t.marker.color for t in held.data}) == 4


# ------------------------------------------------------------------------------------ long context
def _errors(contexts=(4096, 16384, 131072)):
    rows = []
    for entry in ("decode", "attend"):
        for mode in ("dequant", "fp8"):
            for c in contexts:
                for error, e in (("kernel", 2e-3), ("quantization", 0.02), ("total", 0.021)):
                    rows.append(dict(context=c, entry=entry, mode=mode, error=error, rel_err_median=e,
                                     rel_err_max=3 * e))
    return pd.DataFrame(rows)


def _needles(contexts=(4096, 16384, 131072), lost=()):
    return pd.DataFrame([dict(context=c, entry=e, mode=m, margin_exact=1.0, margin_fp8=-0.2 if c in lost else 0.8,
                              needle_top1=c not in lost, needle_weight_exact=0.3, needle_weight_kernel=0.29)
                         for e in ("decode", "attend") for m in ("dequant", "fp8") for c in contexts])


def test_long_context_errors_panel_per_entry_and_mode_log_log_percent():
    fig = viz.long_context_errors(_errors())
    assert len(fig.data) == 2 * 2 * 3 and sum(t.showlegend for t in fig.data) == 3
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log" and _is_percent(fig.layout.yaxis)
    assert list(fig.layout.xaxis.ticktext) == ["4k", "16k", "128k"]
    assert {t.name for t in fig.data} == set(df_.ERROR_NAMES.values())
    assert len({t.line.color for t in fig.data if t.showlegend}) == 3
    t = fig.data[0]
    assert np.allclose(np.array(t.error_y.array) + np.array(t.y), 3 * np.array(t.y))  # bars reach the maximum
    assert "%" in fig.layout.title.text and "tokens" in fig.layout.xaxis3.title.text
    assert [a.text for a in fig.layout.annotations][:2] == ["dequant mode · fp8kv.decode", "fp8 mode · fp8kv.decode"]


def test_needle_margins_cross_where_the_needle_was_lost():
    fig = viz.needle_margins(_needles(lost=(131072,)))
    fp8 = [t for t in fig.data if t.name and t.name.startswith("FP8 cache")]
    assert len(fp8) == 2 and all(list(t.marker.symbol) == ["circle", "circle", "x"] for t in fp8)
    assert any(s.type == "line" and s.y0 == 0 for s in fig.layout.shapes)
    weights = [t for t in fig.data if t.name and t.name.startswith("fp8kv.")]
    assert len(weights) == 4 and {t.line.dash for t in weights} == {"solid", "dash"}
    assert fig.layout.xaxis.type == "log" and _is_percent(fig.layout.yaxis2)
    assert "(logits)" in fig.layout.yaxis.title.text and "%" in fig.layout.yaxis2.title.text


# ------------------------------------------------------------------------------------ refusals
CASES = [
    (lambda: viz.breakeven_lines(be.line_points(_rows()).drop(columns="fitted_us")), "points lacks column(s) ['fitted_us']"),
    (lambda: viz.breakeven_lines(be.line_points(_rows()).iloc[0:0]), "points has no rows"),
    (lambda: viz.breakeven_lines(be.line_points(_rows()), be.crossings(be.fit_lines(_rows())).drop(columns="batch")),
     "crossings lacks column(s) ['batch']"),
    (lambda: viz.breakeven_residuals(be.line_points(_rows()).drop(columns="rel_residual")),
     "points lacks column(s) ['rel_residual']"),
    (lambda: viz.breakeven_residuals(be.line_points(_rows()), max_rel_residual=5), "max_rel_residual=5"),
    (lambda: viz.scale_health_map(pd.DataFrame(dict(layer=[0], head=[0], side=["k"], method=["amax"],
                                                    saturated_frac=[0.0])), "rel_err"), "metric='rel_err'"),
    (lambda: viz.scale_health_map(pd.DataFrame(dict(layer=[0], head=[0], side=["out"], method=["amax"],
                                                    saturated_frac=[0.0]))), "heads (K and V rows) has no rows"),
    (lambda: viz.scale_health_map(pd.DataFrame(dict(layer=[0]))), "heads lacks column(s)"),
    (lambda: viz.advice_bars(pd.DataFrame(dict(method=["amax"]))), "advice lacks column(s)"),
    # int() of these: OverflowError (inf) before, or a fraction rounded (head 0.5 drawn as head 0)
    (lambda: viz.scale_health_map(pd.DataFrame(dict(layer=[0, np.inf], head=[0, 0], side=["k", "v"],
                                                    method=["amax"] * 2, saturated_frac=[0.0] * 2))),
     "scale_health_map: column 'layer' of df holds inf in row 1; expected a finite whole number there"),
    (lambda: viz.scale_health_map(pd.DataFrame(dict(layer=[0, 0], head=[0, 0.5], side=["k", "k"],
                                                    method=["amax"] * 2, saturated_frac=[0.0] * 2))),
     "scale_health_map: column 'head' of df holds 0.5 in row 1"),
    (lambda: viz.advice_bars(_advice(n_layers=[30, np.inf])),
     "advice_bars: column 'n_layers' of df holds inf in row 1; expected a finite whole number there"),
    (lambda: viz.advice_bars(_advice(tokens_lost=[1000, 2.5])), "advice_bars: column 'tokens_lost' of df holds 2.5"),
    (lambda: viz.long_context_errors(_errors().drop(columns="rel_err_max")), "errors lacks column(s) ['rel_err_max']"),
    (lambda: viz.long_context_errors(_errors().iloc[0:0]), "errors has no rows"),
    (lambda: viz.long_context_errors(_errors(), statistic="mean"), "statistic='mean'"),
    (lambda: viz.long_context_errors(_errors().assign(context=np.nan)), "NaN in column 'context'"),
    (lambda: viz.needle_margins(_needles().drop(columns="margin_fp8")), "needles lacks column(s) ['margin_fp8']"),
    (lambda: viz.needle_margins(_needles().iloc[0:0]), "needles has no rows"),
]


@pytest.mark.parametrize("call, words", CASES, ids=[str(i) for i in range(len(CASES))])
def test_figures_refuse_frames_they_cannot_draw_by_name(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()
