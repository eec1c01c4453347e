"""The README's head-layout section: the ``layouts`` preset at B = 64 × 16k and at B = 1 × 4k beside
FlashInfer and vLLM's kernel, the page-layout probe, the CUDA-core kernel and notebook 04's render.

Filter rule of every claim here: only rows that ran and passed their check count
(:func:`~fp8kv.published.sources.ok_rows`); a layout where a peer errored or did not run has no
"FP8 × peer" and counts in no "ahead of every peer" claim.
"""

from __future__ import annotations

import math

import pandas as pd

from ..bench.report import layout_markdown, layout_table
from .decode import claim
from .fmt import num, pct, sci_span, span, times
from .sources import Sources, ok_rows

__all__ = ["layouts", "shape_of", "table_of", "LAYOUTS_64", "LAYOUTS_1", "LAYOUTS_64_BEFORE"]

LAYOUTS_64 = "results/bench/nvidia-h200/20261204T184933Z.csv"
LAYOUTS_1 = "results/bench/nvidia-h200/20261204T150103Z.csv"
LAYOUTS_64_BEFORE = "results/bench/nvidia-h200/20261204T164246Z.csv"
LAYOUTS_1_BEFORE = "results/bench/nvidia-h200/20261204T094705Z.csv"
PAGE_LAYOUT = "results/bench/nvidia-h200/20261204T201542Z-page-layout.json"
CUDA_CORE = "results/bench/nvidia-h200/20261203T131259Z.csv"
NOTEBOOK_04 = "reports/nvidia-h200/04_decode_latency.json"


def shape_of(row) -> str:
    """``"32/8/128"``: a row's query heads / KV heads / head dim."""
    return f"{int(row['num_q_heads'])}/{int(row['num_kv_heads'])}/{int(row['head_dim'])}"


def table_of(src: Sources, rel: str) -> pd.DataFrame:
    """:func:`~fp8kv.bench.layout_table` of a layouts run, indexed by shape (``"32/8/128"``)."""
    t = layout_table(src.csv(rel, ["status", "check_passed", "time_us"]))
    return t.assign(shape=[shape_of(r) for _, r in t.iterrows()]).set_index("shape")


def _peer_errors(src: Sources, rel: str) -> dict[str, pd.Series]:
    ok = ok_rows(src.csv(rel), rel)
    fp8 = ok[ok["kv_dtype"].str.startswith("fp8")]
    return {b: fp8[fp8["backend"] == b]["rel_err"] for b in ("triton", "flashinfer", "vllm")}


def layouts(src: Sources) -> dict[str, str]:
    """Both layout tables, their notes and bullets."""
    v: dict[str, str] = {}
    raw = src.csv(LAYOUTS_64, ["status", "backend", "vllm", "copy_gbps"])
    t64, t1 = table_of(src, LAYOUTS_64), table_of(src, LAYOUTS_1)
    v["layouts.table_64"] = layout_markdown(t64.reset_index(drop=True))
    dagger = {s for s in ("32/32/80", "32/32/96")}
    lines = layout_markdown(t1.reset_index(drop=True)).split("\n")
    v["layouts.table_1"] = "\n".join(
        line.replace(" (triton) |", " (triton) † |", 1) if any(line.startswith(f"| {s} |") for s in dagger) else line
        for line in lines)
    first = raw.iloc[0]
    v["layouts.env"] = (f"H200, driver {src.json(LAYOUTS_64.replace('.csv', '.json'))['device']['driver_version']}, "
                        f"torch {first['torch']}, Triton {first['triton']}, FlashInfer {first['flashinfer']}, "
                        f"vLLM's kernel at commit {str(first['vllm']).removeprefix('shim-')[:8]}")
    v["layouts.copy_tbs"] = num(raw["copy_gbps"].iloc[0] / 1e3, 2)
    ok = ok_rows(raw, LAYOUTS_64)
    bad = raw.drop(ok.index)
    claim((bad["backend"] == "flashinfer").all() and (bad["status"] == "unsupported").all(),
          "the rows that did not run are FlashInfer decodes it does not build", LAYOUTS_64)
    v["layouts.ran_64"], v["layouts.not_run_64"] = str(len(ok)), str(len(bad))
    err = _peer_errors(src, LAYOUTS_64)
    v["layouts.err_own"] = sci_span(err["triton"], -3)
    v["layouts.err_fi"] = sci_span(err["flashinfer"], -3)
    v["layouts.err_vllm"] = sci_span(err["vllm"], -3)
    v["layouts.err_x_peer_64"] = span(t64["fp8_err_x_peer"])
    v["layouts.err_x_peer_1"] = span(t1["fp8_err_x_peer"])
    raw1 = src.csv(LAYOUTS_1, ["status", "copy_gbps"])
    v["layouts.copy_tbs_1"] = num(raw1["copy_gbps"].iloc[0] / 1e3, 2)
    v["layouts.ran_1"] = str(len(ok_rows(raw1, LAYOUTS_1)))
    for part in (_bullets_64(src, t64), _bullets_1(src, t1), _page_layout(src), _cuda_core(src), _notebook(src, t64)):
        v.update(part)
    return v


