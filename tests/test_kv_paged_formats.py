"""Quantized paged KV caches (fp8kv.cache.quantized) and their decode kernel (fp8kv.ops.quant_decode): the write
path bit for bit against fp8kv.kv_formats.quantize, bytes per token against kv_footprint, the Triton kernel (under
the interpreter on CPU) against the fp32 oracle on the same pages with a tolerance from fp16's rounding (and a
corrupted scale, a swapped nibble order shown to break it), and bad input refused by name."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from fixtures import seeded

from conftest import assert_rel_err
from fp8kv import kv_formats as kvf
from fp8kv.cache import PagedKVCache
from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.capability import UnsupportedError, interpreter_on
from fp8kv.ops.decode import DecodePlan
from fp8kv.ops.decode.planning import gluon_config
from fp8kv.ops.quant_decode import (
    QUANT_CONVERTS,
    QUANT_DECODE_FORMATS,
    kernel_tolerance,
    paged_decode_quantized,
    plan_decode_quantized,
    quantized_reference,
    run_quant_decode,
)
from fp8kv.quant import relative_error
from fp8kv.reference import lse_tolerance, score_bound, unit_roundoff

KERNEL_FORMATS = tuple(QUANT_DECODE_FORMATS)


def draw(batch, length, hkv, d, seed=0, scale=1.0):
    """K, V ``[batch, length, hkv, d]`` fp32, N(0, scale^2), from ``seeded(seed)``."""
    g = seeded(seed)
    return (torch.randn(batch, length, hkv, d, generator=g) * scale,
            torch.randn(batch, length, hkv, d, generator=g) * scale)


def valid(x, lens):
    """The valid tokens of every sequence of ``x`` ``[B, L, H, D]``, back to back: ``[sum(lens), H, D]``."""
    return torch.cat([x[i, :n] for i, n in enumerate(lens)])


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as integers, so that equality is bit equality (-0 against 0, fp8 / e8m0 codes)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_stored_as_quantize(cache, k, v, lens):
    """Every sequence's stored K and V are the bytes of kv_formats.quantize of its rows (the cache's tensor scales)."""
    for i, n in enumerate(lens):
        for enc, x, ts in zip(cache.encoded(i), (k[i, :n], v[i, :n]), (cache.k_tensor_scale, cache.v_tensor_scale),
                              strict=True):
            ref = kvf.quantize(x, enc.codec, tensor_scale=ts)
            assert torch.equal(bits(enc.codes), bits(ref.codes)), f"sequence {i}: codes differ"
            assert torch.equal(bits(enc.scales), bits(ref.scales)), f"sequence {i}: scales differ"
            assert torch.equal(enc.dequantize(), ref.dequantize())


# ------------------------------------------------------------------------------------------- the write path
# Tests that launch the kernel on CPU caches run it under the Triton interpreter (CI); on a GPU the gpu-marked tests
# launch it on CUDA caches
needs_kernel = pytest.mark.skipif(not interpreter_on(), reason="launches the kernel on CPU caches: under the Triton "
                                                               "interpreter (on a GPU the gpu-marked tests launch it)")


@pytest.mark.parametrize("fmt", kvf.PAGED_FORMATS)
@pytest.mark.parametrize("block_size", [8, 16])
def test_from_dense_stores_what_quantize_gives_bit_for_bit(fmt, block_size):
    lens = [1, 37, 23]
    k, v = draw(3, 40, 2, 64, seed=block_size)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v, lens, block_size=block_size)
    assert cache.seq_lens.tolist() == lens
    assert_stored_as_quantize(cache, k, v, lens)
    f = kvf.kv_format(fmt)
    if f.key.tensor_scale:  # from the valid tokens of all sequences, as quantize takes it from the whole tensor
        assert torch.equal(cache.k_tensor_scale, kvf.quantize(valid(k, lens), f.key).tensor_scale)
        assert torch.equal(cache.v_tensor_scale, kvf.quantize(valid(v, lens), f.value).tensor_scale)
    for i, n in enumerate(lens):  # gather is kv_formats' round trip of the sequence
        kg, vg = cache.gather(i)
        kq = kvf.quantize(k[i, :n], f.key, tensor_scale=cache.k_tensor_scale)
        assert torch.equal(kg, kq.dequantize()) and kg.dtype == torch.float32 and kg.shape == (n, 2, 64)
        assert vg.shape == (n, 2, 64)


@pytest.mark.parametrize("fmt", kvf.PAGED_FORMATS)
def test_appends_in_any_batching_store_the_same_bytes(fmt):
    """Token by token, in uneven chunks, or all at once: one write's scales belong to its tokens alone."""
    lens = [19, 5, 33]
    k, v = draw(3, 33, 3, 32, seed=7, scale=3.0)
    whole = QuantizedPagedKVCache.from_dense(fmt, k, v, lens, block_size=8)
    ts = dict(k_tensor_scale=whole.k_tensor_scale, v_tensor_scale=whole.v_tensor_scale)
    if whole.k_tensor_scale is None:
        ts = {}
    cache = QuantizedPagedKVCache.empty(fmt, 3, 40, 3, 32, block_size=8, **ts)
    done = [0, 0, 0]
    g = seeded(3)
    while done != lens:
        counts = [min(int(torch.randint(0, 6, (), generator=g)), n - d) for n, d in zip(lens, done, strict=True)]
        rows = [torch.arange(d, d + c) for d, c in zip(done, counts, strict=True)]
        cache.append_tokens(torch.cat([k[i, r] for i, r in enumerate(rows)]),
                            torch.cat([v[i, r] for i, r in enumerate(rows)]), counts)
        done = [d + c for d, c in zip(done, counts, strict=True)]
    assert cache.seq_lens.tolist() == lens
    assert_stored_as_quantize(cache, k, v, lens)
    one = QuantizedPagedKVCache.empty(fmt, 3, 40, 3, 32, block_size=8, **ts)
    for t in range(2):
        one.append(k[:, t], v[:, t])
    assert_stored_as_quantize(one, k, v, [2, 2, 2])


