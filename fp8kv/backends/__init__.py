"""Backend registry behind :func:`fp8kv.decode`.

Each backend is ``fn(q, cache, *, mode, **kwargs) -> (out [B, Hq, D], lse [B, Hq])``. FlashInfer is
imported only when asked for, so fp8kv imports on machines without it.
"""

from __future__ import annotations

from ..capability import UnsupportedError, check, check_variants, choose_backend, choose_mode
from ..checks import attention_variant
from ..reference import check_decode_inputs

__all__ = ["decode", "BACKENDS"]


def _reference(q, cache, *, mode="dequant", sm_scale=None, **variants):
    from ..reference import decode as ref_decode

    return ref_decode(q, cache, sm_scale=sm_scale, **variants)


def _triton(q, cache, *, mode="dequant", **kwargs):
    from ..ops import paged_decode

    return paged_decode(q, cache, mode=mode, **kwargs)


def _flashinfer(q, cache, *, mode="dequant", **kwargs):
    from .flashinfer import decode as fi_decode

    return fi_decode(q, cache, mode=mode, **kwargs)


BACKENDS = {"reference": _reference, "triton": _triton, "flashinfer": _flashinfer}


def decode(q, cache, backend: str = "auto", mode: str = "auto", *, window: int | None = None,
           soft_cap: float | None = None, sinks=None, **kwargs):
    """Paged decode attention through the chosen backend.

    Parameters
    ----------
    q : ``[B, Hq, D]`` query, one token per sequence (bf16/fp16; the reference also takes fp32).
    cache : :class:`~fp8kv.cache.PagedKVCache`.
    backend : ``"auto"``, ``"reference"``, ``"triton"`` or ``"flashinfer"``. ``auto`` picks per
        :mod:`fp8kv.capability` for this device (Triton on a GPU, else the reference).
    mode : ``"auto"``, ``"dequant"`` or ``"fp8"``.
    window, soft_cap, sinks : attention variants (defined in :func:`fp8kv.reference.decode`): a
        sliding window of ``window`` tokens (int >= 1), logit soft-capping ``cap * tanh(s / cap)``
        (``soft_cap`` > 0), and per-query-head sink logits (fp32 ``[Hq]`` on q's device). None: off.
        A backend without one raises UnsupportedError with the reason (``fp8kv.capability.variants``).
    kwargs : passed to the backend (e.g. ``sm_scale``, launch overrides for Triton).

    Raises :class:`~fp8kv.capability.UnsupportedError` (a ValueError) with the capability table's
    reason when the combination cannot run here.
    """
    check_decode_inputs(q, cache)
    window, soft_cap, sinks = attention_variant(window, soft_cap, sinks, num_q_heads=q.shape[1], device=q.device)
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected 'auto' or one of {tuple(BACKENDS)}")
    if mode not in ("auto", "dequant", "fp8"):
        raise ValueError(f"mode={mode!r}; expected 'auto', 'dequant' or 'fp8'")
    if backend == "auto":
        backend = choose_backend(cache.kv_dtype, "dequant" if mode == "auto" else mode, None,
                                 cache.granularity, cache.head_dim)
    if mode == "auto":
        mode = choose_mode(backend, cache.kv_dtype, None, cache.granularity)
    variants = {k: v for k, v in dict(window=window, soft_cap=soft_cap, sinks=sinks).items() if v is not None}
    check_variants(backend, mode, variants)
    ok, why = check(backend, cache.kv_dtype, mode, None, cache.granularity, cache.head_dim)
    if not ok:
        raise UnsupportedError(f"backend={backend}, mode={mode}, kv_dtype={cache.kv_dtype}, "
                               f"granularity={cache.granularity}: {why}")
    return BACKENDS[backend](q, cache, mode=mode, **variants, **kwargs)
