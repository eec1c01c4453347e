"""fp8kv.viz figure builders and fp8kv.ui widget wrappers (no kernel needed).

That the figures survive the HTML export is checked end to end in test_notebook_runner.py.
"""

import math
import re

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch

from fp8kv import ui, viz
from fp8kv.capability import ARCHS, capability
from fp8kv.formats import FORMATS, format

# --------------------------------------------------------------------------- setup_plotly


@pytest.fixture
def restore_plotly():
    renderer, template = pio.renderers.default, pio.templates.default
    yield
    pio.renderers.default = renderer
    pio.templates.default = template


def test_setup_plotly_bundle_has_html_for_nbconvert(restore_plotly):
    viz.setup_plotly()
    assert pio.renderers.default == viz.DEFAULT_RENDERER
    assert pio.templates.default == "plotly_white"
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    # The mime bundle a notebook stores: nbconvert's HTML keeps only text/html.
    bundle = pio.renderers._build_mime_bundle(fig.to_dict())
    assert "application/vnd.plotly.v1+json" in bundle
    assert "Plotly.newPlot" in bundle["text/html"]


def test_setup_plotly_is_idempotent(restore_plotly):
    viz.setup_plotly()
    pio.renderers._to_activate = []  # as after the first figure: plotly.js already embedded
    viz.setup_plotly()
    assert pio.renderers._to_activate == []  # a second call does not embed plotly.js again


def test_setup_plotly_rejects_unknown_renderer(restore_plotly):
    with pytest.raises(ValueError):
        viz.setup_plotly("no_such_renderer")
    with pytest.raises(ValueError, match="renderer"):
        viz.setup_plotly("")


# --------------------------------------------------------------------------- figures


@pytest.mark.parametrize("names", [None, ["e4m3"], ["e5m2", "e4m3fnuz"]])
def test_fp8_code_values_traces_match_code_tables(names):
    fig = viz.fp8_code_values(names)
    expected = list(FORMATS) if names is None else names
    assert len(fig.data) == len(expected)
    for trace, name in zip(fig.data, expected, strict=True):
        vals = format(name).code_values[:128]
        keep = torch.isfinite(vals) & (vals > 0)
        assert list(trace.x) == torch.arange(128)[keep].tolist()
        assert list(trace.y) == vals[keep].tolist()
        assert trace.name.startswith(name)
    assert fig.layout.yaxis.type == "log"


def test_fp8_code_values_linear_axis_keeps_zero():
    fig = viz.fp8_code_values(["e4m3"], log_y=False)
    assert 0.0 in list(fig.data[0].y)


def _sweep():
    rows = []
    for name in ("e4m3", "e5m2"):
        for m, e in [(1e-3, 0.1), (1.0, 0.0), (3.0, 0.02), (1e5, 0.5)]:
            rows.append({"format": name, "magnitude": m, "rel_error": e})
    return pd.DataFrame(rows)


def test_relative_error_vs_magnitude_drops_zero_errors_and_marks_regions():
    df = _sweep()
    fig = viz.relative_error_vs_magnitude(df)
    assert [t.name for t in fig.data] == ["e4m3", "e5m2"]
    for t in fig.data:
        assert 0.0 not in list(t.y) and len(t.x) == 3
    # On log axes plotly.js places shapes at their data values and annotations at the values' log10.
    hlines = sorted(s.y0 for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1)
    assert hlines == pytest.approx(sorted(format(f).unit_roundoff for f in ("e4m3", "e5m2")))
    vlines = {s.x0 for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1}
    assert {format("e4m3").max, format("e5m2").max, format("e4m3").min_normal} <= vlines
    labels = {a.text: (a.x if a.xref == "x" else a.y) for a in fig.layout.annotations}
    assert labels["e4m3 max 448"] == pytest.approx(math.log10(448))
    assert labels["e5m2: unit roundoff 2^-3"] == pytest.approx(math.log10(format("e5m2").unit_roundoff))
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"


def test_relative_error_vs_magnitude_names_missing_column():
    with pytest.raises(ValueError, match="rel_error"):
        viz.relative_error_vs_magnitude(_sweep().drop(columns="rel_error"))


