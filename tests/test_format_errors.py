"""Every KV format side by side: the model hook's format parameter (KVQuantConfig(fmt=...)) stores K/V as the codecs
do, token by token (KIVI's keys in whole groups, the rest bf16); the error table on synthetic K/V and per layer of a
model; next-token accuracy per format; bad input by name."""

import math

import pytest
import torch
from fixtures import seeded

from fp8kv import kv_formats as kvf
from fp8kv.analysis.format_errors import (
    kv_format_errors,
    model_format_errors,
    synthetic_format_errors,
    through_format,
)
from fp8kv.models.kv_config import KVQuantConfig

TOKEN_LOCAL = ["int8_token_head", "int4_token_head", "nvfp4", "mxfp4", "fp8_e4m3_token_head"]


@pytest.mark.parametrize("fmt", TOKEN_LOCAL)
@pytest.mark.parametrize("which", ["k", "v"])
def test_a_token_local_format_stores_what_its_codec_stores_token_by_token(fmt, which):
    x = torch.randn(40, 2, 64, generator=seeded(3)) * 3
    f = kvf.kv_format(fmt)
    codec = f.key if which == "k" else f.value
    whole = through_format(x, fmt, which)
    assert torch.equal(whole, kvf.quantize(x, codec).dequantize())
    if not codec.tensor_scale:  # scales of each token: the same whether the tokens come one by one or together
        one_by_one = torch.cat([kvf.quantize(x[i:i + 1], codec).dequantize() for i in range(40)])
        assert torch.equal(whole, one_by_one)


def test_kivi_keys_are_quantized_in_whole_groups_and_the_rest_kept_in_bf16():
    x = torch.randn(70, 2, 64, generator=seeded(4))
    k = through_format(x, "kivi4_g32", "k")
    assert torch.equal(k[:64], kvf.quantize(x[:64], kvf.codec("kivi4_key_g32")).dequantize())
    assert torch.equal(k[64:], x[64:].to(torch.bfloat16).float())
    v = through_format(x, "kivi4_g32", "v")  # values: per token, all of them
    assert torch.equal(v, kvf.quantize(x, kvf.codec("kivi4_value_g32")).dequantize())


def test_the_config_names_the_format():
    c = KVQuantConfig(fmt="NVFP4")
    assert c.fmt == "nvfp4" and c.label == "nvfp4" and c.describe()["kv_dtype"] == "nvfp4"
    assert KVQuantConfig(fmt="int4_token_head", quantize_k=False).label == "int4_token_head V only"


@pytest.mark.parametrize("bad,error,match", [("int3", ValueError, "fmt='int3' is not a known KV format"),
                                             (4, TypeError, "fmt=4"), (True, TypeError, "fmt=True")])
def test_a_bad_format_is_refused_by_name(bad, error, match):
    with pytest.raises(error, match=match):
        KVQuantConfig(fmt=bad)


def test_the_error_table_orders_the_formats_as_their_bits():
    df = synthetic_format_errors(num_tokens=128, num_kv_heads=2, head_dim=64, num_queries=4)
    by = df.set_index("format")
    assert by.loc["int8_token_head", "out_rel_err"] < by.loc["nvfp4", "out_rel_err"] < by.loc["int4_token_head", "out_rel_err"]
    assert by.loc["int8_token_head", "k_rel_err"] < by.loc["fp8_e4m3_token_head", "k_rel_err"]
    for f, r in by.iterrows():
        if r.note:
            assert f == "kivi4_g128" and "head_dim 64" in r.note and math.isnan(r.out_rel_err)
            continue
        fp = kvf.kv_footprint(f, num_kv_heads=2, head_dim=64)
        assert r.bytes_per_token == fp.per_token and r.code_bytes + r.scale_bytes == r.bytes_per_token
        assert 0 < r.k_rel_err < 0.5 and 0 < r.v_rel_err < 0.5 and 0 < r.out_rel_err < 1


def test_bad_tensors_are_refused_by_name():
    k = torch.randn(8, 2, 64)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple of k's 2 KV heads"):
        kv_format_errors(k, k, torch.randn(2, 3, 64))
    nan_q = torch.randn(2, 4, 64)
    nan_q[0, 0, 0] = float("nan")
    # a NaN query or softmax scale gave an error of 0 (NaN norms), not a refusal
    for kw, exc, match in ((dict(q=nan_q), ValueError, "q has 1 non-finite"), (dict(sm_scale=float("nan")), ValueError,
                           "sm_scale=nan"), (dict(sm_scale=-1.0), ValueError, "sm_scale=-1.0"),
                           (dict(sm_scale=True), TypeError, "sm_scale=True"),
                           (dict(q=torch.randn(0, 4, 64)), ValueError, "at least one query")):
        with pytest.raises(exc, match=match):
            kv_format_errors(k, k, kw.pop("q", torch.randn(2, 4, 64)), ["int4_token_head"], **kw)
    with pytest.raises(ValueError, match="k has shape"):  # no KV heads: a division by zero before
        kv_format_errors(torch.randn(8, 0, 64), torch.randn(8, 0, 64), torch.randn(2, 4, 64))
    with pytest.raises(ValueError, match="formats has"):
        kv_format_errors(k, k, torch.randn(2, 4, 64), ["nvfp4", "int3"])


@pytest.fixture(scope="module")
def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def test_per_layer_errors_and_accuracy_of_a_model(small_llama):
    from fp8kv.analysis.format_errors import format_accuracy

    ids = torch.randint(0, 64, (48,), generator=seeded(5))
    errs = model_format_errors(small_llama, ids, ["int8_token_head", "int4_token_head", "mxfp4"], num_queries=4)
    assert len(errs) == 2 * 3 and set(errs.layer) == {0, 1}
    per = errs.groupby("format").out_rel_err.mean()
    assert per["int8_token_head"] < per["int4_token_head"]
    acc = format_accuracy(small_llama, torch.randint(0, 64, (96,), generator=seeded(6)),
                          ["int8_token_head", "int4_token_head", "kivi4_g32"], window=32)
    rows = acc.set_index("config")
    assert list(rows.index) == ["bf16", "int8_token_head", "int4_token_head", "kivi4_g32"]
    assert rows.loc["int8_token_head", "kl_mean"] < rows.loc["int4_token_head", "kl_mean"]
    assert (rows.top1_agree <= 1).all() and rows.loc["int8_token_head", "top1_agree"] > 0.9
