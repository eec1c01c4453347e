"""What measured decode latencies say context by context, without a fitted line: where an FP8 cache's times
beat a 16-bit cache's. :mod:`.breakeven` uses it where its latency lines do not hold (a split rule or a launch
floor makes the latency steppy) so that a pair still has an answer."""

from __future__ import annotations

import math

import numpy as np

from .. import checks

__all__ = ["LEVEL", "count_text", "measured_speedups", "measured_comparison"]


def count_text(x: float) -> str:
    """A count of tokens as the answers write it: ``32,768``."""
    return f"{x:,.0f}"


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


def measured_comparison(fp8_points, base_points) -> str:
    """Where the measured FP8 times beat the 16-bit ones, context by context, without a line: for a pair whose
    lines do not hold (a split rule or a launch floor makes the latency steppy), what the points themselves say.
    A speedup within :data:`LEVEL` of 1 counts as level. "" when the points share no context."""
    both, speedup = measured_speedups(fp8_points, base_points)
    if not both:
        return ""
    kind = ["faster" if x > 1 + LEVEL else "slower" if x < 1 - LEVEL else "level" for x in speedup]
    span = lambda i, j: f"{min(speedup[i:j]):.2f}-{max(speedup[i:j]):.2f}x"  # noqa: E731
    if len(set(kind)) == 1:
        what = {"faster": "FP8 faster", "slower": "FP8 slower", "level": f"FP8 level (within {LEVEL:.0%})"}[kind[0]]
        return f"{what} at every measured context ({count_text(both[0])}-{count_text(both[-1])} tokens; {span(0, len(both))})"
    at = {k: ", ".join(count_text(t) for t, c in zip(both, kind, strict=True) if c == k) for k in ("slower", "level")}
    rest = "; ".join(f"{k} at {at[k]}" for k in ("slower", "level") if at[k])
    tail = len(kind) - next(i for i, c in enumerate(reversed(kind)) if c != "faster")  # the faster suffix starts here
    if tail < len(kind):
        return f"FP8 faster from {count_text(both[tail])} tokens on ({span(tail, len(kind))}); {rest}"
    faster = ", ".join(count_text(t) for t, c in zip(both, kind, strict=True) if c == "faster")
    return (f"FP8 faster at {faster} tokens only" if faster else "FP8 never faster") + \
        f"; {rest} (the longest, {count_text(both[-1])}: {speedup[-1]:.2f}x)"
