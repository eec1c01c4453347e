"""The notebook runner (fp8kv.notebooks, fp8kv.cli) and every notebook in notebooks/.

* Hygiene of the committed notebooks: no outputs, one ``parameters`` cell with the five parameters.
* Every notebook runs headless in smoke mode, once, through ``fp8kv notebooks run``; then, per
  notebook, its status, its HTML (plotly.js embedded, one plot per figure) and its results JSON are
  checked. **Adding a notebook means adding its check to ``CHECKS``** (name -> check(doc)), where
  ``doc`` is what :func:`fp8kv.notebooks.save_results` wrote (``doc["results"]`` holds the numbers).
* The report folder's life cycle (atomic replace, other GPUs' folders untouched, failures kept,
  ``--only`` carry-over) on tiny synthetic notebooks.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import sys
import time
import types
from pathlib import Path

import nbformat
import pytest
import torch

from fp8kv import cli
from fp8kv import notebooks as runner
from fp8kv.capability import ARCHS, capability
from fp8kv.formats import format
from fp8kv.notebooks import runner as nb_runner  # the runner module itself, for its internals
from fp8kv.notebooks.parameters import check_parameters

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
PLOTLY_MIME = "application/vnd.plotly.v1+json"


# --------------------------------------------------------------------------- per-notebook checks


def check_00_environment(doc):
    r = doc["results"]
    bw = r["copy_bandwidth"]
    assert bw["gbps"] > 0 and bw["time_ms"] > 0
    assert bw["bytes_moved"] == 2 * bw["nbytes"]
    assert bw["meaningful_for_gpu"] == (r["device"]["type"] == "cuda")
    assert r["device"]["slug"] == doc["device"]["slug"]
    per_arch = {a: [row for row in r["capability"] if row["arch"] == a] for a in ARCHS}
    assert set(per_arch) == {row["arch"] for row in r["capability"]}
    for arch, rows in per_arch.items():
        assert len(rows) == len(capability(arch)), arch
    assert len(r["capability_here"]) == len(capability())


def check_01_fp8_formats(doc):
    r = doc["results"]
    rt = r["roundtrip"]
    # Round-to-nearest: relative error in the normal range is at most the unit roundoff 2^-(m+1).
    assert 0 < rt["e4m3"]["max_rel_error_normal"] <= 2**-4
    assert 0 < rt["e5m2"]["max_rel_error_normal"] <= 2**-3
    for name, row in rt.items():
        f = format(name)
        assert row["max_rel_error_normal"] <= f.unit_roundoff, name
        assert row["max_rel_error_subnormal_range"] > f.unit_roundoff, name  # precision decays there
        assert 0 < row["saturated"] <= row["points_above_max"], name
        assert row["underflow"] > 0, name
    assert {s["name"] for s in r["formats"]} == set(rt)
    for name, c in r["casts"].items():
        f = format(name)
        assert c["fp8kv_nonfinite"] == 0 and max(c["fp8kv"]) == f.max, name
        assert c["fp8kv_saturated"] > 0, name
    # The amax scale keeps any tensor inside the format's window; scale = 1 does not.
    for name in ("e4m3", "e5m2"):
        rows = [s for s in r["scale_sweep"] if s["format"] == name]
        amax = [s["rel_error"] for s in rows if s["scale"] == "amax"]
        unit = [s["rel_error"] for s in rows if s["scale"] != "amax"]
        assert max(amax) <= format(name).unit_roundoff, name
        assert max(unit) >= 0.5 and min(unit) <= format(name).unit_roundoff, name


def check_02_quantization_error(doc):
    r = doc["results"]
    assert r["bound"] == {"e4m3": 2**-4, "e5m2": 2**-3}
    combos = {}
    for row in r["rows"]:
        combos.setdefault((row["format"], row["granularity"], row["scale_method"]), {})[row["quantize"]] = row
    assert {f for f, _, _ in combos} == {"e4m3", "e5m2"} and len(combos) == 2 * 4 * 4
    kv = {key: modes["kv"] for key, modes in combos.items()}
    e4 = kv[("e4m3", "tensor", "amax")]
    # Round to nearest: each normal element errs by at most 2^-4 relative, so the norm-wise error does too.
    assert 0 < e4["k_rel_err"] <= 2**-4 and 0 < e4["v_rel_err"] <= 2**-4
    assert 0 < e4["out_rel_err"] < 0.05
    assert r["e4m3_tensor_amax_k_rel_err"] == e4["k_rel_err"] == r["key_numbers"]["e4m3_tensor_amax_k_rel_err"]
    assert r["e4m3_tensor_amax_out_rel_err"] == e4["out_rel_err"]
    for (fmt, gran, method), row in kv.items():
        if method == "amax":
            assert row["k_saturated_frac"] == 0 and row["v_saturated_frac"] == 0, (fmt, gran)
            if fmt == "e4m3":  # one mantissa bit fewer: e5m2 errs more, on K, V and the output
                other = kv[("e5m2", gran, "amax")]
                for col in ("k_rel_err", "v_rel_err", "out_rel_err"):
                    assert other[col] > row[col], (gran, col)
    assert kv[("e4m3", "tensor", "percentile")]["k_saturated_frac"] > 0  # the top 0.1 % is clipped
    assert kv[("e4m3", "tensor", "1.0")]["k_underflow_frac"] > 0  # no scale: the smallest values flush to 0
    # K-vs-V attribution: every combination also ran with only K and only V quantized.
    for key, modes in combos.items():
        assert set(modes) == {"kv", "k", "v"}, key
        assert modes["k"]["v_rel_err"] == 0 and modes["k"]["k_rel_err"] == modes["kv"]["k_rel_err"], key
        assert modes["v"]["k_rel_err"] == 0 and modes["v"]["v_rel_err"] == modes["kv"]["v_rel_err"], key
        assert modes["k"]["out_rel_err"] > 0 and modes["v"]["out_rel_err"] > 0, key
    assert len(r["attribution"]) == len(combos)
    assert all(0 <= a["k_share"] <= 1 for a in r["attribution"])
    lengths = sorted({row["context_len"] for row in r["context"]})
    assert len(lengths) >= 2
    for n in lengths:
        by_fmt = {(row["format"], row["granularity"]): row["out_rel_err"] for row in r["context"]
                  if row["context_len"] == n}
        assert by_fmt[("e5m2", "tensor")] > by_fmt[("e4m3", "tensor")] > 0, n
    if r["real_status"] == "ok":
        real = [row for row in r["real_rows"] if row["quantize"] == "kv" and row["scale_method"] == "amax"]
        assert real and {row["layer"] for row in real} == {s["layer"] for s in r["real_stats"]}
        for row in real:
            if row["format"] == "e4m3":
                assert 0 < row["k_rel_err"] <= 2**-4 and 0 < row["v_rel_err"] <= 2**-4, row["source"]
    else:
        assert r["real_status"].startswith("real activations unavailable: ") and r["real_rows"] == []


def check_03_kv_capacity(doc):
    from fp8kv.capacity import GPUS, plan_capacity

    r = doc["results"]
    rows = r["rows"]
    fits = [row for row in rows if row["fits"]]
    assert fits and {row["model"] for row in rows} == set(r["models"])
    # The table is the planner's: recompute a 16-bit, a per-tensor and a per-token row.
    picks = [next(row for row in fits if row["granularity"] == g) for g in (None, "tensor", "token_head")]
    for row in picks:
        gpu = row["gpu"] if row["gpu"] in GPUS else row["gpu_memory_gib"]
        plan = plan_capacity(row["model"], row["kv_dtype"], gpu_memory_gib=gpu, utilization=r["utilization"],
                             block_size=r["block_size"], granularity=row["granularity"] or "tensor")
        for col in ("blocks", "tokens", "bytes_per_token", "fixed_scale_bytes", "max_concurrency"):
            assert plan[col] == row[col], (row["model"], row["kv_dtype"], col)
        assert row["tokens"] == row["blocks"] * r["block_size"]
    # FP8 halves the bytes per token: 2x the tokens, up to one block's rounding either way.
    ratios = r["ratios"]
    assert ratios
    for x in ratios:
        if x["granularity"] in ("tensor", "head"):
            assert 1.99 <= x["ratio"] <= x["ratio_upper"] <= 2.01, x
        if x["granularity"] == "token_head":  # per-token scales cost 4 bytes per token, head and K/V
            assert x["ratio"] < 2
    assert set(r["fp8_over_bf16_tokens_ratio"]) == set(r["models"])
    for model, ratio in r["fp8_over_bf16_tokens_ratio"].items():
        assert 1.99 <= ratio <= 2.001, (model, ratio)
    for kv, steps in r["walkthrough"].items():
        assert all(s["match"] is not False for s in steps) and sum(s["match"] is True for s in steps) >= 7, kv
    # Real PagedKVCache allocations have exactly the bytes the formula says.
    assert r["measured_vs_formula_bytes_equal"] is True
    assert r["measured"] and all(m["equal"] and m["measured_bytes"] == m["formula_bytes"] for m in r["measured"])
    assert len({(m["model"], m["kv_dtype"], m["granularity"]) for m in r["measured"]}) == len(r["measured"])


def check_04_decode_latency(doc):
    r = doc["results"]
    on_gpu = doc["device"]["type"] == "cuda"
    assert r["timings_meaningful_for_gpu"] is on_gpu  # CPU timings say nothing about any GPU
    copy = r["copy_gbps"]
    assert isinstance(copy, float) and 0 < copy < float("inf")
    rows = r["rows"]
    assert rows and {row["status"] for row in rows} <= {"ok", "unsupported", "skipped"}, \
        [(row["label"], row["reason"]) for row in rows if row["status"] == "error"]
    ran = [row for row in rows if row["status"] == "ok"]
    for row in ran:
        assert row["check_passed"] is True and row["rel_err"] <= row["tol"], row["label"]
        t = row["time_us"]
        assert isinstance(t, float) and 0 < t < float("inf"), (row["label"], t)
        assert row["copy_gbps"] == copy
        assert row["gbps"] == pytest.approx(row["bytes"] / (t * 1e-6) / 1e9)
        assert row["pct_copy_bw"] == pytest.approx(100 * row["gbps"] / copy)
    assert all(row["reason"] for row in rows if row["status"] != "ok")
    must = "triton" if on_gpu else "reference"
    assert any(row["backend"] == must for row in ran), f"no {must} row ran"
    assert r["all_checks_passed"] is True
    # The best share of the ceiling per configuration is the maximum over its rows.
    assert r["best_pct_copy_bw"]
    for best in r["best_pct_copy_bw"]:
        mine = [row["pct_copy_bw"] for row in ran if row["label"] == best["label"]]
        assert best["pct_copy_bw"] == max(mine), best["label"]
    for s in r["speedup"]:  # FP8 rows against the fastest baseline row of the same shape
        base = [row["time_us"] for row in ran if row["kv_dtype"] == r["baseline_kv_dtype"]
                and (row["batch"], row["context"]) == (s["batch"], s["context"])]
        if not base:
            assert s["bf16_us"] == "nan"  # no baseline ran for this shape
            continue
        assert s["bf16_us"] == min(base) and s["speedup_vs_bf16"] == pytest.approx(min(base) / s["time_us"])


def check_05_backend_matrix(doc):
    from fp8kv.capability import BACKEND_NAMES, check

    r = doc["results"]
    rows = r["rows"]
    ran = [row for row in rows if row["status"] != "unsupported"]
    unsupported = [row for row in rows if row["status"] == "unsupported"]
    # backends x (16-bit, FP8 x modes x granularities)
    assert r["n_rows"] == len(rows) == len(BACKEND_NAMES) * (2 + 2 * 2 * 4)
    assert r["n_ran"] == len(ran) >= 1 and r["n_unsupported"] == len(unsupported)
    failed = [(row["backend"], row["kv_dtype"], row["mode"], row["granularity"], row["status"], row["rel_err"],
               row["error"]) for row in ran if row["status"] != "passed"]
    assert not failed, failed
    assert r["n_passed"] == len(ran) and r["all_passed"] is True
    for row in ran:
        assert row["passed"] is True and row["rel_err"] <= row["tol"]
        if row["lse_tol"] == "nan":  # a backend without an LSE (vLLM's kernel) is judged on its output
            assert row["backend"] == "vllm" and row["lse_err"] == "nan"
        else:
            assert row["lse_err"] <= row["lse_tol"]
    for row in unsupported:
        assert isinstance(row["reason"], str) and row["reason"].strip()
        assert check(row["backend"], row["kv_dtype"], row["mode"], None, row["granularity"],
                     row["head_dim"]) == (False, row["reason"])
    backends_ran = {row["backend"] for row in ran}
    assert "reference" in backends_ran
    assert "triton" in backends_ran  # compiled on a GPU, in the interpreter on CPU


def check_06_model_accuracy(doc):
    r = doc["results"]
    rows = {(s["model"], s["config"]): s for s in r["summary"]}
    assert {s["model"] for s in r["summary"]} == set(r["models"])
    for model in r["models"]:
        base = rows[(model, "bf16")]
        assert base["kl_mean"] == 0 and base["top1_agree"] == 1 and base["ppl"] == base["ppl_base"]
        assert base["n_windows"] == r["n_windows"] and base["window"] == r["window"]
        good, bad = rows[(model, "e4m3 tensor amax")], rows[(model, "bad: e4m3 amax/64")]
        # e4m3 per-tensor KV: a small, non-zero change of the next-token distribution (~0.01 nats/token
        # measured), most top-1 tokens unchanged; amax scales never saturate.
        assert 0 < good["kl_mean"] < 0.05, good["kl_mean"]
        assert good["top1_agree"] > 0.85, good["top1_agree"]
        assert good["k_saturated"] == 0 and good["v_saturated"] == 0
        # A scale of amax/64 saturates most values: the damage must show, by far.
        assert bad["kl_mean"] > 10 * good["kl_mean"] and bad["k_sat_frac"] > 0.2
        # K-vs-V attribution: the side that is not quantized records no FP8 underflow.
        k_only, v_only = rows[(model, "e4m3 K only")], rows[(model, "e4m3 V only")]
        assert k_only["v_underflow"] == 0 and v_only["k_underflow"] == 0
        assert 0 < v_only["kl_mean"] and 0 < k_only["kl_mean"]
        n_layers = {lr["layer"] for lr in r["layers"] if lr["model"] == model}
        assert n_layers == set(range(len(n_layers))) and len(n_layers) > 1
        fmts = {f["config"]: f for f in r["formats"] if f["model"] == model}
        # the smoke run's formats, each where it holds the model's heads, beside the model's bf16 row
        assert list(fmts) == ["bf16", "int8_token_head", "int4_token_head", "nvfp4"] and fmts["bf16"]["kl_mean"] == 0
        assert 0 < fmts["int8_token_head"]["kl_mean"] < fmts["int4_token_head"]["kl_mean"]
    assert r["decode_backends"] == ["reference"]  # the CPU run; a GPU adds triton and flashinfer
    assert len(r["decode"]) == 3 * len(r["models"]) * len(r["decode_backends"])
    assert {d["backend"] for d in r["decode"]} == set(r["decode_backends"])
    for d in r["decode"]:
        assert d["n_new"] == r["decode_new"] and 0.0 <= d["match_fraction"] <= 1.0
        assert (d["first_divergence"] is None) == (d["match_fraction"] == 1.0)
        assert d["first_divergence"] is None or d["first_divergence"] < d["n_new"]


def check_07_decode_step(doc):
    r = doc["results"]
    on_gpu = doc["device"]["type"] == "cuda"
    assert r["timings_meaningful_for_gpu"] is on_gpu
    rows = r["rows"]
    assert rows and all(row["status"] == "ok" for row in rows), [row["reason"] for row in rows]
    assert set(r["leaves_out"]) == {"scheduling", "prefill", "sampling", "communication"}
    for row in rows:
        assert row["logits_finite"] is True
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / (row["step_us"] * 1e-6))
        assert row["attention_share"] == pytest.approx(row["attention_us"] / row["step_us"])
        assert 1 <= row["batch"] <= row["ceiling"]
    for (model, ctx, kv) in {(row["model"], row["context"], row["kv_dtype"]) for row in rows}:
        mine = [row for row in rows if (row["model"], row["context"], row["kv_dtype"]) == (model, ctx, kv)]
        assert max(row["batch"] for row in mine) == mine[0]["ceiling"], (model, kv)  # each curve reaches its ceiling
    fp8 = {(row["model"], row["context"]): row["ceiling"] for row in rows if row["kv_dtype"] == "fp8_e4m3"}
    base = {(row["model"], row["context"]): row["ceiling"] for row in rows if row["kv_dtype"] == r["baseline_kv_dtype"]}
    assert fp8 and all(fp8[k] > base[k] for k in fp8)  # FP8 holds more sequences
    assert len(r["reading"]) == len(fp8) and all(x["sentence"] for x in r["reading"].values())


def check_08_multi_token(doc):
    r = doc["results"]
    assert r["timings_meaningful_for_gpu"] is (doc["device"]["type"] == "cuda")
    for key in ("verify_rows", "prefill_rows"):
        assert r[key] and all(row["status"] == "ok" for row in r[key]), [row["reason"] for row in r[key]]
    for row in r["verify_rows"]:
        a, k = row["acceptance"], row["draft_len"]
        want = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
        assert row["q_len"] == k + 1 and row["accepted_per_step"] == pytest.approx(want)
        assert row["step_us"] == pytest.approx(row["verify_us"] + row["draft_us"])
        assert row["accepted_tokens_per_s"] == pytest.approx(row["batch"] * want / (row["step_us"] * 1e-6))
        assert 1 <= row["batch"] <= row["ceiling"] and row["logits_finite"] is True
    for row in r["prefill_rows"]:
        assert row["n_chunks"] == math.ceil(row["prompt"] / row["chunk"]) and row["ttft_us"] > 0
    assert r["attend_speedup"] and all(s["speedup"] > 0 for s in r["attend_speedup"])
    assert {s["q_len"] for s in r["attend_speedup"]} == {row["q_len"] for row in r["attend_rows"]}
    # each mode over FP8 pages has its speed-up over the one 16-bit baseline (dequant mode), cell by cell
    modes = r["settings"]["attend_modes"]
    fp8_cells = {(row["mode"], row["q_len"], row["context"]) for row in r["attend_rows"]
                 if row["kv_dtype"] == "fp8_e4m3" and row["status"] == "ok"}
    assert {(s["mode"], s["q_len"], s["context"]) for s in r["attend_speedup"]} == fp8_cells
    assert {m for m, _, _ in fp8_cells} == set(modes) == {"dequant", "fp8"}
    assert all("math_peak_tflops" in row and "pct_math_peak" in row for row in r["attend_rows"])
    errors, verdict = r["attend_context_errors"], r["attend_context_verdict"]
    assert {(e["entry"], e["mode"], e["error"]) for e in errors} == \
        {("attend", m, e) for m in modes for e in ("kernel", "quantization", "total")}
    assert sorted({e["context"] for e in errors}) == r["settings"]["error_contexts"]
    assert all(e["n_heads"] == r["settings"]["attend_shape"][0] for e in errors)
    assert len(verdict) == 3 * len(modes) and all(n["needle_top1_exact"] for n in r["attend_context_needles"])
    base = r["baseline_kv_dtype"]
    assert all(set(x["best_accepted_tokens_per_s"]) == {base, "fp8_e4m3"} for x in r["verify_reading"].values())
    assert len(r["verify_reading"]) == len({(row["draft_len"], row["acceptance"]) for row in r["verify_rows"]})
    assert len(r["prefill_reading"]) == len({(row["prompt"], row["chunk"]) for row in r["prefill_rows"]})


def check_09_will_fp8_pay(doc):
    from fp8kv.reference import FP8_MODE_TOL

    r = doc["results"]
    assert r["timings_meaningful_for_gpu"] is (doc["device"]["type"] == "cuda")
    assert r["answer"] and r["answer"].startswith("**Smoke run") is r["smoke"]
    assert r["rows"] and all(row["status"] == "ok" for row in r["rows"] if row["backend"] == "triton")
    assert r["crossings"] and all(c["answer"] and c["kv_dtype"].startswith("fp8") for c in r["crossings"])
    assert {layer["layer"] for layer in r["scale_health_layers"]} == set(range(30))  # SmolLM2-135M
    for a in r["advice"]:
        assert a["error_after"] <= a["tolerance"] and a["tokens_mixed"] <= a["tokens_fp8"]
        assert (a["tokens_lost"] > 0) == (a["n_layers_bf16"] > 0)
        assert a["heldout_after"] <= a["heldout_all_fp8"]
        assert a["kl_all_fp8"] > 0 and a["kl_reduces"] is (True if a["n_layers_bf16"] else None)
    stress = r["stress"]  # SmolLM2 with large keys: scale 1.0 collapses the scaled layers, the advice keeps them
    one = next(a for a in stress["advice"] if a["method"] == "1.0")
    assert set(one["collapsed_layers"]) == set(stress["key_layers"]) <= set(one["layers_bf16"])
    assert one["kl_after"] < one["kl_all_fp8"] / 5 and "cuts the next-token KL" in r["answer"]
    assert one["tokens_lost"] > 0 and f"({one['tokens_lost']:,} tokens fewer than all-FP8)" in r["answer"]  # its price
    errors, needles, verdict = r["long_context_errors"], r["long_context_needles"], r["long_context_verdict"]
    assert {e["error"] for e in errors} == {"kernel", "quantization", "total"}
    assert {(e["entry"], e["mode"]) for e in errors} == {(e, m) for e in ("decode", "attend") for m in ("dequant", "fp8")}
    assert all(e["rel_err_max"] <= FP8_MODE_TOL for e in errors if e["error"] == "kernel")
    assert all(n["needle_top1_exact"] for n in needles)
    assert all(n["needle_weight_ok"] and n["needle_weight_err"] <= n["needle_weight_tol"] for n in needles)
    assert {v["needle_weight_ok"] for v in verdict} == {True}
    assert len(verdict) == 12 and all(v["longest_context"] == max(r["settings"]["contexts"]) for v in verdict)


def check_10_kv_formats(doc):
    from fp8kv.capacity import get_model
    from fp8kv.kv_formats import kv_footprint
    from fp8kv.viz import pareto_front

    r = doc["results"]
    on_gpu = doc["device"]["type"] == "cuda"
    assert r["timings_meaningful_for_gpu"] is on_gpu
    assert r["rows"] and all(row["status"] == "ok" and row["check_passed"] for row in r["rows"])
    shape = get_model(r["capacity_model"])
    table = {row["format"]: row for row in r["table"]}
    assert list(table) == r["formats"] and "kivi4_g128" not in table  # KIVI's groups of 128 cannot hold D=64
    for fmt, row in table.items():  # the planner's bytes are kv_footprint's, codes and scales apart
        fp = kv_footprint(fmt, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, num_layers=shape.num_layers)
        assert row["bytes_per_token"] == float(fp.per_token) and row["code_bytes_per_token"] == float(fp.codes)
        assert row["scale_bytes_per_token"] == float(fp.per_token_scales) and row["tokens"] > 0
        assert row["kl_mean"] >= 0 and 0 <= row["top1_agree"] <= 1 and row["out_rel_err"] > 0
    assert table["int8_token_head"]["kl_mean"] < table["int4_token_head"]["kl_mean"]  # 8 bits beat 4 on the same scales
    # Untimed formats were saved as "nan" (save_results writes non-finite floats as strings).
    timed = {row["format"] for row in r["table"] if isinstance(row["tokens_per_s"], float) and row["tokens_per_s"] > 0}
    assert timed == {"int8_token_head", "int4_token_head", "nvfp4", "mxfp4", "fp8_e4m3_tensor"}  # the bench's formats
    # The front is non-empty, non-dominated, and what pareto_front finds in the saved table.
    front = r["front"]
    assert front and front == list(pareto_front(r["table"], "bytes_per_token", "kl_mean")["format"])
    for name in front:
        f = table[name]
        assert not any(o["bytes_per_token"] <= f["bytes_per_token"] and o["kl_mean"] <= f["kl_mean"]
                       and (o["bytes_per_token"] < f["bytes_per_token"] or o["kl_mean"] < f["kl_mean"])
                       for o in r["table"])
    assert r["pick"] in front and f"pick **{r['pick']}**" in r["answer"]
    assert r["answer"].startswith("**Smoke run") is r["smoke"]
    if not on_gpu:
        assert r["smoke"] and "planned: no GPU here" in r["answer"]
        assert ("CPU smoke timing" in r["answer"]) is (r["pick"] in timed)
    assert {row["layer"] for row in r["layer_errors"]} == set(range(shape.num_layers))


CHECKS = {
    "00_environment": check_00_environment,
    "01_fp8_formats": check_01_fp8_formats,
    "02_quantization_error": check_02_quantization_error,
    "03_kv_capacity": check_03_kv_capacity,
    "04_decode_latency": check_04_decode_latency,
    "05_backend_matrix": check_05_backend_matrix,
    "06_model_accuracy": check_06_model_accuracy,
    "07_decode_step": check_07_decode_step,
    "08_multi_token": check_08_multi_token,
    "09_will_fp8_pay": check_09_will_fp8_pay,
    "10_kv_formats": check_10_kv_formats,
}


# --------------------------------------------------------------------------- hygiene of committed notebooks


def _assigned_literals(source: str) -> dict:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = ast.literal_eval(node.value)
    return out


def test_there_are_notebooks():
    assert [p.stem for p in NOTEBOOKS][:2] == ["00_environment", "01_fp8_formats"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"cell {i} has outputs; clear them before committing"
            assert cell.execution_count is None, f"cell {i} has an execution count"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, "exactly one cell must be tagged 'parameters'"
    assert tagged[0].cell_type == "code"
    params = _assigned_literals(tagged[0].source)
    assert set(runner.PARAMETER_NAMES) <= set(params)
    # Interactive defaults: full size, widgets on; the runner overrides them for headless runs.
    # SMOKE None: the notebook detects the machine the way the runner does (fp8kv.notebooks.setup_notebook).
    assert params["SMOKE"] is None and params["SHOW_WIDGETS"] is True and params["DEVICE"] == "auto"
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    first = next(i for i, src in enumerate(code) if "setup_notebook(SMOKE, DEVICE)" in src)
    assert not any(re.search(r"^\s*(import|from)\s", src, re.M) and "triton" in src for src in code[:first]), \
        "the machine is set up before anything imports triton"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert f'save_results(OUT_DIR, "{path.stem}"' in code, "the notebook must save its results under its own name"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_a_check(path):
    assert path.stem in CHECKS, f"add a check for {path.stem} to CHECKS in {Path(__file__).name}"


# --------------------------------------------------------------------------- the real notebooks, smoke mode


def test_smoke_run_succeeds(smoke_report):
    rc, folder, manifest = smoke_report
    assert manifest["failed"] == [], manifest["failed"]
    assert rc == 0
    assert manifest["mode"] == "smoke" and manifest["gpu_slug"] == folder.name
    assert [e["name"] for e in manifest["notebooks"]] == [p.stem for p in NOTEBOOKS]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")], "staging folder left behind"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_report(smoke_report, path):
    _, folder, manifest = smoke_report
    name = path.stem
    entry = next(e for e in manifest["notebooks"] if e["name"] == name)
    assert entry["status"] == "ok", entry["error"]

    executed = nbformat.read(folder / f"{name}.ipynb", as_version=4)
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1 and "SHOW_WIDGETS = False" in injected[0].source and "SMOKE = True" in injected[0].source
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    n_figures = sum(PLOTLY_MIME in o.get("data", {}) for o in outputs)
    assert n_figures >= 1, "a notebook draws at least one figure"
    # plotly.js is stripped from the .ipynb (it is in the .html) ...
    assert all(len(str(o.get("data", {}).get("text/html", ""))) < 1_000_000 for o in outputs)

    # ... and loaded by the HTML from the one copy above its folder, with one plot per figure: views offline.
    html = (folder / f"{name}.html").read_text(encoding="utf-8")
    assert "* plotly.js v" not in html and len(html) < 2_000_000
    library = re.findall(r'<script src="(\.\./plotly-[^"]+\.min\.js)"', html)  # in the reports root
    assert len(library) == 1 and "* plotly.js v" in (folder / library[0]).read_text(encoding="utf-8")[:200]
    assert html.count("Plotly.newPlot(") == n_figures

    doc = runner.load_results(folder, name)
    assert doc["notebook"] == name and doc["device"]["slug"] == folder.name
    CHECKS[name](doc)


# --------------------------------------------------------------------------- JupyterLab's view: no injected parameters


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_its_own_defaults(tmp_path, path, monkeypatch):
    """What a person gets from "Run All" in JupyterLab: the defaults, nothing injected, real numbers.

    The notebook detects this machine itself (smoke sizes and the Triton interpreter without a GPU).
    Headless (``FP8KV_HEADLESS=1``): no widget is displayed, so no cell waits for a frontend.
    """
    from nbclient import NotebookClient

    from fp8kv.ui import HEADLESS_ENV

    monkeypatch.setenv(HEADLESS_ENV, "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    interpret = os.environ.get("TRITON_INTERPRET")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernel inherits none: the notebook sets it
    nb = nbformat.read(path, as_version=4)
    cell_timeout = 300
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()
    took = time.perf_counter() - t0
    if interpret is not None:  # the checks below ask fp8kv.capability about this process, as it was
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert took < cell_timeout, f"{path.stem} took {took:.0f} s: a cell waited for its timeout"
    said = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("output_type") == "stream")
    if not torch.cuda.is_available():
        assert "smoke sizes" in said and "TRITON_INTERPRET=1" in said, said[:500]
    doc = runner.load_results(tmp_path / "results", path.stem)
    CHECKS[path.stem](doc)


# --------------------------------------------------------------------------- runner life cycle, synthetic notebooks


SAVE = ('from fp8kv.notebooks import save_results\n'
        'save_results(OUT_DIR, "{name}", {{"smoke": SMOKE, "seed": SEED, "widgets": SHOW_WIDGETS, '
        '"device": DEVICE, "cwd": __import__("os").getcwd()}}, device=DEVICE)')


def test_failures_are_reported_kept_and_do_not_stop_the_run(tmp_path, capsys, write_notebook):
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "a_ok", SAVE.format(name="a_ok"))
    write_notebook(books, "b_raises", 'raise RuntimeError("deliberate failure 1234")')
    write_notebook(books, "c_no_json", "x = 1")
    out = tmp_path / "reports"
    rc = runner.main(["--notebooks", str(books), "--out", str(out), "--device", "cpu", "--seed", "7",
                      "--no-progress"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED: b_raises, c_no_json" in err

    folder = out / "cpu"
    manifest = json.loads((folder / "manifest.json").read_text())
    by_name = {e["name"]: e for e in manifest["notebooks"]}
    assert manifest["ok"] is False and manifest["failed"] == ["b_raises", "c_no_json"]
    assert by_name["a_ok"]["status"] == "ok" and by_name["a_ok"]["results"] == "a_ok.json"
    assert "deliberate failure 1234" in by_name["b_raises"]["error"]
    assert "did not write c_no_json.json" in by_name["c_no_json"]["error"]
    # The failing notebook is kept, executed and rendered, for inspection.
    assert "deliberate failure 1234" in (folder / "b_raises.html").read_text(encoding="utf-8")
    assert (folder / "b_raises.ipynb").is_file()

    doc = runner.load_results(folder, "a_ok")["results"]
    assert doc["smoke"] is True and doc["seed"] == 7 and doc["widgets"] is False and doc["device"] == "cpu"
    assert Path(doc["cwd"]).resolve() == books.resolve()  # kernels start in the notebook's folder

    # --only reruns one notebook and carries the others over from the previous report.
    (books / "b_raises.ipynb").unlink()
    write_notebook(books, "b_raises", SAVE.format(name="b_raises"))
    rc = runner.main(["--notebooks", str(books), "--out", str(out), "--device", "cpu", "--only", "b",
                      "--no-progress"])
    assert rc == 0  # what ran now succeeded; carried-over failures do not fail this run
    manifest = json.loads((folder / "manifest.json").read_text())
    by_name = {e["name"]: e for e in manifest["notebooks"]}
    assert manifest["ran"] == ["b_raises"]
    assert by_name["b_raises"]["status"] == "ok"
    assert by_name["c_no_json"]["status"] == "failed" and by_name["a_ok"]["status"] == "ok"
    assert manifest["failed"] == ["c_no_json"]
    assert (folder / "a_ok.json").is_file() and (folder / "a_ok.html").is_file()
    assert (folder / "b_raises.json").is_file()


GRID_SAVE = ('from fp8kv.notebooks import save_results\n'
             'save_results(OUT_DIR, "{name}", {{"grid": GRID, "label": LABEL}}, device=DEVICE)')


def test_parameters_override_a_notebooks_own_and_are_recorded(tmp_path, capsys, write_notebook):
    """--param NAME=VALUE reaches the notebook (a Python literal), and the manifest and the page say so."""
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "a_grid", GRID_SAVE.format(name="a_grid"), params='GRID = [1, 4, 16]\nLABEL = "full"')
    out = tmp_path / "reports"
    rc = runner.main(["--notebooks", str(books), "--out", str(out), "--device", "cpu", "--no-progress", "--full",
                      "--param", "GRID=[1, 16]", "--param", "LABEL='trimmed'"])
    assert rc == 0
    folder = out / "cpu"
    assert runner.load_results(folder, "a_grid")["results"] == {"grid": [1, 16], "label": "trimmed"}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["parameters"] == {"GRID": [1, 16], "LABEL": "trimmed"}
    assert manifest["notebooks"][0]["parameters"] == {"GRID": [1, 16], "LABEL": "trimmed"}
    injected = [c for c in nbformat.read(folder / "a_grid.ipynb", as_version=4).cells
                if "injected-parameters" in c.metadata.get("tags", [])]
    assert "GRID = [1, 16]" in injected[0].source and 'LABEL = "trimmed"' in injected[0].source  # the page shows it
    rc = runner.main(["--notebooks", str(books), "--out", str(out), "--device", "cpu", "--no-progress", "--full"])
    assert rc == 0 and runner.load_results(folder, "a_grid")["results"]["grid"] == [1, 4, 16]
    assert json.loads((folder / "manifest.json").read_text())["parameters"] == {}


@pytest.mark.parametrize("argv, match", [
    (["--param", "GRID"], "--param 'GRID': expected NAME=VALUE"),
    (["--param", "1X=2"], "--param '1X=2': expected NAME=VALUE"),
    (["--param", "GRID=[1, 2"], "is not a Python literal"),
    (["--param", "GRID=range(3)"], "is not a Python literal"),
    (["--param", "GRID=[1]", "--param", "GRID=[2]"], r"--param names \['GRID'\] more than once"),
    (["--param", "SEED=3"], r"parameters \['SEED'\] are set by the runner itself"),
    (["--param", "GRIDS=[1]"], r"parameters \['GRIDS'\] are not declared by a_grid; its parameters are \['GRID'\]"),
    (["--param", "GRID=(16, 4)"], r"parameter GRID=\(16, 4\); expected None, a bool, .* write \[16, 4\] for"),
    (["--param", "GRID=[(16, 4)]"], r"parameter GRID=\[\(16, 4\)\]; expected"),
    (["--param", "GRID={1, 2}"], r"parameter GRID=\{1, 2\}; expected"),
    (["--param", "GRID=1e999"], r"parameter GRID=inf; expected None, a bool, finite number"),  # not "inf" recorded
    (["--param", "GRID='1, 16'"], r"parameter GRID='1, 16' \(str\); a_grid declares GRID = \[1, 4, 16\], so "
                                  r"expected list"),
    (["--param", "GRID=" + "9" * 5000], r"^fp8kv notebooks run: error: argument --param: --param GRID='9+\.\.\. is "
                                        r"not a Python literal .{0,200}$"),  # one short line, not the value twice
    (["--smoke", "--param", "GRID=[1]"], r"given to a smoke run; .* go with a full-size run \(--full\)"),
    (["--device", "cpu", "--param", "GRID=[1]"], r"given to a smoke run"),  # smoke by default on a CPU
])
def test_bad_parameter_overrides_are_refused_by_name(tmp_path, capsys, write_notebook, argv, match):
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "a_grid", "pass", params="GRID = [1, 4, 16]")
    out = tmp_path / "reports"
    full = [] if "--smoke" in argv or "--device" in argv else ["--full", "--device", "cpu"]
    with pytest.raises(SystemExit) as exc:
        runner.main(["--notebooks", str(books), "--out", str(out), "--no-progress", *full, *argv])
    assert exc.value.code == 2 and re.search(match, capsys.readouterr().err)
    assert not out.exists()


def test_parameters_through_the_api_are_checked_as_through_the_cli(tmp_path, write_notebook):
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "a_grid", "pass", params="GRID = [1, 4, 16]")
    with pytest.raises(TypeError, match=r"parameter GRID=\(1, 2\)"):
        runner.run_notebooks(books, tmp_path / "reports", smoke=False, device="cpu", parameters={"GRID": (1, 2)})
    with pytest.raises(ValueError, match="given to a smoke run"):
        runner.run_notebooks(books, tmp_path / "reports", device="cpu", parameters={"GRID": [1]})
    assert not (tmp_path / "reports").exists()


def test_an_override_takes_a_kind_its_default_takes(tmp_path, write_notebook):
    """A parameter's override is checked against its declared default before anything runs: a list of names for
    a string ("all"), an int for a float, a list for a tuple; not a float or a bool for an int."""
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "a_kinds", "pass", params='MODELS = "all"\nN = 4\nRATE = 0.5\nHEADS = (32, 8)\nANY = None')
    ok = {"MODELS": ["m"], "N": 2, "RATE": 1, "HEADS": [4, 2], "ANY": "x"}
    assert check_parameters([books / "a_kinds.ipynb"], ok) == ok
    assert check_parameters([books / "a_kinds.ipynb"], {"N": None}) == {"N": None}  # "None: skip / detect"
    for bad, match in (({"N": 4.0}, r"N=4.0 \(float\); a_kinds declares N = 4, so expected int"),
                       ({"N": True}, r"N=True \(bool\); .* expected int"),
                       ({"RATE": "0.5"}, r"RATE='0.5' \(str\); .* expected int or float"),
                       ({"HEADS": 32}, r"HEADS=32 \(int\); a_kinds declares HEADS = \(32, 8\), so expected list")):
        with pytest.raises(TypeError, match=match):
            check_parameters([books / "a_kinds.ipynb"], bad)


def test_the_notebooks_take_the_none_overrides_their_parameters_document():
    """Each real notebook's parameter whose comment offers None (skip real activations, time the draft, ...) takes
    it as an override."""
    import papermill as pm

    offered = 0
    for book in NOTEBOOKS:
        for name, p in pm.inspect_notebook(str(book)).items():
            if "None" in (p.get("help") or "") and name not in runner.PARAMETER_NAMES:
                assert check_parameters([book], {name: None}) == {name: None}
                offered += 1
    assert offered >= 5  # 02's REAL_MODEL and 08's DRAFT_US among them


def test_cell_timeout_fails_the_notebook(tmp_path, write_notebook):
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "slow", "import time\ntime.sleep(120)")  # no imports: only the sleep is slow
    manifest = runner.run_notebooks(books, tmp_path / "reports", device="cpu", timeout=2, progress=False)
    entry = manifest["notebooks"][0]
    assert entry["status"] == "failed" and "timed out" in entry["error"].lower()
    assert entry["duration_s"] < 60
    assert (tmp_path / "reports" / "cpu" / "slow.html").is_file()


def _fake_run_one(book, staging, params, timeout_s, progress, kernel_name, published_out_dir=None):
    """Stands in for executing a notebook: writes the files a real run writes."""
    name = book.stem
    for ext in ("ipynb", "html"):
        (staging / f"{name}.{ext}").write_text(f"{name} {ext}")
    (staging / f"{name}.json").write_text(json.dumps({"results": {"seed": params["SEED"]}}))
    return {"name": name, "status": "ok", "error": None, "mode": "smoke", "duration_s": 0.0,
            "ipynb": f"{name}.ipynb", "html": f"{name}.html", "results": f"{name}.json"}


@pytest.fixture
def books(tmp_path, write_notebook):
    folder = tmp_path / "books"
    folder.mkdir()
    for name in ("00_first", "01_second"):
        write_notebook(folder, name, "pass")
    return folder


def test_rerun_replaces_own_folder_and_leaves_other_gpus_alone(tmp_path, books, monkeypatch):
    monkeypatch.setattr(nb_runner, "_run_one", _fake_run_one)
    out = tmp_path / "reports"
    other = out / "nvidia-h200"
    other.mkdir(parents=True)
    (other / "manifest.json").write_text('{"gpu_slug": "nvidia-h200", "notebooks": []}')
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.iterdir()}
    stale = out / "cpu" / "stale.html"
    stale.parent.mkdir()
    stale.write_text("from an older run")

    first = runner.run_notebooks(books, out, smoke=True, device="cpu", seed=1, progress=False)
    second = runner.run_notebooks(books, out, smoke=True, device="cpu", seed=2, progress=False)

    folder = out / "cpu"
    assert not stale.exists(), "a rerun replaces the whole folder"
    assert json.loads((folder / "00_first.json").read_text())["results"]["seed"] == 2
    assert json.loads((folder / "manifest.json").read_text())["seed"] == 2
    assert first["ok"] and second["ok"] and second["report_dir"] == folder.name  # relative to the reports root
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in other.iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["cpu", "index.html", "nvidia-h200"]  # no staging or old folders


def _interrupt_at(n, calls):
    """A _run_one that half-writes the n-th notebook, then is interrupted (as by Ctrl-C)."""
    def run_one(book, staging, *args, **kwargs):
        calls.append(book.stem)
        if len(calls) == n:
            (staging / f"{book.stem}.ipynb").write_text("half written")
            (staging / f"{book.stem}_fig.png").write_text("half written")
            raise KeyboardInterrupt
        return _fake_run_one(book, staging, *args, **kwargs)
    return run_one


def test_interrupted_run_publishes_what_finished_and_keeps_the_rest(tmp_path, books, monkeypatch):
    """An interrupted run loses nothing: the notebook that ran to the end is published, the one
    stopped keeps its previous page, and the manifest says what happened."""
    monkeypatch.setattr(nb_runner, "_run_one", _fake_run_one)
    out = tmp_path / "reports"
    runner.run_notebooks(books, out, smoke=True, device="cpu", seed=1, progress=False)
    previous_second = {p.name: p.read_bytes() for p in (out / "cpu").glob("01_second.*")}

    monkeypatch.setattr(nb_runner, "_run_one", _interrupt_at(2, []))
    with pytest.raises(KeyboardInterrupt):
        runner.run_notebooks(books, out, smoke=True, device="cpu", seed=9, progress=False)
    folder = out / "cpu"
    assert json.loads((folder / "00_first.json").read_text())["results"]["seed"] == 9
    assert {p.name: p.read_bytes() for p in folder.glob("01_second.*")} == previous_second
    assert not list(folder.glob("01_second_*"))  # the stopped notebook's other files went too
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["interrupted"] == "KeyboardInterrupt during 01_second" and manifest["ran"] == ["00_first"]
    assert [e["name"] for e in manifest["notebooks"]] == ["00_first", "01_second"] and manifest["ok"]
    assert sorted(p.name for p in out.iterdir()) == ["cpu", "index.html"]  # no staging folder left


def _write_books(folder, names, write_notebook):
    folder.mkdir(exist_ok=True)
    for name in names:
        write_notebook(folder, name, "pass")


def test_carry_over_takes_only_a_notebooks_own_files(tmp_path):
    """Notebooks whose names are prefixes of each other: each keeps exactly its own files."""
    previous, staging = tmp_path / "gpu", tmp_path / "staging"
    previous.mkdir()
    staging.mkdir()
    names = ("04_decode", "04_decode_latency")
    (previous / "manifest.json").write_text(json.dumps({"notebooks": [{"name": n} for n in names]}))
    for n in names:
        for ext in ("json", "html", "ipynb"):
            (previous / f"{n}.{ext}").write_text(f"OLD {n}")
    (previous / "04_decode_files").mkdir()  # nbconvert's assets folder of a page
    (previous / "04_decode_files" / "a.png").write_text("asset")
    (staging / "04_decode_latency.json").write_text("NEW")  # finished in this run

    kept = nb_runner._carry_over(previous, staging, {"04_decode_latency"})
    assert [e["name"] for e in kept] == ["04_decode"]
    assert (staging / "04_decode_latency.json").read_text() == "NEW"  # not the old run's over it
    assert sorted(p.name for p in staging.iterdir()) == ["04_decode.html", "04_decode.ipynb", "04_decode.json",
                                                         "04_decode_files", "04_decode_latency.json"]
    assert (staging / "04_decode_files" / "a.png").read_text() == "asset"

    staging2 = tmp_path / "staging2"
    staging2.mkdir()
    nb_runner._carry_over(previous, staging2, {"04_decode"})  # the other way round
    assert sorted(p.name for p in staging2.iterdir()) == [f"04_decode_latency.{e}" for e in ("html", "ipynb", "json")]


def test_interrupted_run_never_puts_an_old_result_over_a_new_one(tmp_path, write_notebook, monkeypatch):
    """The previous report holds 04_decode (since renamed away) beside 04_decode_latency: an
    interrupted run publishes 04_decode_latency's fresh results, not the previous report's."""
    books, out = tmp_path / "books", tmp_path / "reports"
    _write_books(books, ("04_decode", "04_decode_latency", "05_next"), write_notebook)
    monkeypatch.setattr(nb_runner, "_run_one", _fake_run_one)
    runner.run_notebooks(books, out, smoke=True, device="cpu", seed=1, progress=False)
    (books / "04_decode.ipynb").unlink()

    monkeypatch.setattr(nb_runner, "_run_one", _interrupt_at(2, []))  # in 05_next, after 04_decode_latency
    with pytest.raises(KeyboardInterrupt):
        runner.run_notebooks(books, out, smoke=True, device="cpu", seed=9, progress=False)
    folder = out / "cpu"
    assert json.loads((folder / "04_decode_latency.json").read_text())["results"]["seed"] == 9
    assert json.loads((folder / "04_decode.json").read_text())["results"]["seed"] == 1  # kept, as it was
    assert json.loads((folder / "05_next.json").read_text())["results"]["seed"] == 1  # its previous page
    assert not (folder / "05_next_fig.png").exists()  # the stopped notebook's half-written file went
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["ran"] == ["04_decode_latency"]
    assert [e["name"] for e in manifest["notebooks"]] == ["04_decode", "04_decode_latency", "05_next"]


def test_interrupted_notebook_takes_no_file_of_a_longer_named_one(tmp_path, write_notebook, monkeypatch):
    """Stopped in 04_decode (--only): its half-written files go, 04_decode_latency's (carried over) stay."""
    books, out = tmp_path / "books", tmp_path / "reports"
    _write_books(books, ("03_first", "04_decode", "04_decode_latency"), write_notebook)
    monkeypatch.setattr(nb_runner, "_run_one", _fake_run_one)
    runner.run_notebooks(books, out, smoke=True, device="cpu", seed=1, progress=False)
    before = {p.name: p.read_bytes() for p in (out / "cpu").iterdir() if p.name.startswith("04_decode")}

    monkeypatch.setattr(nb_runner, "_run_one", _interrupt_at(2, []))
    with pytest.raises(KeyboardInterrupt):
        runner.run_notebooks(books, out, smoke=True, device="cpu", seed=9, only=["03", "04_decode"], progress=False)
    folder = out / "cpu"
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith("04_decode")} == before
    assert json.loads((folder / "03_first.json").read_text())["results"]["seed"] == 9
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [e["name"] for e in manifest["notebooks"]] == ["03_first", "04_decode", "04_decode_latency"]


