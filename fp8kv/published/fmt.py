"""How the README prints a measured number. One rule for ranges: a range runs from the lowest to
the highest value of the rows it names, each end rounded to the digits shown (never widened or
narrowed by hand); ``a–b`` collapses to ``a`` when both ends round alike."""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["num", "span", "sci_span", "pct", "times"]


def _finite(values: Iterable, what: str) -> list[float]:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError(f"{what}: no values to print (an empty selection of rows)")
    bad = [v for v in vals if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what}: non-finite values {bad}; a published number must be measured")
    return vals


def num(value, digits: int = 1) -> str:
    """``value`` to ``digits`` decimals (``num(683.52, 0) == "684"``); thousands are not grouped."""
    (v,) = _finite([value], "num")
    return f"{v:.{digits}f}"


def span(values: Iterable, digits: int = 2, suffix: str = "") -> str:
    """``"lo–hi"`` of ``values`` (each end rounded to ``digits``), ``suffix`` after each end when given
    (``span([1.15, 1.46], 2, "×") == "1.15×–1.46×"``); one number when both ends print alike."""
    vals = _finite(values, "span")
    lo, hi = num(min(vals), digits), num(max(vals), digits)
    if suffix:
        return lo + suffix if lo == hi else f"{lo}{suffix}–{hi}{suffix}"
    return lo if lo == hi else f"{lo}–{hi}"


def sci_span(values: Iterable, exponent: int, digits: int = 1) -> str:
    """A range of small numbers in one power of ten: ``sci_span([1.62e-3, 1.71e-3], -3) == "1.6–1.7e-3"``."""
    vals = _finite(values, "sci_span")
    return span([v / 10.0 ** exponent for v in vals], digits) + f"e{exponent}"


def pct(value, digits: int = 0) -> str:
    """A share as a percentage number (``pct(0.894) == "89"``)."""
    return num(100.0 * float(value), digits)


def times(value, digits: int = 2) -> str:
    """A ratio as the README prints speed-ups (``times(1.4321) == "1.43"``)."""
    return num(value, digits)