def test_write_skips_negative_slots_and_counts_saturation():
    cache = QuantizedPagedKVCache.empty("nvfp4", 1, 16, 1, 16, block_size=8, k_tensor_scale=2.0**-10,
                                        v_tensor_scale=1.0)
    rows = torch.full((2, 1, 16), 1e6)  # 1e6 / (448 x 2^-10) is far past e2m1's 6: every element saturates
    slots = cache.slots(0, [3, 4])
    n = cache.write(rows, torch.ones(2, 1, 16), torch.stack([slots[0], torch.tensor(-1)]))
    assert n == 16 and cache.saturated == 16
    assert int(cache.k_pages[slots[1] // 8, slots[1] % 8].abs().sum()) == 0  # the skipped row: untouched


# ----------------------------------------------------------------------------------------------- footprint
@pytest.mark.parametrize("fmt", kvf.PAGED_FORMATS)
@pytest.mark.parametrize("hkv,d", [(1, 64), (3, 128)])
def test_bytes_per_token_are_kv_footprint(fmt, hkv, d):
    cache = QuantizedPagedKVCache.empty(fmt, 2, 20, hkv, d, block_size=8,
                                        **({"k_tensor_scale": 1.0, "v_tensor_scale": 1.0}
                                           if kvf.kv_format(fmt).key.tensor_scale else {}))
    fp = kvf.kv_footprint(fmt, num_kv_heads=hkv, head_dim=d)
    assert cache.bytes_per_token() == fp.per_token
    assert cache.footprint() == fp
    assert cache.fixed_nbytes == fp.fixed
    assert cache.nbytes == fp.nbytes(cache.num_blocks * cache.block_size)


# ------------------------------------------------------------------------------------ the kernel vs the oracle
# kernel_tolerance: the package's (fp8kv.ops.quant_decode.oracle), its bound derived there


def q_for(cache, group, dtype, seed=1, scale=1.0):
    q = torch.randn(cache.batch_size, cache.num_kv_heads * group, cache.head_dim, generator=seeded(seed)) * scale
    return q.to(dtype)


CASES = [  # (lens, Hkv, group, D, block_size, num_splits): B 1-3, lengths 1..100, not multiples of the page
    ([77], 1, 4, 64, 8, None), ([1, 37, 100], 2, 1, 128, 16, 3), ([9, 63], 2, 4, 128, 8, 2),
    ([100, 1, 45], 1, 1, 64, 16, 1), ([51], 3, 4, 64, 16, 4), ([13, 29, 3], 1, 4, 128, 8, None),
]


@needs_kernel
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("lens,hkv,group,d,block_size,num_splits", CASES)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_kernel_matches_the_oracle_on_the_same_pages(fmt, lens, hkv, group, d, block_size, num_splits, q_dtype):
    k, v = draw(len(lens), max(lens), hkv, d, seed=len(lens) + d)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v, lens, block_size=block_size, max_seq_len=max(lens) + 5)
    q = q_for(cache, group, q_dtype)
    out, lse = paged_decode_quantized(q, cache, num_splits=num_splits)
    ref, ref_lse = quantized_reference(q, cache)
    assert out.dtype == q_dtype and lse.dtype == torch.float32 and out.shape == q.shape
    assert_rel_err(out.float(), ref, kernel_tolerance(q, q_dtype, cache), f"{fmt} {lens}")
    sb = score_bound(q, cache)
    tol = lse_tolerance("triton", "dequant", torch.float16, ref_lse, "channel" if q_dtype != torch.float16 else "tensor",
                        score_bound=sb)
    assert float((lse - ref_lse).abs().max()) <= tol


@needs_kernel
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("lens,hkv,group,d,block_size,num_splits", [CASES[2], ([30, 7], 2, 3, 96, 8, 2)])
def test_every_code_conversion_gives_the_same_output_bit_for_bit(fmt, lens, hkv, group, d, block_size, num_splits):
    """"software" (the default) places the codes' bits into fp16's fields, "cast" converts integers: the same
    dot operands (module fp8kv.ops.quant_decode.codes), so the same outputs and LSEs to the bit; D 96 pads the
    code bytes and the block scales (NVFP4 6 of 8, MXFP4 3 of 4)."""
    k, v = draw(len(lens), max(lens), hkv, d, seed=3 + d)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v * 3, lens, block_size=block_size)
    q = q_for(cache, group, torch.float16)
    out_s, lse_s = paged_decode_quantized(q, cache, num_splits=num_splits, convert="software")
    out_c, lse_c = paged_decode_quantized(q, cache, num_splits=num_splits, convert="cast")
    assert torch.equal(out_s, out_c) and torch.equal(lse_s, lse_c)
    ref, _ = quantized_reference(q, cache)
    assert_rel_err(out_s.float(), ref, kernel_tolerance(q, torch.float16, cache), f"{fmt} D {d}")


