"""Quantize a K or V tensor with a codec of :mod:`.registry`, and decode it back to fp32.

``quantize(x, codec)`` stores ``x`` (``[..., H, D]``, leading dims index tokens) as an
:class:`Encoded`: packed codes, scales (and zero points, and a tensor scale) shaped as the codec
says, and counts: ``saturated`` (values that round-to-nearest-even would take past the largest code,
clamped to it), ``underflow`` (non-zero inputs that decode to 0) and ``nonfinite`` (NaN / Inf
replaced, only with ``nonfinite="saturate"``). ``dequantize`` takes the stored pieces alone (as a
paged cache holds them, codes and scales per page), checks them against the codec, and decodes::

    symmetric (amax)      x = code x scale
    asymmetric (min_max)  x = code x scale + zero            (fp16 scale and zero, fp32 arithmetic)
    two_level (NVFP4)     x = code x fp32(block x tensor)     (block e4m3, tensor fp32)
    pow2 (OCP MX)         x = code x 2^(e8m0 - 127)

Arithmetic is fp32 throughout, as in a kernel. The caller's tensor is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import checks
from ..quant import broadcast_scale, narrowed
from ..quant import quantize as fp8_quantize
from .elements import decode_e2m1, e8m0_to_float, encode_e2m1, encode_e4m3, encode_int
from .packing import pack_nibbles, signed_nibbles, unpack_nibbles
from .registry import Codec, codec
from .scaling import (
    TENSOR_SCALE_MIN,
    amax_scale,
    effective_two_level,
    group_amax,
    group_view,
    min_max_scale,
    pow2_scale,
    tensor_scale_for,
    two_level_scale,
)

__all__ = ["Encoded", "quantize", "encode_rows", "dequantize", "decode_codes", "check_tensor_scale", "NONFINITE_MODES",
           "INPUT_DTYPES"]

NONFINITE_MODES = ("raise", "saturate")
INPUT_DTYPES = checks.FLOAT_DTYPES
_OUTPUT_DTYPES = INPUT_DTYPES


@dataclass(frozen=True)
class Encoded:
    """A tensor as a codec stores it.

    ``codes``: ``codec.code_shape(shape)`` of ``codec.code_dtype``; ``scales``: ``codec.scale_shape(shape)``
    of ``codec.scale_dtype``; ``zero_points``: like ``scales`` (asymmetric codecs) else None;
    ``tensor_scale``: fp32 ``[]`` (two-level codecs) else None; the counts as the module says.
    """

    codec: Codec
    codes: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None = None
    tensor_scale: torch.Tensor | None = None
    saturated: int = 0
    underflow: int = 0
    nonfinite: int = 0

    @property
    def shape(self) -> tuple:
        """Shape of the data stored, ``[..., H, D]``."""
        s = tuple(self.codes.shape)
        return (*s[:-1], s[-1] * 2) if self.codec.packed else s

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales + zero points + tensor scale (:func:`.registry.footprint` counts the same)."""
        parts = (self.codes, self.scales, self.zero_points, self.tensor_scale)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codec, self.codes, self.scales, zero_points=self.zero_points,
                          tensor_scale=self.tensor_scale, dtype=dtype)


def _check_x(x, c: Codec, nonfinite) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float16, bfloat16, float32 or float64")
    checks.readable_tensor(x, "x")
    c.check_shape(x.shape, "x")
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={nonfinite!r}; expected one of {NONFINITE_MODES}")
    if nonfinite == "raise" and x.numel():
        bad = ~torch.isfinite(x)
        n = int(bad.sum())
        if n:
            first = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"x has {n} non-finite value(s) (NaN/Inf); the first is at index {first} (value "
                             f"{x[first].item()}). Clean the input, or pass nonfinite='saturate' to map ±Inf to the "
                             "extreme codes and NaN to 0.")
    checks.fp32_range_tensor(x, "x")


def check_tensor_scale(tensor_scale, c: Codec, device, name: str = "tensor_scale") -> torch.Tensor | None:
    """A codec's fixed per-tensor scale (``name``: the argument it came in as) as an fp32 scalar on ``device``: None,
    or a positive number, at least 2^-143 for a two-level codec; ValueError naming it otherwise."""
    if tensor_scale is None:
        return None
    if not (c.tensor_scale or c.scaling == "tensor"):
        raise ValueError(f"{name}={tensor_scale!r} is given, but codec {c.name!r} has no per-tensor scale "
                         "(its scales come from the data); pass None")
    s = checks.positive_fp32(tensor_scale, name, device=device, expected="None or a positive number "
                             "(a float or a one-element tensor)")
    if s.numel() != 1:
        raise ValueError(f"{name} has shape {tuple(s.shape)}; expected one number (shape [] or [1])")
    s = s.reshape(())
    if c.tensor_scale and float(s) < TENSOR_SCALE_MIN:
        raise ValueError(f"{name}={float(s)!r} is below {TENSOR_SCALE_MIN!r} (2^-143): times the smallest "
                         f"block scale (2^-6) it would be no fp32 number; expected {name} >= 2^-143")
    return s


