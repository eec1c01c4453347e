"""Multi-token attention over the paged cache (speculative verification, chunked prefill): the oracle
``fp8kv.reference.attend`` and the Triton kernel ``fp8kv.ops.attend.attend`` against it.

The oracle is checked on its own properties: one new token is :func:`fp8kv.reference.decode` bit for
bit, every row is a decode over the cache truncated after the row's position, a later key never
changes an earlier row, and a dense causal softmax written out here gives the same numbers. The
kernel runs under the Triton interpreter on CPU (fp16 queries: the interpreter's bf16 is wrong) on
small odd shapes, and compiled on a GPU (marker ``gpu``) on a large one.

Tolerances are the decode's (``fp8kv.reference.output_tolerance`` / ``lse_tolerance``, derived there
and in tests/test_ops.py from FP8's and the 16-bit types' rounding): a query row of this kernel is
computed as the decode computes its one row (the same dots on the same dequantized tiles, the same
roundings of q, p and the output), and the causal and window masks only remove terms.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import DEVICE, dequant_tol, indptr, make_q, matrix_cache, random_sinks, seeded

from fp8kv.cache import PagedKVCache
from fp8kv.capability import UnsupportedError
from fp8kv.quant import relative_error
from fp8kv.reference import FP8_MODE_TOL, lse_tolerance
from fp8kv.reference import attend as ref_attend
from fp8kv.reference import decode as ref_decode

triton = pytest.importorskip("triton")

from fp8kv.ops.attend import AttendPlan, attend, attend_launch, plan, run  # noqa: E402
from fp8kv.ops.attend.planning import chunk_smem_bytes  # noqa: E402

FP8_NAN_CODE = 0x7F  # NaN in both e4m3fn and e5m2


def dense_causal(q, cache, qo_lens, sm_scale, window=None, soft_cap=None, sinks=None):
    """The definition written out once more, as a dense masked softmax per sequence: query j of
    sequence i (position p = L - n + j) sees keys p - W < key <= p."""
    outs, lses = [], []
    row = 0
    group = q.shape[1] // cache.num_kv_heads
    for i, n in enumerate(qo_lens):
        if n == 0:
            continue
        k, v = cache.gather(i)  # [L, Hkv, D]
        length = k.shape[0]
        kq = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        vq = v.repeat_interleave(group, dim=1)
        qi = q[row:row + n].float()  # [n, Hq, D]
        s = torch.einsum("nhd,lhd->hnl", qi, kq) * sm_scale
        if soft_cap is not None:
            s = soft_cap * torch.tanh(s / soft_cap)
        pos = torch.arange(length - n, length)[:, None]
        key = torch.arange(length)[None, :]
        keep = key <= pos
        if window is not None:
            keep &= key > pos - window
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.float()[:, None, None].expand(-1, n, 1)], dim=-1)
            vq = torch.cat([vq, torch.zeros_like(vq[:1])])
        lse = torch.logsumexp(s, dim=-1)  # [Hq, n]
        out = torch.einsum("hnl,lhd->nhd", torch.exp(s - lse[..., None]), vq)
        outs.append(out)
        lses.append(lse.T)
        row += n
    return torch.cat(outs), torch.cat(lses)


# ------------------------------------------------------------------------------------------ oracle
VARIANTS = [dict(), dict(window=3), dict(soft_cap=2.5), dict(sinks="random"),
            dict(window=6, soft_cap=3.0, sinks="random")]


def _variant(spec, hq):
    return {k: (random_sinks(hq) if v == "random" else v) for k, v in spec.items()}


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(s) or "plain")
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_oracle_one_new_token_is_decode_bit_for_bit(spec, q_dtype):
    lens = [1, 17, 40]
    cache = matrix_cache(lens, 2, 64, granularity="head")
    q = make_q(3, 6, 64, q_dtype)
    kw = _variant(spec, 6)
    out, lse = ref_attend(q, cache, indptr([1, 1, 1]), return_lse=True, **kw)
    ref_out, ref_lse = ref_decode(q, cache, **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(ref_attend(q, cache, indptr([1, 1, 1]), **kw), ref_out)  # return_lse=False: out alone


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(s) or "plain")
def test_oracle_rows_are_decodes_of_the_truncated_cache(spec):
    """Row j of sequence i is what decode answers over the cache cut after the row's position."""
    lens, qo_lens = [9, 20, 5], [4, 7, 5]  # the last sequence is all new tokens
    cache = matrix_cache(lens, 1, 32, kv_dtype="fp8_e5m2", granularity="token_head")
    q = make_q(sum(qo_lens), 3, 32)
    kw = _variant(spec, 3)
    out, lse = ref_attend(q, cache, indptr(qo_lens), return_lse=True, **kw)
    row = 0
    for i, (length, n) in enumerate(zip(lens, qo_lens, strict=True)):
        for j in range(n):
            cut = cache.select([i])
            cut.seq_lens[0] = length - n + j + 1
            o, s = ref_decode(q[row:row + 1], cut, **kw)
            assert torch.equal(out[row:row + 1], o) and torch.equal(lse[row:row + 1], s), (i, j)
            row += 1


