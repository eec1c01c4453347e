"""The capability matrix: the facts per arch, this machine's view, and the automatic choices."""

import re

import pytest
import torch

from fp8kv import capability as cap_fn
from fp8kv.capability import (
    ARCHS,
    BACKEND_NAMES,
    KV_DTYPE_NAMES,
    MODES,
    UnsupportedError,
    capability,
    check,
    check_query,
    choose_backend,
    choose_mode,
)


def test_public_name_is_the_table_function():
    assert cap_fn is capability


@pytest.mark.parametrize("arch", ARCHS)
def test_table_shape_and_columns(arch):
    df = capability(arch)
    assert list(df.columns) == ["arch", "backend", "kv_dtype", "mode", "supported", "granularities", "reason"]
    assert len(df) == len(BACKEND_NAMES) * len(KV_DTYPE_NAMES) * len(MODES)
    assert (df["arch"] == arch).all()
    assert df["reason"].str.len().gt(10).all()  # every cell says why
    assert (df[~df["supported"]]["granularities"] == "").all()


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_storage_works_everywhere_fp8_arithmetic_needs_sm89(arch):
    n = int(arch[2:])
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        ok, why = check("triton", kv, "dequant", arch)
        assert ok, why
        if n < 89:
            assert "decoded in software" in why
        ok, why = check("triton", kv, "fp8", arch)
        assert ok == (n >= 89), why
        if n < 89:
            assert "needs sm89+" in why


def test_flashinfer_facts():
    for arch in ARCHS:
        ok, why = check("flashinfer", "fp8_e4m3", "dequant", arch)
        assert ok and "scalar scales" in why
        ok, why = check("flashinfer", "fp8_e4m3", "fp8", arch)
        assert ok == (arch == "sm100"), why
    ok, why = check("flashinfer", "fp8_e4m3", "dequant", "sm90", granularity="token_head")
    assert not ok and "scalar k_scale/v_scale" in why
    ok, why = check("flashinfer", "bf16", "dequant", "sm90", head_dim=80)
    assert not ok and "head_dim" in why
    assert capability("sm90").query("backend == 'flashinfer' and kv_dtype == 'fp8_e4m3' and mode == 'dequant'")[
        "granularities"].item() == "tensor,head,channel"


def test_mode_and_granularity_limits():
    ok, why = check("triton", "bf16", "fp8", "sm90")
    assert not ok and "needs an FP8 KV cache" in why
    ok, why = check("triton", "fp8_e4m3", "fp8", "sm90", granularity="token_head")
    assert not ok and "token_head needs dequant mode" in why
    ok, why = check("reference", "fp8_e4m3", "fp8", "sm90")
    assert not ok and "no FP8-arithmetic mode" in why
    ok, why = check("triton", "bf16", "dequant", "sm90", head_dim=512)
    assert not ok and "head_dim 512" in why
    ok, why = check("triton", "fp8_e4m3", "dequant", "sm75")
    assert not ok and "predates sm80" in why


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="backend='sglang'"):
        check("sglang", "bf16")
    with pytest.raises(ValueError, match="mode='int8'"):
        check("triton", "bf16", "int8")
    with pytest.raises(ValueError, match="kv_dtype='fp4'"):
        check("triton", "fp4")
    with pytest.raises(ValueError, match="arch='hopper'"):
        check("triton", "bf16", arch="hopper")


@pytest.mark.parametrize("arch", ["sm9", "sm0", "sm9999", "sm00090", "sm²", "sm\u0669\u0660", "SM90", "sm 90"])
def test_an_arch_that_is_not_sm_and_two_or_three_digits_is_refused(arch):
    """"sm9" (a typo of sm90) read as an arch before sm80, the reference as supported on it; other digits (Arabic-Indic
    ones made sm90) and leading zeros passed. Both capability tables take one reading (capability.arch_number)."""
    from fp8kv.capability_formats import check_format

    with pytest.raises(ValueError, match=f"arch={re.escape(repr(arch))}; expected 'sm' and a compute capability"):
        check("reference", "bf16", arch=arch)
    with pytest.raises(ValueError, match=f"arch={re.escape(repr(arch))}; expected 'sm' and a compute capability"):
        check_format("triton", "nvfp4", arch)


