"""Numeric edges of the inputs, where each enters: every accepted value computes right (against the
fp32 oracle, or an independent computation) or is refused by name with the range that works.

* attention variants: soft caps at both ends of [1e-6, 1e30], sm_scale at both ends of the range
  ``checks.softmax_scale`` gives it with and without a cap, sink logits as strided / expanded views
  and at ±1e38, windows past int32;
* the quantizer: deep-subnormal inputs keep their codes; the saturation count of an explicit scale
  equals the count an unbounded round-to-nearest-even implies, on a dense sweep around each
  format's max, for every granularity (and through the cache's writes);
* FlashInfer prefill's query counts; the cache's methods after ``seq_lens`` / ``block_table`` were
  edited in place.

The kernels run under the Triton interpreter on CPU with fp16 queries (its bf16 is wrong).
Tolerances are the oracle's (``fp8kv.reference``): a cap or a sink adds no rounding of its own.
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from fixtures import DEVICE, seeded

import fp8kv
from fp8kv import checks
from fp8kv.backends import flashinfer as fib
from fp8kv.formats import FORMATS
from fp8kv.ops import paged_decode
from fp8kv.quant import GRANULARITIES, broadcast_scale, quantize, relative_error, scale_from_stat, scale_shape
from fp8kv.reference import decode as ref_decode
from fp8kv.reference import lse_tolerance, output_tolerance

LOG2E = math.log2(math.e)
LENS = (5, 19)


@pytest.fixture(name="make_cache")
def _device_cache(make_cache):
    """The shared cache factory (conftest) on this module's device: 2 sequences, 2 KV heads, D = 32."""
    return functools.partial(make_cache, lens=LENS, device=DEVICE)


def query(hq=4, d=32, seed=1, worst=True):
    """fp16 ``[2, hq, d]``; ``worst``: one head all zero (a zero dot times an inf factor is NaN) and
    one holding fp16's largest magnitudes (the factor times them must stay finite)."""
    g = seeded(seed)
    q = torch.randn(len(LENS), hq, d, generator=g)
    if worst:  # both exact in e4m3 after fp8 mode's per-head scale (amax / 448), so every mode sees them
        q[0, 1] = 0.0
        q[1, 2] = 0.0
        q[1, 2, :4] = torch.tensor([65504.0, -65504.0, 65504.0, -65504.0])
    return q.to(DEVICE, torch.float16)


def assert_matches_oracle(out, lse, q, cache, mode="dequant", **kw):
    ref, ref_lse = ref_decode(q, cache, **kw)
    assert torch.isfinite(ref).all() and torch.isfinite(ref_lse).all(), "the oracle itself"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), f"{kw}: non-finite output"
    tol = output_tolerance("triton", mode, q.dtype, cache.granularity)
    err = relative_error(out.float(), ref)
    assert err <= tol, f"{kw}: relative error {err:.2e} > {tol:.1e}"
    lse_err = float((lse - ref_lse).abs().max())
    assert lse_err <= lse_tolerance("triton", mode, q.dtype, ref_lse), f"{kw}: lse error {lse_err:.3g}"


# The Triton kernels: tensor-core dequant and fp8 modes, the CUDA-core kernel; one and three splits.
KERNELS = [("dequant", True), ("fp8", True), ("dequant", False)]
KERNEL_IDS = ["tc-dequant", "tc-fp8", "cuda_core"]


# ------------------------------------------------------------------------------------------- soft cap
BAD_CAPS = [9.99e-7, 1e-7, 1e-30, 1e-38, 1e-40, 1e-46, 5e-324, 1.0000001e30, 1e31, 1e300]


@pytest.mark.parametrize("cap", BAD_CAPS)
@pytest.mark.parametrize("entry", ["decode/reference", "decode/triton", "reference.decode", "checks"])
def test_soft_cap_outside_its_range_is_refused_with_the_range(cap, entry, make_cache):
    """Below 1e-6 the kernels' factor 2 / cap overflowed (NaN on every head with a zero dot); the
    oracle's 1 / cap did so below fp32's range."""
    q, cache = query(), make_cache()
    call = {"decode/reference": lambda: fp8kv.decode(q, cache, backend="reference", soft_cap=cap),
            "decode/triton": lambda: fp8kv.decode(q, cache, backend="triton", soft_cap=cap),
            "reference.decode": lambda: ref_decode(q, cache, soft_cap=cap),
            "checks": lambda: checks.attention_variant(None, cap, None, num_q_heads=4, device=DEVICE)}[entry]
    with pytest.raises(ValueError, match=r"soft_cap=\S+; expected a number in \[1e-06, 1e\+30\]"):
        call()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # e^(2x) -> inf gives tanh = 1, as on a GPU
