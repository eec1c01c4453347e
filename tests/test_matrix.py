"""fp8kv.matrix: every backend × KV dtype × mode × granularity, run once and checked.

On a CPU machine the Triton rows run under the Triton interpreter (the root conftest sets
TRITON_INTERPRET=1 before anything imports triton) with fp16 queries. Sizes are tiny and odd: three
sequences of 1, a few and 70 tokens in pages of 16, 4 query heads over 2 KV heads, head_dim 32.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

import fp8kv.backends as backends
from fp8kv import matrix
from fp8kv.bench import Case, tolerance
from fp8kv.capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES, check, check_query, interpreter_on
from fp8kv.matrix import backend_matrix, lse_tolerance, ragged_seq_lens, summarize
from fp8kv.quant import GRANULARITIES

SMALL = dict(heads=(4, 2), head_dim=32, batch=3, max_len=70, block_size=16)
ON_GPU = torch.cuda.is_available()


def combinations(kv_dtypes=KV_DTYPE_NAMES, modes=MODES, granularities=GRANULARITIES, backends=BACKEND_NAMES):
    """The combinations a matrix must hold, spelled out independently of the implementation."""
    out = set()
    for b in backends:
        for kv in kv_dtypes:
            fp8 = kv.startswith("fp8")
            for m in modes:
                if m == "fp8" and not fp8:
                    continue
                for g in (granularities if fp8 else ["tensor"]):
                    out.add((b, kv, m, g))
    return out


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    return backend_matrix(**SMALL, seed=3)


def _key(row):
    return (row["backend"], row["kv_dtype"], row["mode"], row["granularity"])


# ------------------------------------------------------------------------------------------- rows
def test_one_row_per_combination(table):
    assert list(table.columns) == matrix.COLUMNS
    keys = [_key(r) for _, r in table.iterrows()]
    # per backend: 16-bit x dequant, fp8 x 2 modes x 4
    assert len(keys) == len(set(keys)) == len(BACKEND_NAMES) * (2 + 2 * 2 * 4)
    assert set(keys) == combinations()
    assert set(table["status"]) <= set(matrix.STATUSES)
    assert (table["seq_lens"] == ",".join(map(str, ragged_seq_lens(3, 16, 70)))).all()
    assert (table["batch"] == 3).all() and (table["num_q_heads"] == 4).all() and (table["head_dim"] == 32).all()


def test_unsupported_rows_carry_the_capability_reason(table):
    for _, r in table.iterrows():
        ok, why = check(r["backend"], r["kv_dtype"], r["mode"], None, r["granularity"], r["head_dim"])
        if ok:
            q_ok, q_why = check_query(r["backend"], r["q_dtype"], r["kv_dtype"])
            ok, why = q_ok, why if q_ok else q_why
        assert r["reason"] == why, _key(r)
        assert (r["status"] == "unsupported") == (not ok), _key(r)
    unsupported = table[table["status"] == "unsupported"]
    assert len(unsupported) > 0 and unsupported["reason"].str.strip().str.len().gt(0).all()
    assert unsupported["passed"].isna().all() and unsupported["rel_err"].isna().all()
    # facts of this machine: the reference has no fp8 mode anywhere; no FlashInfer without a GPU
    ref_fp8 = table[(table["backend"] == "reference") & (table["mode"] == "fp8")]
    assert len(ref_fp8) == 8 and (ref_fp8["status"] == "unsupported").all()
    if not ON_GPU:
        assert (table[table["backend"] == "flashinfer"]["status"] == "unsupported").all()
    # vLLM's kernel is run at head_dim 64, 128 and 256 only: these rows (head_dim 32) say so
    vllm = table[table["backend"] == "vllm"]
    assert (vllm["status"] == "unsupported").all() and vllm["reason"].str.contains("not 32").all()


def test_reference_rows_pass(table):
    ref = table[(table["backend"] == "reference") & (table["mode"] == "dequant")]
    assert len(ref) == 2 + 2 * 4
    assert (ref["status"] == "passed").all() and ref["passed"].eq(True).all()
    assert (ref["rel_err"] == 0).all() and (ref["lse_err"] == 0).all()  # the backend is the oracle itself
    assert (ref["tol"] == 1e-5).all()


def test_triton_rows_run_and_pass(table):
    assert ON_GPU or interpreter_on(), "the root conftest sets TRITON_INTERPRET=1 on machines without a GPU"
    tri = table[table["backend"] == "triton"]
    ran = tri[tri["status"] != "unsupported"]
    # 16-bit dequant (2), FP8 dequant (2 dtypes x 4), fp8 mode (2 dtypes x tensor/head/channel)
    assert len(ran) == 2 + 8 + 6
    bad = ran[ran["status"] != "passed"]
    assert bad.empty, bad[["kv_dtype", "mode", "granularity", "status", "rel_err", "tol", "error"]].to_string()
    assert ((ran["rel_err"] > 0) & (ran["rel_err"] <= ran["tol"])).all()
    assert (ran["lse_err"] <= ran["lse_tol"]).all() and ran["seconds"].gt(0).all()
    sixteen = ran["kv_dtype"].isin(["bf16", "fp16"])
    assert (ran.loc[sixteen, "q_dtype"] == ran.loc[sixteen, "kv_dtype"]).all()  # a 16-bit cache pairs its own q
    if not ON_GPU:
        assert (ran.loc[~sixteen, "q_dtype"] == "fp16").all()
    # fp8 mode rounds q and p to e4m3: its error is much larger than dequant's on the same cache
    by = ran.set_index(["kv_dtype", "mode", "granularity"])["rel_err"]
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        for g in ("tensor", "head", "channel"):
            assert by[(kv, "fp8", g)] > 4 * by[(kv, "dequant", g)], (kv, g)


def test_tolerances_follow_bench_and_the_lse_rule(table):
    for _, r in table[table["status"] != "unsupported"].iterrows():
        case = Case(int(r["batch"]), 70, int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"]),
                    int(r["block_size"]),
                    kv_dtype=r["kv_dtype"], mode=r["mode"], backend=r["backend"], granularity=r["granularity"],
                    q_dtype=r["q_dtype"])
        assert r["tol"] == tolerance(case), _key(r)
    lse = torch.tensor([[-7.5, 2.0]])
    assert lse_tolerance("reference", "dequant", "fp16", lse) == pytest.approx(7.5e-5)
    assert lse_tolerance("triton", "fp8", "bf16", lse) == pytest.approx(7.5 / 8)
    assert lse_tolerance("flashinfer", "dequant", "bf16", torch.tensor([0.5])) == pytest.approx(4 * 2.0**-8)


# ------------------------------------------------------------------------------- broken backends
def _reference_only(**kw):
    return backend_matrix(**SMALL, backends=["reference"], kv_dtypes=["fp16", "fp8_e4m3"], modes=["dequant"],
                          granularities=["tensor", "channel"], **kw)


def test_a_wrong_backend_is_reported_as_failed(monkeypatch):
    real = backends.BACKENDS["reference"]

    def perturbed(q, cache, **kw):
        out, lse = real(q, cache, **kw)
        return out * 1.01, lse  # a 1 % error: far above the oracle's 1e-5 tolerance

    monkeypatch.setitem(backends.BACKENDS, "reference", perturbed)
    df = _reference_only()
    assert len(df) == 3 and (df["status"] == "failed").all() and df["passed"].eq(False).all()
    assert ((df["rel_err"] - 0.01).abs() < 1e-4).all() and (df["lse_err"] == 0).all()
    assert summarize(df) == {"n_rows": 3, "n_ran": 3, "n_passed": 0, "n_failed": 3, "n_error": 0,
                             "n_unsupported": 0}


def test_a_wrong_lse_or_a_nan_output_fails(monkeypatch):
    real = backends.BACKENDS["reference"]
    calls = []

    def broken(q, cache, **kw):
        out, lse = real(q, cache, **kw)
        calls.append(cache.kv_dtype)
        if len(calls) == 1:
            return out, lse + 0.01  # the output is right, the LSE is not
        return out * float("nan"), lse

    monkeypatch.setitem(backends.BACKENDS, "reference", broken)
    df = _reference_only()
    assert df["status"].tolist() == ["failed"] * 3
    assert df.loc[0, "rel_err"] == 0 and df.loc[0, "lse_err"] == pytest.approx(0.01, rel=1e-3)
    assert math.isnan(df.loc[1, "rel_err"])


def test_a_backend_that_raises_is_an_error_row(monkeypatch):
    def raises(q, cache, **kw):
        raise RuntimeError("kernel launch failed 42")

    monkeypatch.setitem(backends.BACKENDS, "reference", raises)
    df = _reference_only()
    assert (df["status"] == "error").all() and df["passed"].eq(False).all()
    assert df["error"].str.contains("RuntimeError: kernel launch failed 42").all()
    assert df["reason"].str.len().gt(0).all()  # the capability reason is kept beside the error
    assert summarize(df)["n_error"] == 3 and summarize(df)["n_ran"] == 3


# ----------------------------------------------------------------------------- refused query dtypes
@pytest.mark.parametrize("q_dtype, kv_dtypes, needle", [
    ("fp32", ["fp8_e4m3", "bf16"], "fp32 queries run on the reference only"),
    ("fp16", ["bf16"], "q is float16 but the cache is bf16"),
])
def test_a_query_dtype_the_backend_refuses_is_unsupported_not_an_error(q_dtype, kv_dtypes, needle, monkeypatch):
    """check_query's answer is a fact about the backend, not a failed run: such rows never reach decode."""
    real, ran = backends.BACKENDS["triton"], []
    monkeypatch.setitem(backends.BACKENDS, "triton", lambda q, cache, **kw: ran.append(q.dtype) or real(q, cache, **kw))
    df = backend_matrix(heads=(2, 1), head_dim=32, seq_lens=[1, 17], backends=["reference", "triton"],
                        kv_dtypes=kv_dtypes, modes=["dequant"], granularities=["tensor"], q_dtype=q_dtype)
    tri, ref = df[df["backend"] == "triton"], df[df["backend"] == "reference"]
    assert len(tri) == len(kv_dtypes) and (tri["status"] == "unsupported").all(), tri.to_string()
    assert tri["reason"].str.contains(needle).all() and (tri["error"] == "").all() and not ran
    assert (ref["status"] == "passed").all()  # the oracle takes either query dtype
    n = summarize(df)
    assert n["n_ran"] == len(ref) == n["n_passed"] and n["n_error"] == 0 and n["n_unsupported"] == len(tri)


