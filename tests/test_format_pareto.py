"""fp8kv.viz.format_pareto (the figures and answer of notebook 10) and the table they read,
fp8kv.analysis.format_errors.format_table: the Pareto front on constructed points (dominated, tied, unmeasured),
each figure's traces, titles with units and log axes in powers of ten, the answer's pick and its words for a
smoke run and a GPU run, and bad input refused by name."""

from __future__ import annotations

import math
import random
import re

import pandas as pd
import pytest

from fp8kv import viz
from fp8kv.analysis.format_errors import bench_format_name, fitting_formats, format_table
from fp8kv.capacity import capacity_table, get_model
from fp8kv.kv_formats import kv_footprint
from fp8kv.viz import format_pareto as fpz

NAN = math.nan


def _table(timing="cuda-graph", **overrides) -> pd.DataFrame:
    """A format table as format_table builds it: three formats on the front (mxfp4, int4, int8), nvfp4 dominated
    by int4 at equal bytes, kivi dominated by int4 and not timed."""
    rows = [
        dict(format="int8_token_head", bytes_per_token=12240.0, code_bytes_per_token=11520.0, scale_bytes_per_token=720.0,
             tokens=6_266_304, kl_mean=0.001, top1_agree=0.98, out_rel_err=0.02, tokens_per_s=40_000.0),
        dict(format="int4_token_head", bytes_per_token=6480.0, code_bytes_per_token=5760.0, scale_bytes_per_token=720.0,
             tokens=11_836_368, kl_mean=0.05, top1_agree=0.9, out_rel_err=0.2, tokens_per_s=60_000.0),
        dict(format="nvfp4", bytes_per_token=6480.0, code_bytes_per_token=5760.0, scale_bytes_per_token=720.0,
             tokens=11_836_368, kl_mean=0.08, top1_agree=0.8, out_rel_err=0.25, tokens_per_s=58_000.0),
        dict(format="mxfp4", bytes_per_token=6120.0, code_bytes_per_token=5760.0, scale_bytes_per_token=360.0,
             tokens=12_532_624, kl_mean=0.2, top1_agree=0.7, out_rel_err=0.35, tokens_per_s=61_000.0),
        dict(format="kivi4_g32", bytes_per_token=7200.0, code_bytes_per_token=5760.0, scale_bytes_per_token=1440.0,
             tokens=10_652_720, kl_mean=0.06, top1_agree=0.85, out_rel_err=0.12, tokens_per_s=NAN),
    ]
    df = pd.DataFrame(rows)
    df["fits"] = True
    df["timing"] = [None if v != v else timing for v in df["tokens_per_s"]]
    df["timed_batch"], df["timed_context"] = 64, 16384
    df["gpu"], df["gpu_memory_gib"] = None, 79.6
    for k, v in overrides.items():
        df[k] = v
    return df


# ------------------------------------------------------------------------------------ pareto_front
def _dominated(p, q) -> bool:
    """Whether q dominates p (no worse on both, better on one)."""
    return q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1])


def test_pareto_front_keeps_the_non_dominated_sorted_by_x():
    rows = pd.DataFrame(dict(name=list("abcdef"), x=[4.0, 1.0, 2.0, 3.0, 2.5, 5.0], y=[1.0, 5.0, 3.0, 3.5, 2.0, 0.5]))
    front = viz.pareto_front(rows, "x", "y")
    assert list(front["name"]) == ["b", "c", "e", "a", "f"]  # d (3, 3.5) is beaten by c (2, 3)
    assert list(front.index) == [1, 2, 4, 0, 5]  # the rows themselves, their index kept


@pytest.mark.parametrize("points, want", [
    ([(1, 1), (1, 1)], [0, 1]),                      # equal points: neither dominates, both kept
    ([(1, 2), (1, 1)], [1]),                         # same x: the higher y is dominated
    ([(2, 1), (1, 1)], [1]),                         # same y: the larger x is dominated
    ([(1, 1), (1, 1), (2, 2)], [0, 1]),              # a point beaten by two tied ones
    ([(1, 3), (3, 1), (2, 2)], [0, 2, 1]),           # a trade-off: all on the front
    ([(5, 5)], [0]),                                 # one point is its own front
])
def test_pareto_front_ties_and_dominated(points, want):
    rows = [dict(i=i, x=float(x), y=float(y)) for i, (x, y) in enumerate(points)]
    assert list(viz.pareto_front(rows, "x", "y")["i"]) == want


