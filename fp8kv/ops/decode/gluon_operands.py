"""How the Gluon decode kernel's (:mod:`.gluon_kernel`) code tiles become MMA operands: the codes it reads, the
permutation of head_dim its loads use, and the conversions of FP8, INT8 and INT4 codes to fp16 B operands in registers.

How the loads stay wide although the operand layout scatters every thread's elements: the
contraction index of Q·Kᵀ and the output column of P·V (both head_dim) may be permuted freely, as
long as the query (loaded once) and the output store (once) use the same permutation. With HP the
padded head_dim (64 or 128) and lane = 4g + t:

* K slice, physical [NW tokens, HP bytes]: the thread reads the HP/4 contiguous bytes
  ``d = (HP/4) t + c`` of tokens ``g + 8r``; byte c = 4 kb + 2 h + e is contraction index
  ``k = 16 kb + 8 h + 2 t + e``, where the m16n8k16 B fragment wants it.
* V slice: the thread reads the HP/8 contiguous bytes ``d = (HP/8) g + j`` of tokens
  ``2t + e + 8h + 16kb``, which are output columns ``n = 8 j + g``.
* INT4 codes (two a byte, column 2i in byte i's low nibble): the same columns in half the bytes. K's thread
  reads HP/8 bytes, the pair e = 0, 1 of a register in the same nibble h of two bytes two apart in a word
  (nibble ``(HP/4) t + 8 (kb >> 1) + 4 e + 2 (kb & 1) + h``: one mask takes both); V's reads HP/16, byte m
  holding columns j = 2m and 2m + 1 of one token.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["CODE_TYPES", "k_dphys", "v_dphys", "k_operand", "v_operand", "INT8_K_ASM", "INT4_K_ASM", "INT8_V_ASM",
           "INT4_V_LOW_ASM", "INT4_V_HIGH_ASM", "FP8_V_ASM"]

# The codes it reads, as Gluon types: FP8 pages, INT8 codes (read as bytes, turned to fp16 by their bits) and INT4
# codes, two two's complement nibbles a byte (fp8kv.kv_formats.packing), named by the bytes that hold them
CODE_TYPES = {"fp8_e4m3": gl.float8e4nv, "fp8_e5m2": gl.float8e5, "int8": gl.int8, "int4": gl.uint8}
# INT8 codes become fp16 by their bits (the asm in k_operand and v_operand): 0x6400 | (c ^ 0x80) is 1024 + c + 128
# exactly, and minus 1152 (0x6480, twice in the word 0x64806480) it is c. INT4 codes likewise: n = c ^ 8 is c + 8; a
# nibble in the low bits gives 0x6400 | n = 1024 + n, minus 1032 (0x6408) it is c; one in bits 4-7 gives 1024 + 16 n,
# times 1/16 (0x2C00) minus 72 (0xD480 is -72) it is c. One lop3 ((a & b) ^ c: 0x6A) masks a nibble of two bytes two
# apart, flips its sign bit and sets the exponent (c = 0x6408 or 0x6480 in each half).

# The conversions, as PTX (operands $0.. the outputs, then the inputs; tests/test_gluon_operands.py runs them for every
# code on a CPU). Each takes words of four codes (pack=4).
# INT8 K: a word's four codes -> two fp16x2 registers, codes 0-1 and 2-3
INT8_K_ASM = gl.constexpr(
    "{ .reg .b32 x, hi8, bias; xor.b32 x, $2, 0x80808080; mov.b32 hi8, 0x64646464; mov.b32 bias, 0x64806480;\n"
    "prmt.b32 $0, x, hi8, 0x4140; prmt.b32 $1, x, hi8, 0x4342;\n"
    "sub.f16x2 $0, $0, bias; sub.f16x2 $1, $1, bias; }")
# INT4 K: a word of eight nibbles -> four fp16x2 registers; register s holds nibble s % 2 of bytes s // 2 and s // 2 + 2
INT4_K_ASM = gl.constexpr(
    "{ .reg .b32 w, lo, hi, clo, chi, bias, mul, add; mov.b32 lo, 0x000F000F; mov.b32 hi, 0x00F000F0;\n"
    "mov.b32 clo, 0x64086408; mov.b32 chi, 0x64806480; mov.b32 bias, 0x64086408; mov.b32 mul, 0x2C002C00;\n"
    "mov.b32 add, 0xD480D480; shr.b32 w, $4, 8;\n"
    "lop3.b32 $0, $4, lo, clo, 0x6A; lop3.b32 $1, $4, hi, chi, 0x6A;\n"
    "lop3.b32 $2, w, lo, clo, 0x6A; lop3.b32 $3, w, hi, chi, 0x6A;\n"
    "sub.f16x2 $0, $0, bias; fma.rn.f16x2 $1, $1, mul, add; sub.f16x2 $2, $2, bias; fma.rn.f16x2 $3, $3, mul, add; }")
# INT8 V: the words of an even and an odd token -> four fp16x2 registers, register i = (even's code i, odd's code i)
INT8_V_ASM = gl.constexpr(
    "{ .reg .b32 lo, hi, hi8, bias; mov.b32 hi8, 0x64646464; mov.b32 bias, 0x64806480;\n"
    "prmt.b32 lo, $4, $5, 0x5140; prmt.b32 hi, $4, $5, 0x7362;\n"
    "xor.b32 lo, lo, 0x80808080; xor.b32 hi, hi, 0x80808080;\n"
    "prmt.b32 $0, lo, hi8, 0x4140; prmt.b32 $1, lo, hi8, 0x4342;\n"
    "prmt.b32 $2, hi, hi8, 0x4140; prmt.b32 $3, hi, hi8, 0x4342;\n"
    "sub.f16x2 $0, $0, bias; sub.f16x2 $1, $1, bias; sub.f16x2 $2, $2, bias; sub.f16x2 $3, $3, bias; }")
# INT4 V: the words of an even and an odd token -> register i = (even's, odd's) low nibble of byte i (column 2i) ...
INT4_V_LOW_ASM = gl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3, m, c, bias; mov.b32 m, 0x000F000F; mov.b32 c, 0x64086408; mov.b32 bias, 0x64086408;\n"
    "prmt.b32 t0, $4, $5, 0x5410; prmt.b32 t2, $4, $5, 0x7632; shr.b32 t1, t0, 8; shr.b32 t3, t2, 8;\n"
    "lop3.b32 $0, t0, m, c, 0x6A; lop3.b32 $1, t1, m, c, 0x6A; lop3.b32 $2, t2, m, c, 0x6A; lop3.b32 $3, t3, m, c, 0x6A;\n"
    "sub.f16x2 $0, $0, bias; sub.f16x2 $1, $1, bias; sub.f16x2 $2, $2, bias; sub.f16x2 $3, $3, bias; }")
# ... and their high nibble (column 2i + 1)
INT4_V_HIGH_ASM = gl.constexpr(
    "{ .reg .b32 t0, t1, t2, t3, m, c, mul, add; mov.b32 m, 0x00F000F0; mov.b32 c, 0x64806480;\n"
    "mov.b32 mul, 0x2C002C00; mov.b32 add, 0xD480D480;\n"
    "prmt.b32 t0, $4, $5, 0x5410; prmt.b32 t2, $4, $5, 0x7632; shr.b32 t1, t0, 8; shr.b32 t3, t2, 8;\n"
    "lop3.b32 $0, t0, m, c, 0x6A; lop3.b32 $1, t1, m, c, 0x6A; lop3.b32 $2, t2, m, c, 0x6A; lop3.b32 $3, t3, m, c, 0x6A;\n"
    "fma.rn.f16x2 $0, $0, mul, add; fma.rn.f16x2 $1, $1, mul, add; fma.rn.f16x2 $2, $2, mul, add;\n"
    "fma.rn.f16x2 $3, $3, mul, add; }")
# FP8 V: the words of an even and an odd token -> register i = (even's code i, odd's code i), by cvt
FP8_V_ASM = {name: gl.constexpr(
    "{ .reg .b32 lo, hi; .reg .b16 c0, c1, c2, c3;\n"
    "prmt.b32 lo, $4, $5, 0x5140; prmt.b32 hi, $4, $5, 0x7362;\n"
    "mov.b32 {c0, c1}, lo; mov.b32 {c2, c3}, hi;\n"
    + " ".join(f"{cvt} ${i}, c{i};" for i in range(4)) + " }")
    for name, cvt in (("e4m3", "cvt.rn.f16x2.e4m3x2"), ("e5m2", "cvt.rn.f16x2.e5m2x2"))}
E4M3_V_ASM, E5M2_V_ASM = FP8_V_ASM["e4m3"], FP8_V_ASM["e5m2"]


@gluon.jit
def k_dphys(k, HP: gl.constexpr, PACKED: gl.constexpr):
    """Physical head_dim index of contraction index k in the K tile (and the query). One-byte codes: byte
    (HP/4) t + 4 kb + 2 h + e. INT4 codes (PACKED): nibble (HP/4) t + 8 (kb >> 1) + 4 e + 2 (kb & 1) + h, so that
    the pair e = 0, 1 a B-operand register holds is the same nibble of bytes two apart in a word (see k_operand)."""
    if PACKED:
        d = (HP // 4) * ((k >> 1) & 3) + 8 * (k >> 5) + 4 * (k & 1) + 2 * ((k >> 4) & 1) + ((k >> 3) & 1)
    else:
        d = (HP // 4) * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)
    return d


@gluon.jit
def v_dphys(n, HP: gl.constexpr):
    """Physical head_dim index of output column n = 8j + g (stored at (HP/8) g + j)."""
    return (HP // 8) * (n & 7) + (n >> 3)


@gluon.jit
def k_operand(k_codes, W: gl.constexpr, NW: gl.constexpr, HP: gl.constexpr, B_OP: gl.constexpr,
              CODE_TY: gl.constexpr):
    """[W, NW, HB] uint8 codes (K_PHYS) -> Kᵀ [W, HP (permuted k), NW] fp16 in the B layout."""
    if CODE_TY == gl.uint8:
        # INT4: register s of a word's four holds nibble s % 2 of its bytes s // 2 (e = 0) and s // 2 + 2 (e = 1), as
        # k_dphys places them; the word's registers are kb = 2 i + s // 2, h = s % 2 (i the word), a mask each
        x = k_codes.reshape([W, NW, 4, HP // 32, 4])  # w, n, t, i, s (the asm's element s is register s)
        pairs = gl.inline_asm_elementwise(INT4_K_ASM, "=r,=r,=r,=r,r", [x], dtype=gl.int32, is_pure=True, pack=4)
        lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
        x = gl.join(lo, hi).reshape([W, NW, 4, HP // 16, 2, 2])  # w, n, t, kb = 2 i + s // 2, h = s % 2, e
        x = x.permute([0, 3, 4, 2, 5, 1])  # w, kb, h, t, e, n
        x = x.reshape([W, HP, NW])  # k = 16kb + 8h + 2t + e
        k = gl.convert_layout(x, B_OP, assert_trivial=True)
    else:
        x = k_codes.reshape([W, NW, 4, HP // 16, 2, 2])  # w, n, t, kb, h, e
        x = x.permute([0, 3, 4, 2, 5, 1])  # w, kb, h, t, e, n
        x = x.reshape([W, HP, NW])  # k = 16kb + 8h + 2t + e
        x = gl.convert_layout(x, B_OP, assert_trivial=True)
        if CODE_TY == gl.int8:  # four codes a register: one xor, two byte permutes, two fp16x2 subtractions
            k = gl.inline_asm_elementwise(INT8_K_ASM, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
        else:
            k = x.to(CODE_TY, bitcast=True).to(gl.float16)
    return k


@gluon.jit
def v_operand(v_codes, W: gl.constexpr, NW: gl.constexpr, HP: gl.constexpr, B_OP: gl.constexpr,
              CODE_TY: gl.constexpr):
    """[W, NW, HB] uint8 codes (V_PHYS) -> V [W, NW, HP (permuted n)] fp16 in the B layout.

    A B-operand register holds one column of two adjacent tokens, while a loaded word holds four
    columns of one token: one two-source byte permute per four codes (``prmt``) pairs them, then
    two ``cvt`` per permuted word (the compiler, left to itself, spends four integer ops per cvt);
    INT8 codes take one more permute per pair instead, spreading them into fp16 bit patterns. INT4 codes
    (two columns a byte) take one permute per byte pair, then a mask for each of its two columns."""
    HB: gl.constexpr = v_codes.shape[2]
    x = v_codes.reshape([W, NW // 2, 2, HB]).permute([0, 1, 3, 2])  # w, token pair, byte, e
    even, odd = gl.split(x)
    if CODE_TY == gl.uint8:
        x = _v_nibble_pairs(even, odd, W, NW, HP)
    else:
        x = _v_byte_pairs(even, odd, CODE_TY)
    x = x.permute([0, 1, 3, 2]).reshape([W, NW, HP])  # token = 2 pair + e
    x = x.reshape([W, NW, 8, HP // 8])  # w, tok, g, j
    x = x.permute([0, 1, 3, 2])  # w, tok, j, g
    x = x.reshape([W, NW, HP])  # n = 8j + g
    return gl.convert_layout(x, B_OP, assert_trivial=True)


@gluon.jit
def _v_byte_pairs(even, odd, CODE_TY: gl.constexpr):
    """One-byte V codes (FP8, INT8) of the even and odd token of each pair, [W, NW / 2, HP] each -> fp16
    [W, NW / 2, HP, 2], the last dim the pair's token."""
    if CODE_TY == gl.int8:
        pairs = gl.inline_asm_elementwise(INT8_V_ASM, "=r,=r,=r,=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=4)
    else:
        if CODE_TY == gl.float8e4nv:
            asm: gl.constexpr = E4M3_V_ASM
        else:
            asm: gl.constexpr = E5M2_V_ASM
        pairs = gl.inline_asm_elementwise(asm, "=r,=r,=r,=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=4)
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pairs],
                                       dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    return gl.join(lo, hi)


@gluon.jit
def _v_nibble_pairs(even, odd, W: gl.constexpr, NW: gl.constexpr, HP: gl.constexpr):
    """INT4 V codes of the even and odd token of each pair, [W, NW / 2, HP / 2] bytes each (byte m: columns 2m in the
    low nibble, 2m + 1 in the high one) -> fp16 [W, NW / 2, HP, 2], the last dim the pair's token."""
    # bytes i of both tokens to bytes 0 and 2 of a word (t01: bytes 0 and 1 at 0-1 and 2-3, shifted right 8 for 1)
    low = gl.inline_asm_elementwise(INT4_V_LOW_ASM, "=r,=r,=r,=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=4)
    high = gl.inline_asm_elementwise(INT4_V_HIGH_ASM, "=r,=r,=r,=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=4)
    low_e0, low_e1 = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [low],
                                               dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    high_e0, high_e1 = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [high],
                                                 dtype=(gl.float16, gl.float16), is_pure=True, pack=1)
    x = gl.join(gl.join(low_e0, high_e0), gl.join(low_e1, high_e1))  # w, pair, byte m, column 2m + f, e
    return x.reshape([W, NW // 2, HP, 2])  # w, pair, column, e