def _assert_matches_the_oracle(out, lse, q, q_dtype, cache, what: str) -> None:
    """A quantized decode's output and LSE against quantized_reference on the same pages: the kernel's tolerance, and
    the LSE's with the scores' bound (a non-fp16 query brought to fp16 per head counts as per-channel scaling)."""
    ref, ref_lse = quantized_reference(q, cache)
    assert_rel_err(out.float(), ref, kernel_tolerance(q, q_dtype, cache), what)
    tol = lse_tolerance("triton", "dequant", torch.float16, ref_lse, "channel" if q_dtype != torch.float16 else "tensor",
                        score_bound=score_bound(q, cache))
    assert float((lse - ref_lse).abs().max()) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hkv,group,d", [(8, 4, 128), (4, 3, 64), (2, 8, 96), (1, 8, 256), (2, 4, 160), (1, 71, 64)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("launch,block_size", [({}, 16), ({"num_splits": 1}, 128), ({"block_n": 128, "num_stages": 3}, 16),
                                               ({"block_n": 64}, 128)])
@pytest.mark.parametrize("fmt", ["int8_token_head", "int4_token_head"])
def test_int8_and_int4_pages_through_the_gluon_kernel_on_a_gpu(hkv, group, d, q_dtype, launch, block_size, fmt):
    """INT8 and INT4 per token and head read by the FP8 decode's Gluon kernel (codes turned to fp16 by their bits, INT4's
    two a byte; the scales as FP8's per-token ones), at lengths of 1 token, a partial page and tile, and 5003: against
    the oracle on the same pages and the Triton kernel (2u), pages of 16 and 128 tokens (larger than a tile); the
    default where the splits are long and the group fits one program."""
    lens = [1, 17, 700, 5003]
    k, v = draw(len(lens), max(lens), hkv, d, seed=d + group)
    cache = QuantizedPagedKVCache.from_dense(fmt, k.cuda(), v.cuda() * 3, lens, block_size=block_size)
    q = q_for(cache, group, q_dtype).cuda()
    out, lse = paged_decode_quantized(q, cache, gluon=True, **launch)
    _assert_matches_the_oracle(out, lse, q, q_dtype, cache, f"{d} {group} {launch}")
    twin, _ = paged_decode_quantized(q, cache, gluon=False)
    assert relative_error(out.float(), twin.float()) <= 2 * unit_roundoff(q_dtype)
    assert not isinstance(plan_decode_quantized(q, cache, num_splits=1), DecodePlan)  # an option: the Triton kernel
    if not launch:  # the default: Gluon where the decode's rule takes it (long splits, the group in one program)
        rule = gluon_config(len(lens), cache, group, q.device, gluon=None, q_dtype=q_dtype)
        default = plan_decode_quantized(q, cache)
        assert isinstance(default, DecodePlan) == (rule is not None)
        # the splits tile the capacity: long ones (INT4's smaller programs fill the waves with more splits: at 64k and
        # 2 KV heads they were shorter than GLUON_MIN_SPLIT_TOKENS)
        wide = QuantizedPagedKVCache.from_dense(fmt, k.cuda(), v.cuda() * 3, lens, block_size=16,
                                                max_seq_len=256 * 1024)
        assert isinstance(plan_decode_quantized(q, wide), DecodePlan) == (group <= (32 if d <= 64 else 16))
        assert torch.equal(paged_decode_quantized(q, wide)[0], paged_decode_quantized(q, wide, gluon=True)[0]) or \
            group > (32 if d <= 64 else 16)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(gluon="yes"), TypeError, "gluon='yes'"),
    (dict(gluon=True), UnsupportedError, "gluon=True: Gluon kernels run on a CUDA GPU only"),
    (dict(gluon=True, convert="cast"), UnsupportedError, "the Gluon kernel takes no ['convert']"),
    (dict(gluon=True, fmt="nvfp4"), UnsupportedError, "nvfp4: of the quantized formats the Gluon kernel reads "
                                                      "'int8_token_head' and 'int4_token_head'"),
    (dict(gluon=True, fmt="int4_token_head", d=96), UnsupportedError, "gluon=True: Gluon kernels run on a CUDA GPU"),
    (dict(gluon=True, fmt="int4_token_head", d=80), UnsupportedError, "head_dim=80: the Gluon kernel reads "
                                                                      "int4_token_head (two codes a byte) at head dims "
                                                                      "that are multiples of 32"),
    (dict(gluon=True, q_dtype=torch.float32), UnsupportedError, "q has dtype torch.float32: the Gluon kernel takes")])
@pytest.mark.skipif(not interpreter_on(), reason="the refusals on a CPU, where the interpreter runs the Triton kernel")
def test_the_gluon_option_of_the_quantized_decode_is_checked_by_name(kw, exc, words):
    """On this CPU the Gluon kernel cannot run: gluon=True says why, by name, before anything is launched (the
    format's, the query's and the options' refusals before the machine's)."""
    fmt, q_dtype, d = kw.pop("fmt", "int8_token_head"), kw.pop("q_dtype", torch.float16), kw.pop("d", 64)
    k, v = draw(2, 40, 2, d, seed=5)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v, [40, 9], block_size=16)
    q = q_for(cache, 2, q_dtype)
    with pytest.raises(exc, match=re.escape(words)):
        plan_decode_quantized(q, cache, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter twin runs above)")
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("lens,hkv,group,d,block_size,num_splits", [*CASES[:4], ([30, 7], 2, 3, 96, 8, 2)])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("convert", QUANT_CONVERTS)
def test_kernel_matches_the_oracle_on_a_gpu(fmt, lens, hkv, group, d, block_size, num_splits, q_dtype, convert):
    """The compiled kernel (not the interpreter) on the GPU's pages, bf16 queries included, every code
    conversion (inline PTX too)."""
    k, v = draw(len(lens), max(lens), hkv, d, seed=len(lens) + d)
    cache = QuantizedPagedKVCache.from_dense(fmt, k.cuda(), v.cuda(), lens, block_size=block_size)
    q = q_for(cache, group, q_dtype).cuda()
    out, lse = paged_decode_quantized(q, cache, num_splits=num_splits, convert=convert)
    _assert_matches_the_oracle(out, lse, q, q_dtype, cache, f"{fmt} {lens} on {torch.cuda.get_device_name()}")


