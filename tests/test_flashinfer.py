"""fp8kv.backends.flashinfer on CPU: page-table translation, exact scale folding, refusals.

FlashInfer's kernels need a CUDA GPU (tests/test_gpu_crosscheck.py runs them); everything that
decides *what* FlashInfer is given is pure torch and is checked here.
"""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch
from fixtures import seeded

import fp8kv
from fp8kv import reference
from fp8kv.backends import flashinfer as fib
from fp8kv.backends import flashinfer_args as fia
from fp8kv.backends import flashinfer_decode as fid
from fp8kv.backends import flashinfer_scales as fis
from fp8kv.cache import PagedKVCache
from fp8kv.capability import UnsupportedError, capability, check, current_arch, flashinfer_installed
from fp8kv.quant import relative_error as rel_err

# This module's K/V: head_dim 16, magnitudes differing per head (and in a few channels), so the
# scales differ for real.
SPREAD = dict(head_dim=16, k_head_gain=2.0, v_head_gain=0.5, k_outlier_channels=slice(None, None, 5),
              k_outlier_gain=6.0)


@pytest.fixture(name="make_cache")
def _spread_cache(make_cache):
    """The shared cache factory (conftest) with this module's :data:`SPREAD`."""
    return functools.partial(make_cache, **SPREAD)


def codes_cache(cache: PagedKVCache) -> PagedKVCache:
    """The same pages read with unit scales: gather() then returns the raw FP8 codes as fp32."""
    ones = torch.ones(cache.scale_shape())
    return PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table, cache.seq_lens, cache.kv_dtype,
                        cache.granularity, ones, ones, cache.layout)


# ------------------------------------------------------------------------------------ paged_kv_args
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_kv_args_hand_built(layout, make_cache):
    # lengths: one token, exactly one block, a non-multiple, empty, one past a block boundary
    lens = [1, 16, 37, 0, 33]
    cache = make_cache(lens, block_size=16, layout=layout, seed=3)
    bt = cache.block_table
    indptr, indices, last = fib.paged_kv_args(cache)
    for t in (indptr, indices, last):
        assert t.dtype == torch.int32 and t.device == cache.device
    assert indptr.tolist() == [0, 1, 2, 5, 5, 8]
    assert last.tolist() == [1, 16, 5, 0, 1]
    expected = [bt[0, 0], bt[1, 0], bt[2, 0], bt[2, 1], bt[2, 2], bt[4, 0], bt[4, 1], bt[4, 2]]
    assert indices.tolist() == [int(x) for x in expected]
    # pages are shuffled, so the table is not the identity: the test would catch an arange
    assert indices.tolist() != sorted(indices.tolist())


def test_paged_kv_args_address_the_right_tokens(make_cache):
    """Reading pages through (indptr, indices, last_page_len) the way FlashInfer does gives gather()."""
    lens = [5, 32, 47, 1]
    cache = make_cache(lens, block_size=16, kv_dtype="bf16", seed=7)
    indptr, indices, last = fib.paged_kv_args(cache)
    bs = cache.block_size
    # FlashInfer's length formula (page.cuh get_length / flashinfer.get_seq_lens)
    got_lens = (indptr[1:] - indptr[:-1] - 1).clamp(min=0) * bs + last
    assert got_lens.tolist() == lens
    for i, n in enumerate(lens):
        pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
        k = cache.k_pages[pages].reshape(-1, cache.num_kv_heads, cache.head_dim)[:n].float()
        k_ref, _ = cache.gather(i)
        assert torch.equal(k, k_ref), f"sequence {i}"


def test_qo_indptr():
    assert fib.qo_indptr([3, 0, 5]).tolist() == [0, 3, 3, 8]
    with pytest.raises(ValueError, match="qo_lens\\[1\\]=-2"):
        fib.qo_indptr([1, -2])


