"""FlashInfer paged decode (and prefill) over a :class:`~fp8kv.cache.PagedKVCache`: the names of
:mod:`~fp8kv.backends.flashinfer_args` (import, workspaces, argument translation),
:mod:`~fp8kv.backends.flashinfer_decode` (:class:`FlashInferDecode`, :func:`decode`) and
:mod:`~fp8kv.backends.flashinfer_attend` (:class:`FlashInferAttend`, :func:`prefill`), gathered here.

FlashInfer is optional: nothing here imports it until a kernel is asked for, and then a missing
install raises :class:`~fp8kv.capability.UnsupportedError` ("FlashInfer is not installed (pip install
'fp8kv[gpu]')"). The translation from fp8kv's cache to FlashInfer's arguments is pure torch and
runs anywhere (:func:`paged_kv_args`; the scales: :mod:`fp8kv.backends.flashinfer_scales`).

Facts these modules rely on, read in the flashinfer-python 0.6.13 wheel (paths inside it):

* ``flashinfer/decode.py`` ``BatchDecodeWithPagedKVCacheWrapper``: ``__init__(float_workspace_buffer,
  kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, paged_kv_indptr_buffer=None,
  paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None, backend="auto")``;
  ``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, ...,
  q_data_type, kv_data_type, o_data_type, sm_scale, ...)`` (host work, syncs, not capturable);
  ``run(q, paged_kv_cache, *, k_scale, v_scale, return_lse)`` with ``paged_kv_cache`` a tuple
  ``(k_cache, v_cache)`` of ``[pages, page_size, Hkv, D]`` (NHD) or ``[pages, Hkv, page_size, D]``
  (HND). In ``run``, ``k_scale`` multiplies ``sm_scale`` on the host and ``v_scale`` is applied as
  ``out *= v_scale`` after the kernel: both must be Python floats (scalars), so per-head and
  per-channel scales are folded instead (exactly: :func:`~fp8kv.backends.flashinfer_scales.plan_scales`).
* The wrapper's ``use_tensor_cores=True`` path runs the FA2 *prefill* kernel with one query per
  request; with a 16-bit query it always picks ``fa2`` (``flashinfer/utils.py``
  ``is_fa3_backend_supported``: "FA3 FP8 KV cache currently requires FP8 query"). The CUDA-core
  path dispatches GQA group sizes 1, 2, 3, 4, 8 only (``include/flashinfer/utils.cuh``
  ``DISPATCH_GQA_GROUP_SIZE``).
* LSE is returned in base 2: ``include/flashinfer/attention/state.cuh`` ``get_lse() { return m +
  math::ptx_log2(d); }`` with ``m`` the running max of ``logits * sm_scale * log2e``
  (``attention/variants.cuh`` ``sm_scale_log2``); the prefill kernels write ``ptx_log2(d) + m`` too
  (``attention/prefill.cuh``), and FlashInfer's own tests compare against ``logsumexp * log2(e)``.
  fp8kv converts to natural log (``lse * ln 2``) to match :func:`fp8kv.reference.decode`.
* Paged layout (``flashinfer/page.py`` ``get_seq_lens``): ``len = (pages - 1) * page_size +
  last_page_len`` with ``1 <= last_page_len <= page_size`` for a non-empty sequence. An empty
  sequence is written as zero pages and ``last_page_len = 0`` (``get_seq_lens`` clamps the page
  term at 0); the kernels' own ``get_length`` does not clamp, so decode requires every length >= 1.
* ``BatchPrefillWithPagedKVCacheWrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices,
  paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size, ..., causal, ...,
  sm_scale, ..., q_data_type, kv_data_type, o_data_type)`` (``flashinfer/prefill.py``). Its causal
  mask is aligned bottom-right: query ``j`` of a request with ``qo_len`` queries and ``kv_len`` keys
  sees keys ``0 .. kv_len - qo_len + j`` (``attention/prefill.cuh``: masked when
  ``kv_idx + qo_len > kv_len + q_idx``). Its ``plan`` takes ``window_left`` and ``logits_soft_cap`` as the
  decode wrapper's does, its ``run`` the scalar ``k_scale`` / ``v_scale`` (:class:`FlashInferAttend`).
* Attention variants (``flashinfer/decode.py``, ``include/flashinfer/attention/variants.cuh``):
  ``plan(..., window_left=-1, logits_soft_cap=None)``. The FA2 mask keeps key ``kv_idx`` when
  ``kv_idx + qo_len + window_left >= kv_len + qo_idx``: a decode query (``qo_len = 1``) sees the last
  ``window_left + 1`` keys, so fp8kv's window W (W keys, the query's own included, as transformers'
  ``sliding_window``) is ``window_left = W - 1`` (:func:`window_left`). Soft-capping replaces the
  logit by ``cap * tanh(logit * sm_scale / cap)`` with ``sm_scale`` already multiplied by ``k_scale``
  (natural units, as fp8kv defines it). ``run(sinks=...)`` is passed only to the TRT-LLM kernels;
  the FA2 run path never reads it, so fp8kv refuses sinks here rather than drop them.
  ``trtllm_batch_decode_with_kv_cache(..., window_left=-1, ..., sinks=None)`` has no soft cap.
* An FP8 *query* runs only in the TRT-LLM-generated kernels (``trtllm_batch_decode_with_kv_cache``,
  ``backend="trtllm-gen"`` on sm100), whose ``bmm1_scale`` may be a device tensor.

Importing ``flashinfer`` itself needs apache-tvm-ffi, einops, ninja, tabulate and nvidia-ml-py; its
kernels are compiled on first use (JIT) unless the matching ``flashinfer-jit-cache`` is installed.
"""

from __future__ import annotations

from .flashinfer_args import (
    DEFAULT_WORKSPACE_BYTES,
    LN2,
    MAX_WORKSPACE_BYTES,
    NOT_INSTALLED,
    import_flashinfer,
    paged_kv_args,
    plan_growing,
    qo_indptr,
    query_counts,
    window_left,
    workspace,
)
from .flashinfer_attend import FlashInferAttend, prefill
from .flashinfer_decode import CUDA_CORE_GROUP_SIZES, FP8_Q_MAX, FlashInferDecode, decode

__all__ = ["paged_kv_args", "qo_indptr", "query_counts", "FlashInferDecode", "FlashInferAttend", "decode", "prefill",
           "workspace", "import_flashinfer", "plan_growing",
           "NOT_INSTALLED", "LN2", "window_left", "DEFAULT_WORKSPACE_BYTES", "MAX_WORKSPACE_BYTES",
           "CUDA_CORE_GROUP_SIZES", "FP8_Q_MAX"]
