"""What :mod:`fp8kv.analysis.scale_health` measures, checked by name before anything is measured: per-layer K and
V, decode queries with their softmax scales, and a checkpoint's calibrated scales.

A calibrated scale of 0, NaN or ±Inf is taken, not refused: it is what a checkpoint holds whose scales were never
applied (llm-compressor's zero scales), and the scale health reports such a head as collapsed
(:func:`scale_applied`). A negative scale, one fp32 cannot hold, or a value of the wrong type or shape is refused.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

from .. import checks
from ..quant import scale_shape

__all__ = ["layer_list", "check_kv", "check_queries", "check_calibration", "scale_applied"]

SIDES = ("k", "v")


def layer_list(x, name: str) -> list[torch.Tensor]:
    """``x`` as a list of per-layer tensors; TypeError for a tensor, a non-sequence or an empty one."""
    if isinstance(x, torch.Tensor) or not isinstance(x, Sequence) or not len(x):
        checks.fail(f"{name} must be a non-empty list of per-layer tensors [tokens, Hkv, D]; got "
                    f"{type(x).__name__}", TypeError)
    return list(x)


def check_kv(k, v) -> tuple[list, list]:
    """Per-layer K and V: ``[tokens, Hkv, D]`` float tensors (16 bits or more), finite, equal shapes per layer."""
    k, v = layer_list(k, "k"), layer_list(v, "v")
    if len(k) != len(v):
        checks.fail(f"k has {len(k)} layers but v has {len(v)}; expected one K and one V per layer")
    for i, (kk, vv) in enumerate(zip(k, v, strict=True)):
        for name, x in ((f"k[{i}]", kk), (f"v[{i}]", vv)):
            checks.tensor(x, name, ndim=3, shape_hint="[tokens, Hkv, D]")
            if not x.is_floating_point() or x.dtype.itemsize == 1:
                checks.fail(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; expected a 16/32/64-bit float "
                            "tensor", TypeError)
            if x.shape[0] < 1:
                checks.fail(f"{name} has no tokens (shape {tuple(x.shape)}); give at least one")
            if min(x.shape[1:]) < 1:  # no head or no channel: nothing to scale, and no default 1/sqrt(D)
                checks.fail(f"{name} has shape {tuple(x.shape)}; expected [tokens, Hkv, D] with Hkv >= 1 and D >= 1")
            checks.finite_tensor(x, name)
            checks.fp32_range_tensor(x, name)
        if vv.shape != kk.shape:
            checks.fail(f"k[{i}] and v[{i}] have shapes {tuple(kk.shape)} and {tuple(vv.shape)}; expected equal")
    return k, v


def check_queries(q, sm_scale, k) -> tuple[list | None, list]:
    """Decode queries ``[Nq, Hq, D]`` per layer of ``k`` (or None) and the softmax scale, one or one per layer."""
    n = len(k)
    if sm_scale is None or (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)):  # numpy's too
        sm_scale = [sm_scale] * n
    elif isinstance(sm_scale, np.ndarray) and sm_scale.ndim == 1:  # one per layer, as a list is
        sm_scale = sm_scale.tolist()
    elif not isinstance(sm_scale, (list, tuple)):  # a tensor or a string is not a list of per-layer numbers
        checks.fail(f"sm_scale={checks.show_value(sm_scale)} ({type(sm_scale).__name__}); expected a positive number "
                    "or a list of one per layer", TypeError)
    sm_scale = list(sm_scale)
    if len(sm_scale) != n:
        checks.fail(f"sm_scale has {len(sm_scale)} entries for {n} layers; expected one per layer (or one number)")
    sm_scale = [checks.softmax_scale_or_default(s, k[i].shape[-1], f"sm_scale[{i}]") for i, s in enumerate(sm_scale)]
    if q is None:
        return None, sm_scale
    q = layer_list(q, "q")
    if len(q) != n:
        checks.fail(f"q has {len(q)} layers for {n} layers of K/V; expected one [Nq, Hq, D] tensor per layer")
    for i, qq in enumerate(q):
        checks.tensor(qq, f"q[{i}]", ndim=3, shape_hint="[Nq, Hq, D]")
        hkv, d = k[i].shape[1:]
        if qq.shape[-1] != d or qq.shape[1] % hkv or min(qq.shape) < 1 or qq.dtype not in checks.FLOAT_DTYPES:
            checks.fail(f"q[{i}] has shape {tuple(qq.shape)} ({qq.dtype}); expected [Nq, Hq, {d}] of {checks.FLOAT_DTYPES} "
                        f"with Nq >= 1 and Hq a multiple of k[{i}]'s {hkv} KV heads")
        checks.fp32_range_tensor(checks.finite_tensor(qq, f"q[{i}]"), f"q[{i}]")  # the errors are computed in fp32
    return q, sm_scale


def _calibrated_scale(s, name: str) -> torch.Tensor:
    """One layer's calibrated scale(s) as fp32: 0, NaN and ±Inf kept (a scale not applied); a negative value or a
    positive one fp32 cannot hold is a ValueError, a value of another type a TypeError."""
    if isinstance(s, bool) or not isinstance(s, (numbers.Real, torch.Tensor, list, tuple)):
        checks.fail(f"{name}={checks.show_value(s)} ({type(s).__name__}); expected a scale per layer (a number or "
                    "an fp32 tensor)", TypeError)
    try:
        t = torch.as_tensor(s, dtype=None if isinstance(s, torch.Tensor) else torch.float64)
    except (TypeError, ValueError, RuntimeError):  # e.g. ["a"], ragged lists
        checks.fail(f"{name}={checks.show_value(s)} is not a list of numbers; expected a scale per layer", TypeError)
    if t.dtype == torch.bool or t.is_complex():
        checks.fail(f"{name} has dtype {t.dtype}; expected a real (fp32) tensor of scales", TypeError)
    wide = t.to(torch.float64)
    narrow = wide.to(torch.float32)
    bad = (torch.isfinite(wide) & (wide < 0)) | ((wide > 0) & torch.isfinite(wide) & ((narrow == 0) | narrow.isinf()))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        at = f" at index {idx}" if idx else ""
        value = float(wide[idx])
        checks.fail(f"{name}={value!r}{at}; expected a scale > 0 that fp32 holds ({checks.FP32_TINY:.4g} to "
                    f"{checks.FP32_MAX:.8g}), or 0 / NaN / Inf for a scale the checkpoint never applied")
    return narrow


def check_calibration(calibration, k, granularity) -> tuple[list, list] | None:
    """``(k_scales, v_scales)``, one scale (shaped per ``granularity``, or one number) per layer of ``k``, as fp32
    tensors of the granularity's shape; None stays None. Scales of 0, NaN or Inf are kept (module docstring)."""
    if calibration is None:
        return None
    if not isinstance(calibration, (tuple, list)) or len(calibration) != 2:
        checks.fail(f"calibration must be (k_scales, v_scales), two per-layer lists; got {type(calibration).__name__}",
                    TypeError)
    out = []
    for side, scales in zip(SIDES, calibration, strict=True):
        scales = layer_list(scales, f"calibration {side}_scales")
        if len(scales) != len(k):
            checks.fail(f"calibration {side}_scales has {len(scales)} layers for {len(k)}; expected one per layer")
        shaped = []
        for i, s in enumerate(scales):
            shape = scale_shape(k[i].shape, granularity)
            s = _calibrated_scale(s, f"calibration {side}_scales[{i}]")
            if tuple(s.shape) != shape and s.numel() != 1:
                checks.fail(f"calibration {side}_scales[{i}] has shape {tuple(s.shape)}; granularity "
                            f"{granularity!r} takes {shape}")
            shaped.append(torch.broadcast_to(s.to(k[i].device), shape).contiguous())
        out.append(shaped)
    return out[0], out[1]


def scale_applied(s: torch.Tensor) -> tuple[bool, str]:
    """Whether every entry of scale ``s`` is a usable scale (finite, > 0), and else the first bad value as text
    (``"0"``, ``"nan"``, ``"inf"``), with how many of the entries are bad where there are several."""
    bad = ~(torch.isfinite(s) & (s > 0))
    if not bool(bad.any()):
        return True, ""
    value = float(s.reshape(-1)[bad.reshape(-1)][0])
    text = "0" if value == 0 else f"{value:g}"
    return False, text + (f" in {int(bad.sum())} of {s.numel()} channels" if s.numel() > 1 else "")
