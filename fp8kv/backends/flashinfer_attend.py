"""FlashInfer's multi-token attention over the paged cache (several new tokens per sequence):
:class:`FlashInferAttend` (plan once, run many; ``fp8kv.attend``'s ``"flashinfer"`` backend) and :func:`prefill`
(checked, planned on every call). FlashInfer's wheel facts this relies on: :mod:`fp8kv.backends.flashinfer`."""

from __future__ import annotations

import weakref

import torch

from .. import checks
from ..cache import PagedKVCache
from ..capability import UnsupportedError, check, check_query
from .flashinfer_args import (
    DEFAULT_WORKSPACE_BYTES,
    LN2,
    import_flashinfer,
    paged_kv_args,
    plan_growing,
    qo_indptr,
    query_counts,
    window_left,
    workspace,
)
from .flashinfer_scales import ScaleFold, apply_q_fold, plan_scales

__all__ = ["FlashInferAttend", "prefill"]


def prefill(q: torch.Tensor, qo_lens, cache: PagedKVCache, causal: bool = True,
            sm_scale: float | None = None):
    """Append / prefill attention (several query tokens per sequence) over the paged cache.

    Parameters
    ----------
    q : ``[sum(qo_lens), Hq, D]`` bfloat16 / float16: the queries of sequence 0, then 1, ...
    qo_lens : ints ``[B]`` (a list, or a 1-D int32/int64 tensor; floats and bools are refused):
        query tokens per sequence,
        ``0 <= qo_lens[i] <= seq_lens[i]``. They are
        the *last* ``qo_lens[i]`` positions of each sequence, whose K/V must already be in the cache.
    cache : the cache (every ``seq_lens[i] >= 1``; tensor / head / channel scales).
    causal : query ``j`` of sequence ``i`` sees keys ``0 .. seq_lens[i] - qo_lens[i] + j``
        (FlashInfer's bottom-right alignment); False: every query sees the whole sequence.
    sm_scale : a positive finite number in ``fp8kv.checks.softmax_scale``'s range, default ``1/sqrt(D)``.

    Every argument is checked here (q finite, the cache's tables and scales: FlashInfer reads them as
    they are), before FlashInfer is asked.

    Returns ``out`` ``[sum(qo_lens), Hq, D]`` (q's dtype) and ``lse`` ``[sum(qo_lens), Hq]`` fp32
    (natural log). Plans on every call (for notebooks, not timing: :class:`FlashInferAttend` plans once).
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor) or q.ndim != 3:
        raise ValueError(f"q must be a [total_q, Hq, D] tensor; got {getattr(q, 'shape', type(q).__name__)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q must be bfloat16 or float16, got {q.dtype}")
    if q.shape[-1] != cache.head_dim or q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache (head_dim {cache.head_dim}, "
                         f"{cache.num_kv_heads} KV heads: Hq must be a multiple)")
    checks.flag(causal, "causal")
    if sm_scale is not None:
        sm_scale = checks.softmax_scale(sm_scale)
    lens_q = query_counts(qo_lens)  # 2.7 is no query count (as_tensor would truncate it)
    cache.validate_arrays()  # FlashInfer reads the tables and scales as they are
    cache.validate_tables()
    checks.finite_tensor(q, "q")
    lens_kv = cache.seq_lens.detach().to("cpu", torch.int64)
    if lens_q.numel() != cache.batch_size:
        raise ValueError(f"qo_lens has {lens_q.numel()} entries but the cache holds {cache.batch_size} sequences")
    if (lens_kv < 1).any():
        i = int((lens_kv < 1).nonzero()[0])
        raise ValueError(f"seq_lens[{i}]=0: every sequence needs at least one cached token")
    bad = (lens_q < 0) | (lens_q > lens_kv)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"qo_lens[{i}]={int(lens_q[i])} must be in [0, seq_lens[{i}]={int(lens_kv[i])}]: "
                         "the queries are the last tokens of their sequence, already in the cache")
    if int(lens_q.sum()) != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but sum(qo_lens) = {int(lens_q.sum())}")
    ok, why = check("flashinfer", cache.kv_dtype, "dequant", None, cache.granularity, cache.head_dim, op="attend")
    if not ok:
        raise UnsupportedError(f"flashinfer prefill, kv_dtype={cache.kv_dtype}, "
                               f"granularity={cache.granularity}: {why}")
    ok, why = check_query("flashinfer", q.dtype, cache.kv_dtype)
    if not ok:
        raise TypeError(why)
    attend = FlashInferAttend(cache, trusted=True)
    attend.plan(cache, lens_q.tolist(), num_qo_heads=q.shape[1], q_dtype=q.dtype, sm_scale=sm_scale, causal=causal)
    return attend.run_trusted(q if q.stride(-1) == 1 else q.contiguous())


class FlashInferAttend:
    """Plan once, run many: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (FA2, 16-bit query) over one
    cache's pages, for several new tokens per sequence (``fp8kv.attend``'s ``"flashinfer"`` backend, and
    :func:`prefill`).

    Parameters
    ----------
    cache : the :class:`~fp8kv.cache.PagedKVCache` (on a CUDA device) the wrapper is built for (held weakly).
    workspace_bytes : the shared float workspace's size to start from (it doubles while a plan needs more).
    trusted : ``fp8kv.attend`` / ``planned_attend`` checked the input and the capability table (once, where it
        entered); a user's object (False) asks the capability table here.

    ``plan(cache, qo_lens, num_qo_heads=..., q_dtype=...)`` does the host work (page tables, scale folding,
    FlashInfer's scheduler; a host sync); ``run_trusted(q)`` is device work only, so it can be timed and
    captured in a CUDA graph. The new tokens of sequence i are the last ``qo_lens[i]`` of its row, causal
    among them (FlashInfer's bottom-right alignment), as :func:`fp8kv.reference.attend` defines them.
    """

    def __init__(self, cache: PagedKVCache, *, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, trusted: bool = False):
        if not isinstance(cache, PagedKVCache):
            checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
        checks.flag(trusted, "trusted")
        checks.positive_int(workspace_bytes, "workspace_bytes")
        if cache.device.type != "cuda":
            raise UnsupportedError(f"FlashInfer runs on CUDA tensors only; the cache is on {cache.device}")
        if not trusted:
            ok, why = check("flashinfer", cache.kv_dtype, "dequant", None, cache.granularity, cache.head_dim,
                            op="attend")
            if not ok:
                raise UnsupportedError(f"flashinfer attend, kv_dtype={cache.kv_dtype}, "
                                       f"granularity={cache.granularity}: {why}")
        self.layout, self.device = cache.layout, cache.device
        self._workspace, self._wrapper = self._new_wrapper(workspace_bytes)
        self._cache_ref = weakref.ref(cache)
        self._fold: ScaleFold | None = None

    def _new_wrapper(self, nbytes: int):
        buf = workspace(self.device, nbytes, "fa2")
        return buf, import_flashinfer().BatchPrefillWithPagedKVCacheWrapper(buf, self.layout)

    def plan(self, cache: PagedKVCache, qo_lens, *, num_qo_heads: int, q_dtype: torch.dtype,
             sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
             causal: bool = True) -> None:
        """Host-side planning for ``qo_lens`` new tokens per sequence of ``cache`` (ints, checked by the
        caller: ``0 <= qo_lens[i] <= seq_lens[i]``), every ``seq_lens[i] >= 1``. ``window`` / ``soft_cap`` as
        :func:`fp8kv.reference.attend` defines them (``window_left = window - 1``), trusted. Syncs with the
        device; not capturable."""
        lens = cache.seq_lens.detach().cpu()
        if lens.numel() and int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0])
            checks.fail(f"seq_lens[{i}]=0: FlashInfer's prefill needs at least one cached token per sequence "
                        "(its kernels take 1 <= last_page_len <= page_size)")
        self._fold = plan_scales(cache, num_qo_heads)
        indptr, indices, last = paged_kv_args(cache)
        self._workspace, self._wrapper = plan_growing(
            self._workspace, self._wrapper, self._new_wrapper, False, qo_indptr(qo_lens, cache.device), indptr,
            indices, last, num_qo_heads, cache.num_kv_heads, cache.head_dim, cache.block_size, causal=causal,
            pos_encoding_mode="NONE", sm_scale=checks.resolved_softmax_scale(sm_scale, cache.head_dim),
            window_left=window_left(window), logits_soft_cap=soft_cap, q_data_type=q_dtype,
            kv_data_type=cache.dtype, o_data_type=q_dtype)
        self._cache_ref = weakref.ref(cache)
        self._stamp = cache.stamp()  # the page table, lengths and scales the plan holds

    def run_trusted(self, q: torch.Tensor):
        """Attention of ``q`` ``[sum(qo_lens), Hq, D]`` (the planned dtype, last dim contiguous): ``out`` (q's
        dtype) and ``lse`` ``[sum(qo_lens), Hq]`` fp32, natural log. Device work only: no check, no host sync."""
        cache, fold = self._cache_ref(), self._fold
        if cache is None or fold is None:
            raise RuntimeError("FlashInferAttend.run_trusted before plan(), or the planned cache has been freed")
        cache.check_stamp(self._stamp, "FlashInfer's plan (page table, lengths, folded scales)")  # metadata only
        out, lse = self._wrapper.run(apply_q_fold(q, fold), (cache.k_pages, cache.v_pages), k_scale=fold.k_scale,
                                     v_scale=fold.v_scale, return_lse=True)
        if fold.out_mult is not None:
            out.mul_(fold.out_mult)  # computed in fp32, rounded once to q's dtype
        return out, lse.mul_(LN2)