def _bullets_64(src: Sources, t: pd.DataFrame) -> dict[str, str]:
    v = {}
    before = table_of(src, LAYOUTS_64_BEFORE)
    for s in ("8/1/256", "28/4/128", "71/1/64"):
        key = s.replace("/", "_")
        v[f"layouts.before.{key}"] = f"{num(before.loc[s, 'fp8_us'])} → {num(t.loc[s, 'fp8_us'])}"
    v["layouts.before.8_1_256_x_fi"] = f"{times(before.loc['8/1/256', 'fp8_x_peer'])} → {times(t.loc['8/1/256', 'fp8_x_peer'])}"
    v["layouts.before.71_1_64_bf16"] = f"{num(before.loc['71/1/64', 'bf16_us'])} → {num(t.loc['71/1/64', 'bf16_us'])}"
    v["layouts.before.71_1_64_x_peer"] = times(before.loc["71/1/64", "fp8_x_peer"])
    raw = ok_rows(src.csv(LAYOUTS_64_BEFORE), LAYOUTS_64_BEFORE)
    r = raw[(raw["num_q_heads"] == 8) & (raw["num_kv_heads"] == 1) & (raw["kv_dtype"] != "bf16") & (raw["backend"] == "triton")]
    v["layouts.before.8_1_256_splits"] = str(int(r["num_splits"].iloc[0]))
    row = t.loc["71/1/64"]
    v["layouts.71.peer_us"], v["layouts.71.x_peer"] = num(row["peer_us"]), times(row["fp8_x_peer"])
    claim(row["bf16_us"] < row["fp8_us"], "fp8kv's BF16 stays faster than its FP8 at 71/1/64", LAYOUTS_64)
    groups = ["28/4/128", "32/8/112", "32/8/128", "40/8/128"]
    v["layouts.x_peer.8_1_256"] = times(t.loc["8/1/256", "fp8_x_peer"])
    v["layouts.x_peer.groups"] = span(t.loc[groups, "fp8_x_peer"])
    v["layouts.x_peer.mha_80_96"] = span(t.loc[["32/32/80", "32/32/96"], "fp8_x_peer"])
    v["layouts.x_peer.14_2_64"] = times(t.loc["14/2/64", "fp8_x_peer"])
    mha = t.loc["32/32/128"]
    claim("no-tc fp8" in mha["peer"], "MHA 32/32/128's best peer is FlashInfer's CUDA-core FP8 decode", LAYOUTS_64)
    v["layouts.mha128.peer_us"] = num(mha["peer_us"])
    v["layouts.mha128.peer_pct"] = num(mha["pct_of_limit"] * mha["fp8_us"] / mha["peer_us"], 0)  # same bytes, its time
    v["layouts.mha128.x_peer"] = times(mha["fp8_x_peer"])
    rate = t["fp8_rate_of_bf16"]
    four = ["32/8/128", "40/8/128", "28/4/128"]
    v["layouts.rate.gqa"] = span(rate[four] * 100, 0)
    v["layouts.rate.mha128"] = pct(rate["32/32/128"])
    v["layouts.rate.limit"] = span(t.loc[four + ["32/32/128"], "pct_of_limit"], 0)
    v["layouts.rate.32_8_112"] = pct(rate["32/8/112"])
    v["layouts.rate.8_1_256"] = pct(rate["8/1/256"])
    v["layouts.rate.small"] = span(rate[["14/2/64", "32/32/80", "32/32/96"]] * 100, 0)
    v["layouts.rate.71"] = pct(rate["71/1/64"])
    v["layouts.71.pct_limit"] = num(t.loc["71/1/64", "pct_of_limit"], 0)
    ok = ok_rows(src.csv(LAYOUTS_64), LAYOUTS_64)
    vl = ok[ok["backend"] == "vllm"].assign(shape=lambda d: [shape_of(r) for _, r in d.iterrows()])
    by = vl.pivot_table(index="shape", columns="kv_dtype", values="time_us")
    claim((by["fp8_e4m3"] > by["bf16"]).all(), "vLLM's FP8 is slower than its own BF16 on every layout", LAYOUTS_64)
    v["layouts.vllm.32_8_128"] = f"{num(by.loc['32/8/128', 'fp8_e4m3'], 0)} against {num(by.loc['32/8/128', 'bf16'], 0)}"
    bf = t["bf16_gbps"] / 1e3
    v["layouts.bf16.wide"] = span(bf[[s for s in t.index if s.split("/")[2] in ("128", "256")]], 1)
    v["layouts.bf16.narrow"] = span(bf[[s for s in t.index if s.split("/")[2] in ("64", "80", "96", "112")
                                        and s != "71/1/64"]], 1)
    v["layouts.bf16.71"] = num(bf["71/1/64"], 1)
    return v


