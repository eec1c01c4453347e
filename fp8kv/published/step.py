"""The README's decode-step table (notebook 07's H200 render) and the sliding-window table."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, pct, span, times
from .sources import Sources, ok_rows

__all__ = ["step", "window", "STEP", "WINDOW"]

STEP = "reports/nvidia-h200/07_decode_step.json"
WINDOW = "results/bench/nvidia-h200/20261203T081442Z.csv"


def _grouped(n: float) -> str:
    return f"{n:,.0f}"


def step(src: Sources) -> dict[str, str]:
    """One line per model × context of the render's reading, and the attention rates at BF16's ceiling."""
    res = src.json(STEP)["results"]
    rows = ok_rows(pd.DataFrame(res["rows"]).assign(check_passed=True), STEP)
    lines = ["| model | context | ceiling BF16 / FP8 | best tokens/s BF16 (batch) | best tokens/s FP8 (batch) | FP8 ÷ BF16, best "
             "| step at BF16's ceiling, BF16 / FP8 µs | attention share there, BF16 / FP8 |", "|---|---|---|---|---|---|---|---|"]
    b1, b4, rates, ceilings = [], [], {}, {}
    for r in res["reading"].values():
        m, ctx = r["model"], r["context"]
        at = rows[(rows["model"] == m) & (rows["context"] == ctx)]
        ceil = {k: int(at[at["kv_dtype"] == k]["ceiling"].iloc[0]) for k in ("bf16", "fp8_e4m3")}
        c = r["at_baseline_ceiling"]
        ceilings[m] = ceil["bf16"]
        there = at[at["batch"] == c["batch"]].set_index("kv_dtype")
        best, bb = r["best_tokens_per_s"], r["best_batch"]
        lines.append(f"| {m} | {ctx} | {ceil['bf16']} / {ceil['fp8_e4m3']} | {_grouped(best['bf16'])} ({bb['bf16']}) | "
                     f"{_grouped(best['fp8_e4m3'])} ({bb['fp8_e4m3']}) | **{times(r['best_ratio'])}×** | "
                     f"{_grouped(there.loc['bf16', 'step_us'])} / {_grouped(there.loc['fp8_e4m3', 'step_us'])} "
                     f"({times(c['speedup'])}×) | {pct(c['attention_share']['bf16'])} % / "
                     f"{pct(c['attention_share']['fp8_e4m3'])} % |")
        b1.append(r["batch1"])
        rates[m] = there["kv_bytes"] / there["attention_us"] / 1e6  # TB/s of KV inside the step's attention
        four = at[at["batch"] == 4].set_index("kv_dtype")["step_us"]
        b4.append(four["bf16"] / four["fp8_e4m3"] - 1)
    claim(len(b1) == 3, "three models in the render", STEP)
    v = {"step.table": "\n".join(lines)}
    shares = [100 * r["at_baseline_ceiling"]["attention_share"][k] for r in res["reading"].values()
              for k in ("bf16", "fp8_e4m3")]
    v["step.ceiling_attention"] = span(shares, 0)
    v["step.b1_within"] = num(max(abs(x["speedup"] - 1) for x in b1) * 100, 1)
    v["step.b1_attention"] = span([100 * x["attention_share"][k] for x in b1 for k in ("bf16", "fp8_e4m3")], 0)
    v["step.fp8_over_bf16_rate"] = ", ".join(times(r.loc["fp8_e4m3"] / r.loc["bf16"]) for r in rates.values())
    v["step.fp8_tbs"] = ", ".join(num(r.loc["fp8_e4m3"], 2) for r in rates.values())
    v["step.b4_pct"] = span([100 * x for x in b4], 0)
    v["step.best_ratios"] = ", ".join(f"{times(r['best_ratio'])}× ({r['model']} at {r['context']:,} tokens)"
                                      for r in res["reading"].values())
    bf16 = {m: r.loc["bf16"] for m, r in rates.items()}
    claim(min(bf16, key=bf16.get) == "Qwen3-8B", "BF16 attention read slowest in Qwen3-8B's step", STEP)
    v["step.bf16_tbs_8b"] = num(bf16["Qwen3-8B"], 2)
    at_8b = next(r for r in res["reading"].values() if r["model"] == "Qwen3-8B")
    batch_8b = at_8b["at_baseline_ceiling"]["batch"]  # the batch those rates were read at
    claim(batch_8b == ceilings["Qwen3-8B"], "Qwen3-8B's rates are read at its BF16 ceiling", STEP)
    v["step.batch_8b"] = str(batch_8b)
    v["step.bf16_tbs_others"] = " and ".join(num(x, 2) for m, x in bf16.items() if m != "Qwen3-8B")
    return v


def window(src: Sources) -> dict[str, str]:
    """The sliding-window table (``window`` preset) and its ranges."""
    ok = ok_rows(src.csv(WINDOW, ["label", "window", "time_us"]), WINDOW)
    ok = ok.assign(column=ok["label"].str.replace(r" window=\d+$", "", regex=True))
    t = ok.pivot_table(index=["batch", "context", "window"], columns="column", values="time_us", aggfunc="median")
    cols = [("triton fp8_e4m3 dequant", "Triton fp8"), ("triton fp8_e4m3 fp8", "Triton fp8 fp8-mode"),
            ("triton bf16 dequant", "Triton bf16"), ("flashinfer-tc fp8_e4m3 dequant", "FlashInfer fp8"),
            ("flashinfer-tc bf16 dequant", "FlashInfer bf16")]
    fp8 = t["triton fp8_e4m3 dequant"]
    x_own = t["triton bf16 dequant"] / fp8
    fi_best = t[["flashinfer-tc fp8_e4m3 dequant", "flashinfer-tc bf16 dequant"]].min(axis=1)
    x_fi = fi_best / fp8
    head = ["B", "ctx", "window", *[name for _, name in cols], "FP8 × own BF16", "FP8 × FlashInfer's best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (b, ctx, w), r in t.iterrows():
        lines.append("| " + " | ".join([str(b), str(ctx), str(w), *[num(r[c]) for c, _ in cols],
                                         times(x_own[(b, ctx, w)]), times(x_fi[(b, ctx, w)])]) + " |")
    by_ctx = fp8.unstack("context")
    agree = (by_ctx.max(axis=1) / by_ctx.min(axis=1) - 1).max()
    claim((t["flashinfer-tc fp8_e4m3 dequant"] > t["flashinfer-tc bf16 dequant"]).all(),
          "FlashInfer's FP8 is slower than its BF16 with a window", WINDOW)
    cc = t["flashinfer-no-tc bf16 dequant"].tolist() + t["flashinfer-no-tc fp8_e4m3 dequant"].tolist()
    return {"window.table": "\n".join(lines), "window.ctx_agree_pct": str(max(1, round(agree * 100 + 0.4999))),
            "window.x_fi": span(x_fi), "window.x_own": span(x_own),
            "window.cuda_core_ms": span([c / 1e3 for c in cc], 0)}
