"""fp8kv.ui: controls and explore() check their arguments by name, before any widget or figure.

Headless: ``display`` is replaced by a list, and widgets are built without being displayed.
"""

from __future__ import annotations

import pandas as pd
import pytest

from fp8kv import ui


@pytest.fixture
def shown(monkeypatch):
    out = []
    monkeypatch.setattr(ui, "display", out.append)
    return out


@pytest.fixture
def frame():
    return pd.DataFrame({"head": [0, 0, 1], "channel": [0, 1, 0], "amax": [1.0, 2.0, 3.0]})


def _view(rows, *, title=None):
    return ("fig", list(rows["amax"]), title)


# ------------------------------------------------------------------------------ sliders

@pytest.mark.parametrize("call, exc, match", [
    # an int slider takes ints: int(0.7) was 0, and (0.5, 0.9) passed min < max and became 0..0
    (lambda: ui.int_slider(0, 3, value=0.7), TypeError, r"value=0\.7 \(float\); expected an int"),
    (lambda: ui.int_slider(0.5, 0.9), TypeError, r"min=0\.5 \(float\); expected an int"),
    (lambda: ui.int_slider(0, 2.5), TypeError, r"max=2\.5 \(float\); expected an int"),
    (lambda: ui.int_slider(0, 3, step=1.5), TypeError, r"step=1\.5 \(float\); expected an int"),
    (lambda: ui.int_slider(0, 3, value=True), TypeError, r"value=True \(bool\)"),
    # a step that never moves
    (lambda: ui.int_slider(0, 3, step=0), ValueError, r"step=0; expected an int >= 1"),
    (lambda: ui.int_slider(0, 3, step=-1), ValueError, r"step=-1; expected an int >= 1"),
    (lambda: ui.float_slider(0, 1, step=0), ValueError, r"step=0\.0; expected a finite number > 0"),
    (lambda: ui.float_slider(0, 1, step=-1), ValueError, r"step=-1\.0; expected a finite number > 0"),
    (lambda: ui.float_slider(0, float("nan")), ValueError, r"max=nan; expected a finite number"),
    (lambda: ui.float_slider(0, 1, value="0.5"), TypeError, r"value='0\.5' \(str\)"),
    # the value within [min, max], the bounds in order
    (lambda: ui.int_slider(0, 3, value=4), ValueError, r"value=4 is outside \[min=0, max=3\]"),
    (lambda: ui.float_slider(0.5, 2.0, value=0.1), ValueError, r"value=0\.1 is outside \[min=0\.5, max=2\.0\]"),
    (lambda: ui.int_slider(3, 3), ValueError, r"min < max, got min=3, max=3"),
    (lambda: ui.int_slider(0, 3, description=3), TypeError, r"description=3 \(int\); expected a str"),
])
def test_sliders_refuse_bad_arguments_by_name(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_sliders_keep_good_arguments_and_their_types():
    c = ui.int_slider(0, 7, step=2, value=4, description="head")
    assert c.default == 4 and c.options == {"min": 0, "max": 7, "step": 2, "description": "head"}
    assert all(type(v) is int for v in (c.default, c.options["min"], c.options["max"], c.options["step"]))
    f = ui.float_slider(0, 1, value=1)  # ints are fine where floats are meant
    assert f.default == 1.0 and type(f.default) is float and f.options["step"] == 0.1
    w = f.widget("t")  # built, never displayed
    assert (w.min, w.max, w.value) == (0.0, 1.0, 1.0)
    assert ui.int_slider(0, 3, value=3).widget("n").value == 3


def test_checkbox_and_dropdown_refuse_what_would_be_misread():
    with pytest.raises(TypeError, match=r"checkbox value='no' \(str\); expected True or False"):
        ui.checkbox("no")  # bool("no") is True
    with pytest.raises(TypeError, match="checkbox value=1"):
        ui.checkbox(1)
    with pytest.raises(TypeError, match=r"options='abc' is a string; expected a list of options, e.g. \['abc'\]"):
        ui.dropdown("abc")  # list("abc") offered "a", "b", "c"
    with pytest.raises(TypeError, match=r"options=5 \(int\); expected a list"):
        ui.dropdown(5)
    assert ui.checkbox(True).default is True and ui.dropdown(("x", "y")).default == "x"


# ------------------------------------------------------------------------------ explore

def test_explore_requires_a_dataframe(shown):
    with pytest.raises(TypeError, match="frame must be a pandas DataFrame, got list"):
        ui.explore([1, 2], {"head": ui.int_slider(0, 1)}, show_widgets=False)
    assert shown == []


def test_explore_columns_must_be_the_frames(shown, frame):
    with pytest.raises(ValueError, match=r"columns has \['nope'\]; expected values among \('head', 'channel', "
                                         r"'amax'\)"):
        ui.explore(frame, {"head": ui.int_slider(0, 1)}, columns=["nope"], show_widgets=False)
    with pytest.raises(ValueError, match="columns is empty"):
        ui.explore(frame, {"head": ui.int_slider(0, 1)}, columns=[], show_widgets=False)
    with pytest.raises(ValueError, match="pass columns or view, not both"):  # the view would ignore them
        ui.explore(frame, {"head": ui.int_slider(0, 1)}, _view, columns=["amax"], show_widgets=False)
    assert shown == []
    ui.explore(frame, {"head": ui.int_slider(0, 1, value=1)}, columns=frame.columns.drop("head"),
               show_widgets=False)  # an Index, as notebook 02 passes
    assert shown[-1].equals(frame.loc[[2], ["channel", "amax"]])
    ui.explore(frame, {"head": ui.int_slider(0, 1)}, columns="amax", show_widgets=False)  # one name
    assert shown[-1].equals(frame.loc[[0, 1], ["amax"]])


@pytest.mark.parametrize("title, match", [
    ("{nope}", r"title='\{nope\}' has field\(s\) \['nope'\] that no control fills; available fields: "
               r"\['channel', 'head'\]"),
    ("head {}", r"field\(s\) \[''\] that no control fills"),
    ("head {0}", r"field\(s\) \['0'\]"),
    ("head {head", r"not a valid template .*available fields: \['channel', 'head'\]"),
    ("head {head:d} {channel:.2f}x{channel:q}", r"does not format with the controls' values"),
])
def test_explore_title_fields_must_be_control_names(shown, frame, title, match):
    with pytest.raises(ValueError, match=match):
        ui.explore(frame, {"head": ui.int_slider(0, 1), "channel": [0, 1]}, _view, title=title, show_widgets=False)
    assert shown == []  # refused before anything ran


def test_explore_title_checks_and_formats(shown, frame):
    with pytest.raises(TypeError, match=r"title=3 \(int\)"):
        ui.explore(frame, {"head": ui.int_slider(0, 1)}, _view, title=3, show_widgets=False)
    with pytest.raises(ValueError, match="title='head {head}' is passed to view, and there is none"):
        ui.explore(frame, {"head": ui.int_slider(0, 1)}, title="head {head}", show_widgets=False)
    ui.explore(frame, {"head": ui.int_slider(0, 1, value=1)}, _view, title="head {head:02d} {{literal}}",
               show_widgets=False)
    assert shown == [("fig", [3.0], "head 01 {literal}")]


def test_explore_with_widgets_builds_them_without_display(shown, frame):
    import ipywidgets as w

    ui.explore(frame, {"head": ui.int_slider(0, 1)}, _view, title="head {head}", show_widgets=True)
    box = shown[-1]
    assert isinstance(box, w.VBox)
    slider, = box.children[0].children
    assert isinstance(slider, w.IntSlider) and (slider.min, slider.max, slider.step) == (0, 1, 1)
