"""fp8kv.ops.fp8_codec against torch's own FP8 conversions.

Decoder: every one of the 256 codes of e4m3fn and e5m2, bit for bit (the sign of zero included).
Encoder: a dense sweep of fp32 inputs (every representable value, every midpoint between two
neighbours, the fp32 values just beside each midpoint, the subnormal range, values beyond max,
±Inf, ±0) against ``torch.clamp(x, -max, max).to(fp8)``, round-to-nearest-even of the clamped value.

On a machine without a GPU the kernels run under the Triton interpreter (the root conftest sets
TRITON_INTERPRET=1); the codec is integer arithmetic plus one fp32 addition, so the interpreter
computes exactly what the GPU does. The PTX decoder (inline assembly, which the interpreter cannot
run) is checked on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from fixtures import DEVICE, seeded

from fp8kv.formats import FORMATS
from fp8kv.ops.fp8_codec import fp8_bits_to_fp16, fp8_bits_to_fp16_ptx, fp32_to_fp8_bits

FMTS = ["e4m3", "e5m2"]
BLOCK = 4096


@triton.jit
def _decode_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    codes = tl.load(src + offs, mask=mask, other=0)
    tl.store(dst + offs, fp8_bits_to_fp16(codes, MANT, BIAS), mask=mask)


@triton.jit
def _decode_ptx_kernel(src, dst, n, MANT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    codes = tl.load(src + offs, mask=mask, other=0)
    tl.store(dst + offs, fp8_bits_to_fp16_ptx(codes, MANT), mask=mask)


@triton.jit
def _encode_kernel(src, dst, n, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(src + offs, mask=mask, other=0.0)
    tl.store(dst + offs, fp32_to_fp8_bits(y, MANT, BIAS, FMAX), mask=mask)


def _all_codes() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)


def decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 codes [N] -> float16 [N] through ``fp8_bits_to_fp16``."""
    f = FORMATS[fmt]
    out = torch.empty(codes.shape, dtype=torch.float16, device=codes.device)
    _decode_kernel[(triton.cdiv(codes.numel(), BLOCK),)](codes, out, codes.numel(), MANT=f.mantissa_bits,
                                                         BIAS=f.bias, BLOCK=BLOCK)
    return out


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 [N] -> uint8 codes [N] through ``fp32_to_fp8_bits``."""
    f = FORMATS[fmt]
    x = x.to(DEVICE, torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _encode_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), MANT=f.mantissa_bits, BIAS=f.bias,
                                                     FMAX=f.max, BLOCK=BLOCK)
    return out


def torch_codes(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """torch's round-to-nearest-even cast of ``x`` clamped to ±max, as uint8 codes."""
    f = FORMATS[fmt]
    return x.to(DEVICE, torch.float32).clamp(-f.max, f.max).to(f.torch_dtype).view(torch.uint8)


def _bits16(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16).cpu()


def _finite_values(fmt: str) -> torch.Tensor:
    """Every finite value of the format, sorted ascending, -0 left out (fp32)."""
    v = FORMATS[fmt].code_values
    v = v[torch.isfinite(v) & ~((v == 0) & torch.signbit(v))]
    return v.sort().values


# ------------------------------------------------------------------------------------------ decoder
@pytest.mark.parametrize("fmt", FMTS)
def test_decoder_matches_torch_on_every_finite_code(fmt):
    codes = _all_codes()
    ref = codes.view(FORMATS[fmt].torch_dtype).to(torch.float16)
    got = decode(codes, fmt)
    finite = torch.isfinite(ref).cpu()
    assert int(finite.sum()) == FORMATS[fmt].finite_codes
    mismatch = (_bits16(got) != _bits16(ref)) & finite
    assert not mismatch.any(), [(hex(c), float(got[c]), float(ref[c])) for c in mismatch.nonzero().flatten().tolist()]
    assert torch.signbit(got[0x80].cpu()) and float(got[0x80]) == 0.0  # -0 keeps its sign


def test_decoder_e5m2_inf_and_nan_codes_follow_torch():
    codes = _all_codes()
    ref = codes.view(torch.float8_e5m2).to(torch.float16).cpu()
    got = decode(codes, "e5m2").cpu()
    special = ~torch.isfinite(ref)
    assert int(special.sum()) == 8  # ±Inf and 3 NaN codes of each sign
    assert torch.equal(torch.isnan(got[special]), torch.isnan(ref[special]))
    inf = torch.isinf(ref)
    assert torch.equal(got[inf], ref[inf])