def test_a_stale_results_file_never_stands_for_a_notebook_that_wrote_none(tmp_path, write_notebook, monkeypatch):
    """Whatever is in the staging folder under a notebook's name before it runs is not its result."""
    import papermill

    books, staging = tmp_path / "books", tmp_path / "staging"
    _write_books(books, ("04_decode_latency",), write_notebook)
    staging.mkdir()
    (staging / "04_decode_latency.json").write_text(json.dumps({"results": {"run": "OLD"}}))

    def execute_without_saving(src, dst, **kwargs):  # the notebook runs, and writes no results
        Path(dst).write_bytes(Path(src).read_bytes())

    monkeypatch.setattr(papermill, "execute_notebook", execute_without_saving)
    entry = nb_runner._run_one(books / "04_decode_latency.ipynb", staging,
                               {"SMOKE": True, "OUT_DIR": str(staging)}, 60, False, "python3")
    assert entry["status"] == "failed" and "did not write 04_decode_latency.json" in entry["error"]
    assert entry["results"] is None and not (staging / "04_decode_latency.json").exists()


def test_each_entry_records_the_fp8kv_code_its_page_was_rendered_with(tmp_path, write_notebook, monkeypatch):
    """The manifest entry holds the digest of the fp8kv code the kernel imports (the package the runner puts on its
    path), read as the notebook starts: the index compares it with today's code, page by page."""
    import papermill

    from fp8kv.device import source_digest
    from fp8kv.notebooks.pages import PACKAGE_PARENT

    books, staging = tmp_path / "books", tmp_path / "staging"
    _write_books(books, ("01_a",), write_notebook)
    staging.mkdir()
    monkeypatch.setattr(papermill, "execute_notebook", lambda src, dst, **kw: Path(dst).write_bytes(Path(src).read_bytes()))
    entry = nb_runner._run_one(books / "01_a.ipynb", staging, {"SMOKE": True, "OUT_DIR": str(staging)}, 60, False,
                               "python3")
    assert entry["fp8kv_source"] == source_digest(PACKAGE_PARENT / "fp8kv") == source_digest()
    assert list(entry).index("fp8kv_source") == list(entry).index("source_sha256") + 1


