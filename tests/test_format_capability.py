"""The capability rows of the KV formats beside FP8: which backend reads which format on which arch, with the reason,
in the capability table's columns; each row's facts tied to their sources (fp8kv's launcher and Gluon scope, vLLM's
pinned kernel file where it is on this machine, what fp8kv's backends take); bad input by name."""

import ast
import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

from fp8kv import kv_formats as kvf
from fp8kv.capability import ARCHS, BACKEND_NAMES, capability
from fp8kv.capability_formats import (
    FACT_COLUMNS,
    FORMAT_NAMES,
    FP8KV_PASSES,
    GLUON_FORMATS,
    GLUON_PACKED_FORMATS,
    GLUON_PACKED_HEAD_DIM,
    TRITON_FORMATS,
    VLLM_COMMIT,
    VLLM_KERNEL_FILE,
    VLLM_MODES,
    VLLM_PACKED_MODES,
    check_format,
    format_capability,
    format_facts,
)
from fp8kv.ops.decode.gluon_scope import GLUON_QUANTIZED_FORMATS, PACKED_CODES, PACKED_HEAD_DIM, reads_pages
from fp8kv.ops.quant_decode import QUANT_DECODE_FORMATS

REPO = Path(__file__).resolve().parent.parent
PEERS = [b for b in BACKEND_NAMES if b not in ("triton", "reference")]


def test_the_format_rows_have_the_capability_tables_columns_and_the_two_facts():
    rows = format_capability("sm90")
    assert list(rows.columns) == [*capability("sm90").columns, *FACT_COLUMNS]
    both = pd.concat([capability("sm90"), rows], ignore_index=True)
    assert set(both.kv_dtype) >= {"bf16", "fp8_e4m3", "int8_token_head", "kivi4_g32", "nvfp4", "mxfp4"}
    assert len(rows) == len(BACKEND_NAMES) * len(FORMAT_NAMES)
    assert (rows["mode"] == "dequant").all() and (rows["granularities"] == "").all()


@pytest.mark.parametrize("arch", ARCHS)
def test_supported_is_the_kernel_reading_and_fp8kv_passing(arch):
    """"supported" means fp8kv runs it: a peer that reads a format fp8kv does not hand it is not supported."""
    rows = format_capability(arch)
    assert (rows["supported"] == (rows["kernel_reads"] & rows["fp8kv_passes"])).all()
    for r in rows.itertuples():
        assert r.reason, (r.backend, r.kv_dtype)  # every row says why
        assert check_format(r.backend, r.kv_dtype, arch) == (r.supported, r.reason)
        assert format_facts(r.backend, r.kv_dtype, arch) == (r.kernel_reads, r.fp8kv_passes, r.reason)


def test_every_format_beside_fp8_is_listed_and_fp8_is_not():
    assert set(FORMAT_NAMES) == {n for n in kvf.KV_FORMAT_NAMES if not n.startswith("fp8_")}
    assert {"int8_token_head", "int4_token_head", "kivi4_g32", "kivi4_g64", "kivi4_g128", "nvfp4", "mxfp4"} <= \
        set(FORMAT_NAMES)


# ----------------------------------------------------------------------------------- fp8kv's own decode
def test_the_kernels_formats_are_the_launchers():
    assert set(TRITON_FORMATS) == set(QUANT_DECODE_FORMATS)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8kvs_rows_read_what_its_launcher_dispatches(arch):
    rows = format_capability(arch).set_index(["backend", "kv_dtype"])
    for fmt in FORMAT_NAMES:
        assert rows.loc[("triton", fmt), "kernel_reads"] == (fmt in QUANT_DECODE_FORMATS), fmt
        assert rows.loc[("triton", fmt), "fp8kv_passes"] == (fmt in QUANT_DECODE_FORMATS), fmt


