"""The code -> fp16 conversions of the quantized-page kernel (fp8kv.ops.quant_decode.codes) on every byte value,
each way ("cast", "software"; "ptx" on a GPU, and its PTX strings emulated here on every byte), against the
formats' definitions written out here: INT8 and two's complement INT4 nibbles as integers, e2m1 as its eight
magnitudes and a sign bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fp8kv.ops.decode.triton_launcher import CONVERT_CODES
from fp8kv.ops.quant_decode import codes
from fp8kv.ops.quant_decode.codes import e2m1_halves, e2m1_values, int4_tiles, int8_tile, pow2_fp16

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0-7; bit 3 is the sign


@triton.jit
def _decode_every_byte(codes_ptr, signed_ptr, lo_ptr, hi_ptr, WHICH: tl.constexpr, CONVERT: tl.constexpr):
    offs = tl.arange(0, 256)
    c = tl.load(codes_ptr + offs)  # uint8 0..255
    if WHICH == 0:
        lo = int8_tile(tl.load(signed_ptr + offs), CONVERT)  # int8 -128..127
        hi = lo
    elif WHICH == 1:
        lo, hi = int4_tiles(c, CONVERT)
    elif CONVERT == 0:
        lo = e2m1_values(c & 0xF, 1.0).to(tl.float16)
        hi = e2m1_values(c >> 4, 1.0).to(tl.float16)
    else:
        lo, hi = e2m1_halves(c, CONVERT)
        lo = lo.to(tl.float32) * 16384.0  # the bits hold value x 2^-14
        hi = hi.to(tl.float32) * 16384.0
    tl.store(lo_ptr + offs, lo.to(tl.float32))
    tl.store(hi_ptr + offs, hi.to(tl.float32))


def _decode(which: str, convert: str, device: str):
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    lo = torch.empty(256, dtype=torch.float32, device=device)
    hi = torch.empty_like(lo)
    _decode_every_byte[(1,)](codes, codes.view(torch.int8), lo, hi, WHICH=("int8", "int4", "e2m1").index(which),
                             CONVERT=CONVERT_CODES[convert])
    return lo.cpu(), hi.cpu()


def _int4(n: torch.Tensor) -> torch.Tensor:
    return torch.where(n >= 8, n - 16, n).float()


def _e2m1(n: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1_MAGNITUDES)[n & 7]
    return torch.where(n >= 8, -mag, mag)


def _expected(which: str):
    b = torch.arange(256)
    if which == "int8":
        s = torch.arange(256, dtype=torch.uint8).view(torch.int8).float()
        return s, s
    f = _int4 if which == "int4" else _e2m1
    return f(b & 0xF), f(b >> 4)


def _check(which, convert, device):
    lo, hi = _decode(which, convert, device)
    want_lo, want_hi = _expected(which)
    assert torch.equal(lo, want_lo), f"{which} {convert}: low codes {(lo != want_lo).nonzero().flatten().tolist()}"
    assert torch.equal(hi, want_hi), f"{which} {convert}: high codes {(hi != want_hi).nonzero().flatten().tolist()}"


@pytest.mark.parametrize("which", ["int8", "int4", "e2m1"])
@pytest.mark.parametrize("convert", ["cast", "software"])
def test_every_byte_decodes_to_its_value(which, convert):
    _check(which, convert, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inline PTX; the interpreter runs the rest)")
@pytest.mark.parametrize("which", ["int8", "int4", "e2m1"])
@pytest.mark.parametrize("convert", ["cast", "software", "ptx"])
def test_every_byte_decodes_to_its_value_on_a_gpu(which, convert):
    _check(which, convert, "cuda")


@triton.jit
def _pow2_every_exponent(e_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, pow2_fp16(tl.load(e_ptr + offs)).to(tl.float32))


def test_pow2_fp16_is_exact_to_its_smallest_subnormal_and_zero_below():
    """MXFP4's per-block factors 2^(c - c_max + 14): every fp16 power of two, subnormals included, 0 below 2^-24."""
    e = torch.arange(-64, 0, dtype=torch.int32) + 16  # -48 .. 15
    out = torch.empty(64, dtype=torch.float32)
    _pow2_every_exponent[(1,)](e, out, N=64)
    want = torch.where(e >= -24, torch.pow(2.0, e.double()), torch.zeros((), dtype=torch.float64)).float()
    assert torch.equal(out, want), (e[out != want].tolist(), out[out != want].tolist())


