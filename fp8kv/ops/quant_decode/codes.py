"""Code tiles of the quantized formats -> the fp16 dot operands of :mod:`.kernel`, three ways (CONVERT, the
FP8 decode's names and constexpr values from :mod:`fp8kv.ops.decode.triton_helpers`):

* ``cast`` (CONVERT_CAST): integer -> float conversions and fp32 arithmetic (the kernel's first way). Each
  value costs an integer-to-float conversion, a quarter-rate instruction on sm80-sm90; the 4-bit floats add an
  fp32 -> fp16 conversion and read their block scale once per code byte.
* ``software`` (CONVERT_SOFTWARE): the code's bits are placed into fp16's fields with integer ops and one fp16
  subtraction or product, no conversion instruction (the magic-number decoding of INT8 / INT4 weights in GPU
  GEMM kernels); the 4-bit floats load each block scale once per block. The values of ``cast`` (NVFP4's
  scaled by 2^-7 exactly, the kernel multiplies it back in fp32; e2m1's code 8 is -0 here, +0 there).
* ``ptx`` (CONVERT_PTX): the same bit moves on four codes per instruction (``prmt``, ``and`` / ``or``, which
  ptxas merges into ``lop3``, and ``sub.f16x2``)
  in inline PTX (sm80+ GPUs; the interpreter cannot run assembly).

Why the bits are exact:

* INT8 ``c``: fp16 ``0x6400 | (c ^ 0x80)`` is 1024 + (c + 128), exact (an 11-bit significand); minus 1152 gives c.
* INT4 nibble ``n`` (two's complement): ``0x6400 | (n ^ 8)`` is 1024 + (n ^ 8); minus 1032 gives -8..7.
* e2m1 nibble ``s e1 e0 m``: fp16 bits ``s << 15 | (e1 e0 m) << 9`` put e into fp16's exponent and m on its
  top mantissa bit, which is the e2m1 value x 2^-14 (exponent 0: fp16's subnormals give m x 2^-15 = 0.5 m x
  2^-14). NVFP4 multiplies it by its e4m3 block scale x 2^7 (fp16, exact: at most 448 x 128 = 57344):
  code x scale x 2^-7 is a multiple of 2^-17 (codes are multiples of 1/2, e4m3 scales of 2^-9) with at most 6
  significant bits and at most 21, so fp16 holds it exactly; it is an fp16 subnormal (down to 2^-17) only
  where the block scale is an e4m3 subnormal (below 2^-6), which fp16 arithmetic and the tensor cores keep.
"""

import triton
import triton.language as tl

from ..decode.triton_helpers import CONVERT_CAST, CONVERT_PTX, CONVERT_SOFTWARE
from ..fp8_codec import fp8_bits_to_fp16

NVFP4_UNIT = tl.constexpr(128.0)  # software / ptx NVFP4 tiles hold code x scale / 128: the kernel multiplies it back

__all__ = ["CONVERT_CAST", "CONVERT_SOFTWARE", "CONVERT_PTX", "NVFP4_UNIT", "INT8_PTX", "INT4_PTX_LO", "INT4_PTX_HI",
           "E2M1_PTX_LO", "E2M1_PTX_HI", "int8_tile", "int4_tiles", "nvfp4_tiles", "mxfp4_tiles", "e2m1_halves"]


# --- cast: integer -> float conversions --------------------------------------------------------------------------

@triton.jit
def int4_values(nibbles):
    """Two's complement nibbles (0..15, any int type) -> their values -8..7 as fp16 (exact)."""
    n = nibbles.to(tl.int32)
    return ((n ^ 8) - 8).to(tl.float16)


@triton.jit
def e2m1_values(nibbles, scale):
    """e2m1 codes (0..15) times fp32 ``scale`` -> fp32. |code| x 4 is an integer: ``2m`` for exponent 0,
    ``(2 + m) << e`` otherwise (e: bits 1-2, m: bit 0), so 0, 0.5, 1, 1.5, 2, 3, 4, 6 come out exactly; bit 3
    is the sign (code 8, -0, gives +0 here)."""
    n = nibbles.to(tl.int32)
    e = (n >> 1) & 3
    m = n & 1
    mag4 = tl.where(e == 0, 2 * m, (2 + m) << e)
    signed = tl.where((n & 8) != 0, -mag4, mag4).to(tl.float32)
    return signed * (scale * 0.25)


@triton.jit
def pow2_from_bits(e):
    """``2^e`` in fp32, exactly, for int32 ``e`` in [-127, 127] (2^-127, a subnormal, from its own bits)."""
    return tl.where(e > -127, ((e + 127) << 23), 1 << 22).to(tl.float32, bitcast=True)


# --- software: the bits into fp16's fields -----------------------------------------------------------------------

@triton.jit
def _fp16_from_bits(bits):
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def e2m1_scaled_fp16(nibbles):
    """e2m1 codes (0..15, uint16) -> fp16 of value x 2^-14 (exact; module docstring)."""
    return _fp16_from_bits(((nibbles & 8) << 12) | ((nibbles & 7) << 9))


