"""Bad and unusual input to the decode path: fp8kv.decode, PagedKVCache, write_cache, the kernels.

Every input is either computed right (compared with the fp32 oracle, or with an independent
computation) or refused with a TypeError/ValueError whose message names the argument and the value.
Where a check is skippable (``check=False``, the CUDA-graph path), the kernels must still stay
inside the page pool: the test runs them on corrupt tables and asserts only that they return.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from fixtures import DEVICE, count_calls, make_q

import fp8kv
from fp8kv.cache import PagedKVCache
from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.ops import paged_decode, write_cache
from fp8kv.quant import relative_error
from fp8kv.reference import decode as ref_decode
from fp8kv.reference import output_tolerance


@pytest.fixture(name="make_cache")
def _device_cache(make_cache):
    """The shared cache factory (conftest) on this module's device; two sequences of 5 and 19 tokens by default."""
    return functools.partial(make_cache, lens=(5, 19), device=DEVICE)


def query(b=2, hq=4, d=32, dtype=torch.float16, seed=1, scale=1.0):
    return make_q(b, hq, d, dtype, seed, scale=scale, device=DEVICE)


def triton_matches_oracle(q, cache, tol, **kw):
    out, lse = fp8kv.decode(q, cache, backend="triton", **kw)
    ref, ref_lse = ref_decode(q, cache, sm_scale=kw.get("sm_scale"))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = relative_error(out.float(), ref)
    assert err <= tol, f"relative error {err:.2e} > {tol:.1e}"
    rel_lse = float(((lse - ref_lse).abs() / ref_lse.abs().clamp(min=1.0)).max())
    assert rel_lse <= 4 * tol, f"lse error {rel_lse:.2e}"


# ------------------------------------------------------------------- 16-bit paths computed right
@pytest.mark.parametrize("kv_dtype,q_dtype", [("bf16", torch.bfloat16), ("fp16", torch.bfloat16),
                                               ("fp8_e4m3", torch.bfloat16)])
def test_sixteen_bit_caches_and_bf16_queries_match_the_oracle(kv_dtype, q_dtype, make_cache):
    """The interpreter's bf16 arithmetic is wrong; the launcher must not return its garbage."""
    triton_matches_oracle(query(dtype=q_dtype), make_cache(kv_dtype=kv_dtype), output_tolerance("triton", "dequant", q_dtype))


