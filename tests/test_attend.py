"""Multi-token attention over the paged cache (speculative verification, chunked prefill): the oracle
``fp8kv.reference.attend`` and the Triton kernel ``fp8kv.attend_ops.attend`` against it.

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

from fp8kv.reference import attend as ref_attend
from fp8kv.reference import decode as ref_decode

triton = pytest.importorskip("triton")
from test_ops import DEVICE, make_cache  # noqa: E402


def indptr(qo_lens, device=DEVICE, dtype=torch.int32) -> torch.Tensor:
    """``qo_indptr`` of these per-sequence new-token counts."""
    return torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=dtype, device=device)


def make_q(total_q, hq, d, dtype=torch.float16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(total_q, hq, d, generator=g).to(DEVICE, dtype)


def random_sinks(hq, seed=3):
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


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
    cache = make_cache(lens, 2, 64, granularity="head")
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
    cache = make_cache(lens, 1, 32, kv_dtype="fp8_e5m2", granularity="token_head")
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
    cache = make_cache(lens, 2, 32, kv_dtype="bf16")
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
    cache = make_cache(lens, 2, 32, granularity="channel")
    q = make_q(sum(qo_lens), 6, 32)
    kw = _variant(spec, 6)
    out, lse = ref_attend(q, cache, indptr(qo_lens, dtype=torch.int64), sm_scale=0.3, return_lse=True, **kw)
    want_out, want_lse = dense_causal(q, cache, qo_lens, 0.3, **kw)
    assert out.shape == (41, 6, 32) and lse.shape == (41, 6)
    assert torch.allclose(out, want_out, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_oracle_sequences_without_new_tokens_have_no_rows():
    cache = make_cache([4, 10, 7], 1, 32)
    q = make_q(3, 2, 32)
    out, lse = ref_attend(q, cache, indptr([0, 3, 0]), return_lse=True)
    alone = ref_attend(q, cache.select([1]), indptr([3]), return_lse=True)
    assert torch.equal(out, alone[0]) and torch.equal(lse, alone[1])
    empty = ref_attend(q[:0], cache, indptr([0, 0, 0]), return_lse=True)
    assert empty[0].shape == (0, 2, 32) and empty[1].shape == (0, 2)
    # a sequence of no tokens at all takes no rows either
    short = make_cache([0, 5], 1, 32)
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
    cache = make_cache([6, 9], 2, 32)
    kw = mutate(dict(q=make_q(5, 4, 32), cache=cache, qo_indptr=indptr([2, 3])))
    with pytest.raises(exc, match=pattern):
        ref_attend(kw.pop("q"), kw.pop("cache"), kw.pop("qo_indptr"), **kw)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_oracle_refuses_a_return_lse_that_is_not_a_bool(bad):
    with pytest.raises(TypeError, match="return_lse"):
        ref_attend(make_q(5, 4, 32), make_cache([6, 9], 2, 32), indptr([2, 3]), return_lse=bad)


def test_oracle_refuses_a_cache_whose_tables_were_corrupted():
    cache = make_cache([6, 9], 2, 32)
    cache.block_table[1, 0] = cache.num_blocks + 3
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        ref_attend(make_q(5, 4, 32), cache, indptr([2, 3]))