# ------------------------------------------------------------------------------- the inline PTX, emulated
def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte sel_i of {b, a} (a: bytes 0-3), or with bit 3 of
    sel_i set, that byte's sign bit replicated."""
    src, out = a | (b << 32), 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (s & 7))) & 0xFF
        out |= ((0xFF if byte & 0x80 else 0) if s & 8 else byte) << (8 * i)
    return out


def _f16x2(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


_OPS = {"xor.b32": lambda a, b: a ^ b, "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
        "mov.b32": lambda a: a, "shl.b32": lambda a, n: (a << n) & 0xFFFFFFFF, "shr.b32": lambda a, n: a >> n,
        "prmt.b32": _prmt}


def _emulate(asm: str, word: int) -> list[float]:
    """Run one of fp8kv's inline-PTX strings on the 32-bit input ``$2``: the four fp16 of ``$0`` and ``$1``
    (only the instructions they use; any other is an error)."""
    regs, declared = {"$2": word}, {"$0", "$1"}
    body = asm.strip()
    assert body[0] == "{" and body[-1] == "}"
    for stmt in filter(None, (t.strip() for t in body[1:-1].split(";"))):
        if stmt.startswith(".reg .b32 "):
            declared |= {r.strip() for r in stmt[len(".reg .b32 "):].split(",")}
            continue
        op, rest = stmt.split(None, 1)
        dest, *args = (t.strip() for t in rest.split(","))
        assert dest in declared, f"{dest} is not declared"
        v = [regs[t] if t in regs else int(t, 0) for t in args]
        if op == "sub.f16x2":
            r = (_f16x2(v[0]).astype(np.float64) - _f16x2(v[1]).astype(np.float64)).astype(np.float16).view(np.uint16)
            regs[dest] = int(r[0]) | int(r[1]) << 16
            continue
        regs[dest] = _OPS[op](*v)
    return [*_f16x2(regs["$0"]).tolist(), *_f16x2(regs["$1"]).tolist()]


def _nibble(n):
    return n - 16 if n >= 8 else n


def _e2m1_scaled(n):  # the value x 2^-14, with its sign (code 8 is -0)
    mag = E2M1_MAGNITUDES[n & 7] * 2.0**-14
    return -mag if n & 8 else mag


PTX_CASES = {"INT8_PTX": lambda b: b - 256 if b >= 128 else b, "INT4_PTX_LO": lambda b: _nibble(b & 0xF),
             "INT4_PTX_HI": lambda b: _nibble(b >> 4), "E2M1_PTX_LO": lambda b: _e2m1_scaled(b & 0xF),
             "E2M1_PTX_HI": lambda b: _e2m1_scaled(b >> 4)}


@pytest.mark.parametrize("name", sorted(PTX_CASES))
def test_every_byte_in_every_position_through_the_inline_ptx(name):
    """Each PTX string, emulated: every byte value in each of the four positions, beside fillers that would leak
    into it if a shift or mask were wrong; the value (and e2m1's sign of zero) of every code."""
    asm, want = getattr(codes, name).value, PTX_CASES[name]
    for pos in range(4):
        for fill in (0x00, 0xFF, 0x80, 0x7F, 0x88, 0x77, 0x0F, 0xF0):
            for b in range(256):
                bs = [fill] * 4
                bs[pos] = b
                got = _emulate(asm, bs[0] | bs[1] << 8 | bs[2] << 16 | bs[3] << 24)
                for i in range(4):
                    w = want(bs[i])
                    assert got[i] == w and np.signbit(got[i]) == np.signbit(w), (name, hex(b), pos, hex(fill), i, got[i], w)


def test_the_emulation_catches_a_wrong_selector():
    """A prmt selector off by one byte gives wrong values: the emulation above can fail."""
    bad = codes.INT8_PTX.value.replace("0x4140", "0x4240")
    assert _emulate(bad, 0x04030201)[:2] != [1.0, 2.0] and _emulate(codes.INT8_PTX.value, 0x04030201) == [1, 2, 3, 4]