def test_pareto_front_leaves_unmeasured_rows_out_and_lets_them_dominate_nothing():
    rows = pd.DataFrame(dict(x=[1.0, NAN, 0.5, 2.0], y=[2.0, 0.1, NAN, 1.0]))
    front = viz.pareto_front(rows, "x", "y")
    assert list(front.index) == [0, 3]
    assert viz.pareto_front(pd.DataFrame(dict(x=[NAN], y=[1.0])), "x", "y").empty


def test_pareto_front_matches_a_brute_force_on_random_points():
    rng = random.Random(0)
    for _ in range(50):
        pts = [(rng.randint(0, 6), rng.randint(0, 6)) for _ in range(rng.randint(1, 12))]
        got = list(viz.pareto_front([dict(i=i, x=x, y=y) for i, (x, y) in enumerate(pts)], "x", "y")["i"])
        want = [i for i, p in enumerate(pts) if not any(_dominated(p, q) for q in pts)]
        assert sorted(got) == want
        assert [pts[i] for i in got] == sorted(pts[i] for i in got)  # sorted by x, then y


@pytest.mark.parametrize("rows, x, y, exc, match", [
    (pd.DataFrame(dict(x=[1.0])), "x", "y", ValueError, r"rows lacks column\(s\) \['y'\]"),
    (pd.DataFrame(dict(x=[1.0], y=["big"])), "x", "y", TypeError, r"column 'y' holds 'big'"),
    (pd.DataFrame(dict(x=[True], y=[1.0])), "x", "y", TypeError, r"column 'x' holds True"),
    (pd.DataFrame(dict(x=[None], y=[1.0])), "x", "y", TypeError, r"column 'x' holds None"),
    ("rows", "x", "y", TypeError, r"expected a pandas DataFrame or a list of row dicts"),
    ([1, 2], "x", "y", TypeError, r"expected a pandas DataFrame or a list of row dicts"),
])
def test_pareto_front_refuses_bad_rows_by_name(rows, x, y, exc, match):
    with pytest.raises(exc, match=match):
        viz.pareto_front(rows, x, y)


# ------------------------------------------------------------------------------------ format_table
@pytest.mark.parametrize("kv_dtype, granularity, want", [
    ("int8_token_head", "tensor", "int8_token_head"), ("nvfp4", "tensor", "nvfp4"), ("MXFP4", None, "mxfp4"),
    ("fp8_e4m3", "tensor", "fp8_e4m3_tensor"), ("fp8_e4m3", "token_head", "fp8_e4m3_token_head"),
    ("bf16", "tensor", None), ("fp16", None, None),
])
def test_bench_format_name(kv_dtype, granularity, want):
    assert bench_format_name(kv_dtype, granularity) == want


def test_fitting_formats_leaves_out_what_cannot_hold_the_head_dim():
    names = ["fp8_e4m3_tensor", "kivi4_g128", "nvfp4", "kivi4_g32"]
    assert fitting_formats(names, num_kv_heads=3, head_dim=64) == ["fp8_e4m3_tensor", "nvfp4", "kivi4_g32"]
    assert fitting_formats(names, num_kv_heads=8, head_dim=128) == names
    assert fitting_formats(names, num_kv_heads=1, head_dim=8) == ["fp8_e4m3_tensor"]


def _bench():
    rows = []
    for backend in ("triton", "reference"):
        for batch, context in ((1, 4096), (64, 4096), (64, 16384)):
            for kv, us in (("int8_token_head", 200.0), ("fp8_e4m3", 150.0), ("bf16", 300.0)):
                rows.append(dict(backend=backend, kv_dtype=kv, granularity="tensor", batch=batch, context=context,
                                 time_us=us * (context / 4096) * (10 if backend == "reference" else 1),
                                 status="ok", timing="cuda-graph"))
    rows.append(dict(backend="triton", kv_dtype="mxfp4", granularity="tensor", batch=64, context=16384,
                     time_us=NAN, status="skipped", timing="cuda-graph"))
    for kv in ("int8_token_head", "fp8_e4m3"):  # another launch of the same format, timed beside the default, last
        rows.append(dict(backend="triton", kv_dtype=kv, granularity="tensor", batch=64, context=16384, time_us=5000.0,
                         status="ok", timing="cuda-graph", variant="gluon=False"))
    return pd.DataFrame(rows)