def quantize(x: torch.Tensor, codec_name: Codec | str, *, tensor_scale=None, nonfinite: str = "raise") -> Encoded:
    """Store ``x`` with a codec.

    Parameters
    ----------
    x : tensor ``[..., H, D]`` (``[..., T, H, D]`` for the KIVI key codecs, T a multiple of the
        group); float16 / bfloat16 / float32 / float64 (values within float32's range). Its head_dim
        must be a multiple of the codec's block and even for the 4-bit codecs (else a ValueError
        naming the shape and the need). Never modified.
    codec_name : a :class:`Codec` or its name (:data:`.registry.CODEC_NAMES`).
    tensor_scale : None (from the data) or a positive number: the per-tensor scale of ``int8_tensor``
        and ``fp8_*_tensor`` (a calibrated scale, for a cache filled token by token), or the fp32
        second level of ``nvfp4`` / ``e4m3_b16`` (>= 2^-143). Refused for the other codecs.
    nonfinite : ``"raise"`` (NaN/Inf is a ValueError naming the count and the first index) or
        ``"saturate"`` (scales from the finite values; ±Inf to the extreme codes, counted as saturated
        too; NaN encoded as 0; counted in ``nonfinite``), as :func:`fp8kv.quant.quantize`. The KIVI codecs'
        asymmetric grid spans only its group's min..max, so there a NaN counts as a 0 of its group: the range
        takes 0 in and the NaN decodes within half a step of 0 (exactly 0 where the group's finite values are
        >= 0); it is not counted as saturated.
    """
    c = codec(codec_name)
    _check_x(x, c, nonfinite)
    given = check_tensor_scale(tensor_scale, c, x.device)
    if c.rule == "fp8":
        q = fp8_quantize(x, c.element.name, c.scaling, "amax" if given is None else given, nonfinite=nonfinite)
        return Encoded(c, q.data, q.scale, saturated=q.saturated, underflow=q.underflow, nonfinite=q.nonfinite)

    xf = x.detach().to(torch.float32)
    bad = ~torch.isfinite(xf)
    n_nonfinite = int(bad.sum()) if nonfinite == "saturate" else 0
    finite = torch.where(bad, 0.0, xf) if n_nonfinite else xf  # what data-derived scales come from
    values = torch.where(torch.isnan(xf), 0.0, xf) if n_nonfinite else xf  # ±Inf stay, to saturate
    vg, dim = group_view(values, c)
    fg, _ = group_view(finite, c)
    zero_points = stored_tensor_scale = None
    if c.rule == "min_max":
        # NaN joins its group's range as the 0 it is encoded as: the asymmetric grid spans only min..max, so
        # a 0 left outside decoded to the nearest edge (and counted as saturated). ±Inf stay out of the range.
        inf = torch.isinf(xf)
        lo = group_view(torch.where(inf, torch.inf, values), c)[0] if n_nonfinite else fg
        hi = group_view(torch.where(inf, -torch.inf, values), c)[0] if n_nonfinite else fg
        scales, zero_points = min_max_scale(lo, hi, dim, c)
        y = (vg - zero_points.to(torch.float32)) / scales.to(torch.float32)
    else:
        if c.rule == "two_level":
            stored_tensor_scale = given if given is not None else tensor_scale_for(group_amax(finite.reshape(1, -1), -1), c)
        y, scales = _scaled(vg, fg, dim, c, given if c.rule == "amax" else stored_tensor_scale)
    if n_nonfinite:  # ±Inf / scale is ±Inf: made ±fp32 max, so that the clamp saturates (and counts) it
        y = torch.nan_to_num(y, nan=0.0)
    codes, saturated = _encode(y.reshape(x.shape), c)
    new_shape = c.scale_shape(x.shape)
    scales = scales.reshape(new_shape)
    zero_points = None if zero_points is None else zero_points.reshape(new_shape)
    enc = Encoded(c, codes, scales.contiguous(), zero_points, stored_tensor_scale, saturated, 0, n_nonfinite)
    decoded = enc.dequantize()
    given_x = x.detach()
    underflow = int(((decoded == 0) & (given_x != 0) & ~torch.isnan(given_x)).sum())
    return Encoded(c, codes, enc.scales, zero_points, stored_tensor_scale, saturated, underflow, n_nonfinite)