def test_cast_comparison_draws_nonfinite_as_labelled_markers():
    df = pd.DataFrame({
        "format": ["e5m2"] * 4,
        "method": ["bare", "bare", "fp8kv", "fp8kv"],
        "input": [1.0, 2.0, 1.0, 2.0],
        "output": [1.0, math.inf, 1.0, 2.0],
    })
    fig = viz.cast_comparison(df)
    names = [t.name for t in fig.data]
    assert names == ["bare", "bare: inf (drawn at the top)", "fp8kv"]
    marker = fig.data[1]
    assert marker.marker.symbol == "triangle-up" and "inf" in marker.hovertemplate and list(marker.x) == [2.0]
    assert marker.y[0] > 2.0  # above every finite output
    assert marker.marker.color == fig.data[0].line.color  # the same series


def test_capability_matrix_cells_follow_the_table():
    tables = [capability(a) for a in ARCHS]
    fig = viz.capability_matrix(tables, highlight="sm90")
    heat = fig.data[0]
    assert len(heat.y) == len(ARCHS) and "▶ sm90" in heat.y
    df = pd.concat(tables, ignore_index=True)
    n_combos = len(df) // len(ARCHS)
    assert len(heat.x) == n_combos
    # every cell equals the table's 'supported' for that arch and column
    for i, arch in enumerate(ARCHS):
        row = df[df["arch"] == arch]
        assert list(heat.z[i]) == [float(s) for s in row["supported"]]


def test_capability_matrix_names_missing_column():
    with pytest.raises(ValueError, match="reason"):
        viz.capability_matrix(capability("sm90").drop(columns="reason"))


def test_line_one_trace_per_color_and_log_axes():
    df = pd.DataFrame({"x": [1, 2, 1, 2], "y": [1, 4, 2, 8], "k": ["a", "a", "b", "b"]})
    fig = viz.line(df, "x", "y", "k", log_x=True, log_y=True)
    assert sorted(t.name for t in fig.data) == ["a", "b"]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    with pytest.raises(ValueError, match="'z'"):
        viz.line(df, "x", "z")


def test_add_line_puts_line_and_label_at_the_value_on_log_and_linear_axes():
    from fp8kv.viz.style import add_line

    log = go.Figure(go.Scatter(x=[1, 2], y=[10, 1000]), layout=dict(yaxis_type="log"))
    add_line(log, "y", 1000.0, annotation_text="roof")
    assert log.layout.shapes[0].y0 == 1000.0 and log.layout.annotations[0].y == pytest.approx(3.0)
    lin = add_line(go.Figure(go.Scatter(x=[1, 2], y=[10, 1000])), "y", 500.0, annotation_text="half")
    assert lin.layout.shapes[0].y0 == 500.0 and lin.layout.annotations[0].y == 500.0
    with pytest.raises(ValueError, match="log axis"):
        add_line(log, "y", 0.0)


def test_add_ceiling():
    fig = viz.add_ceiling(go.Figure(), 4321.5, "copy")
    assert fig.layout.shapes[0].y0 == 4321.5
    assert "4322" in fig.layout.annotations[0].text
    with pytest.raises(ValueError, match="finite"):
        viz.add_ceiling(go.Figure(), float("nan"))


# --------------------------------------------------------------------------- ui


def test_defaults_and_control_coercion():
    controls = {"fmt": ["e4m3", "e5m2"], "flag": True, "n": ui.int_slider(1, 9, value=4),
                "t": ui.float_slider(0.5, 2.0), "d": ui.dropdown([3, 5], value=5)}
    assert ui.defaults(controls) == {"fmt": "e4m3", "flag": True, "n": 4, "t": 0.5, "d": 5}


@pytest.mark.parametrize("bad, exc, match", [
    (lambda: ui.dropdown([]), ValueError, "non-empty"),
    (lambda: ui.dropdown(["a"], value="b"), ValueError, "'b'"),
    (lambda: ui.int_slider(5, 1), ValueError, "min < max"),
    (lambda: ui.int_slider(1, 5, value=9), ValueError, "outside"),
    (lambda: ui.defaults({"n": 3}), TypeError, "control 'n'"),
    (lambda: ui.defaults([("n", 3)]), TypeError, "dict"),
])
def test_controls_reject_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