def test_format_table_joins_bytes_errors_accuracy_and_speed():
    formats = ["int8_token_head", "fp8_e4m3_tensor", "mxfp4"]
    cap = capacity_table("SmolLM2-135M", ["H100"], [*formats, "bf16"])
    errors = pd.DataFrame([dict(format=f, layer=layer, out_rel_err=0.01 * (i + 1) * (layer + 1),
                                k_rel_err=0.1 * (i + 1), v_rel_err=0.2 * (i + 1))
                           for i, f in enumerate(formats) for layer in range(2)]
                          + [dict(format="kivi4_g128", layer=0, out_rel_err=NAN, k_rel_err=NAN, v_rel_err=NAN)])
    accuracy = pd.DataFrame(dict(config=["bf16", *formats], kl_mean=[0.0, 0.001, 0.01, 0.2],
                                 top1_agree=[1.0, 0.99, 0.95, 0.7]))
    table = format_table(cap, errors=errors, accuracy=accuracy, bench=_bench())
    assert list(table["format"]) == formats  # bf16 is the baseline, not a format
    shape = get_model("SmolLM2-135M")
    for r in table.itertuples():
        fp = kv_footprint(r.format, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                          num_layers=shape.num_layers)
        assert (r.bytes_per_token, r.code_bytes_per_token, r.scale_bytes_per_token) == \
            (float(fp.per_token), float(fp.codes), float(fp.per_token_scales))
        assert r.tokens > 0 and r.gpu == "H100"
    by = table.set_index("format")
    assert by.loc["fp8_e4m3_tensor", "out_rel_err"] == pytest.approx((0.02 + 0.04) / 2)  # mean over layers
    assert by.loc["mxfp4", "kl_mean"] == 0.2 and by.loc["int8_token_head", "top1_agree"] == 0.99
    # tokens/s of the Triton rows of the default launch at the largest batch, then context: 64 sequences / (4 x the
    # 4k time), not the gluon=False rows beside them
    assert by.loc["int8_token_head", "tokens_per_s"] == pytest.approx(64 / (800e-6))
    assert by.loc["fp8_e4m3_tensor", "tokens_per_s"] == pytest.approx(64 / (600e-6))
    assert (by.loc["int8_token_head", "timed_batch"], by.loc["int8_token_head", "timed_context"]) == (64, 16384)
    assert pd.isna(by.loc["mxfp4", "tokens_per_s"]) and pd.isna(by.loc["mxfp4", "timing"])  # its row skipped
    bare = format_table(cap)
    assert bare[["out_rel_err", "kl_mean", "tokens_per_s"]].isna().all().all()


@pytest.mark.parametrize("arg, frame, match", [
    ("capacity", pd.DataFrame(dict(kv_dtype=["nvfp4"])), r"capacity lacks column\(s\)"),
    ("errors", pd.DataFrame(dict(format=["nvfp4"])), r"errors lacks column\(s\) \['out_rel_err'"),
    ("accuracy", pd.DataFrame(dict(config=["nvfp4"])), r"accuracy lacks column\(s\) \['kl_mean'"),
    ("bench", pd.DataFrame(dict(backend=["triton"])), r"bench lacks column\(s\)"),
])
def test_format_table_names_a_frame_without_its_columns(arg, frame, match):
    cap = capacity_table("SmolLM2-135M", ["H100"], ["nvfp4"])
    kw = {"capacity": cap, arg: frame}
    with pytest.raises(ValueError, match=match):
        format_table(kw.pop("capacity"), **kw)


@pytest.mark.parametrize("col, value", [("batch", math.inf), ("context", 4096.5), ("batch", math.nan)])
def test_format_table_names_a_bench_count_that_is_no_whole_number(col, value):
    """int() of the bench's batch or context raised OverflowError (inf) or "cannot convert float NaN" before."""
    bench = _bench().astype({col: float})
    bench.loc[3, col] = value
    with pytest.raises(ValueError, match=re.escape(f"format_table: column {col!r} of df holds {value!r} in row 3 (a "
                                                   "row that ran); expected a finite whole number there")):
        format_table(capacity_table("SmolLM2-135M", ["H100"], ["int8_token_head"]), bench=bench)


def test_format_table_refuses_a_capacity_without_formats():
    with pytest.raises(ValueError, match=r"capacity has no row of a KV format \(its kv_dtype: \['bf16'\]\)"):
        format_table(capacity_table("SmolLM2-135M", ["H100"], ["bf16"]))


