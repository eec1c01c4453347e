"""A :class:`~fp8kv.cache.PagedKVCache`'s scales as its constructors take them: checked and shaped to its
granularity, computed from the tokens it is built from, or refused where the cache has no use for them."""

from __future__ import annotations

import torch

from .. import checks
from ..checks import fail as _fail
from ..quant import check_scale_method, compute_scale_unchecked, explicit_scale
from .validation import is_unit_scale, show_scale

__all__ = ["init_scale", "refuse_unused_scale", "static_scale"]


def init_scale(cache, scale, name, device) -> torch.Tensor:
    """``scale`` (None: 1.0) as ``cache`` holds it: fp32 of :meth:`~fp8kv.cache.PagedKVCache.scale_shape`
    (owned), or a scalar 1.0 for a 16-bit cache, which takes only None or 1.0."""
    shape = cache.scale_shape()
    if not cache.is_fp8:
        if scale is not None:
            s = checks.positive_fp32(scale, name, device=device, expected=f"None or 1.0 (kv_dtype="
                                     f"{cache.kv_dtype!r} is a 16-bit cache: it stores values unscaled)")
            if not bool((s == 1).all()):
                _fail(f"{name} must be 1.0 (or None) for 16-bit kv_dtype={cache.kv_dtype!r} (it stores values "
                      f"unscaled); got {show_scale(scale)}")
        return torch.ones((), dtype=torch.float32, device=device)
    if scale is None:
        scale = 1.0
    s = checks.positive_fp32(scale, name, device=device,
                             expected=f"a positive float or a float tensor of shape {shape}")
    try:
        return torch.broadcast_to(s, shape).clone()  # owned: token_head writes update it in place
    except RuntimeError:
        _fail(f"{name} of shape {tuple(s.shape)} does not fit granularity {cache.granularity!r}: "
              f"expected shape {shape}")


def refuse_unused_scale(cache, value, name) -> None:
    """Refuse a ``from_dense`` / ``empty`` scale this cache has no use for, rather than ignore it:
    a 16-bit cache stores values unscaled; token_head computes its scales as it writes."""
    if cache.is_fp8:  # token_head
        if value is None or (isinstance(value, str) and value == "amax"):
            return  # what token_head does anyway
        why = "granularity='token_head' computes one scale per token and head as it writes (amax / fmt.max)"
        ok = "None (or 'amax')"
    else:
        if is_unit_scale(value, name):
            return  # the scale a 16-bit cache carries
        why = f"kv_dtype={cache.kv_dtype!r} is a 16-bit cache: it stores values unscaled"
        ok = "None (or 1.0)"
    _fail(f"{name}={show_scale(value)}: {why}, so a given scale would be ignored; pass {name}={ok}")


def static_scale(cache, value, name, x: torch.Tensor, percentile) -> torch.Tensor:
    """A tensor / head / channel scale from a ``from_dense`` argument: a method applied to the
    valid tokens ``x`` (None is ``"amax"``), or a given number / tensor (checked)."""
    if value is None:
        value = "amax"
    if isinstance(value, str):
        pct = check_scale_method(value, percentile, name)
        s = compute_scale_unchecked(x, cache.fmt, cache.granularity, value, pct)
    else:
        s = explicit_scale(value, cache.scale_shape(), cache.granularity, cache.device, name)
    return init_scale(cache, s, name, cache.device)
