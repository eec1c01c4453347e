"""fp8kv.synthetic: shapes, determinism, the structure it promises (outlier channels, heavy tails,
per-head spread, RoPE), and input validation."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures import seeded

from fp8kv import rope
from fp8kv.synthetic import (
    apply_rope,
    kurtosis,
    kv_like_llm,
    outlier_channel_indices,
    queries_like_llm,
    ragged_kv,
    random_paged_cache,
)


def rope_oracle(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """RoPE as a complex rotation: pair (x_i, x_{i+D/2}) is the number x_i + j x_{i+D/2}."""
    d = x.shape[-1]
    half = d // 2
    x64 = x.to(torch.float64)
    z = torch.complex(x64[..., :half], x64[..., half:])
    freqs = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(positions), half, dtype=torch.float64),
                      positions.to(torch.float64)[:, None] * freqs[None, :])
    out = z * rot[:, None, :]
    return torch.cat([out.real, out.imag], dim=-1)


def test_shapes_dtypes_and_odd_sizes():
    k, v = kv_like_llm(15, 3, 30, seed=0)
    assert k.shape == v.shape == (15, 3, 30) and k.dtype == v.dtype == torch.float32
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    q = queries_like_llm(7, 9, 30, seed=0, position=15)
    assert q.shape == (7, 9, 30) and q.dtype == torch.float32
    kb, vb = kv_like_llm(15, 3, 30, seed=0, dtype=torch.bfloat16)
    assert kb.dtype == torch.bfloat16
    assert torch.equal(kb, k.to(torch.bfloat16)) and torch.equal(vb, v.to(torch.bfloat16))


def test_seeded_and_deterministic():
    a = kv_like_llm(33, 2, 16, seed=5)
    b = kv_like_llm(33, 2, 16, seed=5)
    c = kv_like_llm(33, 2, 16, seed=6)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1])
    q1 = queries_like_llm(4, 4, 16, seed=3, position=33)
    q2 = queries_like_llm(4, 4, 16, seed=3, position=33)
    assert torch.equal(q1, q2) and not torch.equal(q1, queries_like_llm(4, 4, 16, seed=4, position=33))


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("tokens", [64, 3000])
def test_outlier_channels_dominate_key_amax(rope, tokens):
    n = 4
    k, v = kv_like_llm(tokens, 4, 64, seed=1, outlier_channels=n, rope=rope)
    chans = set(outlier_channel_indices(64, n, rope).tolist())
    assert len(chans) == n
    amax = k.abs().amax(dim=0)  # [H, D]
    for h in range(4):
        top = set(amax[h].topk(n).indices.tolist())
        assert top == chans, (h, sorted(top), sorted(chans))
        others = amax[h][[c for c in range(64) if c not in chans]]
        assert amax[h][sorted(chans)].min() > 1.5 * others.max()
    # Values have no outlier channels: their largest channel is not far above the median one.
    vmax = v.abs().amax(dim=0)
    assert (vmax.max(dim=-1).values / vmax.median(dim=-1).values).max() < (
        amax.max(dim=-1).values / amax.median(dim=-1).values).min()


def test_outlier_pairs_sit_at_low_rope_frequencies():
    idx = outlier_channel_indices(128, 4, rope=True).tolist()
    assert idx == [61, 63, 125, 127]  # pairs (63, 127) and (61, 125): the slowest rotations
    assert outlier_channel_indices(10, 3, rope=False).tolist() == [0, 4, 9]
    assert outlier_channel_indices(8, 0).numel() == 0


def test_values_are_heavy_tailed():
    _, v = kv_like_llm(4096, 2, 64, seed=2, head_spread=1.0, token_spread=1.0, v_mean=0.0)
    assert kurtosis(v) > 4.0  # Student-t, df 5: kurtosis 9 (a Gaussian has 3)
    _, v_heavy = kv_like_llm(4096, 2, 64, seed=2, head_spread=1.0, token_spread=1.0, v_mean=0.0, v_tail_df=3.0)
    _, v_light = kv_like_llm(4096, 2, 64, seed=2, head_spread=1.0, token_spread=1.0, v_mean=0.0, v_tail_df=60.0)
    assert kurtosis(v_heavy) > kurtosis(v) > kurtosis(v_light)
    assert abs(kurtosis(v_light) - 3.0) < 0.3
    assert abs(float(v_light.std()) - 1.0) < 0.05  # rescaled to unit variance


def test_head_and_token_spread():
    def head_rms_ratio(x):
        rms = x.pow(2).mean(dim=(0, 2)).sqrt()
        return float(rms.max() / rms.min())

    _, v_flat = kv_like_llm(2048, 8, 64, seed=3, head_spread=1.0, token_spread=1.0, v_mean=0.0, v_tail_df=50.0)
    _, v_wide = kv_like_llm(2048, 8, 64, seed=3, head_spread=8.0, token_spread=1.0, v_mean=0.0, v_tail_df=50.0)
    assert head_rms_ratio(v_flat) < 1.1
    assert 2.0 < head_rms_ratio(v_wide) <= 8.0 * 1.1  # log-uniform within a factor 8
    k_flat, _ = kv_like_llm(2048, 2, 64, seed=3, outlier_channels=0, head_spread=1.0, token_spread=1.0)
    k_tok, _ = kv_like_llm(2048, 2, 64, seed=3, outlier_channels=0, head_spread=1.0, token_spread=4.0)

    def token_ratio(x):
        n = x.norm(dim=(1, 2))
        return float(n.max() / n.min())

    # max/min norm of 128-dim Gaussian rows is about 1.6 by itself; the spread multiplies it up to 4x.
    assert token_ratio(k_flat) < 2.0 < 3.0 < token_ratio(k_tok) <= 4.0 * 1.7


def test_apply_rope_matches_complex_rotation_and_keeps_pair_norms():
    x = torch.randn(37, 3, 30, generator=seeded(0))
    pos = torch.arange(100, 137)
    y = apply_rope(x, pos)
    torch.testing.assert_close(y.to(torch.float64), rope_oracle(x, pos), rtol=1e-5, atol=1e-5)
    pair = lambda t: t[..., :15] ** 2 + t[..., 15:] ** 2  # noqa: E731
    torch.testing.assert_close(pair(y), pair(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(x, torch.zeros(37)), x)


def test_keys_are_rotated_by_position():
    k_rope, v_rope = kv_like_llm(50, 2, 16, seed=4, outlier_channels=0, rope=True)
    k_raw, v_raw = kv_like_llm(50, 2, 16, seed=4, outlier_channels=0, rope=False)
    torch.testing.assert_close(k_rope, apply_rope(k_raw, torch.arange(50)))
    assert torch.equal(v_rope, v_raw)  # values are never rotated


def test_queries_position_and_outliers():
    plain = queries_like_llm(4000, 2, 16, seed=0, outlier_scale=5.0, position=None)
    chans = outlier_channel_indices(16, 4, rope=False)
    others = [c for c in range(16) if c not in chans.tolist()]
    ratio = plain[..., chans].std() / plain[..., others].std()
    assert 4.0 < float(ratio) < 6.0
    rotated = queries_like_llm(6, 2, 16, seed=0, position=[0, 1, 2, 3, 4, 5])
    base = queries_like_llm(6, 2, 16, seed=0, position=0)  # position 0: no rotation, same draws
    torch.testing.assert_close(rotated, apply_rope(base, torch.arange(6)))
    same = queries_like_llm(3, 2, 16, seed=0, position=7)
    torch.testing.assert_close(same, apply_rope(queries_like_llm(3, 2, 16, seed=0, position=0), torch.full((3,), 7)))


def test_kurtosis():
    assert kurtosis(torch.tensor([1.0, -1.0, 1.0, -1.0])) == pytest.approx(1.0)
    x = torch.tensor([[0.0, 0.0, 0.0, 4.0], [1.0, -1.0, 1.0, -1.0]])
    # row 0: deviations (-1, -1, -1, 3): m4 = 84 / 4, m2 = 12 / 4
    assert kurtosis(x, dim=1).tolist() == pytest.approx([21 / 9, 1.0])
    g = torch.randn(200_000, generator=seeded(0))
    assert abs(kurtosis(g) - 3.0) < 0.1
    assert math.isnan(kurtosis(torch.full((8,), 2.0)))  # undefined for equal values: NaN, not a number
    assert torch.isnan(kurtosis(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), dim=1)).tolist() == [True, False]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_tokens=0), ValueError, "num_tokens"),
    (dict(head_dim=31), ValueError, "head_dim=31 must be even"),
    (dict(outlier_channels=3), ValueError, "outlier_channels=3 must be even"),
    (dict(outlier_channels=-1), ValueError, "outlier_channels"),
    (dict(v_tail_df=2.0), ValueError, "v_tail_df"),
    (dict(head_spread=0.5), ValueError, "head_spread"),
    (dict(token_spread=float("nan")), ValueError, "token_spread"),
    (dict(outlier_scale=0.0), ValueError, "outlier_scale"),
    (dict(v_mean=-1.0), ValueError, "v_mean"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
])
def test_kv_rejects_bad_arguments(kwargs, exc, match):
    args = dict(num_tokens=8, num_kv_heads=2, head_dim=16) | kwargs
    with pytest.raises(exc, match=match):
        kv_like_llm(args.pop("num_tokens"), args.pop("num_kv_heads"), args.pop("head_dim"), **args)


def test_queries_reject_bad_arguments():
    with pytest.raises(ValueError, match="position must be an int or 3 positions"):
        queries_like_llm(3, 2, 16, position=[1, 2])
    with pytest.raises(ValueError, match="position must be >= 0"):
        queries_like_llm(2, 2, 16, position=[-1, 2])
    with pytest.raises(ValueError, match="query_scale"):
        queries_like_llm(2, 2, 16, query_scale=-1.0)
    with pytest.raises(ValueError, match="num_q_heads"):
        queries_like_llm(2, 0, 16)
    with pytest.raises(ValueError, match="positions has 3 entries"):
        apply_rope(torch.zeros(2, 1, 4), torch.arange(3))
    assert math.isfinite(float(queries_like_llm(1, 1, 2, outlier_channels=0).sum()))


# ------------------------------------------------------------------------------ seeds, devices, range
@pytest.mark.parametrize("seed, exc, match", [
    (None, TypeError, "seed=None.*same seed"),  # NumPy would draw fresh entropy: new tensors every call
    (1.5, TypeError, r"seed=1.5 \(float\)"),
    (True, TypeError, r"seed=True \(bool\)"),
    ([1, 2], TypeError, "seed="),
    (-1, ValueError, r"seed=-1; expected an int >= 0"),
])
def test_numpy_seeds_are_checked_by_name(seed, exc, match):
    with pytest.raises(exc, match=match):
        kv_like_llm(4, 2, 8, seed=seed)
    with pytest.raises(exc, match=match):
        queries_like_llm(2, 4, 8, seed=seed)


def test_torch_seeds_are_checked_by_name():
    for bad, exc in ((None, TypeError), (1.5, TypeError), (2**64, ValueError), (-2**63 - 1, ValueError)):
        with pytest.raises(exc, match="seed="):
            ragged_kv([3], 2, 8, seed=bad)
        with pytest.raises(exc, match="seed="):
            random_paged_cache(2, 20, 2, 8, seed=bad, device="cpu")
    with pytest.raises(TypeError, match=r"seq_lens=5 \(int\)"):
        ragged_kv(5, 2, 8)


def test_paged_cache_seeds_across_torchs_range():
    """A large seed times the chunk stride used to overflow manual_seed; chunk seeds are taken modulo 2**64,
    as torch takes a negative one, so the seeds that worked keep their values."""
    def pages(seed):
        c = random_paged_cache(2, 20, 2, 8, seed=seed, device="cpu")
        return c.k_pages.float(), c.v_pages.float(), c.block_table

    for seed in (2**62, 2**64 - 1, -2**63):
        a, b = pages(seed), pages(seed)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(pages(0)[0], pages(1)[0])
    # a negative seed gives what it gave when its chunk seeds went to torch unreduced (torch takes them modulo 2**64)
    k, _, _ = pages(-1)  # 4 blocks in one chunk: K's chunk 0 is seeded with -1 * 1_000_003
    expected = torch.randn(4, 16, 2, 8, generator=seeded(-1_000_003))
    assert torch.equal(k, expected.to(torch.bfloat16).float())


def test_devices_are_checked_where_they_enter():
    with pytest.raises(TypeError, match=r"device=7 \(int\)"):
        kv_like_llm(4, 2, 8, device=7)
    with pytest.raises(ValueError, match="device='bogus'"):
        queries_like_llm(2, 4, 8, device="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda': this machine has no CUDA GPU"):
            kv_like_llm(4, 2, 8, device="cuda")
    k, v = kv_like_llm(4, 2, 8, device="meta")
    assert k.device.type == v.device.type == "meta" and k.shape == (4, 2, 8)


@pytest.mark.parametrize("kwargs, what, names", [
    (dict(token_spread=1e30, dtype=torch.float16), "keys", "token_spread=1e\\+30"),
    (dict(outlier_scale=1e39), "keys", "outlier_scale=1e\\+39"),  # beyond fp32: inf in the fp32 computation
    (dict(outlier_scale=1e5, dtype=torch.float16), "keys", "outlier_scale=100000"),
    (dict(outlier_scale=1e5, dtype=torch.bfloat16, head_spread=1e70, token_spread=1e70), "keys", "head_spread"),
    (dict(outlier_channels=0, token_spread=1e12, dtype=torch.float16, rope=False), "keys", "token_spread"),
])
def test_values_beyond_the_dtype_are_refused_not_returned(kwargs, what, names):
    with pytest.raises(ValueError, match=rf"kv_like_llm {what}: \d+ of \d+ generated values are not finite.*{names}"):
        kv_like_llm(16, 2, 8, seed=0, **kwargs)


def test_queries_beyond_the_dtype_are_refused():
    with pytest.raises(ValueError, match="queries_like_llm: .* not finite in float16.*query_scale=1e\\+06"):
        queries_like_llm(4, 4, 8, query_scale=1e6, dtype=torch.float16)
    with pytest.raises(ValueError, match="not finite in float32.*outlier_scale=1e\\+39"):
        queries_like_llm(4, 4, 8, outlier_scale=1e39, position=3)
    # within range at the edge: 1e4 x a few is finite in fp16
    assert torch.isfinite(queries_like_llm(4, 4, 8, query_scale=100.0, dtype=torch.float16)).all()


@pytest.mark.parametrize("position, exc, match", [
    (float("nan"), TypeError, r"position=nan is not an int"),
    (float("inf"), TypeError, r"position=inf is not an int"),
    ([1.0, float("-inf")], TypeError, r"position=\[1.0, -inf\] is not an int"),
    ("5", TypeError, r"position='5' \(str\)"),
    (True, TypeError, r"position=True \(bool\)"),
    ([True, False], TypeError, "not an int or a list of ints"),
    ([[1], [2, 3]], TypeError, "not an int or a list of ints"),
])
def test_query_positions_are_ints(position, exc, match):
    with pytest.raises(exc, match=match):
        queries_like_llm(2, 4, 8, position=position)
    q = queries_like_llm(2, 4, 8, position=torch.tensor([3, 4]))  # a tensor of positions is a sequence
    torch.testing.assert_close(q, queries_like_llm(2, 4, 8, position=[3, 4]))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), torch.arange(2), theta=0.0), ValueError, "theta=0.0"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), torch.arange(2), theta=float("nan")), ValueError, "theta=nan"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), torch.tensor([0.0, float("nan")])), ValueError,
     "positions has 1 non-finite"),
    (lambda: rope.rope_inv_freq(-8, 10000.0), ValueError, "head_dim=-8"),
    (lambda: rope.rope_inv_freq(8, -1.0), ValueError, "theta=-1.0"),
    # AttributeError / torch's TypeError and NotImplementedError before; a complex x lost its imaginary part
    (lambda: rope.rope_at_positions([[[1.0, 2.0]]], [0]), TypeError, "x must be a torch.Tensor"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4, dtype=torch.complex64), [0, 1]), TypeError,
     "x has dtype complex64"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4, device="meta"), [0, 1]), ValueError, "x is on meta"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), None), TypeError, "positions=None; expected a 1-D"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), "ab"), TypeError, "positions='ab'; expected a 1-D"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), torch.ones(2, dtype=torch.complex64)), TypeError,
     "positions has dtype torch.complex64"),
    (lambda: rope.rope_at_positions(torch.ones(2, 1, 4), torch.arange(2, device="meta")), ValueError,
     "positions is on meta"),
])
def test_rope_refuses_what_would_give_nan_angles(call, exc, match):
    """A theta of 0 or below, or a NaN position, gave NaN rows; a negative head_dim a torch RuntimeError."""
    with pytest.raises(exc, match=match):
        call()


def test_queries_past_memory_and_meta_data_are_refused_by_name():
    # NumPy's 'Maximum allowed dimension exceeded' (or an allocation failure) before
    with pytest.raises(ValueError, match=r"num_queries=1099511627776 x num_q_heads=8 x head_dim=128 needs .* bytes"):
        queries_like_llm(2**40, 8, 128)
    with pytest.raises(ValueError, match="x is on meta"):  # torch's RuntimeError before
        kurtosis(torch.ones(4, device="meta"))


@pytest.mark.parametrize("rope", [1, "no", None])
def test_rope_is_true_or_false_not_a_truthy_stand_in(rope):
    for call in (lambda: kv_like_llm(4, 2, 8, rope=rope), lambda: outlier_channel_indices(8, 2, rope=rope)):
        with pytest.raises(TypeError, match=rf"rope={rope!r} \({type(rope).__name__}\); expected True or False"):
            call()


def test_kurtosis_refuses_a_dim_the_tensor_lacks_and_non_tensors():
    with pytest.raises(ValueError, match="dim=5; expected an int <= 1"):
        kurtosis(torch.randn(4, 4), dim=5)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        kurtosis([1.0, 2.0, 3.0])


def test_sizes_past_the_free_memory_are_refused_by_name_before_allocating():
    with pytest.raises(ValueError, match=r"batch=1000000 x context=1000000 tokens.*needs [\d,]+ bytes"):
        random_paged_cache(10**6, 10**6, 8, 128, device="cpu")
    with pytest.raises(ValueError, match=r"seq_lens \(max 1000000000, 1 sequences\).*needs [\d,]+ bytes"):
        ragged_kv([10**9], 64, 128)
    with pytest.raises(ValueError, match=r"num_tokens=1000000000000 x num_kv_heads=2 x head_dim=8 needs"):
        kv_like_llm(10**12, 2, 8)


def test_synthetic_refuses_scales_of_16_bit_pages_truthy_flags_and_non_int_positions():
    with pytest.raises(ValueError, match=r"granularity='head' with kv_dtype='bf16'"):
        random_paged_cache(1, 4, 1, 8, kv_dtype="bf16", granularity="head", device="cpu")
    with pytest.raises(TypeError, match=r"head_spread='no' \(str\); expected True or False"):
        ragged_kv([3], 1, 8, head_spread="no")
    for bad in (2.5, 1e30, [0.5, 1]):
        with pytest.raises(TypeError, match="position=.* is not an int or a list of ints"):
            queries_like_llm(2, 1, 8, position=bad)
    with pytest.raises(ValueError, match=r"position\[1\]=2147483648 is past 2147483647"):
        queries_like_llm(2, 1, 8, position=[0, 2**31])
