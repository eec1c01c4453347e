"""The FP8 quantizer.

Scale convention (the one used everywhere in fp8kv)::

    stored      = Q(x / scale)          # Q: clamp to ±fmt.max, then round-to-nearest-even cast
    dequantized = stored * scale

Tensors are laid out ``[..., H, D]``: the last two dims are (KV heads, head_dim), every leading
dim indexes tokens. The granularity says which elements share one scale:

============ ============================ ==================================================
granularity  scale shape                  who uses it
============ ============================ ==================================================
tensor       ``[]``                       vLLM / SGLang / TRT-LLM default (one per K, one per V)
head         ``[H]``                      per-KV-head checkpoints
token_head   ``x.shape[:-1]`` = [..., H]  dynamic per-token quantization
channel      ``[H, D]``                   KIVI-style keys (outlier channels)
============ ============================ ==================================================

Saturation: scaled values beyond ``fmt.max`` are clamped to ±max; those that round-to-nearest-even
would have taken past max are counted in ``Quantized.saturated`` (see :func:`cast_saturating`). A
bare ``.to(float8)`` is never used, because torch versions disagree on overflow (e5m2 overflows to
inf, e4m3fn to NaN). Non-zero values that round to zero are counted in ``Quantized.underflow`` (x's
values as given: a float64 value below fp32's smallest subnormal counts too). A scale computed from
the data represents every value fp32 holds, deep subnormals included (:func:`scale_from_stat`). The
caller's tensor is never modified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checks
from .formats import FP8Format, format

__all__ = ["Quantized", "quantize", "compute_scale", "scale_from_stat", "reduce_dims", "cast_saturating",
           "relative_error", "check_percentile", "narrowed",
           "GRANULARITIES", "SCALE_METHODS", "SCALE_BYTES", "scale_shape", "kv_scale_bytes"]

GRANULARITIES = ("tensor", "head", "token_head", "channel")
# Named ways to derive the scale from the data. vllm_k / vllm_v are vLLM's one-shot
# heuristics (calculate_kv_scales: k_scale = amax(|k|) / 200, v_scale = amax(|v|) / 100).
SCALE_METHODS = ("amax", "percentile", "vllm_k", "vllm_v")
_VLLM_DIVISORS = {"vllm_k": 200.0, "vllm_v": 100.0}
SCALE_BYTES = 4  # scales are fp32
_FP32_NORMAL_MIN = torch.finfo(torch.float32).tiny  # 2^-126


def scale_shape(shape: torch.Size | tuple, granularity: str) -> tuple:
    """Shape of the scale tensor for data of ``shape`` ([..., H, D]) at ``granularity``."""
    _check_granularity(granularity)
    if not isinstance(shape, (tuple, list, torch.Size)):
        checks.fail(f"shape={checks.show_value(shape)} ({type(shape).__name__}); expected a tuple of ints "
                    "[..., heads, head_dim]", TypeError)
    if len(shape) < 2:
        raise ValueError(f"x must have at least 2 dims [..., heads, head_dim]; got shape {tuple(shape)}")
    return {
        "tensor": (),
        "head": (shape[-2],),
        "token_head": tuple(shape[:-1]),
        "channel": tuple(shape[-2:]),
    }[granularity]


def kv_scale_bytes(granularity: str | None, *, num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Scale bytes of a KV cache (K and V of every layer): ``(fixed, per_token)``.

    ``fixed`` is held once whatever the length (``tensor`` one scale, ``head`` ``[Hkv]``, ``channel``
    ``[Hkv, D]`` per layer and K/V); ``per_token`` is stored with each token (``token_head``: ``[Hkv]``
    per layer and K/V). ``granularity=None`` is a 16-bit cache: no scales, ``(0, 0)``. Scales are
    fp32 (:data:`SCALE_BYTES` each), shaped as :func:`scale_shape` says.
    """
    num_layers = checks.positive_int(num_layers, "num_layers")
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
    head_dim = checks.positive_int(head_dim, "head_dim")
    if granularity is None:
        return 0, 0
    _check_granularity(granularity)
    per_layer_and_side = math.prod(scale_shape((num_kv_heads, head_dim), granularity)) * SCALE_BYTES
    if granularity == "token_head":
        return 0, num_layers * 2 * per_layer_and_side
    return num_layers * 2 * per_layer_and_side, 0