def _scaled(vg: torch.Tensor, fg: torch.Tensor, dim: int, c: Codec, given) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped values ``vg`` divided by the scales of a token-local rule (amax, two_level, pow2), the scales
    taken from the finite values ``fg``; ``given``: the amax rule's fixed scale or the two-level tensor scale.
    Returns ``(scaled values, stored scales)``, grouped as ``vg``."""
    if c.rule == "amax":
        s = amax_scale(fg, dim, c, given)
        return vg / s, s
    if c.rule == "two_level":
        scales, eff = two_level_scale(group_amax(fg, dim), c, given)
        return vg / eff, scales
    scales, factor = pow2_scale(group_amax(fg, dim), c)
    return vg / factor, scales


def encode_rows(x: torch.Tensor, c: Codec | str, tensor_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`quantize` stores for finite rows ``x`` ``[..., H, D]`` of a token-local codec (amax, two-level
    or power-of-two scales; ``tensor_scale``: the two-level codecs' fixed fp32 second level), with no checks
    and no counts: no host sync, so a CUDA graph holds it. Returns ``(codes, scales [..., H, groups])``.

    ``tensor_scale`` is required by the two-level codecs and refused by the others. A number or a CPU tensor is
    checked as :func:`check_tensor_scale` checks it (positive, finite, >= 2^-143); a CUDA tensor's value cannot
    be read without a host sync, so of it only what its metadata says is checked (fp32, one element, x's device):
    its value is trusted, as a cache's is (checked where the cache was made)."""
    c = codec(c)  # a name or a Codec; its shape rule checked (metadata only: no host sync)
    if c.rule not in ("amax", "two_level", "pow2") or c.scaling == "tensor":
        raise ValueError(f"codec {c.name!r} (rule {c.rule!r}, {c.scaling} scales) is not token-local; encode_rows "
                         "takes amax, two_level or pow2 codecs with scales per token")
    checks.readable_tensor(checks.tensor(x, "x", dtypes=INPUT_DTYPES), "x")
    c.check_shape(tuple(x.shape), "x")
    tensor_scale = _rows_tensor_scale(tensor_scale, c, x.device)
    vg, dim = group_view(x.detach().to(torch.float32), c)
    y, scales = _scaled(vg, vg, dim, c, tensor_scale)
    codes, _ = _encode(y.reshape(x.shape), c, count=False)
    groups = 1 if c.scaling == "token_head" else x.shape[-1] // c.block  # not -1: ambiguous for no rows
    return codes, scales.reshape(*x.shape[:-1], groups)


def _rows_tensor_scale(tensor_scale, c: Codec, device) -> torch.Tensor | None:
    """:func:`encode_rows`' ``tensor_scale``, checked as its docstring says."""
    if not c.tensor_scale or tensor_scale is None:
        if c.tensor_scale:
            raise ValueError(f"tensor_scale is None, but codec {c.name!r} scales its blocks by a fixed fp32 tensor "
                             "scale; pass the cache's (or quantize(x, codec).tensor_scale)")
        return check_tensor_scale(tensor_scale, c, device)  # None; a scale given is refused by name
    if isinstance(tensor_scale, torch.Tensor) and tensor_scale.is_cuda:  # its value: a host sync, none here
        checks.tensor(tensor_scale, "tensor_scale", dtypes=(torch.float32,), device=device)
        if tensor_scale.numel() != 1:
            raise ValueError(f"tensor_scale has shape {tuple(tensor_scale.shape)}; expected one number (shape [] "
                             "or [1])")
        return tensor_scale.reshape(())
    return check_tensor_scale(tensor_scale, c, device)


def _encode(y: torch.Tensor, c: Codec, *, count: bool = True) -> tuple[torch.Tensor, int | None]:
    """Scaled fp32 values ``[..., H, D]`` to stored codes (packed for 4-bit elements), and the saturated count
    (None without ``count``)."""
    name = c.element.name
    if name == "e2m1":
        codes, saturated = encode_e2m1(y, count=count)
    elif name == "e4m3":
        return encode_e4m3(y, count=count)
    else:
        codes, saturated = encode_int(y, c.element, count=count)
        if name == "int8":
            return codes.to(torch.int8), saturated
    return pack_nibbles(codes), saturated