def test_interactive_headless_displays_default_result_without_widgets(monkeypatch):
    shown, calls = [], []
    monkeypatch.setattr(ui, "display", shown.append)
    monkeypatch.setattr(ui.Control, "widget", lambda self, name: pytest.fail("headless built a widget"))

    def fn(fmt, n):
        calls.append((fmt, n))
        return f"{fmt}:{n}"

    assert ui.interactive(fn, {"fmt": ["e5m2", "e4m3"], "n": ui.int_slider(2, 8, value=3)},
                          show_widgets=False) is None
    assert calls == [("e5m2", 3)] and shown == ["e5m2:3"]


def test_interactive_with_widgets_rerenders_on_change(monkeypatch):
    shown, calls = [], []
    monkeypatch.setattr(ui, "display", shown.append)

    def fn(fmt, n):
        calls.append((fmt, n))
        return (fmt, n)

    ui.interactive(fn, {"fmt": ["a", "b"], "n": ui.int_slider(1, 5, value=2)}, show_widgets=True)
    import ipywidgets as w

    box = shown[-1]
    assert isinstance(box, w.VBox)
    fmt_w, n_w = box.children[0].children
    assert isinstance(fmt_w, w.Dropdown) and isinstance(n_w, w.IntSlider)
    fmt_w.value = "b"
    n_w.value = 5
    assert calls == [("a", 2), ("b", 2), ("b", 5)]


def test_interactive_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        ui.interactive("not a function", {}, show_widgets=False)


def test_interactive_passes_fixed_arguments_in_both_modes(monkeypatch):
    shown, calls = [], []
    monkeypatch.setattr(ui, "display", shown.append)

    def fn(data, n):
        calls.append((data, n))
        return data * n

    ui.interactive(fn, {"n": ui.int_slider(1, 5, value=2)}, fixed={"data": 10}, show_widgets=False)
    assert shown == [20]
    ui.interactive(fn, {"n": ui.int_slider(1, 5, value=2)}, fixed={"data": 10}, show_widgets=True)
    n_w, = shown[-1].children[0].children
    n_w.value = 4
    assert calls == [(10, 2), (10, 2), (10, 4)]
    with pytest.raises(ValueError, match=r"\['n'\]"):
        ui.interactive(fn, {"n": [1]}, fixed={"n": 2}, show_widgets=False)


def test_explore_filters_rows_by_each_control_and_formats_the_title(monkeypatch):
    shown, seen = [], []
    monkeypatch.setattr(ui, "display", shown.append)
    frame = pd.DataFrame({"head": [0, 0, 1], "fmt": ["a", "b", "a"], "v": [1.0, 2.0, 3.0]})

    def view(rows, *, y, title):
        seen.append((list(rows["v"]), y, title))
        return "fig"

    ui.explore(frame, {"head": ui.int_slider(0, 1, value=1), "fmt": ["a", "b"]}, view, y="v",
               title="head {head}, {fmt}", show_widgets=False)
    assert seen == [([3.0], "v", "head 1, a")] and shown == ["fig"]
    ui.explore(frame, {"fmt": ["b", "a"]}, columns=["v"], show_widgets=False)  # no view: the rows
    assert shown[-1].equals(frame.loc[[1], ["v"]])
    with pytest.raises(ValueError, match=r"\['gpu'\] name no column"):
        ui.explore(frame, {"gpu": ["x"]}, view, show_widgets=False)
    with pytest.raises(TypeError, match="view must be callable"):
        ui.explore(frame, {"fmt": ["a"]}, "line", show_widgets=False)


# ----------------------------------------------------------------------------- benchmark and matrix figures

def _bench_rows():
    rows = []
    for label, kv, scale in (("triton bf16 dequant", "bf16", 2.0), ("triton fp8_e4m3 dequant", "fp8_e4m3", 1.0)):
        for b in (1, 16):
            for ctx in (4096, 16384):
                t = scale * b * ctx / 1000
                rows.append(dict(label=label, kv_dtype=kv, batch=b, context=ctx, time_us=t,
                                 bytes=int(t * 3e3), gbps=3.0, pct_copy_bw=75.0))
    return pd.DataFrame(rows)


