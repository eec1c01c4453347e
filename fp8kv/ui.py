"""ipywidgets controls over the same functions the notebooks call, with a headless fallback.

Notebook cells such as::

    ui.interactive(viz.per_layer, {"model": MODELS, "metric": METRICS}, fixed={"layers": layers},
                   show_widgets=SHOW_WIDGETS)
    ui.explore(amax, {"head": ui.int_slider(0, 7)}, viz.line, x="channel", y="amax",
               title="amax of head {head}", show_widgets=SHOW_WIDGETS)

show controls and a figure that re-renders on every change when ``show_widgets`` is True (a
person in JupyterLab), and just displays the figure for the default values when it is False.
Headless runs (the notebook runner, papermill) always pass ``SHOW_WIDGETS=False``: displaying
widgets under papermill intermittently stalls the execution, and no callback could ever run
there anyway. In that mode ipywidgets is not even imported.
"""

from __future__ import annotations

import functools
import os
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from IPython.display import display

from . import checks

# Set (to "1") in the environment of kernels that no person watches: the notebook runner's, the tests'.
HEADLESS_ENV = "FP8KV_HEADLESS"

__all__ = ["HEADLESS_ENV", "headless", "Control", "dropdown", "int_slider", "float_slider", "checkbox", "defaults", "build_widgets",
           "interactive", "explore"]


@dataclass(frozen=True)
class Control:
    """A control's description: widget kind, default value, widget keyword arguments.

    Kept apart from the widget itself so headless runs need only ``default``.
    """

    kind: str  # "dropdown" | "int_slider" | "float_slider" | "checkbox"
    default: Any
    options: dict = field(default_factory=dict)

    def widget(self, name: str):
        """Build the ipywidgets widget, labelled ``name``."""
        import ipywidgets as w

        cls = {"dropdown": w.Dropdown, "int_slider": w.IntSlider, "float_slider": w.FloatSlider,
               "checkbox": w.Checkbox}[self.kind]
        kwargs = dict(self.options)
        kwargs.setdefault("description", name)
        return cls(value=self.default, continuous_update=False, **kwargs) if "slider" in self.kind \
            else cls(value=self.default, **kwargs)


def _description(description) -> str | None:
    if description is not None and not isinstance(description, str):
        raise TypeError(f"description={description!r} ({type(description).__name__}); expected a str or None")
    return description


def dropdown(options: Sequence, value=None, description: str | None = None) -> Control:
    """A choice among ``options`` (a list; default: the first one)."""
    if isinstance(options, str):  # list("abc") would offer "a", "b", "c"
        raise TypeError(f"dropdown options={options!r} is a string; expected a list of options, e.g. [{options!r}]")
    try:
        options = list(options)
    except TypeError:
        raise TypeError(f"dropdown options={options!r} ({type(options).__name__}); expected a list of options") \
            from None
    _description(description)
    if not options:
        raise ValueError("dropdown options must be a non-empty sequence, got an empty one")
    value = options[0] if value is None else value
    if value not in options:
        raise ValueError(f"dropdown value={value!r} is not one of the options {options}")
    opts = {"options": options}
    if description:
        opts["description"] = description
    return Control("dropdown", value, opts)


def _slider(kind, number, lo, hi, step, value, description):
    """``number`` (:func:`checks.integer` or :func:`checks.real`) checks min, max and value by name,
    with no cast: int(0.7) would silently be 0, and int_slider(0.5, 0.9) a slider from 0 to 0.
    ``step`` comes checked (> 0: a step of 0 or less never moves)."""
    lo, hi = number(lo, "min"), number(hi, "max")
    if not lo < hi:
        raise ValueError(f"slider needs min < max, got min={lo!r}, max={hi!r}")
    value = lo if value is None else number(value, "value")
    if not lo <= value <= hi:
        raise ValueError(f"slider value={value!r} is outside [min={lo!r}, max={hi!r}]")
    opts = {"min": lo, "max": hi, "step": step}
    if _description(description):
        opts["description"] = description
    return Control(kind, value, opts)


def int_slider(min: int, max: int, step: int = 1, value: int | None = None,  # noqa: A002 - widget names
               description: str | None = None) -> Control:
    """An integer slider over ``[min, max]`` (default: ``min``); ints only (not floats), ``step >= 1``."""
    return _slider("int_slider", checks.integer, min, max, checks.positive_int(step, "step"), value, description)


def float_slider(min: float, max: float, step: float = 0.1, value: float | None = None,  # noqa: A002
                 description: str | None = None) -> Control:
    """A float slider over ``[min, max]`` (default: ``min``); finite numbers, ``step > 0``."""
    return _slider("float_slider", checks.real, min, max, checks.positive_float(step, "step"), value, description)


def checkbox(value: bool = False, description: str | None = None) -> Control:
    """A boolean toggle (``value`` True or False: bool("no") would be True)."""
    if not isinstance(value, bool):
        raise TypeError(f"checkbox value={value!r} ({type(value).__name__}); expected True or False")
    return Control("checkbox", value, {"description": description} if _description(description) else {})


def _as_control(name: str, spec) -> Control:
    """Accept a Control, a list/tuple of options (a dropdown) or a bool (a checkbox)."""
    if isinstance(spec, Control):
        return spec
    if isinstance(spec, bool):
        return checkbox(spec)
    if isinstance(spec, (list, tuple)):
        return dropdown(spec)
    raise TypeError(f"control {name!r}: expected a fp8kv.ui Control (dropdown/int_slider/float_slider/"
                    f"checkbox), a list of options or a bool; got {type(spec).__name__} {spec!r}")


