"""FlashInfer vs the fp32 reference vs fp8kv's Triton kernel, on the same FP8 paged caches (GPU).

Run: ``python -m pytest tests/test_gpu_crosscheck.py -m gpu -q -s`` (``-s`` prints the error table).
Skipped with a reason where there is no CUDA GPU or FlashInfer is not installed.

FlashInfer is the yardstick: its error against :func:`fp8kv.reference.decode` (fp32 attention over
the dequantized cache) says what a production 16-bit kernel achieves on each case, and the Triton
kernel must stay within ``max(2 x FlashInfer's error, FLOOR)``. The floor is bf16's unit roundoff,
2^-8: both kernels return a bf16 output (each element rounded with relative error up to 2^-8) and
round the probabilities to bf16 before P.V, so no 16-bit kernel is expected below it.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest
import torch

import fp8kv
from fp8kv import reference
from fp8kv.cache import PagedKVCache
from fp8kv.capability import current_arch, flashinfer_installed
from fp8kv.quant import relative_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not flashinfer_installed(), reason="FlashInfer is not installed (pip install 'fp8kv[gpu]')"),
    pytest.mark.skipif(torch.cuda.is_available() and int((current_arch() or "sm0")[2:]) < 80,
                       reason="fp8kv targets sm80 and newer"),
]

FLOOR = 2.0 ** -8  # bf16 unit roundoff: relative output error no bf16-output kernel gets below
FI_GROSS = 2.0 ** -5  # FlashInfer's own output error must stay far below O(1) (wrong scales)
# LSE errors are measured relative to the batch's largest |LSE| (see lse_err). Head / channel
# scales reach FlashInfer folded into a bf16 query (Triton folds channel scales the same way), so
# each score carries the query's rounding, relative 2^-8 per element: about 2^-9 of the largest
# LSE on these caches. A log2 / ln mix-up is off by 31-44% of it.
LSE_FLOOR = 2.0 ** -7
LSE_GROSS = 2.0 ** -4
HEAD_DIM = 128
HKV = 4
ROWS: list[dict] = []  # one row per case, printed as a table when the module finishes


rel_err = relative_error  # ||a - ref|| / ||ref|| in fp64


def lse_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |a - ref| / max(1, max |ref|)``: LSE error on the scale of the scores."""
    a64, r64 = a.detach().to(torch.float64), ref.detach().to(torch.float64)
    return float((a64 - r64).abs().max() / max(1.0, float(r64.abs().max())))


@pytest.fixture(scope="module", autouse=True)
def error_table():
    torch.manual_seed(0)
    yield
    if not ROWS:
        return
    cols = list(ROWS[0])
    width = {c: max(len(c), *(len(_fmt(r.get(c))) for r in ROWS)) for c in cols}
    print("\n\nFlashInfer / Triton vs fp8kv.reference.decode "
          f"({torch.cuda.get_device_name()}, flashinfer-jit-cache "
          f"{'present' if importlib.util.find_spec('flashinfer_jit_cache') else 'absent: kernels JIT-compiled'})")
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in ROWS:
        print("  ".join(_fmt(r.get(c)).rjust(width[c]) for c in cols))


def _fmt(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) else str(x)


# This module's K/V, drawn on the GPU: per-head (and a few outlier-channel) magnitudes.
SPREAD = dict(num_kv_heads=HKV, head_dim=HEAD_DIM, draw_device="cuda", k_head_gain=[0.5, 1.0, 2.0, 4.0],
              v_head_gain=[1.0, 0.5, 2.0, 0.25], k_outlier_channels=slice(7, None, 32), k_outlier_gain=8.0)
# Scales: amax for e4m3; the engines' presets (amax/200 for K, amax/100 for V) for e5m2, whose amax
# scaling puts codes near 57344, where FlashInfer's tensor-core decode breaks down (see
# test_flashinfer_tensor_core_e5m2_near_max).
ENGINE_SCALES = {"fp8_e5m2": dict(k_scale="vllm_k", v_scale="vllm_v")}


@pytest.fixture(name="make_cache")
def _spread_cache(make_cache):
    """The shared cache factory (conftest) with this module's :data:`SPREAD`, on the GPU."""
    return functools.partial(make_cache, **SPREAD)


def ragged_lens(block_size: int) -> list[int]:
    # one token, exactly one page, one past a page, a non-multiple, a long one
    return [1, block_size, block_size + 1, 3 * block_size - 5, 523]