def test_oracle_is_causal_a_later_key_changes_no_earlier_row():
    lens, qo_lens = [12, 30], [5, 8]
    cache = matrix_cache(lens, 2, 32, kv_dtype="bf16")
    q = make_q(13, 4, 32)
    before = ref_attend(q, cache, indptr(qo_lens), return_lse=True)
    # rewrite the last token of sequence 1 (its last new token): only that query sees it
    changed = cache.clone()
    slot = changed.slots(1, [29])
    changed.write(torch.full((1, 2, 32), 3.0, device=DEVICE), torch.full((1, 2, 32), -5.0, device=DEVICE), slot)
    after = ref_attend(q, changed, indptr(qo_lens), return_lse=True)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a[:12], b[:12])  # sequence 0 and sequence 1's first 7 rows
        assert not torch.equal(a[12:], b[12:])


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(s) or "plain")
def test_oracle_matches_a_dense_causal_softmax(spec):
    lens, qo_lens = [29 + 37, 6, 8, 1], [37, 0, 3, 1]  # a chunk after 29 cached tokens, no rows, all new
    cache = matrix_cache(lens, 2, 32, granularity="channel")
    q = make_q(sum(qo_lens), 6, 32)
    kw = _variant(spec, 6)
    out, lse = ref_attend(q, cache, indptr(qo_lens, dtype=torch.int64), sm_scale=0.3, return_lse=True, **kw)
    want_out, want_lse = dense_causal(q, cache, qo_lens, 0.3, **kw)
    assert out.shape == (41, 6, 32) and lse.shape == (41, 6)
    assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_oracle_sequences_without_new_tokens_have_no_rows():
    cache = matrix_cache([4, 10, 7], 1, 32)
    q = make_q(3, 2, 32)
    out, lse = ref_attend(q, cache, indptr([0, 3, 0]), return_lse=True)
    alone = ref_attend(q, cache.select([1]), indptr([3]), return_lse=True)
    assert torch.equal(out, alone[0]) and torch.equal(lse, alone[1])
    empty = ref_attend(q[:0], cache, indptr([0, 0, 0]), return_lse=True)
    assert empty[0].shape == (0, 2, 32) and empty[1].shape == (0, 2)
    # a sequence of no tokens at all takes no rows either
    short = matrix_cache([0, 5], 1, 32)
    assert torch.equal(ref_attend(q[:2], short, indptr([0, 2])), ref_attend(q[:2], short.select([1]), indptr([2])))


# ------------------------------------------------------------------------------- bad input: oracle
def _bad_oracle_inputs():
    """(name, mutate(kwargs) -> kwargs, exception, message pattern) for every argument."""
    nan_q = make_q(5, 4, 32)
    nan_q[2, 1, 3] = float("nan")

    def put(**changes):
        return lambda kw: {**kw, **changes}

    return [
        ("cache-type", put(cache="cache"), TypeError, "cache must be a fp8kv.PagedKVCache"),
        ("q-type", put(q=[[1.0]]), TypeError, "q must be a torch.Tensor"),
        ("q-ndim", put(q=make_q(5, 4, 32)[:, 0]), ValueError, "q must be 3-D"),
        ("q-dtype", put(q=torch.zeros(5, 4, 32, dtype=torch.int32, device=DEVICE)), TypeError, "q has dtype int32"),
        ("q-head-dim", put(q=make_q(5, 4, 16)), ValueError, "q has head_dim 16"),
        ("q-heads", put(q=make_q(5, 3, 32)), ValueError, "q has 3 heads"),
        ("q-nan", put(q=nan_q), ValueError, r"q has 1 non-finite"),
        ("q-device", put(q=make_q(5, 4, 32).to("meta")), ValueError, "q is on meta"),
        ("indptr-list", put(qo_indptr=[0, 2, 5]), TypeError, "qo_indptr must be a torch.Tensor"),
        ("indptr-float", put(qo_indptr=torch.tensor([0.0, 2.0, 5.0], device=DEVICE)), TypeError,
         "qo_indptr has dtype float32"),
        ("indptr-int16", put(qo_indptr=indptr([2, 3], dtype=torch.int16)), TypeError, "qo_indptr has dtype int16"),
        ("indptr-2d", put(qo_indptr=indptr([2, 3])[None]), ValueError, "qo_indptr must be 1-D"),
        ("indptr-length", put(qo_indptr=indptr([2, 3, 0])), ValueError, r"qo_indptr has shape \(4,\); expected \[3\]"),
        ("indptr-start", put(qo_indptr=torch.tensor([1, 2, 5], dtype=torch.int32, device=DEVICE)), ValueError,
         r"qo_indptr\[0\]=1; expected 0"),
        ("indptr-decreasing", put(qo_indptr=torch.tensor([0, 4, 3], dtype=torch.int32, device=DEVICE)),
         ValueError, r"qo_indptr decreases at 1"),
        ("indptr-total", put(qo_indptr=indptr([2, 2])), ValueError, r"qo_indptr\[2\]=4; expected q's row count, total_q=5"),
        ("indptr-beyond-seq", put(q=make_q(8, 4, 32), qo_indptr=indptr([7, 1])), ValueError,
         r"sequence 0 qo_len=7 new tokens but seq_lens\[0\]=6"),
        ("indptr-device", put(qo_indptr=indptr([2, 3]).to("meta")), ValueError, "qo_indptr is on meta"),
        ("indptr-strided", put(qo_indptr=torch.tensor([0, 9, 2, 9, 5], dtype=torch.int32, device=DEVICE)[::2]),
         ValueError, r"qo_indptr has strides \(2,\); expected a contiguous tensor"),
        ("sm_scale-zero", put(sm_scale=0.0), ValueError, "sm_scale"),
        ("sm_scale-str", put(sm_scale="1"), TypeError, "sm_scale"),
        ("sm_scale-nan", put(sm_scale=float("nan")), ValueError, "sm_scale"),
        ("window-zero", put(window=0), ValueError, "window=0"),
        ("window-float", put(window=4.0), TypeError, "window"),
        ("window-bool", put(window=True), TypeError, "window"),
        ("soft_cap-negative", put(soft_cap=-1.0), ValueError, "soft_cap"),
        ("soft_cap-huge", put(soft_cap=1e31), ValueError, "soft_cap"),
        ("sinks-shape", put(sinks=torch.zeros(3, device=DEVICE)), ValueError, "sinks has shape"),
        ("sinks-dtype", put(sinks=torch.zeros(4, dtype=torch.float16, device=DEVICE)), TypeError, "sinks has dtype"),
        ("sinks-inf", put(sinks=torch.tensor([0.0, float("inf"), 0.0, 0.0], device=DEVICE)), ValueError,
         "sinks has 1 non-finite"),
    ]


