"""vLLM's Triton unified-attention kernel over a :class:`~fp8kv.cache.PagedKVCache` (``backend="vllm"``).

vLLM is optional: nothing here imports it until a kernel is asked for, and then a missing install
raises :class:`~fp8kv.capability.UnsupportedError` (:data:`~fp8kv.capability.VLLM_NOT_INSTALLED`).
The translation from fp8kv's cache to the kernel's arguments is pure torch and runs anywhere
(:func:`kernel_args`); :class:`VllmDecode` plans it once and launches the kernel per call.

Facts this module relies on, read in vllm-project/vllm at commit 86a153bd
(``vllm/v1/attention/ops/triton_unified_attention.py`` and ``.../ops/triton_quant_kv/_helpers.py``):

* ``unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k,
  softmax_scale, causal, window_size, block_table, softcap, q_descale, k_descale, v_descale,
  seq_threshold_3D=None, num_par_softmax_segments=None, softmax_segm_output=None,
  softmax_segm_max=None, softmax_segm_expsum=None, alibi_slopes=None, output_scale=None,
  qq_bias=None, sinks=None, mm_prefix_range=None, use_alibi_sqrt=False,
  kv_quant_mode=KVQuantMode.NONE, k_scale_cache=None, v_scale_cache=None)`` writes ``out`` in place
  and returns nothing. It computes no LSE, so this backend returns ``lse=None``.
* ``q``/``out`` ``[tokens, Hq, D]`` (decode: one token per sequence; an attend: ``cu_seqlens_q[i + 1] -
  cu_seqlens_q[i]`` tokens of sequence i, the last of its ``seqused_k`` keys, causal among them), addressed through their first
  two strides; ``cu_seqlens_q`` int32 ``[B + 1]``, the first token of each sequence; ``seqused_k``
  int32 ``[B]``, the keys of each sequence, the query being the last of them; ``block_table`` int32
  ``[B, blocks]`` through its row stride; ``k``/``v`` ``[num_blocks, block_size, Hkv, D]`` through
  their four strides (vLLM's backend passes the halves of its ``[num_blocks, 2, ...]`` cache).
  ``max_seqlen_k`` is not read by this kernel; ``max_seqlen_q > 1`` turns the split path off.
  ``causal`` must be True and ``q_descale`` None ("Q scales not supported").
* Scales: with ``kv_quant_mode=KVQuantMode.FP8_PER_TENSOR`` each loaded K/V tile becomes
  ``(stored.to(fp32) * tl.load(k_descale)).to(q.dtype)``, the first element of
  ``k_descale``/``v_descale`` (vLLM passes ``layer._k_scale.expand(...)``); ``NONE`` casts the pages
  to q's dtype unscaled. vLLM views its uint8 cache as float8 first; fp8kv's FP8 pages are float8.
* Scores ``S = softmax_scale * q·k`` in fp32. ``softcap > 0`` replaces them by ``softcap *
  tanh(S / softcap)`` (from two exps). ``window_size[0] >= 0`` sets ``SLIDING_WINDOW =
  window_size[0] + 1`` and keeps key j when ``query_pos - j < SLIDING_WINDOW`` (vLLM's backend passes
  ``(sliding_window - 1, 0)``). ``sinks`` ``[Hq]`` start the running max at the sink logit with a sum
  of 1 (on the split path in segment 0 only): ``exp(sink)`` joins the denominator once. ``p`` is
  rounded to the value's type for the P·V dot; head_size is padded to the next power of two.
* Two launch shapes: one program per (query block, KV head) over the whole sequence ("2D"), or
  ``num_par_softmax_segments`` programs per sequence and KV head over slices of it, combined by
  ``reduce_segments`` ("3D", split-KV). 3D runs when the three segment buffers (``[tokens, Hq,
  segments, next_pow2(D)]`` and ``[tokens, Hq, segments]`` twice, fp32) are given, ``max_seqlen_q <=
  1``, ``num_seqs <= seq_threshold_3D`` and ``VLLM_BATCH_INVARIANT`` is off. vLLM's Triton attention
  backend (``vllm/v1/attention/backends/triton_attn.py``) takes ``seq_threshold_3D = 128 // Hkv``
  (``MIN_LAUNCH_GRID_SIZE_2D``) and 16 segments (``NUM_PAR_SOFTMAX_SEGMENTS``); fp8kv does the same.
* The kernel loads the block-table entry of every token of a tile (of at most 32 tokens), masked
  tokens included, so a tile can reach past the last block of a row. Where that would run past the
  table's storage, fp8kv passes a copy of the table padded with page 0 (those tokens are masked:
  their pages are never read).
"""

