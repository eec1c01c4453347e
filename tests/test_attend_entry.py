"""``fp8kv.attend``, the one checked entry of multi-token attention, and ``fp8kv.backends.planned_attend``.

A decode is an attend of one new token per sequence: through the reference and the Triton backend (which runs
the decode's plan for it) the two entries agree bit for bit; the attend kernel, asked for by a launch option,
meets the decode within its tolerance. Every backend answers what the oracle
(``fp8kv.reference.attend``) answers: Triton under the interpreter, vLLM's kernel as the fake of
tests/test_vllm.py defines it (and the real one where it imports), FlashInfer on a GPU. Bad input is
refused by name before any backend runs, and each check of the path runs once per call.
"""

from __future__ import annotations

import functools
import importlib
import re

import pytest
import torch
from fixtures import DEVICE, count_calls, dequant_tol, indptr, make_q, matrix_cache, random_sinks, seeded

import fp8kv
from fp8kv import backends, reference
from fp8kv.cache import PagedKVCache
from fp8kv.capability import UnsupportedError
from fp8kv.capability import check as capability_check
from fp8kv.quant import relative_error
from fp8kv.reference import FP8_MODE_TOL, lse_tolerance, output_tolerance

pytest.importorskip("triton")
import test_vllm  # noqa: E402
from test_vllm import REAL_VLLM, _cache  # noqa: E402

from fp8kv.ops.attend import AttendPlan  # noqa: E402

ON_CPU = DEVICE == "cpu"
VARIANTS = [{}, {"window": 6}, {"soft_cap": 15.0}, {"sinks": "sinks"}, {"sm_scale": 0.2},
            {"window": 3, "soft_cap": 8.0, "sinks": "sinks"}]


@pytest.fixture(name="fake_vllm")
def _fake_vllm(monkeypatch):
    """tests/test_vllm.py's fake vLLM: its kernel by vLLM's documented semantics (several queries per sequence
    included: query j at position ``seqused_k - qo_len + j``), on a CPU machine with the interpreter on."""
    return test_vllm.fake_vllm.__wrapped__(monkeypatch)


def _variants(kw: dict, hq: int) -> dict:
    return {k: (random_sinks(hq) if v == "sinks" else v) for k, v in kw.items()}


# ------------------------------------------------------------------------------ decode = one new token
@pytest.mark.parametrize("kv_dtype,granularity", [("fp8_e4m3", "tensor"), ("fp8_e5m2", "token_head"),
                                                  ("fp8_e4m3", "channel"), ("fp16", "tensor")])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "plain")
