"""The capability rows of the KV formats beside FP8: which backend reads which format on which arch, with the reason,
in the capability table's columns; what fp8kv's kernel reads is what its launcher dispatches; bad input by name."""

import pandas as pd
import pytest

from fp8kv import kv_formats as kvf
from fp8kv.capability import ARCHS, BACKEND_NAMES, capability
from fp8kv.capability_formats import FORMAT_NAMES, TRITON_FORMATS, check_format, format_capability
from fp8kv.ops.quant_decode import QUANT_DECODE_FORMATS


def expected(backend, fmt, arch) -> bool:
    """The facts of fp8kv.capability_formats, restated as the table should hold them."""
    if backend == "reference":
        return True
    return {"triton": fmt in ("int8_token_head", "int4_token_head", "nvfp4", "mxfp4"),
            "flashinfer": fmt == "nvfp4" and arch == "sm100",
            "vllm": fmt == "int8_token_head"}[backend]


def test_the_format_rows_have_the_capability_tables_columns():
    rows = format_capability("sm90")
    assert list(rows.columns) == list(capability("sm90").columns)
    both = pd.concat([capability("sm90"), rows], ignore_index=True)
    assert set(both.kv_dtype) >= {"bf16", "fp8_e4m3", "int8_token_head", "kivi4_g32", "nvfp4", "mxfp4"}
    assert len(rows) == len(BACKEND_NAMES) * len(FORMAT_NAMES)
    assert (rows["mode"] == "dequant").all() and (rows["granularities"] == "").all()


def test_every_format_beside_fp8_is_listed_and_fp8_is_not():
    assert set(FORMAT_NAMES) == {n for n in kvf.KV_FORMAT_NAMES if not n.startswith("fp8_")}
    assert {"int8_token_head", "int4_token_head", "kivi4_g32", "kivi4_g64", "kivi4_g128", "nvfp4", "mxfp4"} <= \
        set(FORMAT_NAMES)


@pytest.mark.parametrize("arch", ARCHS)
def test_support_per_format_backend_and_arch(arch):
    rows = format_capability(arch)
    for r in rows.itertuples():
        assert r.supported == expected(r.backend, r.kv_dtype, arch), (r.backend, r.kv_dtype, r.reason)
        assert r.reason  # every row says why


@pytest.mark.parametrize("g", kvf.KIVI_GROUPS)
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "vllm"])
def test_no_kernel_reads_kivi_and_the_reason_says_so(g, backend):
    ok, why = check_format(backend, f"kivi4_g{g}", "sm90")
    assert not ok
    if backend == "triton":
        assert "no paged cache" in why
    else:
        assert "no kivi4" in why


def test_the_reasons_name_the_peers_limits():
    assert "sm100" in check_format("flashinfer", "nvfp4", "sm90")[1]
    assert "kv_cache_sf" in check_format("flashinfer", "nvfp4", "sm100")[1]
    assert "per token and head" in check_format("vllm", "int8_token_head", "sm89")[1]
    assert "no decode kernel yet" in check_format("triton", "e4m3_b16", "sm90")[1]
    assert "predates sm80" in check_format("triton", "nvfp4", "sm75")[1]


def test_the_kernels_formats_are_the_launchers():
    assert set(TRITON_FORMATS) == set(QUANT_DECODE_FORMATS)


def test_this_machine_on_cpu(monkeypatch):
    monkeypatch.setattr("fp8kv.capability_formats.current_arch", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_format("triton", "nvfp4")[0] and "interpreter" in check_format("triton", "nvfp4")[1]
    assert check_format("reference", "kivi4_g32")[0]
    assert not check_format("flashinfer", "nvfp4")[0] and not check_format("vllm", "int8_token_head")[0]
    assert "no paged cache" in check_format("triton", "kivi4_g32")[1]
    assert (format_capability()["arch"] == "cpu").all()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = check_format("triton", "int8_token_head")
    assert not ok and "TRITON_INTERPRET=1" in why


def test_a_list_of_archs_and_a_subset_of_formats():
    rows = format_capability(["sm80", "sm100"], formats=["nvfp4", "mxfp4"])
    assert len(rows) == 2 * len(BACKEND_NAMES) * 2 and set(rows.arch) == {"sm80", "sm100"}


@pytest.mark.parametrize("call,match", [
    (lambda: check_format("cutlass", "nvfp4", "sm90"), "backend='cutlass'"),
    (lambda: check_format("triton", "nvfp8", "sm90"), "fmt='nvfp8' is not a known KV format"),
    (lambda: check_format("triton", "fp8_e4m3_tensor", "sm90"), "fp8_e4m3_tensor' is an FP8 format"),
    (lambda: check_format("triton", "nvfp4", "hopper"), "arch='hopper'"),
    (lambda: check_format("triton", "nvfp4", 90), "arch=90"),
    (lambda: format_capability([]), r"arch=\[\]"),
    (lambda: format_capability("sm90", formats=["nvfp4", "int3"]), r"formats has \['int3'\]"),
    (lambda: format_capability("sm90", formats=[]), "formats is empty"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_non_name_format_is_a_type_error():
    with pytest.raises(TypeError, match="fmt=3"):
        check_format("triton", 3, "sm90")
