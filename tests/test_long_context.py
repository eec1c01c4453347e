"""fp8kv.analysis.long_context: the kernels' error against context (kernel, quantization and total apart),
the planted needle, the flat-and-needle verdict, and every argument refused by name.

Small contexts here (the Triton interpreter on a CPU); 128k runs in notebook 09 on a GPU."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from fixtures import DEVICE

from fp8kv import PagedKVCache, reference
from fp8kv.analysis import long_context as lc
from fp8kv.capability import UnsupportedError

SMALL = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, q_len=3, device=DEVICE)
CONTEXTS = (40, 96)
Q_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.fixture(scope="module")
def triton_run():
    return lc.long_context_error(CONTEXTS, backend="triton", **SMALL)


@pytest.fixture(scope="module")
def reference_run():
    return lc.long_context_error(CONTEXTS, backend="reference", modes=["dequant"], **SMALL)


# ------------------------------------------------------------------------------------ the measurement
def test_tables_hold_every_context_entry_mode_and_error(triton_run):
    errors, needles = triton_run
    assert len(errors) == len(CONTEXTS) * 2 * 2 * 3 and len(needles) == len(CONTEXTS) * 2 * 2
    assert set(errors["error"]) == set(lc.ERRORS) and set(errors["entry"]) == set(lc.ENTRIES)
    assert set(errors["mode"]) == set(lc.LONG_CONTEXT_MODES) and sorted(set(errors["context"])) == list(CONTEXTS)
    assert (errors["n_heads"] == SMALL["num_q_heads"]).all()
    assert (errors.loc[errors["entry"] == "decode", "q_len"] == 1).all()
    assert (errors.loc[errors["entry"] == "attend", "q_len"] == SMALL["q_len"]).all()
    assert (errors["rel_err_median"] <= errors["rel_err_max"]).all()
    # every query sees the needle: it lies before the first of the attend's queries
    assert (needles["needle_position"] < needles["context"] - SMALL["q_len"]).all()


def test_reference_backend_has_no_kernel_error(reference_run):
    """The oracle read through fp8kv.decode / fp8kv.attend is the oracle: its kernel error is 0, and the total is
    the quantization error, row for row."""
    errors, needles = reference_run
    assert (errors.loc[errors["error"] == "kernel", ["rel_err_median", "rel_err_max"]] == 0).all().all()
    quant = errors[errors["error"] == "quantization"].reset_index(drop=True)
    total = errors[errors["error"] == "total"].reset_index(drop=True)
    np.testing.assert_allclose(total["rel_err_max"], quant["rel_err_max"], rtol=1e-12)
    np.testing.assert_allclose(needles["needle_weight_kernel"], needles["needle_weight_oracle"], rtol=1e-5)
    assert needles["needle_weight_ok"].all() and (needles["needle_weight_err"] <= reference.REFERENCE_TOL).all()


def test_kernel_error_within_the_oracle_tolerances(triton_run):
    """fp8kv's kernels against the fp32 oracle on the same FP8 cache, within the tolerances every kernel test
    uses (fp8kv.reference.output_tolerance): dequant mode rounds p and the output to the query's type (2u),
    fp8 mode q and p to e4m3."""
    errors, _ = triton_run
    kernel = errors[errors["error"] == "kernel"]
    for mode, g in kernel.groupby("mode"):
        tol = reference.output_tolerance("triton", mode, Q_DTYPE)
        assert (g["rel_err_max"] <= tol).all(), (mode, g["rel_err_max"].max(), tol)
        assert (g["rel_err_max"] > 0).all()  # a kernel that rounds does not agree bit for bit


def test_quantization_error_is_fp8s_and_the_same_in_both_modes(triton_run):
    """The oracle on an e4m3 cache against exact attention: above 0; the median head below e4m3's unit roundoff
    u = 2^-4 (the output averages the elements' independent roundings), the worst below 8u = 0.5 (a head whose
    output nearly cancels magnifies its error; a lost scale or a broken dequant errs by order one); the same
    numbers for both modes. The total obeys the triangle inequality, per head
    ``total <= kernel (1 + quant) + quant``, so over the maxima too."""
    errors, _ = triton_run
    quant = errors[errors["error"] == "quantization"]
    u = 2.0 ** -4
    assert ((quant["rel_err_median"] > 0) & (quant["rel_err_median"] < u) & (quant["rel_err_max"] < 8 * u)).all()
    per_mode = quant.pivot_table(index=["context", "entry"], columns="mode", values="rel_err_max")
    np.testing.assert_array_equal(per_mode["dequant"], per_mode["fp8"])
    wide = errors.pivot_table(index=["context", "entry", "mode"], columns="error", values="rel_err_max")
    bound = wide["kernel"] * (1 + wide["quantization"]) + wide["quantization"]
    assert (wide["total"] <= bound * (1 + 1e-9)).all()


def test_exact_attention_is_the_oracle_on_unrounded_values():
    """The exact path (causal, the last n positions) equals the oracle's attend on a 16-bit cache holding the same
    values, and its LSE normalises the scores the needle test ranks."""
    k = torch.randn(50, 2, 64, dtype=torch.float64).half().float()
    v = torch.randn(50, 2, 64, dtype=torch.float64).half().float()
    q = torch.randn(3, 4, 64).half()
    sm = 0.125
    out, lse = lc._exact(q.float(), k, v, sm)
    cache = PagedKVCache.from_dense([k], [v], [50], kv_dtype="fp16")
    ref_out, ref_lse = reference.paged_attend(q, cache, [3], sm)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    s = lc._scores(q, k, sm)
    assert torch.isinf(s[0, :, 48:]).all() and torch.isfinite(s[2]).all()  # query 0 sits at 47: 48, 49 unseen
    torch.testing.assert_close(torch.exp(s - lse[..., None]).sum(-1), torch.ones(3, 4), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("margin", [0.25, 2.0])
def test_needle_beats_the_runner_up_by_the_margin_in_exact_attention(margin):
    errors, needles = lc.long_context_error((64,), backend="reference", modes="dequant", margin=margin,
                                            **SMALL)
    assert needles["needle_top1_exact"].all()
    # over all the queries (the attend's) the tightest head beats the runner-up by exactly the margin (the needle's length is
    # chosen for it); the decode's one query by at least that
    attend = needles[needles["entry"] == "attend"]
    np.testing.assert_allclose(attend["margin_exact"], margin, rtol=1e-4)
    assert (needles["margin_exact"] >= margin * (1 - 1e-4)).all()
    assert (needles["margin"] == margin).all()


def test_needle_survives_e4m3_and_the_kernel_weights_it_as_the_oracle(triton_run):
    """With the default margin of one logit the needle stays on top of the e4m3 cache in dequant mode; in fp8 mode
    (the query in e4m3 too) it is top-1 exactly where its margin stays above 0. Either way the weight the kernel's
    output gives it is the oracle's, within the mode's output tolerance (fp8kv.reference.output_tolerance)."""
    _, needles = triton_run
    dequant = needles[needles["mode"] == "dequant"]
    assert dequant["needle_top1"].all() and (dequant["needle_top1_frac"] == 1).all()
    assert (needles["needle_top1"] == (needles["margin_fp8"] > 0)).all()
    for mode, g in needles.groupby("mode"):
        tol = reference.output_tolerance("triton", mode, Q_DTYPE)
        assert (g["needle_weight_tol"] == tol).all()
        assert g["needle_weight_ok"].all() and (g["needle_weight_err"] <= tol).all(), (mode, g["needle_weight_err"].max())
        assert (g["needle_weight_err"] > 0).all()  # the kernel rounds: not the oracle bit for bit
        np.testing.assert_allclose(g["needle_weight_kernel"], g["needle_weight_oracle"], rtol=0, atol=tol)


def test_fp8_mode_reads_the_needle_with_the_query_in_e4m3(triton_run):
    """The needle's scores in fp8 mode come from the query rounded to e4m3 as the kernel rounds it (one amax scale per
    query row and head): its margin and the oracle's weight differ from dequant mode's, and the oracle on that
    query is what the kernel's output matches (its error is far below what the 16-bit query's oracle leaves)."""
    _, needles = triton_run
    wide = needles.pivot_table(index=["context", "entry"], columns="mode", values=["margin_fp8", "needle_weight_oracle"])
    assert (wide["margin_fp8"]["dequant"] != wide["margin_fp8"]["fp8"]).all()
    assert (wide["needle_weight_oracle"]["dequant"] != wide["needle_weight_oracle"]["fp8"]).all()
    q = torch.randn(3, 4, 64).half()
    rounded = lc._mode_query(q, "fp8", "triton")
    scale = q.float().abs().amax(dim=-1, keepdim=True) / 448
    torch.testing.assert_close(rounded, (q.float() / scale).to(torch.float8_e4m3fn).float() * scale)
    assert torch.equal(lc._mode_query(q, "dequant", "triton"), q.float())


def _perturbed_kernel(log_factor: float):
    """A stand-in for fp8kv's kernels: fp32 attention on the cache, the top-scored key of every query head weighted
    by ``exp(log_factor)`` (-inf drops it)."""

    def kernel(entry, q, cache, *, backend, mode, sm_scale):
        k, v = cache.gather(0)
        n, hq, d = q.shape
        hkv = k.shape[1]
        s = lc._scores(q, k, sm_scale)
        s = s.scatter_add(-1, s.argmax(dim=-1, keepdim=True), torch.full((n, hq, 1), log_factor))
        p = torch.softmax(s, dim=-1).reshape(n, hkv, hq // hkv, -1)
        out = torch.einsum("nkgl,lkd->nkgd", p, v.float()).reshape(n, hq, d)
        return out, torch.logsumexp(s, dim=-1)

    return kernel


@pytest.mark.parametrize("log_factor", [-math.inf, math.log(0.5)], ids=["drops", "halves"])
def test_a_kernel_that_drops_or_scales_the_needle_fails_where_top1_holds(monkeypatch, log_factor):
    """The fp32 top-1 reads the cache, not the kernel: a kernel that drops the needle or halves its weight keeps it
    top-1 there, and fails the needle test by what its output gives the needle."""
    monkeypatch.setattr(lc, "_kernel", _perturbed_kernel(log_factor))
    errors, needles = lc.long_context_error((40, 96), backend="reference", modes="dequant", **SMALL)
    assert needles["needle_top1"].all() and not needles["needle_weight_ok"].any()
    assert (needles["needle_weight_err"] > 100 * needles["needle_weight_tol"]).all()
    lost = needles["needle_weight_oracle"] - needles["needle_weight_kernel"]
    # dropped: its weight is gone; halved: p becomes p / (2 - p), a loss of p (1 - p) / (2 - p)
    p = needles["needle_weight_oracle"]
    assert (lost > (0.9 * p if log_factor == -math.inf else 0.5 * p * (1 - p) / (2 - p))).all()
    v = lc.long_context_verdict(errors, needles, reference_context=40)
    assert v["needle_top1_ok"].all() and not v["needle_weight_ok"].any() and not v["needle_ok"].any()
    assert all(list(x) == [40, 96] for x in v["needle_contexts_failed"])
    assert "does NOT give the needle the oracle's weight at 40, 96 tokens" in lc.long_context_text(v)[0]


def test_a_needle_within_fp8s_noise_is_seen_to_flip():
    """A margin of a thousandth of a logit on an e5m2 cache (two mantissa bits): the quantized scores put another
    position first for some query heads, and the table says so where the measured margin is below zero."""
    _, needles = lc.long_context_error((40, 96), backend="reference", modes="dequant", kv_dtype="fp8_e5m2",
                                       margin=1e-3, **SMALL)
    assert needles["needle_top1_exact"].all()
    assert not needles["needle_top1"].all()
    assert (needles["needle_top1"] == (needles["needle_top1_frac"] == 1)).all()
    assert (needles.loc[~needles["needle_top1"], "margin_fp8"] < 0).all()
    assert (needles.loc[needles["needle_top1"], "margin_fp8"] > 0).all()
    failed = lc.long_context_verdict(*lc.long_context_error((40, 96), backend="reference", modes="dequant",
                                                            kv_dtype="fp8_e5m2", margin=1e-3, **SMALL),
                                     reference_context=40)
    assert not failed["needle_ok"].all() and not failed["passed"].all()


def test_same_seed_same_numbers_other_seed_other_needle():
    a = lc.long_context_error((64,), backend="reference", modes="dequant", seed=3, **SMALL)
    b = lc.long_context_error((64,), backend="reference", modes="dequant", seed=3, **SMALL)
    c = lc.long_context_error((64,), backend="reference", modes="dequant", seed=4, **SMALL)
    pd.testing.assert_frame_equal(a[0], b[0])
    assert not np.allclose(a[0]["rel_err_max"], c[0]["rel_err_max"])


# ------------------------------------------------------------------------------------ the verdict
def tables(errs: dict, needle_fail=(), contexts=(4096, 8192, 16384), entries=("decode",), modes=("dequant",),
           weight_fail=()):
    """Constructed tables: ``errs`` maps error -> its median at each context (a list), max = 2 x median."""
    e, n = [], []
    for entry in entries:
        for mode in modes:
            for i, c in enumerate(contexts):
                for error, values in errs.items():
                    e.append(dict(context=c, entry=entry, mode=mode, error=error, rel_err_median=values[i],
                                  rel_err_max=2 * values[i]))
                n.append(dict(context=c, entry=entry, mode=mode, needle_top1=c not in needle_fail,
                              needle_weight_ok=c not in weight_fail))
    return pd.DataFrame(e), pd.DataFrame(n)


@pytest.mark.parametrize("last, flat", [(0.0149, True), (0.015, True), (0.0151, False), (0.001, True),
                                        (0.03, False)])
def test_flat_means_within_one_and_a_half_times_the_4k_error(last, flat):
    e, n = tables({"total": [0.01, 0.02, last]})  # the middle context does not count, only the ends
    v = lc.long_context_verdict(e, n)
    (row,) = v.itertuples()
    assert row.flat is flat and row.passed is flat and row.needle_ok
    assert row.growth == pytest.approx(last / 0.01) and row.err_reference == 0.01 and row.err_longest == last
    assert (row.reference_context, row.longest_context) == (4096, 16384)


def test_the_statistic_and_the_growth_limit_are_the_callers():
    e, n = tables({"total": [0.01, 0.01, 0.012]})
    e.loc[e["context"] == 16384, "rel_err_max"] = 0.05  # the maximum grew 2.5x, the median 1.2x
    assert lc.long_context_verdict(e, n)["flat"].all()
    assert not lc.long_context_verdict(e, n, statistic="rel_err_max")["flat"].any()
    assert not lc.long_context_verdict(e, n, max_growth=1.1)["flat"].any()
    assert lc.long_context_verdict(e, n, reference_context=8192)["growth"].iloc[0] == pytest.approx(1.2)


def test_a_needle_lost_at_one_context_fails_the_verdict_and_is_named():
    e, n = tables({"kernel": [1e-3] * 3, "total": [0.02] * 3}, needle_fail=(8192,), modes=("dequant", "fp8"))
    v = lc.long_context_verdict(e, n)
    assert v["flat"].all() and not v["needle_ok"].any() and not v["passed"].any()
    assert all(list(x) == [8192] for x in v["needle_contexts_failed"])
    text = lc.long_context_text(v)
    assert len(text) == 2 and all("NOT top-1 at 8,192 tokens" in t and "error flat" in t for t in text)
    assert "kernel error flat" in lc.long_context_text(v, "kernel")[0]


def test_a_needle_the_kernel_misweighs_at_one_context_fails_the_verdict_and_is_named():
    e, n = tables({"total": [0.02] * 3}, weight_fail=(16384,))
    (row,) = lc.long_context_verdict(e, n).itertuples()
    assert row.needle_top1_ok and not row.needle_weight_ok and not row.needle_ok and not row.passed
    assert list(row.needle_contexts_failed) == [16384]
    e, n = tables({"total": [0.02] * 3}, weight_fail=(16384,), needle_fail=(4096,))
    v = lc.long_context_verdict(e, n)
    assert list(v["needle_contexts_failed"].iloc[0]) == [4096, 16384]
    assert "NOT top-1, or the kernel does NOT give it the oracle's weight, at 4,096, 16,384" in lc.long_context_text(v)[0]


def test_zero_error_is_flat_and_growth_from_zero_is_not():
    e, n = tables({"kernel": [0.0, 0.0, 0.0], "total": [0.0, 0.0, 1e-6]})
    v = lc.long_context_verdict(e, n).set_index("error")
    assert v.loc["kernel", "flat"] and v.loc["kernel", "growth"] == 1.0
    assert not v.loc["total", "flat"] and math.isinf(v.loc["total", "growth"])
    assert "NOT flat" in lc.long_context_text(v.reset_index())[0]


def test_verdict_of_a_measured_run(triton_run):
    v = lc.long_context_verdict(*triton_run, reference_context=CONTEXTS[0])
    assert len(v) == 2 * 2 * 3 and set(v["longest_context"]) == {CONTEXTS[-1]}
    assert v["needle_weight_ok"].all() and (v["needle_ok"] == v["needle_top1_ok"]).all()
    assert v.loc[v["mode"] == "dequant", "needle_ok"].all()
    assert len(lc.long_context_text(v)) == 4


# ------------------------------------------------------------------------------------ bad input
RUN_BAD = [
    (dict(contexts="4096"), TypeError, "contexts='4096'"),
    (dict(contexts=4096), TypeError, "contexts=4096"),
    (dict(contexts=[]), ValueError, "contexts is empty"),
    (dict(contexts=[3]), ValueError, "contexts[0]=3; expected an int >= 4"),
    (dict(contexts=[64, 2 ** 21]), ValueError, "contexts[1]=2097152"),
    (dict(contexts=[64, 64]), ValueError, "names a context twice"),
    (dict(contexts=[64.0]), TypeError, "contexts[0]=64.0"),
    (dict(contexts=[True]), TypeError, "contexts[0]=True"),
    (dict(modes=[]), ValueError, "modes is empty"),
    (dict(modes=["int8"]), ValueError, "modes has ['int8']"),
    (dict(modes=5), TypeError, "modes=5"),
    (dict(entries=["prefill"]), ValueError, "entries has ['prefill']"),
    (dict(num_q_heads=0), ValueError, "num_q_heads=0"),
    (dict(num_q_heads=3), ValueError, "num_q_heads=3 is not a multiple of num_kv_heads=2"),
    (dict(num_q_heads="4"), TypeError, "num_q_heads='4'"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads=0"),
    (dict(num_kv_heads=True), TypeError, "num_kv_heads=True"),
    (dict(head_dim=63), ValueError, "head_dim=63; expected an even number"),
    (dict(head_dim=-2), ValueError, "head_dim=-2"),
    # a mode the backend lacks here: the capability table's reason, before any work
    (dict(backend="reference", modes=["dequant", "fp8"]), UnsupportedError, "backend=reference, mode=fp8"),  # fp8 mode needs 64: refused before any work
    (dict(q_len=1), ValueError, "q_len=1; expected an int >= 2"),
    (dict(q_len=5000), ValueError, "q_len=5000"),
    (dict(q_len=2.0), TypeError, "q_len=2.0"),
    (dict(kv_dtype="bf16"), ValueError, "kv_dtype='bf16'"),
    (dict(kv_dtype=None), ValueError, "kv_dtype=None"),
    (dict(backend="vllm"), ValueError, "backend='vllm'"),
    (dict(backend="cuda"), ValueError, "backend='cuda'"),
    (dict(q_dtype="fp32"), ValueError, "q_dtype='fp32'"),
    (dict(q_dtype=torch.float32), TypeError, "q_dtype=torch.float32"),
    (dict(q_dtype=16), TypeError, "q_dtype=16"),
    (dict(block_size=0), ValueError, "block_size=0"),
    (dict(block_size=1.5), TypeError, "block_size=1.5"),
    (dict(margin=0), ValueError, "margin=0.0"),
    (dict(margin=1e30), ValueError, "margin=1e+30; expected a finite number >= 0.0 and <= 30.0"),  # the needle's key set the scales
    (dict(margin=-1.0), ValueError, "margin=-1.0"),
    (dict(margin=float("nan")), ValueError, "margin=nan"),
    (dict(margin="1"), TypeError, "margin='1'"),
    (dict(seed=-1), ValueError, "seed=-1"),
    (dict(seed=None), TypeError, "seed=None"),
    (dict(seed=1.5), TypeError, "seed=1.5"),
    (dict(device="tpu"), ValueError, "device='tpu'"),
    (dict(device=3.5), TypeError, "3.5"),
]


@pytest.mark.parametrize("bad, exc, words", RUN_BAD, ids=[f"{next(iter(b))}-{i}" for i, (b, _, _) in
                                                         enumerate(RUN_BAD)])
def test_long_context_error_refuses_bad_input_by_name(bad, exc, words):
    kw = dict(SMALL, contexts=(64,), backend="reference", modes=["dequant"])
    kw.update(bad)
    with pytest.raises(exc, match=re.escape(words)):
        lc.long_context_error(**kw)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU has no CUDA device to refuse")
def test_a_cuda_device_on_a_cpu_machine_is_refused():
    with pytest.raises(ValueError, match="device='cuda'"):
        lc.long_context_error((64,), backend="reference", modes="dequant", **dict(SMALL, device="cuda"))


def _good():
    return tables({"kernel": [1e-3] * 3, "total": [0.02] * 3})


VERDICT_BAD = [
    (lambda e, n: lc.long_context_verdict([1], n), TypeError, "errors is a list"),
    (lambda e, n: lc.long_context_verdict(e.drop(columns="error"), n), ValueError, "errors lacks columns ['error']"),
    (lambda e, n: lc.long_context_verdict(e.iloc[0:0], n), ValueError, "errors has no rows"),
    (lambda e, n: lc.long_context_verdict(e, None), TypeError, "needles is a NoneType"),
    (lambda e, n: lc.long_context_verdict(e, n.drop(columns="needle_top1")), ValueError,
     "needles lacks columns ['needle_top1']"),
    (lambda e, n: lc.long_context_verdict(e, n.iloc[0:0]), ValueError, "needles has no rows"),
    (lambda e, n: lc.long_context_verdict(e, n[n["mode"] == "fp8"].assign(mode="fp8")), ValueError,
     "needles has no rows"),
    (lambda e, n: lc.long_context_verdict(e, n.assign(mode="fp8")), ValueError,
     "needles has no row for entry 'decode', mode 'dequant'"),
    (lambda e, n: lc.long_context_verdict(e, n, reference_context=1000), ValueError,
     "reference_context=1000 is not among the measured contexts [4096, 8192, 16384]"),
    (lambda e, n: lc.long_context_verdict(e, n, reference_context=16384), ValueError,
     "reference_context=16384 is the longest measured context"),
    (lambda e, n: lc.long_context_verdict(e, n, reference_context="4096"), TypeError, "reference_context='4096'"),
    (lambda e, n: lc.long_context_verdict(e, n, max_growth=1.0), ValueError, "max_growth=1.0"),
    (lambda e, n: lc.long_context_verdict(e, n, max_growth=float("nan")), ValueError, "max_growth=nan"),
    (lambda e, n: lc.long_context_verdict(e, n, max_growth="2"), TypeError, "max_growth='2'"),
    (lambda e, n: lc.long_context_verdict(e, n, statistic="mean"), ValueError, "statistic='mean'"),
    (lambda e, n: lc.long_context_verdict(e.assign(rel_err_median=float("nan")), n), ValueError,
     "errors['rel_err_median'] row 0 is nan"),
    (lambda e, n: lc.long_context_verdict(e.assign(rel_err_median="x"), n), ValueError,
     "errors['rel_err_median'] row 0 is 'x'"),
    (lambda e, n: lc.long_context_verdict(e.assign(rel_err_median=-1.0), n), ValueError,
     "expected finite errors >= 0"),
    (lambda e, n: lc.long_context_verdict(pd.concat([e, e.iloc[:1]]), n), ValueError,
     "errors has 2 rows for decode dequant kernel at context 4096"),
    (lambda e, n: lc.long_context_verdict(e[~((e["error"] == "total") & (e["context"] == 16384))], n), ValueError,
     "errors has no decode dequant total row at context 16384"),
    # NaN or the string "False" read as True: a needle never shown top-1 passed
    (lambda e, n: lc.long_context_verdict(e, n.assign(needle_top1=float("nan"))), ValueError,
     "needles['needle_top1'] row 0 is nan; expected True or False"),
    (lambda e, n: lc.long_context_verdict(e, n.assign(needle_top1="False")), ValueError,
     "needles['needle_top1'] row 0 is 'False'"),
    (lambda e, n: lc.long_context_verdict(e, n.assign(needle_weight_ok=float("nan"))), ValueError,
     "needles['needle_weight_ok'] row 0 is nan; expected True or False"),
    (lambda e, n: lc.long_context_verdict(e, n.drop(columns="needle_weight_ok")), ValueError,
     "needles lacks columns ['needle_weight_ok']"),
    # int() of a context: OverflowError (inf), "cannot convert float NaN" or a fraction rounded before
    (lambda e, n: lc.long_context_verdict(e.assign(context=e["context"].where(e.index > 0, math.inf)), n), ValueError,
     "long_context_verdict: column 'context' of df holds inf in row 0; expected a finite whole number there"),
    (lambda e, n: lc.long_context_verdict(e, n.assign(context=n["context"].where(n.index != 1, 8192.5))), ValueError,
     "column 'context' of df holds 8192.5 in row 1; expected a finite whole number there; expected "
     "long_context_error()'s needles table"),
    (lambda e, n: lc.long_context_verdict(e, n.assign(context=n["context"].where(n.index > 0, math.nan))), ValueError,
     "column 'context' of df holds nan in row 0"),
    (lambda e, n: lc.long_context_text("table"), TypeError, "verdict must be long_context_verdict()'s table"),
    (lambda e, n: lc.long_context_text(lc.long_context_verdict(e, n), "bogus"), ValueError, "error='bogus'"),
    (lambda e, n: lc.long_context_text(lc.long_context_verdict(e, n), "quantization"), ValueError,
     "verdict has no 'quantization' rows"),
]


@pytest.mark.parametrize("call, exc, words", VERDICT_BAD, ids=[str(i) for i in range(len(VERDICT_BAD))])
def test_verdict_refuses_bad_input_by_name(call, exc, words):
    e, n = _good()
    with pytest.raises(exc, match=re.escape(words)):
        call(e, n)