def test_decoder_e4m3fn_nan_codes_decode_to_480_as_documented():
    # e4m3fn has no Inf and one NaN pattern per sign (S.1111.111). The codec moves the bits without
    # special cases, so those two codes come out as ±480 (1.875 x 2^8); the writers never store them
    # (they clamp to ±448) and FP8 caches are checked finite on entry.
    codes = torch.tensor([0x7F, 0xFF], dtype=torch.uint8, device=DEVICE)
    assert torch.isnan(codes.view(torch.float8_e4m3fn).to(torch.float32)).all()
    assert decode(codes, "e4m3").cpu().tolist() == [480.0, -480.0]


# ------------------------------------------------------------------------------------------ encoder
def _sweep(fmt: str) -> torch.Tensor:
    """fp32 inputs that exercise every rounding decision of the format (both signs)."""
    f = FORMATS[fmt]
    vals = _finite_values(fmt)
    pos = vals[vals >= 0]
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32: ties, resolved to the even code
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.zeros_like(mids))
    sub = torch.linspace(0, 2 * f.min_normal, 4097)  # dense through the subnormal range
    gen = seeded(0)
    lo, hi = torch.log2(torch.tensor(f.min_subnormal / 4)), torch.log2(torch.tensor(f.max * 2))
    logu = torch.exp2(lo + (hi - lo) * torch.rand(20000, generator=gen))  # every binade, at random
    tiny = torch.tensor([1e-45, 1e-40, 1.1754942e-38, f.min_subnormal / 2, f.min_subnormal * 0.5000001])
    big = torch.tensor([f.max, f.overflow_threshold, f.overflow_threshold * 0.9999999, f.max * 1.01,
                        f.max * 4, 3.0e38, torch.finfo(torch.float32).max, float("inf")])
    x = torch.cat([pos, mids, up, down, sub, logu, tiny, big]).to(torch.float32)
    return torch.cat([x, -x])


@pytest.mark.parametrize("fmt", FMTS)
def test_encoder_rounds_like_torch_on_the_clamped_value(fmt):
    x = _sweep(fmt)
    got, ref = encode(x, fmt).cpu(), torch_codes(x, fmt).cpu()
    bad = (got != ref).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), hex(int(got[i])), hex(int(ref[i]))) for i in bad[:10].tolist()]


@pytest.mark.parametrize("fmt", FMTS)
def test_encoder_round_trips_every_finite_code(fmt):
    # decode(code) then encode must give the code back: the two halves of the codec are inverse.
    codes = _all_codes()
    values = codes.view(FORMATS[fmt].torch_dtype).to(torch.float32)
    finite = torch.isfinite(values)
    assert torch.equal(encode(values[finite], fmt), codes[finite])


@pytest.mark.parametrize("fmt", FMTS)
def test_encoder_ties_go_to_the_even_code_and_beyond_max_saturates(fmt):
    f = FORMATS[fmt]
    one_ulp = f.epsilon  # spacing of the codes in [1, 2)
    x = torch.tensor([1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -(1 + one_ulp / 2), f.max * 8, -f.max * 8,
                      float("inf"), float("-inf"), 0.0, -0.0])
    one, two_up = 1.0, 1 + 2 * one_ulp  # 1 + ulp (odd mantissa) lies between: neither tie goes there
    expect = torch.tensor([one, two_up, -one, f.max, -f.max, f.max, -f.max, 0.0, -0.0])
    got = encode(x, fmt)
    assert torch.equal(got, torch_codes(expect, fmt))
    assert int(got[-1]) == 0x80 and int(got[-2]) == 0x00  # -0 keeps its sign bit


# ------------------------------------------------------------------------------------------ GPU: PTX
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inline PTX)")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="cvt.rn.f16x2.e4m3x2 / e5m2x2 need sm89 or newer")
@pytest.mark.parametrize("fmt", FMTS)
def test_ptx_decoder_matches_torch_on_all_256_codes(fmt):
    f = FORMATS[fmt]
    codes = _all_codes()
    ref = codes.view(f.torch_dtype).to(torch.float16)
    out = torch.empty(256, dtype=torch.float16, device=DEVICE)
    _decode_ptx_kernel[(1,)](codes, out, 256, MANT=f.mantissa_bits, BLOCK=256)
    finite = torch.isfinite(ref)
    assert torch.equal(_bits16(out)[finite.cpu()], _bits16(ref)[finite.cpu()])
    assert torch.equal(torch.isnan(out), torch.isnan(ref))  # the hardware keeps NaN codes NaN
    assert torch.equal(out[torch.isinf(ref)], ref[torch.isinf(ref)])
    assert torch.equal(decode(codes, fmt)[finite], out[finite])  # and agrees with the software codec
