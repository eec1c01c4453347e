"""The README's formats paragraph: INT8 and INT4 per token and head, and FP8 with the same per-token scales, through
the Gluon decode kernel beside fp8kv's Triton kernels (``--preset formats``, INT8 / INT4 / FP8 rows, on an H100)."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, span, times
from .probes import shape_col
from .sources import Sources, ok_rows

__all__ = ["formats", "formats_h200", "FORMATS_GLUON", "FORMATS_H200", "INT4_GOAL_X_FP8", "INT4_GOAL_X_BF16"]

# python -m fp8kv.bench --preset formats --batches 16 64 --contexts 16384 32768 --kv-dtypes int8_token_head
# int4_token_head fp8_e4m3: each format's default kernel beside gluon=False, FP8 with one scale per tensor and per token
# and head
FORMATS_GLUON = "results/bench/nvidia-h100-80gb-hbm3/20261206T074628Z.csv"
# The same command before the scales were copied with their tile (INT8 / FP8 read them in the tile that used them), and
# INT4 through the Gluon kernel just before that change (--kv-dtypes int4_token_head)
FORMATS_BEFORE = "results/bench/nvidia-h100-80gb-hbm3/20261206T051303Z.csv"
INT4_BEFORE = "results/bench/nvidia-h100-80gb-hbm3/20261206T074324Z.csv"
# The same command on the H200 with bf16 among the --kv-dtypes: INT4 and INT8 against FP8 and BF16 in one run
FORMATS_H200 = "results/bench/nvidia-h200/20261206T100317Z.csv"
INT4_GOAL_X_FP8 = 1.5  # a 4-bit decode's goal: this many times FP8's speed at 64k tokens or more (B x ctx)
INT4_GOAL_X_BF16 = 2.5  # the issue's other goal for a 4-bit decode: this many times BF16's speed
_COLUMNS = ["kv_dtype", "granularity", "variant", "kernel", "batch", "context", "num_q_heads", "num_kv_heads",
            "head_dim", "time_us", "pct_copy_bw", "copy_gbps", "kv_bytes"]
_BEFORE_AFTER = ("32/8/128", 64, 32768)  # the point the paragraph follows across the three files
# (kv_dtype, granularity, variant) -> column
_CELLS = {("bf16", "tensor", ""): "BF16", ("fp8_e4m3", "tensor", ""): "FP8", ("fp8_e4m3", "token_head", ""): "FP8 token-head",
          ("fp8_e4m3", "token_head", "gluon=False"): "FP8 token-head, Triton", ("int8_token_head", "tensor", ""): "INT8",
          ("int8_token_head", "tensor", "gluon=False"): "INT8, Triton", ("int4_token_head", "tensor", ""): "INT4",
          ("int4_token_head", "tensor", "gluon=False"): "INT4, Triton"}
_GLUON = {"FP8": "gluon", "FP8 token-head": "gluon", "INT8": "gluon-quantized", "INT4": "gluon-quantized"}


def _cells(src: Sources, rel: str = FORMATS_GLUON) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """µs, % of copy and the kernel that ran per (layout, batch, context) x cell of :data:`_CELLS`, in file ``rel``."""
    rows = ok_rows(src.csv(rel, _COLUMNS), rel)
    rows = rows.assign(variant=rows["variant"].fillna("").astype(str), layout=shape_col(rows))
    rows = rows.assign(cell=[_CELLS.get(k) for k in zip(rows["kv_dtype"], rows["granularity"], rows["variant"],
                                                          strict=True)]).dropna(subset=["cell"])
    index = ["layout", "batch", "context"]
    us = rows.pivot_table(index=index, columns="cell", values="time_us", aggfunc="median")
    us = us[[cell for cell in _CELLS.values() if cell in us.columns]]  # an earlier file times fewer
    pct = rows.pivot_table(index=index, columns="cell", values="pct_copy_bw", aggfunc="median")
    kernel = rows.pivot_table(index=index, columns="cell", values="kernel", aggfunc="first")
    return us, pct, kernel


def _gluon_points(kernel: pd.DataFrame, rel: str) -> pd.Series:
    """The points where the default ran the Gluon kernel for every format: all but 8/1/128 at B 16 (short splits)."""
    gluon = pd.concat([kernel[cell] == name for cell, name in _GLUON.items()], axis=1).all(axis=1)
    claim(list(kernel.index[~gluon]) == [("8/1/128", 16, 16384), ("8/1/128", 16, 32768)],
          "the defaults ran the Gluon kernel at all points but 8/1/128 at B 16", rel)
    return gluon


def _table(us: pd.DataFrame, pct: pd.DataFrame, ratios: dict) -> str:
    """A row per point: its µs per cell, then ``ratios`` (header -> the row and its % of copy -> the text)."""
    head = ["Hq/Hkv/D", "B", "ctx", *us.columns, *ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in us.iterrows():
        lines.append("| " + " | ".join([*map(str, key), *[num(x) for x in r],
                                         *[cell(r, pct.loc[key]) for cell in ratios.values()]]) + " |")
    return "\n".join(lines)


_FP8_X_INT4 = {"FP8 ÷ INT4": lambda r, p: times(r["FP8"] / r["INT4"])}
_INT4_PCT = {"INT4 % of copy": lambda r, p: num(p["INT4"], 0)}
_INT8_X_TOK = {"INT8 ÷ FP8 token-head": lambda r, p: times(r["INT8"] / r["FP8 token-head"])}


def formats(src: Sources) -> dict[str, str]:
    us, pct, kernel = _cells(src)
    gluon = _gluon_points(kernel, FORMATS_GLUON)
    table = _table(us, pct, {**_FP8_X_INT4, **_INT4_PCT, **_INT8_X_TOK})
    on = us[gluon]
    rows = src.csv(FORMATS_GLUON, _COLUMNS)
    per_token_head = rows["kv_bytes"] / (rows["batch"] * rows["context"] * rows["num_kv_heads"])
    before, int4_before = _cells(src, FORMATS_BEFORE)[0], _cells(src, INT4_BEFORE)[0]
    return {"formats.table": table,
            "formats.int4_bytes": span(per_token_head[rows["kv_dtype"] == "int4_token_head"], 0),
            "formats.fp8_bytes": span(per_token_head[(rows["kv_dtype"] == "fp8_e4m3") & (rows["granularity"] == "tensor")], 0),
            "formats.tok_before": num(before.loc[_BEFORE_AFTER, "FP8 token-head"], 0),
            "formats.tok_after": num(us.loc[_BEFORE_AFTER, "FP8 token-head"], 0),
            "formats.int8_before": num(before.loc[_BEFORE_AFTER, "INT8"], 0),
            "formats.int8_after": num(us.loc[_BEFORE_AFTER, "INT8"], 0),
            "formats.int4_before": num(int4_before.loc[_BEFORE_AFTER, "INT4"], 0),
            # FP8 with one tensor scale, which the change did not touch, between the two runs: their drift
            "formats.fp8_drift": span([us.loc[_BEFORE_AFTER, "FP8"] / before.loc[_BEFORE_AFTER, "FP8"]]),
            "formats.fp8_before": num(before.loc[_BEFORE_AFTER, "FP8"], 0),
            "formats.fp8_after": num(us.loc[_BEFORE_AFTER, "FP8"], 0),
            "formats.int4_after": num(us.loc[_BEFORE_AFTER, "INT4"], 0),
            "formats.points": str(int(gluon.sum())), "formats.all_points": str(len(us)),
            "formats.copy_tbs": span(src.csv(FORMATS_GLUON, _COLUMNS)["copy_gbps"] / 1e3, 1),
            "formats.int4_x_fp8": span(on["FP8"] / on["INT4"]),
            "formats.int4_x_triton": span(on["INT4, Triton"] / on["INT4"]),
            "formats.int8_x_triton": span(on["INT8, Triton"] / on["INT8"]),
            "formats.tok_x_triton": span(on["FP8 token-head, Triton"] / on["FP8 token-head"]),
            "formats.int8_vs_tok": span(on["INT8"] / on["FP8 token-head"]),
            "formats.int8_vs_fp8": span(on["INT8"] / on["FP8"]),
            "formats.int4_pct": span(pct[gluon]["INT4"], 0), "formats.int8_pct": span(pct[gluon]["INT8"], 0),
            "formats.tok_pct": span(pct[gluon]["FP8 token-head"], 0), "formats.fp8_pct": span(pct[gluon]["FP8"], 0)}


def formats_h200(src: Sources) -> dict[str, str]:
    """The H200 run (:data:`FORMATS_H200`): each format's µs beside BF16's in the same run, and the ratios #38's
    goals name (INT4 against FP8 and BF16, INT8 against FP8 with the same per-token scales), at the points where
    every default ran the Gluon kernel."""
    us, pct, kernel = _cells(src, FORMATS_H200)
    gluon = _gluon_points(kernel, FORMATS_H200)
    table = _table(us, pct, {**_FP8_X_INT4, "BF16 ÷ INT4": lambda r, p: times(r["BF16"] / r["INT4"]), **_INT4_PCT,
                             **_INT8_X_TOK})
    on, on_pct = us[gluon], pct[gluon]
    h100 = _cells(src, FORMATS_GLUON)[0]
    claim((on["FP8"] / on["INT4"]).max() < INT4_GOAL_X_FP8, "INT4 falls short of its goal against FP8", FORMATS_H200)
    claim((on["BF16"] / on["INT4"]).max() < INT4_GOAL_X_BF16, "INT4 falls short of its goal against BF16", FORMATS_H200)
    claim((on["INT8"] / on["FP8 token-head"]).max() <= 1.05, "INT8 within 5 % of FP8 token-head", FORMATS_H200)
    gain = {c: h100.loc[_BEFORE_AFTER, c] / us.loc[_BEFORE_AFTER, c] for c in ("FP8", "INT4")}
    claim(gain["INT4"] < gain["FP8"], "INT4 gained less than FP8 from the H100 to the H200", FORMATS_H200)
    copy = {rel: src.csv(rel, _COLUMNS)["copy_gbps"].median() for rel in (FORMATS_GLUON, FORMATS_H200)}
    return {"formats_h200.table": table,
            # one point on both GPUs (separate runs): how much of the H200's bandwidth each format turned into time
            "formats_h200.int4_h100": num(h100.loc[_BEFORE_AFTER, "INT4"], 0),
            "formats_h200.int4_h200": num(us.loc[_BEFORE_AFTER, "INT4"], 0),
            "formats_h200.fp8_h100": num(h100.loc[_BEFORE_AFTER, "FP8"], 0),
            "formats_h200.fp8_h200": num(us.loc[_BEFORE_AFTER, "FP8"], 0),
            "formats_h200.copy_x": times(copy[FORMATS_H200] / copy[FORMATS_GLUON]),
            "formats_h200.copy_tbs": span(src.csv(FORMATS_H200, _COLUMNS)["copy_gbps"] / 1e3, 1),
            "formats_h200.points": str(int(gluon.sum())), "formats_h200.all_points": str(len(us)),
            "formats_h200.int4_x_fp8": span(on["FP8"] / on["INT4"]),
            "formats_h200.int4_x_bf16": span(on["BF16"] / on["INT4"]),
            "formats_h200.fp8_x_bf16": span(on["BF16"] / on["FP8"]),
            "formats_h200.int4_pct": span(on_pct["INT4"], 0), "formats_h200.fp8_pct": span(on_pct["FP8"], 0),
            "formats_h200.bf16_pct": span(on_pct["BF16"], 0),
            "formats_h200.int8_vs_tok": span(on["INT8"] / on["FP8 token-head"]),
            "formats_h200.int8_vs_fp8": span(on["INT8"] / on["FP8"]), "formats_h200.goal": times(INT4_GOAL_X_FP8, 1),
            "formats_h200.goal_bf16": times(INT4_GOAL_X_BF16, 1)}
