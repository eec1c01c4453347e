"""fp8kv.quant: scale shapes and methods, bit-exact saturating RNE, counts, errors, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8kv.formats import FORMATS
from fp8kv.quant import (
    GRANULARITIES,
    cast_saturating,
    compute_scale,
    kv_scale_bytes,
    quantize,
    reduce_dims,
    relative_error,
    scale_from_stat,
    scale_shape,
)

GRANS = ("tensor", "head", "token_head", "channel")
U8 = torch.uint8


def ref_cast(y: torch.Tensor, f) -> torch.Tensor:
    """torch's own cast of the clamped fp32 values, as uint8 codes."""
    return y.to(torch.float32).clamp(-f.max, f.max).to(f.torch_dtype).view(U8)


def rne_oracle(y: torch.Tensor, f) -> tuple[torch.Tensor, int]:
    """Saturating round-to-nearest-even from the code table alone (no torch fp8 cast).

    Positive finite codes 0 .. n-1 are increasing in value, so the code of the nearest value is
    found by a sorted search; an exact tie picks the even code (even mantissa). Returns the uint8
    codes and how many inputs were exact ties.
    """
    vals = f.code_values.to(torch.float64)
    n = 0
    while n < 128 and math.isfinite(float(vals[n])) and (n == 0 or vals[n] > vals[n - 1]):
        n += 1
    table = vals[:n]
    a = y.to(torch.float64).abs().clamp(max=f.max).reshape(-1)
    hi = torch.searchsorted(table, a).clamp(max=n - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    tie = (d_lo == d_hi) & (lo != hi)
    code = torch.where(d_lo < d_hi, lo, hi)
    code = torch.where(tie, torch.where(lo % 2 == 0, lo, hi), code)
    code = torch.where(a == table[hi], hi, code)  # exactly representable (incl. 0 and max)
    if f.name.endswith("fnuz"):  # no -0 code: anything that rounds to 0 is +0
        sign = torch.signbit(y.reshape(-1)) & (code != 0)
    else:
        sign = torch.signbit(y.reshape(-1))
    code = code | (sign.to(torch.int64) << 7)
    return code.to(U8).reshape(y.shape), int(tie.sum())


def all_16bit(dtype: torch.dtype) -> torch.Tensor:
    """Every one of the 2^16 bit patterns of a 16-bit float dtype, as [65536, 1, 1]."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).reshape(-1, 1, 1)


def group_amax(x: torch.Tensor, gran: str) -> torch.Tensor:
    """amax(|x|) over each scale group, by explicit indexing ([T, H, D] input)."""
    a = x.abs().to(torch.float32)
    _, h, d = x.shape
    if gran == "tensor":
        return a.max()
    if gran == "head":
        return torch.stack([a[:, i, :].max() for i in range(h)])
    if gran == "token_head":
        return torch.stack([torch.stack([a[t, i, :].max() for i in range(h)]) for t in range(x.shape[0])])
    return torch.stack([torch.stack([a[:, i, j].max() for j in range(d)]) for i in range(h)])


def bcast(s: torch.Tensor, gran: str) -> torch.Tensor:
    """View a granularity-shaped scale against [T, H, D] data (written here, not imported)."""
    if gran == "head":
        return s[:, None]
    if gran == "token_head":
        return s[..., None]
    return s  # tensor [] and channel [H, D] broadcast as they are


# ------------------------------------------------------------------------------- scale shapes


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("shape", [(15, 3, 24), (2, 17, 4, 40), (1, 1, 8)])
def test_scale_shapes(gran, shape, gen):
    x = torch.randn(shape, generator=gen).to(torch.bfloat16)
    expected = {"tensor": (), "head": (shape[-2],), "token_head": shape[:-1], "channel": shape[-2:]}[gran]
    q = quantize(x, "e4m3", gran)
    assert tuple(q.scale.shape) == expected == scale_shape(x.shape, gran)
    assert q.scale.dtype == torch.float32
    assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
    assert q.granularity == gran and q.numel == x.numel()
    assert q.scale_nbytes == 4 * math.prod(expected)
    assert q.nbytes == x.numel() + 4 * math.prod(expected)


# ------------------------------------------------------------------------------ scale methods


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_amax_and_vllm_scales(gran, fmt, gen):
    f = FORMATS[fmt]
    x = torch.randn(17, 3, 40, generator=gen) * torch.rand(1, 3, 40, generator=gen) * 5
    amax = group_amax(x, gran)
    for method, divisor in (("amax", f.max), (None, f.max), ("vllm_k", 200.0), ("vllm_v", 100.0)):
        q = quantize(x, fmt, gran, method)
        assert torch.equal(q.scale, amax / divisor), (method, gran)
        assert torch.equal(compute_scale(x, fmt, gran, method or "amax"), amax / divisor)
    # amax scaling: the group maximum lands exactly on ±max and nothing saturates.
    q = quantize(x, fmt, gran, "amax")
    assert q.saturated == 0
    deq_amax = group_amax(q.data.to(torch.float32), gran)
    assert torch.allclose(deq_amax, torch.full_like(deq_amax, f.max), rtol=0, atol=0)


@pytest.mark.parametrize("gran", GRANS)
def test_all_zero_group_gets_scale_one(gran):
    x = torch.zeros(5, 2, 24)
    x[:, 1] = torch.linspace(-3, 3, 5 * 24).reshape(5, 24)
    q = quantize(x, "e4m3", gran)
    assert (q.scale > 0).all()
    if gran == "tensor":
        assert torch.equal(q.scale, torch.tensor(3.0) / 448)
    else:
        zero_groups = bcast(q.scale, gran).expand_as(x)[:, 0]
        assert (zero_groups == 1.0).all()
    assert (q.data[:, 0].to(torch.float32) == 0).all()


@pytest.mark.parametrize("gran", GRANS)
def test_float_and_tensor_scales_follow_the_convention(gran, gen):
    f = FORMATS["e4m3"]
    x = torch.randn(16, 4, 24, generator=gen).to(torch.float16)
    shape = scale_shape(x.shape, gran)
    s_t = torch.rand(shape, generator=gen) + 0.01
    for given_scale, s_exp in ((0.05, torch.full(shape, 0.05)), (1.0, torch.ones(shape)), (s_t, s_t)):
        before = given_scale.clone() if isinstance(given_scale, torch.Tensor) else None
        q = quantize(x, f, gran, given_scale)
        assert torch.equal(q.scale, s_exp.to(torch.float32))
        y = x.to(torch.float32) / bcast(s_exp, gran)
        # stored = Q(x / scale), bit for bit; dequantized = stored * scale.
        assert torch.equal(q.data.view(U8), ref_cast(y, f))
        assert torch.equal(q.dequantize(), q.data.to(torch.float32) * bcast(s_exp, gran))
        assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
        assert q.saturated == int((y.abs() >= f.first_overflow).sum())
        if before is not None:
            assert torch.equal(given_scale, before)


def test_scale_broadcastable_to_granularity_shape(gen):
    x = torch.randn(15, 3, 24, generator=gen)
    per_dim = torch.rand(24, generator=gen) + 0.1  # [D] broadcasts to the channel shape [H, D]
    q = quantize(x, "e5m2", "channel", per_dim)
    assert q.scale.shape == (3, 24)
    assert torch.equal(q.scale, per_dim.expand(3, 24))


# ---------------------------------------------------------------------------------- percentile


@pytest.mark.parametrize("gran", ["tensor", "head", "channel"])
@pytest.mark.parametrize("p", [50.0, 90.0, 99.9, 100.0])
def test_percentile_semantics(gran, p, gen):
    f = FORMATS["e4m3"]
    x = torch.randn(400, 2, 5, generator=gen)  # distinct magnitudes (continuous distribution)
    s = quantize(x, f, gran, "percentile", percentile=p).scale
    stat = bcast(s * f.max, gran)
    a = x.abs()
    reduce = {"tensor": (0, 1, 2), "head": (0, 2), "channel": (0,)}[gran]
    n = math.prod(x.shape[d] for d in reduce)
    above = (a > stat * (1 + 1e-6)).sum(dim=reduce)  # strictly above the group's p-th percentile
    # Nearest rank: about (1 - p/100) * n values of each group lie above it (±1 for rounding).
    assert ((above.to(torch.float64) - n * (1 - p / 100)).abs() <= 1).all(), (above, n)
    if p == 100.0:
        assert torch.equal(s, quantize(x, f, gran, "amax").scale)
    else:
        q = quantize(x, f, gran, "percentile", percentile=p)
        y = x / bcast(s, gran)
        assert q.saturated == int((y.abs() >= f.first_overflow).sum())
        assert q.saturated > 0 or n * (1 - p / 100) < 1
        assert (q.data.to(torch.float32).abs() <= f.max).all()


# --------------------------------------------------------------- bit-exact RNE on all 2^16 inputs


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_16bit_pattern_is_rounded_like_torch(src, fmt):
    f = FORMATS[fmt]
    x_all = all_16bit(src)
    x = x_all[torch.isfinite(x_all)].reshape(-1, 1, 1)
    before = x.clone()
    q = quantize(x, fmt, "tensor", 1.0)
    got = q.data.view(U8)
    assert torch.equal(got, ref_cast(x, f))
    oracle, ties = rne_oracle(x.to(torch.float32), f)
    assert torch.equal(got, oracle)
    assert ties > 0  # the sweep really exercises round-half-to-even
    a = x.to(torch.float64).abs()
    n_sat = int((a >= f.first_overflow).sum())  # e4m3's tie 464 rounds to 448: not counted
    assert q.saturated == n_sat
    assert n_sat > 0  # fp16's 65504 is past e5m2's threshold 61440 too
    # Non-zero values at most half the smallest subnormal round (ties to even) to zero.
    assert q.underflow == int(((a > 0) & (a <= f.min_subnormal / 2)).sum()) > 0
    assert torch.isfinite(q.dequantize()).all()
    assert torch.equal(x.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_nonfinite_saturate_on_every_bf16_pattern(fmt):
    f = FORMATS[fmt]
    x = all_16bit(torch.bfloat16)
    fin = torch.isfinite(x)
    q = quantize(x, fmt, "tensor", 1.0, nonfinite="saturate")
    d = q.dequantize()
    assert torch.equal(q.data.view(U8)[fin], ref_cast(x[fin], f))
    assert (d[x == float("inf")] == f.max).all() and (d[x == -float("inf")] == -f.max).all()
    assert (d[torch.isnan(x)] == 0).all()
    assert q.nonfinite == int((~fin).sum()) == 256
    n_inf = int(torch.isinf(x).sum())
    assert q.saturated == int((x[fin].to(torch.float32).abs() >= f.first_overflow).sum()) + n_inf
    assert torch.isfinite(d).all()
    with pytest.raises(ValueError, match=r"x has 256 non-finite value\(s\)"):
        quantize(x, fmt, "tensor", 1.0)


# --------------------------------------------------------------------------- saturation / underflow


def test_e5m2_huge_values_saturate_where_torch_overflows():
    f = FORMATS["e5m2"]
    x = torch.tensor([60000.0, 61439.0, 61440.0, 1e6, -1e30, 57344.0, -70000.0, 1.0]).reshape(-1, 1, 1)
    bare = x.to(torch.float8_e5m2).to(torch.float32)
    assert torch.isinf(bare).sum() == 4  # the hazard being guarded against
    q = quantize(x, "e5m2", "tensor", 1.0)
    d = q.dequantize().reshape(-1)
    assert torch.isfinite(d).all()
    assert d.tolist() == [f.max, f.max, f.max, f.max, -f.max, f.max, -f.max, 1.0]
    # 60000 and 61439 round to max anyway (below max + half an ulp): not counted as saturated.
    assert q.saturated == 4


def test_e4m3_saturation_counts_and_sign(gen):
    f = FORMATS["e4m3"]
    x = torch.randn(54, 2, 24, generator=gen) * 300
    q = quantize(x, "e4m3", "tensor", 1.0)
    d = q.dequantize()
    big = x.abs() >= f.first_overflow
    assert q.saturated == int(big.sum()) > 0
    assert torch.equal(d[big], torch.sign(x[big]) * f.max)
    assert not torch.isnan(d).any()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturation_counts_what_rounds_past_max_at_the_exact_tie(fmt):
    """Counted: what round-to-nearest-even would take past max. The tie between max and the next
    (unrepresentable) code goes to the even mantissa: e4m3's 448 = 1.110b x 2^8 is even, so its tie
    464 rounds down to max and is not an overflow; e5m2's 57344 = 1.11b x 2^15 is odd, so its tie
    61440 rounds up (torch's bare cast gives inf) and is. Just above the tie both overflow."""
    f = FORMATS[fmt]
    tie = torch.tensor(f.overflow_threshold, dtype=torch.float32)
    below, above = torch.nextafter(tie, torch.tensor(0.0)), torch.nextafter(tie, torch.tensor(math.inf))
    x = torch.stack([torch.tensor(f.max), below, tie, above])
    x = torch.cat([x, -x]).reshape(-1, 1, 1)
    tie_overflows = fmt == "e5m2"
    q = quantize(x, fmt, "tensor", 1.0)
    assert q.data.to(torch.float32).reshape(-1).tolist() == [f.max] * 4 + [-f.max] * 4  # all stored as ±max
    assert q.saturated == 2 * (1 + tie_overflows)  # `above` of each sign, and the tie when it rounds up
    assert f.tie_overflows == tie_overflows
    assert f.first_overflow == float(tie if tie_overflows else above)
    if fmt == "e5m2":  # IEEE-like: torch's unclamped cast shows which ones overflow
        assert (~torch.isfinite(x.to(f.torch_dtype).float())).sum() == q.saturated


def test_underflow_counted(gen):
    f = FORMATS["e4m3"]
    x = torch.zeros(15, 1, 40)
    x[0, 0, :5] = torch.tensor([1e-9, -1e-6, f.min_subnormal / 2, f.min_subnormal * 0.51, 1.0])
    q = quantize(x, "e4m3", "tensor", 1.0)
    # 1e-9, -1e-6 and the exact half (tie -> even code 0) vanish; 0.51 x min_sub rounds up.
    assert q.underflow == 3
    assert q.dequantize()[0, 0, 3] == f.min_subnormal
    assert q.underflow_fraction == 3 / x.numel()


# ----------------------------------------------------------------------- the input is not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gran", GRANS)
def test_input_never_modified(dtype, gran, gen):
    x = (torch.randn(17, 3, 24, generator=gen) * 1000).to(dtype)
    x[0, 0, 0] = float("inf")
    x[1, 1, 1] = float("nan")
    x[2, 2, 2] = -float("inf")
    before = x.clone()
    for scale in ("amax", "percentile", 0.5):
        q = quantize(x, "e4m3", gran, scale, nonfinite="saturate")
        assert q.nonfinite == 3
        assert torch.equal(x.nan_to_num(7.0), before.nan_to_num(7.0))
        assert torch.isnan(x[1, 1, 1]) and torch.isinf(x[0, 0, 0])
        assert q.data.data_ptr() != x.data_ptr()


# ---------------------------------------------------------------------------------- non-finite


def test_nonfinite_raises_with_count_and_first_index():
    x = torch.zeros(4, 3, 5)
    x[1, 2, 3] = float("nan")
    x[2, 0, 1] = float("inf")
    x[3, 1, 1] = -float("inf")
    with pytest.raises(ValueError, match=r"x has 3 non-finite value\(s\) \(NaN/Inf\); the first is at "
                                         r"index \(1, 2, 3\)"):
        quantize(x)
    with pytest.raises(ValueError, match=r"x has 1 non-finite .* index \(0, 1, 0\)"):
        quantize(torch.tensor([[1.0], [float("inf")]]).unsqueeze(0).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz"])
def test_nonfinite_saturate_maps_and_counts(fmt):
    f = FORMATS[fmt]
    x = torch.tensor([[1.0, float("inf"), float("nan"), -float("inf"), -0.5]]).reshape(1, 1, 5)
    q = quantize(x, fmt, "tensor", nonfinite="saturate")
    assert q.nonfinite == 3
    # The amax scale comes from the finite values, so 1.0 and -0.5 survive; ±Inf -> ±max.
    assert torch.equal(q.scale, torch.tensor(1.0) / f.max)
    assert q.data.to(torch.float32).reshape(-1).tolist() == [f.max, f.max, 0.0, -f.max, -f.max / 2]
    assert q.dequantize().reshape(-1).tolist() == pytest.approx([1.0, 1.0, 0.0, -1.0, -0.5], rel=1e-6)
    assert q.saturated == 2  # the two infinities were clamped
    assert q.underflow == 0


# ------------------------------------------------------------------------------ property tests
#
# Why the bound: in the binade [2^e, 2^(e+1)) with e >= emin the codes are 2^(e-m) apart, so
# round-to-nearest is off by at most half of that, 2^(e-m-1) with e = floor(log2|y|) (rounding up
# to 2^(e+1) included). Below min_normal the codes are min_subnormal apart: error <= min_sub/2,
# which is <= 2^(e-m-1) for every normal e, so max(...) covers both ranges. Between max and
# max + half an ulp the clamp gives max, still within half an ulp (max's binade). Back in x units:
# y = fl(x/s), x_hat = fl(Q(y) s), each fp32 op off by <= 2^-24 relative (plus 2^-149 absolute
# near fp32 subnormals), so |x - x_hat| <= s * bound(y) + 2^-24 (|x| + |x_hat|) + 2^-149.


def half_ulp_bound(y: torch.Tensor, f) -> torch.Tensor:
    a = y.to(torch.float64).abs()
    e = torch.floor(torch.log2(a.clamp(min=f.min_subnormal)))
    return torch.maximum(torch.exp2(e - f.mantissa_bits - 1), torch.full_like(a, f.min_subnormal / 2))


finite32 = st.floats(min_value=-1e7, max_value=1e7, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    xs=st.lists(finite32, min_size=1, max_size=48),
    scale=st.floats(min_value=2.0**-10, max_value=2.0**10, width=32),
    fmt=st.sampled_from(sorted(FORMATS)),
)
def test_property_half_ulp_and_saturation(xs, scale, fmt):
    f = FORMATS[fmt]
    x = torch.tensor(xs, dtype=torch.float32).reshape(-1, 1, 1)
    q = quantize(x, fmt, "tensor", scale)
    y = x / torch.tensor(scale, dtype=torch.float32)  # the same fp32 division quantize performs
    qy = q.data.to(torch.float64)
    x_hat = q.dequantize().to(torch.float64)
    assert torch.isfinite(x_hat).all()
    inside = y.abs() < f.first_overflow
    err_y = (y.to(torch.float64) - qy).abs()
    assert (err_y[inside] <= half_ulp_bound(y, f)[inside]).all()
    x64 = x.to(torch.float64)
    bound_x = scale * half_ulp_bound(y, f) + 2.0**-24 * (x64.abs() + x_hat.abs()) + 2.0**-149
    assert ((x64 - x_hat).abs()[inside] <= bound_x[inside]).all()
    # Saturation: every |y| >= first_overflow maps to ±max with y's sign, and is counted.
    out = ~inside
    assert torch.equal(qy[out], torch.sign(y[out]).to(torch.float64) * f.max)
    assert q.saturated == int(out.sum())
    assert q.underflow == int(((qy == 0) & (x != 0)).sum())


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    mags=st.lists(st.floats(min_value=1.0, max_value=2.0**100, width=32), min_size=1, max_size=32),
    neg=st.booleans(),
    fmt=st.sampled_from(sorted(FORMATS)),
)
def test_property_everything_past_threshold_saturates(mags, neg, fmt):
    f = FORMATS[fmt]
    x = torch.tensor(mags, dtype=torch.float32).reshape(-1, 1, 1) * f.first_overflow
    x = -x if neg else x
    q = quantize(x, fmt, "tensor", 1.0)
    assert q.saturated == x.numel()
    assert (q.data.to(torch.float32) == (-f.max if neg else f.max)).all()


# -------------------------------------------------------------------------------------- errors


def test_errors_by_message(gen):
    x = torch.randn(5, 3, 24, generator=gen)
    with pytest.raises(ValueError, match=r"granularity='block' is not supported; expected one of"):
        quantize(x, granularity="block")
    with pytest.raises(ValueError, match=r"scale of shape \(4,\) does not fit granularity 'head': "
                                         r"expected shape \(3,\)"):
        quantize(x, granularity="head", scale=torch.ones(4))
    with pytest.raises(ValueError, match=r"does not fit granularity 'token_head': expected shape \(5, 3\)"):
        quantize(x, granularity="token_head", scale=torch.ones(3, 5))
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.tensor([1.0, 0.0, 1.0])):
        with pytest.raises(ValueError, match=r"scale must be positive and finite"):
            quantize(x, granularity="head", scale=bad)
    with pytest.raises(ValueError, match=r"scale='max' is not a known scale method"):
        quantize(x, scale="max")
    with pytest.raises(ValueError, match=r"percentile=0.0 must be in \(0, 100\]"):
        quantize(x, scale="percentile", percentile=0.0)
    with pytest.raises(ValueError, match=r"percentile=101 must be in"):
        quantize(x, scale="percentile", percentile=101)
    with pytest.raises(ValueError, match=r"nonfinite='clip'; expected 'raise' or 'saturate'"):
        quantize(x, nonfinite="clip")
    with pytest.raises(ValueError, match=r"at least 2 dims \[\.\.\., heads, head_dim\]; got shape \(24,\)"):
        quantize(x[0, 0])
    with pytest.raises(ValueError, match=r"fmt='e3m4' is not a known FP8 format"):
        quantize(x, "e3m4")


def test_float64_values_beyond_fp32_are_refused_naming_the_value():
    """1e300 is finite: not 'non-finite (value inf)' but beyond float32's range, where the quantizer
    computes; refused in both nonfinite modes (they are about NaN/Inf), not counted as nonfinite."""
    x = torch.ones(2, 2, 4, dtype=torch.float64)
    x[1, 0, 2] = -1e300
    msg = (r"x has 1 value\(s\) beyond float32's range; the first is at index \(1, 0, 2\) \(value -1e\+300\); "
           r"expected \|values\| <= 3.4028234663852886e\+38")
    for nonfinite in ("raise", "saturate"):
        with pytest.raises(ValueError, match=msg):
            quantize(x, nonfinite=nonfinite)
    with pytest.raises(ValueError, match=msg):
        compute_scale(x)
    x[1, 0, 2] = -3e38  # within float32's range: quantized as usual
    q = quantize(x)
    assert q.saturated == 0 and float(q.dequantize()[1, 0, 2]) == pytest.approx(-3e38, rel=2.0**-4)
    x[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"x has 1 non-finite value\(s\) .* \(value nan\)"):
        quantize(x)


@pytest.mark.parametrize("scale, exc, pattern", [
    (1e-300, ValueError, r"scale=1e-300 underflows float32 \(it becomes 0.0 there, and scales are fp32\); "
                         r"expected positive values in \[1.401e-45, 3.4028235e\+38\]"),
    (1e300, ValueError, r"scale=1e\+300 overflows float32 \(it becomes inf there"),
    ([1.0, 1e-300], ValueError, r"scale\[1\]=1e-300 underflows float32"),
    (torch.tensor([1.0, 1e-300], dtype=torch.float64), ValueError, r"scale\[1\]=1e-300 underflows float32"),
    (["a"], TypeError, r"scale=\['a'\] is not a list of numbers; expected None, a method name among"),
    ([[1.0], [1.0, 2.0]], TypeError, r"scale=\[\[1.0\], \[1.0, 2.0\]\] is not a list of numbers"),
])
def test_scales_float32_cannot_hold_and_non_numbers_are_refused(scale, exc, pattern):
    with pytest.raises(exc, match=pattern):
        quantize(torch.randn(4, 2, 8), "e4m3", "head", scale)


def test_smallest_float32_scale_is_accepted():
    q = quantize(torch.ones(1, 1, 2), "e4m3", "tensor", 1.4e-45)  # fp32's smallest subnormal
    assert float(q.scale) == 2.0**-149 and q.saturated == 2


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2])
def test_wrong_dtype_is_type_error(dtype):
    x = torch.ones(2, 3, 8).to(dtype)
    with pytest.raises(TypeError, match=rf"x must be a float16/bfloat16/float32/float64 tensor, got {dtype}"):
        quantize(x)


