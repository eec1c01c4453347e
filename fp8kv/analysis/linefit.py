"""A latency line and whether it holds: ``time_us = intercept + slope x tokens`` by weighted least squares.

:func:`fit_line` fits one line and refuses it (:class:`LineFitError`) when it does not hold; the thresholds,
the weights and why they are what they are: :mod:`fp8kv.analysis.breakeven`, which fits one line per
backend, kernel, batch and KV dtype of a bench run and crosses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import checks

__all__ = ["MIN_CONTEXTS", "MIN_R2", "MAX_REL_RESIDUAL", "LineFit", "LineFitError", "fit_line", "least_squares",
           "t975"]

MIN_CONTEXTS = 3  # distinct contexts per line: two always fit exactly, a third is the first test of the line
MIN_R2 = 0.98
MAX_REL_RESIDUAL = 0.05  # |measured - fitted| / measured, at every point
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}


def t975(dof: int) -> float:
    """Student's t 97.5 % quantile for ``dof`` (an integer >= 1) degrees of freedom (a table, linear in 1/dof between
    its entries; 1.96 beyond 60)."""
    dof = checks.integer(dof, "dof", minimum=1)
    if dof in _T975:
        return _T975[dof]
    if dof > 60:
        return 1.96 + (2.000 - 1.96) * 60 / dof
    lo = max(d for d in _T975 if d < dof)
    hi = min(d for d in _T975 if d > dof)
    w = (1 / dof - 1 / hi) / (1 / lo - 1 / hi)
    return _T975[hi] + w * (_T975[lo] - _T975[hi])


class LineFitError(ValueError):
    """A latency line that does not hold (too few contexts, R² too low, a point too far off it)."""


@dataclass(frozen=True)
class LineFit:
    """``time_us = intercept + slope x tokens``, fitted by least squares.

    ``cov`` is the 2x2 covariance of (intercept, slope) (``sigma² (XᵀX)⁻¹``, sigma² the residual variance
    with ``n - 2`` degrees of freedom); ``residuals`` measured minus fitted, in the points' order;
    ``r2``; ``max_rel_residual`` the largest ``|residual| / measured``.
    """

    intercept: float
    slope: float
    cov: tuple[tuple[float, float], tuple[float, float]]
    residuals: tuple[float, ...]
    r2: float
    max_rel_residual: float
    n_points: int
    n_contexts: int

    @property
    def intercept_se(self) -> float:
        return math.sqrt(self.cov[0][0])

    @property
    def slope_se(self) -> float:
        return math.sqrt(self.cov[1][1])

    @property
    def dof(self) -> int:
        return self.n_points - 2


def least_squares(tokens, time_us, relative: bool = True) -> LineFit:
    """The weighted least-squares line of ``time_us`` against ``tokens``, refused or not (:func:`fit_line` refuses):
    weights ``1 / time_us²`` with ``relative`` (each point by its relative error), else 1. Needs three points or
    more over two contexts or more (a line with a residual degree of freedom); ValueError otherwise."""
    checks.flag(relative, "relative")
    x, y = _points(tokens, time_us)
    if len(x) < 3 or len(np.unique(x)) < 2:
        checks.fail(f"tokens={x.tolist()}: {len(x)} point(s) over {len(np.unique(x))} context(s); a line with an "
                    "error estimate needs three points or more over two contexts or more")
    n = len(x)
    # Fitted in units of the largest context and time (the weights 1 / y² overflow at y ~ 1e-155 otherwise),
    # then scaled back; R² and the relative residuals do not depend on the units.
    sx, sy = float(x.max()), float(y.max())
    xn, yn = x / sx, y / sy
    w = 1.0 / yn ** 2 if relative else np.ones_like(yn)
    w = w / w.sum()
    xm, ym = float((w * xn).sum()), float((w * yn).sum())
    sxx = float((w * (xn - xm) ** 2).sum())
    slope_n = float((w * (xn - xm) * (yn - ym)).sum() / sxx)
    intercept_n = ym - slope_n * xm
    res_n = yn - (intercept_n + slope_n * xn)
    ss_res = float((w * res_n ** 2).sum())
    ss_tot = float((w * (yn - ym) ** 2).sum())
    # A line through every point fits perfectly, flat or not; otherwise the usual 1 - SS_res / SS_tot (weighted).
    r2 = 1.0 if ss_res <= 1e-24 * float((w * yn ** 2).sum()) else (1 - ss_res / ss_tot if ss_tot else 0.0)
    sigma2 = ss_res / (n - 2)  # per unit of (normalized) weight
    var_slope_n = sigma2 / sxx
    k = sy / sx  # a slope's unit
    slope, intercept = slope_n * k, intercept_n * sy
    var_slope, var_int, cov_ab = var_slope_n * k * k, (sigma2 + xm * xm * var_slope_n) * sy * sy, -xm * var_slope_n * k * sy
    res = res_n * sy
    fit = LineFit(intercept, slope, ((var_int, cov_ab), (cov_ab, var_slope)), tuple(float(r) for r in res), r2,
                  float((np.abs(res_n) / yn).max()), n, len(np.unique(x)))
    numbers = [intercept, slope, var_int, cov_ab, var_slope, r2, fit.max_rel_residual, *fit.residuals]
    if not all(math.isfinite(v) for v in numbers):
        checks.fail(f"the line through tokens {x.min():.3g}..{x.max():.3g} and time_us {y.min():.3g}..{y.max():.3g} "
                    "has coefficients beyond float64's range; expected contexts and times of a decode (rescale them)")
    return fit


def _refusal(fit: LineFit, min_r2: float, max_rel_residual: float) -> str:
    """Why ``fit`` does not hold, or "" when it does."""
    why = []
    if not fit.r2 >= min_r2:
        why.append(f"R² {fit.r2:.4f} < {min_r2} (the latency is not a line in the context here, or does not "
                   "rise beyond its scatter)")
    if fit.max_rel_residual > max_rel_residual:
        why.append(f"a point lies {fit.max_rel_residual:.1%} off the line (> {max_rel_residual:.0%})")
    return "; ".join(why)


def _points(tokens, time_us) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` and ``time_us`` as float arrays of equal length, positive and finite (TypeError or ValueError
    naming either)."""
    x, y = (_reals(a, name) for a, name in ((tokens, "tokens"), (time_us, "time_us")))
    if len(x) != len(y):
        checks.fail(f"tokens has {len(x)} values but time_us has {len(y)}; expected one time per context")
    for name, a in (("tokens", x), ("time_us", y)):
        if not np.isfinite(a).all() or (a <= 0).any():
            bad = int(np.flatnonzero(~np.isfinite(a) | (a <= 0))[0])
            checks.fail(f"{name}[{bad}]={float(a[bad])!r}; expected positive finite numbers")
    return x, y