# ---------------------------------------------------------------------------------- sequences, input
def test_ragged_seq_lens_cover_the_edge_cases():
    for batch, bs, top in [(2, 16, 37), (4, 16, 150), (6, 16, 2000), (5, 8, 64)]:
        lens = ragged_seq_lens(batch, bs, top)
        assert len(lens) == batch and lens[0] == 1 and lens[-1] == top
        assert lens == sorted(lens) and all(1 <= n <= top for n in lens)
        assert any(n % bs for n in lens[1:]), lens  # a partial last page
    assert ragged_seq_lens(1, 16, 40) == [40]
    with pytest.raises(ValueError, match=r"batch=1000000000000000000000000000000; expected an int <= 1048576"):
        ragged_seq_lens(10**30)  # refused, where the loop over it ran for ever


def test_explicit_seq_lens_reach_the_cache():
    df = backend_matrix(heads=(2, 1), head_dim=32, seq_lens=[1, 17, 33], backends=["reference"],
                        kv_dtypes=["fp16"], modes=["dequant"])
    assert df["seq_lens"].tolist() == ["1,17,33"] and df["status"].tolist() == ["passed"]
    assert df.loc[0, "q_dtype"] == "fp16"  # CPU: fp16; GPU: a 16-bit cache is read with its own type


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_dtypes=["int8"]), "kv_dtypes"),
    (dict(modes=[]), "modes"),
    (dict(backends=["cuda"]), "backends"),
    (dict(granularities=["block"]), "granularities"),
    (dict(heads=(6, 4)), "heads"),
    (dict(heads=8), "heads"),
    (dict(batch=2, seq_lens=[1, 2, 3]), "batch"),
    (dict(seq_lens=[4, 0]), r"seq_lens\[1\]"),
    (dict(head_dim=0), "head_dim"),
    (dict(q_dtype="fp8"), "q_dtype"),
    (dict(q_dtype=["bf16"]), r"q_dtype=\['bf16'\]"),  # 'unhashable type' before
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        backend_matrix(**kwargs)


@pytest.mark.parametrize("kwargs, match", [(dict(seq_lens=5), "seq_lens=5 \\(int\\)"),
                                           (dict(seq_lens="12"), "seq_lens='12' \\(str\\)"),
                                           (dict(seq_lens=[5], batch=True), "batch=True \\(bool\\)")])
def test_arguments_of_the_wrong_type_are_named(kwargs, match):
    with pytest.raises(TypeError, match=match):
        backend_matrix(**kwargs)


def test_summarize_rejects_foreign_frames():
    with pytest.raises(ValueError, match="lacks columns"):
        summarize(pd.DataFrame({"x": [1]}))
    with pytest.raises(TypeError, match="df must be a pandas DataFrame .*, got list"):
        summarize([1])