def _bullets_1(src: Sources, t: pd.DataFrame) -> dict[str, str]:
    v = {"layouts.b1.x_peer": span(t["fp8_x_peer"])}
    claim((t["fp8_x_peer"] > 1).all(), "FP8 ahead of the best peer on every layout at B = 1 × 4k", LAYOUTS_1)
    ok = ok_rows(src.csv(LAYOUTS_1), LAYOUTS_1)
    v["layouts.b1.vllm_us"] = span(ok[ok["backend"] == "vllm"]["time_us"], 0)
    v["layouts.b1.32_8_128"] = num(t.loc["32/8/128", "fp8_us"])
    slower = t[t["fp8_x_bf16"] < 1]
    claim(set(slower.index) == {"32/32/80", "32/32/96", "8/1/256", "71/1/64"},
          "FP8 slower than its own BF16 exactly at 32/32/80, 32/32/96, 8/1/256 and 71/1/64", LAYOUTS_1)
    v["layouts.b1.x_bf16.8_1_256"] = times(t.loc["8/1/256", "fp8_x_bf16"])
    v["layouts.b1.x_bf16.71_1_64"] = times(t.loc["71/1/64", "fp8_x_bf16"])
    before = table_of(src, LAYOUTS_1_BEFORE)
    for s in ("14/2/64", "71/1/64", "8/1/256", "32/32/128", "32/32/80", "32/32/96"):
        v[f"layouts.b1.before.{s.replace('/', '_')}"] = f"{num(before.loc[s, 'fp8_us'])} → {num(t.loc[s, 'fp8_us'])}"
    v["layouts.b1.before.14_2_64_bf16"] = f"{num(before.loc['14/2/64', 'bf16_us'])} → {num(t.loc['14/2/64', 'bf16_us'])}"
    rest = [s for s in t.index if s not in ("14/2/64", "71/1/64", "8/1/256", "32/32/128", "32/32/80", "32/32/96")]
    v["layouts.b1.before.rest"] = num((t.loc[rest, "fp8_us"] - before.loc[rest, "fp8_us"]).abs().max())
    return v