def _check_granularity(granularity):
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not supported; expected one of {GRANULARITIES}")


def reduce_dims(ndim: int, granularity: str) -> tuple[int, ...]:
    """Dims that are reduced over to compute one scale (the dims that share it), for data of ``ndim`` >= 2 dims."""
    ndim = checks.integer(ndim, "ndim", minimum=2)  # [..., heads, head_dim]
    _check_granularity(granularity)
    return {
        "tensor": tuple(range(ndim)),
        "head": tuple(range(ndim - 2)) + (ndim - 1,),
        "token_head": (ndim - 1,),
        "channel": tuple(range(ndim - 2)),
    }[granularity]


def _group_stat(a: torch.Tensor, granularity: str, percentile: float | None) -> torch.Tensor:
    """amax (or the given percentile) of |a| over each scale group, shaped like the scale."""
    dims = reduce_dims(a.ndim, granularity)
    if percentile is None:
        if not dims:
            return a
        return a.amax(dim=dims) if a.numel() else a.new_zeros(scale_shape(a.shape, granularity))
    # Move the kept dims first, flatten the reduced ones, then take the k-th value.
    keep = [d for d in range(a.ndim) if d not in dims]
    kept_shape = [a.shape[d] for d in keep]
    n = math.prod(a.shape[d] for d in dims)
    if n == 0 or a.numel() == 0:  # empty groups: no statistic, scale 1 (as for amax)
        return a.new_zeros(kept_shape)
    flat = a.permute(*keep, *dims).reshape(*kept_shape, n)
    k = max(1, min(n, int(round(percentile / 100.0 * n))))
    return flat.kthvalue(k, dim=-1).values


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _check_input(x) -> None:
    """``x`` is a 16/32/64-bit float tensor of at least 2 dims."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        raise TypeError(f"x must be a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dims [..., heads, head_dim]; got shape {tuple(x.shape)}")
    checks.readable_tensor(x, "x")  # a meta tensor has no values to scale


def check_scale_method(method, percentile, name: str = "scale") -> float:
    """Validate a scale method name (the argument ``name``) and the percentile; return the percentile."""
    if not isinstance(method, str):
        checks.fail(f"{name}={method!r} ({type(method).__name__}); expected a method name among "
                    f"{SCALE_METHODS}, a positive float or a tensor", TypeError)
    if method not in SCALE_METHODS:
        raise ValueError(f"{name}={method!r} is not a known scale method; expected one of {SCALE_METHODS}, "
                         "a float or a tensor")
    return check_percentile(percentile)


def check_percentile(percentile) -> float:
    """A percentile for ``"percentile"`` scales: a finite real number in (0, 100], as a float."""
    value = checks.real(percentile, "percentile")
    if not 0.0 < value <= 100.0:
        checks.fail(f"percentile={percentile!r} must be in (0, 100]")
    return value


def compute_scale(x: torch.Tensor, fmt="e4m3", granularity="tensor", method="amax",
                  percentile: float = 99.9) -> torch.Tensor:
    """Scale that maps each group's statistic onto the FP8 range (fp32, shaped per granularity).

    ``x`` is ``[..., H, D]`` (float16/bfloat16/float32/float64) with finite values: NaN or Inf is a
    ValueError naming the first bad index (calibrate on clean data, or quantize with
    ``nonfinite="saturate"``, which calibrates on the finite values); so is a float64 value beyond
    float32's range (it would make an inf scale).

    ``amax``: amax / fmt.max (no element saturates). ``percentile``: the p-th percentile of |x|
    maps to fmt.max (the largest values saturate); ``percentile`` is a number in (0, 100].
    ``vllm_k`` / ``vllm_v``: amax / 200 and amax / 100, independent of the format. A group with no
    non-zero value (all zeros, or no elements at all) gets scale 1; a group of deep-subnormal values
    a scale just as small (down to 2^-149, see :func:`scale_from_stat`), so they keep their codes.
    """
    _check_input(x)
    checks.finite_tensor(x, "x")
    checks.fp32_range_tensor(x, "x")
    return compute_scale_unchecked(x, format(fmt, arg="fmt"), granularity, method, percentile)


def compute_scale_unchecked(x: torch.Tensor, f: FP8Format, granularity, method, percentile) -> torch.Tensor:
    """:func:`compute_scale` on an input already checked (finite, float, >= 2 dims)."""
    _check_granularity(granularity)
    percentile = check_scale_method(method, percentile)
    a = x.detach().abs().to(torch.float32)
    stat = _group_stat(a, granularity, percentile if method == "percentile" else None)
    return scale_from_stat(stat, _VLLM_DIVISORS.get(method, f.max)).contiguous()


def scale_from_stat(stat: torch.Tensor, divisor: float) -> torch.Tensor:
    """``stat / divisor`` per scale group (fp32), and 1 for a group whose statistic is 0 (nothing to scale).

    A quotient below fp32's normal range (a group of deep-subnormal values: amax 1e-42 over e4m3's 448)
    is rounded *up* to the next fp32 subnormal, not to nearest: to nearest it loses up to half its
    value (then ``stat / scale`` passes ``divisor`` and amax would saturate) or becomes 0 (then scale 1,
    and every code of the group flushes to 0). Up, the smallest is 2^-149, and ``stat / scale`` stays
    within ``divisor``: every value fp32 holds gets a code. Normal quotients are rounded to nearest
    (their 2^-24 relative error rounds back to the format's max).
    """
    checks.tensor(stat, "stat", dtypes=checks.FLOAT_DTYPES)
    divisor = checks.positive_float(divisor, "divisor")  # a format's largest value: 0 gave inf scales, -1 negative
    exact = stat.to(torch.float64) / divisor
    scale = exact.to(torch.float32)
    low = (scale.to(torch.float64) < exact) & (scale < _FP32_NORMAL_MIN)  # no host sync: where() either way
    scale = torch.where(low, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    return torch.where(stat > 0, scale, torch.ones_like(scale))


def cast_saturating(y: torch.Tensor, fmt: FP8Format, *, count: bool = True) -> tuple[torch.Tensor, int | None]:
    """Clamp ``y`` (taken as fp32) to ±fmt.max and cast (round-to-nearest-even). Returns (fp8, n_saturated).

    Saturated counts the elements that an unclamped round-to-nearest-even cast would have taken
    past ±max (``|y| >= fmt.first_overflow``). Values above max that round down to it are not
    counted, the exact tie included when it goes to max (e4m3: 464 -> 448; e5m2's tie 61440 goes
    up, so it is counted). Without ``count`` it is None: the count is a host sync, which a CUDA graph
    cannot hold.
    """
    checks.readable_tensor(checks.tensor(y, "y", dtypes=checks.FLOAT_DTYPES), "y")
    fmt = format(fmt, arg="fmt")  # an FP8Format, or its name or torch dtype
    count = checks.flag(count, "count")
    y = y.to(torch.float32)  # the threshold is an fp32 boundary, as in the Triton cache write
    saturated = int((y.abs() >= fmt.first_overflow).sum()) if count else None
    return y.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype), saturated


def narrowed(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (fp32) as ``dtype``; a value past ``dtype``'s range is a ValueError naming it, not an inf."""
    if values.numel() and torch.finfo(dtype).max < torch.finfo(values.dtype).max:
        peak = float(values.abs().max())
        if peak > torch.finfo(dtype).max:
            raise ValueError(f"dtype={dtype}: the decoded values reach {peak:.4g}, past {dtype}'s largest "
                             f"{torch.finfo(dtype).max:.6g} (they would be inf); decode to torch.float32 or torch.bfloat16")
    return values.to(dtype)


@dataclass
class Quantized:
    """FP8 data plus its scale. ``dequantize()`` gives back ``data * scale``.

    Attributes: ``data`` fp8 tensor (x's shape), ``scale`` fp32 (see the module table), ``fmt``,
    ``granularity``, ``saturated`` (elements clamped to ±max), ``underflow`` (non-zero inputs that
    became zero), ``nonfinite`` (NaN/Inf inputs replaced, only with ``nonfinite="saturate"``).
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: FP8Format
    granularity: str
    saturated: int = 0
    underflow: int = 0
    nonfinite: int = 0

    @property
    def numel(self) -> int:
        return self.data.numel()

    def scale_broadcast(self) -> torch.Tensor:
        """The scale viewed so that it broadcasts against ``data``."""
        return broadcast_scale(self.scale, self.data.ndim, self.granularity)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` as ``dtype``, a float dtype of :data:`fp8kv.checks.FLOAT_DTYPES`."""
        dtype = checks.float_dtype(dtype)
        return narrowed(self.data.to(torch.float32) * self.scale_broadcast(), dtype)

    @property
    def scale_nbytes(self) -> int:
        """Bytes of scale metadata (fp32)."""
        return self.scale.numel() * SCALE_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of data plus scales."""
        return self.data.numel() * self.data.element_size() + self.scale_nbytes

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / max(1, self.numel)

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / max(1, self.numel)


def broadcast_scale(scale: torch.Tensor, ndim: int, granularity: str) -> torch.Tensor:
    """View a granularity-shaped scale so it broadcasts against ``[..., H, D]`` data of ``ndim`` dims."""
    if granularity == "tensor":
        return scale.reshape(())
    if granularity == "head":
        return scale.reshape(scale.shape[0], 1)
    if granularity == "token_head":
        return scale.unsqueeze(-1)
    return scale  # channel: [H, D] broadcasts as is


def _check_finite(x: torch.Tensor, name: str) -> None:
    bad = ~torch.isfinite(x)
    n = int(bad.sum())
    if n:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} has {n} non-finite value(s) (NaN/Inf); the first is at index {first} "
                         f"(value {x[first].item()}). Clean the input, or pass nonfinite='saturate' to "
                         "map ±Inf to ±max and NaN to 0.")


def quantize(x: torch.Tensor, fmt="e4m3", granularity: str = "tensor", scale=None, *,
             percentile: float = 99.9, nonfinite: str = "raise") -> Quantized:
    """Quantize ``x`` (``[..., H, D]``, any float dtype) to FP8.

    Parameters
    ----------
    x : tensor ``[..., H, D]``; float16 / bfloat16 / float32 / float64. Never modified.
    fmt : ``"e4m3"`` (OCP e4m3fn, max 448), ``"e5m2"`` (max 57344), ``"e4m3fnuz"``, ``"e5m2fnuz"``.
    granularity : ``"tensor"``, ``"head"``, ``"token_head"`` or ``"channel"`` (see module docstring).
    scale : None or ``"amax"`` (from the data), ``"percentile"`` (with ``percentile``), ``"vllm_k"``
        (amax/200), ``"vllm_v"`` (amax/100), a positive float (e.g. 1.0, the engines' fallback), or
        a positive fp32 tensor of the granularity's shape (or broadcastable to it). A bool, a
        string that is not a method, a zero / negative / NaN / Inf scale, or one that float32
        cannot hold (1e-300 would be 0 there, 1e300 inf) is refused, naming the value given.
    percentile : number in (0, 100]: the percentile of |x| that ``scale="percentile"`` maps to max.
    nonfinite : ``"raise"`` (default: NaN/Inf is a ValueError naming the count and first index) or
        ``"saturate"`` (±Inf → ±max, NaN → 0, counted in ``Quantized.nonfinite``). It governs NaN/Inf
        only: a finite float64 value beyond float32's range (|x| > 3.4e38) is a ValueError in both
        modes (the arithmetic is fp32, where it would be inf; a value that large is a bug upstream).
    """
    _check_input(x)
    f = format(fmt, arg="fmt")
    shape = scale_shape(x.shape, granularity)
    if not isinstance(nonfinite, str) or nonfinite not in ("raise", "saturate"):
        raise ValueError(f"nonfinite={nonfinite!r}; expected 'raise' or 'saturate'")
    if scale is None:
        scale = "amax"
    if isinstance(scale, str):
        check_scale_method(scale, percentile)
    else:
        s = explicit_scale(scale, shape, granularity, x.device)
    if nonfinite == "raise":
        _check_finite(x, "x")  # on x itself: its own values in the message
    checks.fp32_range_tensor(x, "x")  # before the fp32 copy turns such values into inf
    xf = x.detach().to(torch.float32)  # a copy when x is not fp32; never written in place below
    n_nonfinite = 0
    x_stat = xf  # what data-derived scales are computed from
    if nonfinite == "saturate":
        bad = ~torch.isfinite(xf)
        n_nonfinite = int(bad.sum())
        if n_nonfinite:
            # Scales come from the finite values only: an Inf in the amax would crush every finite
            # value to zero. ±Inf stays ±Inf here and saturates to ±max below; NaN becomes 0.
            x_stat = torch.where(bad, torch.zeros_like(xf), xf)
            xf = torch.where(torch.isnan(xf), torch.zeros_like(xf), xf)

    if isinstance(scale, str):
        s = compute_scale_unchecked(x_stat, f, granularity, scale, percentile)

    y = xf / broadcast_scale(s, x.ndim, granularity)
    if n_nonfinite:  # ±Inf / scale is ±Inf: make it ±fp32 max so the clamp saturates (and counts) it
        y = torch.nan_to_num(y, nan=0.0)
    data, saturated = cast_saturating(y, f)
    # Counted against x as given: a float64 value below fp32's smallest subnormal is 0 in xf already.
    given = x.detach()
    underflow = int(((data.to(torch.float32) == 0) & (given != 0) & ~torch.isnan(given)).sum())
    return Quantized(data, s, f, granularity, saturated, underflow, n_nonfinite)


def explicit_scale(scale, shape: tuple, granularity: str, device: torch.device,
                    name: str = "scale") -> torch.Tensor:
    """A given scale (positive finite number, or a tensor / sequence of them) as fp32 ``shape``."""
    s = checks.positive_fp32(scale, name, device=device, expected=f"None, a method name among {SCALE_METHODS}, "
                             "a positive float or a positive fp32 tensor")
    try:
        return torch.broadcast_to(s, shape).contiguous()
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(s.shape)} does not fit granularity {granularity!r}: "
                         f"expected shape {shape} (or broadcastable to it)") from None


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref|| / ||ref||`` in fp64 (Frobenius norms); 0 when both are zero. ``a`` and ``ref`` are tensors of one
    shape (one that broadcasts against the other would compare other elements than the caller meant)."""
    for name, t in (("a", a), ("ref", ref)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        checks.readable_tensor(t, name)
    if a.shape != ref.shape:
        raise ValueError(f"a has shape {tuple(a.shape)} but ref has {tuple(ref.shape)}; expected one shape")
    if a.device != ref.device:
        raise ValueError(f"a is on {a.device} but ref is on {ref.device}; expected one device")
    a64, r64 = a.detach().to(torch.float64), ref.detach().to(torch.float64)
    den = r64.norm()
    num = (a64 - r64).norm()
    if den == 0:
        return float(num)
    return float(num / den)