@needs_kernel
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_kernel_with_large_scores_bf16_query_and_fp32_output(fmt):
    """K of scale 8 (scores of tens: a peaked softmax), a bf16 query, an fp32 output, sm_scale given."""
    lens = [41, 6]
    k, v = draw(2, 41, 2, 64, seed=5)
    cache = QuantizedPagedKVCache.from_dense(fmt, k * 8, v, lens, block_size=16)
    q = q_for(cache, 4, torch.bfloat16, scale=2.0)
    out, lse = paged_decode_quantized(q, cache, sm_scale=0.2, out_dtype=torch.float32, num_splits=2, block_n=16)
    ref, ref_lse = quantized_reference(q, cache, sm_scale=0.2)
    assert out.dtype == torch.float32
    assert_rel_err(out, ref, kernel_tolerance(q, torch.float32, cache, 0.2), fmt)


@needs_kernel
def test_mxfp4_blocks_far_below_their_tokens_largest_weigh_nothing():
    """MXFP4 tiles hold code x 2^(block exponent - the token's largest): a block 2^30 below it is 0 in fp16, and
    its share of a score or an output (2^-30 of the token's) is far below the tolerance."""
    lens = [40, 17]
    k, v = draw(2, 40, 2, 64, seed=12)
    k[..., 32:] *= 2.0**-30
    v[..., :32] *= 2.0**-30
    cache = QuantizedPagedKVCache.from_dense("mxfp4", k, v, lens, block_size=8)
    q = q_for(cache, 4, torch.float16)
    out, _ = paged_decode_quantized(q, cache, num_splits=2)
    ref, _ = quantized_reference(q, cache)
    assert_rel_err(out.float()[..., 32:], ref[..., 32:], kernel_tolerance(q, torch.float16, cache), "large block")
    assert float(out[..., :32].float().abs().max()) <= 2.0**-20  # the small block: about 2^-30, or 0


def _corrupt_v_scales(cache, page):
    """Double the V scales of one page (every token, head and block of it)."""
    s = cache.v_scales
    cache.v_scales = s.clone()
    cache.v_scales[page] = (s[page].to(torch.float32) * 2).to(s.dtype)


def _swap_k_nibbles(cache, page):
    """Swap the two channels of every K byte of one page (packed codes), or negate its INT8 codes."""
    p = cache.k_pages.clone()
    p[page] = (p[page] >> 4) | (p[page] << 4) if p.dtype == torch.uint8 else -p[page]
    cache.k_pages = p


@needs_kernel
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("fault", [_corrupt_v_scales, _swap_k_nibbles])
def test_the_tolerance_catches_a_corrupted_page(fmt, fault):
    """The kernel reading one page wrongly (a scale doubled, the nibble order swapped) is far outside the tolerance."""
    lens = [60, 33]
    k, v = draw(2, 60, 2, 64, seed=11)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v, lens, block_size=16)
    q = q_for(cache, 4, torch.float16)
    ref, _ = quantized_reference(q, cache)
    tol = kernel_tolerance(q, torch.float16, cache)
    out, _ = paged_decode_quantized(q, cache)
    assert_rel_err(out.float(), ref, tol, fmt)  # the pages as written: within it
    broken = copy.copy(cache)
    fault(broken, int(cache.block_table[0, 1]))  # the second page of sequence 0 (tokens 16-31)
    out, _ = paged_decode_quantized(q, broken)
    assert relative_error(out.float(), ref) > 10 * tol


# --------------------------------------------------------------------------------------------------- bad input
def _tensor_scales(fmt):
    return {"k_tensor_scale": 1.0, "v_tensor_scale": 1.0} if kvf.kv_format(fmt).key.tensor_scale else {}


@pytest.mark.parametrize("fmt,match", [
    ("kivi4_g32", "cannot be paged"), ("int8_tensor", "cannot be paged"), ("fp8_e4m3_token_head", "cannot be paged"),
    ("int9", "not a known KV format"),
])
def test_formats_that_cannot_be_paged_are_refused_by_name(fmt, match):
    with pytest.raises(ValueError, match=match) as e:
        QuantizedPagedKVCache.empty(fmt, 1, 8, 1, 64)
    assert repr(fmt) in str(e.value)


@pytest.mark.parametrize("fmt,head_dim,match", [
    ("int4_token_head", 33, "even head_dim"), ("nvfp4", 40, "multiple of its block size 16"),
    ("mxfp4", 48, "multiple of its block size 32"), ("int8_token_head", 0, "head_dim"),
])
def test_head_dims_a_format_cannot_store_are_refused(fmt, head_dim, match):
    with pytest.raises(ValueError, match=match):
        QuantizedPagedKVCache.empty(fmt, 1, 8, 1, head_dim, **_tensor_scales(fmt))