CASES = [(kv, gran, group, bs, "NHD")
         for kv in ("fp8_e4m3", "fp8_e5m2")
         for gran in ("tensor", "head")
         for group, bs in ((1, 16), (4, 32), (8, 64))]
CASES += [("fp8_e4m3", "channel", 4, 16, "NHD"), ("fp8_e4m3", "head", 8, 16, "HND"),
          ("fp8_e5m2", "tensor", 4, 32, "HND"), ("bf16", "tensor", 4, 16, "NHD")]


@pytest.mark.parametrize("kv_dtype,granularity,group,block_size,layout", CASES)
def test_flashinfer_triton_reference(kv_dtype, granularity, group, block_size, layout, make_cache):
    lens = ragged_lens(block_size)
    cache = make_cache(lens, kv_dtype=kv_dtype, granularity=granularity, block_size=block_size, layout=layout,
                       seed=block_size + group, **ENGINE_SCALES.get(kv_dtype, {}))
    q = torch.randn(len(lens), HKV * group, HEAD_DIM, device="cuda").to(torch.bfloat16)

    out_ref, lse_ref = reference.decode(q, cache)
    out_fi, lse_fi = fp8kv.decode(q, cache, backend="flashinfer", mode="dequant")
    out_tr, lse_tr = fp8kv.decode(q, cache, backend="triton", mode="dequant")
    torch.cuda.synchronize()

    for name, o, lse in (("flashinfer", out_fi, lse_fi), ("triton", out_tr, lse_tr)):
        assert o.shape == out_ref.shape and o.dtype == torch.bfloat16, name
        assert lse.shape == lse_ref.shape and lse.dtype == torch.float32, name
        assert torch.isfinite(o).all() and torch.isfinite(lse).all(), name
    e_fi, e_tr = rel_err(out_fi, out_ref), rel_err(out_tr, out_ref)
    l_fi, l_tr = lse_err(lse_fi, lse_ref), lse_err(lse_tr, lse_ref)
    ROWS.append(dict(test="decode", kv=kv_dtype, gran=granularity, layout=layout, group=group,
                     page=block_size, fi_out=e_fi, triton_out=e_tr, fi_lse=l_fi, triton_lse=l_tr,
                     triton_bound=max(2 * e_fi, FLOOR)))

    assert e_fi <= FI_GROSS, f"FlashInfer output error {e_fi:.2e} vs the reference"
    assert l_fi <= LSE_GROSS, f"FlashInfer LSE error {l_fi:.2e} (log2 vs ln?)"
    assert e_tr <= max(2 * e_fi, FLOOR), f"Triton {e_tr:.2e} vs FlashInfer {e_fi:.2e}"
    assert l_tr <= max(2 * l_fi, LSE_FLOOR), f"Triton LSE {l_tr:.2e} vs FlashInfer {l_fi:.2e}"