@pytest.mark.parametrize("bad", [[[1.0, 2.0]], 3.0, None])
def test_non_tensor_is_type_error(bad):
    with pytest.raises(TypeError, match=rf"x must be a torch.Tensor, got {type(bad).__name__}"):
        quantize(bad)


# ------------------------------------------------------------------------- error metric + sizes


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("gran", GRANS)
def test_quantization_error_within_unit_roundoff(fmt, gran, gen, assert_rel_err):
    """amax-scaled random data: relative error at most the format's unit roundoff (RMS well below)."""
    f = FORMATS[fmt]
    x = torch.randn(54, 4, 40, generator=gen)
    q = quantize(x, fmt, gran)
    assert_rel_err(q.dequantize(), x, f.unit_roundoff, f"{fmt}/{gran} dequantized vs x")
    r = relative_error(q.dequantize(), x)
    num = float((q.dequantize().double() - x.double()).norm() / x.double().norm())
    assert r == pytest.approx(num, rel=1e-12)
    assert relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert relative_error(torch.ones(4), torch.zeros(4)) == 2.0


@pytest.mark.parametrize("a, ref, exc, match", [
    (torch.ones(2, 1), torch.ones(1, 3), ValueError, r"a has shape \(2, 1\) but ref has \(1, 3\)"),  # broadcast: 0.0
    (torch.ones(3), torch.ones(1), ValueError, "expected one shape"),
    ([1.0], torch.ones(1), TypeError, "a must be a torch.Tensor")])
