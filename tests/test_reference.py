"""fp8kv.reference.decode against a plain dense softmax attention written here in float64.

Tolerance: the oracle computes in fp32 and this test in fp64 on the same dequantized K/V, so the
only difference is fp32 rounding over <= 54 tokens: 1e-5 relative (output, per sequence) and
1e-5 x max(1, |lse|) absolute on the LSE.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8kv.cache import PagedKVCache
from fp8kv.reference import attention, decode

TOL = 1e-5
LENS = [1, 15, 16, 17, 54]


def dense_attention(q, ks, vs, sm_scale):
    """q [B, Hq, D]; ks, vs: lists of [L_i, Hkv, D]. Returns fp64 out [B, Hq, D] and lse [B, Hq]."""
    outs, lses = [], []
    for i in range(q.shape[0]):
        group = q.shape[1] // ks[i].shape[1]
        k = ks[i].double().repeat_interleave(group, dim=1)  # [L, Hq, D]: head h reads KV head h // group
        v = vs[i].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].double(), k) * sm_scale
        lses.append(torch.logsumexp(s, dim=-1))
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v))
    return torch.stack(outs), torch.stack(lses)


@pytest.fixture
def check(assert_rel_err):
    """check(out, lse, ref_out, ref_lse, what): per-sequence output and LSE within TOL."""

    def _check(out, lse, ref_out, ref_lse, what):
        assert out.dtype == lse.dtype == torch.float32
        for i in range(out.shape[0]):
            assert_rel_err(out[i], ref_out[i], TOL, f"{what} out[{i}]")
        assert ((lse.double() - ref_lse).abs() <= TOL * ref_lse.abs().clamp(min=1)).all(), what

    return _check


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (16, 2), (8, 1)], ids=["mha", "g4", "g8", "mqa"])
@pytest.mark.parametrize("kv_dtype, gran, layout, d", [("fp8_e4m3", "tensor", "NHD", 24),
                                                       ("fp8_e5m2", "token_head", "HND", 40),
                                                       ("fp8_e4m3", "channel", "HND", 24),
                                                       ("fp8_e4m3", "head", "NHD", 40),
                                                       ("bf16", "tensor", "NHD", 40)])
def test_decode_matches_dense_softmax(hq, hkv, d, kv_dtype, gran, layout, gen, check, make_cache):
    cache, k, v = make_cache(LENS, hkv, d, kv_dtype=kv_dtype, generator=gen, layout=layout, granularity=gran,
                             dtype=torch.bfloat16, dense=True)
    q = torch.randn(len(LENS), hq, d, generator=gen).to(torch.bfloat16)
    out, lse = decode(q, cache)
    assert out.shape == (5, hq, d) and lse.shape == (5, hq)
    ks, vs = zip(*(cache.gather(i) for i in range(5)), strict=True)  # the dequantized cache: kernel-error tier
    ref_out, ref_lse = dense_attention(q, ks, vs, 1 / math.sqrt(d))
    check(out, lse, ref_out, ref_lse, f"{kv_dtype}/{gran}/{layout} Hq={hq} Hkv={hkv} D={d}")
    if kv_dtype == "bf16":  # a 16-bit cache holds bf16 input exactly: same answer from the raw K/V
        raw_out, raw_lse = dense_attention(q, [k[i, :n] for i, n in enumerate(LENS)],
                                           [v[i, :n] for i, n in enumerate(LENS)], 1 / math.sqrt(d))
        check(out, lse, raw_out, raw_lse, "bf16 cache vs raw K/V")


@pytest.mark.parametrize("sm_scale", [0.05, 1.0, 3.0])
def test_non_default_sm_scale(sm_scale, gen, check, make_cache):
    cache = make_cache([54, 17, 1], 2, 40, kv_dtype="fp8_e4m3", generator=gen, dtype=torch.bfloat16, k_spread=4.0)
    q = torch.randn(3, 8, 40, generator=gen) * 2  # fp32 query; sm_scale 3 makes peaked softmaxes
    out, lse = decode(q, cache, sm_scale=sm_scale)
    ks, vs = zip(*(cache.gather(i) for i in range(3)), strict=True)
    ref_out, ref_lse = dense_attention(q, ks, vs, sm_scale)
    check(out, lse, ref_out, ref_lse, f"sm_scale={sm_scale}")
    default_out, _ = decode(q, cache)
    assert not torch.allclose(default_out, out)  # the argument is really used


def test_single_token_sequence_returns_its_value(gen, make_cache):
    cache = make_cache([1, 1], 2, 24, kv_dtype="bf16", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 24, generator=gen)
    out, lse = decode(q, cache, sm_scale=0.5)
    for i in range(2):
        k, v = cache.gather(i)
        rep_v = v[0].repeat_interleave(2, dim=0)  # [Hq, D]
        assert torch.allclose(out[i], rep_v, rtol=1e-6, atol=0)  # softmax over one token is 1
        score = (q[i].double() * k[0].double().repeat_interleave(2, dim=0)).sum(-1) * 0.5
        assert torch.allclose(lse[i].double(), score, rtol=1e-5, atol=1e-6)


def test_gqa_head_mapping_is_grouped_not_strided(gen):
    """Query head h must read KV head h // group: give each KV head a constant V to tell them apart."""
    lens = [15, 17]
    k = torch.randn(2, 17, 2, 24, generator=gen)
    v = torch.ones(2, 17, 2, 24)
    v[:, :, 1] = 2.0
    cache = PagedKVCache.from_dense(k, v, lens, kv_dtype="bf16")
    out, _ = decode(torch.randn(2, 8, 24, generator=gen), cache)
    expected = torch.tensor([1.0] * 4 + [2.0] * 4)[None, :, None].expand(2, 8, 24)
    assert torch.allclose(out, expected, rtol=1e-6, atol=0)