def _reals(values, name: str) -> np.ndarray:
    """``values`` as a 1-D float64 array: numbers only (not bools, not strings)."""
    try:
        a = np.asarray(values)
    except ValueError:  # ragged nesting
        a = np.asarray(values, dtype=object)
    if a.dtype.kind not in "iuf" or (isinstance(values, (list, tuple)) and any(isinstance(v, bool) for v in values)):
        checks.fail(f"{name} must be a 1-D sequence of real numbers, got {type(values).__name__} of dtype {a.dtype}",
                    TypeError)
    if a.ndim != 1:
        checks.fail(f"{name} has shape {a.shape}; expected a 1-D sequence of numbers")
    return a.astype(np.float64)


def fit_line(tokens, time_us, *, min_contexts: int = MIN_CONTEXTS, min_r2: float = MIN_R2,
             max_rel_residual: float = MAX_REL_RESIDUAL, relative: bool = True) -> LineFit:
    """Least-squares line of ``time_us`` (positive, µs) against ``tokens`` (tokens per sequence), each point
    weighted by ``1 / time_us²`` with ``relative`` (module docstring), else equally.

    Parameters
    ----------
    tokens, time_us : equal-length 1-D sequences of finite numbers; repeated contexts are fine (each
        point counts).
    min_contexts, min_r2, max_rel_residual : the thresholds of the module docstring.

    Raises
    ------
    ValueError on malformed input (lengths, NaN, a non-positive time); :class:`LineFitError` (a
    ValueError) when the line does not hold, the message saying which test failed and by how much.
    """
    min_contexts = checks.integer(min_contexts, "min_contexts", minimum=3)
    min_r2 = checks.real(min_r2, "min_r2", minimum=0.0, maximum=1.0)
    max_rel_residual = checks.real(max_rel_residual, "max_rel_residual", minimum=0.0, inclusive=False)
    checks.flag(relative, "relative")
    x, y = _points(tokens, time_us)
    n_contexts = len(np.unique(x))
    if n_contexts < min_contexts:
        raise LineFitError(f"{n_contexts} distinct context(s) {sorted(set(x.tolist()))}; a line needs at least "
                           f"{min_contexts} (two points always fit one)")
    fit = least_squares(x, y, relative)
    why = _refusal(fit, min_r2, max_rel_residual)
    if why:
        raise LineFitError(why)
    return fit
