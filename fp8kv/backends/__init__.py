"""``fp8kv.decode`` and ``fp8kv.attend``: the one entry points of paged decode attention (one query token per
sequence) and of multi-token attention (several new tokens per sequence: speculative verification, chunked
prefill), and the backend registries.

Input is validated here, once; the backends below (the fp32 oracle's computation, the Triton
launcher, FlashInfer's wrapper, vLLM's Triton kernel) trust what they are given. FlashInfer and vLLM
are imported only when asked for, so fp8kv imports on machines without them.
"""

from __future__ import annotations

import functools

import torch

from .. import checks
from ..attend_checks import (
    ATTEND_BACKEND_OPTIONS,
    ATTEND_KERNEL_OPTIONS,
    attend_query,
    check_counts_unchanged,
    qo_indptr_arg,
)
from ..cache import check_paged_cache
from ..capability import (
    AUTO_MODE,
    BACKEND_NAMES,
    MODES,
    UnsupportedError,
    check_query,
    check_query_strides,
    check_variants,
    choose_backend,
)
from ..capability import check as supported
from ..launch_options import backend_options

__all__ = ["decode", "planned", "attend", "planned_attend", "BACKENDS", "ATTEND_BACKENDS", "LAUNCH_OPTIONS",
           "ATTEND_LAUNCH_OPTIONS"]

DECODE_MODES = ("auto", *MODES)  # what fp8kv.decode takes: "auto" picks AUTO_MODE


def _reference(q, cache, *, mode, sm_scale, **variants):
    from ..reference import paged_attention

    return paged_attention(q, cache, sm_scale, **variants)


def _triton(q, cache, *, mode, sm_scale, **launch):
    from ..ops.decode import plan, run

    return run(plan(q, cache, mode=mode, sm_scale=sm_scale, **launch), q, cache)


def _flashinfer(q, cache, *, mode, sm_scale, **launch):
    from .flashinfer import decode as fi_decode

    return fi_decode(q, cache, mode=mode, sm_scale=sm_scale, **launch)


def _vllm(q, cache, *, mode, sm_scale, **variants):
    from .vllm import decode as vllm_decode

    return vllm_decode(q, cache, mode=mode, sm_scale=sm_scale, **variants)


# The runner of each backend, in the order fp8kv.capability.BACKEND_NAMES names them (the one list of names).
BACKENDS = dict(zip(BACKEND_NAMES, (_reference, _triton, _flashinfer, _vllm), strict=True))
# Options a backend takes beyond (q, cache, mode, sm_scale), from the option table (fp8kv.launch_options); each
# backend validates their values.
LAUNCH_OPTIONS = {backend: backend_options(backend) for backend in BACKEND_NAMES}


def decode(q, cache, backend: str = "auto", mode: str = "auto", *, sm_scale: float | None = None,
           window: int | None = None, soft_cap: float | None = None, sinks=None, check: bool = True, **launch):
    """Paged decode attention through the chosen backend.

    Parameters
    ----------
    q : ``[B, Hq, D]`` query, one token per sequence: bf16 / fp16 (the reference also takes fp32);
        Hq a multiple of the cache's Hkv.
    cache : :class:`~fp8kv.cache.PagedKVCache`.
    backend : ``"auto"``, ``"reference"``, ``"triton"``, ``"flashinfer"`` or ``"vllm"`` (vLLM's Triton
        unified-attention kernel: NHD caches, dequant mode, FP8 with per-tensor scales). ``auto``
        picks per :mod:`fp8kv.capability` for this device (Triton on a GPU, else the reference; never vLLM).
    mode : ``"auto"``, ``"dequant"`` or ``"fp8"``.
    sm_scale : softmax scale, a positive finite number; default ``1 / sqrt(D)``.
    window, soft_cap, sinks : attention variants (defined in :func:`fp8kv.reference.decode`): a
        sliding window of ``window`` tokens (int >= 1), logit soft-capping ``cap * tanh(s / cap)``
        (0 < ``soft_cap`` <= 1e30, ``fp8kv.checks.MAX_SOFT_CAP``), and per-query-head sink logits (fp32 ``[Hq]`` on q's device). None: off.
        A backend without one raises UnsupportedError with the reason (``fp8kv.capability.variants``).
        vLLM's soft cap takes tanh from two exps: NaN once a scaled score passes about 88 × the cap.
    check : validate the *contents* too (default): q finite, sinks finite and within
        ±``fp8kv.checks.MAX_SINK``, the cache's tables (``seq_lens`` within each row's capacity and at
        least 1, every block-table entry that holds tokens inside
        the page pool) and its scales (positive, finite), which catches tables or scales edited in
        place after the cache was built. It costs a host sync, so a CUDA-graph capture or a timed
        loop passes ``check=False`` after one checked call; shapes, dtypes, devices and scalars
        (the cache's pages, tables and scales included: ``PagedKVCache.validate_arrays``) are
        validated either way. Without the
        check a corrupt table cannot make a kernel read outside the pages (fp8kv's kernels clamp the
        indices; FlashInfer and vLLM, which do not, have the tables checked on every call), but the
        result is then meaningless; so is one for contents the check would refuse (a sink past
        ±1e38: lse -inf; an empty row: out 0, lse -inf): with ``check=False`` they are the caller's promise.
    launch : backend options, see ``LAUNCH_OPTIONS`` (Triton's launch overrides and its opt-in
        CUDA-core kernel, ``use_tensor_cores=False``; FlashInfer's ``use_tensor_cores``).

    Returns ``out`` ``[B, Hq, D]`` and ``lse`` ``[B, Hq]`` fp32 (natural log); ``lse`` is None for
    ``backend="vllm"``, whose kernel computes none.

    Raises ``TypeError``/``ValueError`` naming the argument for bad input, and
    :class:`~fp8kv.capability.UnsupportedError` (a ValueError) with the capability table's reason
    when the combination cannot run here.
    """
    backend, mode, sm_scale, variants = _validate(q, cache, backend, mode, sm_scale, window, soft_cap, sinks,
                                                  check, launch)
    return BACKENDS[backend](q, cache, mode=mode, sm_scale=sm_scale, **variants, **launch)