# ------------------------------------------------------------------------------------ figures
def _is_power_log(axis) -> bool:
    return axis.type == "log" and axis.exponentformat == "power" and not (axis.tickformat or "").endswith("s")


def test_pareto_figure_draws_the_front_joined_and_named_in_bold():
    table = _table()
    fig = viz.pareto_figure(table, model="SmolLM2-135M", tolerance=0.01)
    line = next(t for t in fig.data if t.name == "Pareto front")
    assert list(line.x) == [6120.0, 6480.0, 12240.0] and list(line.y) == [0.2, 0.05, 0.001]
    points = {t.name: t for t in fig.data if t.name != "Pareto front"}
    assert set(points) == set(table["format"])
    bold = {n for n, t in points.items() if t.text[0].startswith("<b>")}
    assert bold == {"mxfp4", "int4_token_head", "int8_token_head"}
    assert _is_power_log(fig.layout.yaxis) and fig.layout.xaxis.tickformat == ","
    assert "bytes" in fig.layout.xaxis.title.text and "nats/token" in fig.layout.yaxis.title.text
    assert "SmolLM2-135M" in fig.layout.title.text and "nats/token" in fig.layout.title.text
    assert "decode tokens/s at batch 64, context 16,384" in fig.layout.title.text
    assert "CPU smoke" not in fig.layout.title.text
    # marker area proportional to tokens/s; the untimed format open and smallest
    size = {n: t.marker.size[0] for n, t in points.items()}
    assert size["mxfp4"] == pytest.approx(44) and size["int8_token_head"] == pytest.approx(44 * math.sqrt(40 / 61))
    assert points["kivi4_g32"].marker.symbol == "circle-open" and points["mxfp4"].marker.symbol == "circle"
    assert [s.y0 for s in fig.layout.shapes] == [0.01]  # the tolerance, with its unit
    assert [a.text for a in fig.layout.annotations] == ["tolerance 0.01 nats/token"]
    colours = [t.marker.color for t in points.values()]
    assert len(set(colours)) == len(colours) and set(colours) <= set(viz.PALETTE) | set(viz.FORMAT_COLORS.values())


def test_pareto_figure_without_timing_sizes_by_tokens_and_says_so():
    table = _table(tokens_per_s=NAN, timing=None)
    fig = viz.pareto_figure(table)
    assert "area ∝ tokens that fit" in fig.layout.title.text
    assert all(t.marker.symbol == "circle" for t in fig.data if t.name != "Pareto front")


def test_pareto_figure_says_when_timings_are_cpu_smoke():
    fig = viz.pareto_figure(_table(timing="cpu-wallclock"))
    assert "CPU smoke timing" in fig.layout.title.text


def test_pareto_figure_falls_back_to_the_attention_error_without_kl():
    table = _table(kl_mean=NAN)
    assert fpz.error_metric(table) == "out_rel_err"
    fig = viz.pareto_figure(table)
    assert "attention-output relative error" in fig.layout.yaxis.title.text
    line = next(t for t in fig.data if t.name == "Pareto front")
    # KIVI is on this front: its attention error (0.12) beats INT4's (0.2) though its KL (0.06) does not
    assert list(line.x) == [6120.0, 6480.0, 7200.0, 12240.0] and list(line.y) == [0.35, 0.2, 0.12, 0.02]


def test_format_bytes_stacks_codes_and_scales_fewest_first():
    table = _table()
    fig = viz.format_bytes(table, baseline_bytes=23040, model="SmolLM2-135M")
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.name for b in bars] == ["codes", "scales (and zero points)"] and fig.layout.barmode == "stack"
    order = list(table.sort_values("bytes_per_token", kind="stable")["format"])
    assert list(bars[0].x) == order
    by = table.set_index("format")
    assert list(bars[0].y) == [by.loc[f, "code_bytes_per_token"] for f in order]
    assert list(bars[1].y) == [by.loc[f, "scale_bytes_per_token"] for f in order]
    assert bars[0].marker.color != bars[1].marker.color
    assert fig.layout.yaxis.tickformat == "," and "bytes" in fig.layout.title.text
    assert [s.y0 for s in fig.layout.shapes] == [23040] and "bf16: 23,040" in fig.layout.annotations[0].text