# ------------------------------------------------------------------------------------- scale folding
@pytest.mark.parametrize("granularity", ["tensor", "head", "channel"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("hq_per_kv", [1, 3])
def test_fold_scales_is_exact(granularity, kv_dtype, hq_per_kv, make_cache):
    """Attention over (q_folded, codes x k_scale, codes x v_scale) x out_mult == reference.decode."""
    lens = [9, 16, 40]
    hkv, d = 2, 16
    cache = make_cache(lens, num_kv_heads=hkv, head_dim=d, kv_dtype=kv_dtype, granularity=granularity, seed=11)
    q = torch.randn(len(lens), hkv * hq_per_kv, d, generator=seeded(5))
    q_f, k_s, v_s, out_mult = fis.fold_scales(q, cache)  # fp32 q: the fold without rounding
    assert isinstance(k_s, float) and isinstance(v_s, float)
    assert q_f.dtype == torch.float32 and q_f.shape == q.shape
    if granularity == "tensor":
        assert out_mult is None and torch.equal(q_f, q)
        assert k_s == float(cache.k_scale) and v_s == float(cache.v_scale)
    else:
        assert out_mult is not None and not torch.equal(q_f, q)
    sm = 1.0 / math.sqrt(d)
    codes = codes_cache(cache)
    ref_out, ref_lse = reference.decode(q, cache)
    for i in range(len(lens)):
        kc, vc = codes.gather(i)
        o, lse = reference.attention(q_f[i], kc * k_s, vc * v_s, sm)
        if out_mult is not None:
            o = o * out_mult
        assert rel_err(o, ref_out[i]) < 2e-6, f"sequence {i}"
        assert torch.allclose(lse, ref_lse[i], rtol=0, atol=2e-5), f"sequence {i}"


def test_fold_without_scales_is_wrong(make_cache):
    """The same computation with the folding dropped is far off: the test above can fail."""
    cache = make_cache([20, 33], granularity="head", seed=2)
    q = torch.randn(2, 4, 16, generator=seeded(1))
    _, k_s, v_s, _ = fis.fold_scales(q, cache)
    codes = codes_cache(cache)
    ref_out, _ = reference.decode(q, cache)
    kc, vc = codes.gather(0)
    o, _ = reference.attention(q[0], kc * k_s, vc * v_s, 0.25)  # unfolded q, no output multiplier
    assert rel_err(o, ref_out[0]) > 0.1


def test_fold_ratio_and_shapes(make_cache):
    cache = make_cache([12], num_kv_heads=2, head_dim=16, granularity="head", seed=4)
    fold = fis.plan_scales(cache, 6)
    ks, vs = cache.k_scale, cache.v_scale
    assert fold.k_scale == float(ks.max()) and fold.v_scale == 1.0
    assert fold.q_mult.shape == (6, 1) and fold.out_mult.shape == (6, 1)
    assert float(fold.q_mult.max()) == 1.0 and float(fold.q_mult.min()) > 0
    # query heads 0-2 read KV head 0, 3-5 KV head 1 (reference.attention's h // group)
    assert torch.allclose(fold.q_mult[:, 0] * fold.k_scale, ks.repeat_interleave(3), rtol=1e-6)
    assert torch.equal(fold.out_mult[:, 0], vs.repeat_interleave(3))
    ch = fis.plan_scales(make_cache([12], granularity="channel"), 4)
    assert ch.q_mult.shape == (4, 16) and ch.out_mult.shape == (4, 16)


def test_fold_rounds_once_to_q_dtype(make_cache):
    cache = make_cache([10], granularity="head", seed=8)
    q = torch.randn(1, 2, 16, generator=seeded(3)).to(torch.bfloat16)
    q_f, *_ = fis.fold_scales(q, cache)
    fold = fis.plan_scales(cache, 2)
    assert q_f.dtype == torch.bfloat16
    assert torch.equal(q_f, (q.float() * fold.q_mult).to(torch.bfloat16))
    # one bf16 rounding: relative error at most 2^-8 per element
    exact = q.float() * fold.q_mult
    assert float(((q_f.float() - exact).abs() / exact.abs().clamp_min(1e-30)).max()) <= 2.0 ** -8


def test_sixteen_bit_cache_folds_nothing(make_cache):
    cache = make_cache([7, 3], kv_dtype="bf16")
    q = torch.randn(2, 2, 16)
    q_f, k_s, v_s, out_mult = fis.fold_scales(q, cache)
    assert (k_s, v_s, out_mult) == (1.0, 1.0, None) and q_f is q


def test_token_head_rejected_with_capability_reason(make_cache):
    cache = make_cache([5, 9], granularity="token_head")
    why = check("flashinfer", "fp8_e4m3", "dequant", "sm90", "token_head")[1]
    assert "per-token-head" in why
    with pytest.raises(UnsupportedError) as e:
        fis.fold_scales(torch.randn(2, 2, 16), cache)
    assert why in str(e.value)


def test_plan_scales_rejects_bad_heads(make_cache):
    cache = make_cache([5])
    with pytest.raises(ValueError, match="num_qo_heads=3"):
        fis.plan_scales(cache, 3)


# ------------------------------------------------------------------------------- optional import
no_gpu_flashinfer = pytest.mark.skipif(current_arch() is not None and flashinfer_installed(),
                                       reason="a GPU with FlashInfer is present: nothing is refused here")


@no_gpu_flashinfer
def test_import_without_flashinfer_and_decode_refuses(make_cache):
    mod = importlib.import_module("fp8kv.backends.flashinfer")
    assert callable(mod.decode) and callable(mod.paged_kv_args)
    cache = make_cache([4, 6])
    q = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    ok, why = check("flashinfer", cache.kv_dtype, "dequant", None, cache.granularity, cache.head_dim)
    assert not ok
    with pytest.raises(UnsupportedError) as e:  # the entry point checks capability, with the table's reason
        fp8kv.decode(q, cache, backend="flashinfer")
    assert why in str(e.value)


def test_missing_flashinfer_says_how_to_install(monkeypatch):
    monkeypatch.setattr(fia, "flashinfer_installed", lambda: False)
    with pytest.raises(UnsupportedError, match=r"FlashInfer is not installed \(pip install 'fp8kv\[gpu\]'\)"):
        fib.import_flashinfer()


def test_broken_flashinfer_install_names_its_dependencies(monkeypatch):
    monkeypatch.setattr(fia, "flashinfer_installed", lambda: True)
    monkeypatch.setattr(fia, "_MODULE", "fp8kv_test_no_such_module")
    with pytest.raises(UnsupportedError, match="apache-tvm-ffi") as e:
        fib.import_flashinfer()
    assert isinstance(e.value.__cause__, ImportError)


def test_decoder_refuses_a_cpu_cache(make_cache):
    with pytest.raises(UnsupportedError, match="CUDA tensors only"):
        fib.FlashInferDecode(make_cache([3]))


@no_gpu_flashinfer
def test_registry_reaches_the_flashinfer_entry(make_cache):
    import fp8kv

    cache = make_cache([4, 6])
    q = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="flashinfer"):
        fp8kv.decode(q, cache, backend="flashinfer")


def test_prefill_validates_before_needing_flashinfer(make_cache):
    cache = make_cache([4, 6])
    q = torch.randn(5, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"qo_lens\[0\]=5"):
        fib.prefill(q, [5, 0], cache)
    with pytest.raises(ValueError, match="sum\\(qo_lens\\) = 4"):
        fib.prefill(q, [2, 2], cache)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        fib.prefill(q.float(), [2, 3], cache)
    for kwargs, exc, words in ((dict(sm_scale=-1.0), ValueError, "sm_scale=-1.0"),
                               (dict(sm_scale=float("nan")), ValueError, "sm_scale=nan"),
                               (dict(causal="no"), TypeError, "causal='no'")):
        with pytest.raises(exc, match=words):
            fib.prefill(q, [2, 3], cache, **kwargs)
    with pytest.raises(TypeError, match=r"qo_lens\[1\]=2.7"):  # not truncated to 2
        fib.prefill(q, [2, 2.7], cache)
    bad = q.clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="q has 1 non-finite"):
        fib.prefill(bad, [2, 3], cache)
    broken = cache.clone()
    broken.block_table[1, 0] = 99
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]=99"):
        fib.prefill(q, [2, 3], broken)


