"""What measured decode latencies say context by context, without a fitted line: where an FP8 cache's times
beat a 16-bit cache's. :mod:`.breakeven` uses it where its latency lines do not hold (a split rule or a launch
floor makes the latency steppy) so that a pair still has an answer."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import checks

__all__ = ["LEVEL", "count_text", "kernel_names", "kernel_spans", "measured_speedups", "Measured", "measured_summary", "measured_comparison"]


def count_text(x: float) -> str:
    """A count of tokens as the answers write it: ``32,768``."""
    return f"{x:,.0f}"


def kernel_names(kernels) -> list[str]:
    """The kernels a latency line's rows ran, from ``fit_lines``' ``kernels`` ("gluon,triton"; "" or NaN: none)."""
    return [k for k in (kernels if isinstance(kernels, str) else "").split(",") if k]


def kernel_spans(kernels, tokens) -> list[tuple[str, float, float]] | None:
    """``(kernel, first, last context)`` per kernel of one line's rows, in order of context, where the kernels
    split the line into ranges of context that do not overlap (two kernels or more, every row naming one);
    None otherwise: one kernel, a row without a name, or kernels that interleave (no range is one kernel's)."""
    if isinstance(kernels, str) or not hasattr(kernels, "__len__"):
        checks.fail(f"kernels must be a sequence of kernel names (one per row), got {type(kernels).__name__}", TypeError)
    names = [k if isinstance(k, str) else "" for k in kernels]
    try:
        tokens = np.asarray(tokens, dtype=float)
    except (TypeError, ValueError):
        checks.fail(f"tokens must be a sequence of numbers (one per row), got {type(tokens).__name__}", TypeError)
    if tokens.shape != (len(names),) or not np.isfinite(tokens).all():
        checks.fail(f"tokens has shape {tokens.shape} and {int((~np.isfinite(tokens)).sum())} non-finite value(s); "
                    f"expected {len(names)} finite numbers, one per kernel name")
    if "" in names or len(set(names)) < 2:
        return None
    per_kernel = {k: tokens[np.array([n == k for n in names])] for k in set(names)}
    spans = sorted((float(t.min()), float(t.max()), k) for k, t in per_kernel.items())
    if any(hi >= nxt[0] for (_, hi, _), nxt in zip(spans, spans[1:], strict=False)):
        return None
    return [(k, lo, hi) for lo, hi, k in spans]


LEVEL = 0.01  # measured_comparison: a speedup within 1 % of 1 is "level" (a CUDA graph's timing noise)


def _points(points, name: str) -> dict[float, float]:
    """``(tokens, time_us)`` pairs -> the median time per tokens; positive finite numbers only."""
    try:
        pairs = [(float(t), float(u)) for t, u in points]
    except (TypeError, ValueError):
        checks.fail(f"{name} must be (tokens, time_us) pairs of numbers, got {checks.show_value(points)}", TypeError)
    for t, u in pairs:
        if not (math.isfinite(t) and math.isfinite(u) and t > 0 and u > 0):
            checks.fail(f"{name} holds ({t!r}, {u!r}); expected positive finite tokens and times")
    by = {}
    for t, u in pairs:
        by.setdefault(t, []).append(u)
    return {t: float(np.median(u)) for t, u in by.items()}


def measured_speedups(fp8_points, base_points) -> tuple[list[float], list[float]]:
    """The contexts both measured (ascending) and the 16-bit time over the FP8 time at each (medians per
    context). ``fp8_points`` / ``base_points``: ``(tokens, time_us)`` pairs."""
    f, b = _points(fp8_points, "fp8_points"), _points(base_points, "base_points")
    both = sorted(set(f) & set(b))
    return both, [b[t] / f[t] for t in both]


@dataclass(frozen=True)
class Measured:
    """What a pair's points say (:func:`measured_summary`)."""
    text: str  # the answer's words ("" when the points share no context)
    faster_from: float  # the context from which FP8 is faster at every longer one; inf: not at the longest
    best_speedup: float  # the largest 16-bit time over FP8 time (NaN when the points share no context)


def measured_summary(fp8_points, base_points) -> Measured:
    """Where the measured FP8 times beat the 16-bit ones, context by context, without a line: for a pair whose
    lines do not hold (a split rule or a launch floor makes the latency steppy), what the points themselves say.
    A speedup within :data:`LEVEL` of 1 counts as level, neither faster nor slower."""
    both, speedup = measured_speedups(fp8_points, base_points)
    if not both:
        return Measured("", math.nan, math.nan)
    kind = ["faster" if x > 1 + LEVEL else "slower" if x < 1 - LEVEL else "level" for x in speedup]
    # the faster suffix starts here (len(kind): FP8 is not faster at the longest context)
    tail = len(kind) - next((i for i, c in enumerate(reversed(kind)) if c != "faster"), len(kind))
    faster_from = both[tail] if tail < len(kind) else math.inf
    span = lambda i, j: (f"{speedup[i]:.2f}x" if j - i == 1 else  # noqa: E731
                         f"{min(speedup[i:j]):.2f}-{max(speedup[i:j]):.2f}x")
    if len(set(kind)) == 1:
        what = {"faster": "FP8 faster", "slower": "FP8 slower", "level": f"FP8 level (within {LEVEL:.0%})"}[kind[0]]
        where = (f"at {count_text(both[0])} tokens" if len(both) == 1 else
                 f"at every measured context ({count_text(both[0])}-{count_text(both[-1])} tokens")
        text = f"{what} {where}; {span(0, len(both))})" if len(both) > 1 else f"{what} {where} ({span(0, 1)})"
        return Measured(text, faster_from, max(speedup))
    at = {k: ", ".join(count_text(t) for t, c in zip(both, kind, strict=True) if c == k) for k in ("slower", "level")}
    rest = "; ".join(f"{k} at {at[k]}" for k in ("slower", "level") if at[k])
    if tail < len(kind):
        text = f"FP8 faster from {count_text(both[tail])} tokens on ({span(tail, len(kind))}); {rest}"
    else:
        faster = ", ".join(count_text(t) for t, c in zip(both, kind, strict=True) if c == "faster")
        text = (f"FP8 faster at {faster} tokens only" if faster else "FP8 never faster") + \
            f"; {rest} (the longest, {count_text(both[-1])}: {speedup[-1]:.2f}x)"
    return Measured(text, faster_from, max(speedup))


def measured_comparison(fp8_points, base_points) -> str:
    """:func:`measured_summary`'s words: "" when the points share no context."""
    return measured_summary(fp8_points, base_points).text
