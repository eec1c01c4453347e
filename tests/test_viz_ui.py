"""fp8kv.viz figure builders and fp8kv.ui widget wrappers (no kernel needed).

That the figures survive the HTML export is checked end to end in test_notebook_runner.py.
"""

import math

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
    hlines = sorted(s.y0 for s in fig.layout.shapes if s.type == "line" and s.y0 == s.y1)
    assert hlines == sorted([format("e4m3").unit_roundoff, format("e5m2").unit_roundoff])
    vlines = {s.x0 for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1}
    assert {format("e4m3").max, format("e5m2").max, format("e4m3").min_normal} <= vlines
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
    assert names == ["e5m2: bare", "e5m2: bare (non-finite)", "e5m2: fp8kv"]
    marker = fig.data[1]
    assert list(marker.text) == ["inf"] and list(marker.x) == [2.0]
    assert marker.y[0] > 2.0  # above every finite output


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
