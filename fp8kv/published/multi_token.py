"""The README's multi-token tables: speculative verification (``--preset spec-verify``) and chunked-prefill
append (``--preset chunked-prefill``) on an H100, fp8kv's attend kernel beside FlashInfer's prefill wrapper and
vLLM's unified attention over the same pages."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, span, times
from .probes import shape_col
from .sources import Sources, ok_rows

__all__ = ["multi_token", "short_splits", "verify_step", "VERIFY_STEP", "VERIFY_STEP_H100", "VERIFY_STEP_GOAL", "SPEC_VERIFY", "CHUNKED_PREFILL", "SHORT_SPLITS_ROWS", "SHORT_SPLITS_DEFAULT"]

# 32/8/128 and 40/8/128 at B 16 / 64 x 4k / 16k, q_len 1, 2, 4, 8, on one H100, each point's peers in one run: the
# default (the Gluon kernel's rows where they run) beside gluon=False. The 32/8/128 run at B 16 and 64 was cut
# short at B 64 (its B 16 rows are kept) and B 64 ran again on its own. Path -> the batches taken from it.
SPEC_VERIFY = {"results/bench/nvidia-h100-80gb-hbm3/20261206T022925Z.csv": (16,),
               "results/bench/nvidia-h100-80gb-hbm3/20261206T023638Z.csv": (64,),
               "results/bench/nvidia-h100-80gb-hbm3/20261206T023216Z.csv": (16, 64)}
CHUNKED_PREFILL = "results/bench/nvidia-h100-80gb-hbm3/20261205T231501Z.csv"
# B 1 / 4 / 16 x 4k, 2 and 4 drafts, 32/8/128 and 40/8/128: the rows forced (gluon=True), and the default beside
# FlashInfer, in two runs on one H100 (the rows' bound on short splits, GLUON_MIN_ROW_SPLIT_TOKENS)
SHORT_SPLITS_ROWS = "results/bench/nvidia-h100-80gb-hbm3/20261206T052141Z.csv"
SHORT_SPLITS_DEFAULT = "results/bench/nvidia-h100-80gb-hbm3/20261206T052200Z.csv"
# python -m fp8kv.step --model Qwen3-0.6B --contexts 4096 --draft-lens 0 4 --acceptance 0.7 on the H200: the whole
# step (random weights of Qwen3-0.6B's shapes) with no drafts and with 4 drafts verified, each accepted with 0.7
VERIFY_STEP = "results/step-verify/nvidia-h200/20261206T101607Z.csv"
VERIFY_STEP_H100 = "results/step-verify/nvidia-h100-80gb-hbm3/20261207T125437Z.csv"  # the same command on an H100
VERIFY_STEP_GOAL = 1.8  # FP8's best accepted tokens/s over BF16's, 4 drafts at 70 %, Qwen3-0.6B at 4k
_COLUMNS = ["backend", "kv_dtype", "batch", "context", "q_len", "num_q_heads", "num_kv_heads", "head_dim",
            "time_us", "pct_copy_bw", "tflops", "copy_gbps"]
_PEERS = ("flashinfer", "vllm")
_TRITON_KERNELS = "gluon=False"  # the variant that asks fp8kv.attend for its Triton kernels


def _table(src: Sources, rels, index) -> pd.DataFrame:
    """Median µs per ``index`` × (backend, kv_dtype) of the rows that ran and passed their check, with the
    FP8 kernel's ratios: ``x_own`` (its BF16 / its FP8), ``x_peer`` (the best peer of either dtype / its FP8),
    ``x_peer_fp8`` (the best peer's FP8 / its FP8) and its % of the copy limit."""
    rows = _runs(src, rels)
    variant = rows["variant"].fillna("").astype(str)
    # the default launch, and fp8kv's Triton kernels over FP8 pages (gluon=False) where a run timed them beside it
    keep = (variant == "") | ((variant == _TRITON_KERNELS) & (rows["kv_dtype"] == "fp8_e4m3"))
    rows = rows[(rows["mode"] == "dequant") & keep]  # one launch, one mode a cell
    rows = rows.assign(backend=rows["backend"].where(variant[keep] == "", rows["backend"] + " " + _TRITON_KERNELS))
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


def _runs(src: Sources, rels) -> pd.DataFrame:
    """The rows of the runs ``rels`` (paths, or path -> the batches taken from it) that ran and passed their check,
    with their head layout as ``shape`` ("Hq/Hkv/D")."""
    rels = rels if isinstance(rels, dict) else dict.fromkeys(rels)
    rows = pd.concat([ok_rows(src.csv(rel, [*_COLUMNS, "mode", "variant", "kernel"]), rel)
                      .pipe(lambda r, kept=kept: r if kept is None else r[r["batch"].isin(kept)])
                      for rel, kept in rels.items()], ignore_index=True)
    return rows.assign(shape=shape_col(rows))


def _kernel_times(t: pd.DataFrame) -> pd.DataFrame:
    """The µs columns of :func:`_table` ("<backend> <kv_dtype>"), without the ratios beside them."""
    return t[[c for c in t.columns if c.split()[0] in ("triton", *_PEERS)]]


def _kernels(src: Sources) -> pd.DataFrame:
    """fp8kv's default FP8 rows of the spec-verify runs: which kernel each point ran."""
    rows = _runs(src, SPEC_VERIFY)
    return rows[(rows["backend"] == "triton") & (rows["kv_dtype"] == "fp8_e4m3") & (rows["mode"] == "dequant")
                & (rows["variant"].fillna("").astype(str) == "")]


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
    """The spec-verify table (32/8/128) and its ranges over both layouts, the chunked-prefill table and its, and the
    rows on short splits (:func:`short_splits`)."""
    sv = _table(src, SPEC_VERIFY, ["shape", "batch", "context", "q_len"])
    target = sv.xs("32/8/128", level="shape")
    v = {"multi.spec_table": "\n".join(_lines(target, ["B", "ctx", "q_len"]))}
    from ..ops.decode.planning import MAX_ROW_TILES

    q = sv.index.get_level_values("q_len")
    rows = _kernels(src)
    ran = rows[(rows["q_len"] > 1) & (rows["kernel"] == "gluon-multi-token")]
    programs = -(-(ran["num_q_heads"] // ran["num_kv_heads"] * ran["q_len"]) // ran["block_m"])  # a KV head's
    gluon = ran[programs <= MAX_ROW_TILES].set_index(sv.index.names).index  # what the default now runs
    wide = ran[programs > MAX_ROW_TILES]  # measured in more programs a KV head: now the attend kernel's
    claim(len(gluon) > 0 and set(wide["shape"]) == {"40/8/128"} and set(wide["q_len"]) == {8},
          "the rows ran; those in more programs than the rule allows are 40/8/128's 8 drafts", ", ".join(SPEC_VERIFY))
    w = sv[sv.index.isin(wide.set_index(sv.index.names).index)]
    v["multi.sv_wide_cost"] = span(w["triton fp8_e4m3"] / w[f"triton {_TRITON_KERNELS} fp8_e4m3"])
    on = sv[sv.index.isin(gluon)]  # drafts through the Gluon kernel's rows
    v["multi.sv_rows_x_own"] = span(on["x_own"])
    v["multi.sv_rows_x_peer"] = span(on["x_peer"])
    v["multi.sv_rows_pct"] = span(on["pct_fp8"], 0)
    v["multi.sv_rows_x_kernels"] = span(on[f"triton {_TRITON_KERNELS} fp8_e4m3"] / on["triton fp8_e4m3"])
    one = sv.xs(1, level="q_len")["triton fp8_e4m3"]  # one new token: fp8kv's FP8 decode, in the same run
    vs_decode = sv["triton fp8_e4m3"] / one.reindex(sv.droplevel("q_len").index).to_numpy()
    claim(vs_decode.notna().all(), "fp8kv's FP8 ran one new token and the drafts at every point", ", ".join(SPEC_VERIFY))
    rows_decode = vs_decode[vs_decode.index.isin(gluon)]
    v["multi.sv_rows_decode"] = span(rows_decode, 2)
    v["multi.sv_rows_points"] = str(len(on))
    v["multi.sv_drafts_points"] = str(int((q > 1).sum()))
    # the goals, at the points the rows ran
    met = on[(on["x_own"] >= 1.7) & (on["x_peer"] >= 1.3) & (rows_decode <= 1.3)]
    v["multi.sv_goals_met"] = str(len(met))
    v["multi.sv_own_met"] = str(int((on["x_own"] >= 1.7).sum()))
    v["multi.sv_peer_met"] = str(int((on["x_peer"] >= 1.3).sum()))
    v["multi.sv_decode_met"] = str(int((rows_decode <= 1.3).sum()))
    # the drafts the rows did not take (the splits too short): the attend kernel ran them
    attend = rows[(rows["q_len"] > 1) & (rows["kernel"] == "triton-attend")].set_index(sv.index.names).index
    claim(len(attend) + len(ran) == int((q > 1).sum()), "every draft point ran the rows or the attend kernel",
          ", ".join(SPEC_VERIFY))
    claim(set(attend) == {("32/8/128", 16, 4096, 2), ("32/8/128", 16, 4096, 4), ("40/8/128", 16, 4096, 2)},
          "the rows refused only B 16 x 4k's short splits: 2 drafts, and 4 at 32/8/128", ", ".join(SPEC_VERIFY))
    off = sv[sv.index.isin(attend)]
    v["multi.sv_off_x_peer"] = span(off["x_peer"])
    fastest = _kernel_times(on).idxmin(axis=1)  # the Triton kernels (gluon=False) among them
    v["multi.sv_rows_fastest"] = str(int((fastest == "triton fp8_e4m3").sum()))
    copies = pd.concat([src.csv(rel, _COLUMNS) for rel in (*SPEC_VERIFY, CHUNKED_PREFILL)])["copy_gbps"]
    v["multi.copy_tbs"] = span(copies / 1e3, 1)
    v.update(short_splits(src))

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


def short_splits(src: Sources) -> dict[str, str]:
    """The rows against the attend kernel and FlashInfer's FP8 where the splits are short, per batch: the times behind
    GLUON_MIN_ROW_SPLIT_TOKENS."""
    runs = _runs(src, [SHORT_SPLITS_ROWS, SHORT_SPLITS_DEFAULT])
    runs = runs.assign(variant=runs["variant"].fillna("").astype(str)).set_index(["shape", "batch", "q_len"])
    forced = runs[runs["variant"] == "gluon=True"]
    # the attend kernel: the default where it ran it, gluon=False where the default ran the rows
    attend = runs[runs["kernel"] == "triton-attend"].groupby(level=["shape", "batch", "q_len"])["time_us"].median()
    peer = runs[runs["backend"] == "flashinfer"]
    claim((forced["kernel"] == "gluon-multi-token").all() and len(forced) == 12,
          "the rows ran at all 12 points when asked for", SHORT_SPLITS_ROWS)
    v = {}
    claim(attend.reindex(forced.index).notna().all(), "the attend kernel ran at every point", SHORT_SPLITS_DEFAULT)
    for b in (1, 4, 16):
        x = (forced["time_us"] / attend.reindex(forced.index).to_numpy()).xs(b, level="batch")
        v[f"multi.short_b{b}_x"] = span(x)
        v[f"multi.short_b{b}_splits"] = span(forced.xs(b, level="batch")["num_splits"], 0)
    x16 = (forced["time_us"] / peer["time_us"]).xs(16, level="batch")
    v["multi.short_b16_x_fi"] = span(x16)
    from ..ops.decode.gluon_launcher import GLUON_MIN_ROW_SPLIT_TOKENS

    v["multi.short_bound"] = str(GLUON_MIN_ROW_SPLIT_TOKENS[1])
    claim((forced["time_us"] / attend.reindex(forced.index).to_numpy()).xs(16, level="batch").max() < 1,
          "at B 16 the rows beat the attend kernel everywhere", SHORT_SPLITS_ROWS)
    return v


def verify_step(src: Sources) -> dict[str, str]:
    """The speculative-decode step on the H200 (:data:`VERIFY_STEP`): each KV dtype's best accepted tokens/s over
    its batches, with no drafts and with 4 drafts, as :func:`fp8kv.step.verify_reading` reads them."""
    k4, k0 = _verify_readings(src, VERIFY_STEP)
    h4, h0 = _verify_readings(src, VERIFY_STEP_H100)
    claim(k4["ratio"] < VERIFY_STEP_GOAL, "the verify step falls short of its goal", VERIFY_STEP)
    claim(h4["ratio"] < VERIFY_STEP_GOAL, "the verify step falls short of its goal", VERIFY_STEP_H100)
    return {**_step_numbers("verify_step.", k4, k0), **_step_numbers("verify_step.h100_", h4, h0),
            "verify_step.goal": num(VERIFY_STEP_GOAL, 1),
            "verify_step.gain_k4": times(k4["best_accepted_tokens_per_s"]["fp8_e4m3"]
                                         / k0["best_accepted_tokens_per_s"]["fp8_e4m3"]),
            "verify_step.gain_k4_bf16": times(k4["best_accepted_tokens_per_s"]["bf16"]
                                              / k0["best_accepted_tokens_per_s"]["bf16"])}


def _verify_readings(src: Sources, rel: str) -> tuple[dict, dict]:
    """The 4-draft and no-draft readings (:func:`fp8kv.step.verify_reading`) of one run of the verify command."""
    from ..step.multi_report import verify_reading

    df = src.csv(rel, ["model", "context", "draft_len", "acceptance", "kv_dtype", "batch",
                       "accepted_tokens_per_s", "draft_us", "weights", "status"])
    claim((df["draft_us"] == 0).all(), "the drafts cost no time in this run (no draft model)", rel)
    claim(set(df["weights"]) == {"random"}, "random weights of the model's shapes", rel)
    reading = {(r["draft_len"]): r for r in verify_reading(df).values()}
    claim(set(reading) == {0, 4} and {r["model"] for r in reading.values()} == {"Qwen3-0.6B"}
          and {r["context"] for r in reading.values()} == {4096} and reading[4]["acceptance"] == 0.7,
          "Qwen3-0.6B at 4096 tokens, no drafts and 4 drafts at 0.7", rel)
    return reading[4], reading[0]


def _step_numbers(prefix: str, k4: dict, k0: dict) -> dict[str, str]:
    """One run's best accepted tokens/s with 4 drafts per KV dtype, the batches they came at, and FP8's ratio over
    BF16 with 4 drafts and with none, named ``prefix`` + what."""
    return {f"{prefix}fp8": f"{k4['best_accepted_tokens_per_s']['fp8_e4m3']:,.0f}",
            f"{prefix}bf16": f"{k4['best_accepted_tokens_per_s']['bf16']:,.0f}",
            f"{prefix}fp8_batch": str(k4["best_batch"]["fp8_e4m3"]), f"{prefix}bf16_batch": str(k4["best_batch"]["bf16"]),
            f"{prefix}ratio": times(k4["ratio"]), f"{prefix}ratio_k0": times(k0["ratio"])}
