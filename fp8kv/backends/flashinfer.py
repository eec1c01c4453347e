"""FlashInfer paged decode (and prefill) over a :class:`~fp8kv.cache.PagedKVCache`.

FlashInfer is optional: nothing here imports it until a kernel is asked for, and then a missing
install raises :class:`~fp8kv.capability.UnsupportedError` ("FlashInfer is not installed (pip install
'fp8kv[gpu]')"). The translation from fp8kv's cache to FlashInfer's arguments is pure torch and
runs anywhere (:func:`paged_kv_args`; the scales: :mod:`fp8kv.backends.flashinfer_scales`).

Facts this module relies on, read in the flashinfer-python 0.6.13 wheel (paths inside it):

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
  ``kv_idx + qo_len > kv_len + q_idx``).
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

Workspaces: one zeroed 128 MiB buffer per (device, kernel family), shared by every wrapper fp8kv
creates there, as FlashInfer's examples share one across layers. Run the wrappers on one stream.
"""

from __future__ import annotations

import importlib
import math
import re
import weakref
from collections.abc import Iterable

import torch

from .. import checks
from ..cache import PagedKVCache
from ..capability import (
    UnsupportedError,
    check,
    check_query,
    check_query_strides,
    check_variants,
    current_arch,
    flashinfer_installed,
)
from ..formats import FORMATS
from .flashinfer_scales import ScaleFold, apply_q_fold, plan_scales

__all__ = ["paged_kv_args", "qo_indptr", "query_counts", "FlashInferDecode", "decode", "prefill", "workspace",
           "NOT_INSTALLED", "LN2", "window_left"]

NOT_INSTALLED = "FlashInfer is not installed (pip install 'fp8kv[gpu]')"
LN2 = math.log(2.0)  # FlashInfer's LSE is log2; natural log = log2 * ln 2
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
MAX_WORKSPACE_BYTES = 4 * 1024**3  # the float workspace grows by doubling up to this (plan retries)
# FlashInfer's allocator error names the bytes it had: the float workspace's size when that one is short.
_FLOAT_WORKSPACE_SHORT = re.compile(r"but only (\d+) bytes available.*Increase the workspace buffer size", re.S)
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE of the CUDA-core decode kernel
FP8_Q_MAX = FORMATS["e4m3"].max  # the FP8 query of the sm100 path is e4m3

_MODULE = "flashinfer"  # the import name (a constant so tests can point it elsewhere)
_WORKSPACES: dict[tuple[str, torch.device], torch.Tensor] = {}
# decode()'s decoders, per cache object: dying caches take their entries (and plans) with them.
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def window_left(window: int | None) -> int:
    """FlashInfer's ``window_left`` for fp8kv's sliding ``window`` (keys seen, the query's own
    included): the keys strictly left of the query, ``window - 1``; ``-1`` (no window) for None."""
    return -1 if window is None else window - 1


# ----------------------------------------------------------------------------------------- imports
def _import_flashinfer():
    """The ``flashinfer`` module, or UnsupportedError saying why it cannot be had."""
    if not flashinfer_installed():
        raise UnsupportedError(NOT_INSTALLED)
    try:
        return importlib.import_module(_MODULE)
    except Exception as e:  # a broken install: say what is missing rather than a bare traceback
        raise UnsupportedError(
            f"FlashInfer is installed but failed to import ({type(e).__name__}: {e}); it needs "
            "apache-tvm-ffi, einops, ninja, tabulate and nvidia-ml-py") from e