def test_the_gluon_facts_are_the_gluon_scopes():
    assert set(GLUON_FORMATS) == set(GLUON_QUANTIZED_FORMATS)
    assert set(GLUON_PACKED_FORMATS) == {f for f, codes in GLUON_QUANTIZED_FORMATS.items() if codes in PACKED_CODES}
    assert GLUON_PACKED_HEAD_DIM == PACKED_HEAD_DIM
    for fmt in GLUON_FORMATS:  # the head dims the rows name are those the kernel reads
        for d in range(48, 257, 16):
            assert reads_pages(fmt, "tensor", d) == (fmt not in GLUON_PACKED_FORMATS or d % GLUON_PACKED_HEAD_DIM == 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_rows_name_the_gluon_kernel_for_the_formats_it_reads(arch):
    for fmt in TRITON_FORMATS:
        why = check_format("triton", fmt, arch)[1]
        assert ("Gluon kernel" in why) == (fmt in GLUON_QUANTIZED_FORMATS and int(arch[2:]) >= 89), (fmt, why)
        packed = fmt in GLUON_QUANTIZED_FORMATS and GLUON_QUANTIZED_FORMATS[fmt] in PACKED_CODES
        assert (f"multiples of {PACKED_HEAD_DIM}" in why) == (packed and int(arch[2:]) >= 89), (fmt, why)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_the_oracle_reads_every_format_through_kv_formats(fmt):
    """The reference rows say every format is read: kv_formats stores and loads each one, K and V."""
    from fp8kv.analysis.format_errors import through_format

    x = torch.randn(128, 2, 128, generator=torch.Generator().manual_seed(0))
    for which in ("k", "v"):
        y = through_format(x, fmt, which)
        assert y.shape == x.shape and bool(torch.isfinite(y).all())
        assert float((y - x).norm() / x.norm()) < 0.5, (fmt, which)
    assert format_facts("reference", fmt, "sm90")[:2] == (True, True)


# ----------------------------------------------------------------------------------- what fp8kv passes
@pytest.mark.parametrize("backend", PEERS)
def test_fp8kvs_peer_backends_take_no_quantized_cache(backend):
    """FP8KV_PASSES has nothing for the peers: fp8kv.decode, and the vLLM / FlashInfer argument builders, refuse a
    QuantizedPagedKVCache by type."""
    import fp8kv
    from fp8kv.backends.flashinfer_args import paged_kv_args
    from fp8kv.backends.vllm import kernel_args
    from fp8kv.cache.quantized import QuantizedPagedKVCache

    assert FP8KV_PASSES[backend] == ()
    cache = QuantizedPagedKVCache.empty("int8_token_head", 1, 16, 2, 64)
    with pytest.raises(TypeError, match="must be a fp8kv.PagedKVCache"):
        fp8kv.decode(torch.zeros(1, 2, 64), cache, backend=backend)
    build = {"vllm": lambda: kernel_args(cache, 2), "flashinfer": lambda: paged_kv_args(cache)}[backend]
    with pytest.raises(TypeError, match="must be a fp8kv.PagedKVCache"):
        build()
    for fmt in FORMAT_NAMES:
        reads, passes, why = format_facts(backend, fmt, "sm100")
        assert not passes and (f"fp8kv's {backend} backend does not pass {fmt} pages" in why) is reads, (fmt, why)


# ----------------------------------------------------------------------------------- vLLM's pinned kernel file
def _vllm_kernel_file() -> Path | None:
    """vLLM's kernel file on this machine: the repository's git-ignored shim, else an importable vllm's."""
    shim = REPO / ".vllm_shim" / VLLM_KERNEL_FILE
    if shim.is_file():
        return shim
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent.parent / VLLM_KERNEL_FILE
        return path if path.is_file() else None
    return None


def _dispatch(path: Path) -> tuple[set[str], set[str]]:
    """``(modes, packed)``: every ``KVQuantMode.X`` that ``unified_attention`` names, and those of the branch that
    hands the call to ``get_backend`` (the packed-KV backends)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "unified_attention")

    def named(node) -> set[str]:
        return {a.attr for a in ast.walk(node) if isinstance(a, ast.Attribute)
                and isinstance(a.value, ast.Name) and a.value.id == "KVQuantMode"}

    packed = [named(n.test) for n in ast.walk(fn) if isinstance(n, ast.If)
              and any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "get_backend" for c in ast.walk(n))]
    assert len(packed) == 1, "unified_attention hands packed modes to get_backend in one branch"
    return named(fn), packed[0]


@pytest.fixture(scope="module")
def vllm_file() -> Path:
    path = _vllm_kernel_file()
    if path is None:
        pytest.skip(f"vLLM's {VLLM_KERNEL_FILE} is not on this machine (no .vllm_shim, no vllm install)")
    return path


def test_the_vllm_rows_are_the_modes_its_pinned_kernel_dispatches(vllm_file):
    modes, packed = _dispatch(vllm_file)
    assert modes <= set(VLLM_MODES), f"the kernel dispatches modes the rows do not know: {modes - set(VLLM_MODES)}"
    assert set(packed) == set(VLLM_PACKED_MODES)
    for m in modes:  # INT8_PER_TOKEN_HEAD stores what fp8kv calls int8_token_head; a mode without a format maps to None
        named = m.lower().replace("_per_", "_")
        assert VLLM_MODES[m] == (named if named in FORMAT_NAMES else None), m
    read = {VLLM_MODES[m] for m in modes} - {None}
    for arch in ARCHS:
        rows = format_capability(arch)
        vllm = rows[rows["backend"] == "vllm"].set_index("kv_dtype")
        assert {f for f in FORMAT_NAMES if vllm.loc[f, "kernel_reads"]} == read, arch
        assert not vllm["supported"].any()  # fp8kv's vLLM backend passes none of them
    for m in modes & set(VLLM_PACKED_MODES):
        if VLLM_MODES[m]:
            assert "triton_quant_kv" in check_format("vllm", VLLM_MODES[m], "sm90")[1]


def test_the_vllm_commit_is_the_shims():
    commit = REPO / ".vllm_shim" / "COMMIT"
    if not commit.is_file():
        pytest.skip("no .vllm_shim/COMMIT on this machine")
    assert commit.read_text(encoding="utf-8").strip() == VLLM_COMMIT
    assert f"commit {VLLM_COMMIT}" in check_format("vllm", "int8_token_head", "sm90")[1]


# ----------------------------------------------------------------------------------- reasons, this machine, input
@pytest.mark.parametrize("g", kvf.KIVI_GROUPS)
@pytest.mark.parametrize("backend", ["triton", "flashinfer", "vllm"])
def test_no_kernel_reads_kivi_and_the_reason_says_so(g, backend):
    ok, why = check_format(backend, f"kivi4_g{g}", "sm90")
    assert not ok
    if backend == "triton":
        assert "KIVIPagedKVCache" in why and "no decode kernel reads it yet" in why
    else:
        assert "no kivi4" in why


def test_the_reasons_name_the_peers_limits():
    assert "sm100" in check_format("flashinfer", "nvfp4", "sm90")[1]
    assert "kv_cache_sf" in check_format("flashinfer", "nvfp4", "sm100")[1]
    assert format_facts("flashinfer", "nvfp4", "sm100")[:2] == (True, False)
    assert "per token and head" in check_format("vllm", "int8_token_head", "sm89")[1]
    assert "no decode kernel yet" in check_format("triton", "e4m3_b16", "sm90")[1]
    assert "predates sm80" in check_format("triton", "nvfp4", "sm75")[1]


def test_this_machine_on_cpu(monkeypatch):
    monkeypatch.setattr("fp8kv.capability_formats.current_arch", lambda: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert check_format("triton", "nvfp4")[0] and "interpreter" in check_format("triton", "nvfp4")[1]
    assert check_format("reference", "kivi4_g32")[0]
    assert not check_format("flashinfer", "nvfp4")[0] and not check_format("vllm", "int8_token_head")[0]
    assert format_facts("vllm", "int8_token_head")[0] is False  # no GPU for vLLM's kernel here
    assert "no decode kernel reads it yet" in check_format("triton", "kivi4_g32")[1]
    assert (format_capability()["arch"] == "cpu").all()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = check_format("triton", "int8_token_head")
    assert not ok and "TRITON_INTERPRET=1" in why


def test_a_list_of_archs_and_a_subset_of_formats():
    rows = format_capability(["sm80", "sm100"], formats=["nvfp4", "mxfp4"])
    assert len(rows) == 2 * len(BACKEND_NAMES) * 2 and set(rows.arch) == {"sm80", "sm100"}


@pytest.mark.parametrize("call,match", [
    (lambda: check_format("cutlass", "nvfp4", "sm90"), "backend='cutlass'"),
    (lambda: format_facts("cutlass", "nvfp4", "sm90"), "backend='cutlass'"),
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