BAD_ORACLE = _bad_oracle_inputs()


@pytest.mark.parametrize("name,mutate,exc,pattern", BAD_ORACLE, ids=[b[0] for b in BAD_ORACLE])
def test_oracle_refuses_bad_input_by_name(name, mutate, exc, pattern):
    cache = matrix_cache([6, 9], 2, 32)
    kw = mutate(dict(q=make_q(5, 4, 32), cache=cache, qo_indptr=indptr([2, 3])))
    with pytest.raises(exc, match=pattern):
        ref_attend(kw.pop("q"), kw.pop("cache"), kw.pop("qo_indptr"), **kw)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_oracle_refuses_a_return_lse_that_is_not_a_bool(bad):
    with pytest.raises(TypeError, match="return_lse"):
        ref_attend(make_q(5, 4, 32), matrix_cache([6, 9], 2, 32), indptr([2, 3]), return_lse=bad)


def test_oracle_refuses_a_cache_whose_tables_were_corrupted():
    cache = matrix_cache([6, 9], 2, 32)
    cache.block_table[1, 0] = cache.num_blocks + 3
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        ref_attend(make_q(5, 4, 32), cache, indptr([2, 3]))


# ------------------------------------------------------------------------------- kernel vs oracle
def check_kernel(q, cache, qo_lens, mode="dequant", tol=None, **kw):
    """Run the kernel and the oracle; assert shapes, dtypes, finiteness, the output's relative error
    (the decode's tolerance for this mode, query type and granularity) and the LSE's absolute error.
    Returns the output's relative error."""
    if tol is None:
        tol = FP8_MODE_TOL if mode == "fp8" else dequant_tol(q.dtype, cache.granularity)
    variants = {k: kw[k] for k in ("sm_scale", "window", "soft_cap", "sinks") if k in kw}
    out, lse = attend(q, cache, indptr(qo_lens), mode=mode, **kw)
    ref_out, ref_lse = ref_attend(q, cache, indptr(qo_lens), return_lse=True, **variants)
    assert out.shape == q.shape and out.dtype == kw.get("out_dtype", q.dtype)
    assert lse.shape == q.shape[:2] and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = relative_error(out.float(), ref_out)
    assert err <= tol, f"{mode} {cache} qo_lens={qo_lens} {kw}: rel err {err:.3e} > {tol:.3e}"
    if q.shape[0]:
        lse_tol = lse_tolerance("triton", mode, q.dtype, ref_lse)
        lse_err = float((lse - ref_lse).abs().max())
        assert lse_err <= lse_tol, f"lse err {lse_err:.3e} > {lse_tol:.3e}"
    return err


@pytest.mark.parametrize("q_len", [1, 2, 3, 5, 8])
def test_kernel_spec_verify_lengths(q_len):
    """Draft lengths 1-8 at group 4 (rows = q_len x 4), a sequence made of new tokens only, one past a
    page and one of several pages; one split and the default (several: few rows), e4m3 head scales."""
    lens = [q_len, 17, 40]
    cache = matrix_cache(lens, 2, 64, granularity="head", seed=q_len)
    q = make_q(3 * q_len, 8, 64, seed=q_len)
    for splits in (1, None):
        check_kernel(q, cache, [q_len] * 3, num_splits=splits, block_n=16)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "fp16"])