def test_kernels_import_fp8kv_from_the_folder_put_on_their_path(tmp_path, monkeypatch):
    """PYTHONPATH gets the folder that holds the fp8kv package: ``import fp8kv`` works from it alone,
    and fp8kv's own modules (checks.py...) are not importable as top-level names."""
    import subprocess

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    with nb_runner._kernel_environment(interpret=False):
        path = os.environ["PYTHONPATH"]
        assert os.environ["TQDM_DISABLE"] == os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # no bars drawn
    assert "PYTHONPATH" not in os.environ and "TQDM_DISABLE" not in os.environ  # restored
    assert Path(path) == REPO and (Path(path) / "fp8kv" / "__init__.py").is_file()
    probe = "import importlib.util as u; print(u.find_spec('fp8kv').origin, u.find_spec('checks'))"
    r = subprocess.run([sys.executable, "-S", "-c", probe], env={**os.environ, "PYTHONPATH": path},
                       capture_output=True, text=True, timeout=60)  # -S: no site-packages, only PYTHONPATH
    assert r.stdout.split() == [str(REPO / "fp8kv" / "__init__.py"), "None"], r.stderr


def test_default_notebook_dir_from_another_working_directory(tmp_path, monkeypatch):
    from fp8kv.notebooks.pages import default_notebook_dir

    monkeypatch.chdir(tmp_path)  # no ./notebooks here: the repository's notebooks/ folder
    assert default_notebook_dir() == NOTEBOOK_DIR
    assert runner.discover_notebooks() == NOTEBOOKS and NOTEBOOKS