def test_one_new_token_is_the_decode_bit_for_bit_on_the_reference(kv_dtype, granularity, q_dtype, kw):
    cache = matrix_cache([1, 17, 40], 2, 32, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(3, 6, 32, q_dtype)
    kw = _variants(kw, 6)
    out, lse = fp8kv.attend(q, cache, indptr([1, 1, 1]), "reference", **kw)
    dec_out, dec_lse = fp8kv.decode(q, cache, "reference", **kw)
    assert torch.equal(out, dec_out) and torch.equal(lse, dec_lse)


ONE_TOKEN_CASES = [("fp8_e4m3", "head", "dequant"), ("fp8_e5m2", "channel", "dequant"),
                   ("fp8_e4m3", "token_head", "dequant"), ("fp16", "tensor", "dequant"), ("fp8_e4m3", "tensor", "fp8")]


@pytest.mark.parametrize("kv_dtype,granularity,mode", ONE_TOKEN_CASES)
@pytest.mark.parametrize("kw", VARIANTS[:4], ids=lambda kw: ",".join(kw) or "plain")
def test_one_new_token_is_the_decode_bit_for_bit_on_triton(kv_dtype, granularity, mode, kw):
    """One new token per sequence through the Triton backend runs the decode's plan: the same answer as
    fp8kv.decode, bit for bit (and the decode's speed: its Gluon tile path where that runs)."""
    cache = matrix_cache([1, 17, 70], 2, 64, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(3, 8, 64)
    kw = _variants(kw, 8)
    out, lse = fp8kv.attend(q, cache, indptr([1, 1, 1]), "triton", mode, **kw)
    dec_out, dec_lse = fp8kv.decode(q, cache, "triton", mode, **kw)
    assert torch.equal(out, dec_out) and torch.equal(lse, dec_lse)
    assert type(backends.planned_attend(q, cache, indptr([1, 1, 1]), "triton", mode, **kw).args[0]).__name__ == \
        "DecodePlan"


@pytest.mark.parametrize("head_dim", [8, 12])
def test_a_head_dim_below_16_pads_the_decodes_dot_to_16(head_dim):
    """tl.dot takes K >= 16 on a GPU: the decode pads a small head_dim's q.k dot to 16 (masked), as the attend
    kernel does, so the one-token attend it now serves runs where it ran before."""
    cache = matrix_cache([1, 17, 40], 2, head_dim)
    q = make_q(3, 4, head_dim)
    plan = backends.planned_attend(q, cache, indptr([1, 1, 1]), "triton").args[0]
    assert plan.launch.constexprs["D_PAD"] == 16 and plan.launch.constexprs["HEAD_DIM"] == head_dim
    out, _ = fp8kv.attend(q, cache, indptr([1, 1, 1]), "triton")
    ref, _ = fp8kv.decode(q, cache, "reference")
    assert relative_error(out.float(), ref) <= dequant_tol(q.dtype, "tensor")


@pytest.mark.parametrize("kv_dtype,granularity,mode", ONE_TOKEN_CASES)
@pytest.mark.parametrize("kw", VARIANTS[:4], ids=lambda kw: ",".join(kw) or "plain")
def test_the_attend_kernel_at_one_new_token_is_the_decode_within_its_tolerance(kv_dtype, granularity, mode, kw):
    """A launch option of the attend kernel runs that kernel at one new token too. Both Triton kernels meet the
    oracle within the decode's tolerance, so they meet each other within twice it (they round q, the tiles
    and p alike, but tile and split the keys differently)."""
    cache = matrix_cache([1, 17, 70], 2, 64, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(3, 8, 64)
    kw = _variants(kw, 8)
    assert isinstance(backends.planned_attend(q, cache, indptr([1, 1, 1]), "triton", mode, block_m=16,
                                              **kw).args[0], AttendPlan)
    out, lse = fp8kv.attend(q, cache, indptr([1, 1, 1]), "triton", mode, block_m=16, **kw)
    dec_out, dec_lse = fp8kv.decode(q, cache, "triton", mode, **kw)
    ref_out, ref_lse = fp8kv.decode(q, cache, "reference", **kw)
    tol = FP8_MODE_TOL if mode == "fp8" else dequant_tol(q.dtype, granularity)
    assert relative_error(out.float(), dec_out.float()) <= 2 * tol
    assert float((lse - dec_lse).abs().max()) <= 2 * lse_tolerance("triton", mode, q.dtype, ref_lse)
    assert relative_error(out.float(), ref_out) <= tol


# ------------------------------------------------------------------------------------ the backends
def _check_against_oracle(out, lse, q, cache, qo_lens, backend, mode, kw):
    ref_out, ref_lse = fp8kv.reference.attend(q, cache, indptr(qo_lens), return_lse=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = FP8_MODE_TOL if mode == "fp8" else output_tolerance(backend, mode, q.dtype, cache.granularity)
    err = relative_error(out.float(), ref_out)
    assert err <= tol, f"{backend} {mode} {cache} {qo_lens} {kw}: {err:.3e} > {tol:.3e}"
    if lse is not None:
        assert float((lse - ref_lse).abs().max()) <= lse_tolerance(backend, mode, q.dtype, ref_lse, cache.granularity)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "plain")
def test_triton_matches_the_oracle_through_the_entry(kw):
    lens, qo_lens = [5, 40, 0, 23], [2, 16, 0, 1]
    cache = matrix_cache(lens, 2, 32, granularity="head")
    q = make_q(sum(qo_lens), 4, 32)
    kw = _variants(kw, 4)
    out, lse = fp8kv.attend(q, cache, indptr(qo_lens), "triton", **kw)
    _check_against_oracle(out, lse, q, cache, qo_lens, "triton", "dequant", kw)


def test_auto_picks_what_the_capability_table_picks(monkeypatch):
    """On CPU the reference (bit for bit: it is what runs); an fp32 query goes to the reference anywhere."""
    cache = matrix_cache([9, 12], 1, 32)
    q = make_q(5, 2, 32, torch.float32)
    out, lse = fp8kv.attend(q, cache, indptr([2, 3]))
    ref_out, ref_lse = fp8kv.reference.attend(q, cache, indptr([2, 3]), return_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    if ON_CPU:
        q16 = q.half()
        assert torch.equal(fp8kv.attend(q16, cache, indptr([2, 3]))[0],
                           fp8kv.reference.attend(q16, cache, indptr([2, 3])))


@pytest.mark.parametrize("kv_dtype,q_dtype", [("fp8_e4m3", torch.float16), ("fp8_e5m2", torch.bfloat16),
                                              ("fp16", torch.float16)])
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "plain")
def test_vllm_takes_the_query_counts_natively(kv_dtype, q_dtype, kw, fake_vllm):
    cache = _cache(lens=(4, 37, 70), kv_dtype=kv_dtype)
    qo_lens = [4, 1, 9]
    q = torch.randn(sum(qo_lens), 6, 64, generator=seeded(2)).to(q_dtype)
    kw = _variants(kw, 6)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].cpu()
    out, lse = fp8kv.attend(q, cache, indptr(qo_lens, "cpu"), "vllm", **kw)
    assert lse is None
    _check_against_oracle(out, None, q, cache, qo_lens, "vllm", "dequant", kw)
    (call,) = fake_vllm.calls
    assert call["cu_seqlens_q"].tolist() == [0, 4, 5, 14] and call["max_seqlen_q"] == 9
    assert call["num_par_softmax_segments"] is None  # the split path takes one query per sequence


def test_vllm_takes_its_split_path_only_for_one_token_everywhere(fake_vllm):
    cache = _cache(kv_dtype="fp16")
    q = torch.randn(3, 6, 64).half()
    for counts, split in (([1, 1, 1], 16), ([1, 0, 1], None)):
        fake_vllm.calls.clear()
        fp8kv.attend(q[:sum(counts)], cache, indptr(counts, "cpu", torch.int64), "vllm")
        assert fake_vllm.calls[-1]["num_par_softmax_segments"] == split
        assert fake_vllm.calls[-1]["cu_seqlens_q"].dtype == torch.int32


def test_vllm_refuses_an_empty_sequence_by_name(fake_vllm):
    cache = _cache(lens=(5, 0, 9), kv_dtype="fp16")
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=0: vLLM's kernel needs"):
        fp8kv.attend(torch.randn(3, 6, 64).half(), cache, indptr([2, 0, 1], "cpu"), "vllm")


def test_vllm_without_new_tokens_launches_nothing(fake_vllm):
    cache = _cache(kv_dtype="fp16")
    out, _ = fp8kv.attend(torch.zeros(0, 6, 64).half(), cache, indptr([0, 0, 0], "cpu"), "vllm")
    assert out.shape == (0, 6, 64) and fake_vllm.calls == []


@pytest.mark.skipif(not REAL_VLLM, reason="vllm is not importable (put the kernel's shim on PYTHONPATH to run it)")
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_real_vllm_kernel_attends_several_tokens(kv_dtype):
    from fp8kv.capability import interpreter_on

    if torch.cuda.is_available() or not interpreter_on():
        pytest.skip("runs the real kernel on CPU under the Triton interpreter")
    cache = _cache(lens=(4, 37, 70), kv_dtype=kv_dtype)
    qo_lens = [4, 1, 9]
    q = torch.randn(sum(qo_lens), 6, 64, generator=seeded(2)).half()
    for kw in ({}, {"window": 5}, {"soft_cap": 2.0, "sinks": torch.randn(6)}):
        out, lse = fp8kv.attend(q, cache, indptr(qo_lens, "cpu"), "vllm", **kw)
        _check_against_oracle(out, lse, q, cache, qo_lens, "vllm", "dequant", kw)


@pytest.mark.skipif(not ON_CPU, reason="the CPU refusal")
def test_flashinfer_on_cpu_is_refused_with_the_reason():
    cache = matrix_cache([6, 9], 2, 64)
    with pytest.raises(UnsupportedError, match="no GPU: FlashInfer runs only on CUDA GPUs"):
        fp8kv.attend(make_q(5, 4, 64), cache, indptr([2, 3]), "flashinfer")
    with pytest.raises(UnsupportedError, match="cannot apply sinks"):  # the variant is named first
        fp8kv.attend(make_q(5, 4, 64), cache, indptr([2, 3]), "flashinfer", sinks=random_sinks(4))


# ------------------------------------------------------------------------------------ planned_attend
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_planned_attend_reads_refilled_inputs(backend):
    lens, qo_lens = [12, 30], [3, 8]
    cache = matrix_cache(lens, 2, 32)
    q = make_q(11, 4, 32)
    call = backends.planned_attend(q, cache, indptr(qo_lens), backend, window=7)
    assert isinstance(call, functools.partial)
    if backend == "triton":
        assert isinstance(call.args[0], AttendPlan) and call.args[0].qo_lens == tuple(qo_lens)
    q.copy_(make_q(11, 4, 32, seed=5))
    out, lse = call()
    expected = fp8kv.attend(q, cache, indptr(qo_lens), backend, window=7)
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@pytest.mark.parametrize("options", [{}, {"num_splits": 2, "block_n": 16}, {"window": 40, "block_n": 16}])
def test_planned_attend_covers_sequences_grown_past_the_planned_longest(options):
    """The attend kernel's splits are sized for the longest sequence at plan time; the last split takes every key
    past them, so a plan run after the cache grew (within its rows' capacity) attends every key."""
    cache = matrix_cache([5, 9], 2, 32, max_seq_len=160)
    q, ip = make_q(5, 4, 32), indptr([2, 3])
    call = backends.planned_attend(q, cache, ip, "triton", **options)
    assert isinstance(call.args[0], AttendPlan)
    grown = make_q(2 * 100, 2, 32, torch.float32, seed=4)
    cache.append_tokens(grown, grown * 0.5, [100, 100])  # 105 and 109 tokens: past the planned splits
    out, _ = call()
    assert relative_error(out, reference.attend(q, cache, ip, window=options.get("window"))) < \
        dequant_tol(q.dtype, "tensor")


@pytest.mark.parametrize("backend,qo_lens", [("triton", [2, 3]), ("triton", [1, 1]), ("reference", [2, 3])])
def test_planned_attend_refuses_counts_written_after_planning(backend, qo_lens):
    """A plan read the counts once (the grid, the decode's plan of one token each, the oracle's rows): a run after
    qo_indptr was written in place is refused by its version counter (metadata), not run on the old counts."""
    cache = matrix_cache([5, 9], 2, 32)
    ip = indptr(qo_lens)
    call = backends.planned_attend(make_q(sum(qo_lens), 4, 32), cache, ip, backend)
    call()
    ip.copy_(indptr([0, sum(qo_lens)]))
    with pytest.raises(ValueError, match=r"qo_indptr was written in place after planning .*qo_lens="
                                         + re.escape(str(qo_lens)) + ".*plan again"):
        call()


def test_run_attend_refuses_inputs_it_was_not_planned_for():
    """run_attend checks q, the cache and qo_indptr against the plan by their metadata: a query of another row
    count was read past its end (and the output sized for the plan's)."""
    from fp8kv.ops.attend import run_attend

    cache, q, ip = matrix_cache([5, 9], 2, 32), make_q(5, 4, 32), indptr([2, 3])
    plan = backends.planned_attend(q, cache, ip, "triton").args[0]
    with pytest.raises(ValueError, match=r"q's shape is \(3, 4, 32\), but the plan was made for \(5, 4, 32\)"):
        run_attend(plan, make_q(3, 4, 32), cache, indptr([1, 2]))
    with pytest.raises(ValueError, match=r"the block table's shape is \(3, 1\), but the plan was made for \(2, 1\)"):
        run_attend(plan, q, matrix_cache([5, 9, 4], 2, 32), indptr([2, 3, 0]))
    with pytest.raises(ValueError, match=r"qo_indptr has shape \(4,\); expected \[3\]"):
        run_attend(plan, q, cache, indptr([2, 3, 0]))


def test_launch_options_reach_the_plan_and_other_backends_take_none():
    cache = matrix_cache([12, 30], 2, 32)
    q = make_q(11, 4, 32)
    call = backends.planned_attend(q, cache, indptr([3, 8]), "triton", num_splits=2, block_n=16, block_m=32)
    assert {k: call.args[0].config[k] for k in ("num_splits", "block_n", "block_m")} == \
        dict(num_splits=2, block_n=16, block_m=32)
    assert backends.ATTEND_LAUNCH_OPTIONS["reference"] == () and "block_m" in backends.ATTEND_LAUNCH_OPTIONS["triton"]
    with pytest.raises(TypeError, match=r"block_m=16 is not an option of the reference backend; it takes none"):
        fp8kv.attend(q, cache, indptr([3, 8]), "reference", block_m=16)


# ------------------------------------------------------------------------------------ bad input
def _good():
    return dict(q=make_q(5, 4, 32), cache=matrix_cache([6, 9], 2, 32), qo_indptr=indptr([2, 3]))


BAD = [
    ("cache", dict(cache="pages"), TypeError, "cache must be a fp8kv.PagedKVCache, got str"),
    ("q-2d", dict(q=torch.zeros(5, 32)), ValueError, "q"),
    ("q-head_dim", dict(q=make_q(5, 4, 16)), ValueError, "head_dim 16"),
    ("q-heads", dict(q=make_q(5, 3, 32)), ValueError, "not a multiple of the cache's 2 KV heads"),
    ("q-int", dict(q=torch.zeros(5, 4, 32, dtype=torch.int32)), TypeError, "q"),
    ("q-nan", dict(q=make_q(5, 4, 32).index_fill(0, torch.tensor([3], device=DEVICE), float("nan"))), ValueError, "q"),
    ("q-strided", dict(q=make_q(5, 4, 64)[..., ::2], backend="triton"), ValueError, "contiguous in its last"),
    ("q-fp32-triton", dict(q=make_q(5, 4, 32, torch.float32), backend="triton"), TypeError, "q is fp32"),
    ("backend", dict(backend="cuda"), ValueError, "backend='cuda'"),
    ("mode", dict(mode="fp4"), ValueError, "mode='fp4'"),
    ("check", dict(check="yes"), TypeError, "check='yes'"),
    ("qo_indptr-float", dict(qo_indptr=indptr([2, 3]).float()), TypeError, "qo_indptr"),
    ("qo_indptr-shape", dict(qo_indptr=indptr([2, 3, 0])), ValueError, r"qo_indptr has shape \(4,\)"),
    ("qo_indptr-start", dict(qo_indptr=indptr([2, 3]) + 1), ValueError, r"qo_indptr\[0\]=1"),
    ("qo_indptr-total", dict(qo_indptr=indptr([2, 2])), ValueError, r"qo_indptr\[2\]=4; expected .* total_q=5"),
    ("qo_indptr-long", dict(q=make_q(9, 4, 32), qo_indptr=indptr([7, 2])), ValueError, "qo_len=7 new tokens"),
    # a strided view's values pass every other check; the kernels would read its raw memory as offsets
    ("qo_indptr-strided", dict(qo_indptr=torch.tensor([0, 9, 2, 9, 5], dtype=torch.int32, device=DEVICE)[::2],
                               backend="triton"), ValueError, r"qo_indptr has strides \(2,\)"),
    ("window", dict(window=0), ValueError, "window"),
    ("soft_cap", dict(soft_cap=-1.0), ValueError, "soft_cap"),
    ("sinks", dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    ("sm_scale", dict(sm_scale=float("inf")), ValueError, "sm_scale"),
    ("option", dict(backend="triton", heads_per_program=4), TypeError,
     "heads_per_program=4 is not an option of the triton backend"),
    ("block_m", dict(backend="triton", block_m=48), ValueError, "block_m=48"),
    ("fp8-mode-16-bit", dict(cache=matrix_cache([6, 9], 2, 32, kv_dtype="fp16"), backend="triton", mode="fp8"),
     UnsupportedError, "fp8 mode needs an FP8 KV cache"),
    ("fp8-token_head", dict(cache=matrix_cache([6, 9], 2, 32, granularity="token_head"), backend="triton", mode="fp8"),
     UnsupportedError, "token_head needs dequant mode"),
]


ENTRIES = [(entry, *bad) for entry in ("attend", "planned_attend") for bad in BAD
           if not (entry == "planned_attend" and "check" in bad[1])]  # planned_attend always checks


@pytest.mark.parametrize("entry,name,changes,exc,pattern", ENTRIES, ids=[f"{e[0]}-{e[1]}" for e in ENTRIES])
def test_bad_input_is_refused_by_name(entry, name, changes, exc, pattern):
    kw = {**_good(), **changes}
    call = backends.planned_attend if entry == "planned_attend" else fp8kv.attend
    with pytest.raises(exc, match=pattern):
        call(kw.pop("q"), kw.pop("cache"), kw.pop("qo_indptr"), **kw)


def test_unchecked_calls_still_check_shapes_and_query_counts():
    good = _good()
    with pytest.raises(ValueError, match=r"qo_indptr\[2\]=4"):
        fp8kv.attend(good["q"], good["cache"], indptr([2, 2]), "triton", check=False)
    q = good["q"].index_fill(0, torch.tensor([3], device=DEVICE), float("nan"))
    out, _ = fp8kv.attend(q, good["cache"], good["qo_indptr"], "triton", check=False)  # contents trusted
    assert torch.isnan(out[3]).any()


# ------------------------------------------------------------------------- each check runs once
@pytest.mark.parametrize("kv_dtype,granularity,options", [("fp8_e4m3", "tensor", {}), ("fp8_e5m2", "token_head", {}),
                                                          ("fp16", "tensor", {"num_splits": 2, "block_n": 16})])
@pytest.mark.parametrize("entry,check", [("attend", True), ("attend", False), ("planned_attend", True)])
def test_each_check_of_the_triton_attend_runs_once_per_call(monkeypatch, kv_dtype, granularity, options, entry,
                                                            check):
    """The query's shape (attend_query) and dtype (capability.check_query), its strides, the fp8/token_head
    refusal, the cache's arrays and qo_indptr's counts are each checked once per call, once per plan (whose
    runs check nothing)."""
    import fp8kv.ops  # noqa: F401  (loaded, so that its bindings are spied on too)

    capability = importlib.import_module("fp8kv.capability")
    attend_checks = importlib.import_module("fp8kv.attend_checks")
    counts: dict[str, int] = {}
    for name in ("check_query", "check_query_strides", "scales_refusal"):
        count_calls(monkeypatch, capability, name, counts)
    for name in ("attend_query", "qo_indptr_arg"):
        count_calls(monkeypatch, attend_checks, name, counts)
    count_calls(monkeypatch, PagedKVCache, "validate_arrays", counts)
    cache = matrix_cache([12, 30], 2, 32, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(11, 4, 32)
    once = dict.fromkeys(counts, 1)
    if entry == "attend":
        out, _ = fp8kv.attend(q, cache, indptr([3, 8]), "triton", check=check, **options)
    else:
        call = backends.planned_attend(q, cache, indptr([3, 8]), "triton", **options)
        assert counts == once
        out, _ = call()
        out, _ = call()
    assert torch.isfinite(out).all()
    assert counts == once


@pytest.mark.parametrize("check", [True, False])
def test_each_check_of_the_reference_attend_runs_once_per_call(monkeypatch, check):
    """The oracle behind fp8kv.attend computes on what the entry checked (reference.paged_attend): the query,
    qo_indptr's counts and the cache's arrays are checked once, not again by reference.attend."""
    attend_checks = importlib.import_module("fp8kv.attend_checks")
    counts: dict[str, int] = {}
    for name in ("attend_query", "qo_indptr_arg"):
        count_calls(monkeypatch, attend_checks, name, counts)
    count_calls(monkeypatch, PagedKVCache, "validate_arrays", counts)
    cache = matrix_cache([12, 30], 2, 32)
    q = make_q(11, 4, 32)
    out, lse = fp8kv.attend(q, cache, indptr([3, 8]), "reference", check=check)
    assert counts == dict.fromkeys(counts, 1)
    want, want_lse = reference.attend(q, cache, indptr([3, 8]), return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


# ------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "vllm"])
@pytest.mark.parametrize("kv_dtype,granularity", [("fp8_e4m3", "tensor"), ("fp8_e4m3", "head"), ("bf16", "tensor")])
def test_backends_on_gpu_match_the_oracle(backend, kv_dtype, granularity):
    """32/8/128 bf16 queries at ~3000 tokens: a 4-token draft per sequence, and 512-row chunks beside drafts,
    plain and with a window and a soft cap, through each backend that runs the combination here."""
    ok, why = capability_check(backend, kv_dtype, "dequant", None, granularity, 128, op="attend")
    if not ok:
        pytest.skip(why)
    cache = matrix_cache([3000, 2999, 3001, 1500], 8, 128, kv_dtype=kv_dtype, granularity=granularity)
    for qo_lens in ([4, 4, 4, 4], [512, 4, 512, 1]):
        q = make_q(sum(qo_lens), 32, 128, torch.bfloat16, seed=len(qo_lens))
        for kw in ({}, {"window": 1024, "soft_cap": 30.0}):
            out, lse = fp8kv.attend(q, cache, indptr(qo_lens), backend, **kw)
            _check_against_oracle(out, lse, q, cache, qo_lens, backend, "dequant", kw)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "vllm"])
def test_planned_attend_replays_in_a_cuda_graph(backend):
    """The planned callable does no host work: captured once in a CUDA graph, a replay over a refilled query
    answers what a fresh call answers."""
    if not capability_check(backend, "fp8_e4m3", "dequant", None, "tensor", 128, op="attend")[0]:
        pytest.skip(f"{backend} cannot run here")
    cache = matrix_cache([2000, 700], 8, 128)
    qo_lens = [8, 3]
    q = make_q(11, 32, 128, torch.bfloat16)
    call = backends.planned_attend(q, cache, indptr(qo_lens), backend)
    call()  # compiled and warmed up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = call()
    q.copy_(make_q(11, 32, 128, torch.bfloat16, seed=4))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8kv.attend(q, cache, indptr(qo_lens), backend)[0])