from __future__ import annotations

import importlib
import math
import os
import weakref

import torch

from .. import checks
from ..cache import PagedKVCache
from ..capability import (
    VLLM_NOT_INSTALLED,
    UnsupportedError,
    check,
    check_query,
    check_query_strides,
    vllm_installed,
)
from ..formats import kv_dtype_info

__all__ = ["kernel_args", "split_segments", "launch_info", "VllmDecode", "VllmAttend", "decode", "MIN_LAUNCH_GRID_SIZE_2D",
           "NUM_PAR_SOFTMAX_SEGMENTS", "MAX_TILE_SIZE"]

MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM's triton_attn.py: up to 128 // Hkv sequences take the split (3D) path
NUM_PAR_SOFTMAX_SEGMENTS = 16  # vLLM's triton_attn.py: segments per sequence on the split path
MAX_TILE_SIZE = 32  # the largest TILE_SIZE the kernel's _get_tile_size picks (tokens per tile)
FP16_MAX = float(torch.finfo(torch.float16).max)

# The import names (constants so tests can point them elsewhere).
_KERNEL_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
_QUANT_MODE_MODULE = "vllm.v1.kv_cache_interface"


# ----------------------------------------------------------------------------------------- imports
def _import_kernel():
    """``(unified_attention, KVQuantMode)`` from vLLM, or UnsupportedError saying why they cannot be had."""
    if not vllm_installed():
        raise UnsupportedError(VLLM_NOT_INSTALLED)
    try:
        kernel = importlib.import_module(_KERNEL_MODULE)
        modes = importlib.import_module(_QUANT_MODE_MODULE).KVQuantMode
        return kernel.unified_attention, modes
    except Exception as e:  # another vLLM version, or a broken install: say which import failed
        raise UnsupportedError(
            f"vLLM is installed but {_KERNEL_MODULE}.unified_attention / {_QUANT_MODE_MODULE}.KVQuantMode "
            f"failed to import ({type(e).__name__}: {e}); fp8kv follows the kernel of vLLM commit 86a153bd") from e


# ---------------------------------------------------------------------------- argument translation
def _batch_invariant() -> bool:
    # vLLM's launcher takes the 2D path whatever the buffers when this is set (read as vllm.envs reads it).
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")


def split_segments(batch: int, num_kv_heads: int) -> int:
    """Segments per sequence of a decode of ``batch`` sequences over ``num_kv_heads`` KV heads:
    :data:`NUM_PAR_SOFTMAX_SEGMENTS` on the split ("3D") path, which vLLM's backend takes up to
    ``MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads`` sequences, else 1 (the "2D" path). Both positive ints."""
    batch = checks.positive_int(batch, "batch")
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")  # 0 divided by zero
    if _batch_invariant() or batch > MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads:
        return 1
    return NUM_PAR_SOFTMAX_SEGMENTS


def launch_info(batch: int, num_kv_heads: int) -> dict:
    """What a decode of ``batch`` sequences launches, for the benchmark's rows: ``kernel``
    (``"vllm-3d"`` split-KV or ``"vllm-2d"``), ``num_splits`` (segments per sequence) and
    ``tensor_cores`` (True: the kernel's dots are tl.dot)."""
    segments = split_segments(batch, num_kv_heads)
    return {"kernel": "vllm-3d" if segments > 1 else "vllm-2d", "num_splits": segments, "tensor_cores": True}


def _table_width(blocks: int, block_size: int) -> int:
    """Block-table columns the kernel may load for a row of ``blocks`` blocks: the pages of whole tiles of
    :data:`MAX_TILE_SIZE` tokens (rounded up: a page size need not divide the tile)."""
    return math.ceil(math.ceil(blocks * block_size / MAX_TILE_SIZE) * MAX_TILE_SIZE / block_size)


def _num_q_heads(cache: PagedKVCache, num_q_heads) -> int:
    """``num_q_heads`` as a positive int that is a multiple of the cache's KV heads."""
    hq = checks.positive_int(num_q_heads, "num_q_heads")
    if hq % cache.num_kv_heads:
        checks.fail(f"num_q_heads={hq} is not a multiple of the cache's {cache.num_kv_heads} KV heads")
    return hq