# ------------------------------------------------------------------------------- capability rows
@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm89", "sm90", "sm100", "sm120"])
def test_capability_rows_for_flashinfer(arch):
    df = capability(arch)
    fi = df[df.backend == "flashinfer"].set_index(["kv_dtype", "mode"])
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        row = fi.loc[(kv, "dequant")]
        assert bool(row.supported), f"{arch} {kv} dequant: {row.reason}"
        assert row.granularities == "tensor,head,channel"
        fp8 = fi.loc[(kv, "fp8")]
        assert bool(fp8.supported) == (arch == "sm100"), f"{arch} {kv} fp8: {fp8.reason}"
        if arch != "sm100":
            assert "sm100" in fp8.reason
    for kv in ("bf16", "fp16"):
        assert bool(fi.loc[(kv, "dequant")].supported)
        assert not bool(fi.loc[(kv, "fp8")].supported)


# ------------------------------------------------------------------------- workspace growth (stand-in)
class _NeedsWorkspace:
    """A stand-in FA2 wrapper whose plan needs ``need`` bytes of float workspace (FlashInfer's message)."""

    need = 0

    def __init__(self, buf, layout, **kwargs):
        self.buf, self.planned = buf, False

    def plan(self, *args, **kwargs):
        if self.buf.numel() < self.need:
            raise RuntimeError(f"Buffer overflow when allocating memory for batch_prefill_tmp_v with size "
                               f"{self.need} and alignment 16, but only {self.buf.numel()} bytes available in "
                               "AlignedAllocator. Increase the workspace buffer size.")
        self.planned = True


