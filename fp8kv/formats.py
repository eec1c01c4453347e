"""FP8 format facts, as data.

Four 8-bit float formats matter for KV caches:

========== ========= ==== ========== =============================================
name       exp/mant  bias max        notes
========== ========= ==== ========== =============================================
e4m3       4 / 3     7    448        OCP ``E4M3FN``: no inf, one NaN code per sign
e5m2       5 / 2     15   57344      OCP / IEEE-like: has inf and NaN
e4m3fnuz   4 / 3     8    240        AMD MI300 flavour: no -0, 0x80 is the only NaN
e5m2fnuz   5 / 2     16   57344      AMD MI300 flavour
========== ========= ==== ========== =============================================

The "±240" quoted in some engines' documentation for "FP8 e4m3" is the
*fnuz* range (MI300); NVIDIA GPUs use OCP e4m3fn, whose range is ±448.

Every number here is derived from the format's bit layout and checked against
torch's own decoding of all 256 codes (``tests/test_formats.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

__all__ = ["FP8Format", "FORMATS", "format", "UNQUANTIZED_DTYPES", "KV_DTYPES", "KV_DTYPE_NAMES", "is_fp8",
           "kv_dtype_info", "saturation_bounds", "summary_table", "code_table"]


@dataclass(frozen=True)
class FP8Format:
    """One FP8 format: its bit layout and the torch dtype that stores it."""

    name: str
    torch_dtype: torch.dtype = field(repr=False)
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite magnitude
    min_normal: float  # smallest positive normal
    min_subnormal: float  # smallest positive subnormal
    has_inf: bool
    triton_name: str  # name of the dtype in Triton (tl.float8e4nv ...)

    @property
    def epsilon(self) -> float:
        """Spacing of the codes just above 1.0 (one ulp at 1.0)."""
        return 2.0 ** -self.mantissa_bits

    @property
    def overflow_threshold(self) -> float:
        """max + half an ulp at max: the tie between max and the next (unrepresentable) code.

        Magnitudes above it round past ``max``; the tie itself does only when :attr:`tie_overflows`.
        """
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits) / 2

    @property
    def tie_overflows(self) -> bool:
        """Whether round-to-nearest-even takes :attr:`overflow_threshold` itself past max.

        The tie goes to the even neighbour: to max when max's mantissa is even (e4m3fn: 448 =
        1.110b x 2^8, so 464 -> 448), past it when odd (e5m2 57344 = 1.11b x 2^15, both fnuz).
        """
        return _max_mantissa_is_odd(self.max, self.mantissa_bits)

    @property
    def first_overflow(self) -> float:
        """Smallest fp32 magnitude that rounds past max: the saturation count is ``|y| >= this``
        for fp32 ``y`` (the tie when it overflows, else the next fp32 above the tie)."""
        return _first_overflow(self.max, self.mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of round-to-nearest for normal values: half an ulp."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @cached_property
    def code_values(self) -> torch.Tensor:
        """fp32 value of each of the 256 codes, indexed by code (NaN where the code is NaN)."""
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        return codes.view(self.torch_dtype).to(torch.float32)

    @property
    def finite_codes(self) -> int:
        """Number of the 256 codes that decode to a finite value."""
        return int(torch.isfinite(self.code_values).sum())

    def codes(self):
        """Table of all 256 codes: code, bits, sign, exponent field, mantissa field, value, kind.

        ``kind`` is one of zero / subnormal / normal / inf / nan. Returns a pandas DataFrame.
        """
        import pandas as pd

        vals = self.code_values.tolist()
        m = self.mantissa_bits
        rows = []
        for code, v in enumerate(vals):
            exp_field = (code >> m) & ((1 << self.exponent_bits) - 1)
            if math.isnan(v):
                kind = "nan"
            elif math.isinf(v):
                kind = "inf"
            elif v == 0.0:
                kind = "zero"
            elif exp_field == 0:
                kind = "subnormal"
            else:
                kind = "normal"
            rows.append(
                dict(
                    code=code,
                    bits=f"{code:08b}",
                    sign=code >> 7,
                    exponent=exp_field,
                    mantissa=code & ((1 << m) - 1),
                    value=v,
                    kind=kind,
                )
            )
        return pd.DataFrame(rows)

    def summary(self) -> dict:
        """The scalar facts as a plain dict (for tables and JSON)."""
        return dict(
            name=self.name,
            exponent_bits=self.exponent_bits,
            mantissa_bits=self.mantissa_bits,
            bias=self.bias,
            max=self.max,
            min_normal=self.min_normal,
            min_subnormal=self.min_subnormal,
            finite_codes=self.finite_codes,
            has_inf=self.has_inf,
            unit_roundoff=self.unit_roundoff,
        )


def _make(name, dtype, e, m, bias, has_inf, triton_name, top_exp_fraction_codes):
    """Build a format from its layout. ``top_exp_fraction_codes``: how many mantissa codes of
    the top exponent are finite (all for fn/fnuz e4m3 but the NaN one; none for IEEE-like)."""
    min_normal = 2.0 ** (1 - bias)
    min_sub = min_normal * 2.0**-m
    if top_exp_fraction_codes == 0:  # IEEE-like: top exponent is inf/nan
        max_exp = (2**e - 2) - bias
        max_mant = 2**m - 1
    else:
        max_exp = (2**e - 1) - bias
        max_mant = top_exp_fraction_codes - 1
    fmax = 2.0**max_exp * (1 + max_mant / 2**m)
    return FP8Format(name, dtype, e, m, bias, fmax, min_normal, min_sub, has_inf, triton_name)


FORMATS: dict[str, FP8Format] = {
    f.name: f
    for f in (
        _make("e4m3", torch.float8_e4m3fn, 4, 3, 7, False, "fp8e4nv", 7),  # 0x7F/0xFF are NaN
        _make("e5m2", torch.float8_e5m2, 5, 2, 15, True, "fp8e5", 0),
        _make("e4m3fnuz", torch.float8_e4m3fnuz, 4, 3, 8, False, "fp8e4b8", 8),
        _make("e5m2fnuz", torch.float8_e5m2fnuz, 5, 2, 16, False, "fp8e5b16", 4),
    )
}

_ALIASES = {
    "e4m3fn": "e4m3",
    "fp8_e4m3": "e4m3",
    "float8_e4m3fn": "e4m3",
    "fp8_e5m2": "e5m2",
    "float8_e5m2": "e5m2",
    "float8_e4m3fnuz": "e4m3fnuz",
    "float8_e5m2fnuz": "e5m2fnuz",
}


def format(name: str | FP8Format | torch.dtype, *, arg: str = "name") -> FP8Format:  # noqa: A001 - public name
    """Look up an FP8 format by name (``"e4m3"``, ``"e5m2"``, ``"fp8_e4m3"``, ...) or torch dtype; ``arg`` is the
    name an error gives the argument (a caller's own parameter, e.g. ``"fmt"``)."""
    if isinstance(name, FP8Format):
        return name
    if isinstance(name, torch.dtype):
        for f in FORMATS.values():
            if f.torch_dtype == name:
                return f
        raise ValueError(f"{arg}: dtype {name} is not an FP8 format; expected one of "
                         f"{[str(f.torch_dtype) for f in FORMATS.values()]}")
    if not isinstance(name, str):
        raise TypeError(f"{arg} must be a format name or torch dtype, got {type(name).__name__}")
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(f"{arg}={name!r} is not a known FP8 format; expected one of {sorted(FORMATS)}")
    return FORMATS[key]


# Unquantized float types by name: queries, and K/V kept at 16 (or 32) bits.
UNQUANTIZED_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# KV-cache element types: name -> (torch dtype, FP8 format or None for 16-bit).
KV_DTYPES: dict[str, tuple[torch.dtype, FP8Format | None]] = {
    "bf16": (UNQUANTIZED_DTYPES["bf16"], None),
    "fp16": (UNQUANTIZED_DTYPES["fp16"], None),
    "fp8_e4m3": (FORMATS["e4m3"].torch_dtype, FORMATS["e4m3"]),
    "fp8_e5m2": (FORMATS["e5m2"].torch_dtype, FORMATS["e5m2"]),
}
KV_DTYPE_NAMES: tuple[str, ...] = tuple(KV_DTYPES)  # for choices and error messages


def is_fp8(kv_dtype: str) -> bool:
    """Whether the KV dtype named ``kv_dtype`` stores FP8 codes (False for 16-bit and unknown names)."""
    return isinstance(kv_dtype, str) and kv_dtype in KV_DTYPES and KV_DTYPES[kv_dtype][1] is not None


def kv_dtype_info(kv_dtype: str | torch.dtype) -> tuple[str, torch.dtype, FP8Format | None]:
    """Normalise a KV dtype to ``(name, torch dtype, fp8 format or None)``."""
    if isinstance(kv_dtype, torch.dtype):
        for k, (dt, f) in KV_DTYPES.items():
            if dt == kv_dtype:
                return k, dt, f
    else:
        aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "e4m3": "fp8_e4m3",
                   "e5m2": "fp8_e5m2", "fp8": "fp8_e4m3"}
        key = aliases.get(str(kv_dtype).lower(), str(kv_dtype).lower())
        if key in KV_DTYPES:
            return (key, *KV_DTYPES[key])
    raise ValueError(f"kv_dtype={kv_dtype!r} is not supported; expected one of {list(KV_DTYPES)}")


