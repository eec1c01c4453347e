"""Argument checks of multi-token attention over a paged cache (speculative verification, chunked prefill).

A call attends a ragged batch of new tokens: ``q`` ``[total_q, Hq, D]`` holds the queries of every
sequence back to back, and ``qo_indptr`` ``[B + 1]`` says where each sequence's rows start
(``qo_indptr[i] .. qo_indptr[i + 1]``). The new tokens are already written into the cache: they are
the last ``qo_len[i]`` tokens of sequence i's row. These checks are shared by the oracle
(``fp8kv.reference.attend``) and the Triton launcher (``fp8kv.ops.attend.attend``); each raises a
``TypeError``/``ValueError`` that names the argument, the value seen and what is accepted.
"""

from __future__ import annotations

import torch

from . import checks
from .cache import PagedKVCache, check_paged_cache

__all__ = ["cache_arg", "attend_query", "qo_indptr_arg", "planned_qo_indptr",
           "check_counts_unchanged", "attend_arguments", "ATTEND_OPTIONS", "ATTEND_BACKEND_OPTIONS",
           "QO_INDPTR_DTYPES"]

QO_INDPTR_DTYPES = (torch.int32, torch.int64)
# The options of the Triton attend beyond mode, sm_scale and the variants (fp8kv.attend's launch options of the
# triton backend; the other backends take none): the output's dtype, how dequant mode converts FP8 (as the
# decode takes it), and the launch overrides of fp8kv.ops.attend.attend_launch.
# The attend kernel's own launch (fp8kv.ops.attend.attend_launch); asking for one of them runs that kernel.
ATTEND_KERNEL_OPTIONS = ("num_splits", "block_m", "block_n", "num_warps", "num_stages")
ATTEND_OPTIONS = ("out_dtype", "convert", *ATTEND_KERNEL_OPTIONS)
# What fp8kv.attend's triton backend takes: the attend kernel's options and the choice of kernel, ``gluon`` (None:
# the Gluon kernel where every sequence has as many new tokens and it runs, else the attend kernel; True: the Gluon
# kernel or UnsupportedError; False: the Triton kernels).
ATTEND_BACKEND_OPTIONS = (*ATTEND_OPTIONS, "gluon")


def cache_arg(cache) -> PagedKVCache:
    """A :class:`~fp8kv.cache.PagedKVCache` whose arrays (pages, tables, scales) and tables' contents
    are sound (:meth:`PagedKVCache.validate_arrays` and :meth:`PagedKVCache.validate_tables`: one host sync)."""
    check_paged_cache(cache)
    cache.validate_arrays(contents=True)
    cache.validate_tables()
    return cache


def attend_query(q, cache: PagedKVCache) -> torch.Tensor:
    """``q`` ``[total_q, Hq, D]`` against the cache, by the decode's rule (:meth:`PagedKVCache.check_query`)
    but for the row count, which ``qo_indptr`` fixes."""
    cache.check_query(q, one_per_sequence=False)
    return q


def planned_qo_indptr(qo_indptr, cache: PagedKVCache) -> torch.Tensor:
    """``qo_indptr``'s metadata (what a planned run checks; no host sync): a contiguous int32/int64 tensor
    ``[B + 1]`` on the cache's device."""
    b = cache.batch_size
    checks.tensor(qo_indptr, "qo_indptr", ndim=1, dtypes=QO_INDPTR_DTYPES, device=cache.device,
                  shape_hint=f"[{b + 1}] (B + 1 row offsets into q)")
    if qo_indptr.shape[0] != b + 1:
        checks.fail(f"qo_indptr has shape {tuple(qo_indptr.shape)}; expected [{b + 1}]: B + 1 offsets for the "
                    f"cache's {b} sequences")
    if not qo_indptr.is_contiguous():  # the kernels read it as a plain array of B + 1 offsets
        checks.fail(f"qo_indptr has strides {qo_indptr.stride()}; expected a contiguous tensor (pass "
                    "qo_indptr.contiguous())")
    return qo_indptr


def check_counts_unchanged(qo_indptr: torch.Tensor, version: int | None, qo_lens) -> None:
    """ValueError if ``qo_indptr`` was written in place since a plan read its counts ``qo_lens`` (its version
    counter moved: metadata, no host sync)."""
    if version is not None and checks.version_counter(qo_indptr) != version:
        checks.fail(f"qo_indptr was written in place after planning (the plan read its counts once, "
                    f"qo_lens={list(qo_lens)}, and runs with them): plan again for the new counts")


def qo_indptr_arg(qo_indptr, cache: PagedKVCache, total_q: int) -> list[int]:
    """``qo_indptr``: a contiguous int32/int64 tensor ``[B + 1]`` on the cache's device with ``qo_indptr[0] = 0``,
    non-decreasing, ``qo_indptr[B] = total_q`` and every ``qo_len[i] = qo_indptr[i + 1] - qo_indptr[i]``
    at most ``seq_lens[i]`` (the new tokens are the last ``qo_len[i]`` of the row). Returns the
    ``qo_len`` as Python ints (one host sync)."""
    b = cache.batch_size
    planned_qo_indptr(qo_indptr, cache)
    ptr = qo_indptr.cpu().to(torch.int64).tolist()
    if ptr[0] != 0:
        checks.fail(f"qo_indptr[0]={ptr[0]}; expected 0 (sequence 0's rows start at q[0])")
    lens = [ptr[i + 1] - ptr[i] for i in range(b)]
    if min(lens) < 0:
        i = lens.index(min(lens))
        checks.fail(f"qo_indptr decreases at {i}: qo_indptr[{i}]={ptr[i]} > qo_indptr[{i + 1}]={ptr[i + 1]}; "
                    "expected non-decreasing offsets (qo_len >= 0)")
    if ptr[-1] != total_q:
        checks.fail(f"qo_indptr[{b}]={ptr[-1]}; expected q's row count, total_q={total_q}")
    seq_lens = cache.seq_lens.cpu().tolist()
    for i, (n, length) in enumerate(zip(lens, seq_lens, strict=True)):
        if n > length:
            checks.fail(f"qo_indptr gives sequence {i} qo_len={n} new tokens but seq_lens[{i}]={length}; the new "
                        "tokens are the last qo_len of the cached ones (write them first), so qo_len <= seq_len")
    return lens


def attend_arguments(q, cache, qo_indptr, sm_scale, window, soft_cap, sinks) -> tuple:
    """Every argument of an attend call, checked in order (cache, q, qo_indptr, sm_scale, the variants).

    q must be finite (a host sync). Returns ``(qo_lens, sm_scale, window, soft_cap, sinks)``: the per-sequence new-token counts as ints,
    ``sm_scale`` as a float (None stays None: ``1 / sqrt(D)``) and the variants as
    :func:`fp8kv.checks.attention_variant` returns them (sinks ``[Hq]`` fp32 on q's device, finite).
    """
    cache_arg(cache)
    attend_query(q, cache)
    checks.finite_tensor(q, "q")
    qo_lens = qo_indptr_arg(qo_indptr, cache, q.shape[0])
    window, soft_cap, sinks = checks.attention_variant(window, soft_cap, sinks, num_q_heads=q.shape[1],
                                                       device=q.device)
    if sm_scale is not None:  # its range depends on the cap it is folded with
        sm_scale = checks.softmax_scale(sm_scale, soft_cap)
    return qo_lens, sm_scale, window, soft_cap, sinks
