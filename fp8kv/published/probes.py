"""Shared readings of the probe files the README quotes (``scripts/*_probe.py``): a point timed under
two rules, the same launch before and after, and how a point prints.

A probe times each point under its rules in turn, some of them twice (``before, after, before``): the
ratio of a point is the mean of one rule's times over the mean of the other's, so a repeated timing
narrows it rather than picking one.
"""

from __future__ import annotations

import pandas as pd

from .fmt import num

__all__ = ["shape_col", "point_label", "rule_ratios", "ctx_label", "arrow"]


def shape_col(df: pd.DataFrame) -> pd.Series:
    """``"32/8/128"`` per row of a benchmark table (its ``num_q_heads`` / ``num_kv_heads`` / ``head_dim``)."""
    return df["num_q_heads"].astype(int).astype(str) + "/" + df["num_kv_heads"].astype(int).astype(str) + "/" \
        + df["head_dim"].astype(int).astype(str)


def ctx_label(context: int) -> str:
    """A context as the README prints it: ``4096 -> "4k"``, ``16384 -> "16k"``, ``1000 -> "1000"``."""
    c = int(context)
    return f"{c // 1024}k" if c % 1024 == 0 else str(c)


def point_label(shape: str, batch: int, context: int) -> str:
    """``"32/8/128 at 1 × 4k"``."""
    return f"{shape} at {int(batch)} × {ctx_label(context)}"


def rule_ratios(df: pd.DataFrame, keys: list[str], rule: str, new, old, rel: str,
                value: str = "time_us", extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per point (``keys``): the mean ``value`` under ``old`` and ``new`` of column ``rule``,
    their ratio ``x`` (new over old) and the first row's ``extra`` columns under each (``splits_old``...).

    Raises ``ValueError`` naming ``rel`` for a point missing either rule or a rule column not there.
    """
    missing = [c for c in [*keys, rule, value, *extra] if c not in df.columns]
    if missing:
        raise ValueError(f"{rel}: lacks columns {missing}; it has {list(df.columns)}")
    out = []
    for point, g in df.groupby(keys, sort=False, dropna=False):
        a, b = g[g[rule] == old], g[g[rule] == new]
        if a.empty or b.empty:
            raise ValueError(f"{rel}: point {point} lacks a row under {rule}={old!r} or {rule}={new!r}")
        row = dict(zip(keys, point if isinstance(point, tuple) else (point,), strict=True))
        row.update(old_us=a[value].mean(), new_us=b[value].mean())
        row["x"] = row["new_us"] / row["old_us"]
        for c in extra:
            row[f"{c}_old"], row[f"{c}_new"] = a[c].iloc[0], b[c].iloc[0]
        out.append(row)
    return pd.DataFrame(out)


def arrow(old: float, new: float, digits: int = 1) -> str:
    """``"21.3 → 18.0"``."""
    return f"{num(old, digits)} → {num(new, digits)}"