def test_interrupted_before_any_notebook_finished_keeps_previous_report(tmp_path, books, monkeypatch):
    monkeypatch.setattr(nb_runner, "_run_one", _fake_run_one)
    out = tmp_path / "reports"
    runner.run_notebooks(books, out, smoke=True, device="cpu", seed=1, progress=False)
    snapshot = {p.name: p.read_bytes() for p in (out / "cpu").iterdir()}
    monkeypatch.setattr(nb_runner, "_run_one", _interrupt_at(1, []))
    with pytest.raises(KeyboardInterrupt):
        runner.run_notebooks(books, out, smoke=True, device="cpu", seed=9, progress=False)
    assert {p.name: p.read_bytes() for p in (out / "cpu").iterdir()} == snapshot
    assert sorted(p.name for p in out.iterdir()) == ["cpu", "index.html"]  # staging removed


def test_swap_restores_old_folder_if_the_rename_fails(tmp_path, monkeypatch):
    final, staging = tmp_path / "cpu", tmp_path / ".cpu.staging"
    final.mkdir()
    (final / "old.txt").write_text("old")
    staging.mkdir()
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("disk trouble")
        return real(src, dst)

    monkeypatch.setattr(nb_runner.os, "replace", flaky)
    with pytest.raises(OSError, match="disk trouble"):
        nb_runner._swap_into_place(staging, final)
    assert (final / "old.txt").read_text() == "old"


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"timeout": 0}, ValueError, "timeout=0; expected an int >= 1"),
    ({"timeout": 2.5}, TypeError, r"timeout=2.5 \(float\); expected an int"),
    ({"seed": "x"}, TypeError, r"seed='x' \(str\); expected an int"),
    ({"device": "tpu"}, ValueError, "tpu"),
    ({"only": ["99"]}, ValueError, "matches no notebook"),
])
def test_run_notebooks_rejects_bad_arguments(tmp_path, books, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        runner.run_notebooks(books, tmp_path / "reports", **kwargs)
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").iterdir())


# --------------------------------------------------------------------------- helpers and command line


def test_discover_notebooks_matching(books):
    assert [p.stem for p in runner.discover_notebooks(books)] == ["00_first", "01_second"]
    for key in ("01", "01_second", "01_second.ipynb"):
        assert [p.stem for p in runner.discover_notebooks(books, [key])] == ["01_second"]
    assert [p.stem for p in runner.discover_notebooks(books, ["01", "00"])] == ["00_first", "01_second"]
    with pytest.raises(ValueError, match="not a folder"):
        runner.discover_notebooks(books / "missing")


def test_save_and_load_results_round_trip(tmp_path):
    import numpy as np
    import pandas as pd
    import torch

    results = {"a": np.float32(1.5), "b": torch.tensor([1.0, float("inf")]), "c": pd.DataFrame({"x": [1, 2]}),
               "d": (1, float("nan")), "e": torch.float8_e4m3fn, "f": np.arange(3), 7: "int key"}
    path = runner.save_results(tmp_path / "new", "02_demo", results, device="cpu")
    assert path == tmp_path / "new" / "02_demo.json"
    doc = runner.load_results(tmp_path / "new", "02_demo")
    assert doc["notebook"] == "02_demo" and doc["device"]["type"] == "cpu"
    assert doc["results"] == {"a": 1.5, "b": [1.0, "inf"], "c": [{"x": 1}, {"x": 2}], "d": [1, "nan"],
                              "e": "torch.float8_e4m3fn", "f": [0, 1, 2], "7": "int key"}
    with pytest.raises(ValueError, match="name"):
        runner.save_results(tmp_path, "../escape", {})
    with pytest.raises(TypeError, match="dict"):
        runner.save_results(tmp_path, "ok", [1])
    with pytest.raises(FileNotFoundError, match="03_missing"):
        runner.load_results(tmp_path, "03_missing")


def test_collect_results_across_gpus(tmp_path):
    for slug in ("cpu", "nvidia-h200"):
        path = runner.save_results(tmp_path / slug, "00_x", {"slug": slug}, device="cpu")
        doc = json.loads(path.read_text())
        doc["device"]["slug"] = slug  # as that GPU's own run records it
        path.write_text(json.dumps(doc))
    (tmp_path / "nvidia-a100").mkdir()  # a GPU without that notebook
    found = runner.collect_results("00_x", tmp_path)
    assert sorted(found) == ["cpu", "nvidia-h200"]
    assert found["nvidia-h200"]["results"]["slug"] == "nvidia-h200"
    # a file copied into another GPU's folder is named, not shown as that GPU's
    (tmp_path / "nvidia-a100" / "00_x.json").write_text((tmp_path / "cpu" / "00_x.json").read_text())
    with pytest.raises(ValueError, match=r"nvidia-a100.*00_x\.json.*'cpu'"):
        runner.collect_results("00_x", tmp_path)


def test_cli_bench_forwards_arguments(monkeypatch):
    seen = []
    fake = types.ModuleType("fp8kv.bench")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "fp8kv.bench", fake)
    assert cli.main(["bench", "--help", "--kv", "fp8_e4m3"]) == 3
    assert seen == [["--help", "--kv", "fp8_e4m3"]]


