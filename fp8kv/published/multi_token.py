"""The README's multi-token tables: speculative verification (``--preset spec-verify``) and chunked-prefill
append (``--preset chunked-prefill``) on an H100, fp8kv's attend kernel beside FlashInfer's prefill wrapper and
vLLM's unified attention over the same pages."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, span, times
from .sources import Sources, ok_rows

__all__ = ["multi_token", "SPEC_VERIFY", "CHUNKED_PREFILL"]

# 32/8/128 and 40/8/128 at B 16 / 64 x 4k / 16k, q_len 1, 2, 4, 8 (two runs of one session on one H100)
SPEC_VERIFY = ("results/bench/nvidia-h100-80gb-hbm3/20261205T231300Z.csv",
               "results/bench/nvidia-h100-80gb-hbm3/20261205T231742Z.csv")
CHUNKED_PREFILL = "results/bench/nvidia-h100-80gb-hbm3/20261205T231501Z.csv"
# fp8kv's FP8 decode (the formats preset's e4m3 rows, another run on an H100): the baseline of the drafts' cost
DECODE = "results/bench/nvidia-h100-80gb-hbm3/20261205T153929Z.csv"
_COLUMNS = ["backend", "kv_dtype", "batch", "context", "q_len", "num_q_heads", "num_kv_heads", "head_dim",
            "time_us", "pct_copy_bw", "tflops", "copy_gbps"]
_PEERS = ("flashinfer", "vllm")
_TRITON_KERNELS = "gluon=False"  # the variant that asks fp8kv.attend for its Triton kernels


def _table(src: Sources, rels, index) -> pd.DataFrame:
    """Median µs per ``index`` × (backend, kv_dtype) of the rows that ran and passed their check, with the
    FP8 kernel's ratios: ``x_own`` (its BF16 / its FP8), ``x_peer`` (the best peer of either dtype / its FP8),
    ``x_peer_fp8`` (the best peer's FP8 / its FP8) and its % of the copy limit."""
    rows = pd.concat([ok_rows(src.csv(rel, [*_COLUMNS, "mode", "variant"]), rel) for rel in rels])
    variant = rows["variant"].fillna("").astype(str)
    # the default launch, and fp8kv's Triton kernels over FP8 pages (gluon=False) where a run timed them beside it
    keep = (variant == "") | ((variant == _TRITON_KERNELS) & (rows["kv_dtype"] == "fp8_e4m3"))
    rows = rows[(rows["mode"] == "dequant") & keep]  # one launch, one mode a cell
    rows = rows.assign(backend=rows["backend"].where(variant[keep] == "", rows["backend"] + " " + _TRITON_KERNELS))
    rows = rows.assign(shape=rows["num_q_heads"].astype(str) + "/" + rows["num_kv_heads"].astype(str) + "/"
                       + rows["head_dim"].astype(str))
    t = rows.pivot_table(index=index, columns=["backend", "kv_dtype"], values="time_us", aggfunc="median")
    t.columns = [f"{b} {k}" for b, k in t.columns]
    fp8 = t["triton fp8_e4m3"]
    peers = [c for c in _kernel_times(t).columns if not c.startswith("triton ")]
    out = t.assign(x_own=t["triton bf16"] / fp8, x_peer=t[peers].min(axis=1) / fp8,
                   x_peer_fp8=t[[c for c in peers if c.endswith("fp8_e4m3")]].min(axis=1) / fp8)
    own = rows[rows["backend"] == "triton"].pivot_table(index=index, columns="kv_dtype",
                                                        values=["pct_copy_bw", "tflops"], aggfunc="median")
    return out.assign(pct_fp8=own[("pct_copy_bw", "fp8_e4m3")], pct_bf16=own[("pct_copy_bw", "bf16")],
                      tflops_fp8=own[("tflops", "fp8_e4m3")], tflops_bf16=own[("tflops", "bf16")])


def _kernel_times(t: pd.DataFrame) -> pd.DataFrame:
    """The µs columns of :func:`_table` ("<backend> <kv_dtype>"), without the ratios beside them."""
    return t[[c for c in t.columns if c.split()[0] in ("triton", *_PEERS)]]


def _lines(t: pd.DataFrame, keys: list[str], compute_bound: bool = False) -> list[str]:
    cols = [("triton fp8_e4m3", "fp8kv FP8"), (f"triton {_TRITON_KERNELS} fp8_e4m3", "fp8kv FP8, Triton kernels"),
            ("triton bf16", "fp8kv BF16"), ("flashinfer fp8_e4m3", "FlashInfer FP8"),
            ("flashinfer bf16", "FlashInfer BF16"), ("vllm fp8_e4m3", "vLLM FP8"), ("vllm bf16", "vLLM BF16")]
    cols = [(c, name) for c, name in cols if c in t.columns]
    last = "fp8kv TFLOP/s, FP8 / BF16" if compute_bound else "FP8 % of copy"
    head = [*keys, *[name for _, name in cols], "FP8 × own BF16", "FP8 × best peer", last]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in t.iterrows():
        key = key if isinstance(key, tuple) else (key,)
        end = f"{num(r['tflops_fp8'], 0)} / {num(r['tflops_bf16'], 0)}" if compute_bound else num(r["pct_fp8"], 0)
        lines.append("| " + " | ".join([*map(str, key), *[num(r[c]) for c, _ in cols], times(r["x_own"]),
                                         times(r["x_peer"]), end]) + " |")
    return lines


def multi_token(src: Sources) -> dict[str, str]:
    """The spec-verify table (32/8/128) and its ranges over both layouts, the chunked-prefill table and its."""
    sv = _table(src, SPEC_VERIFY, ["shape", "batch", "context", "q_len"])
    target = sv.xs("32/8/128", level="shape")
    v = {"multi.spec_table": "\n".join(_lines(target, ["B", "ctx", "q_len"]))}
    drafts = sv[sv.index.get_level_values("q_len") > 1]
    v["multi.sv_x_own"] = span(drafts["x_own"])
    v["multi.sv_x_peer"] = span(drafts["x_peer"])
    v["multi.sv_pct_fp8"] = span(drafts["pct_fp8"], 0)
    v["multi.sv_pct_bf16"] = span(drafts["pct_bf16"], 0)
    fi_fp8 = drafts["flashinfer fp8_e4m3"]
    v["multi.sv_fi_pct"] = span(drafts["pct_fp8"] * drafts["triton fp8_e4m3"] / fi_fp8, 0)  # same bytes
    one = sv.xs(1, level="q_len")
    cost = sv["triton fp8_e4m3"] / one["triton fp8_e4m3"].reindex(sv.droplevel("q_len").index).to_numpy()
    v["multi.sv_cost_q8"] = span(cost[cost.index.get_level_values("q_len") == 8], 2)
    v["multi.sv_cost_q24"] = span(cost[cost.index.get_level_values("q_len").isin([2, 4])], 2)
    dec = ok_rows(src.csv(DECODE, ["backend", "kv_dtype", "mode", "granularity", "num_q_heads", "num_kv_heads",
                                   "head_dim", "batch", "context", "time_us"]), DECODE)
    dec = dec[(dec["backend"] == "triton") & (dec["kv_dtype"] == "fp8_e4m3") & (dec["mode"] == "dequant")
              & (dec["granularity"] == "tensor") & (dec["num_q_heads"] == 32) & (dec["num_kv_heads"] == 8)
              & (dec["head_dim"] == 128)].set_index(["batch", "context"])["time_us"]
    mine = target["triton fp8_e4m3"]
    vs_decode = mine / dec.reindex(mine.droplevel("q_len").index).to_numpy()
    q = vs_decode.index.get_level_values("q_len")
    claim(vs_decode.notna().all(), "the decode ran at every spec-verify point of 32/8/128", DECODE)
    v["multi.sv_decode_q24"] = span(vs_decode[(q == 2) | (q == 4)], 2)
    v["multi.sv_decode_q8"] = span(vs_decode[q == 8], 2)
    ahead = drafts[drafts["x_peer_fp8"] > 1.05]  # ahead by more than run-to-run noise
    claim(set(ahead.index.get_level_values("q_len")) == {8} and
          set(ahead.index.get_level_values("shape")) == {"40/8/128"},
          "fp8kv's FP8 is ahead of FlashInfer's FP8 only at 40/8/128 with 8 drafts", SPEC_VERIFY[1])
    v["multi.sv_ahead"] = span(ahead["x_peer_fp8"])
    level = sv.loc[("32/8/128", 64, 16384, 8), "x_peer_fp8"]
    claim(abs(level - 1) < 0.05, "level with FlashInfer's FP8 at 32/8/128, B 64 x 16k, 8 drafts", SPEC_VERIFY[0])
    few = _kernel_times(sv)[sv.index.get_level_values("q_len").isin([2, 4])]
    claim((few.idxmin(axis=1) == "flashinfer fp8_e4m3").all(), "FlashInfer's FP8 is the fastest at 2 and 4 drafts",
          SPEC_VERIFY[0])
    copies = pd.concat([src.csv(rel, _COLUMNS) for rel in (*SPEC_VERIFY, CHUNKED_PREFILL)])["copy_gbps"]
    v["multi.copy_tbs"] = span(copies / 1e3, 1)

    cp = _table(src, [CHUNKED_PREFILL], ["context", "q_len"])
    v["multi.chunk_table"] = "\n".join(_lines(cp, ["cached", "chunk"], compute_bound=True))
    v["multi.cp_x_own"] = span(cp["x_own"])
    v["multi.cp_fi_own"] = span(cp["flashinfer bf16"] / cp["flashinfer fp8_e4m3"])
    x_fi = cp["flashinfer fp8_e4m3"] / cp["triton fp8_e4m3"]
    claim(list(x_fi[x_fi > 1].index) == [(0, 256)], "fp8kv's FP8 beats FlashInfer's FP8 only on a 256-token chunk of "
          "a new prompt", CHUNKED_PREFILL)
    v["multi.cp_x_fi_fp8"] = span(x_fi[x_fi < 1])
    v["multi.cp_x_fi_fp8_first"] = times(x_fi[(0, 256)])
    long = cp[cp.index.get_level_values("q_len") >= 2048]
    v["multi.cp_tflops_bf16"] = span(long["tflops_bf16"], 0)
    v["multi.cp_tflops_fp8"] = span(long["tflops_fp8"], 0)
    claim((cp["x_own"] < 1).all(), "fp8kv's FP8 chunk is slower than its BF16 at every point", CHUNKED_PREFILL)
    claim((_kernel_times(cp).idxmin(axis=1) == "flashinfer bf16").all(), "FlashInfer's BF16 prefill is the fastest chunk",
          CHUNKED_PREFILL)
    return v
