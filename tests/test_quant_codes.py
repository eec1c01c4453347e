"""The code -> fp16 conversions of the quantized-page kernel (fp8kv.ops.quant_decode.codes) on every byte value,
each way ("cast", "software"; "ptx" on a GPU), against the formats' definitions written out here: INT8 and
two's complement INT4 nibbles as integers, e2m1 as its eight magnitudes and a sign bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fp8kv.ops.decode.triton_launcher import CONVERT_CODES
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
