"""The README's earlier B = 1 measurements: which points FP8 led every peer at, counted by the rule
that a point whose peers errored or did not run is left out (and said so), never counted as a lead."""

from __future__ import annotations

import pandas as pd

from ..bench.report import layout_table
from ..viz import tokens_label
from .decode import claim
from .fmt import num
from .layouts import shape_of
from .sources import Sources

__all__ = ["earlier", "lead_points", "EARLIER_B1"]

EARLIER_B1 = "results/bench/nvidia-h200/20261203T125917Z.csv"


def lead_points(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(ahead, behind, no_peer)`` rows of a :func:`~fp8kv.bench.layout_table`: FP8 faster than the best
    peer that ran, not faster, and points where no peer ran (errored or unsupported: never a lead)."""
    no_peer = table[table["peer_us"].isna() | table["fp8_us"].isna()]
    rated = table.drop(no_peer.index)
    return rated[rated["fp8_x_peer"] > 1], rated[rated["fp8_x_peer"] <= 1], no_peer


def _point(r) -> str:
    return f"{shape_of(r)} × {tokens_label(int(r['context']))}"


def earlier(src: Sources) -> dict[str, str]:
    """The ``earlier.*`` values: the B = 1 points of the run FP8 led, trailed, and could not be compared at."""
    df = src.csv(EARLIER_B1, ["status", "check_passed", "batch", "time_us"])
    table = layout_table(df[df["batch"] == 1])
    ahead, behind, no_peer = lead_points(table)
    claim(len(behind) == 1 and _point(behind.iloc[0]) == "8/1/256 × 16k",
          "FP8 trailed the best peer at B = 1 only at 8/1/256 × 16k", EARLIER_B1)
    r = behind.iloc[0]
    return {"earlier.ahead": f"{len(ahead)} of the {len(ahead) + len(behind)}",
            "earlier.no_peer": f"{len(no_peer)} ({', '.join(_point(x) for _, x in no_peer.iterrows())})",
            "earlier.behind_us": f"{num(r['fp8_us'])} µs in that run against FlashInfer's {num(r['peer_us'])} µs"}