def decode_codes(codes: torch.Tensor, c: Codec | str) -> torch.Tensor:
    """Stored codes to the fp32 values they stand for before scaling, ``[..., H, D]``. ``c``: a :class:`Codec` or
    its name; ``codes`` a tensor of its ``code_dtype`` (their values are not checked)."""
    c = codec(c)
    checks.tensor(codes, "codes", dtypes=(c.code_dtype,))
    return _code_values(codes, c)


def _code_values(codes: torch.Tensor, c: Codec) -> torch.Tensor:
    """:func:`decode_codes` on arguments already checked."""
    name = c.element.name
    if not c.packed:
        return codes.to(torch.float32)
    nibbles = unpack_nibbles(codes)
    if name == "e2m1":
        return decode_e2m1(nibbles)
    if name == "int4":
        return signed_nibbles(nibbles).to(torch.float32)
    return nibbles.to(torch.float32)  # uint4


def _check_stored(c: Codec, codes, scales, zero_points, tensor_scale) -> tuple:
    """Check stored pieces against the codec; return the data shape ``[..., H, D]``."""
    checks.tensor(codes, "codes", dtypes=(c.code_dtype,))
    if codes.device.type not in ("cpu", "cuda"):
        raise ValueError(f"codes are on {codes.device}; the codecs take tensors on 'cpu' or a CUDA device")
    shape = tuple(codes.shape)
    if c.packed and shape:
        shape = (*shape[:-1], shape[-1] * 2)
    c.check_shape(shape, "codes (as data)")
    want = c.scale_shape(shape)
    for name, t, needed, dtype in (("scales", scales, True, c.scale_dtype),
                                   ("zero_points", zero_points, c.zero_point, c.scale_dtype),
                                   ("tensor_scale", tensor_scale, c.tensor_scale, torch.float32)):
        if not needed:
            if t is not None:
                raise ValueError(f"{name} is given, but codec {c.name!r} stores none; pass None")
            continue
        if t is None:
            raise ValueError(f"{name} is None, but codec {c.name!r} stores them; pass the tensor quantize returned")
        checks.tensor(t, name, dtypes=(dtype,), device=codes.device)
        expected = () if name == "tensor_scale" else want
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; codec {c.name!r} with codes of shape "
                             f"{tuple(codes.shape)} (data {shape}) needs {expected}")
        # quantize writes finite scales >= 0 (an all-zero block's may be 0), a tensor scale >= 2^-143, and finite zero
        # points; a NaN or a negative one would decode to NaN or flip signs, a tensor scale of 0 zero everything,
        # silently
        v = t.float()
        least = {"zero_points": None, "tensor_scale": TENSOR_SCALE_MIN}.get(name, 0.0)
        bad = ~torch.isfinite(v) if least is None else ~torch.isfinite(v) | (v < least)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0]) if v.ndim else ()
            raise ValueError(f"{name} has {int(bad.sum())} value(s) that are not finite"
                             f"{'' if least is None else f' and >= {least:g}'}; the first is at index {first} "
                             f"(value {float(v[first])}); expected what quantize returned")
    return shape


def dequantize(codec_name: Codec | str, codes: torch.Tensor, scales: torch.Tensor, *,
               zero_points: torch.Tensor | None = None, tensor_scale: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode stored codes to ``dtype`` (fp32 by default), ``[..., H, D]``.

    ``codes`` of ``codec.code_dtype`` (packed: ``[..., H, D // 2]``), ``scales`` (and ``zero_points``) of
    ``codec.scale_dtype`` shaped ``codec.scale_shape(data shape)``, ``tensor_scale`` fp32 ``[]`` for the
    two-level codecs; each on the codes' device. A missing, superfluous or mis-shaped piece, or one of the
    wrong dtype, is a ValueError / TypeError naming it and what the codec needs.
    """
    c = codec(codec_name)
    checks.float_dtype(dtype, "dtype", _OUTPUT_DTYPES)
    shape = _check_stored(c, codes, scales, zero_points, tensor_scale)
    vals = _code_values(codes, c)
    if c.rule == "fp8":
        return narrowed(vals * broadcast_scale(scales, len(shape), c.scaling), dtype)
    vg, dim = group_view(vals, c)
    s = scales.reshape(1, 1) if c.scaling == "tensor" else scales.unsqueeze(dim)
    if c.rule == "amax":
        out = vg * s
    elif c.rule == "min_max":
        out = vg * s.to(torch.float32) + zero_points.unsqueeze(dim).to(torch.float32)
    elif c.rule == "two_level":
        out = vg * effective_two_level(s, tensor_scale)
    else:  # pow2
        out = vg * e8m0_to_float(s)
    return narrowed(out.reshape(shape), dtype)