def _max_mantissa_is_odd(fmax: float, mantissa_bits: int) -> bool:
    frac = fmax / 2.0 ** math.floor(math.log2(fmax)) - 1  # in [0, 1): the mantissa field / 2^m
    return int(round(frac * 2**mantissa_bits)) % 2 == 1


def _first_overflow(fmax: float, mantissa_bits: int) -> float:
    """Smallest fp32 magnitude that round-to-nearest-even takes past ``fmax`` (see FP8Format.first_overflow)."""
    tie = fmax + 2.0 ** (math.floor(math.log2(fmax)) - mantissa_bits) / 2
    t = torch.tensor(tie, dtype=torch.float32)  # exact for every 8/16-bit format (inf for fp32's own max)
    if not _max_mantissa_is_odd(fmax, mantissa_bits):  # the tie rounds down to max: not an overflow
        t = torch.nextafter(t, torch.tensor(math.inf))
    return float(t)


# The dtypes saturation_bounds answers for: the FP8 formats', the 16-bit ones, and fp32 / fp64.
_SATURATING_DTYPES = (*(f.torch_dtype for f in FORMATS.values()), torch.float16, torch.bfloat16, torch.float32,
                      torch.float64)


def saturation_bounds(dtype: torch.dtype) -> tuple[float, float]:
    """``(max, first_overflow)`` of a float dtype: fp32 inputs at or above ``first_overflow`` would
    round past max under round-to-nearest-even, so a saturating store clamps them to ±max and counts
    them; smaller ones (including e4m3's tie 464, which rounds down to 448) are not counted.

    ``dtype``: an FP8 format's torch dtype, float16, bfloat16, float32 or float64 (else a TypeError naming
    it). For float32 and float64 no fp32 input rounds past max: ``first_overflow`` is inf (only an inf input
    counts)."""
    if not isinstance(dtype, torch.dtype) or dtype not in _SATURATING_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in _SATURATING_DTYPES)
        raise TypeError(f"dtype={dtype!r}; expected a torch float dtype among: {names}")
    for f in FORMATS.values():
        if f.torch_dtype == dtype:
            return f.max, f.first_overflow
    fi = torch.finfo(dtype)
    if fi.bits >= 32:  # holds every fp32 value (fp64's tie does not fit a Python float: OverflowError)
        return fi.max, math.inf
    return fi.max, _first_overflow(fi.max, round(-math.log2(fi.eps)))


def summary_table(names=None):
    """One row of :meth:`FP8Format.summary` per format, as a DataFrame. ``names``: None (every format), one
    format as :func:`format` takes it (a name, an :class:`FP8Format` or a torch dtype) or a list of them."""
    import pandas as pd

    if names is None:
        names = FORMATS
    elif isinstance(names, (str, FP8Format, torch.dtype)):  # one format, not an iterable of them
        names = [names]
    elif not hasattr(names, "__iter__"):
        raise TypeError(f"names={names!r} ({type(names).__name__}); expected None, a format (name, FP8Format or "
                        "torch dtype) or a list of them")
    return pd.DataFrame([format(name, arg=f"names[{i}]").summary() for i, name in enumerate(names)])


def code_table(name: str | FP8Format | torch.dtype):
    """The 256-code table of one format (:meth:`FP8Format.codes`)."""
    return format(name).codes()