def workspace(device, nbytes: int = DEFAULT_WORKSPACE_BYTES, family: str = "fa2") -> torch.Tensor:
    """The shared zero-initialised uint8 workspace of ``nbytes`` for ``family`` on ``device``.

    ``family`` separates kernel families that keep state in the buffer (the TRT-LLM kernels keep
    counters there), so they never see each other's scratch data.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (family, dev)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        _WORKSPACES[key] = buf
    return buf


# ---------------------------------------------------------------------------- argument translation
def paged_kv_args(cache: PagedKVCache, device=None):
    """FlashInfer's CSR page description of ``cache``: ``(indptr, indices, last_page_len)``.

    Parameters
    ----------
    cache : the cache; its ``block_table`` ``[B, max_blocks]`` and ``seq_lens`` ``[B]`` are read
        (one device-to-host copy: call this at plan time, not in a timed loop).
    device : where the results go (default: the cache's device).

    Returns
    -------
    indptr : int32 ``[B + 1]``, ``indptr[i+1] - indptr[i]`` = pages of sequence i = ceil(len / bs).
    indices : int32 ``[indptr[-1]]``, the used block-table entries, sequence by sequence in order.
    last_page_len : int32 ``[B]``, tokens in each sequence's last page: ``(len - 1) % bs + 1``
        (in ``[1, bs]``) for ``len >= 1``; ``0`` for an empty sequence (zero pages), the form
        ``flashinfer.get_seq_lens`` maps back to length 0. Decode needs every length >= 1.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}")
    device = cache.device if device is None else torch.device(device)
    lens = cache.seq_lens.detach().to("cpu", torch.int64)
    bs = cache.block_size
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(cache.max_blocks_per_seq)[None, :] < pages[:, None]
    indices = cache.block_table.detach().to("cpu")[used]  # row-major: sequence by sequence, in order
    last = torch.where(lens > 0, (lens - 1) % bs + 1, torch.zeros_like(lens))
    return (indptr.to(torch.int32).to(device), indices.to(torch.int32).contiguous().to(device),
            last.to(torch.int32).to(device))


def query_counts(qo_lens) -> torch.Tensor:
    """Query tokens per sequence, checked, as host int64 ``[B]``: a list/tuple of ints or a 1-D
    int32/int64 tensor. Floats (even integral ones: 1.5 would become a pointer step, 2.0 hides a
    bug), float or bool tensors, bools and negative counts are refused by name (``qo_lens[i]``)."""
    if isinstance(qo_lens, torch.Tensor):
        lens = checks.int_tensor(qo_lens, "qo_lens", ndim=1, shape_hint="[B] (query tokens per sequence)")
        lens = lens.detach().to("cpu", torch.int64)
    elif isinstance(qo_lens, (str, bytes)) or not isinstance(qo_lens, Iterable):
        checks.fail(f"qo_lens={qo_lens!r} ({type(qo_lens).__name__}); expected a list of ints or a 1-D int tensor "
                    "(query tokens per sequence)", TypeError)
    else:
        lens = torch.tensor([checks.integer(n, f"qo_lens[{i}]") for i, n in enumerate(qo_lens)], dtype=torch.int64)
    if (lens < 0).any():
        i = int((lens < 0).nonzero()[0])
        checks.fail(f"qo_lens[{i}]={int(lens[i])} is negative; expected query counts >= 0")
    return lens


def qo_indptr(qo_lens, device=None) -> torch.Tensor:
    """int32 ``[B + 1]`` prefix sums of the query lengths (FlashInfer's ``qo_indptr``); ``qo_lens`` as
    :func:`query_counts` takes them."""
    lens = query_counts(qo_lens)
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lens, 0)
    return out.to(torch.int32).to(device or "cpu")


