"""The parameters a run passes to the notebooks: the runner's own (:data:`PARAMETER_NAMES`) and the overrides of
a notebook's own parameters, checked against what each notebook declares (:func:`check_parameters`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .. import checks

# Parameters every notebook declares in its cell tagged "parameters" (and the runner injects).
PARAMETER_NAMES = ("SMOKE", "DEVICE", "OUT_DIR", "SEED", "SHOW_WIDGETS")


def _papermill_value(value) -> bool:
    """Whether papermill writes ``value`` into a notebook as itself: None, bools, numbers, strings, and lists and
    dicts of them (a tuple or a set would arrive as the string of it; inf or NaN is no size, and the manifest
    would record it as a string)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, list):
        return all(map(_papermill_value, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) and _papermill_value(v) for k, v in value.items())
    return False


def check_parameters(books: Sequence[Path], parameters, *, smoke: bool = False) -> dict:
    """``parameters`` (name -> value) checked against every notebook of ``books``: each name declared in its
    cell tagged "parameters" and not one the runner sets itself (:data:`PARAMETER_NAMES`), each value one
    papermill passes as itself (lists, not tuples; finite numbers) and of a kind its default takes (:data:`_KINDS`),
    and a full-size run (``smoke`` False): a smoke run sets its own small sizes over the parameters, so an override
    would be recorded but not used. A page run with overrides shows them in its injected-parameters cell and its
    manifest entry."""
    import papermill as pm

    if parameters is None or parameters == {}:
        return {}
    if not isinstance(parameters, dict) or not all(isinstance(k, str) for k in parameters):
        checks.fail(f"parameters={checks.show_value(parameters)}; expected a dict of parameter names to values",
                    TypeError)
    if smoke:
        checks.fail(f"parameters {sorted(parameters)} given to a smoke run; a smoke run sets each notebook's own "
                    "small sizes over its parameters, so overrides go with a full-size run (--full)")
    own = sorted(set(parameters) & set(PARAMETER_NAMES))
    if own:
        checks.fail(f"parameters {own} are set by the runner itself (use its options: --smoke/--full, --device, "
                    f"--seed, --out); overrides may name a notebook's own parameters only")
    for name, value in parameters.items():
        if not _papermill_value(value):
            checks.fail(f"parameter {name}={checks.show_value(value)}; expected None, a bool, finite number or "
                        "string, or a list or dict of them (papermill passes a tuple or a set as its string: write "
                        "[16, 4] for (16, 4))", TypeError)
    for book in books:
        declared = pm.inspect_notebook(str(book))
        unknown = sorted(set(parameters) - set(declared))
        if unknown:
            checks.fail(f"parameters {unknown} are not declared by {book.stem}; its parameters are "
                        f"{sorted(set(declared) - set(PARAMETER_NAMES))}")
        for name, value in parameters.items():
            _check_kind(book.stem, name, value, declared[name]["default"])
    return dict(parameters)


# What an override of a parameter may be, by its default's type: a string default ("all") may be a list of names,
# a tuple one ((32, 8)) a list; None takes anything, and None is taken for any (the notebooks' "None: skip" or
# "None: detect" settings, e.g. 02's REAL_MODEL=None, 08's DRAFT_US=None with a DRAFT_MODEL).
_KINDS = {bool: (bool,), int: (int,), float: (int, float), str: (str, list), tuple: (list,), list: (list,),
          dict: (dict,)}


def _check_kind(notebook: str, name: str, value, default_source: str) -> None:
    """TypeError where ``value`` is not of a kind the declared default ``default_source`` (its text) takes: a
    string for a number would fail in the notebook, after the run had started."""
    import ast

    try:
        default = ast.literal_eval(default_source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return  # an expression: its type is not known before it runs
    kinds = _KINDS.get(type(default))
    if kinds is None or value is None:
        return
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):  # a bool is an int too
        return
    checks.fail(f"parameter {name}={checks.show_value(value)} ({type(value).__name__}); {notebook} declares "
                f"{name} = {checks.show_value(default)}, so expected {' or '.join(k.__name__ for k in kinds)}",
                TypeError)