def test_attention_helper_matches_dense(gen, check):
    q = torch.randn(6, 40, generator=gen)
    k = torch.randn(54, 3, 40, generator=gen)
    v = torch.randn(54, 3, 40, generator=gen)
    out, lse = attention(q, k, v, 0.2)
    ref_out, ref_lse = dense_attention(q[None], [k], [v], 0.2)
    check(out[None], lse[None], ref_out, ref_lse, "attention()")


def test_empty_sequence_is_a_clear_error(gen):
    k = torch.randn(3, 16, 2, 24, generator=gen)
    cache = PagedKVCache.from_dense(k, k, [16, 0, 5])
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=0: decode needs at least one cached token"):
        decode(torch.randn(3, 4, 24), cache)


def test_input_errors_by_message(gen, make_cache):
    cache = make_cache([5, 17], 2, 24, kv_dtype="fp8_e4m3", generator=gen, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor \[B, Hq, D\].*, got list"):
        decode([[0.0]], cache)
    with pytest.raises(TypeError, match=r"cache must be a fp8kv.PagedKVCache, got dict"):
        decode(torch.zeros(2, 4, 24), {})
    with pytest.raises(ValueError, match=r"q must be 3-D \[B, Hq, D\] .* got shape \(2, 1, 4, 24\)"):
        decode(torch.zeros(2, 1, 4, 24), cache)
    for dt in (torch.float64, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=rf"q has dtype {str(dt).replace('torch.', '')}; expected one of"):
            decode(torch.zeros(2, 4, 24).to(dt), cache)
    with pytest.raises(ValueError, match=r"q has batch 3 but the cache holds 2 sequences"):
        decode(torch.zeros(3, 4, 24), cache)
    with pytest.raises(ValueError, match=r"q has head_dim 40 but the cache has head_dim 24"):
        decode(torch.zeros(2, 4, 40), cache)
    with pytest.raises(ValueError, match=r"q has 3 heads, not a multiple of the cache's 2 KV heads"):
        decode(torch.zeros(2, 3, 24), cache)
    with pytest.raises(ValueError, match=r"q is on meta but the cache is on cpu"):
        decode(torch.empty(2, 4, 24, device="meta"), cache)


def _corrupt(cache, what):
    bad = cache.clone()
    if what == "block_table":
        bad.block_table[1, 1] = 99  # a live entry (sequence 1 holds 17 tokens: two pages) past the 4-page pool
    elif what == "seq_len_over":
        bad.seq_lens[0] = 1000  # beyond its row's 2 x 16 tokens
    else:
        bad.seq_lens[0] = -5
    return bad


@pytest.mark.parametrize("kw, exc, match", [(dict(backend="bogus"), ValueError, "backend='bogus'"),
                                            (dict(mode="fast"), ValueError, "mode='fast'"),
                                            (dict(granularity="block"), ValueError, "granularity='block'"),
                                            (dict(score_bound=float("inf")), ValueError, "score_bound=inf"),
                                            (dict(score_bound=-1.0), ValueError, "score_bound=-1.0")])
def test_output_tolerance_refuses_names_it_has_no_bound_for(kw, exc, match):
    """An unknown backend, mode or granularity got the default bound; an infinite score bound an infinite one."""
    from fp8kv.reference import output_tolerance

    args = dict(backend="triton", mode="dequant", granularity="tensor") | kw
    with pytest.raises(exc, match=match):
        output_tolerance(args.pop("backend"), args.pop("mode"), torch.bfloat16, **args)


def test_a_query_that_is_not_finite_is_refused_by_name():
    """fp8kv.decode and the attend oracle refuse it; the decode oracle returned NaN for it."""
    cache = PagedKVCache.from_dense(torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32), [8])
    q = torch.randn(1, 4, 32)
    q[0, 2, 5] = float("inf")
    with pytest.raises(ValueError, match=r"q has 1 non-finite value\(s\) \(NaN/Inf\); the first is at index \(0, 2, 5\)"):
        decode(q, cache)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.k_scale.fill_(float("nan")), r"k_scale=nan; scales must be positive and finite"),
    (lambda c: c.v_scale.fill_(-0.5), r"v_scale=-0.5; scales must be positive and finite"),
    (lambda c: setattr(c, "k_scale", torch.ones(2)), r"k_scale has shape \(2,\); .* holds scales of shape \(\)"),
])
def test_scales_edited_after_construction_are_refused_by_name(edit, message):
    """As fp8kv.decode and the attend oracle refuse them: the decode oracle answered NaN for a NaN scale, a
    sign-flipped output for a negative one, and a raw broadcasting RuntimeError for a mis-shaped one."""
    cache = PagedKVCache.from_dense(torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32), [8])
    edit(cache)
    with pytest.raises(ValueError, match=message):
        decode(torch.randn(1, 4, 32), cache)
    with pytest.raises(ValueError, match=message):  # the cache's own read, a public entry too
        cache.gather(0)