def _validate(q, cache, backend, mode, sm_scale, window, soft_cap, sinks, check, launch) -> tuple:
    """:func:`decode`'s input checks, each once; returns the resolved ``(backend, mode, sm_scale, variants)``,
    ``sm_scale`` a number (its default resolved here for every backend)."""
    _cache_arg(cache)
    cache.check_query(q)
    return _validated(q, cache, backend, mode, sm_scale, window, soft_cap, sinks, check, launch, op="decode")


def _cache_arg(cache) -> None:
    check_paged_cache(cache)


def _validated(q, cache, backend, mode, sm_scale, window, soft_cap, sinks, check, launch, *, op: str) -> tuple:
    """The checks :func:`decode` and :func:`attend` share, each once, after the query's own (its shape against
    the cache): the backend, mode and check flag, the variants and sm_scale, the cache's arrays and tables, the
    query's values and strides, the capability table for ``op`` and the backend's options."""
    registry = BACKENDS if op == "decode" else ATTEND_BACKENDS
    options = LAUNCH_OPTIONS if op == "decode" else ATTEND_LAUNCH_OPTIONS
    checks.one_of(backend, "backend", ("auto", *registry))
    checks.one_of(mode, "mode", DECODE_MODES)
    if not isinstance(check, bool):
        checks.fail(f"check={check!r}; expected True or False", TypeError)
    window, soft_cap, sinks = checks.attention_variant(window, soft_cap, sinks, num_q_heads=q.shape[1],
                                                       device=q.device, contents=check)
    if sm_scale is not None:  # its range depends on the cap it is folded with
        sm_scale = checks.softmax_scale(sm_scale, soft_cap)
    if backend == "auto" and q.dtype == torch.float32:
        backend = "reference"  # the GPU kernels take 16-bit queries; the oracle takes fp32 as it is
    cache.validate_arrays(contents=check)  # pages, tables and scales replaced since the cache was built

    # The capability table is asked once: by the search for a backend, or about the one named.
    mode = AUTO_MODE if mode == "auto" else mode
    chosen = backend == "auto"
    if chosen:
        backend = choose_backend(cache.kv_dtype, mode, None, cache.granularity, cache.head_dim, op=op)
    variants = {k: v for k, v in dict(window=window, soft_cap=soft_cap, sinks=sinks).items() if v is not None}
    check_variants(backend, mode, variants, op=op)  # a variant the backend lacks is named before anything else
    check_query_strides(backend, q)  # the kernels address head_dim with stride 1
    if not chosen:
        ok, why = supported(backend, cache.kv_dtype, mode, None, cache.granularity, cache.head_dim, cache.layout,
                            op=op)
        if not ok:
            raise UnsupportedError(f"backend={backend}, mode={mode}, kv_dtype={cache.kv_dtype}, "
                                   f"granularity={cache.granularity}: {why}")
    ok, why = check_query(backend, q.dtype, cache.kv_dtype)
    if not ok:
        checks.fail(why, TypeError)
    unknown = sorted(set(launch) - set(options[backend]))
    if unknown:
        checks.fail(f"{unknown[0]}={launch[unknown[0]]!r} is not an option of the {backend} backend; it takes "
                    f"{options[backend] or 'none'}", TypeError)
    # The contents last (a host sync), after every argument: FlashInfer and vLLM read the table as it is (no
    # clamping), and their plans sync with the host anyway.
    if check or backend in ("flashinfer", "vllm"):
        # a decode's empty row: refused for every backend alike; an attend's row without tokens has no query
        cache.validate_tables(nonempty=check and op == "decode")
    if check:
        checks.finite_tensor(q, "q")
    return backend, mode, checks.resolved_softmax_scale(sm_scale, cache.head_dim), variants