# ------------------------------------------------------------------------------------------ decode
def _version(t: torch.Tensor):
    """The tensor's in-place-edit counter (None for inference-mode tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _plan_key(cache: PagedKVCache, num_qo_heads, q_dtype, sm_scale, window=None, soft_cap=None):
    """What a plan depends on: tables and scales by identity, shape and in-place version."""
    parts = [id(cache), id(cache.k_pages), num_qo_heads, q_dtype, sm_scale, window, soft_cap]
    for t in (cache.block_table, cache.seq_lens, cache.k_scale, cache.v_scale):
        parts += [id(t), tuple(t.shape), _version(t)]
    return tuple(parts)


class FlashInferDecode:
    """Plan once, run many: FlashInfer paged decode over one cache's block table and lengths.

    Parameters
    ----------
    cache : the :class:`~fp8kv.cache.PagedKVCache` (on a CUDA device) whose layout, device and
        batch shape the wrapper is built for. It is held weakly: the decoder never keeps a cache alive.
    use_tensor_cores : FlashInfer's tensor-core decode (the FA2 prefill kernel; any GQA group) rather
        than its CUDA-core kernel (group sizes 1, 2, 3, 4, 8).
    workspace_bytes : size of the shared float workspace (FlashInfer recommends 128 MiB).
    use_cuda_graph : build the wrapper with fixed page-table buffers (FlashInfer's CUDA-graph mode);
        ``run`` is capturable either way once planned, this keeps re-plans visible to a captured graph.
    mode : ``"dequant"`` (16-bit query, FP8 or 16-bit cache; FA2 kernels) or ``"fp8"`` (FP8 query,
        the TRT-LLM kernels: sm100 only, e4m3 cache).

    Use ``plan(cache, num_qo_heads=..., q_dtype=...)`` then ``run(q)`` (= ``decoder(q)``). ``plan``
    does the host work (page tables, scale folding, FlashInfer's scheduler) and is skipped when
    nothing it depends on changed; ``run`` is device work only (no host sync), so it can be timed
    and captured in a CUDA graph.
    """

    def __init__(self, cache: PagedKVCache, *, use_tensor_cores: bool = True,
                 workspace_bytes: int = DEFAULT_WORKSPACE_BYTES, use_cuda_graph: bool = False,
                 mode: str = "dequant", trusted: bool = False):
        # trusted: fp8kv.decode / planned built this decoder after validating the input and checking
        # capability themselves (once, where the input entered); a user's decoder checks here.
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}")
        if mode not in ("dequant", "fp8"):
            raise ValueError(f"mode={mode!r}; expected 'dequant' or 'fp8'")
        if not isinstance(use_tensor_cores, bool):
            raise TypeError(f"use_tensor_cores={use_tensor_cores!r}; expected True or False")
        checks.positive_int(workspace_bytes, "workspace_bytes")
        if cache.device.type != "cuda":
            raise UnsupportedError(f"FlashInfer runs on CUDA tensors only; the cache is on {cache.device}")
        fi = _import_flashinfer()
        arch = current_arch()
        ok, why = (True, "") if trusted else check("flashinfer", cache.kv_dtype, mode, arch, cache.granularity,
                                                   cache.head_dim)
        if not ok:
            raise UnsupportedError(f"flashinfer backend, mode={mode}, kv_dtype={cache.kv_dtype}, "
                                   f"granularity={cache.granularity}: {why}")
        if mode == "fp8" and cache.kv_dtype != "fp8_e4m3":
            raise UnsupportedError(f"flashinfer fp8 mode (TRT-LLM kernels) reads an e4m3 cache, not "
                                   f"kv_dtype={cache.kv_dtype}; use dequant mode")
        self.mode = mode
        self.trusted = trusted
        self.layout = cache.layout
        self.device = cache.device
        self.use_tensor_cores = use_tensor_cores
        self.use_cuda_graph = bool(use_cuda_graph)
        self._cache_ref = weakref.ref(cache)
        self._batch = cache.batch_size
        self._key = None
        self._fold: ScaleFold | None = None
        self._wrapper = None
        self._workspace_bytes = workspace_bytes
        if mode == "fp8":
            self._fi_decode = fi.decode
            self._workspace = workspace(self.device, workspace_bytes, "trtllm-gen")
            return
        self._workspace, self._wrapper = self._new_wrapper(cache, workspace_bytes)

    def _new_wrapper(self, cache: PagedKVCache, nbytes: int):
        """A shared float workspace of at least ``nbytes`` and an FA2 decode wrapper over it."""
        buf = workspace(self.device, nbytes, "fa2")
        bufs = {}
        if self.use_cuda_graph:
            b, dev = cache.batch_size, self.device
            bufs = dict(
                paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(b * cache.max_blocks_per_seq, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev),
            )
        return buf, _import_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            buf, self.layout, use_cuda_graph=self.use_cuda_graph, use_tensor_cores=self.use_tensor_cores, **bufs)

    def _plan_dequant(self, cache: PagedKVCache, *args, **kwargs) -> None:
        """The FA2 wrapper's ``plan``. Where its scratch outgrows the float workspace (many query heads
        per KV head at long contexts: Falcon's 71 need ~600 MiB at 64 x 16k), a wrapper over a workspace
        twice as large plans instead, up to :data:`MAX_WORKSPACE_BYTES`; it replaces the current one
        only once its plan succeeded. A decoder built with ``use_cuda_graph`` never swaps its buffers
        (a captured graph would replay the old ones): it says which ``workspace_bytes`` to pass."""
        workspace_buf, wrapper = self._workspace, self._wrapper
        while True:
            try:
                wrapper.plan(*args, **kwargs)
                break
            except RuntimeError as e:
                size = workspace_buf.numel()
                short = _FLOAT_WORKSPACE_SHORT.search(str(e))
                if short is None or int(short.group(1)) != size or size >= MAX_WORKSPACE_BYTES:
                    raise  # not the float workspace (FlashInfer's fixed int workspace), or at the cap
                if self.use_cuda_graph:
                    raise ValueError(f"FlashInfer's plan needs more than the {size} bytes of workspace this "
                                     f"CUDA-graph decoder was built with; build it with workspace_bytes="
                                     f"{min(2 * size, MAX_WORKSPACE_BYTES)} or more") from e
            workspace_buf, wrapper = self._new_wrapper(cache, min(2 * workspace_buf.numel(), MAX_WORKSPACE_BYTES))
        self._workspace, self._wrapper, self._workspace_bytes = workspace_buf, wrapper, workspace_buf.numel()

    # ---------------------------------------------------------------------------------- planning
    @property
    def cache(self) -> PagedKVCache | None:
        """The planned cache (None if it has been freed)."""
        return self._cache_ref()

    def plan(self, cache: PagedKVCache | None = None, *, num_qo_heads: int,
             q_dtype: torch.dtype = torch.bfloat16, sm_scale: float | None = None,
             window: int | None = None, soft_cap: float | None = None, force: bool = False) -> bool:
        """Host-side planning for ``cache`` (default: the one given at construction).

        ``window`` / ``soft_cap``: a sliding window of that many keys (``window_left = window - 1``)
        and logit soft-capping, as :func:`fp8kv.reference.decode` defines them (trusted: checked
        by :func:`fp8kv.decode`). Re-plans only when the cache object, its block table / seq_lens /
        scales (identity, shape or in-place version), ``num_qo_heads``, ``q_dtype``, ``sm_scale``,
        ``window`` or ``soft_cap`` changed, or ``force``. Returns True when it planned. Syncs with
        the device; not capturable.
        """
        cache = self.cache if cache is None else cache
        if cache is None:
            raise ValueError("the cache this decoder was built for has been freed; pass cache=")
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}")
        default_scale = sm_scale is None
        sm_scale = checks.resolved_softmax_scale(sm_scale, cache.head_dim)
        key = _plan_key(cache, num_qo_heads, q_dtype, sm_scale, window, soft_cap)
        if key == self._key and not force:  # planned for exactly this input, checked then
            return False
        if cache.layout != self.layout or cache.device != self.device:
            raise ValueError(f"this decoder was built for layout {self.layout} on {self.device}; the cache "
                             f"is {cache.layout} on {cache.device}: build a new FlashInferDecode")
        if self.use_cuda_graph and cache.batch_size != self._batch:
            raise ValueError(f"use_cuda_graph fixes the batch at {self._batch}; the cache has "
                             f"{cache.batch_size} sequences")
        if not self.trusted:  # fp8kv.decode checked the query where it entered (fp8 mode quantizes it itself)
            ok, why = check_query("flashinfer", q_dtype, cache.kv_dtype)
            if not ok:
                raise TypeError(why)
        hkv = cache.num_kv_heads
        if not isinstance(num_qo_heads, int) or num_qo_heads < 1 or num_qo_heads % hkv:
            raise ValueError(f"num_qo_heads={num_qo_heads!r} must be a positive multiple of {hkv} KV heads")
        group = num_qo_heads // hkv
        if self.mode == "dequant" and not self.use_tensor_cores and group not in CUDA_CORE_GROUP_SIZES:
            raise UnsupportedError(f"FlashInfer's CUDA-core decode builds GQA group sizes "
                                   f"{CUDA_CORE_GROUP_SIZES}, not {group}; use use_tensor_cores=True")
        sm_scale = sm_scale if default_scale else float(sm_scale)
        if not self.trusted:  # fp8kv.decode checked the variants where they entered
            check_variants("flashinfer", self.mode, [n for n, v in (("window", window), ("soft_cap", soft_cap))
                                                     if v is not None])

        fold = plan_scales(cache, num_qo_heads)
        indptr, indices, last = paged_kv_args(cache)
        lens = cache.seq_lens.detach().cpu()
        if lens.numel() and int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0])
            raise ValueError(f"seq_lens[{i}]=0: decode needs at least one cached token per sequence "
                             "(FlashInfer's kernels take 1 <= last_page_len <= page_size)")
        if self.mode == "dequant":
            self._plan_dequant(cache, indptr, indices, last, num_qo_heads, hkv, cache.head_dim, cache.block_size,
                               pos_encoding_mode="NONE", q_data_type=q_dtype, kv_data_type=cache.dtype,
                               o_data_type=q_dtype, sm_scale=sm_scale, window_left=window_left(window),
                               logits_soft_cap=soft_cap)
        else:
            # The page-table capacity bounds every length (FlashInfer uses it for split sizing).
            self._max_seq_len = cache.max_blocks_per_seq * cache.block_size
            self._qk_scale = sm_scale * fold.k_scale  # fp32-exact host product, times q's scale per run
            self._window_left = window_left(window)
        self._cache_ref = weakref.ref(cache)
        self._batch = cache.batch_size
        self._num_qo_heads, self._q_dtype, self._sm_scale = num_qo_heads, q_dtype, sm_scale
        self._fold = fold
        self._key = key
        return True

    # --------------------------------------------------------------------------------------- run
    def run(self, q: torch.Tensor):
        """Decode attention for ``q`` ``[B, Hq, D]`` (the planned dtype, last dim contiguous).

        Returns ``out`` ``[B, Hq, D]`` in q's dtype and ``lse`` ``[B, Hq]`` fp32, natural log.
        Device work only: no host sync, capturable in a CUDA graph.
        """
        if self._fold is None:
            raise RuntimeError("FlashInferDecode.run before plan(): call plan(cache, num_qo_heads=...) first")
        cache = self.cache
        if cache is None:
            raise RuntimeError("the planned cache has been freed; plan() a live cache")
        exp = (self._batch, self._num_qo_heads, cache.head_dim)
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != exp:
            raise ValueError(f"q must be {list(exp)} (as planned); got {tuple(getattr(q, 'shape', ()))}")
        if q.dtype != self._q_dtype:
            raise TypeError(f"q is {q.dtype} but the plan is for {self._q_dtype}; plan() again")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device} but the cache is on {self.device}")
        check_query_strides("flashinfer", q)
        return self.run_trusted(q)

    def run_trusted(self, q: torch.Tensor):
        """:meth:`run` without its checks of ``q``: for a query :func:`fp8kv.decode` already validated
        against this plan."""
        cache, fold = self.cache, self._fold
        if cache is None:
            raise RuntimeError("the planned cache has been freed; plan() a live cache")
        if self.mode == "fp8":
            return self._run_fp8(q, cache, fold)
        q_in = apply_q_fold(q, fold)
        out, lse = self._wrapper.run(q_in, (cache.k_pages, cache.v_pages), k_scale=fold.k_scale,
                                     v_scale=fold.v_scale, return_lse=True)
        if fold.out_mult is not None:
            out.mul_(fold.out_mult)  # computed in fp32, rounded once to q's dtype
        return out, lse.mul_(LN2)

    __call__ = run

    def _run_fp8(self, q, cache, fold):
        """sm100: FP8 query (per-tensor scale from this q, on the device) through the TRT-LLM kernels."""
        qf = q.to(torch.float32)
        if fold.q_mult is not None:
            qf = qf * fold.q_mult
        amax = qf.abs().amax()
        q_scale = torch.where(amax > 0, amax / FP8_Q_MAX, torch.ones_like(amax))
        q8 = (qf / q_scale).clamp(-FP8_Q_MAX, FP8_Q_MAX).to(torch.float8_e4m3fn)
        bmm1 = (q_scale * self._qk_scale).reshape(1).to(torch.float32)
        out, lse = self._fi_decode.trtllm_batch_decode_with_kv_cache(
            q8, (cache.k_pages, cache.v_pages), self._workspace, cache.block_table, cache.seq_lens,
            self._max_seq_len, bmm1_scale=bmm1, bmm2_scale=fold.v_scale, out_dtype=q.dtype,
            window_left=self._window_left, kv_layout=self.layout, backend="trtllm-gen", return_lse=True)
        if fold.out_mult is not None:
            out.mul_(fold.out_mult)
        # Treated as base 2 like the FA2 kernels (TRT-LLM's softmax runs in exp2); not exercised on
        # sm100 hardware by fp8kv's own tests.
        return out, lse.mul_(LN2)


def decode(q: torch.Tensor, cache: PagedKVCache, *, mode: str = "dequant", use_tensor_cores: bool = True,
           sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
           sinks: torch.Tensor | None = None):
    """FlashInfer paged decode: the ``backend="flashinfer"`` entry of :func:`fp8kv.decode`, which
    validates the input and checks capability, variants included (so this does neither).

    Parameters
    ----------
    q : ``[B, Hq, D]`` bfloat16 / float16, one query token per sequence.
    cache : :class:`~fp8kv.cache.PagedKVCache` on a CUDA device, every ``seq_lens[i] >= 1``;
        tensor / head / channel scales (token_head raises UnsupportedError).
    mode : ``"dequant"`` (any sm80+ GPU) or ``"fp8"`` (FP8 query; sm100 only, else UnsupportedError
        with the capability table's reason).
    use_tensor_cores, sm_scale : see :class:`FlashInferDecode`; ``sm_scale`` defaults to ``1/sqrt(D)``.
    window, soft_cap : a sliding window (``window_left = window - 1``) and logit soft-capping (dequant
        mode; fp8 mode takes the window only). ``sinks``: refused (UnsupportedError): FlashInfer's
        FA2 decode has no sink term.

    Returns ``out`` ``[B, Hq, D]`` (q's dtype) and ``lse`` ``[B, Hq]`` fp32, natural log.

    One :class:`FlashInferDecode` is kept per cache object and (q dtype, Hq, mode, use_tensor_cores,
    sm_scale); it re-plans when the cache's tables change (e.g. after ``append``). Planning costs a
    host sync, so time the decoder's ``run`` rather than this function.
    """
    # one decoder (and plan) per variant: a model's windowed and global layers do not re-plan each other
    key = (q.dtype, q.shape[1], mode, use_tensor_cores, sm_scale, window, soft_cap)
    per_cache = _DECODERS.setdefault(cache, {})
    dec = per_cache.get(key)
    if dec is None:
        dec = per_cache[key] = FlashInferDecode(cache, use_tensor_cores=use_tensor_cores, mode=mode, trusted=True)
    dec.plan(cache, num_qo_heads=q.shape[1], q_dtype=q.dtype, sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    return dec.run_trusted(q)


# ----------------------------------------------------------------------------------------- prefill
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
    (natural log). Plans on every call (for notebooks, not timing).
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
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r} ({type(causal).__name__}); expected True or False")
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
    ok, why = check("flashinfer", cache.kv_dtype, "dequant", None, cache.granularity, cache.head_dim)
    if not ok:
        raise UnsupportedError(f"flashinfer prefill, kv_dtype={cache.kv_dtype}, "
                               f"granularity={cache.granularity}: {why}")
    ok, why = check_query("flashinfer", q.dtype, cache.kv_dtype)
    if not ok:
        raise TypeError(why)
    fi = _import_flashinfer()
    hq = q.shape[1]
    fold = plan_scales(cache, hq)
    sm_scale = checks.resolved_softmax_scale(sm_scale, cache.head_dim)
    indptr, indices, last = paged_kv_args(cache)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(cache.device), cache.layout)
    wrapper.plan(qo_indptr(lens_q, cache.device), indptr, indices, last, hq, cache.num_kv_heads,
                 cache.head_dim, cache.block_size, causal=bool(causal), pos_encoding_mode="NONE",
                 sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=cache.dtype, o_data_type=q.dtype)
    q_in = apply_q_fold(q if q.stride(-1) == 1 else q.contiguous(), fold)
    out, lse = wrapper.run(q_in, (cache.k_pages, cache.v_pages), k_scale=fold.k_scale,
                           v_scale=fold.v_scale, return_lse=True)
    if fold.out_mult is not None:
        out.mul_(fold.out_mult)
    return out, lse.mul_(LN2)
