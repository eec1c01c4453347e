"""The fp32 oracle: paged decode attention computed plainly from the dequantized cache.

Every backend (Triton, FlashInfer) is checked against :func:`decode`. It favours being obviously
right over being fast: one sequence at a time, fp32 throughout.
"""

from __future__ import annotations

import math

import torch

from . import checks
from .cache import PagedKVCache

__all__ = ["decode", "attention", "paged_attention"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float):
    """One query token against one sequence, GQA by head groups, in fp32.

    q: ``[Hq, D]``; k, v: ``[L, Hkv, D]`` with Hq a multiple of Hkv (query head h reads KV head
    ``h // (Hq // Hkv)``). Returns out ``[Hq, D]`` and the natural-log LSE of the scaled scores ``[Hq]``.
    """
    hq, hkv = q.shape[0], k.shape[1]
    group = hq // hkv
    qf = q.to(torch.float32).reshape(hkv, group, -1)  # [Hkv, G, D]
    kf = k.to(torch.float32).transpose(0, 1)  # [Hkv, L, D]
    vf = v.to(torch.float32).transpose(0, 1)
    s = torch.einsum("hgd,hld->hgl", qf, kf) * sm_scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("hgl,hld->hgd", p, vf)
    return out.reshape(hq, -1), lse.reshape(hq)


def decode(q: torch.Tensor, cache: PagedKVCache, sm_scale: float | None = None):
    """fp32 paged decode attention over the dequantized cache.

    Parameters
    ----------
    q : ``[B, Hq, D]`` float16 / bfloat16 / float32, one query token per sequence.
    cache : a :class:`~fp8kv.cache.PagedKVCache` with every ``seq_lens[i] >= 1``.
    sm_scale : softmax scale, a positive finite number; default ``1 / sqrt(D)``.

    Returns
    -------
    out : ``[B, Hq, D]`` float32.
    lse : ``[B, Hq]`` float32, natural-log log-sum-exp of the scaled scores.
    """
    if not isinstance(cache, PagedKVCache):
        checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
    cache.check_query(q)
    if sm_scale is not None:
        sm_scale = checks.positive_float(sm_scale, "sm_scale")
    return paged_attention(q, cache, sm_scale)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, sm_scale: float | None = None):
    """The computation of :func:`decode` on inputs already validated (by it, or ``fp8kv.decode``)."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    lens = cache.seq_lens.tolist()
    if min(lens) < 1:
        raise ValueError(f"seq_lens[{lens.index(min(lens))}]=0: decode needs at least one cached token "
                         "per sequence (empty sequences have no attention output)")
    outs, lses = [], []
    for i in range(q.shape[0]):
        k, v = cache.gather(i)
        o, lse = attention(q[i], k, v, sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