@pytest.mark.parametrize("what, message", [("block_table", r"block_table\[1, 1\]=99 is out of range \[0, 4\)"),
                                           ("seq_len_over", r"seq_lens\[0\]=1000 exceeds the capacity"),
                                           ("seq_len_negative", r"seq_lens\[0\]=-5 is negative")])
def test_corrupt_tables_are_refused_by_name(what, message, gen, make_cache):
    """Tables edited in place after the cache was built: the oracle names the entry and its value
    (no IndexError, no answer), also through fp8kv.decode with check=False, which skips its own check."""
    from fp8kv import decode as fp8kv_decode

    cache = make_cache([5, 17], 2, 24, kv_dtype="fp8_e4m3", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 24, generator=gen)
    bad = _corrupt(cache, what)
    with pytest.raises(ValueError, match=message):
        decode(q, bad)
    with pytest.raises(ValueError, match=message):
        fp8kv_decode(q, bad, backend="reference", check=False)


def test_unused_block_table_entries_are_not_checked(gen, make_cache):
    """Entries past a sequence's last page hold no tokens (padding such as -1 is fine): same answer."""
    cache = make_cache([5, 17], 2, 24, kv_dtype="fp8_e4m3", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 24, generator=gen)
    padded = cache.clone()
    padded.block_table[0, 1] = -1  # sequence 0 (5 tokens) uses only its first page
    for a, b in zip(decode(q, padded), decode(q, cache), strict=True):
        assert torch.equal(a, b)