def test_bf16_compute_dtype_matches_the_oracle(make_cache):
    triton_matches_oracle(query(dtype=torch.bfloat16), make_cache(), output_tolerance("triton", "dequant", torch.bfloat16),
                          compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("scale", [1e6, 3e30, 1e-9])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_bf16_queries_beyond_fp16_range_are_computed_right(scale, granularity, make_cache):
    """fp16 dots with a bf16 query: values past 65504 (or below fp16's subnormals) must not
    overflow or flush; each head is rescaled by a power of two first."""
    q = query(dtype=torch.bfloat16, scale=scale)
    cache = make_cache(granularity=granularity)
    # a small sm_scale keeps the softmax away from one-hot, so the comparison has something to see
    triton_matches_oracle(q, cache, output_tolerance("triton", "dequant", torch.bfloat16), sm_scale=0.1 / (scale * math.sqrt(32)))


def test_bf16_query_heads_of_one_group_ten_orders_apart(make_cache):
    """Each head is rescaled by its own power of two: one factor for the whole query group would push
    the small heads (1e-5) into fp16's subnormals next to the large ones (1e5)."""
    q = query(dtype=torch.float32)
    q[:, 0::2] *= 1e5
    q[:, 1::2] *= 1e-5
    triton_matches_oracle(q.to(torch.bfloat16), make_cache(), output_tolerance("triton", "dequant", torch.bfloat16), sm_scale=0.3 / (1e-5 * math.sqrt(32)))


def test_bf16_query_write_through_fused_kernel_is_bit_identical_to_torch(make_cache):
    """bf16 pages written by the fused kernel (interpreter: integer rounding) equal torch's."""
    a, b = make_cache(kv_dtype="bf16", max_seq_len=40), make_cache(kv_dtype="bf16", max_seq_len=40)
    x = torch.randn(2, 2, 32, dtype=torch.float32, device=DEVICE) * 1e3
    slots = torch.stack([a.slots(0, torch.tensor([5]))[0], a.slots(1, torch.tensor([19]))[0]])
    a.write(x, -x, slots)
    write_cache(b, x, -x, slots)
    assert torch.equal(a.k_pages.view(torch.int16), b.k_pages.view(torch.int16))
    assert torch.equal(a.v_pages.view(torch.int16), b.v_pages.view(torch.int16))


# --------------------------------------------------------------------------- shared pages, writes
def shared_prefix_cache(make_cache):
    """Rows 0 and 1 share their first (full) page, as prefix caching does."""
    c = make_cache(lens=(16, 16), max_seq_len=48)
    c.block_table[1, 0] = c.block_table[0, 0]
    return c


def test_pages_shared_for_reading_decode_right(make_cache):
    c = shared_prefix_cache(make_cache)
    triton_matches_oracle(query(), c, output_tolerance("triton", "dequant", torch.float16))
    k0, _ = c.gather(0)
    k1, _ = c.gather(1)
    assert torch.equal(k0, k1)
    c.append(torch.ones(2, 2, 32, device=DEVICE), torch.ones(2, 2, 32, device=DEVICE))  # own pages: fine
    assert c.seq_lens.tolist() == [17, 17]


def test_append_into_a_page_another_row_reads_is_refused(make_cache):
    c = make_cache(lens=(5, 7), max_seq_len=32)
    c.block_table[1, 0] = c.block_table[0, 0]  # row 1 now reads row 0's partly filled page
    before = c.k_pages.clone()
    with pytest.raises(ValueError, match=r"page \d+ .*block_table\[0, 0\], block_table\[1, 0\]"):
        c.append(torch.ones(2, 2, 32, device=DEVICE), torch.ones(2, 2, 32, device=DEVICE))
    assert torch.equal(c.k_pages.view(torch.uint8), before.view(torch.uint8))
    assert c.seq_lens.tolist() == [5, 7]


def test_append_into_a_page_listed_twice_in_one_row_is_refused(make_cache):
    c = make_cache(lens=(16, 3), max_seq_len=48)
    c.block_table[0, 1] = c.block_table[0, 0]  # the next append of row 0 would overwrite its own tokens
    with pytest.raises(ValueError, match=r"block_table\[0, 0\], block_table\[0, 1\]"):
        c.append_tokens(torch.ones(1, 2, 32, device=DEVICE), torch.ones(1, 2, 32, device=DEVICE), [1, 0])


def test_two_rows_appending_into_one_reserved_page_is_refused(make_cache):
    c = make_cache(lens=(16, 16), max_seq_len=48)
    c.block_table[1, 1] = c.block_table[0, 1]  # both rows' next page
    with pytest.raises(ValueError, match=r"block_table\[0, 1\], block_table\[1, 1\]"):
        c.append(torch.ones(2, 2, 32, device=DEVICE), torch.ones(2, 2, 32, device=DEVICE))


@pytest.mark.parametrize("writer", ["write", "write_cache"])
def test_raw_writes_into_a_shared_page_are_refused(writer, make_cache):
    c = shared_prefix_cache(make_cache)
    slot = int(c.block_table[0, 0]) * c.block_size + 3
    x = torch.ones(1, 2, 32, device=DEVICE)
    fn = c.write if writer == "write" else (lambda *a: write_cache(c, *a))
    with pytest.raises(ValueError, match=rf"page {slot // c.block_size} "):
        fn(x, x, torch.tensor([slot], device=DEVICE))


# -------------------------------------------------------------------- tables edited after building
def test_decode_refuses_tables_edited_out_of_range(make_cache):
    c = make_cache()
    c.block_table[1, 0] = -3
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=-3 is out of range"):
        fp8kv.decode(query(), c, backend="triton")
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=-3 is out of range"):
        fp8kv.decode(query(), c, backend="reference")
    c.block_table[1, 0] = 10**6
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=1000000 is out of range"):
        fp8kv.decode(query(), c)
    # unchecked (CUDA-graph path): the kernel clamps the entry into the pool and returns
    out, _ = fp8kv.decode(query(), c, backend="triton", check=False)
    assert out.shape == (2, 4, 32)


def test_decode_refuses_seq_lens_edited_past_capacity(make_cache):
    c = make_cache()
    c.seq_lens[0] = 1000
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=1000 exceeds the capacity"):
        fp8kv.decode(query(), c, backend="triton")
    out, _ = fp8kv.decode(query(), c, backend="triton", check=False)  # clamped to the row: no stray reads
    assert out.shape == (2, 4, 32)


# ------------------------------------------------------------------------------- the write paths
def test_write_cache_slot_out_of_range_is_refused_not_a_segfault(make_cache):
    c = make_cache()
    x = torch.ones(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"slot_mapping has slot 1000000 >= num_blocks x block_size"):
        write_cache(c, x, x, torch.tensor([10**6], device=DEVICE))
    before = c.k_pages.clone()
    write_cache(c, x, x, torch.tensor([10**6], device=DEVICE), check=False)  # skipped by the kernel
    assert torch.equal(c.k_pages.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("writer", ["write", "write_cache"])
def test_float_slot_mapping_is_refused(writer, make_cache):
    c = make_cache()
    x = torch.ones(1, 2, 32, device=DEVICE)
    fn = c.write if writer == "write" else (lambda *a: write_cache(c, *a))
    with pytest.raises(TypeError, match="slot_mapping"):
        fn(x, x, torch.tensor([1.5], device=DEVICE))
    with pytest.raises(TypeError, match=r"slot_mapping\[0\]=1.5"):
        c.write(x, x, [1.5])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fused_write_refuses_non_finite_rows(bad, make_cache):
    c = make_cache(max_seq_len=32)
    x = torch.ones(1, 2, 32, device=DEVICE)
    x[0, 1, 7] = bad
    with pytest.raises(ValueError, match=r"k_new has non-finite values"):
        write_cache(c, x, torch.ones_like(x), c.slots(0, torch.tensor([5])))


def test_append_counts_must_be_non_negative_integers(make_cache):
    c = make_cache(max_seq_len=32)
    x = torch.ones(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"counts\[0\]=-1"):
        c.append_tokens(x, x, [-1, 2])
    with pytest.raises(TypeError, match=r"counts\[1\]=0.5"):
        c.append_tokens(x, x, [1, 0.5])
    with pytest.raises(TypeError, match=r"counts has dtype (torch\.)?float32"):
        c.append_tokens(x, x, torch.tensor([1.0, 0.0]))


# -------------------------------------------------------------------------- the cache's arguments
def test_cache_construction_refuses_nonsense():
    k = torch.randn(2, 8, 2, 32)
    with pytest.raises(TypeError, match=r"seq_lens\[0\]=3.7"):
        PagedKVCache.from_dense(k, k, [3.7, 2])
    with pytest.raises(TypeError, match="seq_lens has dtype torch.float32"):
        PagedKVCache.from_dense(k, k, torch.tensor([3.0, 2.0]))
    for bs, exc in ((0, ValueError), (-16, ValueError), (16.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match=rf"block_size={bs}"):
            PagedKVCache.from_dense(k, k, [3, 2], block_size=bs)
    with pytest.raises(TypeError, match=r"k_scale=True \(bool\)"):
        PagedKVCache.from_dense(k, k, [3, 2], k_scale=True)
    with pytest.raises(ValueError, match=r"k and v must be \[len, Hkv, D\] with equal shapes"):
        PagedKVCache.from_dense(k, torch.randn(2, 8, 1, 32), [3, 2])
    with pytest.raises(ValueError, match=r"seq_lens is empty"):
        PagedKVCache.from_dense(k[:0], k[:0], [])
    with pytest.raises(ValueError, match=r"seq_lens is empty"):  # a quantized cache the same (not torch.cat's error)
        QuantizedPagedKVCache.from_dense("int8_token_head", k[:0], k[:0], [])
    # more than the memory free: named, as PagedKVCache.empty names it (the allocator's RuntimeError before)
    with pytest.raises(ValueError, match=r"num_blocks=1000000000000 .* more than the .* GiB free on cpu"):
        QuantizedPagedKVCache.empty("int8_token_head", 1, 16, 2, 64, num_blocks=10**12)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        PagedKVCache.from_dense(torch.randn(2, 8, 0, 32), torch.randn(2, 8, 0, 32), [3, 2])
    with pytest.raises(ValueError, match="batch_size=0"):
        PagedKVCache.empty(0, 16, 2, 32)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        PagedKVCache.empty(2, 16, 0, 32)
    with pytest.raises(ValueError, match="block_table has shape \\(0, 1\\)"):
        PagedKVCache(torch.zeros(1, 16, 2, 32, dtype=torch.float8_e4m3fn),
                     torch.zeros(1, 16, 2, 32, dtype=torch.float8_e4m3fn),
                     torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize("bad, exc, match", [
    (None, TypeError, r"k=None \(NoneType\); expected a \[B, max_len, Hkv, D\] tensor or a list"),  # not iterable
    (3.0, TypeError, r"k=3.0 \(float\); expected a \[B, max_len, Hkv, D\] tensor"),
    ("kv", TypeError, r"k='kv' \(str\); expected"),
    (torch.zeros(2, 8, 2, 32, dtype=torch.float8_e4m3fn), TypeError,  # torch's isfinite NotImplementedError before
     "k\\[0\\] has dtype float8_e4m3fn; expected one of: float16, bfloat16, float32, float64"),
    (torch.zeros(2, 8, 2, 32, dtype=torch.complex64), TypeError, "k\\[0\\] has dtype complex64"),
])
def test_from_dense_refuses_k_that_is_no_float_sequences(bad, exc, match):
    v = torch.randn(2, 8, 2, 32)
    with pytest.raises(exc, match=match):
        PagedKVCache.from_dense(bad, v, [3, 2])


def test_lengths_on_meta_are_refused_by_name(make_cache):
    """seq_lens and counts on 'meta' hold no lengths (torch's NotImplementedError before)."""
    k = torch.randn(2, 8, 2, 32)
    with pytest.raises(ValueError, match="seq_lens is on meta; expected a tensor on 'cpu' or a CUDA device"):
        PagedKVCache.from_dense(k, k, torch.tensor([3, 2], device="meta"))
    c = make_cache()
    x = torch.randn(2, c.num_kv_heads, c.head_dim, device=c.device)
    with pytest.raises(ValueError, match="counts is on meta"):
        c.append_tokens(x, x, torch.ones(c.batch_size, dtype=torch.int64, device="meta"))


@pytest.mark.parametrize("call, name", [
    (lambda c, x, s: c.check_write(x, x, s, shared_checked="no"), "shared_checked"),  # truthy: skipped the check
    (lambda c, x, s: c.check_write(x, x, s, contents=None), "contents"),  # falsy: skipped the contents
    (lambda c, x, s: c.validate_arrays(contents=1), "contents"),
    (lambda c, x, s: c.validate_tables(nonempty="yes"), "nonempty"),
])
def test_cache_check_switches_are_true_or_false(call, name, make_cache):
    c = make_cache()
    x = torch.randn(1, c.num_kv_heads, c.head_dim, device=c.device)
    with pytest.raises(TypeError, match=rf"{name}=.* expected True or False"):
        call(c, x, c.slots(0, [5]))


def test_gather_and_slots_take_integer_indices(make_cache):
    c = make_cache()
    with pytest.raises(TypeError, match=r"i=1.0 \(float\)"):
        c.gather(1.0)
    with pytest.raises(ValueError, match=r"sequence index 2 is out of range"):
        c.gather(2)
    with pytest.raises(ValueError, match=r"seq=5; expected an int <= 1"):
        c.slots(5, torch.tensor([0]))


# ------------------------------------------------------------------------ fp8kv.decode's arguments
@pytest.mark.parametrize("sm_scale,exc", [(float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError),
                                          (-0.1, ValueError), (True, TypeError), ("0.1", TypeError)])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_decode_refuses_bad_sm_scale(sm_scale, exc, backend, make_cache):
    with pytest.raises(exc, match="sm_scale="):
        fp8kv.decode(query(), make_cache(), backend=backend, sm_scale=sm_scale)


def test_reference_refuses_bad_sm_scale_too(make_cache):
    with pytest.raises(ValueError, match="sm_scale=nan"):
        ref_decode(query(), make_cache(), sm_scale=float("nan"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_decode_refuses_non_finite_queries(bad, make_cache):
    q = query()
    q[1, 2, 3] = bad
    with pytest.raises(ValueError, match=r"q has 1 non-finite value\(s\) \(NaN/Inf\); the first is at index \(1, 2, 3\)"):
        fp8kv.decode(q, make_cache(), backend="triton")


def test_decode_refuses_mismatched_shapes_and_options(make_cache):
    c = make_cache()
    with pytest.raises(ValueError, match="q has batch 0 but the cache holds 2"):
        fp8kv.decode(query(b=0), c)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple of the cache's 2 KV heads"):
        fp8kv.decode(query(hq=3), c)
    with pytest.raises(ValueError, match="q has 0 heads"):
        fp8kv.decode(query(hq=0), c)
    with pytest.raises(TypeError, match="cache must be a fp8kv.PagedKVCache, got dict"):
        fp8kv.decode(query(), {})
    with pytest.raises(ValueError, match="backend='sglang'"):
        fp8kv.decode(query(), c, backend="sglang")
    with pytest.raises(TypeError, match="check='yes'"):
        fp8kv.decode(query(), c, check="yes")
    with pytest.raises(TypeError, match="num_splits=4 is not an option of the reference backend"):
        fp8kv.decode(query(), c, backend="reference", num_splits=4)


@pytest.mark.parametrize("option,value,exc", [("num_splits", 0, ValueError), ("num_splits", -2, ValueError),
                                              ("num_splits", 1.5, TypeError), ("block_n", 0, ValueError),
                                              ("block_n", 48, ValueError), ("num_warps", 3, ValueError),
                                              ("num_stages", 0, ValueError), ("out_dtype", torch.int8, TypeError)])
def test_triton_launch_options_are_validated(option, value, exc, make_cache):
    with pytest.raises(exc, match=rf"{option}"):
        fp8kv.decode(query(), make_cache(), backend="triton", **{option: value})


def test_unchecked_launcher_is_the_same_computation(make_cache):
    """check=False skips only the content checks: the numbers are those of the checked call."""
    q, c = query(), make_cache()
    a = fp8kv.decode(q, c, backend="triton")
    b = paged_decode(q, c)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_neighbours_of_the_cache_arguments(make_cache):
    k = torch.randn(2, 8, 2, 32)
    for bad in (None, 5):
        with pytest.raises(TypeError, match=rf"seq_lens={bad}"):
            PagedKVCache.from_dense(k, k, bad)
    nan_k = k.clone()
    nan_k[1, 2, 0, 4] = float("nan")
    with pytest.raises(ValueError, match=r"k has 1 non-finite value"):
        PagedKVCache.from_dense(nan_k, k, [3, 8])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda:3': this machine has no CUDA GPU"):
            PagedKVCache.empty(2, 16, 2, 32, device="cuda:3")
    c = make_cache(max_seq_len=32)
    with pytest.raises(ValueError, match=r"k_new has 3 rows but counts sum to 2"):
        c.append_tokens(torch.ones(3, 2, 32), torch.ones(3, 2, 32), [1, 1])


@pytest.mark.parametrize("option,value,exc", [("block_n", 1 << 20, ValueError), ("num_warps", True, TypeError)])
def test_launch_option_neighbours(option, value, exc, make_cache):
    with pytest.raises(exc, match=rf"{option}="):
        fp8kv.decode(query(), make_cache(), backend="triton", **{option: value})


def test_append_through_a_padding_entry_is_refused_not_dropped():
    """Engines pad unused block-table entries with -1; a sequence growing into one must be refused,
    not have its tokens skipped while seq_lens advances."""
    k = torch.randn(2, 16, 1, 32)
    c = PagedKVCache.from_dense(k, k, [16, 16], max_seq_len=32)
    c.block_table[0, 1] = -1
    x = torch.ones(1, 1, 32)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=-1 is out of range \[0, 4\): sequence 0"):
        c.append_tokens(x, x, [1, 0])
    assert c.seq_lens.tolist() == [16, 16]


def test_fp16_query_on_a_bf16_cache_is_refused():
    """fp16 dots over bf16 pages turn values beyond 65504 into inf: refused, as FlashInfer does."""
    k = torch.randn(1, 8, 2, 32)
    k[0, 3, 1, 5] = 1e5
    k = k.to(DEVICE)
    c = PagedKVCache.from_dense(k, k, [8], kv_dtype="bf16")
    with pytest.raises(TypeError, match="q is float16 but the cache is bf16"):
        fp8kv.decode(query(b=1), c, backend="triton")
    out, _ = fp8kv.decode(query(b=1, dtype=torch.bfloat16), c, backend="triton")
    assert torch.isfinite(out).all()


def test_fp8_mode_with_token_head_scales_is_refused_by_the_launcher_too(make_cache):
    from fp8kv.capability import UnsupportedError

    with pytest.raises(UnsupportedError, match="token_head needs dequant mode"):
        paged_decode(query(), make_cache(granularity="token_head"), mode="fp8")


def test_fp32_query_with_auto_backend_runs_the_reference(make_cache):
    q, c = query(dtype=torch.float32), make_cache()
    out, lse = fp8kv.decode(q, c)
    ref, ref_lse = ref_decode(q, c)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_a_query_strided_in_head_dim_is_refused_where_it_enters(backend, make_cache):
    """The GPU kernels address head_dim with stride 1: a transposed view is refused by fp8kv.decode
    (for every kernel, the Gluon one included), never read as if it were contiguous. The reference
    takes any layout."""
    q = torch.randn(2, 32, 4, device=DEVICE).to(torch.float16).transpose(1, 2)  # [2, 4, 32], stride 1 on heads
    cache = make_cache()
    ref, _ = fp8kv.decode(q, cache, backend="reference")
    assert torch.isfinite(ref).all()
    if backend == "triton":
        from fp8kv.capability import interpreter_on

        if DEVICE != "cuda" and not interpreter_on():
            pytest.skip("the Triton kernel runs on CPU under the interpreter only")
    else:
        from fp8kv.backends import supported

        if not supported("flashinfer", cache.kv_dtype)[0]:
            pytest.skip("FlashInfer cannot run here")
    with pytest.raises(ValueError, match=r"q has strides .* contiguous in its last \(head_dim\) dimension"):
        fp8kv.decode(q, cache, backend=backend, **({"gluon": True} if backend == "triton" else {}))
    with pytest.raises(ValueError, match="contiguous in its last"):
        paged_decode(q, cache, gluon=True)  # the launcher called directly refuses it too


# ------------------------------------------------------------------------- each check runs once
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("kv_dtype,granularity,options", [("fp8_e4m3", "tensor", {}), ("fp8_e5m2", "token_head", {}),
                                                          ("fp16", "tensor", {}),
                                                          ("fp8_e4m3", "channel", {"num_splits": 2, "block_n": 16})])
@pytest.mark.parametrize("entry", ["decode", "planned"])
def test_each_check_of_the_decode_path_runs_once_per_call(monkeypatch, make_cache, backend, check, kv_dtype,
                                                          granularity, options, entry):
    """fp8kv.decode validates where the input enters and the layers below trust it: the query against the
    cache (cache.check_query) and the backend (capability.check_query), its head_dim stride, the refusal of fp8
    mode over token_head scales and the cache's arrays (validate_arrays) each run exactly once per call, on
    either backend, checked or not, and once per plan through fp8kv.backends.planned (its runs check nothing)."""
    import importlib

    import fp8kv.ops  # noqa: F401  (loaded, so that its bindings of the checks are spied on too)
    from fp8kv.backends import planned

    capability = importlib.import_module("fp8kv.capability")  # fp8kv.capability is also a function's name

    if backend == "reference" and options:
        pytest.skip("the reference takes no launch options")
    counts: dict[str, int] = {}
    for name in ("check_query", "check_query_strides", "scales_refusal"):
        count_calls(monkeypatch, capability, name, counts)
    spied_cache = {}
    for name in ("check_query", "validate_arrays"):
        original = getattr(PagedKVCache, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            spied_cache[_name] += 1
            return _original(self, *args, **kwargs)

        spied_cache[name] = 0
        monkeypatch.setattr(PagedKVCache, name, counting)
    cache = make_cache(kv_dtype=kv_dtype, granularity=granularity)
    q = query()
    if entry == "decode":
        out, _ = fp8kv.decode(q, cache, backend=backend, check=check, **options)
    else:
        if not check:
            pytest.skip("planned() always checks")
        call = planned(q, cache, backend, **options)
        assert counts == dict.fromkeys(counts, 1) and spied_cache == {"check_query": 1, "validate_arrays": 1}
        out, _ = call()
        out, _ = call()  # a planned call checks nothing
    assert torch.isfinite(out).all()
    assert counts == {"check_query": 1, "check_query_strides": 1, "scales_refusal": 1}
    assert spied_cache == {"check_query": 1, "validate_arrays": 1}
