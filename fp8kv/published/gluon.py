"""The README's Gluon section: the wide-head probe's table and the ``gluon`` preset's run beside the
Triton kernel and FlashInfer, with the ranges of their bullets and the Results section's opening."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, sci_span, span, times
from .layouts import shape_of
from .sources import Sources, ok_rows

__all__ = ["gluon", "GLUON_64", "WIDE"]

GLUON_64 = "results/bench/nvidia-h200/20261203T210605Z.csv"
GLUON_1 = "results/bench/nvidia-h200/20261203T210857Z.csv"
WIDE = "results/bench/nvidia-h200/20261204T120140Z-gluon-wide.json"
WIDE_2 = "results/bench/nvidia-h200/20261204T120840Z-gluon-wide.json"
NAMES = {"8/1/256": "8/1/256 (Gemma-2B)", "16/8/256": "16/8/256 (Gemma-2-9B)", "16/16/256": "16/16/256 (Gemma-7B)"}


def _wide(src: Sources) -> tuple[str, pd.Series, dict[str, str]]:
    rows = src.rows(WIDE, columns=["shape", "batch", "kernel", "launch", "block_n", "num_stages", "time_us"])
    rows = rows[rows["batch"] == 64]
    lines = ["| Hq/Hkv/D | Triton kernel µs | Gluon, 64-token tiles 2 / 3 / 4 deep | Gluon, 128-token tiles 2 deep "
             "(the default) | × Triton |", "|---|---|---|---|---|"]
    ratios = {}
    for shape in rows["shape"].unique():
        r = rows[rows["shape"] == shape]
        tri = r[r["kernel"] == "triton"]["time_us"].iloc[0]
        asked = r[r["launch"].str.contains("block_n")]
        deep = [asked[(asked["block_n"] == 64) & (asked["num_stages"] == s)]["time_us"].iloc[0] for s in (2, 3, 4)]
        wide = asked[(asked["block_n"] == 128) & (asked["num_stages"] == 2)]["time_us"].iloc[0]
        ratios[shape] = tri / wide
        lines.append(f"| {NAMES.get(shape, shape)} | {num(tri)} | {' / '.join(num(x) for x in deep)} | {num(wide)} | "
                     f"{times(tri / wide)} |")
    second = src.rows(WIDE_2, columns=["shape", "batch", "kernel", "launch", "time_us"])
    second = second[(second["batch"] == 64) & (second["kernel"] == "gluon") & (second["launch"] == "{'gluon': True}")]
    v = {"gluon.wide_second": ", ".join(num(second[second["shape"] == s]["time_us"].iloc[0]) for s in rows["shape"].unique()
                                        if (second["shape"] == s).any())}
    return "\n".join(lines), pd.Series(ratios), v


def _preset(src: Sources) -> tuple[pd.DataFrame, dict[str, str]]:
    """The ``gluon`` preset at B = 64 × 16k: per layout FlashInfer's best, fp8kv BF16, Triton FP8, Gluon FP8."""
    raw = src.csv(GLUON_64, ["label", "backend", "kernel", "time_us", "copy_gbps", "kv_bytes", "rel_err"])
    ok = ok_rows(raw, GLUON_64)
    ok = ok.assign(shape=[shape_of(r) for _, r in ok.iterrows()])
    fp8 = ok["kv_dtype"].str.startswith("fp8")
    own = ok["backend"] == "triton"
    gl = ok[own & fp8 & (ok["kernel"] == "gluon")].set_index("shape")
    tr = ok[own & fp8 & (ok["kernel"] == "triton")].set_index("shape")
    bf = ok[own & (ok["label"] == "triton bf16 dequant")].set_index("shape")
    fi = ok[ok["backend"] == "flashinfer"].sort_values("time_us").drop_duplicates("shape").set_index("shape")
    order = list(dict.fromkeys(ok["shape"]))
    t = pd.DataFrame({"bf16": bf["time_us"], "triton": tr["time_us"], "gluon": gl["time_us"],
                      "bf16_tbs": bf["kv_bytes"] / bf["time_us"] / 1e6, "fp8_tbs": gl["kv_bytes"] / gl["time_us"] / 1e6,
                      "fi": fi["time_us"], "fi_label": fi["label"]}).loc[order]
    copy = raw["copy_gbps"].iloc[0] / 1e3
    head = ["Hq/Hkv/D", "B × ctx", "FlashInfer's best", "fp8kv BF16", "Triton FP8", "Gluon FP8", "Gluon × Triton",
            "Gluon × FlashInfer", "Gluon × own BF16", "BF16 TB/s", "FP8 TB/s", "FP8 ÷ BF16 bytes/s", "% of copy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, r in t.iterrows():
        has_fi = r["fi"] == r["fi"]
        fi_name = str(r["fi_label"]).replace("flashinfer-", "").replace(" dequant", "").replace("fp8_e4m3", "fp8")
        rate = r["fp8_tbs"] / r["bf16_tbs"]
        bold = shape == t["gluon"].index[0]
        cells = [shape, "64 × 16k", f"{num(r['fi'])} ({fi_name})" if has_fi else "—", num(r["bf16"]), num(r["triton"]),
                 f"**{num(r['gluon'])}**" if bold else num(r["gluon"]), times(r["triton"] / r["gluon"]),
                 times(r["fi"] / r["gluon"]) if has_fi else "—", times(r["bf16"] / r["gluon"]), num(r["bf16_tbs"], 2),
                 num(r["fp8_tbs"], 2), f"**{times(rate)}**" if bold else times(rate),
                 num(100 * r["fp8_tbs"] / copy, 0)]
        lines.append("| " + " | ".join(cells) + " |")
    claim(set(ok["batch"]) == {64} and set(ok["context"]) == {16384}, "the run is B = 64 × 16k only", GLUON_64)
    ours, peers = ok[own & fp8]["rel_err"], ok[(ok["backend"] == "flashinfer") & fp8]["rel_err"]
    return t, {"gluon.table": "\n".join(lines), "gluon.copy_tbs": num(copy, 2),
               "gluon.err_own": sci_span(ours, -3), "gluon.err_fi": sci_span(peers, -3)}


def gluon(src: Sources) -> dict[str, str]:
    """The wide probe's table, the ``gluon`` preset's numbers, and the opening's Gluon × Triton ranges."""
    table, wide_x, v = _wide(src)
    v["gluon.wide_table"] = table
    t, more = _preset(src)
    v.update(more)
    x = t["triton"] / t["gluon"]
    claim((x > 1).all(), "the Gluon kernel is faster than the Triton kernel on every layout of the gluon preset", GLUON_64)
    v["intro.gluon_x_triton"] = span(x)
    v["intro.gluon_x_triton_wide"] = span(wide_x)
    v["gluon.x_triton"] = span(x)
    rate = t["fp8_tbs"] / t["bf16_tbs"]
    v["gluon.best_rate"] = span(rate[["32/8/128", "32/32/128"]] * 100, 0)
    v["gluon.32_8_128_us"] = num(t.loc["32/8/128", "gluon"])
    v["gluon.32_8_128_x_bf16"] = times(t.loc["32/8/128", "bf16"] / t.loc["32/8/128", "gluon"])
    v["gluon.mha_x_bf16"] = times(t.loc["32/32/128", "bf16"] / t.loc["32/32/128", "gluon"])
    other = [s for s in t.index if s not in ("32/8/128", "32/32/128")]
    v["gluon.rate_other"] = span(rate[other] * 100, 0)
    odd = ["16/2/96", "32/32/80", "32/32/96", "32/8/112"]
    v["gluon.odd_x_bf16"] = span(t.loc[odd, "bf16"] / t.loc[odd, "gluon"])
    v["gluon.odd_x_bf16_triton"] = span(t.loc[odd, "bf16"] / t.loc[odd, "triton"])
    v["gluon.mha_x_fi"] = times(t.loc["32/32/128", "fi"] / t.loc["32/32/128", "gluon"])
    claim(t.loc["32/32/128", "triton"] > t.loc["32/32/128", "fi"], "the Triton kernel lost to FlashInfer at MHA 32/32/128", GLUON_64)
    with_fi = [s for s in other if t.loc[s, "fi"] == t.loc[s, "fi"]]
    v["gluon.x_fi_other"] = span(t.loc[with_fi, "fi"] / t.loc[with_fi, "gluon"])
    v["gluon.bf16_small"] = span(t.loc[["16/2/96", "32/32/80", "14/2/64"], "bf16_tbs"], 1)
    return v
