"""Attention variants (sliding window, logit soft-capping, sinks) in the oracle and the Triton kernel.

The oracle (``fp8kv.reference``) is checked on cases computed by hand; the kernel against the oracle
on the dequantized cache, under the interpreter on CPU (fp16 queries) and compiled on a GPU. The
tolerances are those of ``tests/test_ops.py`` (derived there from FP8 and 16-bit rounding): a window
only removes terms, a cap only bends scores (|d tanh| <= 1, so score errors do not grow) and a sink
only adds one fp32 term to the denominator, so none of them adds rounding of its own.
"""

from __future__ import annotations

import math

import pytest
import torch
from fixtures import DEVICE, dequant_tol, make_q, matrix_cache, random_sinks, seeded

from fp8kv import decode as fp8kv_decode
from fp8kv.capability import VARIANTS, UnsupportedError, check_variant, variants
from fp8kv.reference import FP8_MODE_TOL, attention, lse_tolerance, output_tolerance
from fp8kv.reference import decode as ref_decode

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from test_ops import Q_DTYPES  # noqa: E402

from fp8kv.ops import launch_config, paged_decode  # noqa: E402
from fp8kv.ops.decode.triton_helpers import soft_cap_scores  # noqa: E402

FP8_NAN_CODE = 0x7F  # NaN in both e4m3fn (S.1111.111) and e5m2 (S.11111.11)


# ------------------------------------------------------------------------------------------ oracle
def test_oracle_window_keeps_the_last_tokens():
    """Window 1: the query sees only itself; window 2: the last two keys, by hand."""
    q = torch.tensor([[1.0, 0.0]])  # [Hq=1, D=2]
    k = torch.tensor([[[5.0, 0.0]], [[1.0, 0.0]], [[2.0, 0.0]]])  # [L=3, Hkv=1, D=2]: scores 5, 1, 2
    v = torch.tensor([[[10.0, 0.0]], [[20.0, 0.0]], [[30.0, 0.0]]])
    out, lse = attention(q, k, v, 1.0, window=1)
    assert torch.allclose(out, torch.tensor([[30.0, 0.0]])) and torch.allclose(lse, torch.tensor([2.0]))
    out, lse = attention(q, k, v, 1.0, window=2)
    p1, p2 = math.exp(1) / (math.exp(1) + math.exp(2)), math.exp(2) / (math.exp(1) + math.exp(2))
    assert torch.allclose(out, torch.tensor([[20 * p1 + 30 * p2, 0.0]]))
    assert torch.allclose(lse, torch.tensor([math.log(math.exp(1) + math.exp(2))]))
    full = attention(q, k, v, 1.0)
    for w in (3, 4, 1000):  # a window at least as long as the sequence is the whole sequence
        assert all(torch.equal(a, b) for a, b in zip(attention(q, k, v, 1.0, window=w), full, strict=True))


def test_oracle_window_is_transformers_sliding_window():
    """transformers' sliding-window mask (Gemma-3, Mistral) for the last query of L keys keeps exactly
    the oracle's window: the last W keys, the query's own included."""
    masking = pytest.importorskip("transformers.masking_utils")
    length = 12
    g = seeded(0)
    q, k, v = torch.randn(1, 8, generator=g), torch.randn(length, 1, 8, generator=g), torch.randn(length, 1, 8, generator=g)
    for w in (1, 5, 11, 12, 30):
        keep = masking.sliding_window_causal_mask_function(w)
        t = torch.tensor
        seen = [j for j in range(length) if bool(keep(t(0), t(0), t(length - 1), t(j)))]
        assert seen == list(range(max(0, length - w), length))
        assert torch.allclose(attention(q, k, v, 0.3, window=w)[0], attention(q, k[seen], v[seen], 0.3)[0])


def test_oracle_soft_cap_by_hand():
    q = torch.tensor([[1.0, 0.0]])
    k = torch.tensor([[[100.0, 0.0]], [[-3.0, 0.0]]])  # scores 50 and -1.5 at sm_scale 0.5
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    cap = 4.0
    s = [cap * math.tanh(50 / cap), cap * math.tanh(-1.5 / cap)]
    den = math.exp(s[0]) + math.exp(s[1])
    out, lse = attention(q, k, v, 0.5, soft_cap=cap)
    assert torch.allclose(out, torch.tensor([[math.exp(s[0]) / den, math.exp(s[1]) / den]]))
    assert torch.allclose(lse, torch.tensor([math.log(den)]))
    assert s[0] < cap  # far beyond the cap, the score is pinned just under it


