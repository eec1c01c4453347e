"""Long chunks over FP8 pages in both modes: notebook 08's attention-alone rows and prefill steps on an H100, and
the attend kernel's tile loop built for sm90 (scripts/attend_sass.py)."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, span, times
from .sources import Sources

__all__ = ["chunk_modes", "chunk_tiles", "PAGE_08_H100", "ATTEND_SASS", "CHUNK_TUNE", "CHUNK_TILES_AB"]

PAGE_08_H100 = "reports/nvidia-h100-80gb-hbm3/08_multi_token.json"
# python scripts/attend_sass.py
ATTEND_SASS = "results/sass/sm90/20261207T100833Z-attend.csv"
# python -m fp8kv.bench --preset attend-tune --q-lens 512 --batches 16 --kv-dtypes bf16 fp8_e4m3 on an H100:
# B 16 x 16k, 512 new tokens, after both Triton kernels began rounding fp8 mode's probabilities on the GPU
CHUNK_TUNE = "results/bench/nvidia-h100-80gb-hbm3/20261207T125528Z.csv"
# the same chunks (B 4, 4k / 16k cached, 64 / 512 / 2048 new, 32/8/128) in three runs on one H100 minutes apart:
# the launch of that hour (64-key tiles two deep; FlashInfer beside), 128-key tiles, 128-key tiles three deep
CHUNK_TILES_AB = {"64x2": "results/bench/nvidia-h100-80gb-hbm3/20261207T125722Z.csv",
                  "128x2": "results/bench/nvidia-h100-80gb-hbm3/20261207T125820Z.csv",
                  "128x3": "results/bench/nvidia-h100-80gb-hbm3/20261207T125855Z.csv"}
_KEY = ["batch", "context", "q_len"]
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


def _times(src: Sources, rel: str, backend: str = "triton") -> pd.DataFrame:
    """Time (µs) per chunk point of one run's default-variant rows, a column per KV dtype and mode."""
    df = src.csv(rel, ["backend", "variant", "kv_dtype", "mode", *_KEY, "time_us", "status"])
    df = df[(df["status"] == "ok") & (df["backend"] == backend)]
    if backend == "triton":  # the run's own launch: its default rows, or the one variant it was asked for
        df = df[df["variant"].isna()] if df["variant"].isna().any() else df
    claim(df["variant"].nunique(dropna=False) == 1, "one launch per run", rel)
    t = df.assign(col=df["kv_dtype"] + " " + df["mode"]).pivot_table(index=_KEY, columns="col", values="time_us")
    claim(t.notna().all().all(), "every chunk point in every dtype and mode", rel)
    return t


def chunk_tiles(src: Sources) -> dict[str, str]:
    """Long chunks after the probabilities' rounding went to the GPU (:data:`CHUNK_TUNE`), and the chunk's tiles
    (:data:`CHUNK_TILES_AB`): each dtype's gain from 64-key tiles two deep to 128 three deep at 512 and 2048 new
    tokens, FP8 over BF16 then, and against FlashInfer's FP8 prefill (run beside the first)."""
    tune = _times(src, CHUNK_TUNE)
    (point,) = tune.index
    bf16, deq, fp8 = "bf16 dequant", "fp8_e4m3 dequant", "fp8_e4m3 fp8"
    page = pd.DataFrame(src.json(PAGE_08_H100)["results"]["attend_rows"])
    page = page[(page["status"] == "ok") & (page[_KEY].apply(tuple, axis=1) == point)]
    was = page.set_index(page["kv_dtype"] + " " + page["mode"])["time_us"]
    old, new = (_times(src, CHUNK_TILES_AB[k]) for k in ("64x2", "128x3"))
    long = old.index.get_level_values("q_len") >= 512
    old, new = old[long], new[long]
    claim(set(old.index) == set(new.index), "the same chunk points in both launches", CHUNK_TILES_AB["128x3"])
    peer = _times(src, CHUNK_TILES_AB["64x2"], "flashinfer")[long]
    gain = old / new.reindex(old.index)
    return {"tiles.point": f"B {point[0]}, {point[1] // 1024}k cached, {point[2]} new",
            "tiles.fp8_was": times(was[bf16] / was[fp8]), "tiles.fp8_now": times(tune[bf16].iloc[0] / tune[fp8].iloc[0]),
            "tiles.gain_bf16": span(gain[bf16]), "tiles.gain_dequant": span(gain[deq]), "tiles.gain_fp8": span(gain[fp8]),
            "tiles.x_dequant": span(new[bf16] / new[deq]), "tiles.x_fp8": span(new[bf16] / new[fp8]),
            "tiles.over_flashinfer": span(peer[deq].reindex(new.index) / new[deq]),
            "tiles.flashinfer_bf16_lead": span(new[bf16] / peer[bf16].reindex(new.index))}