def test_bench_lines_facets_and_ceiling():
    fig = viz.bench_lines(_bench_rows(), x="context", y="time_us", facet="batch", log_x=True, ceiling=100.0)
    assert len(fig.data) == 2 * 2  # a line per label in each of the two batch panels
    assert all(list(tr.x) == sorted(tr.x) for tr in fig.data)
    assert any(s.type == "line" and s.y0 == 100.0 for s in fig.layout.shapes)
    assert fig.layout.yaxis.dtick is None  # a linear axis keeps plotly's ticks
    with pytest.raises(ValueError, match="lacks column"):
        viz.bench_lines(_bench_rows(), x="context", y="nope")
    # a log value axis labels 1-2-5 in full ("2k"), not plotly's bare minor digits ("2" beside "1000")
    logy = viz.bench_lines(_bench_rows(), x="context", y="time_us", facet="batch", log_y=True)
    assert (logy.layout.yaxis.dtick, logy.layout.yaxis.tickformat) == ("D2", "~s")


def test_speedup_heatmap_cells_and_log_scale():
    sp = pd.DataFrame([dict(label="fp8", batch=b, context=c, time_us=1.0, bf16_us=v, speedup_vs_bf16=v)
                       for (b, c), v in {(1, 4096): 2.0, (16, 4096): 0.5}.items()])
    h = viz.speedup_heatmap(sp).data[0]
    assert list(h.x) == ["B = 1 · 4k tokens", "B = 16 · 4k tokens"] and list(h.y) == ["fp8"]
    assert [list(r) for r in h.text] == [["2.00×", "0.50×"]]
    assert [list(r) for r in h.z] == [[1.0, -1.0]] and h.zmid == 0 and h.zmax == 1.0


def test_bandwidth_roofline_draws_the_roof():
    fig = viz.bandwidth_roofline(_bench_rows(), 4000.0)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert (fig.layout.xaxis.dtick, fig.layout.xaxis.tickformat) == (1, "~s")  # decades: "10M", "1G"
    assert (fig.layout.yaxis.dtick, fig.layout.yaxis.tickformat) == ("D2", "~s")
    cpu = viz.bandwidth_roofline(_bench_rows().assign(gbps=3e-4), 50.0)  # below 1 GB/s no SI prefixes ("300µ")
    assert cpu.layout.yaxis.tickformat is None
    # plotly.js places a shape at its data value on a log axis, an annotation at the value's log10
    assert [s.y0 for s in fig.layout.shapes] == [4000.0]
    assert [a.y for a in fig.layout.annotations] == [pytest.approx(math.log10(4000.0))]
    with pytest.raises(ValueError, match="copy_gbps"):
        viz.bandwidth_roofline(_bench_rows(), float("nan"))


def _matrix_rows():
    nan = math.nan
    return pd.DataFrame([
        dict(backend="triton", mode="dequant", kv_dtype="bf16", granularity="tensor", status="passed",
             rel_err=1e-4, tol=1e-3, lse_err=0.0, lse_tol=0.1, reason="16-bit", error=""),
        dict(backend="triton", mode="dequant", kv_dtype="fp8_e4m3", granularity="head", status="failed",
             rel_err=0.5, tol=1e-3, lse_err=0.0, lse_tol=0.1, reason="fp8 kv", error=""),
        dict(backend="flashinfer", mode="dequant", kv_dtype="fp8_e4m3", granularity="head", status="error",
             rel_err=nan, tol=1e-3, lse_err=nan, lse_tol=nan, reason="fa2", error="RuntimeError: boom"),
        dict(backend="flashinfer", mode="dequant", kv_dtype="bf16", granularity="tensor", status="unsupported",
             rel_err=nan, tol=nan, lse_err=nan, lse_tol=nan, reason="not installed", error=""),
    ])


