"""Element codes: the values one stored code can take, and round-to-nearest-even onto them.

=========== ==== ============================== ===================================================
element     bits values                         encoding
=========== ==== ============================== ===================================================
int8        8    -127 .. 127                    two's complement (-128 unused: symmetric range)
int4        4    -7 .. 7                        two's complement nibble (-8 unused: symmetric range)
uint4       4    0 .. 15                        unsigned nibble (asymmetric: with a zero point)
e2m1        4    ±{0, .5, 1, 1.5, 2, 3, 4, 6}   OCP FP4: sign, 2 exponent bits (bias 1), 1 mantissa
                                                bit; no inf / NaN, code 0x8 is -0
e4m3        8    ±448 (OCP e4m3fn)              torch.float8_e4m3fn (see fp8kv.formats)
e5m2        8    ±57344                         torch.float8_e5m2 (the fp8 reference codecs only)
=========== ==== ============================== ===================================================

Every encoder takes fp32 values already divided by their scale and returns ``(codes, saturated)``:
``saturated`` counts the values that round-to-nearest-even would take past the largest code (those
are clamped to it), as :func:`fp8kv.quant.cast_saturating` counts them for FP8. The e8m0 scale
codes (power-of-two scales of OCP MX) live here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import FORMATS
from ..quant import cast_saturating

__all__ = ["Element", "ELEMENTS", "E2M1_VALUES", "E2M1_MAX", "encode_int", "encode_e2m1", "decode_e2m1", "encode_e4m3",
           "e8m0_from_exponent", "e8m0_to_float", "E8M0_BIAS", "E8M0_MIN_EXPONENT", "E8M0_MAX_EXPONENT",
           "floor_log2"]

# e2m1's eight magnitudes, indexed by the low 3 bits of the code (exponent field, mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT = -127, 127  # code 0 .. 254; 255 is NaN


@dataclass(frozen=True)
class Element:
    """One element code: ``bits`` per code, the range of values the codes decode to (before scaling)
    and ``emax`` (exponent of the largest power of two not above ``max``; OCP MX's ``emax_elem``)."""

    name: str
    bits: int
    is_float: bool
    min: float  # smallest value a code decodes to (most negative)
    max: float  # largest
    emax: int | None  # floats only


ELEMENTS: dict[str, Element] = {e.name: e for e in (
    Element("int8", 8, False, -127.0, 127.0, None),
    Element("int4", 4, False, -7.0, 7.0, None),
    Element("uint4", 4, False, 0.0, 15.0, None),
    Element("e2m1", 4, True, -E2M1_MAX, E2M1_MAX, 2),
    Element("e4m3", 8, True, -FORMATS["e4m3"].max, FORMATS["e4m3"].max, 8),
    Element("e5m2", 8, True, -FORMATS["e5m2"].max, FORMATS["e5m2"].max, 15),
)}


def encode_int(y: torch.Tensor, element: Element, *, count: bool = True) -> tuple[torch.Tensor, int | None]:
    """Round fp32 ``y`` to the nearest integer (ties to even, as ``torch.round``), clamp to the
    element's range. Returns ``(codes as int16, saturated)``; saturated counts the rounded values
    outside the range (127.5 rounds to 128: counted; -0.5 rounds to -0: in range for uint4); None
    without ``count`` (the count is a host sync, which a CUDA graph cannot hold)."""
    r = torch.round(y.to(torch.float32))
    saturated = int(((r > element.max) | (r < element.min)).sum()) if count else None
    return r.clamp(element.min, element.max).to(torch.int16), saturated


def encode_e2m1(y: torch.Tensor, *, count: bool = True) -> tuple[torch.Tensor, int | None]:
    """fp32 ``y`` to e2m1 codes (uint8, 0..15), round-to-nearest-even, saturating at ±6.

    The code grid has spacing 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; on each stretch the codes
    are consecutive, so rounding ``|y| / step`` to the even integer is rounding to the even code
    (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4, and 7 -> 8, past 6: saturated and counted). The sign
    bit is kept for values that round to zero (-0.1 -> 0x8, -0), as a float cast keeps it.
    Without ``count`` the saturated count is None (no host sync).
    """
    y = y.to(torch.float32)
    a = y.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = torch.round(a / step) * step  # exact: division and product by powers of two
    saturated = int((q > E2M1_MAX).sum()) if count else None
    q = q.clamp(max=E2M1_MAX)
    # value -> code: below 2 the code is 2q; 2, 3 -> 4, 5; 4, 6 -> 6, 7
    mag = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4)).to(torch.uint8)
    return mag | (torch.signbit(y).to(torch.uint8) << 3), saturated


_E2M1_TABLE = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, values 0..15) to fp32 (code 0x8 decodes to -0.0)."""
    return _E2M1_TABLE.to(codes.device)[codes.to(torch.int64)]


def encode_e4m3(y: torch.Tensor, *, count: bool = True) -> tuple[torch.Tensor, int | None]:
    """fp32 ``y`` to OCP e4m3fn (torch.float8_e4m3fn), saturating at ±448 (:func:`fp8kv.quant.cast_saturating`);
    without ``count`` the same codes and None (no host sync)."""
    return cast_saturating(y, FORMATS["e4m3"], count=count)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` exactly, for positive finite fp32 ``a`` (subnormals included), as int32.

    ``frexp`` splits ``a = m x 2^e`` with ``m`` in [0.5, 1), so the floor is ``e - 1``; ``torch.log2``
    would round (log2 of 2^k - ulp is k in fp32).
    """
    return torch.frexp(a.to(torch.float32)).exponent - 1


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponents in [-127, 127] (int) to e8m0 codes (``torch.float8_e8m0fnu``): code = e + 127."""
    return (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (``torch.float8_e8m0fnu``) to fp32 ``2^(code - 127)`` (code 255, NaN, is never written)."""
    exponent = scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS
    return torch.ldexp(torch.ones(exponent.shape, dtype=torch.float32, device=scale.device), exponent)