def test_format_layer_errors_k_and_v_panels_a_line_per_format():
    errors = pd.DataFrame([dict(source="/cache/models/smollm2-135m", format=f, layer=layer,
                                k_rel_err=0.01 * (i + 1), v_rel_err=0.02 * (i + 1))
                           for i, f in enumerate(["int8_token_head", "nvfp4"]) for layer in range(4)]
                          + [dict(source="/cache/models/smollm2-135m", format="kivi4_g128", layer=0,
                                  k_rel_err=NAN, v_rel_err=NAN)])
    fig = viz.format_layer_errors(errors)
    assert len(fig.data) == 2 * 2 and {t.name for t in fig.data} == {"int8_token_head", "nvfp4"}
    assert sum(t.showlegend for t in fig.data) == 2
    assert [a.text for a in fig.layout.annotations] == ["K: ‖K̂ − K‖ / ‖K‖", "V: ‖V̂ − V‖ / ‖V‖"]
    nv = [t for t in fig.data if t.name == "nvfp4"]
    assert list(nv[0].y) == [0.02] * 4 and list(nv[1].y) == [0.04] * 4
    assert _is_power_log(fig.layout.yaxis) and "smollm2-135m" in fig.layout.title.text
    assert "relative error" in fig.layout.title.text


@pytest.mark.parametrize("call, match", [
    (lambda: viz.pareto_figure(_table().drop(columns=["tokens"])), r"table lacks column\(s\) \['tokens'\]"),
    (lambda: viz.pareto_figure(_table().iloc[:0]), r"table has no rows"),
    (lambda: viz.pareto_figure(_table(kl_mean=NAN, out_rel_err=NAN)), r"no error measured for every format"),
    (lambda: viz.pareto_figure(_table(), error="ppl"), r"error"),
    (lambda: viz.pareto_figure(_table(), tolerance=0), r"tolerance"),
    (lambda: viz.format_bytes(_table().drop(columns=["scale_bytes_per_token"])), r"scale_bytes_per_token"),
    (lambda: viz.format_bytes(_table(), baseline_bytes=-1), r"baseline_bytes"),
    (lambda: viz.format_layer_errors(pd.DataFrame(dict(format=["a"], layer=[0], k_rel_err=[NAN], v_rel_err=[NAN]))),
     r"nothing to draw"),
    (lambda: viz.format_layer_errors(pd.DataFrame(dict(format=["a"]))), r"errors lacks column\(s\)"),
    # a timed table without how it was timed: an AttributeError / KeyError before
    (lambda: viz.pareto_figure(_table().drop(columns=["timing"])),
     r"table \(timed: it has tokens_per_s\) lacks column\(s\) \['timing'\]"),
    (lambda: viz.format_answer(_table().drop(columns=["timed_batch"]), model="m", gpu="g", tolerance=0.06, smoke=False),
     r"lacks column\(s\) \['timed_batch'\]"),
    # int() of these: OverflowError (inf) or "cannot convert float NaN" before, or a fraction rounded
    (lambda: viz.pareto_figure(_table(tokens=[1, 2, 3, math.inf, 5])),
     r"pareto_figure: column 'tokens' of df holds inf in row 3; expected a finite whole number there"),
    (lambda: viz.pareto_figure(_table(timed_batch=[64, 64.5, 64, 64, 64])),
     r"pareto_figure: column 'timed_batch' of df holds 64\.5 in row 1"),
    (lambda: viz.format_answer(_table(timed_context=[16384, math.nan, 1, 1, 1]), model="m", gpu="g",
                               tolerance=0.06, smoke=False),
     r"format_answer: column 'timed_context' of df holds nan in row 1"),
    (lambda: viz.format_answer(_table(tokens=[1, math.inf, 3, 4, 5]), model="m", gpu="g", tolerance=0.06,
                               smoke=False), r"format_answer: column 'tokens' of df holds inf in row 1"),
    (lambda: viz.format_layer_errors(pd.DataFrame(dict(format=["a", "a"], layer=[0, math.inf], k_rel_err=[0.1, 0.1],
                                                       v_rel_err=[0.1, 0.1]))),
     r"format_layer_errors: column 'layer' of df holds inf in row 1; expected a finite whole number there"),
    (lambda: viz.format_layer_errors(pd.DataFrame(dict(format=["a", "a"], layer=[0, 1.5], k_rel_err=[0.1, 0.1],
                                                       v_rel_err=[0.1, 0.1]))),
     r"format_layer_errors: column 'layer' of df holds 1\.5 in row 1"),
    # a format not timed (kivi4_g32, row 4) needs no timed_batch
    (lambda: viz.format_answer(_table(timed_batch=[64, 64, 64, 64, math.nan], tokens=[1, 2, 3, 4, 5.5]),
                               model="m", gpu="g", tolerance=0.06, smoke=False), r"'tokens' of df holds 5\.5 in row 4"),
])
def test_figures_refuse_what_they_cannot_draw_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------ the answer
def test_answer_on_a_gpu_picks_the_smallest_front_format_within_the_tolerance():
    table = _table()
    text = viz.format_answer(table, model="SmolLM2-135M", gpu="NVIDIA H100 80GB HBM3", tolerance=0.06, smoke=False,
                             baseline_tokens=3_328_976)
    assert viz.format_pick(table, tolerance=0.06) == "int4_token_head"
    assert text.startswith("For SmolLM2-135M on NVIDIA H100 80GB HBM3, pick **int4_token_head**: mean KL 0.05 "
                           "nats/token against bf16 K/V, within the tolerance (top-1 agreement 90.0%)")
    assert "6,480 bytes per token" in text and "11,836,368 tokens fit in NVIDIA H100 80GB HBM3's memory" in text
    assert "(3.56× bf16's 3,328,976)" in text
    assert "60,000 decode tokens/s at batch 64, context 16,384." in text
    assert "within the tolerance of 0.06 nats/token" in text
    assert "The next smaller, mxfp4 (6,120 bytes per token), has mean KL 0.2 nats/token against bf16 K/V, above " \
        "the tolerance" in text
    assert "Smoke" not in text and "smoke" not in text
    assert "whole decode step" not in text  # no step columns joined: no step sentence