def defaults(controls: Mapping[str, Any]) -> dict:
    """The default value of each control, by name."""
    if not isinstance(controls, Mapping):
        raise TypeError(f"controls must be a dict name -> control, got {type(controls).__name__}")
    return {name: _as_control(name, spec).default for name, spec in controls.items()}


def build_widgets(fn: Callable[..., Any], controls: Mapping[str, Any]):
    """Widgets for ``controls`` plus an Output that shows ``fn(**values)``, re-rendered on change.

    Returns an ``ipywidgets.VBox`` (controls row, then the output). ``fn`` is called once now with
    the defaults. The box's ``.children[0].children`` are the control widgets, in ``controls`` order.
    """
    import ipywidgets as w

    widgets = {name: _as_control(name, spec).widget(name) for name, spec in controls.items()}
    out = w.Output()

    def render(_change=None):
        values = {name: wid.value for name, wid in widgets.items()}
        out.clear_output(wait=True)
        with out:  # an exception inside is shown in the output area, not lost
            display(fn(**values))

    for wid in widgets.values():
        wid.observe(render, names="value")
    render()
    return w.VBox([w.HBox(list(widgets.values())), out])


def headless() -> bool:
    """True in a kernel that no person watches (``FP8KV_HEADLESS=1``, set by the notebook runner).

    There a widget's callback can never run, and displaying widgets under nbclient can stall the
    cell until its timeout; :func:`interactive` then shows the static figure whatever ``show_widgets`` says.
    """
    return os.environ.get(HEADLESS_ENV, "") == "1"


def interactive(fn: Callable[..., Any], controls: Mapping[str, Any], show_widgets: bool = True, *,
                fixed: Mapping[str, Any] | None = None) -> None:
    """Display ``fn(**fixed, **values)`` with controls (``show_widgets=True``) or once, for the defaults.

    Parameters
    ----------
    fn : callable taking the control names (and ``fixed``'s) as keyword arguments and returning
        something displayable (a plotly Figure, a DataFrame...).
    controls : dict name -> Control (``dropdown``, ``int_slider``, ``float_slider``, ``checkbox``),
        a list of options (a dropdown, default the first) or a bool (a checkbox).
    show_widgets : False in headless runs: no widget is created, the static result is displayed.
        Ignored (treated as False) when :func:`headless` is true.
    fixed : keyword arguments passed to every call unchanged (the data a figure is drawn from).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    values = defaults(controls)  # validates every control up front, in both modes
    fixed = dict(fixed or {})
    if clash := sorted(set(fixed) & set(controls)):
        raise ValueError(f"fixed and controls both name {clash}; a keyword is one or the other")
    call = functools.partial(fn, **fixed) if fixed else fn
    if not show_widgets or headless():
        display(call(**values))
        return
    display(build_widgets(call, controls))


def explore(frame, controls: Mapping[str, Any], view: Callable[..., Any] | None = None, *,
            title: str | None = None, columns: Sequence[str] | None = None, show_widgets: bool = True,
            **view_kwargs) -> None:
    """Display the rows of ``frame`` whose columns equal the controls' values, through ``view``.

    ``frame`` is a pandas DataFrame; each control is named after one of its columns.
    ``view(rows, **view_kwargs)`` draws the rows (a figure function of :mod:`fp8kv.viz`), with
    ``title`` formatted with the controls' values (``"head {head}"``: only control names are fields);
    without a view the rows are shown as a table, only ``columns`` (columns of ``frame``) if given.
    ``title`` needs a view and ``columns`` needs none: either would otherwise be ignored.
    """
    import pandas as pd

    # Everything is checked here, before the first render: an error inside a widget's callback
    # would only show in its output area, and a headless run would fail deep in pandas.
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    if view is not None and not callable(view):
        raise TypeError(f"view must be callable or None, got {type(view).__name__}")
    values = defaults(controls)
    missing = [name for name in controls if name not in frame.columns]
    if missing:
        raise ValueError(f"controls {missing} name no column of the frame; its columns: {list(frame.columns)}")
    if columns is not None:
        if view is not None:
            raise ValueError(f"columns={columns!r} selects the table shown without a view; view={view!r} draws "
                             "the rows itself: pass columns or view, not both")
        columns = checks.many_of(columns, "columns", list(frame.columns))
    if title is not None:
        if view is None:
            raise ValueError(f"title={title!r} is passed to view, and there is none: pass a view, or no title")
        _check_title(title, values)
    interactive(functools.partial(_rows_view, frame, view, title, columns, view_kwargs), controls, show_widgets)


def _check_title(title, values: dict) -> None:
    """``title`` formats with ``values`` (the controls' defaults): its fields are control names."""
    if not isinstance(title, str):
        raise TypeError(f"title={title!r} ({type(title).__name__}); expected a str such as 'head {{head}}'")
    available = f"available fields: {sorted(values)} (the controls' names; write a literal brace as {{{{ or }}}})"
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(title) if f is not None]
    except ValueError as e:  # an unmatched brace
        raise ValueError(f"title={title!r} is not a valid template ({e}); {available}") from None
    unknown = [f for f in fields if re.split(r"[.\[]", f)[0] not in values]  # "{head}", "{head.real}", "{x[0]}"
    if unknown:
        raise ValueError(f"title={title!r} has field(s) {unknown} that no control fills; {available}")
    try:  # e.g. "{head:.2f}" with a string value
        title.format(**values)
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
        raise ValueError(f"title={title!r} does not format with the controls' values {values}: {e}") from None


def _rows_view(_frame, _view, _title, _columns, _kwargs, **values):
    """What :func:`explore` shows for one set of control values."""
    rows = _frame
    for name, value in values.items():
        rows = rows[rows[name] == value]
    if _view is None:
        return rows if _columns is None else rows[list(_columns)]
    return _view(rows, **_kwargs, **({} if _title is None else {"title": _title.format(**values)}))