def planned(q, cache, backend: str = "auto", mode: str = "auto", *, sm_scale: float | None = None,
            window: int | None = None, soft_cap: float | None = None, sinks=None, **launch):
    """Plan once, run many: validate as :func:`decode` does with ``check=True`` (once, here), do the
    backend's host work (fp8kv's plan of kernel and launch, FlashInfer's plan, vLLM's arguments), and return a
    zero-argument callable that runs the decode of ``q`` over ``cache`` with no host sync left (CUDA-graph
    capturable for the Triton, FlashInfer and vLLM backends; the reference syncs with the host by its nature).

    The callable is ``functools.partial(run, plan, ...)``: its first argument (``.args[0]``) is the backend's plan,
    for the Triton backend a :class:`fp8kv.ops.DecodePlan` (``.kernel``, ``.config``: what runs).

    Arguments as :func:`decode`. The callable returns ``(out, lse)`` as :func:`decode` would; it
    reads ``q`` and the cache's tensors when called, so refill them in place between calls, and
    plan again after the cache's tables change (``append``, ``write`` of new tokens): the Triton plan stays valid
    (it reads lengths, tables and scales on the device, its splits tile each row's capacity), FlashInfer's and
    vLLM's hold copies and raise ValueError naming the array (its version counter moved: metadata, no host sync).
    A query or cache of other shapes, dtypes, device or format is refused by the Triton plan the same way.
    """
    backend, mode, sm_scale, variants = _validate(q, cache, backend, mode, sm_scale, window, soft_cap, sinks,
                                                  True, launch)
    if backend == "triton":
        from ..ops.decode import plan, run

        return functools.partial(run, plan(q, cache, mode=mode, sm_scale=sm_scale, **variants, **launch), q, cache)
    if backend == "flashinfer":
        from .flashinfer import FlashInferDecode

        dec = FlashInferDecode(cache, mode=mode, trusted=True, **launch)
        dec.plan(cache, num_qo_heads=q.shape[1], q_dtype=q.dtype, sm_scale=sm_scale, **variants)
        return functools.partial(FlashInferDecode.run_trusted, dec, q)
    if backend == "vllm":
        from .vllm import VllmDecode

        dec = VllmDecode(cache, num_q_heads=q.shape[1], sm_scale=sm_scale, trusted=True, **variants)
        return functools.partial(VllmDecode.run_trusted, dec, q)
    return functools.partial(_reference, q, cache, mode=mode, sm_scale=sm_scale, **variants)


# ------------------------------------------------------------------------------------ multi-token queries
def _attend_reference(q, cache, qo_indptr, qo_lens, *, mode, sm_scale, **variants):
    from ..reference import paged_attend

    return paged_attend(q, cache, qo_lens, sm_scale, **variants)  # checked where it entered, counts read once


