"""The fp32 oracle of the quantized-page decode: a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` read back
by :func:`fp8kv.kv_formats.dequantize` (its ``gather``), then :func:`fp8kv.reference.attention`, the fp32 core
every FP8 backend is checked against. The kernel and the oracle read the same codes and scales."""

from __future__ import annotations

import torch

from ... import checks
from ...cache.quantized import QuantizedPagedKVCache
from ...reference import attention, score_bound, unit_roundoff

__all__ = ["quantized_reference", "kernel_tolerance"]


def _checked(q, cache, sm_scale) -> float:
    """The cache's type and the query against it checked; ``sm_scale`` checked (positive, finite) or the default."""
    if not isinstance(cache, QuantizedPagedKVCache):
        checks.fail(f"cache must be a fp8kv.cache.quantized.QuantizedPagedKVCache, got {type(cache).__name__}",
                    TypeError)
    cache.check_query(q)
    checks.finite_tensor(q, "q")  # as fp8kv.reference.decode refuses it
    if sm_scale is not None:
        sm_scale = checks.softmax_scale(sm_scale)
    return checks.resolved_softmax_scale(sm_scale, q.shape[-1])


def quantized_reference(q: torch.Tensor, cache: QuantizedPagedKVCache, sm_scale: float | None = None):
    """fp32 decode attention of ``q`` ``[B, Hq, D]`` (fp16 / bf16 / fp32) over ``cache``, every ``seq_lens[i] >= 1``.

    Checked: the cache's type, arrays and tables, the query against it, ``sm_scale`` (positive, finite; default
    ``1 / sqrt(D)``). Returns out ``[B, Hq, D]`` and the natural-log lse ``[B, Hq]``, both fp32, as
    :func:`fp8kv.reference.decode` defines them.
    """
    sm_scale = _checked(q, cache, sm_scale)
    cache.validate_arrays()
    cache.validate_tables(nonempty=True)
    outs, lses = [], []
    for i in range(q.shape[0]):
        k, v = cache.gather(i, check_scales=False)  # the arrays were checked above
        o, lse = attention(q[i], k, v, sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def kernel_tolerance(q: torch.Tensor, out_dtype: torch.dtype, cache: QuantizedPagedKVCache,
                     sm_scale: float | None = None) -> float:
    """Allowed ``||out - ref|| / ||ref||`` of :func:`~fp8kv.ops.quant_decode.paged_decode_quantized` against
    :func:`quantized_reference` on the same pages.

    Both read the same codes and scales, and the kernel's dot operands are exact in fp16 (INT8 codes -127..127,
    INT4 -7..7, NVFP4 code x e4m3 block scale, MXFP4 code x its block's power of two relative to the token's
    largest); per-token and tensor scales are applied in fp32, as the oracle does. What is left is fp16's rounding
    (u = 2^-11): each probability times its V scale ratio, rounded once (u); the output rounded to ``out_dtype``
    (its u); and a query of another dtype rounded to fp16, which moves each score by up to u x
    :func:`fp8kv.reference.score_bound`. The probabilities' rounding errors average out across tokens, as in
    :func:`fp8kv.reference.output_tolerance`'s dequant mode.
    """
    sm_scale = _checked(q, cache, sm_scale)
    u16 = unit_roundoff("fp16")
    tol = u16 + unit_roundoff(out_dtype)
    if q.dtype != torch.float16:
        tol += u16 * max(1.0, score_bound(q, cache, sm_scale))
    return tol