def test_window_longer_than_any_int64_is_the_whole_sequence(gen, make_cache):
    """fp8kv.decode takes any int >= 1 as a window; one beyond int64 must not overflow the mask."""
    from fp8kv import decode as fp8kv_decode

    cache = make_cache([5, 17], 2, 24, kv_dtype="fp8_e4m3", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 24, generator=gen)
    full = decode(q, cache)
    for w in (17, 2**63, 2**70):
        for got in (decode(q, cache, window=w), fp8kv_decode(q, cache, backend="reference", window=w)):
            assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True)), w


def test_soft_cap_up_to_its_bound_is_no_cap_and_beyond_it_refused(gen, make_cache):
    """The largest cap (checks.MAX_SOFT_CAP, 1e30) stays in fp32's range: with |s| < 100,
    |c tanh(s / c) - s| <= |s|^3 / (3 c^2) is zero in fp32, so the answer is the uncapped one up to the
    summation order (REFERENCE_TOL). A larger cap is refused by name, not turned into inf or NaN."""
    from fp8kv.checks import MAX_SOFT_CAP

    cache = make_cache([5, 17], 2, 24, kv_dtype="fp8_e4m3", generator=gen, dtype=torch.bfloat16)
    q = torch.randn(2, 4, 24, generator=gen)
    full_out, full_lse = decode(q, cache)
    out, lse = decode(q, cache, soft_cap=MAX_SOFT_CAP)
    assert float((out - full_out).norm() / full_out.norm()) <= TOL
    assert float((lse - full_lse).abs().max()) <= TOL * max(1.0, float(full_lse.abs().max()))
    for cap in (1.01e30, 1e38, 1e300):
        with pytest.raises(ValueError, match=r"soft_cap=.*\[1e-06, 1e\+30\]"):
            decode(q, cache, soft_cap=cap)


_Q, _K = torch.randn(4, 8), torch.randn(5, 2, 8)


@pytest.mark.parametrize("args, kw, exc, match", [
    ((_Q, _K, _K, 0.3), dict(window=0), ValueError, r"window=0; expected an int >= 1"),
    ((_Q, _K, _K, float("nan")), {}, ValueError, r"sm_scale=nan; expected a finite number"),
    ((_Q, _K, _K, -1.0), {}, ValueError, r"sm_scale=-1.0"),
    ((_Q[:3], _K, _K, 0.3), {}, ValueError, r"q has 3 heads, not a multiple of k's 2 KV heads"),
    ((_Q, _K[..., :4], _K[..., :4], 0.3), {}, ValueError, r"q has head_dim 8 but k and v have head_dim 4"),
    ((_Q, _K, _K[..., :4], 0.3), {}, ValueError, r"k has shape \(5, 2, 8\) but v has \(5, 2, 4\)"),
    ((_Q, _K[:0], _K[:0], 0.3), {}, ValueError, r"0 tokens; expected at least one"),
    ((_Q, _K.to(torch.int32), _K, 0.3), {}, TypeError, r"k has dtype int32"),
    ((_Q.clone().fill_(float("nan")), _K, _K, 0.3), {}, ValueError, r"q has 32 non-finite"),
    ((_Q, _K, _K, 0.3), dict(sinks=torch.zeros(3)), ValueError, r"sinks has shape \(3,\); expected \[4\]"),
])
def test_attention_checks_its_arguments_by_name(args, kw, exc, match):
    """It checked nothing: window 0 and a NaN scale gave NaN outputs, head or dim mismatches einsum errors, an
    empty sequence zeros with lse -inf."""
    with pytest.raises(exc, match=match):
        attention(*args, **kw)