def test_answer_of_a_smoke_run_says_so_first_and_calls_the_timing_cpu_smoke():
    table = _table(timing="cpu-wallclock", gpu="H100")
    text = viz.format_answer(table, model="SmolLM2-135M", gpu="an H100 (planned: no GPU here)", tolerance=0.01,
                             smoke=True, baseline_tokens=3_328_976)
    assert text.startswith("**Smoke run (no GPU")
    assert "pick **int8_token_head**" in text and "tokens fit in H100 memory (planned; 1.88× bf16's" in text
    assert "from a CPU smoke timing in Triton's interpreter, meaningless for any GPU" in text
    # a CPU wall-clock timing is named so even where the caller did not say smoke
    assert "CPU smoke timing" in viz.format_answer(table, model="m", gpu="cpu", tolerance=0.01, smoke=False)


def test_answer_when_nothing_meets_the_tolerance_picks_the_most_accurate_and_says_so():
    table = _table()
    text = viz.format_answer(table, model="m", gpu="g", tolerance=1e-4, smoke=False)
    assert viz.format_pick(table, tolerance=1e-4) == "int8_token_head"
    assert "no format on the Pareto front is within the tolerance of 0.0001 nats/token" in text
    assert "next smaller" not in text


def test_answer_leaves_out_speed_for_an_untimed_pick_and_formats_that_do_not_fit():
    table = _table()
    table.loc[table["format"] == "int4_token_head", "tokens"] = 0  # does not fit: off the front
    table.loc[table["format"] == "nvfp4", "tokens_per_s"] = NAN
    assert viz.format_pick(table, tolerance=0.1) == "nvfp4"
    text = viz.format_answer(table, model="m", gpu="g", tolerance=0.1, smoke=False)
    assert "pick **nvfp4**" in text and "tokens/s" not in text.split(". It is")[0]


def test_answer_by_the_attention_error_where_no_kl_was_measured():
    text = viz.format_answer(_table(kl_mean=NAN), model="m", gpu="g", tolerance=0.25, smoke=False)
    assert "pick **int4_token_head**: attention-output relative error 0.2 (mean over layers)" in text
    assert "within the tolerance of 0.25 (relative)" in text


