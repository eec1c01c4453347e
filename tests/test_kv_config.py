"""KVQuantConfig and quantize_kv refuse bad input where it enters, by name."""

from __future__ import annotations

import pytest
import torch

from fp8kv.models.kv_config import KVQuantConfig, layer_entry, quantize_kv


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("which", ["K", "V", "key", "", None])
def test_quantize_kv_refuses_a_side_other_than_k_or_v(which):
    cfg = KVQuantConfig(k_scale=0.001, v_scale=1.0)  # "K" was quantized with V's scale
    with pytest.raises(ValueError, match=r"which=.*expected one of \('k', 'v'\)"):
        quantize_kv(_x(1, 2, 4, 8), cfg, which, 0)
    with pytest.raises(ValueError, match=r"which=.*expected one of \('k', 'v'\)"):
        cfg.layer_scale(which, 0)


@pytest.mark.parametrize("cfg, layer, exc, words", [
    (KVQuantConfig(k_scale=[1.0, 2.0]), -1, ValueError, r"layer=-1; expected an int >= 0"),  # took the last entry
    (KVQuantConfig(k_scale=1.0), -1, ValueError, r"layer=-1; expected an int >= 0"),
    (KVQuantConfig(k_scale=[1.0, 2.0]), 2, ValueError, r"k_scale has 2 per-layer entries but layer 2"),
    (KVQuantConfig(k_scale=1.0), 1.0, TypeError, r"layer=1.0 \(float\); expected an int"),
    (KVQuantConfig(k_scale=1.0), True, TypeError, r"layer=True \(bool\); expected an int"),
])
def test_quantize_kv_refuses_a_bad_layer(cfg, layer, exc, words):
    with pytest.raises(exc, match=words):
        quantize_kv(_x(1, 2, 4, 8), cfg, "k", layer)
    with pytest.raises(exc, match=words):
        cfg.layer_scale("k", layer)


def test_layer_entry_refuses_a_negative_layer():
    with pytest.raises(ValueError, match=r"layer=-1; expected an int >= 0"):
        layer_entry([1.0, 2.0], "k_scale", -1)
    assert layer_entry(3.0, "k_scale", 5) == 3.0  # a scalar is every layer's


@pytest.mark.parametrize("x, cfg, exc, words", [
    ([[1.0]], KVQuantConfig(), TypeError, r"x must be a torch.Tensor \[batch, heads, tokens, head_dim\], got list"),
    (_x(3, 4), KVQuantConfig(granularity="head"), ValueError, r"x must be 4-D .*got shape \(3, 4\)"),
    (_x(2, 4, 8), KVQuantConfig(fmt="nvfp4"), ValueError, r"x must be 4-D"),
    (torch.ones(1, 2, 4, 8, dtype=torch.int32), KVQuantConfig(), TypeError, r"x has dtype int32"),
])
def test_quantize_kv_refuses_x_that_is_not_a_4d_float_tensor(x, cfg, exc, words):
    with pytest.raises(exc, match=words):
        quantize_kv(x, cfg, "k", 0)


def test_quantize_kv_refuses_a_config_that_is_not_one():
    with pytest.raises(TypeError, match=r"cfg=\{'kv_dtype': 'fp8'\} \(dict\); expected a KVQuantConfig"):
        quantize_kv(_x(1, 2, 4, 8), {"kv_dtype": "fp8"}, "k", 0)


def test_k_and_v_use_their_own_scales():
    x = _x(1, 2, 4, 8)
    cfg = KVQuantConfig(k_scale=0.001, v_scale=1.0)
    assert quantize_kv(x, cfg, "k", 0)[1]["scale"] == pytest.approx(0.001)
    assert quantize_kv(x, cfg, "v", 0)[1]["scale"] == pytest.approx(1.0)


@pytest.mark.parametrize("percentile, exc, words", [
    (200, ValueError, r"percentile=200 must be in \(0, 100\]"),
    (0, ValueError, r"percentile=0 must be in \(0, 100\]"),
    ("x", TypeError, r"percentile='x' \(str\); expected a finite number"),
    (True, TypeError, r"percentile=True \(bool\)"),
    (float("nan"), ValueError, r"percentile=nan; expected a finite number"),
])
def test_config_refuses_a_bad_percentile_at_construction(percentile, exc, words):
    with pytest.raises(exc, match=words):  # failed only at the first quantize, never with amax scales
        KVQuantConfig(percentile=percentile)


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(scale_factor=True), TypeError, r"scale_factor=True \(bool\)"),
    (dict(scale_factor=0.0), ValueError, r"scale_factor=0.0; expected a finite number > 0"),
    (dict(scale_factor=1 / 64, kv_dtype="bf16"), ValueError,
     r"scale_factor=0.015625 has no effect with kv_dtype='bf16'"),
    (dict(scale_factor=1 / 64, fmt="int8_token_head"), ValueError,
     r"scale_factor=0.015625 has no effect with fmt='int8_token_head'"),
])
def test_config_refuses_a_scale_factor_that_is_not_one_or_does_nothing(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        KVQuantConfig(**kwargs)
    assert KVQuantConfig(scale_factor=1 / 64).label.endswith("x0.015625")
    assert KVQuantConfig(kv_dtype="bf16", scale_factor=1).scale_factor == 1.0


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(k_scale=[-1.0, "foo"]), ValueError, r"k_scale\[0\] must be positive and finite; got -1.0"),
    (dict(k_scale=[1.0, "foo"]), ValueError, r"k_scale\[1\]='foo'; expected one of \('amax'"),
    (dict(v_scale=[1.0, None]), TypeError, r"v_scale\[1\]=None \(NoneType\); expected one of"),
    (dict(v_scale=(1.0, torch.tensor([1.0, 0.0]))), ValueError, r"v_scale\[1\] must be positive and finite"),
])
def test_config_checks_each_per_layer_scale_by_index(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        KVQuantConfig(**kwargs)
    cfg = KVQuantConfig(k_scale=[1.0, "amax", torch.tensor(2.0)])
    assert cfg.layer_scale("k", 1) == "amax"