@pytest.mark.parametrize("kw,exc,match", [
    ({}, ValueError, "k_tensor_scale is None"),
    ({"k_tensor_scale": 1.0}, ValueError, "v_tensor_scale is None"),
    ({"k_tensor_scale": 0.0, "v_tensor_scale": 1.0}, ValueError, "k_tensor_scale must be positive"),
    ({"k_tensor_scale": float("nan"), "v_tensor_scale": 1.0}, ValueError, "k_tensor_scale must be positive"),
    ({"k_tensor_scale": 1.0, "v_tensor_scale": "big"}, TypeError, "v_tensor_scale='big'"),
    ({"k_tensor_scale": [1.0, 2.0], "v_tensor_scale": 1.0}, ValueError, r"k_tensor_scale has shape \(2,\)"),
])
def test_nvfp4_tensor_scales_are_checked(kw, exc, match):
    with pytest.raises(exc, match=match):
        QuantizedPagedKVCache.empty("nvfp4", 1, 8, 1, 16, **kw)


def test_a_tensor_scale_for_a_format_without_one_is_refused():
    with pytest.raises(ValueError, match="k_tensor_scale=2.0, but format 'int8_token_head' has no per-tensor"):
        QuantizedPagedKVCache.empty("int8_token_head", 1, 8, 1, 16, k_tensor_scale=2.0)


def _cache(fmt="int4_token_head"):
    k, v = draw(2, 20, 2, 32, seed=2)
    return QuantizedPagedKVCache.from_dense(fmt, k, v, [20, 7], block_size=8, max_seq_len=24)


def _replace(name, make):
    def corrupt(cache):
        setattr(cache, name, make(getattr(cache, name)))
    return corrupt


@pytest.mark.parametrize("corrupt,exc,match", [
    (_replace("k_scales", lambda s: s.half()), TypeError, "k_scales has dtype float16; expected one of: float32"),
    (_replace("v_scales", lambda s: s[..., :0]), ValueError, r"v_scales has shape .* holds scales of shape"),
    (_replace("k_scales", lambda s: -s), ValueError, r"k_scales\[0, 0, 0, 0\]=-"),
    (_replace("v_scales", lambda s: s * float("nan")), ValueError, "scales must be positive and finite"),
    (_replace("k_pages", lambda p: p.to(torch.int8)), TypeError, "k_pages has dtype torch.int8"),
    (_replace("k_pages", lambda p: p[..., :8].contiguous()), ValueError, "k_pages .* must have the same shape"),
    (_replace("block_table", lambda t: t.long()), TypeError, "block_table must be int32"),
    # one array for K and V: a write of V would overwrite K's codes (or scales)
    (lambda c: setattr(c, "v_pages", c.k_pages), ValueError, "k_pages and v_pages share memory"),
    (lambda c: setattr(c, "v_scales", c.k_scales), ValueError, "k_scales and v_scales share memory"),
])
def test_arrays_replaced_with_bad_ones_are_named(corrupt, exc, match):
    cache = _cache()
    corrupt(cache)
    with pytest.raises(exc, match=match):
        cache.validate_arrays()


def test_the_contents_switch_and_gathers_scale_check_are_flags():
    """As a PagedKVCache's: contents="no" is no False (it was truthy), and gather checks the scales unless told."""
    cache = _cache()
    with pytest.raises(TypeError, match=r"contents='no'.* expected True or False"):
        cache.validate_arrays(contents="no")
    with pytest.raises(TypeError, match=r"check_scales=1 .* expected True or False"):
        cache.gather(0, check_scales=1)


