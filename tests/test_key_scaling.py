"""Large keys with the same function (fp8kv.models.outliers.scale_keys), layers kept 16-bit in a simulated cache
(KVQuantConfig.bf16_layers), and what the keep-16-bit advice buys in next-token KL (fp8kv.analysis.advice_kl)."""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest
import torch

from fp8kv.analysis import advice_kl, advice_kl_text, keep_bf16_advice, model_scale_health, stress_sentence
from fp8kv.models import KVQuantConfig, capture_kv, evaluate
from fp8kv.models.kv_config import quantize_kv, round_through
from fp8kv.models.outliers import scale_keys

pytest.importorskip("transformers", reason="needs the 'models' extra: pip install -e '.[models]'")
VOCAB = 64


def _tiny(kind: str = "llama"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config, model = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, head_dim=8)
    cfg._attn_implementation = "sdpa"
    return model(cfg).eval()


def test_scaled_keys_leave_the_model_unchanged_and_the_keys_larger():
    """Gain 1000 on layer 1: the logits agree to fp32 rounding (q·k is unchanged), layer 1's captured keys are
    1000x larger and the other layers' keys are unchanged (layer 0's bit for bit)."""
    ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1))
    model = _tiny()
    with torch.no_grad():
        before = model(input_ids=ids[None]).logits
    k0 = capture_kv(model, ids).k
    assert scale_keys(model, 1000.0, [1]) == [1]
    with torch.no_grad():
        after = model(input_ids=ids[None]).logits
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    k1 = capture_kv(model, ids).k
    # fp32 rounding of the projection and RoPE's sums, relative to the layer's largest key (RoPE's cancellations
    # leave a near-zero element with no relative bound of its own; seen: 280 ulp on one element of 320)
    torch.testing.assert_close(k1[1] / 1000.0, k0[1], rtol=1e-5, atol=1e-6 * float(k0[1].abs().max()))
    assert torch.equal(k1[0], k0[0])  # before the scaled layer: bit for bit
    torch.testing.assert_close(k1[2], k0[2], rtol=1e-4, atol=1e-5)  # after it: the rounding of q·k apart


@pytest.mark.parametrize("gain, layers, exc, words", [
    (0.0, [1], ValueError, "gain=0.0"), (-2.0, [1], ValueError, "gain=-2.0"),
    (float("nan"), [1], ValueError, "gain=nan"), ("big", [1], TypeError, "gain='big'"),
    (10.0, [3], ValueError, "layers=3"), (10.0, [-1], ValueError, "layers=-1"),
    (10.0, [], ValueError, "layers is empty"), (10.0, [True], TypeError, "layers=True"),
])
def test_scale_keys_refuses_bad_arguments_by_name(gain, layers, exc, words):
    model = _tiny()
    w = model.model.layers[1].self_attn.k_proj.weight.clone()
    with pytest.raises(exc, match=words.replace("(", r"\(").replace("[", r"\[")):
        scale_keys(model, gain, layers)
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, w)  # nothing changed


def test_scale_keys_refuses_a_model_that_normalizes_its_keys():
    model = _tiny("qwen3")
    with pytest.raises(ValueError, match=r"layers=\[0, 2\]: layer 0 normalizes its keys \(k_norm\)"):
        scale_keys(model, 10.0, [2, 0])


def test_bf16_layers_stay_16_bit_and_are_named():
    x = torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(0)) * 900.0  # saturates e4m3 at scale 1
    cfg = KVQuantConfig(k_scale=1.0, v_scale=1.0, bf16_layers=[2, 0, 2])
    assert cfg.bf16_layers == (0, 2) and cfg.label.endswith(" bf16 layers 0,2")
    for layer in (0, 2):
        out, info = quantize_kv(x, cfg, "k", layer)
        assert torch.equal(out, round_through(x, torch.bfloat16)) and info["saturated"] == 0
    out, info = quantize_kv(x, cfg, "k", 1)
    assert info["saturated"] > 0 and out.abs().max() <= 448
    assert KVQuantConfig(fmt="int8_token_head", bf16_layers=[1]).label == "int8_token_head bf16 layers 1"


@pytest.mark.parametrize("layers, exc, words", [
    ([-1], ValueError, "bf16_layers=[-1]"), (["a"], TypeError, "bf16_layers=['a']"),
    ([True], TypeError, "bf16_layers=[True]"), (5, TypeError, "bf16_layers=5"), ([1.0], TypeError, "bf16_layers=[1.0]"),
])
def test_bf16_layers_refused_by_name(layers, exc, words):
    with pytest.raises(exc, match=words.replace("[", r"\[")):
        KVQuantConfig(bf16_layers=layers)


