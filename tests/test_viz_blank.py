"""Figures refuse data that would draw a blank figure (no rows, no finite value, an unknown model, a negative
value on a log colour scale) by a ValueError naming the argument and what is missing."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from fp8kv import viz

NAN = float("nan")


def _rows(values):
    n = len(values)
    return pd.DataFrame(dict(x=list(range(n)), y=values, label=["a"] * n))


@pytest.mark.parametrize("figure", ["line", "grouped_bars", "bench_lines"])
@pytest.mark.parametrize("values, words", [([], "df has no y to draw (no rows)"),
                                           ([NAN, NAN], "df has no y to draw (2 rows, none finite there)")])
def test_line_and_bar_figures_refuse_no_finite_value(figure, values, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        getattr(viz, figure)(_rows(values), "x", "y")


@pytest.mark.parametrize("figure", ["line", "grouped_bars", "bench_lines"])
def test_log_axes_need_a_positive_value(figure):
    with pytest.raises(ValueError, match=re.escape("df has no y to draw (2 rows, none positive and finite there)")):
        getattr(viz, figure)(_rows([0.0, -1.0]), "x", "y", log_y=True)
    getattr(viz, figure)(_rows([NAN, 2.0]), "x", "y", log_y=True)  # one value to draw: drawn


def _layers(metric_values, model="m"):
    n = len(metric_values)
    return pd.DataFrame(dict(model=[model] * n, config=["fp8"] * n, layer=list(range(n)), layer_type=["full"] * n,
                             attn_rel_err=metric_values))


def test_per_layer_refuses_an_unknown_model_and_no_values():
    with pytest.raises(ValueError, match=re.escape("model='zz' is not in layers; it has ['m']")):
        viz.per_layer(_layers([0.1, 0.2]), "zz", "attn_rel_err")
    with pytest.raises(ValueError, match=re.escape("layers of model 'm' (the FP8 configs) has no attn_rel_err to "
                                                   "draw (2 rows, none positive and finite there)")):
        viz.per_layer(_layers([NAN, NAN]), "m", "attn_rel_err")
    with pytest.raises(ValueError, match=re.escape("(the bf16 run) has no k_amax to draw (no rows)")):
        viz.per_layer(_layers([0.1]).assign(k_amax=1.0), "m", "k_amax")  # no bf16 rows
    assert len(viz.per_layer(_layers([0.1, 0.2]), "m", "attn_rel_err").data) == 1


def test_relative_error_vs_magnitude_refuses_nothing_to_draw():
    df = pd.DataFrame(dict(magnitude=[1.0, 2.0], rel_error=[0.0, NAN], format=["e4m3"] * 2))
    with pytest.raises(ValueError, match=re.escape("df has no rel_error to draw (2 rows, none positive and finite")):
        viz.relative_error_vs_magnitude(df)
    with pytest.raises(ValueError, match=re.escape("df has no magnitude to draw (no rows)")):
        viz.relative_error_vs_magnitude(df.iloc[0:0])


def _heat(values):
    n = len(values)
    return pd.DataFrame(dict(granularity=["tensor"] * n, scale_method=[f"s{i}" for i in range(n)],
                             format=["e4m3"] * n, out_rel_err=values))


def test_quant_error_heatmap_refuses_no_finite_value_and_negatives_on_a_log_scale():
    with pytest.raises(ValueError, match=re.escape("df has no out_rel_err to draw (2 rows, none positive and finite")):
        viz.quant_error_heatmap(_heat([NAN, NAN]))
    with pytest.raises(ValueError, match=r"df has a negative out_rel_err \(-0.5\); log_color=True .* log_color=False"):
        viz.quant_error_heatmap(_heat([0.1, -0.5]))  # was a blank (NaN) cell
    signed = viz.quant_error_heatmap(_heat([0.1, -0.5]), log_color=False).data[0]
    assert list(signed.z[0]) == [0.1, -0.5]


def _bench(**cols):
    df = pd.DataFrame(dict(label=["a", "a"], batch=[1, 1], context=[1024, 4096], time_us=[1.0, 2.0],
                           bytes=[1e6, 4e6], gbps=[10.0, 20.0]))
    return df.assign(**cols)


@pytest.mark.parametrize("call, words", [
    (lambda: viz.tokens_label(float("inf")), "a token count (context, window) is inf"),  # an OverflowError before
    (lambda: viz.bench_lines(_bench(context=[1024, float("inf")]), "context", "time_us", log_x=True),
     "a token count (context, window) is inf"),
    (lambda: viz.bench_lines(_bench(batch=[NAN, NAN]), "context", "time_us", facet="batch"),
     "df has NaN in column 'batch' (row 0)"),  # a figure without a trace before
    (lambda: viz.grouped_bars(_bench(batch=[1, NAN]), "context", "time_us", facet_col="batch"),
     "df has NaN in column 'batch' (row 1)"),  # a panel titled "B = nan" before
    (lambda: viz.bandwidth_roofline(_bench().iloc[0:0], 100.0), "df has no bytes to draw (no rows)"),
    (lambda: viz.bandwidth_roofline(_bench(gbps=[-1.0, NAN]), 100.0),
     "df has no gbps to draw (2 rows, none positive and finite there)"),
    (lambda: viz.cast_comparison(pd.DataFrame(dict(input=[], output=[], method=[], format=[]))), "df has no rows"),
    (lambda: viz.cast_comparison(pd.DataFrame(dict(input=[1.0], output=[1.0], method=[NAN], format=["e4m3"]))),
     "df has NaN in column 'method' (row 0)"),
])
def test_figures_refuse_a_blank_figure_or_a_nan_label(call, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        call()


def test_error_vs_tolerance_refuses_a_matrix_where_nothing_ran():
    rows = pd.DataFrame(dict(backend=["triton", "reference"], mode="dequant", kv_dtype="fp8_e4m3", granularity="tensor",
                             status=["unsupported", "passed"], rel_err=[NAN, 0.0], tol=[NAN, 1e-3]))
    with pytest.raises(ValueError, match=re.escape("df (rows that ran, the reference's left out) has no share to draw "
                                                   "(no rows)")):
        viz.error_vs_tolerance(rows)  # an empty figure before
    with pytest.raises(ValueError, match="none positive and finite"):
        viz.error_vs_tolerance(rows.assign(status="failed", rel_err=[0.1, 0.0], tol=[-1.0, 1e-3]))