def test_cuda_core_decode_path(make_cache):
    """use_tensor_cores=False runs FlashInfer's CUDA-core decode kernel: same answers."""
    from fp8kv.backends.flashinfer import decode as fi_decode

    lens = ragged_lens(16)
    cache = make_cache(lens, kv_dtype="fp8_e4m3", granularity="head", block_size=16, seed=21)
    q = torch.randn(len(lens), HKV * 4, HEAD_DIM, device="cuda").to(torch.bfloat16)
    out_ref, lse_ref = reference.decode(q, cache)
    out_tc, _ = fi_decode(q, cache, use_tensor_cores=True)
    out_cc, lse_cc = fi_decode(q, cache, use_tensor_cores=False)
    e_cc, e_tc = rel_err(out_cc, out_ref), rel_err(out_tc, out_ref)
    ROWS.append(dict(test="cuda-core", kv="fp8_e4m3", gran="head", layout="NHD", group=4, page=16,
                     fi_out=e_cc, triton_out=e_tc, fi_lse=lse_err(lse_cc, lse_ref), triton_lse="",
                     triton_bound=""))
    assert e_cc <= max(2 * e_tc, FLOOR), f"CUDA-core {e_cc:.2e} vs tensor-core {e_tc:.2e}"
    assert lse_err(lse_cc, lse_ref) <= LSE_GROSS


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_non_unit_scales_are_honoured(granularity):
    """Same FP8 codes, scales 4 / 0.25 (tensor) or per-head powers of two, vs unit scales.

    With ``K = s_k k̂`` and ``V = s_v v̂``: out(q; s) = s_v[h] * out(s_k[h] q; 1) and
    lse(q; s) = lse(s_k[h] q; 1). Powers of two keep every product exact in bf16.
    """
    lens = ragged_lens(32)
    g = torch.Generator(device="cuda").manual_seed(3)
    k = torch.randn(len(lens), max(lens), HKV, HEAD_DIM, generator=g, device="cuda")
    v = torch.randn(len(lens), max(lens), HKV, HEAD_DIM, generator=g, device="cuda")
    if granularity == "tensor":
        s_k = torch.full((HKV,), 4.0, device="cuda")
        s_v = torch.full((HKV,), 0.25, device="cuda")
        k_scale, v_scale = 4.0, 0.25
    else:
        s_k = torch.tensor([4.0, 0.5, 2.0, 1.0], device="cuda")
        s_v = torch.tensor([0.25, 2.0, 1.0, 0.5], device="cuda")
        k_scale, v_scale = s_k, s_v
    unit = PagedKVCache.from_dense(k, v, lens, block_size=32, granularity=granularity,
                                   k_scale=1.0 if granularity == "tensor" else torch.ones(HKV, device="cuda"),
                                   v_scale=1.0 if granularity == "tensor" else torch.ones(HKV, device="cuda"))
    scaled = PagedKVCache.from_dense(k * s_k[:, None], v * s_v[:, None], lens, block_size=32,
                                     granularity=granularity, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(unit.k_pages.view(torch.uint8), scaled.k_pages.view(torch.uint8))
    assert torch.equal(unit.v_pages.view(torch.uint8), scaled.v_pages.view(torch.uint8))

    group = 2
    q = torch.randn(len(lens), HKV * group, HEAD_DIM, device="cuda").to(torch.bfloat16)
    sk_q = s_k.repeat_interleave(group)[:, None]
    sv_q = s_v.repeat_interleave(group)[:, None]
    out_s, lse_s = fp8kv.decode(q, scaled, backend="flashinfer")
    out_u, lse_u = fp8kv.decode((q.float() * sk_q).to(torch.bfloat16), unit, backend="flashinfer")
    expected = out_u.float() * sv_q
    out_plain, _ = fp8kv.decode(q, unit, backend="flashinfer")
    e_scaled = rel_err(out_s, expected)
    e_ref = rel_err(out_s, reference.decode(q, scaled)[0])
    ROWS.append(dict(test="scales", kv="fp8_e4m3", gran=granularity, layout="NHD", group=group, page=32,
                     fi_out=e_scaled, triton_out="", fi_lse=lse_err(lse_s, lse_u), triton_lse="",
                     triton_bound=""))
    assert e_scaled <= FLOOR, f"scaled cache vs rescaled unit cache: {e_scaled:.2e}"
    assert lse_err(lse_s, lse_u) <= LSE_FLOOR
    assert e_ref <= FI_GROSS
    assert rel_err(out_s, out_plain) > 0.1, "the scales made no difference: they were ignored"


def _prefill_reference(q, qo_lens, cache, causal):
    """fp32 oracle for append attention: query j of sequence i sees keys < L_i - qo_i + j + 1."""
    outs, lses, row = [], [], 0
    sm = 1.0 / math.sqrt(cache.head_dim)
    for i, nq in enumerate(qo_lens):
        k, v = cache.gather(i)
        n = k.shape[0]
        for j in range(nq):
            stop = n - nq + j + 1 if causal else n
            o, lse = reference.attention(q[row + j], k[:stop], v[:stop], sm)
            outs.append(o)
            lses.append(lse)
        row += nq
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(causal, make_cache):
    from fp8kv.backends.flashinfer import prefill

    lens, qo_lens = [17, 64, 100], [1, 16, 33]
    cache = make_cache(lens, kv_dtype="fp8_e4m3", granularity="head", block_size=16, seed=5)
    q = torch.randn(sum(qo_lens), HKV * 4, HEAD_DIM, device="cuda").to(torch.bfloat16)
    out, lse = prefill(q, qo_lens, cache, causal=causal)
    out_ref, lse_ref = _prefill_reference(q, qo_lens, cache, causal)
    e, le = rel_err(out, out_ref), lse_err(lse, lse_ref)
    ROWS.append(dict(test=f"prefill causal={causal}", kv="fp8_e4m3", gran="head", layout="NHD", group=4,
                     page=16, fi_out=e, triton_out="", fi_lse=le, triton_lse="", triton_bound=""))
    assert e <= FI_GROSS and le <= LSE_GROSS
    # the last query of each sequence is that sequence's decode query
    last = torch.tensor(qo_lens).cumsum(0) - 1
    out_dec, _ = fp8kv.decode(q[last], cache, backend="flashinfer")
    if causal:
        assert rel_err(out[last], out_dec) <= FLOOR


def test_run_is_cuda_graph_capturable(make_cache):
    """plan once, capture run(q) (folding, kernel, output scaling, LSE units), replay on new queries."""
    from fp8kv.backends.flashinfer import FlashInferDecode

    lens = ragged_lens(16)
    cache = make_cache(lens, kv_dtype="fp8_e4m3", granularity="head", block_size=16, seed=9)
    dec = FlashInferDecode(cache, use_cuda_graph=True)
    dec.plan(cache, num_qo_heads=HKV * 4, q_dtype=torch.bfloat16)
    q_static = torch.randn(len(lens), HKV * 4, HEAD_DIM, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dec.run(q_static)  # warm-up outside the capture (lazy buffers, JIT)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, lse_g = dec.run(q_static)
    for seed in (1, 2):
        torch.manual_seed(seed)
        q_static.copy_(torch.randn_like(q_static, dtype=torch.float32).to(torch.bfloat16))
        graph.replay()
        out_e, lse_e = dec.run(q_static)
        out_ref, _ = reference.decode(q_static, cache)
        assert rel_err(out_g, out_e) <= 1e-6 and lse_err(lse_g, lse_e) <= 1e-6
        assert rel_err(out_g, out_ref) <= FI_GROSS
    assert dec.plan(cache, num_qo_heads=HKV * 4, q_dtype=torch.bfloat16) is False  # plan is cached
    cache.append(torch.randn(len(lens), HKV, HEAD_DIM, device="cuda"),
                 torch.randn(len(lens), HKV, HEAD_DIM, device="cuda"))
    assert dec.plan(cache, num_qo_heads=HKV * 4, q_dtype=torch.bfloat16) is True  # seq_lens changed



def _e5m2_near_max_errors(make_cache):
    """Errors of each decode on an e5m2 cache with amax scales (codes up to 57344)."""
    lens = ragged_lens(16)
    cache = make_cache(lens, kv_dtype="fp8_e5m2", granularity="tensor", block_size=16, scale="amax")
    q = torch.randn(len(lens), HKV * 4, HEAD_DIM, device="cuda").to(torch.bfloat16)
    out_ref, _ = reference.decode(q, cache)
    errs = {}
    for name, kw in (("fi_tc", dict(backend="flashinfer", use_tensor_cores=True)),
                     ("fi_cc", dict(backend="flashinfer", use_tensor_cores=False)),
                     ("triton", dict(backend="triton"))):
        out, _ = fp8kv.decode(q, cache, mode="dequant", **kw)
        errs[name] = rel_err(out, out_ref)
    return errs


def test_e5m2_near_max_cuda_core_and_triton(make_cache):
    errs = _e5m2_near_max_errors(make_cache)
    assert errs["fi_cc"] <= FI_GROSS, errs
    assert errs["triton"] <= FLOOR, errs


@pytest.mark.xfail(strict=True, reason=(
    "FlashInfer 0.6.13 tensor-core decode with e5m2 KV whose codes reach ~57344 (amax scaling): measured "
    "relative error 0.86 on an H200, against 1.7e-3 for its CUDA-core decode and for engine-style scales. "
    "Strict: this starts failing (XPASS) once FlashInfer fixes it."))
def test_flashinfer_tensor_core_e5m2_near_max(make_cache):
    assert _e5m2_near_max_errors(make_cache)["fi_tc"] <= FI_GROSS


def test_workspace_grows_for_many_heads_per_kv_head(make_cache):
    """Falcon-7B's 71 query heads on one KV head at 16k tokens need more than FlashInfer's 128 MiB
    scratch: the decoder doubles its workspace and plans again instead of failing."""
    from fp8kv.backends.flashinfer import DEFAULT_WORKSPACE_BYTES, FlashInferDecode

    cache = make_cache([16384], num_kv_heads=1, head_dim=64, k_head_gain=None, v_head_gain=None,
                       kv_dtype="fp8_e4m3", block_size=16, seed=5)
    dec = FlashInferDecode(cache, use_tensor_cores=True)
    dec.plan(cache, num_qo_heads=71, q_dtype=torch.bfloat16)
    assert dec._workspace_bytes > DEFAULT_WORKSPACE_BYTES
    q = torch.randn(1, 71, 64, device="cuda").to(torch.bfloat16)
    out, _ = dec.run(q)
    assert rel_err(out, reference.decode(q, cache)[0]) <= FI_GROSS