def kernel_args(cache: PagedKVCache, num_q_heads: int, *, sm_scale: float | None = None, window: int | None = None,
                soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                qo_indptr: torch.Tensor | None = None, qo_lens: list[int] | None = None) -> dict:
    """The keyword arguments of vLLM's ``unified_attention`` for a decode over ``cache`` (or, with ``qo_indptr``
    and ``qo_lens``, an attend of several new tokens per sequence), but ``q`` and ``out`` (given per call).

    Parameters
    ----------
    cache : an NHD cache (else UnsupportedError); FP8 caches with per-tensor scales only.
    num_q_heads : query heads Hq, a multiple of the cache's Hkv.
    sm_scale : default ``1 / sqrt(D)``.
    window, soft_cap, sinks : as :func:`fp8kv.reference.decode` defines them (trusted: checked by
        :func:`fp8kv.decode`).
    qo_indptr, qo_lens : an attend's row offsets ``[B + 1]`` (int32 / int64 on the cache's device) and its
        new-token counts (ints), trusted (checked by :func:`fp8kv.attend`): ``cu_seqlens_q`` is ``qo_indptr`` as
        int32 (a device copy where it is int64) and ``max_seqlen_q`` the longest count, which vLLM's kernel
        takes natively (query j of sequence i at position ``seq_lens[i] - qo_lens[i] + j``, causal). None:
        a decode, one query per sequence.

    Returns a dict: the cache's own tensors for ``k``, ``v``, ``seqused_k`` (seq_lens), ``block_table``
    (a copy, padded with page 0 where a tile could load past the table, :func:`_table_width`) and
    ``k_descale``/``v_descale`` (``[1]`` views of the cache's scales, read when the kernel runs);
    ``cu_seqlens_q = arange(B + 1)`` int32, ``max_seqlen_q = 1``, ``causal=True``, ``q_descale=None``,
    ``window_size = (window - 1, 0)`` or ``(-1, -1)`` (also for a window as long as the capacity),
    ``softcap`` (0.0: off; vLLM's tanh comes from two exps and turns to NaN once a scaled score
    exceeds about 88 times the cap), ``sinks``, and
    ``kv_quant_mode`` by its *name* in ``KVQuantMode`` (``"FP8_PER_TENSOR"`` or ``"NONE"``). With
    :func:`split_segments` > 1 (and, for an attend, every count 1: vLLM's split path takes one query per
    sequence) also the split path's threshold, segment count and fp32 buffers, one row per query. No host sync.
    """
    if not isinstance(cache, PagedKVCache):
        checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
    if cache.layout != "NHD":
        raise UnsupportedError(f"vLLM's kernel reads pages laid out [num_blocks, block_size, Hkv, D] (NHD); the "
                               f"cache is {cache.layout}")
    if cache.is_fp8 and cache.granularity != "tensor":
        raise UnsupportedError(f"vLLM's FP8_PER_TENSOR mode reads one k and one v scale; the cache has "
                               f"granularity={cache.granularity!r}")
    hkv, d, bs, batch = cache.num_kv_heads, cache.head_dim, cache.block_size, cache.batch_size
    hq = _num_q_heads(cache, num_q_heads)
    dev = cache.device
    # A copy, padded with page 0 where a tile could load past the table (masked tokens only): the plan
    # holds the table as it was planned, whatever the width, and is rebuilt when the tables change.
    width = max(_table_width(cache.max_blocks_per_seq, bs), cache.block_table.shape[1])
    table = torch.nn.functional.pad(cache.block_table, (0, width - cache.block_table.shape[1]))
    if window is not None and window >= cache.max_blocks_per_seq * bs:
        window = None  # the whole sequence (vLLM's window is a 32-bit compile-time constant)
    if qo_lens is None:
        rows, longest = batch, 1
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    else:
        rows, longest = sum(qo_lens), max(max(qo_lens, default=1), 1)
        cu_seqlens_q = qo_indptr.to(torch.int32)
    args = dict(
        k=cache.k_pages, v=cache.v_pages, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=longest,
        seqused_k=cache.seq_lens, max_seqlen_k=cache.max_blocks_per_seq * bs,
        softmax_scale=float(checks.resolved_softmax_scale(sm_scale, d)), causal=True,
        window_size=(-1, -1) if window is None else (window - 1, 0),
        block_table=table, softcap=0.0 if soft_cap is None else float(soft_cap),
        q_descale=None, k_descale=cache.k_scale.reshape(1), v_descale=cache.v_scale.reshape(1),
        sinks=None if sinks is None else sinks.contiguous(),
        kv_quant_mode="FP8_PER_TENSOR" if cache.is_fp8 else "NONE",
    )
    segments = split_segments(batch, hkv)
    if segments > 1 and (qo_lens is None or all(n == 1 for n in qo_lens)):
        d_pad = 1 << (d - 1).bit_length()
        args.update(seq_threshold_3D=MIN_LAUNCH_GRID_SIZE_2D // hkv, num_par_softmax_segments=segments,
                    softmax_segm_output=torch.empty(rows, hq, segments, d_pad, dtype=torch.float32, device=dev),
                    softmax_segm_max=torch.empty(rows, hq, segments, dtype=torch.float32, device=dev),
                    softmax_segm_expsum=torch.empty(rows, hq, segments, dtype=torch.float32, device=dev))
    return args


