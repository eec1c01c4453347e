"""How a cache's FP8 scales reach FlashInfer, whose run takes one scalar ``k_scale`` and ``v_scale``:
per-head and per-channel scales are folded exactly into the query and the output
(:class:`ScaleFold`, :func:`plan_scales`, :func:`apply_q_fold`). Pure torch: runs anywhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PagedKVCache
from ..capability import UnsupportedError, check

__all__ = ["ScaleFold", "plan_scales", "apply_q_fold", "fold_scales"]


@dataclass(frozen=True)
class ScaleFold:
    """How a cache's scales reach FlashInfer, which takes one scalar ``k_scale`` and ``v_scale``.

    The kernel computes ``out' = softmax(sm_scale * k_scale * q' . k_codes) @ v_codes * v_scale``;
    with ``q' = q * q_mult`` and ``out = out' * out_mult`` this equals attention over the
    dequantized cache (stored × scale, ``fp8kv.quant``):

    * tensor: ``k_scale``/``v_scale`` are the cache's scalars; nothing is folded.
    * head ``[Hkv]``: ``q · (s_k[h] k̂) = (s_k[h] q) · k̂``, so query head ``j`` (KV head
      ``h = j // group``) is multiplied by ``s_k[h] / k_scale`` with ``k_scale = max(s_k)`` (the
      ratio is <= 1, which keeps fp16 queries away from overflow and the bulk of the factor exact
      in fp32 on the host); ``Σ p (s_v[h] v̂) = s_v[h] Σ p v̂``, so the output of head ``j`` is
      multiplied by ``s_v[h]`` (``v_scale = 1``: one multiply, one rounding).
    * channel ``[Hkv, D]``: the same per element of ``D``.
    * token_head: a scale per token cannot leave the sum; FlashInfer cannot run it.

    Fields
    ------
    k_scale, v_scale : Python floats (taken from the device once, at plan time).
    q_mult, out_mult : fp32 ``[Hq, 1]`` (head) or ``[Hq, D]`` (channel), broadcasting over
        ``[B, Hq, D]``; None when there is nothing to fold.
    """

    k_scale: float
    v_scale: float
    q_mult: torch.Tensor | None = None
    out_mult: torch.Tensor | None = None


def _unsupported_granularity_reason(cache: PagedKVCache) -> str:
    # The reason is a library fact, the same on every arch FlashInfer runs on.
    return check("flashinfer", cache.kv_dtype, "dequant", "sm90", cache.granularity, None)[1]


def plan_scales(cache: PagedKVCache, num_qo_heads: int) -> ScaleFold:
    """The :class:`ScaleFold` for ``cache`` and ``num_qo_heads`` query heads (host sync: plan time).

    Raises UnsupportedError for token_head scales, with the capability table's reason.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}")
    hkv = cache.num_kv_heads
    if not isinstance(num_qo_heads, int) or num_qo_heads < 1 or num_qo_heads % hkv:
        raise ValueError(f"num_qo_heads={num_qo_heads!r} must be a positive multiple of the cache's "
                         f"{hkv} KV heads")
    if not cache.is_fp8:
        return ScaleFold(1.0, 1.0)
    gran = cache.granularity
    if gran == "token_head":
        raise UnsupportedError(f"flashinfer backend, granularity=token_head: "
                               f"{_unsupported_granularity_reason(cache)}")
    ks = cache.k_scale.detach().to(torch.float32)
    vs = cache.v_scale.detach().to(torch.float32)
    if gran == "tensor":
        return ScaleFold(float(ks), float(vs))
    group = num_qo_heads // hkv
    k_ref = float(ks.max())
    q_mult = (ks / k_ref).repeat_interleave(group, dim=0)  # [Hq] or [Hq, D]
    out_mult = vs.repeat_interleave(group, dim=0)
    if gran == "head":
        q_mult, out_mult = q_mult[:, None], out_mult[:, None]
    return ScaleFold(k_ref, 1.0, q_mult.contiguous(), out_mult.contiguous())


def apply_q_fold(q: torch.Tensor, fold: ScaleFold, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * fold.q_mult`` computed in fp32 and rounded once to ``dtype`` (default q's dtype).

    The rounding is the fold's only inexact step: a bf16 query keeps 8 significant bits, so each
    folded element carries a relative error <= 2^-8 (exact for power-of-two scale ratios).
    Device work only (capturable).
    """
    if fold.q_mult is None:
        return q if dtype is None or q.dtype == dtype else q.to(dtype)
    return (q.to(torch.float32) * fold.q_mult).to(dtype or q.dtype)


def fold_scales(q: torch.Tensor, cache: PagedKVCache):
    """``(q_folded, k_scale, v_scale, out_multiplier)``: :func:`plan_scales` then :func:`apply_q_fold`.

    q : ``[B, Hq, D]``. ``q_folded`` has q's dtype (pass fp32 to see the fold without rounding);
    ``k_scale``/``v_scale`` are floats; ``out_multiplier`` is fp32 ``[Hq, 1]`` / ``[Hq, D]`` or None.
    Attention over ``(q_folded, codes x k_scale, codes x v_scale)`` times ``out_multiplier`` equals
    attention of ``q`` over the dequantized cache.
    """
    if not isinstance(q, torch.Tensor) or q.ndim != 3:
        raise ValueError(f"q must be a [B, Hq, D] tensor; got {getattr(q, 'shape', type(q).__name__)}")
    fold = plan_scales(cache, q.shape[1])
    return apply_q_fold(q, fold), fold.k_scale, fold.v_scale, fold.out_mult