def _attend_plan_triton(q, cache, qo_indptr, qo_lens, *, mode, sm_scale, **launch):
    from ..ops.attend import plan_attend, run_attend
    from ..ops.decode.planning import gluon_choice

    gluon = gluon_choice(launch.pop("gluon", None))
    attend_kernel = any(launch.get(k) is not None for k in ATTEND_KERNEL_OPTIONS)
    if qo_lens and len(set(qo_lens)) == 1 and qo_lens[0] >= 1 and not attend_kernel:
        from ..ops.decode import plan, plan_rows, run

        rest = {k: v for k, v in launch.items() if k not in ATTEND_KERNEL_OPTIONS}
        if qo_lens[0] == 1:
            # One new token per sequence is a decode: the decode's plan (its Gluon tile path where that runs), so
            # fp8kv.attend and fp8kv.decode give the same answer, bit for bit, at the decode's speed.
            return functools.partial(run, plan(q, cache, mode=mode, sm_scale=sm_scale, gluon=gluon, **rest), q, cache)
        # As many new tokens in every sequence (speculative verification): the Gluon kernel reads each K/V tile
        # once for all of a KV head's (token, head) rows, where it runs
        rows = plan_rows(q, cache, qo_lens[0], mode=mode, sm_scale=sm_scale, gluon=gluon, **rest)
        if not isinstance(rows, str):
            return functools.partial(run, rows, q, cache)
        if gluon:
            raise UnsupportedError(f"gluon=True: {rows}")
    elif gluon:
        raise UnsupportedError("gluon=True: the Gluon kernel takes as many new tokens in every sequence and no launch "
                               f"option of the attend kernel {ATTEND_KERNEL_OPTIONS}")
    return functools.partial(run_attend, plan_attend(q, cache, qo_indptr, mode=mode, sm_scale=sm_scale,
                                                     qo_lens=qo_lens, **launch), q, cache, qo_indptr)


def _attend_plan_flashinfer(q, cache, qo_indptr, qo_lens, *, mode, sm_scale, **variants):
    from .flashinfer import FlashInferAttend

    runner = FlashInferAttend(cache, trusted=True)
    runner.plan(cache, qo_lens, num_qo_heads=q.shape[1], q_dtype=q.dtype, sm_scale=sm_scale, **variants)
    return functools.partial(FlashInferAttend.run_trusted, runner, q)


def _attend_plan_vllm(q, cache, qo_indptr, qo_lens, *, mode, sm_scale, **variants):
    from .vllm import VllmAttend

    runner = VllmAttend(cache, qo_indptr, qo_lens, num_q_heads=q.shape[1], sm_scale=sm_scale, **variants)
    return functools.partial(VllmAttend.run_trusted, runner, q)


def _attend_plan_reference(q, cache, qo_indptr, qo_lens, **kwargs):
    return functools.partial(_attend_reference, q, cache, qo_indptr, qo_lens, **kwargs)


# Each backend's planner of an attend (host work once; the callable it returns runs it), in BACKEND_NAMES' order.
ATTEND_BACKENDS = dict(zip(BACKEND_NAMES, (_attend_plan_reference, _attend_plan_triton, _attend_plan_flashinfer,
                                           _attend_plan_vllm), strict=True))
# Options an attend's backend takes beyond (q, cache, qo_indptr, mode, sm_scale) and the variants.
ATTEND_LAUNCH_OPTIONS = {backend: ATTEND_BACKEND_OPTIONS if backend == "triton" else () for backend in BACKEND_NAMES}


def _validate_attend(q, cache, qo_indptr, backend, mode, sm_scale, window, soft_cap, sinks, check, launch) -> tuple:
    """:func:`attend`'s input checks, each once (:func:`_validated`'s, then ``qo_indptr``'s: one host read of the
    counts, which the plans need anyway); returns ``(backend, mode, sm_scale, variants, qo_lens)``."""
    _cache_arg(cache)
    attend_query(q, cache)
    backend, mode, sm_scale, variants = _validated(q, cache, backend, mode, sm_scale, window, soft_cap, sinks, check,
                                                   launch, op="attend")
    return backend, mode, sm_scale, variants, qo_indptr_arg(qo_indptr, cache, q.shape[0])