# ------------------------------------------------------------------------------------------ decode
class VllmDecode:
    """Plan once, run many: vLLM's ``unified_attention`` over one cache.

    Parameters
    ----------
    cache : the :class:`~fp8kv.cache.PagedKVCache` (NHD; FP8 with per-tensor scales, or 16-bit), every
        ``seq_lens[i] >= 1``.
    num_q_heads : the query heads Hq of the calls.
    sm_scale, window, soft_cap, sinks : as :func:`fp8kv.decode`.
    trusted : a bool. True: :func:`fp8kv.decode` / :func:`fp8kv.backends.planned` checked the input and the
        capability table already; a user's decoder (False) checks them here.

    The constructor checks its arguments and the lengths (one host sync), then the capability table
    (untrusted), and only then imports vLLM's kernel (UnsupportedError if it cannot: a bad argument is named
    even where vLLM is missing); it reads the scales and builds :func:`kernel_args`; ``run(q)`` is device work
    only (capturable in a CUDA graph). The plan reads the pages, scales and ``seq_lens`` when it runs, so
    refill those in place; it holds a copy of the block table, so build a new decoder after the
    tables change (``append``, ``write`` of new tokens). A length set to 0 after planning is not
    checked again (vLLM's split path then divides by zero).

    vLLM's kernel casts each dequantized element (stored × scale) to the query's type: an fp16 query
    over an FP8 cache whose scale lets a value pass fp16's 65504 is refused (it would be inf, and the
    output NaN).
    """

    def __init__(self, cache: PagedKVCache, *, num_q_heads: int, sm_scale: float | None = None,
                 window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                 trusted: bool = False):
        checks.flag(trusted, "trusted")  # "no" is truthy: it would skip every check below
        if not isinstance(cache, PagedKVCache):
            checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
        num_q_heads = _num_q_heads(cache, num_q_heads)
        if not trusted:
            # The arguments first: the capability table also says whether vLLM is installed, and that
            # refusal must not hide a bad argument.
            if sm_scale is not None:
                sm_scale = checks.positive_float(sm_scale, "sm_scale")
            window, soft_cap, sinks = checks.attention_variant(window, soft_cap, sinks, num_q_heads=num_q_heads,
                                                               device=cache.device)
            cache.validate_tables()
        lens = cache.seq_lens.detach().cpu()
        if int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0])
            checks.fail(f"seq_lens[{i}]={int(lens[i])}: decode needs at least one cached token per sequence (the "
                        "query is the last of them)")
        if not trusted:
            ok, why = check("vllm", cache.kv_dtype, "dequant", None, cache.granularity, cache.head_dim, cache.layout)
            if not ok:
                raise UnsupportedError(f"vllm backend, kv_dtype={cache.kv_dtype}, granularity={cache.granularity}: "
                                       f"{why}")
        self._launch_over(cache, kernel_args(cache, num_q_heads, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                                             sinks=sinks), (cache.batch_size, num_q_heads, cache.head_dim))

    def _launch_over(self, cache: PagedKVCache, args: dict, shape: tuple[int, int, int]) -> None:
        """Import vLLM's kernel and fix its launch: ``args`` (:func:`kernel_args`) for queries of ``shape``."""
        unified_attention, quant_modes = _import_kernel()
        self.args = args
        # The largest value a page can dequantize to, for the fp16-query check in run_trusted.
        fmt = kv_dtype_info(cache.kv_dtype)[2]
        self._largest = float(torch.maximum(cache.k_scale.max(), cache.v_scale.max())) * fmt.max if fmt else 0.0
        self._kernel = unified_attention
        self._launch = {**args, "kv_quant_mode": quant_modes[args["kv_quant_mode"]]}
        # the table is copied, the fp16 range read from the scales: a run after they change is refused
        self._cache_ref = weakref.ref(cache)
        self._stamp = cache.stamp(("block_table", "k_scale", "v_scale"), ("seq_lens", "k_pages", "v_pages"))
        self.kv_dtype = cache.kv_dtype
        self.shape = shape
        self.device = cache.device

    def run(self, q: torch.Tensor):
        """Decode attention for ``q`` ``[B, Hq, D]`` (bf16/fp16; a 16-bit cache's own type; last dim
        contiguous). Returns ``out`` ``[B, Hq, D]`` in q's dtype and ``lse=None`` (the kernel has none)."""
        if not isinstance(q, torch.Tensor) or tuple(q.shape) != self.shape:
            checks.fail(f"q must be {list(self.shape)} (as planned); got {tuple(getattr(q, 'shape', ()))}")
        ok, why = check_query("vllm", q.dtype, self.kv_dtype)
        if not ok:
            checks.fail(why, TypeError)
        if q.device != self.device:
            checks.fail(f"q is on {q.device} but the cache is on {self.device}")
        check_query_strides("vllm", q)
        return self.run_trusted(q)

    def run_trusted(self, q: torch.Tensor):
        """:meth:`run` without its checks of ``q``, for a query :func:`fp8kv.decode` already validated
        (but the fp16 range, which only this plan knows, and the cache's arrays against the plan's copies by their
        identity, shape and version counter: metadata, no host sync)."""
        cache = self._cache_ref()
        if cache is not None:
            cache.check_stamp(self._stamp, "vLLM's plan (a copy of the block table, the scales' range)")
        if q.dtype == torch.bfloat16 and q.device.type == "cpu" and self._kernel.__module__ == _KERNEL_MODULE:
            raise UnsupportedError("q is bf16 on the CPU: there vLLM's Triton kernel runs under the Triton "
                                   "interpreter, whose bf16 arithmetic is wrong; pass an fp16 query")
        if q.dtype == torch.float16 and self._largest > FP16_MAX:
            checks.fail(f"q is float16 but the cache's k_scale/v_scale let a dequantized value reach "
                        f"{self._largest:.4g}: vLLM's kernel casts each one to the query's type, and fp16 ends at "
                        f"{FP16_MAX:g} (inf, then NaN); pass a bfloat16 query")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if q.shape[0]:  # an attend without new tokens launches nothing
            self._kernel(q=q, out=out, **self._launch)
        return out, None

    __call__ = run