def test_relative_error_compares_tensors_of_one_shape(a, ref, exc, match):
    with pytest.raises(exc, match=match):
        relative_error(a, ref)


@pytest.mark.parametrize("kw, exc, match", [(dict(num_layers=-1), ValueError, "num_layers=-1"),
                                            (dict(num_kv_heads=2.5), TypeError, "num_kv_heads"),
                                            (dict(head_dim=True), TypeError, "head_dim"),
                                            (dict(granularity=None, num_layers=0), ValueError, "num_layers=0")])
def test_kv_scale_bytes_refuses_bad_sizes(kw, exc, match):
    """Negative sizes gave negative bytes; the sizes are checked for a 16-bit cache too."""
    args = dict(granularity="head", num_layers=2, num_kv_heads=8, head_dim=128) | kw
    with pytest.raises(exc, match=match):
        kv_scale_bytes(args.pop("granularity"), **args)


@pytest.mark.parametrize("divisor, exc", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                          ("448", TypeError)])
def test_scale_from_stat_refuses_a_divisor_that_is_not_positive(divisor, exc):
    from fp8kv.quant import scale_from_stat

    with pytest.raises(exc, match="divisor"):
        scale_from_stat(torch.ones(3), divisor)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_kv_scale_bytes_counts_the_scales_quantize_stores(granularity):
    tokens, heads, head_dim, layers = 5, 3, 16, 7
    x = torch.randn(tokens, heads, head_dim)
    stored = quantize(x, "e4m3", granularity).scale_nbytes  # one layer, one of K / V
    fixed, per_token = kv_scale_bytes(granularity, num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
    assert fixed + per_token * tokens == layers * 2 * stored
    assert (per_token > 0) == (granularity == "token_head")
    assert kv_scale_bytes(None, num_layers=layers, num_kv_heads=heads, head_dim=head_dim) == (0, 0)
    with pytest.raises(ValueError, match="granularity='block'"):
        kv_scale_bytes("block", num_layers=layers, num_kv_heads=heads, head_dim=head_dim)


@pytest.mark.parametrize("call, exc, match", [
    (lambda x, q: q.dequantize(True), TypeError, r"dtype=True; expected a torch dtype among: float16"),  # bool out
    (lambda x, q: q.dequantize(""), TypeError, r"dtype=''; expected a torch dtype"),  # torch's RuntimeError before
    (lambda x, q: q.dequantize(torch.int32), TypeError, r"dtype=torch.int32; expected"),
    (lambda x, q: reduce_dims(3, "block"), ValueError, r"granularity='block' is not supported"),  # KeyError before
    (lambda x, q: reduce_dims(1.5, "head"), TypeError, r"ndim=1.5 \(float\); expected an int"),
    (lambda x, q: reduce_dims(1, "head"), ValueError, r"ndim=1; expected an int >= 2"),
    (lambda x, q: scale_shape(5, "head"), TypeError, r"shape=5 \(int\); expected a tuple of ints"),
    (lambda x, q: scale_shape("bogus", "head"), TypeError, r"shape='bogus' \(str\)"),  # ('u',) before
    (lambda x, q: scale_from_stat(None, 448.0), TypeError, "stat must be a torch.Tensor"),  # AttributeError before
    (lambda x, q: scale_from_stat(torch.ones(2, dtype=torch.complex64), 448.0), TypeError, "stat has dtype"),
    (lambda x, q: cast_saturating(x.tolist(), FORMATS["e4m3"]), TypeError, "y must be a torch.Tensor"),
    (lambda x, q: cast_saturating(x.to(torch.complex64), "e4m3"), TypeError, "y has dtype complex64"),
    (lambda x, q: cast_saturating(x.to("meta"), "e4m3"), ValueError, "y is on meta"),  # torch's RuntimeError before
    (lambda x, q: cast_saturating(x, "e3m4"), ValueError, r"fmt='e3m4' is not a known FP8 format"),
    (lambda x, q: cast_saturating(x, "e4m3", count="no"), TypeError, r"count='no' \(str\); expected True or False"),
    (lambda x, q: relative_error(x, x.to("meta")), ValueError, "ref is on meta"),
])
def test_quant_helpers_refuse_bad_arguments_by_name(call, exc, match):
    x = torch.randn(4, 2, 8)
    with pytest.raises(exc, match=match):
        call(x, quantize(x))


def test_cast_saturating_takes_a_format_by_name():
    y = torch.tensor([1.0, 500.0, -3.0])
    data, saturated = cast_saturating(y, "e4m3")
    assert saturated == 1 and data.to(torch.float32).tolist() == [1.0, 448.0, -3.0]
    assert quantize(y.reshape(1, 1, 3), scale=1.0).dequantize(torch.float16).dtype == torch.float16


def test_dequantize_past_the_dtypes_range_is_refused_by_name():
    """e4m3 codes times a large scale exceed fp16's 65504: the narrower dtype is named, not filled with inf."""
    q = quantize(torch.tensor([[1.0, -2.0e5]]), "e4m3", granularity="tensor", scale="amax")
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize().to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"dtype=torch.float16: the decoded values reach .* past torch.float16's"):
        q.dequantize(torch.float16)