def test_cli_bench_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fp8kv.bench", None)  # makes the import fail as not found
    assert cli.main(["bench"]) == 2
    assert "fp8kv.bench is not available" in capsys.readouterr().err


def test_cli_notebooks_list(books, capsys):
    assert cli.main(["notebooks", "list", "--notebooks", str(books)]) == 0
    assert capsys.readouterr().out.split() == ["00_first", "01_second"]


def test_cli_requires_a_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["notebooks", "run", "--smoke", "--full"])


def test_externalize_plotlyjs_writes_one_library_and_carry_over_keeps_it(tmp_path):
    import shutil

    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    previous, staging = tmp_path / "gpu", tmp_path / "staging"
    previous.mkdir()
    staging.mkdir()
    page = "<html><body><script>{}</script><div>Plotly.newPlot(1)</div></body></html>"
    for name in ("a_nb", "b_nb"):
        (previous / f"{name}.html").write_text(page.format(get_plotlyjs()), encoding="utf-8")
    library = f"plotly-{get_plotlyjs_version()}.min.js"
    src = f"../{library}"  # one copy in the reports root, above every GPU's folder
    assert runner.externalize_plotlyjs(previous / "a_nb.html") == src
    assert runner.externalize_plotlyjs(previous / "a_nb.html") == src  # idempotent
    assert runner.externalize_plotlyjs(previous / "b_nb.html") == src
    assert (tmp_path / library).read_text(encoding="utf-8") == get_plotlyjs() and not (previous / library).exists()
    html = (previous / "a_nb.html").read_text(encoding="utf-8")
    assert len(html) < 1000 and f'<script src="{src}"' in html and "Plotly.newPlot(1)" in html
    no_figures = tmp_path / "plain.html"
    no_figures.write_text("<html></html>", encoding="utf-8")
    assert runner.externalize_plotlyjs(no_figures) is None and no_figures.read_text() == "<html></html>"

    (previous / "manifest.json").write_text(json.dumps({"notebooks": [{"name": "a_nb"}, {"name": "b_nb"}]}))
    kept = nb_runner._carry_over(previous, staging, rerun={"b_nb"})
    assert [e["name"] for e in kept] == ["a_nb"]
    assert sorted(p.name for p in staging.iterdir()) == ["a_nb.html"]  # its library is the root's, beside staging
    # a page written when the library lay beside it takes its copy along
    (previous / "a_nb.html").write_text(html.replace(src, library), encoding="utf-8")
    (previous / library).write_text("the old copy", encoding="utf-8")
    shutil.rmtree(staging)
    staging.mkdir()
    nb_runner._carry_over(previous, staging, rerun={"b_nb"})
    assert sorted(p.name for p in staging.iterdir()) == ["a_nb.html", library]