@pytest.mark.parametrize("group,block_m", [(1, 16), (3, 32), (2, 64)])
def test_kernel_chunk_after_cached_tokens(kv_dtype, group, block_m):
    """A chunk of 37 new tokens after 29 cached ones beside a 3-token draft: tiles of 16-64 rows, some
    starting inside a query's group of heads, each reading only the keys up to its last row."""
    lens, qo_lens = [29 + 37, 11], [37, 3]
    cache = matrix_cache(lens, 2, 64, kv_dtype=kv_dtype, seed=group)
    q = make_q(40, 2 * group, 64, seed=group)
    check_kernel(q, cache, qo_lens, block_m=block_m, block_n=32)


def test_kernel_ragged_batch_with_sequences_without_rows():
    """qo_len 0 (a cached sequence, and an empty one) between sequences with rows; all rows of the
    batch in one call, split and not."""
    lens, qo_lens = [4, 20, 0, 9, 30, 1], [0, 5, 0, 1, 12, 1]
    cache = matrix_cache(lens, 1, 64, kv_dtype="fp8_e5m2", granularity="tensor")
    q = make_q(sum(qo_lens), 4, 64)
    for splits in (1, 2):
        check_kernel(q, cache, qo_lens, num_splits=splits, block_m=16, block_n=16)
    out, lse = attend(q[:0], cache, indptr([0] * 6))
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


# group, head_dim, layout, granularity: every group of 1, 2, 4 and 5 (odd), both page layouts, head dims
# 64 and 80 (padded to 128 in registers, masked) and one 128
HEAD_LAYOUTS = [(1, 80, "HND", "channel"), (2, 64, "NHD", "token_head"), (4, 80, "NHD", "head"),
                (5, 64, "HND", "tensor"), (4, 128, "HND", "token_head"), (5, 80, "NHD", "channel")]


@pytest.mark.parametrize("group,head_dim,layout,granularity", HEAD_LAYOUTS)
def test_kernel_head_layouts_and_page_layouts(group, head_dim, layout, granularity):
    lens, qo_lens = [13, 33, 6], [3, 9, 6]
    cache = matrix_cache(lens, 2, head_dim, granularity=granularity, layout=layout, seed=group)
    q = make_q(18, 2 * group, head_dim, seed=head_dim)
    check_kernel(q, cache, qo_lens, block_n=16, num_splits=2)


@pytest.mark.parametrize("hkv,group,head_dim,block_m,mode", [(1, 20, 96, 16, "dequant"), (1, 16, 64, 32, "fp8"),
                                                             (2, 2, 256, 16, "dequant")])
def test_kernel_mqa_wide_groups_and_head_dims(hkv, group, head_dim, block_m, mode):
    """MQA groups whose rows fill several tiles per query (20 heads in tiles of 16: a query's heads split
    across programs) or one tile per two queries, and the widest head dim (256)."""
    lens, qo_lens = [11, 30], [3, 9]
    cache = matrix_cache(lens, hkv, head_dim, granularity="head", seed=group)
    q = make_q(12, hkv * group, head_dim, seed=group)
    check_kernel(q, cache, qo_lens, mode, block_m=block_m, block_n=32, num_splits=2)


@pytest.mark.parametrize("mode", ["dequant", "fp8"])
def test_kernel_chunk_tiles(mode):
    """A chunk's own tiles (CHUNK_TILES: 128 rows x 128 keys, 3 stages, head dim 128): a chunk of 40 after 260
    cached tokens (a partial last tile) beside one that is new tokens only, plain, split and windowed."""
    lens, qo_lens = [300, 33], [40, 33]
    cache = matrix_cache(lens, 2, 128, granularity="head", seed=3)
    q = make_q(73, 8, 128, seed=3)
    for kw in (dict(), dict(num_splits=2), dict(window=70)):
        check_kernel(q, cache, qo_lens, mode, block_m=128, block_n=128, num_stages=3, **kw)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head", "channel"])
def test_kernel_dequant_scale_granularities(kv_dtype, granularity):
    lens, qo_lens = [23, 8], [5, 8]
    cache = matrix_cache(lens, 2, 64, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(13, 4, 64)
    check_kernel(q, cache, qo_lens, block_n=16, block_m=16)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "channel"])
