"""The README's break-even paragraph: ``--preset breakeven`` on the H200, read by :mod:`fp8kv.analysis.breakeven`
(lines, crossings, what the points measured) and :func:`fp8kv.analysis.breakeven_text.speed_details` (notebook 09's
break-even section in sentences)."""

from __future__ import annotations

import math

from ..analysis.breakeven import MAX_REL_RESIDUAL, PER_KERNEL, REQUIRED, breakeven_context
from ..analysis.breakeven_text import speed_details
from .decode import claim
from .fmt import num, pct, times
from .sources import Sources

__all__ = ["breakeven", "BREAKEVEN_H200"]

# python -m fp8kv.bench --preset breakeven (B 1 / 16 / 64 x nine contexts 512-32k, 32/8/128, Triton and FlashInfer)
BREAKEVEN_H200 = "results/bench/nvidia-h200/20261206T095853Z.csv"


def _line(lines, r, kv_dtype: str, mode: str) -> str:
    """``intercept + slope`` of the pair's line of ``kv_dtype``, its largest residual, or why it was refused."""
    keys = ["backend", "variant", "batch"]
    sel = lines[(lines["kv_dtype"] == kv_dtype) & (lines["mode"] == mode)]
    for k in keys:
        sel = sel[sel[k] == r[k]]
    claim(len(sel) == 1, f"one {kv_dtype} {mode} line per backend and batch", BREAKEVEN_H200)
    f = sel.iloc[0]
    fit = f"{num(f['intercept_us'])} + {num(f['slope_us_per_token'] * 1e3, 2)} / 1k"
    held = "holds" if f["status"] == "ok" else "refused"
    return f"{fit} ({held}; worst point {pct(f['max_rel_residual'], 1)} % off)"


def breakeven(src: Sources) -> dict[str, str]:
    rows = src.csv(BREAKEVEN_H200, REQUIRED)
    lines, cross = breakeven_context(rows)
    gpu = str(rows["gpu"].iloc[0])
    head = ["B", "backend", "FP8 mode", "BF16 line, µs + µs per 1k tokens", "FP8 line", "FP8 kernels", "answer"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in cross.sort_values(["batch", "backend", "variant", "mode"]).iterrows():
        backend = r["backend"] + (f"-{r['variant']}" if r["variant"] else "")
        if r["status"] == "ok":
            answer = r["verdict"] + (f" {r['crossing_tokens']:,.0f} tokens" if r["verdict"] in ("beyond", "below")
                                     else "")
            if r["verdict"] in ("beyond", "below") and r["slope_gap_z"] < 2:
                answer += " (ill-determined)"
        else:
            answer = f"no line; measured: {r['measured']}" if r["measured"] else "no line"
            answer += f"; {PER_KERNEL}{r['by_kernel']}" if r["by_kernel"] else ""
        out.append("| " + " | ".join([str(r["batch"]), backend, r["mode"], _line(lines, r, "bf16", "dequant"),
                                      _line(lines, r, r["kv_dtype"], r["mode"]), r["kernels"].replace(",", ", "),
                                      answer]) + " |")
    ours = cross[(cross["backend"] == "triton") & (cross["mode"] == "dequant")]
    two = ours[ours["kernels"].str.contains(",")].sort_values("batch")
    faster = [float(x) for x in two["measured_faster_from"]]
    claim(len(two) >= 1 and all(math.isfinite(x) for x in faster),
          "fp8kv's FP8 rows change kernel at some batches and are faster from some context on there", BREAKEVEN_H200)
    # per such batch: where the Gluon kernel took over, and each kernel's own line (breakeven_context's by_kernel)
    fp8 = rows[(rows["backend"] == "triton") & (rows["mode"] == "dequant") & (rows["kv_dtype"] == "fp8_e4m3")]
    gluon_from = []
    for b in two["batch"]:
        at = fp8[fp8["batch"] == b].sort_values("context")
        first = at.loc[at["kernel"] == "gluon", "context"].min()
        claim((at.loc[at["context"] >= first, "kernel"] == "gluon").all(), "the Gluon kernel at every longer context",
              BREAKEVEN_H200)
        gluon_from.append(first)
    claim(all("gluon:every" in v.split(",") for v in two["kernel_verdicts"]),
          "the Gluon kernel's own line pays at every context it ran, at each batch where the decode changes kernel",
          BREAKEVEN_H200)
    peer = cross[cross["backend"] == "flashinfer"]
    claim((cross[cross["batch"] == 1]["status"] != "ok").all(), "no line holds at batch 1", BREAKEVEN_H200)
    claim((peer[peer["batch"] > 1]["status"] == "ok").all(), "FlashInfer's lines hold at batches 16 and 64",
          BREAKEVEN_H200)
    no_tc = peer[(peer["batch"] > 1) & (peer["variant"] == "no-tc")]
    tc = peer[(peer["batch"] > 1) & (peer["variant"] == "tc")].sort_values("batch")
    claim((no_tc["verdict"] == "never").all(), "FlashInfer's CUDA-core FP8 never pays at batches 16 and 64",
          BREAKEVEN_H200)
    claim((tc["slope_gap_z"] < 2).all(), "FlashInfer's tensor-core lines are nearly parallel", BREAKEVEN_H200)
    return {"breakeven.table": "\n".join(out), "breakeven.max_residual": f"{100 * MAX_REL_RESIDUAL:g} %", "breakeven.headline": speed_details(gpu, cross),
            "breakeven.kernel_batches": " and ".join(str(b) for b in two["batch"]),
            "breakeven.per_kernel": " ".join(f"At batch {r['batch']}: {r['by_kernel']}." for _, r in two.iterrows()),
            "breakeven.ours_from": ("at every measured context" if set(faster) == {float(rows["context"].min())}
                                    else "from " + " and ".join(f"{x:,.0f}" for x in faster) + " tokens on"),
            "breakeven.gluon_from": " and ".join(f"{x:,.0f}" for x in gluon_from),
            "breakeven.tc_at_hi": " and ".join(times(x) for x in tc["fp8_speedup_at_hi"])}