def test_pages_find_templates_installed_beside_nbconvert(tmp_path, monkeypatch):
    """``pip install --target DIR`` puts nbconvert's templates in DIR/share/jupyter/nbconvert/templates,
    where nbconvert does not look: the export passes that folder on, and only when it exists."""
    import nbconvert

    from fp8kv.notebooks import pages

    site = tmp_path / "site"
    (site / "nbconvert").mkdir(parents=True)
    monkeypatch.setattr(nbconvert, "__file__", str(site / "nbconvert" / "__init__.py"))
    assert pages.template_dirs() == []
    templates = site / "share" / "jupyter" / "nbconvert" / "templates"
    templates.mkdir(parents=True)
    assert pages.template_dirs() == [str(templates)]

    seen = {}

    class Exporter:
        def __init__(self, **kwargs):
            seen.update(kwargs)

        def from_filename(self, path):
            return "<html></html>", {}

    monkeypatch.setattr(nbconvert, "HTMLExporter", Exporter)
    pages.render_html(tmp_path / "x.ipynb", tmp_path / "x.html")
    assert seen == {"extra_template_basedirs": [str(templates)], "extra_template_paths": [str(templates)]}


def test_pages_render_with_templates_only_beside_nbconvert(tmp_path, monkeypatch):
    """The real exporter, with nbconvert's templates found nowhere but beside the package (as on a
    machine where it was installed with ``pip install --target``): the lab template and the base
    templates it extends both load, and the page is written."""
    import shutil

    import nbconvert
    import nbformat
    from nbconvert.exporters.templateexporter import TemplateExporter

    from fp8kv.notebooks import pages

    installed = [Path(d) / "nbconvert" / "templates" for d in TemplateExporter().get_prefix_root_dirs()]
    source = next(d for d in installed if (d / "lab").is_dir() and (d / "base").is_dir())
    site = tmp_path / "site"
    (site / "nbconvert").mkdir(parents=True)
    shutil.copytree(source, site / "share" / "jupyter" / "nbconvert" / "templates")
    monkeypatch.setattr(nbconvert, "__file__", str(site / "nbconvert" / "__init__.py"))

    class Bare(nbconvert.HTMLExporter):  # no Jupyter path and no data path holds templates
        def __init__(self, **kwargs):
            super().__init__(template_data_paths=[], **kwargs)

        def get_prefix_root_dirs(self):
            return []

    monkeypatch.setattr(nbconvert, "HTMLExporter", Bare)

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# fp8kv page")])
    nbformat.write(nb, tmp_path / "x.ipynb")
    page = pages.render_html(tmp_path / "x.ipynb", tmp_path / "x.html").read_text()
    assert "fp8kv page" in page