@pytest.mark.parametrize("arch", ["sm90", None])  # the arch's facts and this machine's view check alike
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(granularity="bogus"), ValueError, r"granularity='bogus'; expected one of \('tensor', 'head'"),
    (dict(granularity=None), ValueError, "granularity=None"),
    (dict(head_dim=0), ValueError, "head_dim=0; expected an int >= 1"),
    (dict(head_dim=-5), ValueError, "head_dim=-5; expected an int >= 1"),
    (dict(head_dim="128"), TypeError, r"head_dim='128' \(str\); expected an int"),
    (dict(head_dim=True), TypeError, "head_dim=True"),
    (dict(head_dim=128.0), TypeError, "head_dim=128.0"),
    (dict(layout="XYZ"), ValueError, r"layout='XYZ'; expected one of \('NHD', 'HND'\)"),
])
@pytest.mark.parametrize("backend", ["triton", "vllm", "reference"])
def test_check_refuses_arguments_outside_their_sets(backend, arch, kwargs, exc, match):
    """Nonsense is an error naming the argument, not (True, ...) from a branch that never reads it."""
    with pytest.raises(exc, match=match):
        check(backend, "fp8_e4m3", "dequant", arch, **kwargs)


def test_check_keeps_ok_reason_for_valid_arguments_that_do_not_run():
    assert check("vllm", "fp8_e4m3", "dequant", "sm90", layout="HND")[0] is False
    assert check("flashinfer", "bf16", "dequant", "sm90", head_dim=96)[0] is False
    assert check("triton", "fp8_e4m3", "dequant", "sm90", head_dim=96, layout="HND")[0] is True


def test_check_query_refuses_an_unknown_backend_or_cache_by_name():
    with pytest.raises(ValueError, match=r"backend='bogus'; expected one of \('reference', 'triton'"):
        check_query("bogus", "bf16", "fp8_e4m3")
    with pytest.raises(ValueError, match="kv_dtype='int4'"):
        check_query("triton", "bf16", "int4")


