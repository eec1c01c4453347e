"""fp8kv.backends.vllm: vLLM's Triton unified-attention kernel as the "vllm" backend.

No vLLM is installed where these tests run by default, so the adaptor is checked against a *fake*
``vllm`` put into ``sys.modules``: its ``unified_attention`` has vLLM's signature and computes what
vLLM's source says the kernel computes (pages gathered through ``block_table``, FP8 dequantized with
the per-tensor descales and rounded to the query's type, ``window_size``, ``softcap``, ``sinks``), in
plain torch from the arguments it receives. A wrong mapping of any argument then misses the fp32
oracle. Where a real ``vllm`` (or the kernel's shim) is importable, the last tests run the real
kernel under the Triton interpreter too.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import math
import sys
import types
from enum import IntEnum

import pandas as pd
import pytest
import torch
from fixtures import make_cache, make_q, seeded

import fp8kv
from fp8kv import backends
from fp8kv.backends import vllm as vb
from fp8kv.bench import layout_markdown, layout_table, run, sweep
from fp8kv.cache import PagedKVCache
from fp8kv.capability import (
    ARCHS,
    KV_DTYPE_NAMES,
    VLLM_HEAD_DIMS,
    VLLM_NOT_INSTALLED,
    UnsupportedError,
    check,
    check_query,
    check_variant,
    choose_backend,
    variants,
)
from fp8kv.quant import relative_error
from fp8kv.reference import output_tolerance

C = importlib.import_module("fp8kv.capability")  # the module (fp8kv.capability is also the function)
REAL_VLLM = importlib.util.find_spec("vllm") is not None  # a vLLM install or the kernel's shim on PYTHONPATH


# ------------------------------------------------------------------------------------ the fake vllm
class FakeKVQuantMode(IntEnum):
    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3


def _fake_unified_attention(calls):
    """vLLM's unified_attention (commit 86a153bd) by its documented semantics, in fp32 torch."""

    def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                          causal, window_size, block_table, softcap, q_descale, k_descale, v_descale,
                          seq_threshold_3D=None, num_par_softmax_segments=None, softmax_segm_output=None,
                          softmax_segm_max=None, softmax_segm_expsum=None, alibi_slopes=None, output_scale=None,
                          qq_bias=None, sinks=None, mm_prefix_range=None, use_alibi_sqrt=False,
                          kv_quant_mode=FakeKVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None):
        calls.append(dict(q=q, k=k, v=v, out=out, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                          seqused_k=seqused_k, window_size=window_size, block_table=block_table, softcap=softcap,
                          k_descale=k_descale, v_descale=v_descale, kv_quant_mode=kv_quant_mode, sinks=sinks,
                          num_par_softmax_segments=num_par_softmax_segments, seq_threshold_3D=seq_threshold_3D))
        assert causal is True and q_descale is None, "vLLM asserts both"
        assert alibi_slopes is None and output_scale is None and qq_bias is None and mm_prefix_range is None
        assert isinstance(kv_quant_mode, FakeKVQuantMode)
        assert kv_quant_mode in (FakeKVQuantMode.NONE, FakeKVQuantMode.FP8_PER_TENSOR)
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seqused_k", seqused_k), ("block_table", block_table)):
            assert t.dtype == torch.int32, name
        num_tokens, hq, d = q.shape
        hkv, bs = k.shape[2], v.shape[1]  # [num_blocks, block_size, Hkv, D]
        assert k.shape == v.shape and k.shape[3] == d and out.shape == q.shape and out.dtype == q.dtype
        if num_par_softmax_segments is not None:  # the split path's buffers, as the kernel indexes them
            d_pad = 1 << (d - 1).bit_length()
            assert softmax_segm_output.shape == (num_tokens, hq, num_par_softmax_segments, d_pad)
            assert softmax_segm_max.shape == softmax_segm_expsum.shape == (num_tokens, hq, num_par_softmax_segments)
        group = hq // hkv
        kf_all, vf_all = k.float(), v.float()
        cu = cu_seqlens_q.tolist()
        for i, length in enumerate(seqused_k.tolist()):
            for t in range(cu[i], cu[i + 1]):
                qpos = length - (cu[i + 1] - cu[i]) + (t - cu[i])  # the query's own position
                pos = torch.arange(qpos + 1)
                pages, slots = block_table[i, pos // bs].long(), pos % bs
                kt, vt = kf_all[pages, slots], vf_all[pages, slots]  # [n, Hkv, D]
                if kv_quant_mode == FakeKVQuantMode.FP8_PER_TENSOR:
                    kt, vt = kt * k_descale.reshape(-1)[0], vt * v_descale.reshape(-1)[0]
                kt = kt.to(q.dtype).float().repeat_interleave(group, dim=1)  # cast to q's type, as the kernel
                vt = vt.to(q.dtype).float().repeat_interleave(group, dim=1)
                s = softmax_scale * torch.einsum("hd,nhd->hn", q[t].float(), kt)
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if window_size[0] >= 0:
                    s[:, (qpos - pos) >= window_size[0] + 1] = float("-inf")
                if sinks is not None:
                    p = torch.softmax(torch.cat([s, sinks.float()[:, None]], dim=1), dim=1)[:, :-1]
                else:
                    p = torch.softmax(s, dim=1)
                out[t] = torch.einsum("hn,nhd->hd", p, vt).to(out.dtype)

    return unified_attention


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake ``vllm`` in ``sys.modules`` (kernel + KVQuantMode), on a machine treated as CPU-only
    with the Triton interpreter on (where fp8kv's capability table lets the "vllm" backend run)."""
    calls: list[dict] = []
    pkg = types.ModuleType("vllm")
    pkg.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    pkg.__path__ = []
    pkg.__version__ = "fake-1.0"
    kernel = types.ModuleType(vb._KERNEL_MODULE)
    kernel.unified_attention = _fake_unified_attention(calls)
    iface = types.ModuleType(vb._QUANT_MODE_MODULE)
    iface.KVQuantMode = FakeKVQuantMode
    for name, module in (("vllm", pkg), (vb._KERNEL_MODULE, kernel), (vb._QUANT_MODE_MODULE, iface)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(C, "current_arch", lambda device=None: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    return types.SimpleNamespace(calls=calls)


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM not installed, on a CPU machine with the Triton interpreter on."""
    monkeypatch.setattr(C, "vllm_installed", lambda: False)
    monkeypatch.setattr(vb, "vllm_installed", lambda: False)
    monkeypatch.setattr(C, "current_arch", lambda device=None: None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _cache(lens=(1, 37, 70), hkv=2, d=64, kv_dtype="fp8_e4m3", block_size=16, layout="NHD", granularity="tensor",
           v_gain=5.0, seed=0):
    """Ragged sequences in shuffled pages; V five times larger than K so k and v scales differ."""
    return make_cache(lens, hkv, d, kv_dtype=kv_dtype, granularity=granularity, block_size=block_size,
                      layout=layout, seed=seed, v_head_gain=[v_gain] * hkv)


def _query(cache, hq=6, dtype=torch.float16, seed=1):
    return make_q(cache.batch_size, hq, cache.head_dim, dtype, seed, device="cpu")


# ---------------------------------------------------------------------------------------- capability
def test_not_installed_is_refused_with_the_reason(no_vllm):
    ok, why = check("vllm", "fp8_e4m3")
    assert not ok and why == VLLM_NOT_INSTALLED and "pip install vllm" in why
    cache = _cache()
    with pytest.raises(UnsupportedError, match="vLLM is not installed"):
        fp8kv.decode(_query(cache), cache, "vllm")
    with pytest.raises(UnsupportedError, match="vLLM is not installed"):
        vb.VllmDecode(cache, num_q_heads=6, trusted=True)  # the import itself refuses


def test_not_installed_on_a_gpu(monkeypatch):
    monkeypatch.setattr(C, "vllm_installed", lambda: False)
    monkeypatch.setattr(C, "current_arch", lambda device=None: "sm90")
    assert check("vllm", "bf16", head_dim=128) == (False, VLLM_NOT_INSTALLED)
    monkeypatch.setattr(C, "vllm_installed", lambda: True)
    ok, why = check("vllm", "bf16", head_dim=128)
    assert ok and "no LSE" in why


def test_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setattr(C, "current_arch", lambda device=None: None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ok, why = check("vllm", "bf16")
    assert not ok and why.startswith("no GPU") and "TRITON_INTERPRET=1" in why


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_facts(arch):
    n = int(arch[2:])
    for kv in KV_DTYPE_NAMES:
        ok, why = check("vllm", kv, "dequant", arch, head_dim=128)
        assert ok == (kv != "fp8_e4m3" or n >= 89), (kv, why)
        if not ok:
            assert "fp8e4nv" in why and "sm89" in why
        assert "no LSE" in why or not ok
    ok, why = check("vllm", "fp8_e4m3", "dequant", "sm75")
    assert not ok and "predates sm80" in why


def test_hnd_layout_is_refused(fake_vllm):
    ok, why = check("vllm", "bf16", "dequant", "sm90", layout="HND")
    assert not ok and "NHD" in why and "HND" in why
    cache = _cache(kv_dtype="fp16", layout="HND")
    with pytest.raises(UnsupportedError, match="NHD"):
        fp8kv.decode(_query(cache), cache, "vllm")
    with pytest.raises(UnsupportedError, match="NHD"):
        vb.kernel_args(cache, 6)
    assert not fake_vllm.calls


@pytest.mark.parametrize("head_dim", [32, 48, 72, 192, 512])
def test_head_dims_outside_the_measured_ones_are_refused(head_dim):
    ok, why = check("vllm", "bf16", "dequant", "sm90", head_dim=head_dim)
    assert not ok and f"not {head_dim}" in why and str(VLLM_HEAD_DIMS) in why


def test_the_measured_head_dims_run():
    assert VLLM_HEAD_DIMS == (64, 80, 96, 112, 128, 256)
    for d in VLLM_HEAD_DIMS:
        assert check("vllm", "fp8_e4m3", "dequant", "sm90", head_dim=d)[0]


def test_an_unmeasured_head_dim_is_refused_before_any_launch(fake_vllm):
    cache = _cache(d=48)
    with pytest.raises(UnsupportedError, match="checked against the oracle"):
        fp8kv.decode(_query(cache), cache, "vllm")
    assert not fake_vllm.calls


@pytest.mark.parametrize("granularity", ["head", "channel", "token_head"])
def test_per_tensor_scales_only(granularity, fake_vllm):
    ok, why = check("vllm", "fp8_e4m3", "dequant", "sm90", granularity=granularity, head_dim=64)
    assert not ok and "per-tensor scales only" in why and granularity in why
    # what vLLM's kernel itself reads is said apart from what fp8kv passes it
    assert ("FP8_PER_TOKEN_HEAD reads token_head scales too" in why) == (granularity == "token_head")
    table = fp8kv.capability("sm90")
    row = table[(table.backend == "vllm") & (table.kv_dtype == "fp8_e4m3") & (table["mode"] == "dequant")]
    assert row["granularities"].item() == "tensor"
    cache = _cache(granularity=granularity)
    with pytest.raises(UnsupportedError, match="per-tensor"):
        fp8kv.decode(_query(cache), cache, "vllm")
    with pytest.raises(UnsupportedError, match="one k and one v scale"):
        vb.kernel_args(cache, 6)
    assert not fake_vllm.calls


def test_fp8_mode_is_refused(fake_vllm):
    for arch in ARCHS:
        ok, why = check("vllm", "fp8_e5m2", "fp8", arch, head_dim=64)
        assert not ok and ("no query scale" in why or "predates" in why)
    cache = _cache()
    with pytest.raises(UnsupportedError, match="no query scale"):
        fp8kv.decode(_query(cache), cache, "vllm", "fp8")
    with pytest.raises(UnsupportedError, match="dequant mode only"):
        vb.decode(_query(cache), cache, mode="fp8")
    assert not fake_vllm.calls


def test_auto_never_picks_vllm(monkeypatch):
    for arch in ARCHS:
        for kv in KV_DTYPE_NAMES:
            try:
                assert choose_backend(kv, "dequant", arch, head_dim=128) != "vllm"
            except UnsupportedError:
                pass
    # even where every other backend is refused, the search does not fall back to vLLM
    real = C.check
    monkeypatch.setattr(C, "check", lambda b, *a, **k: real(b, *a, **k) if b == "vllm" else (False, "off"))
    with pytest.raises(UnsupportedError, match="no backend runs") as e:
        choose_backend("bf16", "dequant", "sm90", head_dim=128)
    assert "vllm" not in str(e.value)


def test_query_pairing():
    for q, kv in (("fp16", "bf16"), ("bf16", "fp16")):
        ok, why = check_query("vllm", q, kv)
        assert not ok and f"q is {q}" in why and "casts the pages" in why
    assert not check_query("vllm", "fp32", "fp8_e4m3")[0]
    for q, kv in (("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8_e4m3"), ("fp16", "fp8_e5m2")):
        assert check_query("vllm", q, kv) == (True, "")


def test_variants_table():
    for v in ("window", "soft_cap", "sinks"):
        ok, why = check_variant("vllm", v, "dequant")
        assert ok and why
    t = variants()
    rows = t[t.backend == "vllm"]
    assert set(rows["mode"]) == {"dequant"} and len(rows) == 3 and rows.supported.all()
    assert "window_size=(window - 1, 0)" in check_variant("vllm", "window")[1]


def test_launch_options_and_registry():
    assert backends.LAUNCH_OPTIONS["vllm"] == ()
    assert "vllm" in backends.BACKENDS and "vllm" in C.BACKEND_NAMES


# ------------------------------------------------------------------------------- argument translation
def test_kernel_args_name_the_cache_exactly():
    cache = _cache(lens=(5, 40, 64), kv_dtype="fp8_e4m3")  # 4 blocks of 16 per row: whole tiles of 32
    window, sinks = 7, torch.randn(6)
    a = vb.kernel_args(cache, 6, sm_scale=0.25, window=window, soft_cap=30.0, sinks=sinks)
    assert a["k"] is cache.k_pages and a["v"] is cache.v_pages
    assert a["k"].dtype == torch.float8_e4m3fn and a["k"].shape == (cache.num_blocks, 16, 2, 64)
    assert a["k"].stride() == cache.k_pages.stride() and a["v"].stride() == cache.v_pages.stride()
    assert a["seqused_k"] is cache.seq_lens and torch.equal(a["block_table"], cache.block_table)
    assert a["block_table"].data_ptr() != cache.block_table.data_ptr()  # the plan holds the table as planned
    assert a["cu_seqlens_q"].dtype == torch.int32 and a["cu_seqlens_q"].tolist() == [0, 1, 2, 3]
    assert a["max_seqlen_q"] == 1 and a["max_seqlen_k"] == 4 * 16
    assert a["softmax_scale"] == 0.25 and a["causal"] is True and a["q_descale"] is None
    assert a["window_size"] == (window - 1, 0) and a["softcap"] == 30.0 and a["sinks"] is sinks
    assert a["kv_quant_mode"] == "FP8_PER_TENSOR"
    for name, scale in (("k_descale", cache.k_scale), ("v_descale", cache.v_scale)):
        # views of the cache's own scales: refilled scales are read when the kernel runs
        assert a[name].shape == (1,) and a[name].data_ptr() == scale.data_ptr() and float(a[name]) == float(scale)
    assert float(a["k_descale"]) != float(a["v_descale"])


def test_kernel_args_defaults_and_16_bit_caches():
    cache = _cache(kv_dtype="bf16", d=128)
    a = vb.kernel_args(cache, 4)
    assert a["kv_quant_mode"] == "NONE" and a["k"].dtype == torch.bfloat16
    assert a["softmax_scale"] == pytest.approx(1 / math.sqrt(128)) and a["window_size"] == (-1, -1)
    assert a["softcap"] == 0.0 and a["sinks"] is None
    with pytest.raises(ValueError, match="num_q_heads=5 is not a multiple"):
        vb.kernel_args(cache, 5)
    with pytest.raises(TypeError, match="PagedKVCache"):
        vb.kernel_args("cache", 4)


def test_window_of_one_keeps_the_query_only():
    assert vb.kernel_args(_cache(), 6, window=1)["window_size"] == (0, 0)


@pytest.mark.parametrize("hkv, batch, segments", [(2, 3, 16), (2, 64, 16), (2, 65, 1), (8, 16, 16), (8, 17, 1),
                                                  (1, 128, 16), (1, 129, 1)])
def test_split_path_follows_vllms_threshold(hkv, batch, segments, monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert vb.split_segments(batch, hkv) == segments
    info = vb.launch_info(batch, hkv)
    assert info["num_splits"] == segments and info["kernel"] == ("vllm-3d" if segments > 1 else "vllm-2d")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert vb.split_segments(batch, hkv) == 1


def test_split_buffers():
    cache = _cache(lens=(3, 9), hkv=2, d=64)
    a = vb.kernel_args(cache, 6)
    assert a["num_par_softmax_segments"] == 16 and a["seq_threshold_3D"] == 128 // 2
    assert a["softmax_segm_output"].shape == (2, 6, 16, 64) and a["softmax_segm_output"].dtype == torch.float32
    assert a["softmax_segm_max"].shape == a["softmax_segm_expsum"].shape == (2, 6, 16)
    cache = _cache(lens=(3, 9), hkv=2, d=64, kv_dtype="fp16")
    big = vb.kernel_args(PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table.repeat(40, 1),
                                      cache.seq_lens.repeat(40), kv_dtype="fp16"), 6)
    assert "num_par_softmax_segments" not in big and "softmax_segm_output" not in big  # 80 > 64: the 2D path


@pytest.mark.parametrize("lens, block_size, width", [((5, 40, 48), 16, 4), ((5, 9), 8, 4), ((5, 33), 8, 8),
                                                     ((5, 40, 64), 16, 4), ((70,), 32, 3)])
def test_block_table_padded_where_a_tile_reaches_past_it(lens, block_size, width):
    cache = _cache(lens=lens, block_size=block_size)
    table = vb.kernel_args(cache, 6)["block_table"]
    assert table.shape == (len(lens), width) and table.dtype == torch.int32
    blocks = cache.max_blocks_per_seq
    assert torch.equal(table[:, :blocks], cache.block_table)
    assert (table[:, blocks:] == 0).all()  # page 0, loaded only for masked tokens
    assert table.data_ptr() != cache.block_table.data_ptr()  # a copy, whatever the width


def test_a_window_as_long_as_the_capacity_is_the_whole_sequence():
    cache = _cache(lens=(5, 40, 64))  # capacity 64 tokens
    assert vb.kernel_args(cache, 6, window=64)["window_size"] == (-1, -1)
    assert vb.kernel_args(cache, 6, window=2**40)["window_size"] == (-1, -1)  # not a 32-bit constant
    assert vb.kernel_args(cache, 6, window=63)["window_size"] == (62, 0)


def test_fp16_query_refused_where_a_page_dequantizes_past_fp16(fake_vllm):
    g = seeded(0)
    k = torch.randn(1, 20, 2, 64, generator=g) * 25000  # amax scale ~ 250: e4m3's 448 x 250 > 65504
    cache = PagedKVCache.from_dense(k, torch.randn(1, 20, 2, 64, generator=g), [20], block_size=16,
                                    kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="k_scale/v_scale.*fp16 ends at 65504"):
        fp8kv.decode(_query(cache), cache, "vllm")
    assert not fake_vllm.calls
    ok = _cache()  # scales of randn data: every dequantized value inside fp16
    assert fp8kv.decode(_query(ok), ok, "vllm")[1] is None


@pytest.mark.skipif(not REAL_VLLM, reason="vllm is not importable (put the kernel's shim on PYTHONPATH to run it)")
def test_bf16_query_refused_where_the_interpreter_would_run_the_real_kernel():
    if torch.cuda.is_available():
        pytest.skip("a CPU-only check")
    cache = _cache()
    with pytest.raises(UnsupportedError, match="bf16 arithmetic is wrong"):
        fp8kv.decode(_query(cache, dtype=torch.bfloat16), cache, "vllm")


def test_empty_sequence_is_refused(fake_vllm):
    cache = _cache(lens=(0, 20))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=0"):
        vb.VllmDecode(cache, num_q_heads=6, trusted=True)
    assert not fake_vllm.calls


# ------------------------------------------------------------------ end to end through the fake vllm
VARIANTS = [{}, {"window": 5}, {"window": 1}, {"soft_cap": 2.0}, {"sinks": "random"}, {"sm_scale": 0.3},
            {"window": 20, "soft_cap": 3.0, "sinks": "random"}]


@pytest.mark.parametrize("kv_dtype, q_dtype", [("fp8_e4m3", torch.float16), ("fp8_e5m2", torch.bfloat16),
                                               ("fp16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "plain")
def test_decode_matches_the_oracle(kv_dtype, q_dtype, kw, fake_vllm, assert_rel_err):
    cache = _cache(kv_dtype=kv_dtype)
    q = _query(cache, dtype=q_dtype)
    if kw.get("sinks") == "random":
        kw = {**kw, "sinks": torch.randn(6, generator=seeded(5)) * 2}
    out, lse = fp8kv.decode(q, cache, "vllm", **kw)
    assert lse is None and out.dtype == q_dtype and out.shape == q.shape
    ref, _ = fp8kv.reference.decode(q, cache, **kw)
    assert_rel_err(out.float(), ref, output_tolerance("vllm", "dequant", q_dtype), f"vllm {kv_dtype} {kw}")
    (call,) = fake_vllm.calls
    assert call["kv_quant_mode"] == (FakeKVQuantMode.FP8_PER_TENSOR if cache.is_fp8 else FakeKVQuantMode.NONE)
    assert call["num_par_softmax_segments"] == 16  # 3 sequences over 2 KV heads: the split path


def test_the_2d_path_and_padded_tables(fake_vllm, monkeypatch, assert_rel_err):
    monkeypatch.setattr(vb, "MIN_LAUNCH_GRID_SIZE_2D", 0)  # every batch above the threshold
    cache = _cache(lens=(3, 11, 21), block_size=8)
    q = _query(cache)
    out, _ = fp8kv.decode(q, cache, "vllm", window=9)
    ref, _ = fp8kv.reference.decode(q, cache, window=9)
    assert_rel_err(out.float(), ref, output_tolerance("vllm", "dequant", q.dtype), "2D, block 8")
    assert fake_vllm.calls[0]["num_par_softmax_segments"] is None
    assert fake_vllm.calls[0]["block_table"].shape[1] == 4  # 3 blocks of 8 padded to whole tiles of 32


def test_mqa_and_large_groups(fake_vllm, assert_rel_err):
    cache = _cache(lens=(17, 50), hkv=1, d=128)
    q = _query(cache, hq=71)
    out, _ = fp8kv.decode(q, cache, "vllm")
    ref, _ = fp8kv.reference.decode(q, cache)
    assert_rel_err(out.float(), ref, output_tolerance("vllm", "dequant", q.dtype), "71/1/128")


def test_planned_reads_refilled_inputs(fake_vllm, assert_rel_err):
    cache = _cache()
    q = _query(cache)
    call = backends.planned(q, cache, "vllm", window=12)
    assert call()[1] is None
    q.copy_(_query(cache, seed=9))
    out, _ = call()
    ref, _ = fp8kv.reference.decode(q, cache, window=12)
    assert_rel_err(out.float(), ref, output_tolerance("vllm", "dequant", q.dtype), "planned, q refilled")
    assert len({id(c["cu_seqlens_q"]) for c in fake_vllm.calls}) == 1  # arguments built once, at plan time


def test_planned_refuses_tables_and_scales_changed_after_planning(fake_vllm):
    """The plan holds a copy of the block table and read the scales' range: a run after either was written in
    place (their version counters: metadata, no host sync) is refused by name, not run on the copy; lengths,
    read by the kernel, may change."""
    cache = _cache(lens=(20, 37, 70))
    q = _query(cache)
    call = backends.planned(q, cache, "vllm")
    cache.seq_lens.sub_(1)
    call()
    cache.block_table[[0, 1]] = cache.block_table[[1, 0]].clone()  # rows swapped in place
    with pytest.raises(ValueError, match=r"cache.block_table was written in place after planning.*vLLM's plan.*plan "
                                         "again"):
        call()
    call = backends.planned(q, cache, "vllm")
    cache.k_scale = cache.k_scale.clone()
    with pytest.raises(ValueError, match=r"cache.k_scale was replaced after planning"):
        call()


def test_vllm_decode_checks_what_it_is_given(fake_vllm):
    cache = _cache(kv_dtype="fp16")
    dec = vb.VllmDecode(cache, num_q_heads=6)
    with pytest.raises(ValueError, match=r"q must be \[3, 6, 64\]"):
        dec.run(torch.zeros(3, 4, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match="q is bf16"):
        dec.run(torch.zeros(3, 6, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        dec.run(torch.zeros(3, 64, 6, dtype=torch.float16).transpose(1, 2))
    out, lse = dec(_query(cache))
    assert lse is None and out.shape == (3, 6, 64)
    with pytest.raises(UnsupportedError, match="checked against the oracle"):
        vb.VllmDecode(_cache(d=48), num_q_heads=6)  # an untrusted decoder asks the capability table


def test_decode_validates_the_tables_every_call(fake_vllm):
    cache = _cache()
    cache.block_table[2, 1] = cache.num_blocks + 5  # vLLM's kernel would read it unclamped
    with pytest.raises(ValueError, match=r"block_table\[2, 1\]"):
        fp8kv.decode(_query(cache), cache, "vllm", check=False)
    assert not fake_vllm.calls


def test_a_wrong_mapping_fails(fake_vllm, monkeypatch):
    """The comparison can fail: the window passed one token too wide misses the oracle."""
    real = vb.kernel_args

    def off_by_one(*a, **kw):
        args = real(*a, **kw)
        w = args["window_size"][0]
        return {**args, "window_size": (w + 1, 0) if w >= 0 else (-1, -1)}

    monkeypatch.setattr(vb, "kernel_args", off_by_one)
    cache = _cache()
    q = _query(cache)
    out, _ = fp8kv.decode(q, cache, "vllm", window=5)
    ref, _ = fp8kv.reference.decode(q, cache, window=5)
    assert relative_error(out.float(), ref) > 10 * output_tolerance("vllm", "dequant", q.dtype)


def test_backend_matrix_judges_the_output_without_an_lse(fake_vllm):
    from fp8kv.matrix import backend_matrix

    t = backend_matrix(backends=["vllm"], heads=(4, 2), head_dim=64, batch=3, max_len=40, block_size=16,
                       granularities=["tensor", "head"])
    ran = t[t.status != "unsupported"]
    assert len(ran) == 4 and (ran.status == "passed").all(), ran[["kv_dtype", "status", "error"]].to_string()
    assert ran.lse_err.isna().all() and ran.lse_tol.isna().all() and ran.reason.str.contains("no LSE").all()
    refused = t[t.status == "unsupported"]
    assert set(zip(refused.granularity, refused["mode"], strict=True)) >= {("head", "dequant"), ("tensor", "fp8")}


# ------------------------------------------------------------------------------------------ the bench
def test_bench_rows_run_checked_and_name_the_version(fake_vllm):
    cases = sweep([2], [40], shapes=[(4, 2, 64), (4, 2, 48)], kv_dtypes=["fp16", "fp8_e4m3"], modes=["dequant"],
                  backends=["vllm"], memory_budget_bytes=2**40, device="cpu")
    assert [c.label for c in cases] == ["vllm fp16 dequant", "vllm fp8_e4m3 dequant"] * 2
    df = run(cases, copy_bandwidth=False, progress=False, device="cpu", cpu_reps=1)
    ok = df[df.head_dim == 64]
    assert (ok.status == "ok").all() and ok.check_passed.eq(True).all(), ok[["label", "reason"]].to_string()
    assert (ok.kernel == "vllm-3d").all() and (ok.num_splits == 16).all() and ok.tensor_cores.eq(True).all()
    assert (ok.tol == output_tolerance("vllm", "dequant", "fp16")).all()
    assert (df.vllm == "fake-1.0").all()
    refused = df[df.head_dim == 48]
    assert (refused.status == "unsupported").all() and refused.reason.str.contains("checked against the oracle").all()


def test_bench_rows_without_vllm_are_not_run_with_the_reason(no_vllm):
    cases = sweep([2], [40], shapes=[(4, 2, 64)], kv_dtypes=["fp8_e4m3"], modes=["dequant"],
                  backends=["triton", "vllm"], memory_budget_bytes=2**40, device="cpu")
    (vc,) = [c for c in cases if c.backend == "vllm"]
    assert vc.status == "unsupported" and vc.reason == VLLM_NOT_INSTALLED
    df = run([vc], copy_bandwidth=False, progress=False, device="cpu")
    assert df.status.tolist() == ["unsupported"] and df.reason.tolist() == [VLLM_NOT_INSTALLED]


def test_presets_put_vllm_beside_flashinfer():
    from fp8kv.bench import PRESET_HELP, PRESETS

    for name in ("layouts", "latency", "gluon"):
        assert "vllm" in PRESETS[name]["backends"] and "vLLM" in PRESET_HELP[name]


def _row(backend, kv, us, label=None, **kw):
    return dict(num_q_heads=32, num_kv_heads=8, head_dim=128, batch=64, context=4096, backend=backend,
                label=label or f"{backend} {kv} dequant", kv_dtype=kv, time_us=us, kv_bytes=1e9, copy_gbps=4000.0,
                status="ok", check_passed=True, block_size=16, layout="NHD", q_dtype="bf16", window=None,
                granularity="tensor", **kw)


def test_layout_table_counts_vllm_as_a_peer():
    df = pd.DataFrame([_row("triton", "bf16", 260.0), _row("triton", "fp8_e4m3", 180.0),
                       _row("flashinfer", "bf16", 255.0, "flashinfer-tc bf16 dequant"),
                       _row("vllm", "fp8_e4m3", 240.0), _row("vllm", "bf16", 300.0)])
    t = layout_table(df)
    assert t.loc[0, "peer"] == "vllm fp8_e4m3 dequant" and t.loc[0, "peer_us"] == 240.0
    assert t.loc[0, "fp8_x_peer"] == pytest.approx(240 / 180)
    assert "240.0 (vLLM fp8_e4m3 dequant)" in layout_markdown(t)
    df.loc[df.backend == "vllm", "check_passed"] = False  # a peer that missed the oracle is no peer
    t = layout_table(df)
    assert t.loc[0, "peer"] == "flashinfer-tc bf16 dequant"
    assert "255.0 (FlashInfer tc bf16 dequant)" in layout_markdown(t)


def test_describe_device_records_the_vllm_version(fake_vllm):
    from fp8kv.device import describe_device

    assert describe_device("cpu")["vllm"] == "fake-1.0"


# ------------------------------------------------------- the real kernel, where vllm imports (optional)
@pytest.mark.skipif(not REAL_VLLM, reason="vllm is not importable (put the kernel's shim on PYTHONPATH to run it)")
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("two_d", [False, True], ids=["3d", "2d"])
def test_real_kernel_under_the_interpreter(kv_dtype, two_d, monkeypatch, assert_rel_err):
    from fp8kv.capability import interpreter_on

    if torch.cuda.is_available() or not interpreter_on():
        pytest.skip("runs the real kernel on CPU under the Triton interpreter")
    if two_d:
        monkeypatch.setattr(vb, "MIN_LAUNCH_GRID_SIZE_2D", 0)
    cache = _cache(lens=(1, 37, 70), kv_dtype=kv_dtype)
    q = _query(cache)  # fp16: the interpreter's bf16 arithmetic is wrong
    sinks = torch.randn(6, generator=seeded(5))
    for kw in ({}, {"window": 5}, {"soft_cap": 2.0, "sinks": sinks}):
        out, lse = fp8kv.decode(q, cache, "vllm", **kw)
        ref, _ = fp8kv.reference.decode(q, cache, **kw)
        assert lse is None
        assert_rel_err(out.float(), ref, output_tolerance("vllm", "dequant", q.dtype), f"{kv_dtype} {kw}")


@pytest.mark.skipif(not REAL_VLLM, reason="vllm is not importable (put the kernel's shim on PYTHONPATH to run it)")
@pytest.mark.parametrize("head_dim", [80, 96])
def test_real_kernel_pads_a_head_dim_that_is_not_a_power_of_two(head_dim, assert_rel_err):
    from fp8kv.capability import interpreter_on

    if torch.cuda.is_available() or not interpreter_on():
        pytest.skip("runs the real kernel on CPU under the Triton interpreter")
    cache = _cache(lens=(1, 37, 70), d=head_dim)
    q = _query(cache)
    out, lse = fp8kv.decode(q, cache, "vllm")
    ref, _ = fp8kv.reference.decode(q, cache)
    assert lse is None and out.shape == (3, 6, head_dim)
    assert_rel_err(out.float(), ref, output_tolerance("vllm", "dequant", q.dtype), f"D={head_dim}")


# ------------------------------------------------------------------------- arguments before the install
@pytest.mark.parametrize("kw, exc, match", [
    (dict(num_q_heads="x"), TypeError, r"num_q_heads='x' \(str\)"),
    (dict(num_q_heads=3), ValueError, "num_q_heads=3 is not a multiple of the cache's 2 KV heads"),
    (dict(num_q_heads=0), ValueError, "num_q_heads=0"),
    (dict(num_q_heads=6, sm_scale=-1), ValueError, "sm_scale=-1"),
    (dict(num_q_heads=6, window=0), ValueError, "window=0"),
    (dict(num_q_heads=6, soft_cap=float("nan")), ValueError, "soft_cap"),
    (dict(num_q_heads=6, sinks=torch.zeros(4)), ValueError, "sinks"),
    (dict(num_q_heads=6, trusted="no"), TypeError, r"trusted='no' \(str\); expected True or False"),
    (dict(num_q_heads=6, trusted=1), TypeError, "trusted=1"),
])
def test_arguments_are_checked_before_vllm_is_required(kw, exc, match, no_vllm):
    """Without vLLM every call used to say only "vLLM is not installed" (and trusted="no" was taken as True)."""
    with pytest.raises(exc, match=match):
        vb.VllmDecode(_cache(), **kw)
    with pytest.raises(UnsupportedError, match="vLLM is not installed"):  # good arguments: then the install
        vb.VllmDecode(_cache(), num_q_heads=6)


def test_arguments_are_checked_with_vllm_too(fake_vllm):
    with pytest.raises(TypeError, match="trusted='no'"):
        vb.VllmDecode(_cache(), num_q_heads=6, trusted="no")
    with pytest.raises(ValueError, match="num_q_heads=5"):
        vb.VllmDecode(_cache(), num_q_heads=5, trusted=True)
    assert not fake_vllm.calls


@pytest.mark.parametrize("batch, hkv, exc, match", [(1, 0, ValueError, "num_kv_heads=0"),
                                                    (0, 2, ValueError, "batch=0"), (-5, 2, ValueError, "batch=-5"),
                                                    (2.0, 2, TypeError, r"batch=2.0 \(float\)"),
                                                    (2, True, TypeError, "num_kv_heads=True")])
def test_split_segments_checks_its_arguments(batch, hkv, exc, match):
    with pytest.raises(exc, match=match):
        vb.split_segments(batch, hkv)
    with pytest.raises(exc, match=match):
        vb.launch_info(batch, hkv)