# --------------------------------------------------------------------------- names that collide


@pytest.mark.parametrize("name", ["manifest", "Manifest", "MANIFEST"])
def test_a_notebook_whose_results_would_be_the_manifest_is_refused_by_name(tmp_path, write_notebook, monkeypatch,
                                                                          capsys, name):
    """manifest.ipynb's results (manifest.json) were overwritten by the report's manifest, which still said ok."""
    books, out = tmp_path / "books", tmp_path / "reports"
    _write_books(books, ("00_first", name), write_notebook)
    monkeypatch.setattr(nb_runner, "_run_one", _fake_run_one)
    for only in (None, [name]):
        with pytest.raises(ValueError, match=rf"notebook {books / name}\.ipynb cannot be run: its file {name}\.json "
                                             r"would be the runner's own manifest\.json"):
            runner.run_notebooks(books, out, smoke=True, device="cpu", only=only, progress=False)
    assert not out.exists()
    for argv in (["list", "--notebooks", str(books)], ["run", "--notebooks", str(books), "--out", str(out)]):
        with pytest.raises(SystemExit) as exc:
            runner.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and f"{name}.json would be the runner's own" in err, err
    # a run that leaves it out is a run like any other
    assert runner.run_notebooks(books, out, smoke=True, device="cpu", only=["00_first"], progress=False)["ok"]


