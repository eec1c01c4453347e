"""FP8 <-> float conversions in integer arithmetic, for Triton kernels.

Why software: Triton has no e4m3 type before sm89 (the cache must then be read as uint8), and its
float→fp8 casts differ between the interpreter and the GPU. These helpers are exact, identical on
every target, and bit-for-bit equal to torch: the decoder to torch's FP8 → fp16 conversion on every
finite code, the encoder to torch's round-to-nearest-even cast of the value clamped to ±max
(tests/test_fp8_codec.py checks all 256 codes of each format and a dense sweep of inputs: every
value, every tie and its fp32 neighbours, subnormals, beyond max, ±Inf, ±0).

Where they differ from torch, by design:

* Decoding the e4m3fn NaN codes (0x7F, 0xFF) gives ±480, not NaN: the bits are moved without a
  special case. fp8kv never stores them (writes clamp to ±448). e5m2's Inf and NaN codes decode
  to fp16 Inf and NaN, like torch.
* Encoding saturates ±Inf to ±max (torch's bare cast would give NaN for e4m3fn, Inf for e5m2), as
  the clamp says. A NaN input has no defined code (the GPU's minimum returns max, the interpreter's
  propagates the NaN); callers keep NaN out.

Format parameters (constexpr): ``MANT`` mantissa bits, ``BIAS`` exponent bias, as
``fp8kv.formats.FORMATS[...]`` gives them (``mantissa_bits``, ``bias``, ``max``):
e4m3fn: MANT=3, BIAS=7, FMAX=448.  e5m2: MANT=2, BIAS=15, FMAX=57344.
"""

import triton
import triton.language as tl


@triton.jit
def fp8_bits_to_fp16(code, MANT: tl.constexpr, BIAS: tl.constexpr):
    """uint8 FP8 codes -> float16 values (exact for every finite code; e4m3fn/e5m2 fit in fp16).

    Move sign, exponent and mantissa into fp16's fields (the fp8 exponent lands unbiased-by-15),
    then multiply by 2^(15 - BIAS) to rebias. fp16 keeps subnormals, so fp8 subnormals come out exact.
    """
    c = code.to(tl.uint16)
    bits = ((c & 0x80) << 8) | ((c & 0x7F) << (10 - MANT))
    x = bits.to(tl.float16, bitcast=True)
    if BIAS != 15:
        x = x * (2.0 ** (15 - BIAS))
    return x


@triton.jit
def fp32_to_fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    """fp32 values -> uint8 FP8 codes: clamp to ±FMAX, then round to nearest even.

    Normal results: round the fp32 mantissa to MANT bits with the carry running into the
    exponent (add 0x7FF.. plus the lowest kept bit, shift), then rebias. Subnormal results: adding
    2^(24 - BIAS - MANT) makes the fp32 adder round ``a`` to a multiple of the fp8 subnormal step.
    """
    a = tl.minimum(tl.abs(y), FMAX)
    sign = (y.to(tl.uint32, bitcast=True) >> 31) << 7  # from the bits, so -0.0 keeps its sign
    bits = a.to(tl.uint32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MANT
    rounded = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    normal = (rounded >> SHIFT) - ((127 - BIAS) << MANT)
    MAGIC: tl.constexpr = 2.0 ** (24 - BIAS - MANT)
    STEP_INV: tl.constexpr = 2.0 ** (BIAS + MANT - 1)
    sub = ((a + MAGIC) - MAGIC) * STEP_INV  # exact small integer, 0 .. 2^MANT
    MIN_NORMAL: tl.constexpr = 2.0 ** (1 - BIAS)
    code = tl.where(a < MIN_NORMAL, sub.to(tl.uint32), normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def fp32_to_e4m3(y, FMAX: tl.constexpr, HARDWARE: tl.constexpr):
    """fp32 values -> e4m3 values, clamped to ±FMAX (e4m3's largest, 448) and rounded to nearest even.
    HARDWARE: by the GPU's conversion (sm89+: ``cvt.rn.satfinite.e4m3x2.f32``, two values an instruction; PTX
    has no unsaturated form, so it clamps as well); else by :func:`fp32_to_fp8_bits` (about fifteen integer
    instructions a value), as Triton's interpreter needs: its cast rounds otherwise. fp8 mode rounds every
    probability tile this way; at the chunk launch (128 rows x 64 keys, D 128, 8 warps) bit arithmetic made
    the sm90 attend loop 1031 instructions a warp, the conversion 611 (scripts/attend_sass.py)."""
    if HARDWARE:
        return y.to(tl.float8e4nv)
    else:
        return fp32_to_fp8_bits(y, 3, 7, FMAX).to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp8_bits_to_fp16_ptx(code, MANT: tl.constexpr):
    """uint8 FP8 codes -> float16 with the sm89+ PTX conversion (two codes per instruction).

    Inline assembly is opaque to Triton's layout passes, so the tile is converted in registers
    right after its global load and reaches the dot's shared-memory staging as fp16.
    """
    if MANT == 3:
        asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                             "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
    else:
        asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                             "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }")
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [code], dtype=tl.float16, is_pure=True, pack=4)