def test_kernel_fp8_mode_scale_granularities(kv_dtype, granularity):
    lens, qo_lens = [23, 40], [5, 29]
    cache = matrix_cache(lens, 2, 64, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(34, 4, 64)
    for splits in (1, 2):
        check_kernel(q, cache, qo_lens, mode="fp8", num_splits=splits, block_n=32, block_m=32)


def test_kernel_fp8_mode_is_really_fp8():
    """fp8 mode rounds q and p to e4m3: its error must be well above dequant mode's on the same input."""
    lens, qo_lens = [23, 40], [5, 29]
    cache = matrix_cache(lens, 2, 64)
    q = make_q(34, 4, 64)
    e_deq = check_kernel(q, cache, qo_lens, block_n=32)
    e_fp8 = check_kernel(q, cache, qo_lens, mode="fp8", block_n=32)
    assert e_fp8 > 4 * e_deq


def test_kernel_bf16_cache_and_queries_and_out_dtypes():
    """bf16 pages with bf16 queries (computed in fp32 by the interpreter, rounded by torch), and each
    out_dtype of an fp16 query over FP8 pages."""
    lens, qo_lens = [19, 7], [6, 7]
    cache = matrix_cache(lens, 2, 64, kv_dtype="bf16")
    check_kernel(make_q(13, 4, 64, torch.bfloat16), cache, qo_lens, block_n=16)
    fp8 = matrix_cache(lens, 2, 64)
    for out_dtype in (torch.float16, torch.bfloat16, torch.float32):
        # the output is rounded to out_dtype: a bf16 output takes bf16's u in the decode's 2u bound
        tol = dequant_tol(torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float16, "tensor")
        check_kernel(make_q(13, 4, 64), fp8, qo_lens, tol=tol, out_dtype=out_dtype, block_n=16)


ATTEND_VARIANTS = [dict(window=1), dict(window=5), dict(window=16), dict(window=50), dict(window=1000), dict(soft_cap=2.0),
                   dict(sinks="random"), dict(window=7, soft_cap=3.0, sinks="random")]


@pytest.mark.parametrize("spec", ATTEND_VARIANTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("mode,granularity", [("dequant", "token_head"), ("fp8", "head")])
def test_kernel_variants(spec, mode, granularity):
    """Window (from each query's own position; 1: the query alone; 50: past every sequence but within the
    page table; 1000: past the page table, the plain kernel), soft cap and sinks, over a chunk, a draft and a lone token, one split and several."""
    lens, qo_lens = [25 + 21, 9, 12], [21, 4, 1]
    cache = matrix_cache(lens, 2, 64, granularity=granularity, max_seq_len=64)
    q = make_q(26, 6, 64)
    kw = _variant(spec, 6)
    for splits in (1, 3):
        check_kernel(q, cache, qo_lens, mode, num_splits=splits, block_m=16, block_n=32, **kw)


def _poison(cache, positions):
    """NaN into K and V of the given {sequence: positions}: a kernel that loaded any of them, even masked
    out of the softmax, would turn a row NaN (p = 0 times NaN in the P.V dot)."""
    bs = cache.block_size
    for b, where in positions.items():
        for t in where:
            page, slot = int(cache.block_table[b, t // bs]), t % bs
            for pages in (cache.k_pages, cache.v_pages):
                nhd = pages if cache.layout == "NHD" else pages.transpose(1, 2)
                if cache.is_fp8:
                    nhd.view(torch.uint8)[page, slot] = FP8_NAN_CODE
                else:
                    nhd[page, slot] = float("nan")


# e5m2 and fp16 pages: their NaN codes convert to NaN under the interpreter too (e4m3's 0x7F decodes to 480 there)
@pytest.mark.parametrize("kv_dtype,layout,mode", [("fp8_e5m2", "HND", "dequant"), ("fp16", "NHD", "dequant"),
                                                  ("fp8_e5m2", "NHD", "fp8")])
def test_kernel_reads_no_key_past_a_tiles_last_row(kv_dtype, layout, mode):
    """A chunk of 40 new tokens after 8 cached, one query head per KV head, tiles of 16 rows: keys past
    position 8 + 15 are poisoned. The first tile's rows never read them (bit-identical to the clean
    cache), the later rows do (NaN): fully masked key tiles are skipped, not masked."""
    lens, qo_lens = [48], [40]
    clean = matrix_cache(lens, 2, 64, kv_dtype=kv_dtype, layout=layout)
    dirty = clean.clone()
    _poison(dirty, {0: range(8 + 16, 48)})
    q = make_q(40, 2, 64)
    for splits in (1, 2):
        kw = dict(mode=mode, num_splits=splits, block_m=16, block_n=32)
        a, b = attend(q, clean, indptr(qo_lens), **kw), attend(q, dirty, indptr(qo_lens), **kw)
        assert torch.equal(a[0][:16], b[0][:16]) and torch.equal(a[1][:16], b[1][:16])
        assert torch.isnan(b[0][16:]).all()  # the poison is really there


@pytest.mark.parametrize("kv_dtype,layout,mode", [("fp8_e5m2", "NHD", "dequant"), ("fp16", "HND", "dequant"),
                                                  ("fp8_e5m2", "HND", "fp8")])
def test_kernel_reads_no_key_before_the_window(kv_dtype, layout, mode):
    """Window 9: keys before the first query's window (of a chunk and of a draft) are poisoned; no row
    reads them, with one split and several."""
    lens, qo_lens = [30 + 20, 25], [20, 3]
    clean = matrix_cache(lens, 2, 64, kv_dtype=kv_dtype, layout=layout, max_seq_len=64)
    dirty = clean.clone()
    _poison(dirty, {0: range(0, 30 - 8), 1: range(0, 22 - 8)})
    q = make_q(23, 4, 64)
    for splits in (1, 3):
        kw = dict(mode=mode, num_splits=splits, block_m=16, block_n=32)
        a, b = attend(q, clean, indptr(qo_lens), window=9, **kw), attend(q, dirty, indptr(qo_lens), window=9, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert torch.isnan(attend(q, dirty, indptr(qo_lens), **kw)[0]).all()  # the poison is really there


# ------------------------------------------------------------------------------------------ launch
def test_launch_sizes_tiles_by_the_rows_and_splits_few_rows():
    cache = matrix_cache([4000, 4000], 2, 128)
    draft = attend_launch([4, 4], [4000, 4000], cache, 4, "dequant", num_sms=132)
    assert draft["block_m"] == 16 and draft["num_splits"] > 1  # 16 rows a sequence: few programs, split
    chunk = attend_launch([512, 512], [4000, 4000], cache, 4, "dequant", num_sms=132)
    assert chunk["block_m"] == 128 and chunk["num_warps"] == 8
    assert chunk["num_splits"] == 3  # 2 x 16 tiles x 2 KV heads = 64 programs: split to fill one wave of 132
    many = attend_launch([512, 512], [4000, 4000], cache, 4, "dequant", num_sms=60)
    assert many["num_splits"] == 1  # 64 programs fill a wave of 60 SMs
    for cfg in (draft, chunk, many):  # whole key tiles a split, none empty
        assert cfg["tokens_per_split"] % cfg["block_n"] == 0
        assert (cfg["num_splits"] - 1) * cfg["tokens_per_split"] < 4000 <= cfg["num_splits"] * cfg["tokens_per_split"]
    window = attend_launch([4, 4], [4000, 4000], cache, 4, "dequant", window=100, num_sms=132)
    assert window["num_splits"] * window["tokens_per_split"] < 4000  # the splits tile the window, not the row


def test_chunk_tiles_are_the_largest_that_fit_shared_memory():
    """On sm90 and newer a chunk (128-row tiles) takes 128-key tiles three deep where they fit the GPU's shared
    memory (an H100's or H200's 227 KiB), two deep where only those fit (a GPU of 163 KiB), else the 64-key
    default; sm80 keeps the default (its builds of them spill); a draft's small tiles and a caller's own keep theirs."""
    h100, smaller, ada = 232448, 166912, 101376  # shared_memory_per_block_optin, bytes
    for kv_dtype, expected in (("bf16", {h100: (128, 3), smaller: (128, 2), ada: (64, 1)}),
                               ("fp8_e4m3", {h100: (128, 3), smaller: (128, 3), ada: (128, 2)})):
        cache = matrix_cache([4000, 4000], 2, 128, kv_dtype=kv_dtype)
        for smem, tiles in expected.items():
            cfg = attend_launch([512, 512], [4000, 4000], cache, 4, "dequant", num_sms=132, smem_bytes=smem,
                                arch="sm90")
            assert (cfg["block_n"], cfg["num_stages"]) == tiles  # (64, 1): the default, 1 stage in the interpreter
            if tiles[0] == 128:
                assert chunk_smem_bytes(*tiles, 128, 1 if kv_dtype != "bf16" else 2) <= smem
        a100 = attend_launch([512, 512], [4000, 4000], cache, 4, "dequant", num_sms=108, smem_bytes=smaller, arch="sm80")
        assert a100["block_n"] == 64
    cache = matrix_cache([4000, 4000], 2, 128)
    draft = attend_launch([4, 4], [4000, 4000], cache, 4, "dequant", num_sms=132, smem_bytes=h100, arch="sm90")
    assert draft["block_n"] == 64
    own = attend_launch([512, 512], [4000, 4000], cache, 4, "dequant", num_sms=132, smem_bytes=h100, block_n=32,
                        arch="sm90")
    assert own["block_n"] == 32 and own["num_stages"] != 3
    assert chunk_smem_bytes(64, 2, 128, 2) == 98304  # the sm90 build's shared memory (scripts/attend_sass.py)


# ------------------------------------------------------------------------------------ plan and run
@pytest.mark.parametrize("kw", [dict(), dict(num_splits=3, block_n=16), dict(mode="fp8", block_n=32),
                                dict(window=7, soft_cap=20.0, sinks="sinks", out_dtype=torch.float32)],
                         ids=["default", "split", "fp8", "variants"])
def test_a_plan_runs_what_attend_computes_bit_for_bit(kw):
    """attend() is checks + plan + run: a plan made once and run (twice) answers the same bits."""
    kw = {k: (random_sinks(8) if v == "sinks" else v) for k, v in kw.items()}
    lens, qo_lens = [21, 40, 5], [3, 16, 0]
    cache = matrix_cache(lens, 2, 64, granularity="head")
    q = make_q(sum(qo_lens), 8, 64)
    p = plan(q, cache, indptr(qo_lens), **kw)
    assert isinstance(p, AttendPlan) and p.qo_lens == tuple(qo_lens) and p.shape == tuple(q.shape)
    expected = attend(q, cache, indptr(qo_lens), **kw)
    for _ in range(2):
        out, lse = run(p, q, cache, indptr(qo_lens))
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


def test_a_plan_reads_the_query_when_it_runs_and_takes_counts_read_already():
    """A plan holds no query: refilled in place, the next run answers for the new values. Planned from the
    query's shape alone (a meta tensor) with the counts given, it is the same plan."""
    lens, qo_lens = [9, 30], [4, 7]
    cache = matrix_cache(lens, 1, 32)
    q = make_q(11, 2, 32)
    p = plan(q, cache, indptr(qo_lens))
    first = run(p, q, cache, indptr(qo_lens))[0].clone()
    q.copy_(make_q(11, 2, 32, seed=9))
    again = run(p, q, cache, indptr(qo_lens))[0]
    assert not torch.equal(first, again)
    assert torch.equal(again, attend(q, cache, indptr(qo_lens))[0])
    meta = plan(torch.empty(11, 2, 32, dtype=q.dtype, device="meta"), cache, None, qo_lens=qo_lens)
    assert meta.grid == p.grid and meta.config == p.config and meta.constexprs == p.constexprs


@pytest.mark.parametrize("name,options,exc,pattern", [
    ("unknown", dict(gluon=True), TypeError, "gluon=True is not an option of the triton attend"),
    ("use_tensor_cores", dict(use_tensor_cores=False), TypeError, "use_tensor_cores=False is not an option"),
    ("convert-name", dict(convert="fast"), ValueError, "convert='fast'"),
    *([("convert", dict(convert="ptx"), UnsupportedError, "convert='ptx' is inline GPU assembly")]
      if DEVICE == "cpu" else []),
])
def test_a_plan_refuses_options_it_does_not_take_by_name(name, options, exc, pattern):
    cache = matrix_cache([6, 9], 2, 32)
    with pytest.raises(exc, match=pattern):
        plan(make_q(5, 4, 32), cache, indptr([2, 3]), **options)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_convert_is_refused_over_16_bit_pages(kv_dtype):
    """convert says how FP8 codes become 16-bit values: over 16-bit pages nothing is converted, and a convert given
    there was ignored. Refused by every entry (the attend kernel, fp8kv.attend's decode paths, fp8kv.decode); the
    default (None) runs, as convert does over FP8 pages."""
    import fp8kv

    dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float16
    cache, fp8 = matrix_cache([6, 9], 2, 32, kv_dtype=kv_dtype), matrix_cache([6, 9], 2, 32)
    q, one = make_q(5, 4, 32, dtype), make_q(2, 4, 32, dtype)
    calls = [lambda c, **kw: attend(q, c, indptr([2, 3]), **kw),
             lambda c, **kw: plan(q, c, indptr([2, 3]), **kw),
             lambda c, **kw: fp8kv.attend(q, c, indptr([2, 3]), backend="triton", **kw),
             lambda c, **kw: fp8kv.attend(make_q(4, 4, 32, dtype), c, indptr([2, 2]), backend="triton", **kw),
             lambda c, **kw: fp8kv.attend(one, c, indptr([1, 1]), backend="triton", **kw),
             lambda c, **kw: fp8kv.decode(one, c, backend="triton", **kw)]
    for call in calls:
        with pytest.raises(ValueError, match=f"convert='software' .*; {kv_dtype} pages are read as they are: pass "
                                             "convert=None"):
            call(cache, convert="software")
        call(cache, convert=None)
        call(fp8, convert="software")


def test_convert_is_refused_in_fp8_mode():
    """fp8 mode's dots take the FP8 tiles as they are: a convert given there was ignored. Refused by the decode and
    the attend alike; dequant mode takes it."""
    import fp8kv

    fp8 = matrix_cache([6, 9], 2, 32)
    q, one = make_q(5, 4, 32, torch.float16), make_q(2, 4, 32, torch.float16)
    calls = [lambda **kw: attend(q, fp8, indptr([2, 3]), **kw),
             lambda **kw: fp8kv.attend(q, fp8, indptr([2, 3]), backend="triton", **kw),
             lambda **kw: fp8kv.decode(one, fp8, backend="triton", **kw)]
    for call in calls:
        with pytest.raises(ValueError, match="convert='software' .*; mode='fp8' multiplies the FP8 tiles as they "
                                             "are: pass convert=None"):
            call(mode="fp8", convert="software")
        call(mode="fp8")
        call(mode="dequant", convert="software")


def test_a_plan_refuses_split_partials_past_32_bit_offsets():
    """The split combine addresses [total_q, Hq, splits, D] partials with 32-bit offsets: a plan whose
    partials would pass 2^31 elements asks for fewer splits, by name (planned from the shape alone)."""
    cache = matrix_cache([4096], 1, 32)
    q = torch.empty(2**17, 8, 32, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="num_splits=64: .* exceed"):
        plan(q, cache, None, qo_lens=[2**17], num_splits=64, block_n=64)
    assert plan(q, cache, None, qo_lens=[2**17], num_splits=63, block_n=64).config["num_splits"] < 64


# ------------------------------------------------------------------------------- bad input: kernel
@pytest.mark.parametrize("name,mutate,exc,pattern", BAD_ORACLE, ids=[b[0] for b in BAD_ORACLE])
def test_kernel_refuses_what_the_oracle_refuses(name, mutate, exc, pattern):
    cache = matrix_cache([6, 9], 2, 32)
    kw = mutate(dict(q=make_q(5, 4, 32), cache=cache, qo_indptr=indptr([2, 3])))
    with pytest.raises(exc, match=pattern):
        attend(kw.pop("q"), kw.pop("cache"), kw.pop("qo_indptr"), **kw)


BAD_LAUNCH = [
    ("mode", dict(mode="fp4"), ValueError, "mode='fp4'"),
    ("mode-auto", dict(mode="auto"), ValueError, "mode='auto'"),
    ("out_dtype", dict(out_dtype=torch.int8), TypeError, "out_dtype=torch.int8"),
    ("out_dtype-str", dict(out_dtype="fp16"), TypeError, "out_dtype='fp16'"),
    ("num_splits-zero", dict(num_splits=0), ValueError, "num_splits=0"),
    ("num_splits-float", dict(num_splits=2.0), TypeError, "num_splits"),
    ("block_m-8", dict(block_m=8), ValueError, "block_m=8"),
    ("block_m-48", dict(block_m=48), ValueError, "block_m=48"),
    ("block_m-str", dict(block_m="16"), TypeError, "block_m"),
    ("block_n-8", dict(block_n=8), ValueError, "block_n=8"),
    ("block_n-48", dict(block_n=48), ValueError, "block_n=48"),
    ("block_n-512", dict(block_n=512), ValueError, "block_n=512"),
    ("block_n-fp8", dict(mode="fp8", block_n=16), ValueError, "fp8 mode needs block_n >= 32"),
    ("num_warps-3", dict(num_warps=3), ValueError, "num_warps=3"),
    ("num_warps-bool", dict(num_warps=True), TypeError, "num_warps"),
    ("num_stages-zero", dict(num_stages=0), ValueError, "num_stages=0"),
    ("num_stages-float", dict(num_stages=2.5), TypeError, "num_stages"),
    ("num_stages-huge", dict(num_stages=10**9), ValueError, r"num_stages=1000000000; expected 1 to 8"),  # each stage a tile in smem
    ("q-fp32", dict(q=make_q(5, 4, 32, torch.float32)), TypeError, "q is fp32"),
    ("q-strided", dict(q=make_q(5, 4, 64)[..., ::2]), ValueError, "contiguous in its last"),
]


@pytest.mark.parametrize("name,changes,exc,pattern", BAD_LAUNCH, ids=[b[0] for b in BAD_LAUNCH])
def test_kernel_refuses_bad_launch_options_by_name(name, changes, exc, pattern):
    kw = {**dict(q=make_q(5, 4, 32), cache=matrix_cache([6, 9], 2, 32), qo_indptr=indptr([2, 3])), **changes}
    with pytest.raises(exc, match=pattern):
        attend(kw.pop("q"), kw.pop("cache"), kw.pop("qo_indptr"), **kw)


@pytest.mark.parametrize("kv_dtype,granularity,q_dtype,exc,pattern", [
    ("bf16", "tensor", torch.float16, TypeError, "q is float16 but the cache is bf16"),
    ("fp16", "tensor", torch.float16, UnsupportedError, "fp8 mode needs an FP8 KV cache"),
    ("fp8_e4m3", "token_head", torch.float16, UnsupportedError, "token_head needs dequant mode"),
])
def test_kernel_refuses_what_it_cannot_run(kv_dtype, granularity, q_dtype, exc, pattern):
    cache = matrix_cache([6, 9], 2, 32, kv_dtype=kv_dtype, granularity=granularity)
    with pytest.raises(exc, match=pattern):
        attend(make_q(5, 4, 32, q_dtype), cache, indptr([2, 3]), mode="dequant" if kv_dtype == "bf16" else "fp8")


# ------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype,granularity,mode", [("fp8_e4m3", "tensor", "dequant"), ("fp8_e4m3", "head", "fp8"),
                                                       ("fp8_e5m2", "token_head", "dequant"),
                                                       ("bf16", "tensor", "dequant")])
def test_large_shapes_on_gpu(kv_dtype, granularity, mode):
    """B = 4 at ~5000 tokens (32/8/128, bf16 queries): a 4-token draft per sequence, and a 512-row chunk
    in two sequences beside drafts in the others, plain and with a window, soft cap and sinks."""
    lens = [5000, 4999, 5001, 3000]
    cache = matrix_cache(lens, 8, 128, kv_dtype=kv_dtype, granularity=granularity)
    for qo_lens in ([4, 4, 4, 4], [512, 4, 512, 1]):
        q = make_q(sum(qo_lens), 32, 128, torch.bfloat16, seed=len(qo_lens))
        check_kernel(q, cache, qo_lens, mode)
        check_kernel(q, cache, qo_lens, mode, window=1024, soft_cap=30.0, sinks=random_sinks(32))


def test_the_attend_oracle_checks_its_counts_against_q_and_the_rows():
    """fp8kv.reference.paged_attend (public) returned rows of q it never read as uninitialized memory, and a count
    longer than its row as plausible numbers."""
    from fp8kv.reference import paged_attend

    k = torch.randn(2, 5, 2, 64, generator=seeded(0))
    cache = PagedKVCache.from_dense(k, k, [5, 5])
    with pytest.raises(ValueError, match=r"qo_lens=\[1, 1\] for q of 4 rows over 2 sequences"):
        paged_attend(torch.randn(4, 4, 64), cache, [1, 1])
    with pytest.raises(ValueError, match=r"qo_lens\[0\]=9; expected 0 to the sequence's 5 tokens"):
        paged_attend(torch.randn(10, 4, 64), cache, [9, 1])
    out, lse = paged_attend(torch.randn(2, 4, 64), cache, [1, 1])
    assert out.shape == (2, 4, 64) and bool(torch.isfinite(lse).all())