@pytest.mark.parametrize("call,exc,match", [
    (lambda c: c.append_tokens(torch.full((1, 2, 32), float("inf")), torch.zeros(1, 2, 32), [1, 0]), ValueError,
     "k_new has non-finite values"),
    (lambda c: c.append_tokens(torch.zeros(1, 2, 30), torch.zeros(1, 2, 30), [1, 0]), ValueError,
     r"k_new must be \[N, 2, 32\]"),
    (lambda c: c.append_tokens(torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), [1, 0]), ValueError,
     "k_new has 2 rows but counts sum to 1"),
    (lambda c: c.append_tokens(torch.zeros(5, 2, 32), torch.zeros(5, 2, 32), [5, 0]), ValueError,
     "seq_len 20 \\+ 5 new tokens exceeds its capacity of 24"),
    (lambda c: c.append_tokens(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), [-1, 2]), ValueError, "counts\\[0\\]"),
    (lambda c: c.append_tokens(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), [1]), ValueError,
     "one entry per sequence"),
    (lambda c: c.append_tokens(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), [0.5, 0.5]), TypeError, "counts\\[0\\]"),
    (lambda c: c.write(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), [10**6]), ValueError,
     "slot_mapping has slot 1000000 >= num_blocks x block_size"),
    (lambda c: c.write(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32), torch.tensor([1.0])), TypeError, "slot_mapping"),
    # two rows into one slot: which a GPU keeps is undefined (and its codes and scales could come from different rows)
    (lambda c: c.write(torch.zeros(3, 2, 32), torch.zeros(3, 2, 32), [3, -1, 3]), ValueError,
     r"slot_mapping writes slot 3 2 times \(rows \[0, 2\]\)"),
    (lambda c: c.slots(2, [0]), ValueError, "seq=2"),
    (lambda c: c.encoded(-1), ValueError, "i=-1"),
])
def test_bad_writes_and_reads_are_refused_before_anything_changes(call, exc, match):
    cache = _cache()
    before = [t.clone() for t in (cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales, cache.seq_lens)]
    with pytest.raises(exc, match=match):
        call(cache)
    after = (cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales, cache.seq_lens)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("call,exc,match", [
    (lambda c, q: paged_decode_quantized(q, object()), TypeError, "cache must be a fp8kv.cache.quantized"),
    (lambda c, q: paged_decode_quantized(q.to(torch.int32), c), TypeError, "q has dtype int32; expected one of"),
    (lambda c, q: paged_decode_quantized(q[:, :3], c), ValueError, "q has 3 heads, not a multiple"),
    (lambda c, q: paged_decode_quantized(q[..., :16], c), ValueError, "q has head_dim 16"),
    (lambda c, q: paged_decode_quantized(q[:1], c), ValueError, "q has batch 1"),
    (lambda c, q: paged_decode_quantized(q.index_fill(2, torch.tensor([5]), float("nan")), c), ValueError,
     r"q has \d+ non-finite value\(s\)"),  # as fp8kv.decode: a NaN query is no result
    (lambda c, q: quantized_reference(q.index_fill(2, torch.tensor([5]), float("inf")), c), ValueError,
     r"q has \d+ non-finite value\(s\)"),
    (lambda c, q: paged_decode_quantized(q.transpose(1, 2).contiguous().transpose(1, 2), c), ValueError,
     "last dim .* must be contiguous"),
    (lambda c, q: paged_decode_quantized(q, c, sm_scale=0.0), ValueError, "sm_scale"),
    (lambda c, q: paged_decode_quantized(q, c, sm_scale=float("nan")), ValueError, "sm_scale"),
    (lambda c, q: paged_decode_quantized(q, c, out_dtype=torch.int8), TypeError, "out_dtype=torch.int8"),
    (lambda c, q: paged_decode_quantized(q, c, num_splits=0), ValueError, "num_splits"),
    (lambda c, q: paged_decode_quantized(q, c, block_n=24), ValueError, "block_n=24; expected a power of two"),
    (lambda c, q: paged_decode_quantized(q, c, block_n=8), ValueError, r"block_n=8; expected a power of two in \[16"),
    (lambda c, q: paged_decode_quantized(q, c, check=1), TypeError, "check=1"),
    (lambda c, q: paged_decode_quantized(q, c, convert="fast"), ValueError, "convert='fast'; expected one of"),
    (lambda c, q: paged_decode_quantized(q, c, convert="ptx"), UnsupportedError, "convert='ptx' is inline GPU"),
    (lambda c, q: paged_decode_quantized(q, c, num_warps=3), ValueError, r"num_warps=3; expected one of \(1, 2, 4"),
    (lambda c, q: paged_decode_quantized(q, c, num_warps=4.0), TypeError, "num_warps=4.0"),
    (lambda c, q: paged_decode_quantized(q, c, num_stages=0), ValueError, "num_stages"),
    (lambda c, q: paged_decode_quantized(q, c, num_stages=10**9), ValueError, "num_stages=1000000000"),
    (lambda c, q: quantized_reference(q, c, sm_scale=-1.0), ValueError, "sm_scale"),
    (lambda c, q: quantized_reference(q, "cache"), TypeError, "cache must be a fp8kv.cache.quantized"),
    (lambda c, q: kernel_tolerance(q, torch.float16, c, sm_scale=float("nan")), ValueError, "sm_scale=nan"),
    (lambda c, q: kernel_tolerance(q, torch.float16, c, sm_scale=-1.0), ValueError, "sm_scale=-1"),
    (lambda c, q: kernel_tolerance(q, torch.float16, c, sm_scale="x"), TypeError, "sm_scale='x'"),
    (lambda c, q: kernel_tolerance(q[..., :16], torch.float16, c), ValueError, "q has head_dim 16"),
    (lambda c, q: kernel_tolerance(q, torch.float16, "c"), TypeError, "cache must be a fp8kv.cache.quantized"),
])
def test_bad_decode_arguments_are_refused_by_name(call, exc, match):
    cache = _cache()
    q = torch.randn(2, 4, 32).half()
    with pytest.raises(exc, match=match):
        call(cache, q)


@pytest.mark.parametrize("entry", [paged_decode_quantized, quantized_reference])
@pytest.mark.parametrize("edit,match", [
    (lambda c: c.seq_lens.__setitem__(1, 0), r"seq_lens\[1\]=0: decode needs at least one cached token"),
    (lambda c: c.seq_lens.__setitem__(0, 99), r"seq_lens\[0\]=99 exceeds the capacity"),
    (lambda c: c.block_table.__setitem__((0, 1), 10**4), r"block_table\[0, 1\]=10000 is out of range"),
])
def test_tables_edited_after_construction_are_refused(entry, edit, match):
    cache = _cache()
    edit(cache)
    with pytest.raises(ValueError, match=match):
        entry(torch.randn(2, 4, 32).half(), cache)


def test_a_format_without_a_kernel_is_refused_by_name():
    k, v = draw(1, 5, 1, 32, seed=4)
    cache = QuantizedPagedKVCache.from_dense("e4m3_b16", k, v, [5], block_size=8)
    with pytest.raises(UnsupportedError, match="'e4m3_b16' has no decode kernel; the kernel reads"):
        paged_decode_quantized(torch.randn(1, 2, 32).half(), cache)
    out, _ = quantized_reference(torch.randn(1, 2, 32).half(), cache)  # the oracle reads every paged format
    assert torch.isfinite(out).all()