def test_attention_takes_none_for_the_default_scale(gen):
    q, k = torch.randn(4, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    for a, b in zip(attention(q, k, k), attention(q, k, k, 0.25), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw, exc, match", [(dict(backend="cuda"), ValueError, "backend='cuda'"),
                                            (dict(mode="zzz"), ValueError, "mode='zzz'"),
                                            (dict(granularity="blah"), ValueError, "granularity='blah'"),
                                            (dict(score_bound=float("nan")), ValueError, "score_bound=nan"),
                                            (dict(score_bound=-5), ValueError, "score_bound=-5"),
                                            (dict(q_dtype="fp64"), ValueError, "q_dtype='fp64'"),
                                            (dict(q_dtype=[1.0]), ValueError, r"q_dtype=\[1.0\]; expected"),
                                            (dict(ref_lse=[1.0]), TypeError, "ref_lse must be a torch.Tensor"),
                                            (dict(ref_lse=torch.zeros(2, device="meta")), ValueError,
                                             "ref_lse is on meta"),
                                            (dict(ref_lse=torch.tensor([])), ValueError, r"ref_lse has shape \(0,\)"),
                                            (dict(ref_lse=torch.tensor([1.0, float("inf")])), ValueError,
                                             r"ref_lse has 1 non-finite")])
def test_lse_tolerance_refuses_what_output_tolerance_refuses(kw, exc, match):
    """They all returned the default bound (an infinite ref_lse an infinite one, which passes any comparison)."""
    from fp8kv.reference import lse_tolerance

    args = dict(backend="triton", mode="dequant", q_dtype=torch.bfloat16, ref_lse=torch.tensor([2.0])) | kw
    with pytest.raises(exc, match=match):
        lse_tolerance(args.pop("backend"), args.pop("mode"), args.pop("q_dtype"), args.pop("ref_lse"), **args)


def test_paged_attend_names_a_count_that_is_not_an_int():
    """A float count failed in range() with "'float' object cannot be interpreted as an integer"."""
    from fp8kv.reference import paged_attend

    k = torch.randn(2, 8, 2, 16)
    cache = PagedKVCache.from_dense(k, k, [3, 2])
    with pytest.raises(TypeError, match=r"qo_lens\[0\]=3.0 \(float\); expected an int"):
        paged_attend(torch.randn(5, 4, 16), cache, [3.0, 2.0])
    out, _ = paged_attend(torch.randn(5, 4, 16), cache, [3, 2])
    assert out.shape == (5, 4, 16)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(sm_scale=-1.0), ValueError, r"sm_scale=-1.0; expected a finite number > 0"),  # a bound of 0 before
    (dict(sm_scale=float("nan")), ValueError, "sm_scale=nan"),
    (dict(sm_scale="0.5"), TypeError, r"sm_scale='0.5' \(str\)"),  # float()'s own ValueError before
    (dict(cache=None), TypeError, "cache must be a paged KV cache .* got NoneType"),  # AttributeError before
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(1, 2, 4, 16)), ValueError, "q must be 3-D"),  # einsum's RuntimeError before
])
def test_score_bound_refuses_bad_arguments_by_name(kw, exc, match):
    from fp8kv.reference import score_bound

    k = torch.randn(2, 5, 1, 16)
    args = dict(q=torch.randn(2, 2, 16, dtype=torch.float16), cache=PagedKVCache.from_dense(k, k, [5, 3])) | kw
    with pytest.raises(exc, match=match):
        score_bound(args["q"], args["cache"], args.get("sm_scale"))