def _page_layout(src: Sources) -> dict[str, str]:
    rows = src.rows(PAGE_LAYOUT, columns=["shape", "kv_dtype", "layout", "time_us"])
    lines = ["| Hq/Hkv/D | FP8 NHD (µs) | FP8 HND (µs) | HND speed-up | BF16 NHD (µs) | BF16 HND (µs) |",
             "|---|---|---|---|---|---|"]
    ups = []
    for shape in rows["shape"].unique():
        r = rows[rows["shape"] == shape]
        fp8 = r[r["kv_dtype"].str.startswith("fp8")]
        bf16 = r[r["kv_dtype"] == "bf16"]
        nhd, hnd = fp8[fp8["layout"] == "NHD"]["time_us"], fp8[fp8["layout"] == "HND"]["time_us"]
        up = nhd.mean() / hnd.iloc[0]  # NHD was timed before and after HND: their mean
        ups.append(up)
        lines.append(f"| {shape} | {', '.join(num(x) for x in nhd)} | {num(hnd.iloc[0])} | {times(up)} | "
                     f"{num(bf16[bf16['layout'] == 'NHD']['time_us'].iloc[0])} | "
                     f"{num(bf16[bf16['layout'] == 'HND']['time_us'].iloc[0])} |")
    return {"layouts.page_layout": "\n".join(lines)}


def _cuda_core(src: Sources) -> dict[str, str]:
    ok = ok_rows(src.csv(CUDA_CORE, ["label", "time_us"]), CUDA_CORE)
    ok = ok[(ok["batch"] == 64) & (ok["context"] == 16384) & ok["kv_dtype"].str.startswith("fp8")]
    ok = ok.assign(shape=[shape_of(r) for _, r in ok.iterrows()])
    t = ok.pivot_table(index="shape", columns="label", values="time_us", aggfunc="median")
    cc = [c for c in t.columns if c.startswith("triton-no-tc")]
    best_cc, tc = t[cc].min(axis=1), t["triton fp8_e4m3 dequant"]
    ahead = sorted(t.index[best_cc < tc])
    claim(ahead == ["16/16/256"], "the CUDA-core kernel is ahead of the tensor-core kernel only at 16/16/256", CUDA_CORE)

    def pair(s):
        return f"{num(t.loc[s, 'triton-no-tc fp8_e4m3 dequant'], 0)} µs, {num(best_cc[s], 0)} with 64-token tiles"

    v = {"cc.16_16_256": f"{pair('16/16/256')}, against {num(tc['16/16/256'], 0)} µs",
         "cc.16_16_256_fi": num(t.loc["16/16/256", "flashinfer-no-tc fp8_e4m3 dequant"], 0),
         "cc.32_32_128": f"{pair('32/32/128')}, against {num(tc['32/32/128'], 0)} µs",
         "cc.80_96": (f"{num(t.loc['32/32/80', 'triton-no-tc fp8_e4m3 dequant'], 0)} / "
                      f"{num(t.loc['32/32/96', 'triton-no-tc fp8_e4m3 dequant'], 0)} against "
                      f"{num(tc['32/32/80'], 0)} / {num(tc['32/32/96'], 0)} µs"),
         "cc.16_8_128": f"{pair('16/8/128')}, against {num(tc['16/8/128'], 0)} µs"}
    return v


def _notebook(src: Sources, t: pd.DataFrame) -> dict[str, str]:
    doc = src.json(NOTEBOOK_04)["results"]
    nb = pd.DataFrame(doc["layouts"])
    nb = nb.assign(shape=[shape_of(r) for _, r in nb.iterrows()]).set_index("shape")
    diff = (nb["fp8_us"] / t["fp8_us"] - 1).abs().dropna()
    claim(len(diff) == len(t), "the render ran every layout of the table", NOTEBOOK_04)
    claim(bool(doc.get("all_checks_passed")), "every row of the render passed its check", NOTEBOOK_04)
    return {"nb04.copy_tbs": num(doc["copy_gbps"] / 1e3, 2), "nb04.within_pct": str(math.ceil(diff.max() * 100)),
            "nb04.examples": (f"8/1/256 {num(nb.loc['8/1/256', 'fp8_us'])} µs, 32/8/128 {num(nb.loc['32/8/128', 'fp8_us'])}, "
                              f"71/1/64 {num(nb.loc['71/1/64', 'fp8_us'])}")}