def test_oracle_sinks_by_hand():
    """Two heads sharing one KV head: the sink enlarges each head's denominator, with no value."""
    q = torch.tensor([[1.0], [2.0]])  # [Hq=2, D=1]
    k = torch.tensor([[[1.0]]])  # one token: scores 1 and 2
    v = torch.tensor([[[6.0]]])
    sinks = torch.tensor([0.0, 5.0])
    out, lse = attention(q, k, v, 1.0, sinks=sinks)
    for h, s in enumerate((1.0, 2.0)):
        den = math.exp(s) + math.exp(float(sinks[h]))
        assert math.isclose(float(out[h, 0]), 6 * math.exp(s) / den, rel_tol=1e-6)
        assert math.isclose(float(lse[h]), math.log(den), rel_tol=1e-6)


def test_oracle_decode_validates_variants():
    cache = matrix_cache([3, 5], 2, 64)
    q = make_q(2, 4, 64, torch.float16)
    for bad, exc in ((0, ValueError), (-2, ValueError), (True, TypeError), (4.0, TypeError)):
        with pytest.raises(exc, match="window"):
            ref_decode(q, cache, window=bad)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="soft_cap"):
            ref_decode(q, cache, soft_cap=bad)


# ------------------------------------------------------------------------------- kernel vs oracle
LENS = [1, 17, 40]  # one token; one past a page; several pages
CAPACITY = 64  # page-table capacity (4 pages of 16): windows up to it take the windowed kernel path
SCALES = ["tensor", "head", "token_head"]
# (name, variants): window smaller than / equal to / larger than the sequences, not a page multiple
CASES = [
    ("window5", dict(window=5)),
    ("window16", dict(window=16)),  # = one page; = 17 - 1
    ("window17", dict(window=17)),  # = the second sequence
    ("window50", dict(window=50)),  # > every sequence, < capacity: the windowed path, covering all
    ("softcap", dict(soft_cap=2.0)),
    ("sinks", dict(sinks="random")),
    ("all", dict(window=7, soft_cap=3.0, sinks="random")),
]


def _cache(granularity, kv_dtype="fp8_e4m3", lens=LENS, seed=0):
    # pages reserved up to CAPACITY tokens per sequence, so every cache has the same page-table capacity
    c = matrix_cache(lens, 2, 64, kv_dtype=kv_dtype, granularity=granularity, seed=seed, max_seq_len=CAPACITY)
    assert c.max_blocks_per_seq * c.block_size == CAPACITY
    return c


def _variants(spec, hq, seed=3):
    out = dict(spec)
    if out.get("sinks") == "random":
        out["sinks"] = random_sinks(hq, seed)
    return out


def check_variant_against_oracle(q, cache, mode, variant_kw, *, out_dtype=None, **launch):
    out, lse = paged_decode(q, cache, mode=mode, out_dtype=out_dtype, **variant_kw, **launch)
    ref_out, ref_lse = ref_decode(q, cache, **variant_kw)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    tol = FP8_MODE_TOL if mode == "fp8" else dequant_tol(q.dtype, cache.granularity)
    err = float((out.float() - ref_out).norm() / ref_out.norm())
    assert err <= tol, f"{mode} {variant_kw}: rel err {err:.3e} > {tol:.3e}"
    lse_tol = lse_tolerance("triton", mode, q.dtype, ref_lse)
    lse_err = float((lse - ref_lse).abs().max())
    assert lse_err <= lse_tol, f"{mode} {variant_kw}: lse err {lse_err:.3e} > {lse_tol:.3e}"
    return out, lse


@pytest.mark.parametrize("mode", ["dequant", "fp8"])
@pytest.mark.parametrize("granularity", SCALES)
@pytest.mark.parametrize("name,spec", CASES, ids=[c[0] for c in CASES])
def test_variant_matches_oracle(name, spec, granularity, mode):
    if mode == "fp8" and granularity == "token_head":
        pytest.skip("fp8 mode takes tensor/head/channel scales (UnsupportedError tested in test_ops)")
    cache = _cache(granularity)
    q = make_q(len(LENS), 8, 64, Q_DTYPES[-1])
    kw = _variants(spec, 8)
    for splits in (1, 3):
        check_variant_against_oracle(q, cache, mode, kw, num_splits=splits, block_n=32)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # e^(2x) -> inf gives tanh = 1, as on a GPU
