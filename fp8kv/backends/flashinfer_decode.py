"""FlashInfer paged decode (one query token per sequence): :class:`FlashInferDecode` (plan once, run many)
and :func:`decode`, the ``backend="flashinfer"`` entry of :func:`fp8kv.decode`. FlashInfer's wheel facts
this relies on: :mod:`fp8kv.backends.flashinfer`."""

from __future__ import annotations

import weakref

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
)
from ..formats import FORMATS
from .flashinfer_args import (
    DEFAULT_WORKSPACE_BYTES,
    LN2,
    import_flashinfer,
    paged_kv_args,
    plan_growing,
    window_left,
    workspace,
)
from .flashinfer_scales import ScaleFold, apply_q_fold, plan_scales

__all__ = ["FlashInferDecode", "decode", "CUDA_CORE_GROUP_SIZES", "FP8_Q_MAX"]

CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)  # DISPATCH_GQA_GROUP_SIZE of the CUDA-core decode kernel
FP8_Q_MAX = FORMATS["e4m3"].max  # the FP8 query of the sm100 path is e4m3

# decode()'s decoders, per cache object: dying caches take their entries (and plans) with them.
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_key(cache: PagedKVCache, num_qo_heads, q_dtype, sm_scale, window=None, soft_cap=None):
    """What a plan depends on: tables and scales by identity, shape and in-place version."""
    parts = [id(cache), id(cache.k_pages), num_qo_heads, q_dtype, sm_scale, window, soft_cap]
    for t in (cache.block_table, cache.seq_lens, cache.k_scale, cache.v_scale):
        parts += [id(t), tuple(t.shape), checks.version_counter(t)]
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
        fi = import_flashinfer()
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
        return buf, import_flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            buf, self.layout, use_cuda_graph=self.use_cuda_graph, use_tensor_cores=self.use_tensor_cores, **bufs)

    def _plan_dequant(self, cache: PagedKVCache, *args, **kwargs) -> None:
        """The FA2 wrapper's ``plan``. Where its scratch outgrows the float workspace (many query heads
        per KV head at long contexts: Falcon's 71 need ~600 MiB at 64 x 16k), a wrapper over a workspace
        twice as large plans instead, up to :data:`MAX_WORKSPACE_BYTES`; it replaces the current one
        only once its plan succeeded. A decoder built with ``use_cuda_graph`` never swaps its buffers
        (a captured graph would replay the old ones): it says which ``workspace_bytes`` to pass."""
        workspace_buf, wrapper = plan_growing(self._workspace, self._wrapper, lambda n: self._new_wrapper(cache, n),
                                               self.use_cuda_graph, *args, **kwargs)
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
        self._stamp = cache.stamp()  # the page table, lengths and scales FlashInfer's plan holds
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
        # metadata only (identity, shape, version counter): no host sync
        cache.check_stamp(self._stamp, "FlashInfer's plan (page table, lengths, folded scales)")
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