class VllmAttend(VllmDecode):
    """Plan once, run many: vLLM's ``unified_attention`` over one cache for several new tokens per sequence
    (``fp8kv.attend``'s ``"vllm"`` backend): the new tokens of sequence i are the last ``qo_lens[i]`` of its row,
    causal among them, as :func:`fp8kv.reference.attend` defines them.

    Built only from input :func:`fp8kv.attend` / :func:`fp8kv.backends.planned_attend` checked (the query, the
    counts, the variants and the capability table): ``qo_indptr`` ``[B + 1]`` and its counts ``qo_lens`` (ints),
    ``num_q_heads`` and the variants as :class:`VllmDecode` takes them. Checked here: every ``seq_lens[i] >= 1``
    (one host sync). ``run(q)`` (``q`` ``[sum(qo_lens), Hq, D]``) is device work only; the plan holds a copy of
    the block table and ``qo_indptr`` as int32 (a copy where it is int64), so build a new one after they change.
    """

    def __init__(self, cache: PagedKVCache, qo_indptr: torch.Tensor, qo_lens: list[int], *, num_q_heads: int,
                 sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None):
        if not isinstance(cache, PagedKVCache):
            checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
        num_q_heads = _num_q_heads(cache, num_q_heads)
        lens = cache.seq_lens.detach().cpu()
        if int(lens.min()) < 1:
            i = int((lens < 1).nonzero()[0])
            checks.fail(f"seq_lens[{i}]={int(lens[i])}: vLLM's kernel needs at least one cached token per sequence")
        self._launch_over(cache, kernel_args(cache, num_q_heads, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                                             sinks=sinks, qo_indptr=qo_indptr, qo_lens=list(qo_lens)),
                          (sum(qo_lens), num_q_heads, cache.head_dim))


def decode(q: torch.Tensor, cache: PagedKVCache, *, mode: str = "dequant", sm_scale: float | None = None,
           window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    """vLLM's paged decode: the ``backend="vllm"`` entry of :func:`fp8kv.decode`, which validates the
    input and checks capability (dequant mode only; NHD; FP8 with per-tensor scales), so this does neither.

    Returns ``out`` ``[B, Hq, D]`` (q's dtype) and ``lse=None``: vLLM's kernel computes no LSE.
    Plans on every call (a host sync): time :class:`VllmDecode`'s ``run`` instead.
    """
    if mode != "dequant":  # the capability table refuses it first; say so here too rather than ignore it
        raise UnsupportedError(f"mode={mode!r}: vLLM's kernel runs in dequant mode only (it takes no query scale)")
    dec = VllmDecode(cache, num_q_heads=q.shape[1], sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                     sinks=sinks, trusted=True)
    return dec.run_trusted(q)
