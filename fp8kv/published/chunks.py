"""Long chunks over FP8 pages in both modes: notebook 08's attention-alone rows and prefill steps on an H100, and
the attend kernel's tile loop built for sm90 (scripts/attend_sass.py)."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, span
from .sources import Sources

__all__ = ["chunk_modes", "PAGE_08_H100", "ATTEND_SASS"]

PAGE_08_H100 = "reports/nvidia-h100-80gb-hbm3/08_multi_token.json"
# python scripts/attend_sass.py
ATTEND_SASS = "results/sass/sm90/20261207T100833Z-attend.csv"
CHUNK_Q_LEN = 64  # the page's chunk sizes (q_len 64 and 512): at 32/8/128 both in the attend kernel's 128-row tiles


def chunk_modes(src: Sources) -> dict[str, str]:
    """FP8 over BF16 for attention of >= CHUNK_Q_LEN new tokens, per mode, its TFLOP/s, the prefill steps' time to
    first token, and the instructions a warp issues per key tile in each build."""
    page = src.json(PAGE_08_H100)
    claim(page["device"]["slug"] == "nvidia-h100-80gb-hbm3", "rendered on an H100", PAGE_08_H100)
    rows = pd.DataFrame(page["results"]["attend_rows"])
    rows = rows[(rows["status"] == "ok") & (rows["q_len"] >= CHUNK_Q_LEN)]
    key = ["batch", "context", "q_len"]
    bf16 = rows[rows["kv_dtype"] == "bf16"].set_index(key)
    fp8 = rows[rows["kv_dtype"] == "fp8_e4m3"]
    claim((bf16["mode"] == "dequant").all() and len(bf16) >= 4, "16-bit rows in dequant mode at the chunk sizes",
          PAGE_08_H100)
    x, tflops = {}, {}
    for mode in ("dequant", "fp8"):
        m = fp8[fp8["mode"] == mode].set_index(key)
        claim(set(m.index) == set(bf16.index), f"an FP8 {mode} row beside every 16-bit row", PAGE_08_H100)
        x[mode] = bf16["time_us"] / m["time_us"].reindex(bf16.index)
        tflops[mode] = m["tflops"]
    steps = pd.DataFrame(page["results"]["prefill_reading"].values())
    sass = src.csv(ATTEND_SASS, ["kv_dtype", "mode", "round_hw", "loop_instructions", "F2FP", "spilled_bytes"])
    at = sass.set_index(["kv_dtype", "mode", "round_hw"])["loop_instructions"]
    soft, hard, base = at[("fp8_e4m3", "fp8", False)], at[("fp8_e4m3", "fp8", True)], at[("bf16", "dequant", False)]
    claim(hard < soft, "the conversion instruction shortens the loop", ATTEND_SASS)
    return {"chunk.q_lens": ", ".join(map(str, sorted(set(bf16.index.get_level_values("q_len"))))),
            "chunk.contexts": ", ".join(f"{c // 1024}k" for c in sorted(set(bf16.index.get_level_values("context")))),
            "chunk.x_dequant": span(x["dequant"]), "chunk.x_fp8": span(x["fp8"]),
            "chunk.tflops_bf16": span(bf16["tflops"], 0), "chunk.tflops_dequant": span(tflops["dequant"], 0),
            "chunk.tflops_fp8": span(tflops["fp8"], 0), "chunk.ttft_x": span(steps["speedup"]),
            "chunk.loop_soft": str(int(soft)), "chunk.loop_hw": str(int(hard)), "chunk.loop_bf16": str(int(base)),
            "chunk.loop_dequant": str(int(at[("fp8_e4m3", "dequant", False)])),
            "chunk.rounding_share": num(100 * (soft - hard) / soft, 0)}