def test_bf16_layers_take_numpy_integers():
    import numpy as np

    assert KVQuantConfig(bf16_layers=np.array([2, 1])).bf16_layers == (1, 2)


@pytest.mark.parametrize("layers, exc, words", [(5, TypeError, "key_layers=5"), (["a"], TypeError, "key_layers='a'"),
                                                ([-1], ValueError, "key_layers=-1")])
def test_key_layers_are_checked_before_the_model_loads(layers, exc, words):
    from fp8kv.models.outliers import load_model_with_keys

    with pytest.raises(exc, match=words):
        load_model_with_keys("no-such-model", key_layers=layers)  # refused before the name is even looked up


def test_bf16_layer_beyond_the_model_is_refused_where_it_meets_it():
    model = _tiny()
    with pytest.raises(ValueError, match=r"bf16_layers=\[3\] of config 'x': the model has 3 layers"):
        evaluate(model, torch.randint(0, VOCAB, (40,)), [KVQuantConfig(name="x", bf16_layers=[3])], window=20)


# ------------------------------------------------------------------------------------ a real model
@pytest.fixture(scope="module")
def stressed():
    """SmolLM2-135M with layer 3's keys x300: scale 1.0 collapses it, the advice keeps it 16-bit."""
    kw = dict(key_gain=300.0, key_layers=[3])
    health = model_scale_health("smollm2-135m", 32, 32, 2, methods=["1.0", "amax"], **kw)
    return advice_kl("smollm2-135m", keep_bf16_advice(health, 0.1), num_tokens=32, calibration_tokens=32, window=16,
                     **kw).set_index("method")


def test_the_advice_cuts_the_kl_of_a_model_with_large_keys(stressed):
    one, amax = stressed.loc["1.0"], stressed.loc["amax"]
    assert one["collapsed_layers"] == [3] and 3 in one["layers_bf16"]
    assert one["kl_after"] < one["kl_all_fp8"] / 5 and one["top1_after"] >= one["top1_all_fp8"]
    assert one["kl_reduces"]
    # amax scales fit the large keys: nothing kept, and far less KL than scale 1.0 all-FP8
    assert amax["layers_bf16"] == [] and amax["kl_after"] == amax["kl_all_fp8"] < one["kl_all_fp8"] / 5
    assert amax["kl_reduces"] is None
    lines = advice_kl_text(stressed.reset_index())
    assert lines[0].startswith("scale 1.0: layers 3") and " kept 16-bit: next-token KL " in lines[0]
    assert lines[1].startswith("scale amax: every layer FP8: next-token KL ")
    one_row = stressed.reset_index()
    assert stress_sentence(one_row, 300.0, [3]) == (
        "With the keys of layer(s) 3 x300 (the same model, keys beyond e4m3's range), scale 1.0 needs layer(s) 3 "
        f"16-bit: keeping them cuts the next-token KL from {one['kl_all_fp8']:.3g} to {one['kl_after']:.3g}.")
    assert stress_sentence(one_row[one_row["method"] == "amax"], 300.0, [3]) == ""


@pytest.mark.parametrize("advice, exc, words", [
    ("advice", TypeError, "advice must be keep_bf16_advice()'s table"),
    (pd.DataFrame([dict(method="magic", layers_bf16=[])]), ValueError, "advice has method(s) ['magic']"),
])
def test_advice_kl_refuses_what_is_not_an_advice(advice, exc, words):
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        advice_kl("smollm2-135m", advice)


@pytest.mark.parametrize("words", [advice_kl_text, lambda t: stress_sentence(t, 2.0, [1])])
def test_advice_kl_words_refuse_another_table(words):
    with pytest.raises(TypeError, match="table must be advice_kl"):
        words(pd.DataFrame([dict(method="1.0")]))


@pytest.mark.parametrize("layers, exc, words", [
    ([1.5], TypeError, "advice row 0 has layers_bf16=[1.5]; expected layer indices (ints >= 0)"),  # read as layer 1
    ([True], TypeError, "advice row 0 has layers_bf16=[True]"),
    ([-2], ValueError, "advice row 0 has layers_bf16=[-2]"),
    ("1", TypeError, "advice row 0 has layers_bf16='1' (str); expected a list of layer indices"),
])
def test_advice_kl_refuses_layers_it_would_misread_before_the_model_loads(layers, exc, words):
    advice = pd.DataFrame([dict(method="amax", layers_bf16=layers)])
    with pytest.raises(exc, match=re.escape(words)):
        advice_kl("no-such-model", advice)