@pytest.mark.parametrize("kw, exc, match", [
    (dict(model=""), TypeError, r"model=''"),
    (dict(model=None), TypeError, r"model=None"),
    (dict(gpu=3), TypeError, r"gpu=3"),
    (dict(smoke="yes"), TypeError, r"smoke='yes'"),
    (dict(smoke=None), TypeError, r"smoke=None"),
    (dict(tolerance=0), ValueError, r"tolerance"),
    (dict(tolerance=-0.1), ValueError, r"tolerance"),
    (dict(tolerance=NAN), ValueError, r"tolerance"),
    (dict(tolerance="0.1"), TypeError, r"tolerance"),
    (dict(baseline_tokens=0), ValueError, r"baseline_tokens"),
    (dict(baseline_tokens=1.5), TypeError, r"baseline_tokens"),
    (dict(error="ppl"), ValueError, r"error='ppl'"),
])
def test_answer_refuses_bad_arguments_by_name(kw, exc, match):
    args = dict(model="m", gpu="g", tolerance=0.01, smoke=False, **{})
    args.update(kw)
    with pytest.raises(exc, match=match):
        viz.format_answer(_table(), **args)


def test_answer_refuses_a_table_where_nothing_fits():
    with pytest.raises(ValueError, match=r"no format that fits"):
        viz.format_answer(_table(tokens=0), model="m", gpu="g", tolerance=0.01, smoke=False)


# ------------------------------------------------------------------------------------ errors beside the tolerance
@pytest.mark.parametrize("value, tolerance, want", [
    (0.010007, 0.01, "0.01001"),    # above: three digits would print it equal to the tolerance
    (0.0099996, 0.01, "0.0099996"),  # below, the same
    (0.01, 0.01, "0.01"),           # equal: equal
    (0.05, 0.06, "0.05"),           # apart at three digits already
    (0.123456, None, "0.123"),      # no tolerance: three digits
])
def test_error_digits_tell_a_value_from_the_tolerance(value, tolerance, want):
    assert viz.error_digits(value, tolerance) == want
    if tolerance is not None and value != tolerance:
        assert float(want) != tolerance


def test_answer_never_prints_an_error_above_the_tolerance_equal_to_it():
    table = _table()
    table.loc[table["format"] == "int4_token_head", "kl_mean"] = 0.010007
    table.loc[table["format"] == "int8_token_head", "kl_mean"] = 0.0099996
    text = viz.format_answer(table, model="m", gpu="g", tolerance=0.01, smoke=False)
    assert "pick **int8_token_head**: mean KL 0.0099996 nats/token against bf16 K/V, within the tolerance" in text
    assert "has mean KL 0.01001 nats/token against bf16 K/V, above the tolerance" in text
    assert "within the tolerance of 0.01 nats/token" in text
    fig = viz.pareto_figure(table, tolerance=0.01)
    hover = next(t.hovertext[0] for t in fig.data if t.name == "int4_token_head")
    assert "0.01001" in hover


# ------------------------------------------------------------------------------------ the step's tokens/s
def _ceilings(**overrides) -> pd.DataFrame:
    """fp8kv.step.ceiling_table's rows of one run: bf16 (no format), FP8 per tensor, INT4 and NVFP4."""
    rows = pd.DataFrame(dict(model="Qwen3-8B", context=16384,
                             kv_dtype=["bf16", "fp8_e4m3", "int4_token_head", "nvfp4"],
                             kv_format=["", "fp8_e4m3_tensor", "int4_token_head", "nvfp4"],
                             bytes_per_token=[147456.0, 73728.0, 39168.0, 41472.0], ceiling=[30, 60, 113, 106],
                             best_tokens_per_s=[1500.0, 2500.0, 3000.0, 2800.0], best_batch=[16, 32, 64, 64],
                             ceiling_tokens_per_s=[1400.0, 2400.0, 2900.0, 2700.0]))
    for k, v in overrides.items():
        rows[k] = v
    return rows


def _with_fp8(table: pd.DataFrame) -> pd.DataFrame:
    fp8 = table[table["format"] == "int8_token_head"].assign(format="fp8_e4m3_tensor", kl_mean=0.0005,
                                                              bytes_per_token=12288.0)
    return pd.concat([table, fp8], ignore_index=True)


def test_join_step_ceilings_adds_each_formats_step_speed_by_its_format():
    table = _with_fp8(_table())
    out = viz.join_step_ceilings(table, _ceilings())
    assert list(out.columns) == [*table.columns, *fpz.STEP_COLUMNS] and list(out["format"]) == list(table["format"])
    got = out.set_index("format")
    assert got.loc["int4_token_head", "step_tokens_per_s"] == 3000.0 and got.loc["int4_token_head", "step_batch"] == 64
    assert got.loc["int4_token_head", "step_ceiling"] == 113
    assert got.loc["fp8_e4m3_tensor", "step_tokens_per_s"] == 2500.0  # the step's fp8_e4m3 KV by its kv_format
    assert math.isnan(got.loc["mxfp4", "step_tokens_per_s"]) and math.isnan(got.loc["int8_token_head", "step_batch"])
    assert (out["step_baseline"] == "bf16").all() and (out["step_baseline_tokens_per_s"] == 1500.0).all()
    assert (out["step_model"] == "Qwen3-8B").all() and (out["step_context"] == 16384).all()
    assert "step_tokens_per_s" not in table.columns  # a new frame