def test_backend_check_matrix_codes_text_and_hover():
    h = viz.backend_check_matrix(_matrix_rows()).data[0]
    assert list(h.y) == ["triton · dequant", "flashinfer · dequant"]
    assert list(h.x) == ["bf16", "fp8_e4m3 · head"]
    order = list(viz.MATRIX_STATUS_COLORS)
    assert [list(r) for r in h.z] == [[order.index("passed"), order.index("failed")],
                                      [order.index("unsupported"), order.index("error")]]
    assert h.text[1][0] == "n/a" and h.text[0][0] == "1.0e-04"
    assert "RuntimeError: boom" in h.customdata[1][1] and "not installed" in h.customdata[1][0]
    with pytest.raises(ValueError, match="status"):
        viz.backend_check_matrix(_matrix_rows().assign(status="maybe"))
    # a combination the matrix has no row for reads "—", not a blank cell
    rows = pd.concat([_matrix_rows(), _matrix_rows().iloc[[1]].assign(mode="fp8")], ignore_index=True)
    h = viz.backend_check_matrix(rows).data[0]
    assert list(h.y) == ["triton · dequant", "flashinfer · dequant", "triton · fp8"]
    assert h.text[2][0] == "—" and "no such combination" in h.customdata[2][0] and h.z[2][0] != h.z[2][0]
    assert h.text[2][1] == "5.0e-01"


def test_error_vs_tolerance_leaves_unsupported_and_the_reference_out():
    rows = pd.concat([_matrix_rows(), _matrix_rows().iloc[[0]].assign(backend="reference", rel_err=0.0)])
    fig = viz.error_vs_tolerance(rows)
    shares = sorted(v for tr in fig.data for v in tr.y if v == v)
    assert shares == [pytest.approx(0.1), pytest.approx(500.0)]
    assert sum(len(tr.x) for tr in fig.data) == 3
    assert not any("reference" in str(x) for tr in fig.data for x in tr.x)
    assert fig.layout.yaxis.type == "log"
    assert [s.y0 for s in fig.layout.shapes] == [1.0] and [a.y for a in fig.layout.annotations] == [0.0]


def _quant_rows():
    rows = []
    for fmt, base in (("e4m3", 0.02), ("e5m2", 0.04)):
        for i, gran in enumerate(("tensor", "head")):
            for j, method in enumerate(("amax", "1.0")):
                rows.append(dict(format=fmt, granularity=gran, scale_method=method, out_rel_err=base * (1 + i + 2 * j)))
    return pd.DataFrame(rows)


def test_quant_error_heatmap_panels_share_one_colour_scale():
    fig = viz.quant_error_heatmap(_quant_rows())
    heat = [tr for tr in fig.data if tr.type == "heatmap"]
    assert len(heat) == 2  # one panel per format
    assert len({(tr.zmin, tr.zmax) for tr in heat}) == 1  # comparable colours across panels
    e4m3 = heat[0]
    assert list(e4m3.y) == ["tensor", "head"] and list(e4m3.x) == ["amax", "1.0"]
    assert math.isclose(e4m3.z[1][1], math.log10(0.02 * 4))  # colour is log10 of the error
    with pytest.raises(ValueError, match="lacks column"):
        viz.quant_error_heatmap(_quant_rows(), value="nope")


def test_grouped_bars_one_trace_per_colour():
    fig = viz.grouped_bars(_quant_rows(), x="granularity", y="out_rel_err", color="format", facet_col="scale_method")
    assert {tr.name for tr in fig.data} == {"e4m3", "e5m2"}
    assert fig.layout.barmode == "group"
    with pytest.raises(ValueError, match="lacks column"):
        viz.grouped_bars(_quant_rows(), x="granularity", y="nope")


def test_token_axes_read_as_people_write_them():
    """A log context axis ticks at the measured sizes, written 4k / 16k (not 4.096k / 16.384k)."""
    import pandas as pd

    from fp8kv import viz

    df = pd.DataFrame({"context": [4096, 16384, 1000], "time_us": [1.0, 2.0, 0.5], "label": ["a"] * 3})
    fig = viz.bench_lines(df, x="context", y="time_us", log_x=True)
    assert list(fig.layout.xaxis.tickvals) == [1000, 4096, 16384]
    assert list(fig.layout.xaxis.ticktext) == ["1000", "4k", "16k"]
    batch = viz.bench_lines(df.rename(columns={"context": "batch"}), x="batch", y="time_us", log_x=True)
    assert list(batch.layout.xaxis.ticktext) == ["1000", "4096", "16384"]  # not a token count
    assert all(viz.style._contrast_on_white(c) >= viz.MIN_CONTRAST for c in viz.PALETTE)


