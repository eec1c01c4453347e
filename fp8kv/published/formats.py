"""The README's formats paragraph: INT8 per token and head, and FP8 with the same per-token scales, through the Gluon
decode kernel beside fp8kv's Triton kernels (``--preset formats``, INT8 / FP8 / BF16 rows, on an H100)."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, span, times
from .sources import Sources, ok_rows

__all__ = ["formats", "FORMATS_GLUON"]

# python -m fp8kv.bench --preset formats --batches 16 64 --contexts 16384 32768 --kv-dtypes int8_token_head fp8_e4m3
# bf16: each format's default kernel beside gluon=False, FP8 with one scale per tensor and per token and head
FORMATS_GLUON = "results/bench/nvidia-h100-80gb-hbm3/20261206T051303Z.csv"
_COLUMNS = ["kv_dtype", "granularity", "variant", "kernel", "batch", "context", "num_q_heads", "num_kv_heads",
            "head_dim", "time_us", "pct_copy_bw", "copy_gbps"]
# (kv_dtype, granularity, variant) -> column
_CELLS = {("bf16", "tensor", ""): "BF16", ("fp8_e4m3", "tensor", ""): "FP8",
          ("fp8_e4m3", "token_head", ""): "FP8 token-head", ("fp8_e4m3", "token_head", "gluon=False"):
          "FP8 token-head, Triton", ("int8_token_head", "tensor", ""): "INT8",
          ("int8_token_head", "tensor", "gluon=False"): "INT8, Triton"}


def _cells(src: Sources) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """µs, % of copy and the kernel that ran per (layout, batch, context) x cell of :data:`_CELLS`."""
    rows = ok_rows(src.csv(FORMATS_GLUON, _COLUMNS), FORMATS_GLUON)
    rows = rows.assign(variant=rows["variant"].fillna("").astype(str),
                       layout=rows["num_q_heads"].astype(str) + "/" + rows["num_kv_heads"].astype(str) + "/"
                       + rows["head_dim"].astype(str))
    rows = rows.assign(cell=[_CELLS.get(k) for k in zip(rows["kv_dtype"], rows["granularity"], rows["variant"],
                                                          strict=True)]).dropna(subset=["cell"])
    index = ["layout", "batch", "context"]
    us = rows.pivot_table(index=index, columns="cell", values="time_us", aggfunc="median")[list(_CELLS.values())]
    pct = rows.pivot_table(index=index, columns="cell", values="pct_copy_bw", aggfunc="median")
    kernel = rows.pivot_table(index=index, columns="cell", values="kernel", aggfunc="first")
    return us, pct, kernel


def formats(src: Sources) -> dict[str, str]:
    us, pct, kernel = _cells(src)
    # the points where the default ran the Gluon kernel for INT8, FP8 token-head and FP8 alike
    gluon = (kernel["INT8"] == "gluon-quantized") & (kernel["FP8 token-head"] == "gluon") & (kernel["FP8"] == "gluon")
    claim(list(us.index[~gluon]) == [("8/1/128", 16, 16384), ("8/1/128", 16, 32768)],
          "the defaults ran the Gluon kernel at all points but 8/1/128 at B 16 (16k: all three; 32k: FP8)", FORMATS_GLUON)
    head = ["Hq/Hkv/D", "B", "ctx", *us.columns, "INT8 ÷ FP8 token-head", "INT8 % of copy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in us.iterrows():
        lines.append("| " + " | ".join([*map(str, key), *[num(x) for x in r],
                                         times(r["INT8"] / r["FP8 token-head"]), num(pct.loc[key, "INT8"], 0)]) + " |")
    on = us[gluon]
    return {"formats.table": "\n".join(lines),
            "formats.points": str(int(gluon.sum())), "formats.all_points": str(len(us)),
            "formats.copy_tbs": span(src.csv(FORMATS_GLUON, _COLUMNS)["copy_gbps"] / 1e3, 1),
            "formats.int8_x_triton": span(on["INT8, Triton"] / on["INT8"]),
            "formats.tok_x_triton": span(on["FP8 token-head, Triton"] / on["FP8 token-head"]),
            "formats.int8_vs_tok": span(on["INT8"] / on["FP8 token-head"]),
            "formats.int8_vs_fp8": span(on["INT8"] / on["FP8"]),
            "formats.int8_pct": span(pct[gluon]["INT8"], 0), "formats.tok_pct": span(pct[gluon]["FP8 token-head"], 0),
            "formats.fp8_pct": span(pct[gluon]["FP8"], 0)}