@pytest.mark.parametrize("mode", ["dequant", "fp8"])
def test_soft_cap_with_scores_far_beyond_the_cap(mode):
    """Keys x 40 push scaled scores to hundreds; a cap of 1 flattens them to within e^2 of each other."""
    cache = matrix_cache(LENS, 2, 64, k_spread=40.0, granularity="head")
    q = make_q(len(LENS), 8, 64, torch.float16)
    out, lse = check_variant_against_oracle(q, cache, mode, dict(soft_cap=1.0), num_splits=2, block_n=32)
    # |capped score| < 1, so lse lies within ln(L) +- 1
    lens = torch.tensor(LENS, dtype=torch.float32, device=lse.device)[:, None]
    assert ((lse - lens.log()).abs() <= 1.0 + 1e-3).all()


@triton.jit
def _soft_cap_probe(s_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, soft_cap_scores(tl.load(s_ptr + offs), 1.0))  # cap log2(e) = 1: tanh itself


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # the unselected exp form of large |x|
def test_kernel_tanh_is_accurate_near_zero_and_at_the_seam():
    """The kernels' tanh against fp64's, on the x the kernel sees (s = 2x / ln 2 rounded to fp32).

    Below |x| = 1/8 the polynomial (truncation < 1.4e-9 relative) and ~5 fp32 operations: 8u
    relative. Above, 1 - 2 / (e^2x + 1): exp2, add, divide, subtract on values <= 2, each within
    ~u of 2 absolute: 8u absolute, a relative 8u / tanh(1/8) = 64u at the seam. The exp form alone
    fails the first bound near 0 (x = 1e-30 gives tanh = 0: all of it lost)."""
    pos = [1e-30, 1e-12, 1e-6, 1e-3, 0.1, 0.124999, 0.125, 0.125001, 0.2, 0.5, 1.0, 5.0, 20.0, 100.0]
    x = torch.tensor([0.0] + pos + [-v for v in pos], dtype=torch.float64)
    n = triton.next_power_of_2(x.numel())
    s = torch.zeros(n, dtype=torch.float32)
    s[: x.numel()] = (x * (2 / math.log(2))).float()
    got = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _soft_cap_probe[(1,)](s.to(DEVICE), got, N=n)
    got = got.cpu()[: x.numel()].double()
    x32 = s[: x.numel()].double() * (math.log(2) / 2)  # the x that fp32 s stands for
    want = torch.tanh(x32)
    u = 2.0**-24
    poly = (s[: x.numel()] * (0.5 * math.log(2))).abs() < 0.125  # the kernel's choice, made on its fp32 x
    bound = torch.where(poly, 8 * u * want.abs(), torch.full_like(want, 8 * u))
    err = (got - want).abs()
    assert (err <= bound).all(), [(float(a), float(e)) for a, e, b in zip(x32, err, bound, strict=True) if e > b]
    assert (got[1:] != 0).all() and torch.equal(got[1:].sign(), x32[1:].sign())  # odd, never flushed to 0


# Gemma-2's cap, then caps so large the capped scores equal the plain ones to fp32: the kernels' tanh
# must stay accurate relative to tiny x = score / cap (the exp form lost up to cap x u absolutely).
LARGE_CAPS = [50.0, 1e4, 1e6, 1e30]


@pytest.mark.parametrize("cap", LARGE_CAPS, ids=[f"cap{c:g}" for c in LARGE_CAPS])
@pytest.mark.parametrize("kernel", ["tensor_cores/dequant", "tensor_cores/fp8", "cuda_core/dequant"])
def test_soft_cap_of_any_size_matches_oracle(kernel, cap):
    """Normal decode tolerances (a cap adds no rounding of its own: see the module docstring)."""
    cores, mode = kernel.split("/")
    cache = _cache("head")
    q = make_q(len(LENS), 8, 64, torch.float16)
    for splits in (1, 3):
        check_variant_against_oracle(q, cache, mode, dict(soft_cap=cap), num_splits=splits, block_n=32,
                                     use_tensor_cores=cores == "tensor_cores")