def test_join_step_ceilings_reads_what_the_step_report_writes():
    from fp8kv.step import ceiling_table

    rows = pd.DataFrame(dict(status="ok", model="Qwen3-8B", context=16384, kv_dtype=["bf16", "bf16", "nvfp4", "nvfp4"],
                             kv_format=["", "", "nvfp4", "nvfp4"], batch=[1, 8, 1, 16], ceiling=[8, 8, 16, 16],
                             tokens_per_s=[100.0, 600.0, 110.0, 1200.0], bytes_per_token=[1.0, 1.0, 0.3, 0.3]))
    out = viz.join_step_ceilings(_table(), ceiling_table(rows)).set_index("format")
    assert out.loc["nvfp4", "step_tokens_per_s"] == 1200.0 and out.loc["nvfp4", "step_batch"] == 16
    assert out.loc["nvfp4", "step_baseline_tokens_per_s"] == 600.0


def test_answer_quotes_the_picks_step_speed_against_bf16_and_fp8():
    table = viz.join_step_ceilings(_with_fp8(_table()), _ceilings())
    text = viz.format_answer(table, model="SmolLM2-135M", gpu="g", tolerance=0.06, smoke=False)
    assert "pick **int4_token_head**" in text
    assert text.endswith(" In a whole decode step of Qwen3-8B at context 16,384 (each KV format to its memory "
                         "ceiling), int4_token_head KV reaches 3,000 tokens/s at batch 64 (its ceiling 113): 2.00× "
                         "bf16 KV's 1,500 and 1.20× fp8_e4m3_tensor KV's 2,500.")
    # FP8 picked: against the 16-bit KV only
    fp8 = viz.format_answer(table, model="m", gpu="g", tolerance=0.0006, smoke=False)
    assert "pick **fp8_e4m3_tensor**" in fp8 and "1.67× bf16 KV's 1,500." in fp8 and "fp8_e4m3_tensor KV's" not in fp8
    # a pick the step did not run: no step sentence
    mxfp4 = viz.format_answer(table, model="m", gpu="g", tolerance=0.5, smoke=False)
    assert "pick **mxfp4**" in mxfp4 and "whole decode step" not in mxfp4


def test_answer_reads_the_step_columns_of_a_saved_table():
    """save_results writes NaN as "nan": the untimed step cells of a table read back are no number."""
    table = viz.join_step_ceilings(_with_fp8(_table()), _ceilings())
    saved = pd.DataFrame([{k: ("nan" if isinstance(v, float) and v != v else v) for k, v in r.items()}
                          for r in table.to_dict("records")])
    saved["tokens_per_s"] = table["tokens_per_s"]
    assert "2.00× bf16 KV's 1,500" in viz.format_answer(saved, model="m", gpu="g", tolerance=0.06, smoke=False)
    assert "whole decode step" not in viz.format_answer(saved, model="m", gpu="g", tolerance=0.5, smoke=False)


def test_join_step_ceilings_without_rows_leaves_the_columns_empty():
    out = viz.join_step_ceilings(_table(), _ceilings().iloc[:0])
    assert out["step_tokens_per_s"].isna().all() and out["step_model"].isna().all()


@pytest.mark.parametrize("ceilings, exc, match", [
    (_ceilings(context=[16384, 16384, 32768, 32768]), ValueError, r"ceilings holds 2 runs \(model, context\)"),
    (_ceilings().drop(columns="kv_format"), ValueError, r"join_step_ceilings: .* lacks columns \['kv_format'\]"),
    (_ceilings(best_tokens_per_s="fast"), ValueError, r"column 'best_tokens_per_s' .* not numbers"),
    (_ceilings(best_batch=1.5), ValueError, r"best_batch"),
    ("rows", TypeError, r"ceilings='rows'"),
])
def test_join_step_ceilings_refuses_bad_ceilings_by_name(ceilings, exc, match):
    with pytest.raises(exc, match=match):
        viz.join_step_ceilings(_table(), ceilings)