def attend(q, cache, qo_indptr, backend: str = "auto", mode: str = "auto", *, sm_scale: float | None = None,
           window: int | None = None, soft_cap: float | None = None, sinks=None, check: bool = True, **launch):
    """Paged attention of several new tokens per sequence (speculative verification, chunked-prefill append)
    through the chosen backend.

    Parameters
    ----------
    q : ``[total_q, Hq, D]`` query: bf16 / fp16 (the reference also takes fp32), the new tokens of every sequence
        back to back; Hq a multiple of the cache's Hkv.
    cache : :class:`~fp8kv.cache.PagedKVCache` that already holds the new tokens: those of sequence i are the
        last ``qo_len[i]`` of its row.
    qo_indptr : int32 / int64 ``[B + 1]`` on the cache's device: ``qo_indptr[0] = 0``, non-decreasing,
        ``qo_indptr[B] = total_q``, ``qo_len[i] = qo_indptr[i + 1] - qo_indptr[i] <= seq_lens[i]``. Query j of
        sequence i sits at position ``seq_lens[i] - qo_len[i] + j`` and attends keys up to it (causal).
    backend : ``"auto"``, ``"reference"`` (:func:`fp8kv.reference.attend`), ``"triton"`` (fp8kv's multi-token
        kernel, :mod:`fp8kv.ops.attend`), ``"flashinfer"`` (``BatchPrefillWithPagedKVCacheWrapper``; every
        ``seq_lens[i] >= 1``) or ``"vllm"`` (``unified_attention`` with ``cu_seqlens_q = qo_indptr``; every
        ``seq_lens[i] >= 1``; no LSE). What runs where: :func:`fp8kv.capability.check` with ``op="attend"``.
    mode, sm_scale, window, soft_cap, sinks, check : as :func:`decode` (``check``: q and sinks finite, the cache's
        tables and scales; ``qo_indptr`` is checked either way, its counts being read for the plan).
    launch : the triton backend's options (:data:`ATTEND_LAUNCH_OPTIONS`: out_dtype, convert, the launch
        overrides of :func:`fp8kv.ops.attend.attend_launch`, and ``gluon``, the kernel: None picks, True asks for
        the Gluon kernel, False for the Triton kernels); the other backends take none.

    Which Triton kernel runs: with ``qo_len = 1`` everywhere the decode's plan, so the answer is :func:`decode`'s
    (bit for bit, as on the reference); with as many new tokens in every sequence (speculative verification) the
    Gluon decode kernel, a KV head's (token, head) rows in its programs, where it runs
    (:func:`fp8kv.ops.decode.plan_rows` says why not); else, or with a launch option of the attend kernel, the
    attend kernel (:mod:`fp8kv.ops.attend`).

    Returns ``out`` ``[total_q, Hq, D]`` and ``lse`` ``[total_q, Hq]`` fp32 (natural log; None for vLLM).

    Raises ``TypeError``/``ValueError`` naming the argument for bad input, and
    :class:`~fp8kv.capability.UnsupportedError` with the capability table's reason where the combination cannot
    run here. Plans on every call (a host sync): time :func:`planned_attend`'s callable instead.
    """
    backend, mode, sm_scale, variants, qo_lens = _validate_attend(q, cache, qo_indptr, backend, mode, sm_scale,
                                                                  window, soft_cap, sinks, check, launch)
    return ATTEND_BACKENDS[backend](q, cache, qo_indptr, qo_lens, mode=mode, sm_scale=sm_scale, **variants,
                                    **launch)()


def planned_attend(q, cache, qo_indptr, backend: str = "auto", mode: str = "auto", *, sm_scale: float | None = None,
                   window: int | None = None, soft_cap: float | None = None, sinks=None, **launch):
    """Plan once, run many: validate as :func:`attend` does with ``check=True`` (once, here), do the backend's
    host work (fp8kv's :class:`~fp8kv.ops.attend.AttendPlan`, FlashInfer's prefill plan, vLLM's arguments; the
    new-token counts read once) and return a zero-argument callable that runs the attention of ``q`` over
    ``cache`` with no host sync left (CUDA-graph capturable for the Triton, FlashInfer and vLLM backends).

    The callable is a ``functools.partial``; for the Triton backend its first argument (``.args[0]``) is the
    :class:`~fp8kv.ops.attend.AttendPlan` (``.config``: what runs), or, where :func:`attend` runs the decode kernels,
    a :class:`~fp8kv.ops.decode.DecodePlan` (``.kernel``, ``.config``, ``.qo_len``). It reads ``q`` and the cache's
    tensors when called: refill them in place. The counts are the plan's: a call after ``qo_indptr`` was written in
    place (its version counter, metadata: no host sync) raises ValueError, plan again. After the cache's tables
    change, plan again (the Triton plans read them on the device and stay valid within the rows' capacity;
    FlashInfer's and vLLM's hold copies and refuse to run).
    """
    backend, mode, sm_scale, variants, qo_lens = _validate_attend(q, cache, qo_indptr, backend, mode, sm_scale,
                                                                  window, soft_cap, sinks, True, launch)
    call = ATTEND_BACKENDS[backend](q, cache, qo_indptr, qo_lens, mode=mode, sm_scale=sm_scale, **variants, **launch)
    return functools.partial(_counted, *call.args, run=call.func,
                             counts=(qo_indptr, checks.version_counter(qo_indptr), qo_lens), **call.keywords)


def _counted(*args, run, counts, **kwargs):
    """A planned attend's ``run(*args, **kwargs)``, refused once ``qo_indptr`` was written after planning."""
    check_counts_unchanged(*counts)
    return run(*args, **kwargs)