@pytest.mark.parametrize("argv, words", [(["list"], "no notebooks found in"), (["run"], "no notebooks found in"),
                                         (["run", "--seed", "-1"], "--seed=-1; expected an int >= 0")])
def test_list_and_run_refuse_alike_before_the_banner(tmp_path, capsys, argv, words, books):
    """list printed nothing and exited 0 over an empty folder, where run refused; run refused --seed -1 only
    after its banner."""
    folder = str(books) if "--seed" in argv else str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exc:
        runner.main([*argv, "--notebooks", folder, *(["--out", str(tmp_path / "out")] if argv[0] == "run" else [])])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "" and captured.err.count("\n") == 1 and words in captured.err


def test_notebooks_differing_only_in_case_are_refused_by_name(tmp_path, write_notebook):
    books = tmp_path / "books"
    _write_books(books, ("01_Step", "01_step"), write_notebook)
    with pytest.raises(ValueError, match=r"01_Step\.ipynb and .*01_step\.ipynb differ only in case"):
        runner.discover_notebooks(books)


@pytest.mark.parametrize("name, filename, own", [
    ("04_decode", "04_decode.ipynb", True), ("04_decode", "04_decode.html", True),
    ("04_decode", "04_decode.json", True), ("04_decode", "04_decode_files", True),
    ("04_decode", "04_decode_latency.json", False), ("04_decode", "04_decode.csv", False),
    # the pages' library is the runner's, whatever a notebook is called: a rerun of this one deleted it
    ("plotly-2.35.2.min", "plotly-2.35.2.min.js", False), ("manifest", "manifest.json", True),
])
def test_a_notebook_owns_exactly_its_own_files(name, filename, own):
    from fp8kv.notebooks.pages import owns, runner_file

    assert owns(name, filename) is own
    assert runner_file(filename) is (filename in ("manifest.json", "plotly-2.35.2.min.js"))


def test_a_rerun_of_a_notebook_named_like_the_library_keeps_the_library(tmp_path, write_notebook, monkeypatch):
    """Its stale files are deleted before it runs: never the pages' plotly.js."""
    import papermill

    books, staging = tmp_path / "books", tmp_path / "staging"
    _write_books(books, ("plotly-2.35.2.min",), write_notebook)
    staging.mkdir()
    (staging / "plotly-2.35.2.min.js").write_text("the library")
    monkeypatch.setattr(papermill, "execute_notebook", lambda src, dst, **kw: Path(dst).write_bytes(Path(src).read_bytes()))
    nb_runner._run_one(books / "plotly-2.35.2.min.ipynb", staging, {"SMOKE": True, "OUT_DIR": str(staging)}, 60,
                       False, "python3")
    assert (staging / "plotly-2.35.2.min.js").read_text() == "the library"


def test_only_repeated_keeps_every_name():
    import argparse

    from fp8kv.notebooks.cli import add_run_arguments

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert parser.parse_args(["--only", "01", "--only", "02", "03"]).only == ["01", "02", "03"]
    assert parser.parse_args([]).only is None
