"""The bench's rows of the quantized KV formats (INT8 and INT4 per token and head, NVFP4, MXFP4): their caches
(:class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` of N(0, 1) K/V, as the FP8 and BF16 rows'), the bytes a
decode reads (from :func:`fp8kv.kv_formats.kv_footprint`, the one count of a format's bytes), what runs them
(:func:`fp8kv.ops.quant_decode.plan_decode_quantized` once, then its launch, for ``triton``; its oracle for
``reference``) and the
check of every row against :func:`~fp8kv.ops.quant_decode.quantized_reference` before it is timed."""

from __future__ import annotations

import functools
import math

import torch

from ..cache.quantized import QuantizedPagedKVCache
from ..capability_formats import check_format
from ..kv_formats import kv_footprint, kv_format, quantize
from ..ops.decode import DecodePlan
from ..ops.quant_decode import (
    QUANT_DECODE_FORMATS,
    kernel_tolerance,
    plan_decode_quantized,
    quantized_reference,
    run_quant_decode,
)
from ..quant import relative_error
from ..reference import REFERENCE_TOL
from ..synthetic import CHUNK_ELEMS

__all__ = ["QUANT_KV_DTYPES", "QUANT_BACKENDS", "is_quantized", "format_bytes", "format_footprint_bytes",
           "format_support", "quantized_cache", "clone_quantized", "quantized_call", "check_quantized"]

QUANT_KV_DTYPES: tuple[str, ...] = tuple(QUANT_DECODE_FORMATS)  # the formats a bench row can time
QUANT_BACKENDS = ("triton", "reference")  # fp8kv's quantized-page kernel and its fp32 oracle


def is_quantized(kv_dtype: str) -> bool:
    """Whether ``kv_dtype`` names a quantized format the bench times (:data:`QUANT_KV_DTYPES`)."""
    return kv_dtype in QUANT_KV_DTYPES