@pytest.mark.parametrize("mode", ["dequant", "fp8"])
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_that_dominate_the_softmax(mode, splits):
    """Sinks 12 above every score: the attention mass on the tokens is ~e^-12; the LSE is the sink's.

    With the sink dominating, out ~ Σ_j exp(s_j - sink) v_j: an absolute score error δ is no longer
    cancelled by the normalisation but scales the output by e^δ. fp8 mode's e4m3 query errs by up to
    2^-4 relative per element; a query of a quarter scale keeps |δ| (∝ |s|) within the fp8 tolerance.
    """
    cache = _cache("tensor")
    q = make_q(len(LENS), 8, 64, torch.float16) * 0.25
    ref_lse = ref_decode(q, cache)[1]
    sinks = (ref_lse.max(dim=0).values + 12.0).float().contiguous()  # per head
    out, lse = check_variant_against_oracle(q, cache, mode, dict(sinks=sinks), out_dtype=torch.float32,
                                            num_splits=splits, block_n=32)
    assert torch.allclose(lse, sinks.expand_as(lse), atol=1e-4)
    assert float(out.abs().max()) < 1e-3


def _poison_outside_window(cache, window):
    """Overwrite every cached token before each sequence's window with NaN (and NaN token scales)."""
    bs = cache.block_size
    for b, length in enumerate(cache.seq_lens.tolist()):
        for t in range(max(0, length - window)):
            page, slot = int(cache.block_table[b, t // bs]), t % bs
            for pages in (cache.k_pages, cache.v_pages):
                if cache.is_fp8:
                    pages.view(torch.uint8)[page, slot] = FP8_NAN_CODE
                else:
                    pages[page, slot] = float("nan")
            if cache.granularity == "token_head":
                cache.k_scale[page, slot] = float("nan")
                cache.v_scale[page, slot] = float("nan")


@pytest.mark.parametrize("kv_dtype,granularity,mode", [("fp8_e4m3", "token_head", "dequant"),
                                                       ("fp8_e5m2", "head", "fp8"), ("fp16", "tensor", "dequant")])
def test_window_never_reads_tokens_before_it(kv_dtype, granularity, mode):
    """NaN in every K/V element (and scale) before the window: a kernel that touched any of them,
    even masked out of the softmax, would turn the output NaN (0 x NaN). The output must be
    bit-identical to the clean cache's."""
    window = 9  # not a page multiple: the window starts mid-page
    lens = [1, 17, 40, 64]
    clean = _cache(granularity, kv_dtype, lens)
    dirty = _cache(granularity, kv_dtype, lens)
    _poison_outside_window(dirty, window)
    assert not torch.isfinite(dirty.gather(3, check_scales=False)[0]).all()  # the poison is really there
    q = make_q(len(lens), 8, 64, torch.float16)
    for splits in (1, 2):
        o1, l1 = paged_decode(q, clean, mode=mode, window=window, num_splits=splits, block_n=32)
        o2, l2 = paged_decode(q, dirty, mode=mode, window=window, num_splits=splits, block_n=32)
        assert torch.equal(o1, o2) and torch.equal(l1, l2)
    check_variant_against_oracle(q, clean, mode, dict(window=window), block_n=32)


def test_splits_are_chosen_over_the_window():
    """A 512-token window over a 16k page table gets the launch of a 512-token page table."""
    long = matrix_cache([20], 2, 64)
    long.block_table = torch.zeros(1, 16384 // 16, dtype=torch.int32, device=long.device)
    short = matrix_cache([20], 2, 64)
    short.block_table = torch.zeros(1, 512 // 16, dtype=torch.int32, device=short.device)
    cfg_window = launch_config(1, long, window=512, device=torch.device("cpu"))
    cfg_short = launch_config(1, short, device=torch.device("cpu"))
    cfg_long = launch_config(1, long, device=torch.device("cpu"))
    assert cfg_window == cfg_short
    assert cfg_window["num_splits"] * cfg_window["tokens_per_split"] < 512 + cfg_window["block_n"]
    assert cfg_long["num_splits"] * cfg_long["tokens_per_split"] >= 16384


def test_window_at_least_the_page_table_is_the_plain_kernel():
    """window >= capacity: no sequence can exceed it, so the plain kernel runs (bit-identical)."""
    cache = _cache("head")
    q = make_q(len(LENS), 8, 64, torch.float16)
    plain = paged_decode(q, cache, num_splits=2, block_n=32)
    for w in (CAPACITY, 10**6):
        windowed = paged_decode(q, cache, window=w, num_splits=2, block_n=32)
        assert torch.equal(plain[0], windowed[0]) and torch.equal(plain[1], windowed[1])


# ---------------------------------------------------------------------------------- public entry
def test_decode_entry_validates_variants_by_name():
    cache = matrix_cache([3, 5], 2, 64)
    q = make_q(2, 4, 64, torch.float16)
    for bad, exc in ((0, ValueError), (-1, ValueError), (False, TypeError), (2.5, TypeError), ("8", TypeError)):
        with pytest.raises(exc, match="window"):
            fp8kv_decode(q, cache, backend="reference", window=bad)
    for bad, exc in ((float("nan"), ValueError), (float("inf"), ValueError), (0, ValueError), (-3.0, ValueError),
                     ("1", TypeError), (1e31, ValueError)):  # 1e31: above MAX_SOFT_CAP, where fp32 factors underflow
        with pytest.raises(exc, match="soft_cap"):
            fp8kv_decode(q, cache, backend="reference", soft_cap=bad)
    good = torch.zeros(4, device=DEVICE)
    for bad, exc, what in ((torch.zeros(3, device=DEVICE), ValueError, r"\[4\]"),
                           (torch.zeros(4, 1, device=DEVICE), ValueError, "1-D"),
                           (good.double(), TypeError, "float32"), ([0.0] * 4, TypeError, "torch.Tensor"),
                           (torch.tensor([0.0, float("nan"), 0.0, 0.0], device=DEVICE), ValueError, "non-finite")):
        with pytest.raises(exc, match=f"sinks.*{what}|{what}.*sinks"):
            fp8kv_decode(q, cache, backend="reference", sinks=bad)
    out, lse = fp8kv_decode(q, cache, backend="reference", window=2, soft_cap=5, sinks=good)
    ref = ref_decode(q, cache, window=2, soft_cap=5.0, sinks=good)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])


def test_decode_entry_passes_variants_to_triton():
    cache = _cache("head")
    q = make_q(len(LENS), 8, 64, torch.float16)
    kw = _variants(dict(window=6, soft_cap=2.5, sinks="random"), 8)
    out, lse = fp8kv_decode(q, cache, backend="triton", mode="dequant", **kw)
    assert torch.equal(out, paged_decode(q, cache, **kw)[0])


def test_variant_capability_rows():
    table = variants()
    assert set(table["variant"]) == set(VARIANTS)
    assert table[table.backend != "flashinfer"].supported.all()
    assert (table.reason.str.len() > 10).all()
    assert not check_variant("flashinfer", "sinks", "dequant")[0]
    assert "window_left" in check_variant("flashinfer", "window", "dequant")[1]
    assert check_variant("flashinfer", "soft_cap", "dequant")[0]
    with pytest.raises(ValueError, match="variant="):
        check_variant("triton", "alibi")
    cache = matrix_cache([3], 1, 64)
    q = make_q(1, 2, 64, torch.float16)
    with pytest.raises(UnsupportedError, match="sinks"):
        fp8kv_decode(q, cache, backend="flashinfer", mode="dequant", sinks=torch.zeros(2, device=DEVICE))


# ------------------------------------------------------------------------------------------ GPU only
GPU_CONVERTS = ["ptx", "cast", "software", "cast/ptx"]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("convert", GPU_CONVERTS)
@pytest.mark.parametrize("mode", ["dequant", "fp8"])
def test_compiled_variants_at_scale(mode, convert):
    """Compiled kernels (each conversion; fp8 mode), Gemma-3-like window and GQA, long sequences."""
    if mode == "fp8" and convert != GPU_CONVERTS[0]:
        pytest.skip("fp8 mode has no conversion step")
    lens = [4096, 1, 3000, 16384 - 5]
    cache = matrix_cache(lens, 8, 128, kv_dtype="fp8_e4m3", granularity="head")
    q = make_q(len(lens), 32, 128, torch.bfloat16)
    for spec in (dict(window=512), dict(window=1000, soft_cap=30.0), dict(sinks="random"),
                 dict(window=1024, soft_cap=50.0, sinks="random")):
        kw = _variants(spec, 32)
        extra = {} if mode == "fp8" else dict(convert=convert)
        check_variant_against_oracle(q, cache, mode, kw, **extra)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_compiled_window_never_reads_tokens_before_it():
    lens = [5000, 700, 129]
    clean = matrix_cache(lens, 8, 128, granularity="head")
    dirty = matrix_cache(lens, 8, 128, granularity="head")
    _poison_outside_window(dirty, 512)
    q = make_q(len(lens), 32, 128, torch.bfloat16)
    for mode in ("dequant", "fp8"):
        a = paged_decode(q, clean, mode=mode, window=512)
        b = paged_decode(q, dirty, mode=mode, window=512)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype,granularity", [("fp8_e4m3", "tensor"), ("fp8_e4m3", "head"), ("bf16", "tensor")])
@pytest.mark.parametrize("use_tensor_cores", [True, False])
def test_flashinfer_window_and_soft_cap_against_oracle(kv_dtype, granularity, use_tensor_cores):
    """FlashInfer's window_left = W - 1 and logits_soft_cap give fp8kv's window and cap: same oracle,
    same tolerance as the Triton kernel (bf16 output: 2u; head scales folded into q: 3u)."""
    from fp8kv.backends.flashinfer import decode as fi_decode
    from fp8kv.capability import flashinfer_installed

    if not flashinfer_installed():
        pytest.skip("FlashInfer is not installed (pip install 'fp8kv[gpu]')")
    lens = [4096, 1, 600, 513, 16384 - 5]
    cache = matrix_cache(lens, 8, 128, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(len(lens), 32, 128, torch.bfloat16)
    tol = output_tolerance("flashinfer", "dequant", torch.bfloat16, granularity)
    for kw in (dict(window=512), dict(window=1000, soft_cap=30.0), dict(soft_cap=5.0), dict(window=1)):
        out, lse = fi_decode(q, cache, use_tensor_cores=use_tensor_cores, **kw)
        ref_out, ref_lse = ref_decode(q, cache, **kw)
        err = float((out.float() - ref_out).norm() / ref_out.norm())
        assert err <= tol, f"flashinfer {kw}: rel err {err:.3e} > {tol:.3e}"
        lse_tol = lse_tolerance("flashinfer", "dequant", torch.bfloat16, ref_lse)
        assert float((lse - ref_lse).abs().max()) <= lse_tol, kw


# ------------------------------------------------------------------------------------------- bench
def test_bench_windowed_cases_count_window_bytes_and_check_against_the_oracle():
    from fp8kv.bench import PRESETS, Case, bytes_moved, run, speedup_table, sweep

    plain, windowed = Case(2, 48, 4, 2, 64, kv_dtype="fp8_e4m3"), Case(2, 48, 4, 2, 64, kv_dtype="fp8_e4m3", window=20)
    assert bytes_moved(windowed)["kv"] == 2 * 20 * 2 * 64 * 2 * 1  # B x window x Hkv x D x (K, V) x 1 byte
    assert bytes_moved(plain)["kv"] == 48 / 20 * bytes_moved(windowed)["kv"]
    assert bytes_moved(windowed, [10, 48])["kv"] == (10 + 20) * 2 * 64 * 2
    assert "window=20" in windowed.label and "window" not in plain.label
    with pytest.raises(ValueError, match="Case.window"):
        Case(2, 48, window=0)
    cases = sweep([2], [48], heads=[(4, 2)], head_dims=[64], kv_dtypes=["fp8_e4m3"], modes=["dequant"],
                  backends=["triton", "reference"], windows=[None, 20], q_dtype="fp16")
    assert sorted((c.backend, c.window or 0) for c in cases) == [("reference", 0), ("reference", 20),
                                                                   ("triton", 0), ("triton", 20)]
    df = run(cases, check=True, rep=1, warmup=1)
    assert (df.status == "ok").all(), df.reason.tolist()
    assert df.check_passed.all()
    win = df[df.window == 20]
    assert (win.kv_bytes == bytes_moved(windowed)["kv"]).all()
    # windows are part of the shape: each windowed row is compared with the baseline of its own window
    as_baseline = df.assign(kv_dtype=df.backend.map({"reference": "bf16", "triton": "fp8_e4m3"}))
    sp = speedup_table(as_baseline)
    assert sorted(sp.window.fillna(0)) == [0, 20] and sp.bf16_us.notna().all()
    for _, r in sp.iterrows():
        same = as_baseline[(as_baseline.backend == "reference") & (as_baseline.window.fillna(0) == (0 if r.window != r.window else r.window))]
        assert r.bf16_us == float(same.time_us.iloc[0])
    assert all(sweep(**{**PRESETS[p], "memory_budget_bytes": 2**62}) for p in ("window", "window-gemma3"))