def test_this_cpu_machine(monkeypatch):
    """With no GPU, the answers depend on what this machine can do: the reference always, Triton only
    under the interpreter, FlashInfer never."""
    import importlib

    C = importlib.import_module("fp8kv.capability")  # the module (fp8kv.capability is also the function)
    monkeypatch.setattr(C, "current_arch", lambda device=None: None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = check("triton", "fp8_e4m3")
    assert not ok and "TRITON_INTERPRET=1" in why
    assert check("reference", "fp8_e4m3")[0]
    ok, why = check("flashinfer", "bf16")
    assert not ok and why.startswith("no GPU")
    assert choose_backend("fp8_e4m3") == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, why = check("triton", "fp8_e4m3")
    assert ok and "interpreter" in why
    assert not check("triton", "bf16", "fp8")[0]  # fp8 mode still needs an FP8 cache
    assert (capability()["arch"] == "cpu").all()


def test_automatic_choices():
    assert choose_mode("triton", "fp8_e4m3", "sm90") == "dequant"
    assert choose_backend("fp8_e4m3", arch="sm80") == "triton"
    assert choose_backend("fp8_e4m3", "fp8", arch="sm100") == "triton"
    with pytest.raises(UnsupportedError, match="no backend runs"):
        choose_backend("fp8_e4m3", "fp8", arch="sm80")
    with pytest.raises(UnsupportedError, match="triton cannot run"):
        choose_mode("triton", "fp8_e4m3", "sm75")


@pytest.mark.parametrize("backend", ["auto", "reference", "triton"])
def test_decode_asks_the_capability_table_once_per_call(backend, make_cache, monkeypatch):
    """Validation and capability happen once, where the input enters (fp8kv.decode): the search for
    a backend or the check of the one named, not both, and not again inside the backend."""
    import sys

    import torch

    from fp8kv import backends
    from fp8kv.capability import interpreter_on

    if backend == "triton" and not interpreter_on():
        pytest.skip("the Triton kernel runs on CPU under the interpreter only")
    calls = []
    real = check

    def counted(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(sys.modules["fp8kv.capability"], "check", counted)
    monkeypatch.setattr(backends, "supported", counted)
    cache = make_cache([5, 40], 2, 32)
    q = torch.randn(2, 4, 32, dtype=torch.float16)
    backends.decode(q, cache, backend)
    assert len(calls) == 1, calls


@pytest.mark.parametrize("backend, q, kv, needle", [
    ("triton", "fp32", "fp8_e4m3", "fp32 queries run on the reference only"),
    ("flashinfer", "fp32", "bf16", "fp32 queries run on the reference only"),
    ("flashinfer", "fp16", "bf16", "FlashInfer pairs a fp16 query with a fp16 or FP8 cache, not bf16"),
    ("triton", "fp16", "bf16", "q is float16 but the cache is bf16"),
    ("triton", torch.int8, "bf16", "expected one of ('bf16', 'fp16', 'fp32')"),
])
def test_check_query_names_the_refused_pairing(backend, q, kv, needle):
    ok, why = check_query(backend, q, kv)
    assert not ok and needle in why


@pytest.mark.parametrize("backend, q, kv", [
    ("reference", "fp32", "bf16"), ("reference", torch.float16, "bf16"), ("triton", "bf16", "fp16"),
    ("triton", torch.float16, "fp8_e5m2"), ("flashinfer", "bf16", "fp8_e4m3"), ("flashinfer", "fp16", "fp16"),
])
def test_check_query_accepts_what_the_kernels_take(backend, q, kv):
    assert check_query(backend, q, kv) == (True, "")


# ------------------------------------------------------------------------ the attend (multi-token queries)
@pytest.mark.parametrize("arch", ["sm80", "sm89", "sm90", "sm100"])
def test_the_attend_runs_where_the_decode_runs_but_flashinfers_fp8_mode(arch):
    """Each backend's attend runs by the decode's facts on every arch, except FlashInfer's fp8 mode (its prefill
    wrapper runs 16-bit queries), and says how it runs the several queries."""
    from fp8kv.capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES

    for backend in BACKEND_NAMES:
        for kv in KV_DTYPE_NAMES:
            for mode in MODES:
                for gran in ("tensor", "token_head"):
                    dec = check(backend, kv, mode, arch, gran)
                    att = check(backend, kv, mode, arch, gran, op="attend")
                    if backend == "flashinfer" and mode == "fp8" and dec[0]:
                        assert att == (False, att[1]) and "16-bit query" in att[1]
                    else:
                        assert att[0] == dec[0], (backend, kv, mode, gran, att, dec)
                        if not dec[0]:
                            assert att[1] == dec[1]  # the decode's refusal, word for word
    how = {b: check(b, "fp8_e4m3", "dequant", "sm90", op="attend")[1] for b in BACKEND_NAMES}
    assert "truncated" in how["reference"] or "cut after" in how["reference"]
    assert "fp8kv.ops.attend" in how["triton"]
    assert "BatchPrefillWithPagedKVCacheWrapper" in how["flashinfer"]
    assert "cu_seqlens_q = qo_indptr" in how["vllm"]


@pytest.mark.parametrize("op", ["prefill", "", None, 1])
def test_an_op_that_is_not_one_is_refused_by_name(op):
    from fp8kv.capability import check_variant, choose_backend

    for call in (lambda: check("triton", "fp8_e4m3", op=op), lambda: check_variant("triton", "window", op=op),
                 lambda: choose_backend("fp8_e4m3", op=op)):
        with pytest.raises((ValueError, TypeError), match="op="):
            call()


def test_the_attend_capability_table():
    from fp8kv.capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES, attend_capability

    df = attend_capability("sm90")
    assert list(df.columns) == ["arch", "op", "backend", "kv_dtype", "mode", "supported", "granularities",
                                "variants", "reason"]
    assert len(df) == len(BACKEND_NAMES) * len(KV_DTYPE_NAMES) * len(MODES) and set(df.op) == {"attend"}
    row = df.set_index(["backend", "kv_dtype", "mode"])
    assert row.loc[("triton", "fp8_e4m3", "dequant")].granularities == "tensor,head,token_head,channel"
    assert row.loc[("triton", "fp8_e4m3", "fp8")].granularities == "tensor,head,channel"
    assert row.loc[("triton", "fp8_e4m3", "dequant")].variants == "window,soft_cap,sinks"
    fi = row.loc[("flashinfer", "fp8_e4m3", "dequant")]
    assert fi.supported and fi.granularities == "tensor,head,channel" and fi.variants == "window,soft_cap"
    assert not row.loc[("flashinfer", "fp8_e4m3", "fp8")].supported
    assert row.loc[("flashinfer", "fp8_e4m3", "fp8")].variants == ""
    assert row.loc[("vllm", "fp8_e4m3", "dequant")].granularities == "tensor"
    assert not row.loc[("reference", "bf16", "fp8")].supported
    both = attend_capability(["sm80", "sm90"])
    assert list(both.arch.unique()) == ["sm80", "sm90"]
    assert not both.set_index(["arch", "backend", "kv_dtype", "mode"]).loc[("sm80", "triton", "fp8_e4m3", "fp8")].supported
    with pytest.raises(ValueError, match=r"arch=\[\]"):
        attend_capability([])


def test_flashinfers_attend_variants_are_its_prefill_wrappers():
    from fp8kv.capability import check_variant, check_variants

    assert check_variant("flashinfer", "window", op="attend")[0]
    assert "BatchPrefillWithPagedKVCacheWrapper" in check_variant("flashinfer", "soft_cap", op="attend")[1]
    ok, why = check_variant("flashinfer", "sinks", op="attend")
    assert not ok and "no sink term" in why
    with pytest.raises(UnsupportedError, match="cannot apply sinks"):
        check_variants("flashinfer", "dequant", ["window", "sinks"], op="attend")
    for backend in ("reference", "triton", "vllm"):  # the decode's facts
        for v in ("window", "soft_cap", "sinks"):
            assert check_variant(backend, v, op="attend") == check_variant(backend, v)


def test_one_variant_name_and_a_list_for_a_dtype_are_read_as_such():
    """check_variants("sinks") walked the string's letters (naming variant 's'); a list as q's dtype raised
    'unhashable type'."""
    from fp8kv.capability import check_query, check_variants

    with pytest.raises(UnsupportedError, match="cannot apply sinks"):
        check_variants("flashinfer", "dequant", "sinks")
    assert check_query("triton", ["bf16"], "bf16") == (False, "q is ['bf16']; expected one of ('bf16', 'fp16', 'fp32')")


# ------------------------------------------------------------------------- the attend per class of new-token counts
def test_the_attend_table_by_query_count_names_the_kernel_of_each_class():
    from fp8kv.capability import attend_capability
    from fp8kv.capability_attend import QUERY_CLASSES

    plain = attend_capability("sm90")
    df = attend_capability("sm90", by_queries=True)
    assert list(df.columns) == ["arch", "op", "backend", "kv_dtype", "mode", "queries", "kernel", "kernel_reason",
                                "supported", "granularities", "variants", "reason"]
    assert len(df) == len(QUERY_CLASSES) * len(plain) and QUERY_CLASSES == ("1", "2+ equal", "ragged or long")
    keys = ["backend", "kv_dtype", "mode"]
    same = df.drop(columns=["queries", "kernel", "kernel_reason"]).drop_duplicates().reset_index(drop=True)
    assert same.equals(plain[same.columns])  # the plain table's facts, once per class
    k = df.set_index([*keys, "queries"])["kernel"]
    why = df.set_index([*keys, "queries"])["kernel_reason"]
    assert k[("triton", "fp8_e4m3", "dequant", "1")] == "decode plan: Gluon or Triton decode kernel"
    assert k[("triton", "fp8_e4m3", "dequant", "2+ equal")] == "Gluon rows or Triton attend kernel"
    assert "fp8kv.ops.decode.plan_rows" in why[("triton", "fp8_e4m3", "dequant", "2+ equal")]
    assert k[("triton", "fp8_e4m3", "dequant", "ragged or long")] == "Triton attend kernel"
    # the Gluon kernel runs dequant mode over FP8 pages only: the attend kernel takes the rest
    assert k[("triton", "fp8_e4m3", "fp8", "1")] == "decode plan: Triton decode kernel"
    assert k[("triton", "fp8_e4m3", "fp8", "2+ equal")] == "Triton attend kernel"
    assert "mode='fp8': the Gluon kernel runs dequant mode" in why[("triton", "fp8_e4m3", "fp8", "2+ equal")]
    assert k[("triton", "bf16", "dequant", "2+ equal")] == "Triton attend kernel"
    assert "reads FP8 pages" in why[("triton", "bf16", "dequant", "2+ equal")]
    for q in QUERY_CLASSES:  # FlashInfer's prefill wrapper, dequant only, whatever the counts; vLLM's kernel
        assert k[("flashinfer", "fp8_e4m3", "dequant", q)].startswith("FlashInfer BatchPrefillWithPagedKVCacheWrapper")
        assert k[("flashinfer", "fp8_e4m3", "fp8", q)] == "" and why[("flashinfer", "fp8_e4m3", "fp8", q)] == ""
        assert k[("vllm", "fp8_e4m3", "dequant", q)] == ("vLLM unified_attention (3D split or 2D)" if q == "1" else
                                                         "vLLM unified_attention (2D)")
        assert k[("reference", "bf16", "dequant", q)] == "reference (fp32 torch)"
    old = attend_capability("sm80", by_queries=True).set_index([*keys, "queries"])
    assert old.loc[("triton", "fp8_e4m3", "dequant", "2+ equal"), "kernel"] == "Triton attend kernel"
    assert "need sm89+" in old.loc[("triton", "fp8_e4m3", "dequant", "2+ equal"), "kernel_reason"]
    both = attend_capability(["sm80", "sm90"], by_queries=True)
    assert len(both) == 2 * len(df) and list(both.arch.unique()) == ["sm80", "sm90"]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_by_queries_must_be_a_bool(value):
    from fp8kv.capability import attend_capability

    with pytest.raises(TypeError, match=rf"by_queries={value!r} \({type(value).__name__}\); expected True or False"):
        attend_capability("sm90", by_queries=value)


def test_a_query_class_that_is_not_one_is_refused_by_name():
    from fp8kv.capability_attend import query_kernel

    with pytest.raises(ValueError, match=r"queries='2-16'; expected one of \('1', '2\+ equal', 'ragged or long'\)"):
        query_kernel("triton", "fp8_e4m3", "dequant", "2-16", 90)


def test_the_query_classes_words_are_the_gluon_kernels_limits():
    """The class texts and reasons quote the Gluon kernel's limits in numbers (the capability layer cannot import
    fp8kv.ops): they must be the constants plan / plan_rows read."""
    from fp8kv.capability_attend import QUERY_CLASS_TEXT, query_kernel
    from fp8kv.ops.decode.gluon_launcher import GLUON_MIN_ROW_SPLIT_TOKENS, GLUON_MIN_SPLIT_TOKENS
    from fp8kv.ops.decode.gluon_scope import MAX_HEAD_DIM, MIN_HEAD_DIM, max_rows
    from fp8kv.ops.decode.planning import MAX_ROW_TILES

    assert MAX_ROW_TILES == 2 and "within two Gluon programs" in QUERY_CLASS_TEXT["2+ equal"]
    assert (MAX_ROW_TILES * max_rows(64), MAX_ROW_TILES * max_rows(128), MAX_ROW_TILES * max_rows(256)) == (64, 32, 32)
    assert "at most 64 rows at head_dim <= 64, 32 above" in QUERY_CLASS_TEXT["2+ equal"]
    assert 4 * 8 <= MAX_ROW_TILES * max_rows(128) < 4 * 9  # "8 new tokens at a group of 4, head_dim 128"
    rows = query_kernel("triton", "fp8_e4m3", "dequant", "2+ equal", 90)[1]
    one = query_kernel("triton", "fp8_e4m3", "dequant", "1", 90)[1]
    assert f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}" in rows and f"from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}" in one
    assert set(GLUON_MIN_ROW_SPLIT_TOKENS.values()) == {512} and "at least 512 tokens" in rows
    assert GLUON_MIN_SPLIT_TOKENS == {1: 1024, 2: 512} and "at least 1024 tokens, 512 above head_dim 128" in one


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's rows: no Gluon kernel")
def test_this_cpus_attend_rows_name_the_plans_the_triton_backend_makes():
    """arch=None on a CPU: the table's kernel per class is the plan fp8kv.planned_attend makes of such counts."""
    from fixtures import make_cache

    from fp8kv import backends
    from fp8kv.capability import attend_capability, interpreter_on
    from fp8kv.ops.attend.planning import AttendPlan
    from fp8kv.ops.decode import DecodePlan

    if not interpreter_on():
        pytest.skip("the Triton backend runs on a CPU under TRITON_INTERPRET=1 only")
    df = attend_capability(by_queries=True).set_index(["backend", "kv_dtype", "mode", "queries"])
    counts = {"1": [1, 1, 1], "2+ equal": [3, 3, 3], "ragged or long": [1, 3, 2]}
    cache = make_cache([20, 33, 40], 2, 64)
    for mode in ("dequant", "fp8"):
        for queries, lens in counts.items():
            row = df.loc[("triton", "fp8_e4m3", mode, queries)]
            qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            q = torch.randn(sum(lens), 8, 64, dtype=torch.float16)
            plan = backends.planned_attend(q, cache, qo, "triton", mode).args[0]
            if queries == "1":
                assert row.kernel == "decode plan: Triton decode kernel" and isinstance(plan, DecodePlan)
                assert plan.kernel == "triton"
            else:
                assert row.kernel == "Triton attend kernel" and isinstance(plan, AttendPlan), (mode, queries)
            if queries != "ragged or long" and mode == "dequant":
                assert "CUDA GPU only" in row.kernel_reason