def _decoder_with_stand_in(monkeypatch, need: int, use_cuda_graph: bool = False, start: int = 1024):
    """A FlashInferDecode whose FlashInfer is the stand-in above, on CPU buffers (the retry logic only)."""
    import types

    monkeypatch.setattr(_NeedsWorkspace, "need", need)
    monkeypatch.setattr(fid, "import_flashinfer",
                        lambda: types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_NeedsWorkspace))
    monkeypatch.setattr(fia, "_WORKSPACES", {})
    monkeypatch.setattr(fia, "MAX_WORKSPACE_BYTES", 64 * 1024)
    dec = object.__new__(fib.FlashInferDecode)  # no CUDA here: only the fields _plan_dequant uses
    dec.device, dec.layout, dec.use_tensor_cores, dec.use_cuda_graph = torch.device("cpu"), "NHD", True, use_cuda_graph
    dec._workspace, dec._wrapper = dec._new_wrapper(None, start)
    return dec


def test_a_planned_run_refuses_a_cache_changed_since_its_plan(monkeypatch):
    """FlashInfer's plan holds the page table, the lengths and the folded scales: run_trusted (the planned callable)
    refuses by name a cache whose arrays were written or replaced since (metadata, no host sync)."""
    dec = _decoder_with_stand_in(monkeypatch, need=0)
    cache = PagedKVCache.from_dense(torch.randn(2, 20, 2, 32), torch.randn(2, 20, 2, 32), [5, 9], max_seq_len=32)
    dec._cache_ref, dec._fold, dec.mode, dec._stamp = (lambda: cache), fis.ScaleFold(1.0, 1.0), "dequant", cache.stamp()
    monkeypatch.setattr(dec._wrapper, "run", lambda *a, **k: (torch.zeros(2, 4, 32), torch.zeros(2, 4)), raising=False)
    dec.run_trusted(torch.zeros(2, 4, 32))
    cache.append(torch.randn(2, 2, 32), torch.randn(2, 2, 32))
    with pytest.raises(ValueError, match=r"cache.seq_lens was written in place after planning.*FlashInfer's plan"):
        dec.run_trusted(torch.zeros(2, 4, 32))
    dec._stamp = cache.stamp()
    cache.k_scale.mul_(2.0)  # a per-tensor scale FlashInfer took as a float at plan time
    with pytest.raises(ValueError, match=r"cache.k_scale was written in place after planning"):
        dec.run_trusted(torch.zeros(2, 4, 32))


def test_the_workspace_doubles_until_the_plan_fits(monkeypatch):
    dec = _decoder_with_stand_in(monkeypatch, need=5000)
    dec._plan_dequant(None)
    assert dec._wrapper.planned and dec._workspace.numel() == 8192 == dec._workspace_bytes


def test_a_plan_that_never_fits_leaves_the_old_wrapper(monkeypatch):
    dec = _decoder_with_stand_in(monkeypatch, need=10**6)
    old = dec._wrapper
    with pytest.raises(RuntimeError, match="Increase the workspace buffer size"):
        dec._plan_dequant(None)
    assert dec._wrapper is old and dec._workspace.numel() == 1024  # nothing half-swapped


def test_another_buffer_short_is_not_the_float_workspace(monkeypatch):
    """FlashInfer's fixed int workspace overflows with the same words: growing the float one would not help."""
    dec = _decoder_with_stand_in(monkeypatch, need=0)

    def int_workspace_short(*args, **kwargs):
        raise RuntimeError("Buffer overflow when allocating memory for batch_prefill_tmp_s with size 9000000 and "
                           "alignment 16, but only 8388608 bytes available in AlignedAllocator. Increase the "
                           "workspace buffer size.")

    monkeypatch.setattr(dec._wrapper, "plan", int_workspace_short)
    with pytest.raises(RuntimeError, match="8388608"):
        dec._plan_dequant(None)
    assert dec._workspace.numel() == 1024


def test_a_cuda_graph_decoder_asks_for_a_larger_workspace(monkeypatch):
    dec = _decoder_with_stand_in(monkeypatch, need=5000, use_cuda_graph=False)
    dec.use_cuda_graph = True  # its buffers are fixed: a captured graph replays them
    with pytest.raises(ValueError, match="workspace_bytes=2048 or more"):
        dec._plan_dequant(None)


def test_workspace_bytes_must_be_positive(make_cache):
    with pytest.raises(ValueError, match="workspace_bytes=0"):
        fib.FlashInferDecode(make_cache([3]), workspace_bytes=0)