@pytest.mark.parametrize("cap", [checks.MIN_SOFT_CAP, checks.MAX_SOFT_CAP], ids=["min", "max"])
@pytest.mark.parametrize("mode,tensor_cores", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_soft_caps_at_both_ends_compute_right(cap, mode, tensor_cores, splits, make_cache):
    q, cache = query(), make_cache(granularity="head")
    out, lse = fp8kv.decode(q, cache, backend="triton", mode=mode, soft_cap=cap, num_splits=splits, block_n=32,
                            use_tensor_cores=tensor_cores)
    assert_matches_oracle(out, lse, q, cache, mode, soft_cap=cap)


# ------------------------------------------------------------------------------------------- sm_scale
CAPS = [None, checks.MIN_SOFT_CAP, 30.0, checks.MAX_SOFT_CAP]


def scale_range(cap):
    """The sm_scale range for ``cap``, computed here from the rule: sm_scale x log2(e), and with a cap
    also x 2 / cap, within [2^-126, 2^64]."""
    factors = [LOG2E] + ([] if cap is None else [LOG2E * 2 / cap])
    return max(2.0**-126 / f for f in factors), min(2.0**64 / f for f in factors)


@pytest.mark.parametrize("cap", CAPS, ids=["nocap", "capmin", "cap30", "capmax"])
def test_softmax_scale_range_with_each_cap(cap, make_cache):
    lo, hi = scale_range(cap)
    assert checks.softmax_scale(lo, cap) == lo and checks.softmax_scale(hi, cap) == hi
    for bad in (lo * (1 - 1e-9), hi * (1 + 1e-9), 1e-300, 1e300):
        with pytest.raises(ValueError, match=re.escape(f"sm_scale={bad:g}; expected sm_scale in [{lo:.3g}, {hi:.3g}]")):
            checks.softmax_scale(bad, cap)
        with pytest.raises(ValueError, match="sm_scale="):
            ref_decode(query(), make_cache(), sm_scale=bad, soft_cap=cap)
    for bad, exc in ((0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (True, TypeError), ("1", TypeError)):
        with pytest.raises(exc, match="sm_scale="):
            checks.softmax_scale(bad, cap)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("cap,end", [(None, 0), (None, 1), (checks.MIN_SOFT_CAP, 0), (checks.MIN_SOFT_CAP, 1),
                                     (checks.MAX_SOFT_CAP, 0), (checks.MAX_SOFT_CAP, 1)],
                         ids=["nocap-lo", "nocap-hi", "capmin-lo", "capmin-hi", "capmax-lo", "capmax-hi"])
@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tc", "cuda_core"])
def test_sm_scale_at_the_ends_of_its_range_computes_right(cap, end, tensor_cores, make_cache):
    """The Triton kernel (dequant mode: fp8 mode's e4m3 query would pick another argmax where a huge
    sm_scale makes the softmax one-hot) against the oracle at each end of the range. At the low end
    the scores are ~0 (uniform attention), at the high end the softmax is one-hot: both must stay
    finite (no 0 x inf, no inf - inf)."""
    q, cache = query(worst=False), make_cache(granularity="head")
    sm = scale_range(cap)[end]
    out, lse = paged_decode(q, cache, sm_scale=sm, soft_cap=cap, num_splits=2, block_n=32,
                            use_tensor_cores=tensor_cores)
    assert_matches_oracle(out, lse, q, cache, sm_scale=sm, soft_cap=cap)


# ---------------------------------------------------------------------------------------------- sinks
def sink_views(hq=4):
    """name -> a float32 [hq] view the kernels must not read as if contiguous."""
    g = seeded(7)
    base = torch.randn(2 * hq, generator=g).to(DEVICE) * 3
    grid = (torch.randn(hq, 3, generator=g) * 3).to(DEVICE)
    return {
        "strided": base[::2],
        "expanded-scalar": torch.tensor(0.5, device=DEVICE).expand(hq),
        "transposed-row": grid.t()[1],
        "column-of-2d": grid[:, 2],
        "offset-strided": base[1::2],
    }


@pytest.mark.parametrize("view", list(sink_views()))
@pytest.mark.parametrize("backend,splits,tensor_cores", [("reference", 1, True), ("triton", 1, True),
                                                         ("triton", 3, True), ("triton", 1, False),
                                                         ("triton", 3, False)],
                         ids=["reference", "triton-1", "triton-3", "cuda_core-1", "cuda_core-3"])
@pytest.mark.parametrize("check", [True, False])
def test_sinks_of_any_strides_compute_right(view, backend, splits, tensor_cores, check, make_cache):
    """The kernels read sinks[h] at offset h: a strided or stride-0 view gave other heads' logits."""
    sinks = sink_views()[view]
    assert not sinks.is_contiguous()
    q, cache = query(), make_cache()
    launch = {} if backend == "reference" else dict(num_splits=splits, block_n=32, use_tensor_cores=tensor_cores)
    out, lse = fp8kv.decode(q, cache, backend=backend, sinks=sinks, check=check, **launch)
    ref, ref_lse = ref_decode(q, cache, sinks=sinks.contiguous().clone())
    tol = output_tolerance(backend, "dequant", q.dtype)
    assert relative_error(out.float(), ref) <= tol
    assert float((lse - ref_lse).abs().max()) <= lse_tolerance(backend, "dequant", q.dtype, ref_lse)


def test_sinks_are_handed_on_contiguous_without_a_host_sync():
    for name, sinks in sink_views().items():
        got = checks.attention_variant(None, None, sinks, num_q_heads=4, device=DEVICE, contents=False)[2]
        assert got.is_contiguous() and got.dtype == torch.float32 and torch.equal(got, sinks), name
    plain = torch.zeros(4, device=DEVICE)
    assert checks.attention_variant(None, None, plain, num_q_heads=4, device=DEVICE)[2] is plain  # no copy


FP32_MAX_SINK = float(torch.tensor(checks.MAX_SINK, dtype=torch.float32))  # 1e38 as fp32 (just below it)
OVER_SINK = float(torch.nextafter(torch.tensor(FP32_MAX_SINK), torch.tensor(math.inf)))


@pytest.mark.parametrize("sink", [FP32_MAX_SINK, -FP32_MAX_SINK], ids=["+max", "-max"])
@pytest.mark.parametrize("splits,tensor_cores", [(1, True), (3, True), (1, False), (3, False)])
def test_sinks_at_the_bound_compute_right(sink, splits, tensor_cores, make_cache):
    """+1e38 takes all the mass (out 0, lse = the sink); -1e38 none (as without sinks)."""
    q, cache = query(), make_cache()
    sinks = torch.full((4,), sink, device=DEVICE)
    out, lse = fp8kv.decode(q, cache, backend="triton", sinks=sinks, num_splits=splits, block_n=32,
                            use_tensor_cores=tensor_cores)
    ref, ref_lse = ref_decode(q, cache, sinks=sinks)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    if sink > 0:
        assert float(out.abs().max()) == 0.0 and torch.allclose(lse, ref_lse, rtol=1e-6) and torch.allclose(
            ref_lse, sinks.expand_as(ref_lse), rtol=1e-6)
    else:
        plain, plain_lse = ref_decode(q, cache)
        assert relative_error(ref, plain) <= 1e-6 and relative_error(ref_lse, plain_lse) <= 1e-6
        assert_matches_oracle(out, lse, q, cache, sinks=sinks)


@pytest.mark.parametrize("sink", [OVER_SINK, -OVER_SINK, 3e38, -3e38, torch.finfo(torch.float32).max])
@pytest.mark.parametrize("entry", ["decode/triton", "decode/reference", "reference.decode"])
def test_sinks_beyond_the_bound_are_refused_with_the_range(sink, entry, make_cache):
    """Past 2.36e38 the kernels' log2-unit sink is inf in fp32 (lse -inf, NaN outputs)."""
    q, cache = query(), make_cache()
    sinks = torch.zeros(4, device=DEVICE)
    sinks[2] = sink
    call = {"decode/triton": lambda: fp8kv.decode(q, cache, backend="triton", sinks=sinks),
            "decode/reference": lambda: fp8kv.decode(q, cache, backend="reference", sinks=sinks),
            "reference.decode": lambda: ref_decode(q, cache, sinks=sinks)}[entry]
    with pytest.raises(ValueError, match=r"sinks\[2\]=\S+; expected sink logits in \[-1e\+38, 1e\+38\]"):
        call()


# --------------------------------------------------------------------------------------------- window
@pytest.mark.parametrize("window", [checks.MAX_WINDOW, checks.MAX_WINDOW + 1, 2**63, 10**30])
def test_windows_past_int32_are_the_whole_sequence(window, make_cache):
    """Every length is int32: such a window is the whole sequence, handed on as 2^31 - 1 (FlashInfer's
    and vLLM's int32 window arguments hold it)."""
    assert checks.attention_variant(window, None, None, num_q_heads=4, device=DEVICE)[0] == checks.MAX_WINDOW
    assert fib.window_left(checks.MAX_WINDOW) == 2**31 - 2
    q, cache = query(), make_cache()
    for backend in ("reference", "triton"):
        out, lse = fp8kv.decode(q, cache, backend=backend, window=window)
        plain, plain_lse = fp8kv.decode(q, cache, backend=backend)
        assert torch.equal(out, plain) and torch.equal(lse, plain_lse), backend


# ------------------------------------------------------------------------------------------ quantizer
DEEP = [2.0**-149, 1e-44, 1e-42, 3e-41, 1e-39, 2.0**-126]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("method", ["amax", "vllm_k"])
@pytest.mark.parametrize("magnitude", DEEP, ids=[f"{m:.3g}" for m in DEEP])
def test_deep_subnormal_inputs_keep_their_codes(magnitude, method, fmt, granularity):
    """amax / 448 underflowed fp32 (scale 1: every code 0) or was rounded to a subnormal by up to half
    (the amax then saturated). Scale groups of one magnitude, both signs: no value may flush or
    saturate, and each comes back within the format's rounding plus fp32's subnormal spacing."""
    x = torch.full((3, 2, 8), magnitude, dtype=torch.float32)
    x[..., ::2] *= -1
    x[1] *= 0.75
    q = quantize(x, fmt, granularity, method)
    assert q.underflow == 0 and q.saturated == 0
    assert (q.scale > 0).all() and (q.scale <= 2.0**-126).all()
    err = (q.dequantize() - x).abs()
    bound = (FORMATS[fmt].unit_roundoff + 2.0**-23) * x.abs() + 2.0**-149
    assert (err <= bound).all(), float((err - bound).max())


def test_scale_from_stat_never_exceeds_the_divisor_and_never_flushes():
    """Over stats spanning fp32's subnormals: scale > 0, and stat / scale <= divisor (exactly, in fp64,
    where the quotient is subnormal)."""
    stat = torch.cat([torch.arange(1, 5000, dtype=torch.float64) * 2.0**-149,
                      torch.logspace(-45, -30, 3000, dtype=torch.float64)]).to(torch.float32)
    stat = stat[stat > 0]
    for divisor in (448.0, 57344.0, 240.0, 200.0, 100.0):
        s = scale_from_stat(stat, divisor)
        assert (s > 0).all() and s.dtype == torch.float32
        ratio = stat.double() / s.double()
        sub = s < 2.0**-126  # rounded up: within the divisor exactly; normal ones to nearest (2^-24)
        assert sub.any() and (ratio[sub] <= divisor).all(), divisor
        assert (ratio[~sub] <= divisor * (1 + 2.0**-24)).all(), divisor


def test_float64_values_below_fp32_are_counted_as_underflow():
    x = torch.full((2, 2, 4), 1e-50, dtype=torch.float64)
    x[0, 0, 0] = 0.0
    assert quantize(x).underflow == x.numel() - 1


def unbounded_rne(y: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """``y`` rounded to nearest-even with ``mantissa_bits`` and no largest exponent (fp64): the value an
    FP8 cast would produce if the format went on past its max."""
    y = y.to(torch.float64)
    exp = torch.floor(torch.log2(y.abs().clamp(min=2.0**min_exponent)))
    ulp = torch.exp2(exp - mantissa_bits)
    return torch.round(y / ulp) * ulp  # torch.round: half to even


def edge_sweep(fmt) -> torch.Tensor:
    """fp32 magnitudes densely around max and the tie past it (every fp32 within 64 ulps of each, and
    a linear sweep from 0.97 max to 1.03 x tie), with both signs."""
    f = FORMATS[fmt]
    points = []
    for centre in (f.max, f.overflow_threshold):
        c = torch.tensor(centre, dtype=torch.float32)
        bits = c.view(torch.int32) + torch.arange(-64, 65, dtype=torch.int32)
        points.append(bits.view(torch.float32))
    points.append(torch.linspace(0.97 * f.max, 1.03 * f.overflow_threshold, 2001, dtype=torch.float32))
    y = torch.cat(points)
    return torch.cat([y, -y])


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64])
def test_explicit_scale_saturation_count_matches_the_cast(fmt, granularity, x_dtype):
    """quantize's ``saturated`` with a fixed scale = the elements whose quotient x / scale (fp32, as
    stored) an unbounded round-to-nearest-even takes past max; where torch's own cast marks overflow
    (inf / NaN: e5m2 and the fnuz formats; its e4m3fn cast saturates instead) it says the same. So
    e4m3's 464 (the tie, rounding to 448) is not counted, e5m2's 61440 is."""
    f = FORMATS[fmt]
    y = edge_sweep(fmt)
    n = y.numel()
    heads, d = 2, 8
    tokens = -(-n // (heads * d))
    yy = torch.cat([y, y[: tokens * heads * d - n]]).reshape(tokens, heads, d)
    g = seeded(3)
    shape = scale_shape(yy.shape, granularity)
    scale = (0.25 + torch.rand(shape, generator=g) * 3).float() if shape else torch.tensor(0.37)
    s_b = broadcast_scale(scale, 3, granularity)
    x = (yy.double() * s_b.double()).to(x_dtype)  # quotients land on and around the edges
    q = quantize(x, fmt, granularity, scale=scale)
    quotient = x.to(torch.float32) / s_b  # what the quantizer casts (fp32 arithmetic)
    mant, min_exp = f.mantissa_bits, 1 - f.bias
    expected = int((unbounded_rne(quotient, mant, min_exp).abs() > f.max).sum())
    assert q.saturated == expected, (q.saturated, expected)
    assert expected > 0 and (quotient.abs() > f.max).sum() > expected  # the sweep straddles both edges
    cast = quotient.to(f.torch_dtype).to(torch.float32)
    if f.name != "e4m3":
        assert int((~torch.isfinite(cast)).sum()) == expected


@pytest.mark.parametrize("granularity", ["tensor", "head", "channel"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_cache_write_saturation_count_matches_the_cast(kv_dtype, granularity):
    """The cache's static-scale write counts as quantize does: against the unbounded rounding."""
    from fixtures import make_cache

    cache = make_cache([1], 2, 8, kv_dtype=kv_dtype, granularity=granularity, max_seq_len=1024)
    fmt = kv_dtype.removeprefix("fp8_")
    f = FORMATS[fmt]
    y = edge_sweep(fmt)
    rows = y.numel() // 16
    yy = y[: rows * 16].reshape(rows, 2, 8)
    ks = broadcast_scale(cache.k_scale, 3, granularity)
    x = (yy.double() * ks.double()).float()
    before = cache.saturated
    slots = cache.slots(0, torch.arange(1, 1 + rows))
    n = cache.write(x, torch.zeros_like(x), slots)
    quotient = x / ks
    expected = int((unbounded_rne(quotient, f.mantissa_bits, 1 - f.bias).abs() > f.max).sum())
    assert n == expected == cache.saturated - before and expected > 0


# ------------------------------------------------------------------------------ FlashInfer prefill
BAD_COUNTS = [
    ([2, 1.5], TypeError, r"qo_lens\[1\]=1.5 \(float\)"),
    ([2.0, 3], TypeError, r"qo_lens\[0\]=2.0 \(float\)"),
    ([True, 4], TypeError, r"qo_lens\[0\]=True \(bool\)"),
    ([2, torch.tensor(3.0)], TypeError, r"qo_lens\[1\]=tensor\(3\.\) \(Tensor\)"),
    (torch.tensor([2.0, 3.0]), TypeError, "qo_lens has dtype float32"),
    (torch.tensor([2, 3], dtype=torch.float64), TypeError, "qo_lens has dtype float64"),
    (torch.tensor([True, False]), TypeError, "qo_lens has dtype bool"),
    (torch.tensor([[2, 3]]), ValueError, r"qo_lens must be 1-D"),
    (5, TypeError, r"qo_lens=5 \(int\); expected a list of ints"),
    (None, TypeError, r"qo_lens=None \(NoneType\)"),
    ("23", TypeError, r"qo_lens='23' \(str\)"),
    ([2, -1], ValueError, r"qo_lens\[1\]=-1 is negative"),
]


@pytest.mark.parametrize("counts,exc,words", BAD_COUNTS, ids=[str(i) for i in range(len(BAD_COUNTS))])
@pytest.mark.parametrize("entry", ["prefill", "qo_indptr"])
def test_prefill_query_counts_must_be_integers(counts, exc, words, entry):
    """Checked before FlashInfer is asked (it is not needed to reach the refusal)."""
    from fixtures import make_cache

    cache = make_cache([4, 6], 2, 16)
    q = torch.randn(5, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(exc, match=words):
        if entry == "prefill":
            fib.prefill(q, counts, cache)
        else:
            fib.qo_indptr(counts)


def test_prefill_query_counts_that_are_integers_pass():
    for counts in ([2, 3], (2, 3), torch.tensor([2, 3]), torch.tensor([2, 3], dtype=torch.int32)):
        assert fib.query_counts(counts).tolist() == [2, 3]
        assert fib.qo_indptr(counts).tolist() == [0, 2, 5]


# --------------------------------------------------------------------------- cache tables edited in place
def corrupt(cache, how):
    """Edit ``cache``'s tables in place (sequence 1 of lengths (5, 19), 16-token pages, 2 pages a row)."""
    if how == "seq_len-past-capacity":
        cache.seq_lens[1] = 40
        return r"seq_lens\[1\]=40 exceeds the capacity of its block-table row \(2 blocks x 16 = 32 tokens\)"
    if how == "seq_len-negative":
        cache.seq_lens[1] = -3
        return r"seq_lens\[1\]=-3 is negative"
    if how == "page-out-of-range":
        cache.block_table[1, 1] = 99
        return r"block_table\[1, 1\]=99 is out of range \[0, 4\)"
    if how == "page-negative":
        cache.block_table[1, 0] = -1
        return r"block_table\[1, 0\]=-1 is out of range \[0, 4\)"
    if how == "table-swapped-float":
        cache.seq_lens = cache.seq_lens.float()
        return "seq_lens must be int32"
    raise AssertionError(how)


CORRUPTIONS = ["seq_len-past-capacity", "seq_len-negative", "page-out-of-range", "page-negative",
               "table-swapped-float"]
READERS = {
    "gather": lambda c: c.gather(1),
    "validate_tables": lambda c: c.validate_tables(),
    "validate_arrays": lambda c: (c.validate_arrays(), c.validate_tables()),
    "append": lambda c: c.append(torch.randn(2, 2, 32, device=c.device), torch.randn(2, 2, 32, device=c.device)),
    "append_tokens": lambda c: c.append_tokens(torch.randn(1, 2, 32, device=c.device),
                                               torch.randn(1, 2, 32, device=c.device), [0, 1]),
    "write": lambda c: c.write(torch.randn(1, 2, 32, device=c.device), torch.randn(1, 2, 32, device=c.device),
                               torch.tensor([0], device=c.device)),
    "reference": lambda c: ref_decode(query(), c),
    "decode": lambda c: fp8kv.decode(query(), c, backend="reference"),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("how", CORRUPTIONS)
def test_cache_methods_name_tables_edited_in_place(how, reader, make_cache):
    """Every method that reads seq_lens / block_table after construction names the bad value (it
    raised IndexError, appended at a row's end through a negative length, or read other pages)."""
    cache = make_cache(max_seq_len=32)
    assert cache.max_blocks_per_seq == 2 and cache.num_blocks == 4
    words = corrupt(cache, how)
    with pytest.raises((ValueError, TypeError), match=words):
        READERS[reader](cache)


@pytest.mark.parametrize("how", ["table-swapped-float", "page-out-of-range"])
def test_slots_names_a_bad_table(how, make_cache):
    cache = make_cache(max_seq_len=32)
    words = corrupt(cache, how)
    with pytest.raises((ValueError, TypeError), match=words if how != "page-out-of-range" else
                       r"block_table\[1, 1\]=99, which is not a page in \[0, 4\)"):
        cache.slots(1, torch.tensor([20]))
