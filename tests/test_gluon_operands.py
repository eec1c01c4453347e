"""The Gluon kernel's code conversions (fp8kv.ops.decode.gluon_operands), run here for every code: the interpreter
cannot run Gluon or inline PTX, so a small PTX evaluator executes each conversion's instructions (the few it uses:
mov, xor, shr, prmt, lop3, fp16x2 sub / fma and the FP8 cvt) on a CPU, and the registers it leaves must hold the
codes' values in the order the kernel's layouts assume (the module's comments). The GPU tests check the whole
kernel against the oracle; these pin each bit trick to its meaning, for all 256 byte values at every byte position."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

gluon_operands = pytest.importorskip("fp8kv.ops.decode.gluon_operands", exc_type=ImportError)


def _f16(bits: int) -> float:
    return float(np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16))


def _bits(value: float) -> int:
    return int(np.array(value, dtype=np.float64).astype(np.float16).view(np.uint16))


def _halves(x: int) -> tuple[float, float]:
    return _f16(x), _f16(x >> 16)


def _pack(lo: float, hi: float) -> int:
    return _bits(lo) | _bits(hi) << 16


def _prmt(a: int, b: int, sel: int) -> int:
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(pool[(sel >> 4 * k) & 7] << 8 * k for k in range(4))  # no sign replication (bit 3) is used


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))


def _cvt(byte: int, dtype: torch.dtype) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(dtype).to(torch.float16))


def run_ptx(asm: str, inputs: list[int], num_outputs: int) -> list[int]:
    """Execute ``asm`` (operands $0.. the outputs, then the inputs, 32-bit) and return the outputs' bits."""
    regs = {f"${num_outputs + i}": x for i, x in enumerate(inputs)}

    def val(token: str) -> int:
        return regs[token] if token in regs else int(token, 0)

    for stmt in (s.strip() for s in asm.strip().strip("{}").replace("\n", " ").split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {lo16, hi16}, r
            lo, hi, src = re.match(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", rest).groups()
            regs[lo], regs[hi] = val(src) & 0xFFFF, val(src) >> 16
            continue
        d, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0]) & 0xFFFFFFFF
        elif op == "xor.b32":
            regs[d] = val(src[0]) ^ val(src[1])
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "lop3.b32":
            regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op == "sub.f16x2":  # exact in float64, rounded once to fp16, as the instruction rounds
            (a0, a1), (b0, b1) = _halves(val(src[0])), _halves(val(src[1]))
            regs[d] = _pack(a0 - b0, a1 - b1)
        elif op == "fma.rn.f16x2":
            (a0, a1), (b0, b1), (c0, c1) = (_halves(val(t)) for t in src)
            regs[d] = _pack(a0 * b0 + c0, a1 * b1 + c1)
        elif op in ("cvt.rn.f16x2.e4m3x2", "cvt.rn.f16x2.e5m2x2"):
            dtype = torch.float8_e4m3fn if "e4m3" in op else torch.float8_e5m2
            x = val(src[0])
            regs[d] = _pack(_cvt(x & 0xFF, dtype), _cvt(x >> 8, dtype))
        else:
            raise AssertionError(f"the evaluator does not know {op!r}: extend it with the instruction's meaning")
    return [regs[f"${i}"] for i in range(num_outputs)]


def _words(salt: int) -> list[int]:
    """256 words whose byte i runs through every value (the other bytes through a permutation of them)."""
    return [sum(((b * (2 * i + 1) + salt * i) % 256) << 8 * i for i in range(4)) for b in range(256)]


def _byte(word: int, i: int) -> int:
    return (word >> 8 * i) & 0xFF


def _int8(byte: int) -> int:
    return byte - 256 if byte > 127 else byte


def _int4(nibble: int) -> int:  # two's complement, as fp8kv.kv_formats.packing stores it
    return (nibble ^ 8) - 8


def _nibble(byte: int, high: int) -> int:
    return (byte >> 4 * high) & 0xF


@pytest.mark.parametrize("salt", [0, 77])
def test_int8_k_and_v_conversions_give_every_code(salt):
    for w in _words(salt):
        regs = run_ptx(gluon_operands.INT8_K_ASM.value, [w], 2)  # codes 0-1 and 2-3 of the word
        assert [x for r in regs for x in _halves(r)] == [_int8(_byte(w, i)) for i in range(4)]
    for even, odd in zip(_words(salt), _words(salt + 1)[::-1], strict=True):
        regs = run_ptx(gluon_operands.INT8_V_ASM.value, [even, odd], 4)
        assert [_halves(r) for r in regs] == [(_int8(_byte(even, i)), _int8(_byte(odd, i))) for i in range(4)]


@pytest.mark.parametrize("salt", [0, 77])
def test_int4_k_conversion_pairs_one_nibble_of_bytes_two_apart(salt):
    """Register s holds nibble s % 2 of bytes s // 2 (e = 0) and s // 2 + 2 (e = 1): the pairing k_dphys assumes."""
    for w in _words(salt):
        regs = run_ptx(gluon_operands.INT4_K_ASM.value, [w], 4)
        want = [(_int4(_nibble(_byte(w, s // 2), s % 2)), _int4(_nibble(_byte(w, s // 2 + 2), s % 2))) for s in range(4)]
        assert [_halves(r) for r in regs] == want, hex(w)


@pytest.mark.parametrize("salt", [0, 77])
def test_int4_v_conversions_pair_the_two_tokens_of_each_column(salt):
    """Register i of the low conversion holds column 2i (byte i's low nibble) of the even and the odd token, the high
    conversion's column 2i + 1."""
    for even, odd in zip(_words(salt), _words(salt + 1)[::-1], strict=True):
        for asm, high in ((gluon_operands.INT4_V_LOW_ASM, 0), (gluon_operands.INT4_V_HIGH_ASM, 1)):
            regs = run_ptx(asm.value, [even, odd], 4)
            want = [(_int4(_nibble(_byte(even, i), high)), _int4(_nibble(_byte(odd, i), high))) for i in range(4)]
            assert [_halves(r) for r in regs] == want, (hex(even), hex(odd), high)


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_v_conversion_pairs_the_two_tokens_of_each_column(fmt, dtype):
    for even, odd in zip(_words(3), _words(4)[::-1], strict=True):
        regs = run_ptx(gluon_operands.FP8_V_ASM[fmt].value, [even, odd], 4)
        want = [(_cvt(_byte(even, i), dtype), _cvt(_byte(odd, i), dtype)) for i in range(4)]
        got = [_halves(r) for r in regs]
        assert np.array_equal(np.array(got), np.array(want), equal_nan=True), (hex(even), hex(odd))


def test_the_evaluator_can_fail():
    """A wrong constant is caught: the INT4 bias off by one (1033 for 1032) gives codes one too small."""
    wrong = gluon_operands.INT4_K_ASM.value.replace("mov.b32 bias, 0x64086408", "mov.b32 bias, 0x64096409")
    assert wrong != gluon_operands.INT4_K_ASM.value
    assert _halves(run_ptx(wrong, [0x00000000], 4)[0]) == (-1.0, -1.0)
    assert _halves(run_ptx(gluon_operands.INT4_K_ASM.value, [0x00000000], 4)[0]) == (_int4(0), _int4(0)) == (0, 0)