@triton.jit
def pow2_fp16(e):
    """``2^e`` in fp16 for int32 ``e`` <= 15: exact down to 2^-24 (fp16's smallest subnormal), 0 below."""
    return tl.where(e >= -24, pow2_from_bits(tl.maximum(e, -24)).to(tl.float16), 0.0).to(tl.float16)


@triton.jit
def scaled_by_block(x, s, BLOCK_N: tl.constexpr, NB_PAD: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """``x`` ``[BLOCK_N, NB_PAD x BLOCK_BYTES]`` times its block's ``s`` ``[BLOCK_N, NB_PAD]``, byte ``j`` in block
    ``j // BLOCK_BYTES``: the tile seen as ``[BLOCK_N, NB_PAD, BLOCK_BYTES]``, the scales broadcast along its
    last dim."""
    x3 = tl.reshape(x, (BLOCK_N, NB_PAD, BLOCK_BYTES))
    return tl.reshape(x3 * s[:, :, None], (BLOCK_N, NB_PAD * BLOCK_BYTES))


@triton.jit
def block_scale_codes(scale_ptr, s_row, t_mask, NB: tl.constexpr, NB_PAD: tl.constexpr):
    """The ``NB`` block-scale bytes of each token (``s_row``: its first) as ``[BLOCK_N, NB_PAD]`` int32, 0 where
    masked: one load per block, not per code byte."""
    offs_b = tl.arange(0, NB_PAD)
    if NB == NB_PAD:  # a mask the same along each token's scales: they load as one vector
        mask = t_mask[:, None] & (offs_b >= 0)[None, :]
    else:
        mask = t_mask[:, None] & (offs_b < NB)[None, :]
    return tl.load(scale_ptr + s_row[:, None] + offs_b[None, :], mask=mask, other=0).to(tl.int32)


# --- ptx: four codes per instruction ------------------------------------------------------------------------------

# The inline PTX, four codes of one 32-bit register ($2, code i in byte i) to four fp16 (codes 0-1 in $0, 2-3 in
# $1, the lower code in the lower half), as Triton's inline_asm_elementwise packs them (tests/test_quant_codes.py
# runs each on every byte value in every position through an emulation of these instructions).
# INT8: each byte flipped (c ^ 0x80), spread under 0x64 by prmt (1024 + c + 128), minus 1152 (0x6480).
INT8_PTX = tl.constexpr(
    "{ .reg .b32 t, m, k; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; mov.b32 k, 0x64806480; "
    "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; }")
# INT4, the low (LO) or high (HI) nibbles: masked in place and flipped (n ^ 8), spread under 0x64, minus 1032.
_INT4_SPREAD = ("mov.b32 m, 0x64646464; mov.b32 k, 0x64086408; prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; "
                "sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; }")
INT4_PTX_LO = tl.constexpr("{ .reg .b32 t, m, k; and.b32 t, $2, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; "
                           + _INT4_SPREAD)
INT4_PTX_HI = tl.constexpr("{ .reg .b32 t, m, k; shr.b32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F; "
                           "xor.b32 t, t, 0x08080808; " + _INT4_SPREAD)
# e2m1 x 2^-14, the low or high codes: in all four bytes at once each code becomes its fp16's high byte (sign to
# bit 7, magnitude to bits 1-3), which prmt puts over zero low bytes.
_E2M1_SPREAD = "or.b32 a, a, b; mov.b32 z, 0; prmt.b32 $0, a, z, 0x1404; prmt.b32 $1, a, z, 0x3424; }"
E2M1_PTX_LO = tl.constexpr("{ .reg .b32 a, b, z; shl.b32 a, $2, 1; and.b32 a, a, 0x0E0E0E0E; shl.b32 b, $2, 4; "
                           "and.b32 b, b, 0x80808080; " + _E2M1_SPREAD)
E2M1_PTX_HI = tl.constexpr("{ .reg .b32 a, b, z; shr.b32 a, $2, 3; and.b32 a, a, 0x0E0E0E0E; "
                           "and.b32 b, $2, 0x80808080; " + _E2M1_SPREAD)


@triton.jit
def _ptx(codes, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [codes], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def e2m1_halves(codes, CONVERT: tl.constexpr):
    """Packed e2m1 bytes -> (even, odd) channels as fp16 value x 2^-14."""
    if CONVERT == CONVERT_PTX:
        return _ptx(codes, E2M1_PTX_LO), _ptx(codes, E2M1_PTX_HI)
    c = codes.to(tl.uint16)
    return e2m1_scaled_fp16(c & 0xF), e2m1_scaled_fp16(c >> 4)


# --- the tiles the kernel takes ----------------------------------------------------------------------------------

@triton.jit
def int8_tile(codes, CONVERT: tl.constexpr):
    """An int8 code tile -> fp16 values (exact, every way)."""
    if CONVERT == CONVERT_PTX:
        x = _ptx(codes, INT8_PTX)
    elif CONVERT == CONVERT_SOFTWARE:
        u = codes.to(tl.uint8, bitcast=True).to(tl.uint16)
        x = _fp16_from_bits((u ^ 0x80) | 0x6400) - 1152.0
    else:
        x = codes.to(tl.float16)
    return x.to(tl.float16)


@triton.jit
def int4_tiles(codes, CONVERT: tl.constexpr):
    """A tile of packed int4 bytes -> the (even, odd) channels' values in fp16 (exact, every way)."""
    if CONVERT == CONVERT_PTX:
        lo = _ptx(codes, INT4_PTX_LO)
        hi = _ptx(codes, INT4_PTX_HI)
    elif CONVERT == CONVERT_SOFTWARE:
        x = codes.to(tl.uint16) ^ 0x88  # both nibbles' sign bits flipped at once
        lo = _fp16_from_bits((x & 0xF) | 0x6400) - 1032.0
        hi = _fp16_from_bits((x >> 4) | 0x6400) - 1032.0
    else:
        lo = int4_values(codes & 0xF)
        hi = int4_values(codes >> 4)
    return lo.to(tl.float16), hi.to(tl.float16)


@triton.jit
def nvfp4_tiles(codes, scale_ptr, s_row, t_mask, c_ld, CONVERT: tl.constexpr, BLOCK_N: tl.constexpr,
                C_PAD: tl.constexpr, NB: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """An NVFP4 tile of packed codes ``[N, C_PAD]`` -> its even and odd channels in fp16 (exact): code x e4m3
    block scale (cast), or that / 128 (software / ptx: the caller multiplies :data:`NVFP4_UNIT` back).
    ``s_row`` ``[N]``: each token's first scale (byte ``j`` of the codes lies in block ``j // BLOCK_BYTES``)."""
    if CONVERT == CONVERT_CAST:
        blocks = s_row[:, None] + (tl.arange(0, C_PAD) // BLOCK_BYTES)[None, :]  # a scale read per code byte
        scale = fp8_bits_to_fp16(tl.load(scale_ptr + blocks, mask=c_ld, other=0), 3, 7).to(tl.float32)
        lo = e2m1_values(codes & 0xF, scale).to(tl.float16)
        hi = e2m1_values(codes >> 4, scale).to(tl.float16)
    else:
        NB_PAD: tl.constexpr = C_PAD // BLOCK_BYTES
        s = fp8_bits_to_fp16(block_scale_codes(scale_ptr, s_row, t_mask, NB, NB_PAD), 3, 7) * (16384.0 / NVFP4_UNIT)
        s = s.to(tl.float16)
        lo, hi = e2m1_halves(codes, CONVERT)
        lo = scaled_by_block(lo, s, BLOCK_N, NB_PAD, BLOCK_BYTES)
        hi = scaled_by_block(hi, s, BLOCK_N, NB_PAD, BLOCK_BYTES)
    return lo, hi


@triton.jit
def mxfp4_tiles(codes, scale_ptr, s_row, t_mask, c_ld, CONVERT: tl.constexpr, BLOCK_N: tl.constexpr,
                C_PAD: tl.constexpr, NB: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """An MXFP4 tile of packed codes -> its even and odd channels in fp16 and each token's factor (fp32 ``[N]``).

    Each token's largest block scale ``2^(c_max - 127)`` (e8m0 code ``c`` is ``2^(c - 127)``) is factored out
    and returned; the tiles hold code x ``2^(c - c_max)``: exact down to blocks 2^-23 below the token's largest
    (fp16's subnormals end at 2^-24), every way; smaller blocks are as small beside that token's norm."""
    if CONVERT == CONVERT_CAST:
        blocks = s_row[:, None] + (tl.arange(0, C_PAD) // BLOCK_BYTES)[None, :]
        c = tl.load(scale_ptr + blocks, mask=c_ld, other=0).to(tl.int32)
        c_max = tl.max(c, axis=1)
        rel = c - c_max[:, None]
        factor = tl.where(rel > -127, pow2_from_bits(tl.maximum(rel, -126)), 0.0)
        lo = e2m1_values(codes & 0xF, factor).to(tl.float16)
        hi = e2m1_values(codes >> 4, factor).to(tl.float16)
    else:
        NB_PAD: tl.constexpr = C_PAD // BLOCK_BYTES
        c = block_scale_codes(scale_ptr, s_row, t_mask, NB, NB_PAD)
        c_max = tl.max(c, axis=1)
        # code x 2^-14 (the bits) x 2^(c - c_max + 14): code x 2^(c - c_max)
        f = pow2_fp16(c - c_max[:, None] + 14)
        lo, hi = e2m1_halves(codes, CONVERT)
        lo = scaled_by_block(lo, f, BLOCK_N, NB_PAD, BLOCK_BYTES)
        hi = scaled_by_block(hi, f, BLOCK_N, NB_PAD, BLOCK_BYTES)
    return lo, hi, pow2_from_bits(c_max - 127)