def test_series_of_one_figure_are_far_apart_in_colour():
    """Up to eight series in one figure get colours no closer than MIN_COLOUR_DISTANCE (CIEDE2000; three
    magentas side by side read as one), independent of the order the labels come in."""
    import itertools

    from fp8kv import viz

    labels = ["reference fp16 dequant", "reference fp8_e4m3 dequant", "triton fp16 dequant",
              "triton fp8_e4m3 dequant", "triton fp8_e4m3 fp8", "flashinfer-tc bf16 dequant",
              "flashinfer-tc fp8_e4m3 dequant", "flashinfer-no-tc fp8_e4m3 dequant"]
    colours = viz.color_map(labels)
    for a, b in itertools.combinations(colours.values(), 2):
        assert viz.style.colour_distance(a, b) >= viz.MIN_COLOUR_DISTANCE, (a, b)
    assert viz.color_map(labels[::-1]) == colours


def test_figures_refuse_frames_they_cannot_draw_by_name():
    """Empty frames, NaN keys and duplicated cells: a ValueError that says what is wrong with the frame,
    not a plotly or pandas error from inside the figure."""
    import numpy as np

    m = pd.DataFrame([dict(backend="triton", mode="dequant", kv_dtype="fp8_e4m3", granularity="tensor",
                           status="passed", rel_err=0.01, tol=0.02, reason="r")] * 2)
    cases = [(lambda: viz.backend_check_matrix(m), "2 rows for triton · dequant × fp8_e4m3 · tensor"),
             (lambda: viz.backend_check_matrix(m.iloc[0:0]), "no rows"),
             (lambda: viz.backend_check_matrix(m.iloc[:1].assign(kv_dtype=[np.nan])), "NaN in column 'kv_dtype'"),
             (lambda: viz.quant_error_heatmap(pd.DataFrame(dict(out_rel_err=[], granularity=[], scale_method=[],
                                                                format=[]))), "no rows"),
             (lambda: viz.capability_matrix([]), "empty list"),
             (lambda: viz.tokens_label(float("nan")), "token count"),
             (lambda: viz.bench_metric(pd.DataFrame(dict(label=["a", "a"], context=[1024, np.nan], batch=[1, 1],
                                                        time_us=[1.0, 2.0])), "time_us", "context"), "token count")]
    for call, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            call()
    viz.backend_check_matrix(m.iloc[:1])  # one row per cell: drawn


@pytest.mark.parametrize("bad", [None, [1, 2], {"x": [1]}])
@pytest.mark.parametrize("figure", ["line", "grouped_bars", "bench_lines"])
def test_figures_name_a_frame_that_is_not_a_dataframe(figure, bad):
    """An AttributeError deep in the column check before."""
    with pytest.raises(TypeError, match="df must be a pandas DataFrame, got"):
        getattr(viz, figure)(bad, "x", "y")


def test_readable_table_links_a_url_by_a_short_text_that_is_never_broken():
    """A URL as link text broke anywhere, so a table wider than the page squeezed its column to one character."""
    url = "https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json"
    df = pd.DataFrame({"source": [url, "https://www.nvidia.com/en-us/data-center/h200/", "https://example.org"],
                       "note": ["a", "b & c", "d"]})
    html = viz.style.readable_table(df)._repr_html_()
    assert f'<a href="{url}" title="{url}">huggingface.co/…/config.json</a>' in html
    assert ">nvidia.com/…/h200</a>" in html and ">example.org</a>" in html
    assert "td a{white-space:nowrap}" in html and "b &amp; c" in html
    assert repr(viz.style.readable_table(df)) == df.to_string()  # the plain form keeps the whole URL