def format_bytes(kv_dtype: str, tokens: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """``(codes, scales)`` bytes of K and V over ``tokens`` tokens: ``kv_footprint``'s codes, and its per-token
    scales plus the fixed (tensor) scales, read once per call."""
    fp = kv_footprint(kv_dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return int(fp.codes * tokens), int(fp.per_token_scales * tokens) + fp.fixed


def format_footprint_bytes(case) -> int:
    """Device bytes a quantized case needs at peak: its pages and scales, one fp32 generation chunk of K and V,
    two fp32 sequences gathered for the check, the split partials."""
    bs = case.block_size
    tokens = case.batch * math.ceil(case.context / bs) * bs
    codes, scales = format_bytes(case.kv_dtype, tokens, case.num_kv_heads, case.head_dim)
    build = 2 * min(case.context * case.num_kv_heads * case.head_dim, CHUNK_ELEMS) * 4 * 2
    check = 2 * 2 * case.context * case.num_kv_heads * case.head_dim * 4
    partials = case.batch * case.num_q_heads * 128 * (case.head_dim + 1) * 4
    return codes + scales + build + check + partials


def format_support(backend: str, kv_dtype: str, arch: str | None) -> tuple[bool, str]:
    """Whether a bench row of ``kv_dtype`` on ``backend`` runs here (or on ``arch``): the capability rows of the
    format (:func:`fp8kv.capability_formats.check_format`), and only the backends that take a quantized cache."""
    ok, why = check_format(backend, kv_dtype, arch)
    if ok and backend not in QUANT_BACKENDS:
        return False, (f"fp8kv's {backend} backend does not pass {kv_dtype} pages (the peer reads them: {why}); "
                       f"the bench times {kv_dtype} on {QUANT_BACKENDS}")
    return ok, why


def _rows(gen: torch.Generator, n: int, hkv: int, d: int, device) -> torch.Tensor:
    return torch.randn(n, hkv, d, generator=gen, device=device)


def quantized_cache(case, device: torch.device) -> QuantizedPagedKVCache:
    """The case's cache: ``batch`` sequences of ``context`` N(0, 1) tokens (K and V) in ``case.kv_dtype``, written
    a chunk at a time through the cache's own quantizing write. NVFP4's fixed tensor scales come from the first
    chunk (calibrated, as a serving cache's are); a value past them saturates and is counted."""
    hkv, d, ctx = case.num_kv_heads, case.head_dim, case.context
    gen = torch.Generator(device=device).manual_seed(case.seed)
    chunk = max(1, min(ctx, CHUNK_ELEMS // (hkv * d)))
    f = kv_format(case.kv_dtype)
    scales = {}
    if f.key.tensor_scale:
        first = _rows(torch.Generator(device=device).manual_seed(case.seed), chunk, hkv, d, device)
        scales = {"k_tensor_scale": quantize(first, f.key).tensor_scale,
                  "v_tensor_scale": quantize(first, f.value).tensor_scale}
    cache = QuantizedPagedKVCache.empty(f, case.batch, ctx, hkv, d, block_size=case.block_size, device=device,
                                        seed=case.seed, **scales)
    for i in range(case.batch):
        for start in range(0, ctx, chunk):
            n = min(chunk, ctx - start)
            counts = [0] * case.batch
            counts[i] = n
            cache.append_tokens(_rows(gen, n, hkv, d, device), _rows(gen, n, hkv, d, device), counts)
    return cache


def clone_quantized(cache: QuantizedPagedKVCache) -> QuantizedPagedKVCache:
    """A copy of ``cache`` in new memory (the bench cycles through copies so reads come from HBM, not L2)."""
    return QuantizedPagedKVCache(cache.fmt, cache.k_pages.clone(), cache.v_pages.clone(), cache.k_scales.clone(),
                                 cache.v_scales.clone(), cache.block_table.clone(), cache.seq_lens.clone(),
                                 k_tensor_scale=cache.k_tensor_scale, v_tensor_scale=cache.v_tensor_scale)


def quantized_call(q: torch.Tensor, cache: QuantizedPagedKVCache, backend: str, options: dict):
    """The zero-argument decode of ``q`` over ``cache`` a row times and the launch columns of its row: the
    kernel (planned once here, every argument and the tables checked; the timed call only launches; its
    ``kernel`` names the code conversion, e.g. ``triton-quantized-software``) or the oracle."""
    if backend == "reference":
        return functools.partial(quantized_reference, q, cache), {"kernel": "reference-quantized"}
    launch = plan_decode_quantized(q, cache, **options)
    if isinstance(launch, DecodePlan):  # the Gluon kernel (INT8 and INT4 per token and head)
        cfg = launch.config
        columns = dict(kernel="gluon-quantized", num_splits=cfg["num_splits"], block_n=cfg["block_n"],
                       num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    else:
        columns = dict(kernel=f"triton-quantized-{launch.convert}", num_splits=launch.num_splits,
                       block_n=launch.block_n, num_warps=launch.constexprs["num_warps"],
                       num_stages=launch.constexprs["num_stages"])
    return functools.partial(run_quant_decode, q, cache, launch), columns


def _subset(cache: QuantizedPagedKVCache, idx: list[int]) -> QuantizedPagedKVCache:
    """The sequences ``idx`` of ``cache`` over the same pages (tables cut, arrays shared)."""
    rows = torch.tensor(idx, device=cache.block_table.device)
    return QuantizedPagedKVCache(cache.fmt, cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales,
                                 cache.block_table[rows], cache.seq_lens[rows], k_tensor_scale=cache.k_tensor_scale,
                                 v_tensor_scale=cache.v_tensor_scale)


def check_quantized(out: torch.Tensor, q: torch.Tensor, cache: QuantizedPagedKVCache, idx: list[int],
                    backend: str) -> dict:
    """``rel_err`` of the sequences ``idx`` of ``out`` against :func:`quantized_reference` on the same pages,
    ``tol`` (the kernel's: :func:`fp8kv.ops.quant_decode.kernel_tolerance`; the oracle against itself: REFERENCE_TOL) and
    ``check_passed``."""
    sub = cache if len(idx) == cache.batch_size else _subset(cache, idx)
    ref, _ = quantized_reference(q[idx], sub)
    err = relative_error(out[idx].float(), ref)
    tol = REFERENCE_TOL if backend == "reference" else kernel_tolerance(q[idx], out.dtype, sub)
    return {"rel_err": err, "tol": tol, "check_passed": bool(err <= tol)}