def _padded(fill_padding=None):
    k, v = draw(2, 5, 1, 32, seed=6)
    if fill_padding is not None:
        k[1, 4] = fill_padding
    return k, v


@pytest.mark.parametrize("args,exc,match", [
    (lambda: (*_padded(), [6, 1]), ValueError, r"seq_lens\[0\]=6 is more than the 5 tokens"),
    (lambda: (*_padded(), [-1, 1]), ValueError, r"seq_lens\[0\]=-1"),
    (lambda: (*_padded(), [1]), ValueError, "seq_lens has 1 entries but k holds 2 sequences"),
    (lambda: (*_padded(), torch.tensor([1.0, 2.0])), TypeError, "seq_lens has dtype float32"),
    (lambda: (*_padded(), 3), TypeError, "seq_lens=3"),
    (lambda: (*_padded(float("nan")), [5, 5]), ValueError, r"k\[1, :5\] has 32 non-finite value"),
    (lambda: (*_padded(float("inf")), [5, 5]), ValueError, r"k\[1, :5\] has 32 non-finite value"),
    (lambda: (_padded()[0], _padded()[1][:, :4], [1, 1]), ValueError, "must match"),
    (lambda: (_padded()[0].int(), _padded()[1], [1, 1]), TypeError, "k has dtype int32; expected one of"),
    (lambda: (_padded()[0].to(torch.float8_e4m3fn), _padded()[1], [1, 1]), TypeError, "k has dtype float8_e4m3fn"),
    (lambda: (_padded()[0][0], _padded()[1], [1, 1]), ValueError, "k must be 4-D"),
])
def test_from_dense_refuses_bad_sequences_by_name(args, exc, match):
    with pytest.raises(exc, match=match):
        QuantizedPagedKVCache.from_dense("int8_token_head", *args())


def test_non_finite_padding_is_never_read():
    k, v = _padded(float("nan"))
    cache = QuantizedPagedKVCache.from_dense("nvfp4", k, v, [5, 4], block_size=8)
    assert torch.isfinite(cache.gather(1)[0]).all() and torch.isfinite(cache.k_tensor_scale)


@pytest.mark.parametrize("fmt", kvf.PAGED_FORMATS)
def test_a_nan_or_non_positive_scale_code_is_named(fmt):
    """e8m0's code 255 is NaN (no other code is bad); e4m3 and fp32 scales must be positive and finite."""
    k, v = draw(1, 5, 1, 32, seed=8)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v, [5], block_size=8)
    cache.validate_arrays()
    raw = cache.v_scales.view(torch.uint8) if cache.v_scales.element_size() == 1 else cache.v_scales
    raw[0, 0, 0, 0] = 255 if cache.v_scales.dtype == torch.float8_e8m0fnu else 0
    with pytest.raises(ValueError, match=r"v_scales\[0, 0, 0, 0\]=(nan|0\.0); scales must be positive and finite"):
        cache.validate_arrays()


def test_empty_sequences_are_stored_and_refused_by_the_decode():
    k, v = draw(2, 5, 1, 32, seed=9)
    cache = QuantizedPagedKVCache.from_dense("int4_token_head", k, v, [0, 3], block_size=8)
    assert cache.gather(0)[0].shape == (0, 1, 32)
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=0"):
        paged_decode_quantized(torch.randn(2, 1, 32).half(), cache)
    out, lse = paged_decode_quantized(torch.randn(2, 1, 32).half(), cache, check=False)  # unchecked: 0 and -inf
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


def test_the_fp8_entries_name_the_decode_that_reads_a_quantized_cache():
    """fp8kv.decode, fp8kv.attend and the reference read FP8 and 16-bit pages; handed a quantized cache they say
    which decode reads it instead of failing inside."""
    import fp8kv
    from fp8kv.reference import decode as ref_decode

    cache = QuantizedPagedKVCache.from_dense("int8_token_head", torch.randn(1, 5, 1, 64), torch.randn(1, 5, 1, 64),
                                              [5], block_size=8)
    q = torch.randn(1, 2, 64, dtype=torch.float16)
    for call in (lambda: fp8kv.decode(q, cache), lambda: ref_decode(q, cache),
                 lambda: fp8kv.attend(q, cache, torch.tensor([0, 1], dtype=torch.int32))):
        with pytest.raises(TypeError, match="got QuantizedPagedKVCache; .*paged_decode_quantized"):
            call()


def _planned(fmt, num_kv_heads=2):
    """A planned launch over a cache of ``fmt`` at head_dim 64 (NVFP4: 4 block scales a token and head, MXFP4: 2)."""
    scale = {"k_tensor_scale": 1.0, "v_tensor_scale": 1.0} if fmt == "nvfp4" else {}
    k, v = draw(2, 20, num_kv_heads, 64, seed=2)
    cache = QuantizedPagedKVCache.from_dense(fmt, k, v, [20, 7], block_size=8, max_seq_len=24, **scale)
    q = torch.randn(2, 2 * num_kv_heads, 64, dtype=torch.float16)
    return q, cache, plan_decode_quantized(q, cache)


def _spread(s, dim):
    """The same values and shape, every other element of a tensor twice as large along ``dim``."""
    shape = list(s.shape)
    shape[dim] *= 2
    wide = torch.zeros(shape, dtype=s.dtype)
    index = [slice(None)] * s.dim()
    index[dim] = slice(None, None, 2)
    wide[tuple(index)] = s
    return wide[tuple(index)]