_KL_TABLE = dict(method="1.0", layers_bf16=[1], kl_all_fp8=0.5, kl_after=0.1, top1_all_fp8=0.8, top1_after=0.9)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: advice_kl_text(pd.DataFrame([dict(_KL_TABLE, layers_bf16=[2.5])])), TypeError,
     "table row 0 has layers_bf16=[2.5]"),  # "layers 2 kept 16-bit" before
    (lambda: stress_sentence(pd.DataFrame([dict(_KL_TABLE, layers_bf16=[2.5])]), 8.0, [1]), TypeError,
     "table row 0 has layers_bf16=[2.5]"),
    (lambda: stress_sentence(pd.DataFrame([_KL_TABLE]), 8.0, [1.5]), TypeError, "key_layers=1.5 (float)"),
    (lambda: stress_sentence(pd.DataFrame([_KL_TABLE]), 8.0, ["a"]), TypeError, "key_layers='a' (str)"),
    (lambda: stress_sentence(pd.DataFrame([_KL_TABLE]), "8", [1]), TypeError, "key_gain='8' (str)"),
    (lambda: stress_sentence(pd.DataFrame([_KL_TABLE]), math.nan, [1]), ValueError, "key_gain=nan"),
])
def test_advice_kl_words_refuse_layers_and_gains_they_would_misread(call, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        call()


def test_stress_sentence_says_what_the_kept_layers_cost_in_tokens():
    """Through advice_capacity the table holds tokens_lost: the sentence gives the price beside the KL it buys."""
    table = pd.DataFrame([dict(method="1.0", layers_bf16=[3, 11], kl_all_fp8=0.176, kl_after=0.00825,
                               tokens_lost=123456)])
    assert stress_sentence(table, 300.0, [3, 11]) == (
        "With the keys of layer(s) 3, 11 x300 (the same model, keys beyond e4m3's range), scale 1.0 needs layer(s) "
        "3, 11 16-bit (123,456 tokens fewer than all-FP8): keeping them cuts the next-token KL from 0.176 to "
        "0.00825.")
    for bad, exc in ((math.nan, TypeError), (-5, ValueError), (1.5, TypeError)):
        with pytest.raises(exc, match=re.escape("table['tokens_lost']=")):
            stress_sentence(table.assign(tokens_lost=bad), 300.0, [3, 11])


def test_stress_sentence_where_scale_one_keeps_everything_fp8():
    table = pd.DataFrame([dict(method="1.0", layers_bf16=[], kl_all_fp8=0.0123, kl_after=0.0123)])
    assert stress_sentence(table, 8.0, [5, 2]) == ("With the keys of layer(s) 2, 5 x8 (the same model, keys beyond "
                                                   "e4m3's range), scale 1.0 still needs no 16-bit layer (next-token "
                                                   "KL 0.0123).")


@pytest.mark.parametrize("kw, exc, words", [
    (dict(granularity="token_head"), ValueError, "granularity='token_head'; expected one of"),
    (dict(percentile=0.0), ValueError, r"percentile=0.0 must be in \(0, 100\]"),
    (dict(percentile="99"), TypeError, "percentile='99'"),
])
def test_advice_kl_checks_its_scales_before_the_model_loads(kw, exc, words):
    advice = pd.DataFrame([dict(method="percentile", layers_bf16=[1])])
    with pytest.raises(exc, match=words):
        advice_kl("no-such-model", advice, **kw)  # refused before the name is even looked up


def test_advice_kl_measures_the_scales_the_advice_was_chosen_with(monkeypatch):
    """Each configuration it evaluates carries the advice's granularity and percentile, for both the all-FP8 run and
    the advised one (a per-head advice judged with per-tensor scales would measure other scales than it chose)."""
    import fp8kv.models as models

    seen = []

    def fake_evaluate(net, tokens, configs, **kw):
        seen.extend(configs)
        return pd.DataFrame([dict(config=c.name, kl_mean=0.0, top1_agree=1.0) for c in configs])

    monkeypatch.setattr(models, "evaluate", fake_evaluate)
    advice = pd.DataFrame([dict(method="percentile", layers_bf16=[1]), dict(method="amax", layers_bf16=[])])
    out = advice_kl("smollm2-135m", advice, num_tokens=8, calibration_tokens=8, window=4, granularity="head",
                    percentile=99.0)
    assert [c.name for c in seen] == ["percentile all FP8", "percentile advised", "amax all FP8"]
    assert {(c.granularity, c.percentile) for c in seen} == {("head", 99.0)}
    # nothing kept with amax: no advised run to compare, the reduction is not applicable (None), not True
    assert seen[1].bf16_layers == (1,) and list(out["kl_reduces"]) == [False, None]