@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("which", ["k_scales", "v_scales", "both"])
def test_scales_swapped_for_strided_views_after_planning_are_refused_at_launch(fmt, which):
    """The kernel reads each token's block scales as one vector from a multiple of their count, which only
    contiguous scales give: scales swapped after the plan for views whose scales are not consecutive (K's,
    V's, or both alike) are refused by name, not read wrong."""
    q, cache, launch = _planned(fmt)
    run_quant_decode(q, cache, launch)  # as planned: runs
    for name in (("k_scales", "v_scales") if which == "both" else (which,)):
        setattr(cache, name, _spread(getattr(cache, name), -1))
    refusal = "contiguous scales" if which == "both" else "(contiguous scales|both with one set of strides)"
    with pytest.raises(ValueError, match=rf"_scales has strides \(.*the kernel reads {refusal}"):
        run_quant_decode(q, cache, launch)


@needs_kernel
def test_per_token_scales_may_be_strided_alike_but_not_apart():
    """INT8's scales (one a token and head) are read through their strides: K and V strided alike give the
    contiguous run's answer; K strided and V not is refused by name (the kernel takes one set of strides)."""
    q, cache, launch = _planned("int8_token_head")
    want = run_quant_decode(q, cache, launch)
    k_scales, v_scales = cache.k_scales, cache.v_scales
    cache.k_scales, cache.v_scales = _spread(k_scales, 2), _spread(v_scales, 2)
    got = run_quant_decode(q, cache, launch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    cache.v_scales = v_scales
    with pytest.raises(ValueError, match=r"k_scales has strides .* and v_scales .*one set of strides"):
        run_quant_decode(q, cache, launch)


@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_size_one_dimension_of_any_stride_is_read_as_it_is(fmt):
    """One KV head: torch calls scales contiguous whatever the head dimension's stride (its index is always 0).
    The launch takes them and reads the same values."""
    q, cache, launch = _planned(fmt, num_kv_heads=1)
    want = run_quant_decode(q, cache, launch)
    for name in ("k_scales", "v_scales"):
        s = getattr(cache, name)
        odd = torch.empty(s.shape[0], s.shape[1], s.shape[3], 1, dtype=s.dtype).permute(0, 1, 3, 2)
        odd.copy_(s)
        assert odd.is_contiguous() and odd.stride() != s.stride()
        setattr(cache, name, odd)
    got = run_quant_decode(q, cache, launch)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("other, match", [
    (lambda c, q: (q.repeat(2, 1, 1)[:3], c), r"q's shape is \(3, 4, 32\), but the plan was made for \(2, 4, 32\)"),
    (lambda c, q: (q.float(), c), "q's dtype is torch.float32, but the plan was made for torch.float16"),
    (lambda c, q: (q, _cache("int8_token_head")), "the cache's format is int8_token_head, but the plan was made for "
     "int4_token_head"),
])
def test_a_plan_run_on_other_inputs_is_refused_not_read_wrong(other, match):
    """A launch planned for one query and cache, run on another: the rows past the plan's were left unwritten (NaN),
    and an INT8 plan read INT4 codes (error 14.8); now the first difference is named."""
    cache = _cache()
    q = torch.randn(2, 4, 32).half()
    launch = plan_decode_quantized(q, cache)
    with pytest.raises(ValueError, match=match):
        run_quant_decode(*other(cache, q), launch)
    with pytest.raises(TypeError, match="launch must be a plan_decode_quantized launch"):
        run_quant_decode(q, cache, "launch")


def test_a_tensor_scale_below_the_codecs_floor_is_refused_where_the_cache_is_made():
    """Accepted before, then every write failed naming quantize's ``tensor_scale``."""
    with pytest.raises(ValueError, match=r"k_tensor_scale=1\.4\d*e-45 is below .* expected k_tensor_scale >= 2\^-143"):
        QuantizedPagedKVCache.empty("nvfp4", 1, 4, 1, 16, k_tensor_scale=1e-45, v_tensor_scale=1.0)


@pytest.mark.parametrize("bad, exc", [("40", TypeError), (-5, ValueError), (True, TypeError)])
def test_from_dense_max_seq_len_is_a_positive_int(bad, exc):
    k, v = draw(1, 3, 1, 16, seed=0)
    with pytest.raises(exc, match=f"max_seq_len={bad!r}" if exc is TypeError else "max_seq_len=-5"):
        QuantizedPagedKVCache.from_dense("int8_token_head", k, v, [3], max_seq_len=bad)


def test_from_dense_refuses_a_max_seq_len_below_the_longest_sequence():
    """Both caches raised it to the longest seq_len, silently."""
    k = torch.randn(2, 5, 2, 32)
    for build in (lambda n: QuantizedPagedKVCache.from_dense("nvfp4", k, k, [3, 5], max_seq_len=n),
                  lambda n: PagedKVCache.from_dense(k, k, [3, 5], max_seq_len=n)):
        with pytest.raises(ValueError, match=r"max_seq_len=2 is below seq_lens\[1\]=5; expected max_seq_len >= the "
                                             r"longest seq_len \(5\)"):
            build(2)
        assert build(5).seq_lens.tolist() == [3, 5] and build(None).seq_lens.tolist() == [3, 5]


def test_a_write_after_a_scale_array_was_replaced_names_it():
    cache = _cache("int8_token_head")
    cache.k_scales = cache.k_scales.double()
    with pytest.raises(TypeError, match="k_scales has dtype float64"):
        cache.append(torch.randn(2, 2, 32), torch.randn(2, 2, 32))
