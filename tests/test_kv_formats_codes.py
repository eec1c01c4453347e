"""fp8kv.kv_formats element codes, bit-exact: e2m1, the integer codes, e4m3, e8m0 and nibble packing, each
against encoders written here from the formats' definitions and against torch's own (its e8m0 dtype, its
e4m3 cast, and the FP4 encoder / decoder / packer torch ships in torch.testing._internal.common_quantized,
taken from torchao; read from its source by tests/kv_format_oracles.py). torch 2.13 cannot cast to or from
torch.float4_e2m1fn_x2 (copy_kernel is not implemented for it), so FP4 is checked through those functions."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures import seeded
from kv_format_oracles import (
    E2M1_TABLE,
    E4M3_TABLE,
    all_finite_16bit,
    boundary_sweep,
    e2m1_value,
    rne_int,
    rne_on_table,
    torch_fp4_decode,
    torch_fp4_encode,
    torch_pack_uint4,
)

from fp8kv.kv_formats.elements import (
    E2M1_VALUES,
    ELEMENTS,
    decode_e2m1,
    e8m0_from_exponent,
    e8m0_to_float,
    encode_e2m1,
    encode_e4m3,
    encode_int,
    floor_log2,
)
from fp8kv.kv_formats.packing import pack_nibbles, signed_nibbles, unpack_nibbles

F32 = torch.float32
U8 = torch.uint8


# ------------------------------------------------------------------------------ e2m1
def test_e2m1_value_table_matches_the_definition_and_torchs_decoder():
    codes = torch.arange(16, dtype=U8)
    ours = decode_e2m1(codes)
    assert ours.tolist() == [e2m1_value(c) for c in range(16)]
    assert torch.equal(torch.signbit(ours), codes >= 8)  # code 8 is -0
    assert torch.equal(torch_fp4_decode(codes, 2, 1), ours)
    assert tuple(ours[:8].tolist()) == E2M1_VALUES and ELEMENTS["e2m1"].max == 6.0


@pytest.mark.parametrize("source", ["sweep", "fp16", "bf16", "uniform"])
def test_e2m1_encoder_is_bit_exact(source):
    if source == "sweep":
        y = boundary_sweep(E2M1_TABLE, 1e6)
    elif source == "uniform":
        y = (torch.rand(20001, generator=seeded(3)) - 0.5) * 20
    else:
        y = all_finite_16bit(torch.float16 if source == "fp16" else torch.bfloat16)
    codes, saturated = encode_e2m1(y)
    ref, ref_sat = rne_on_table(y, E2M1_TABLE, 3)
    assert codes.dtype == U8 and torch.equal(codes.to(torch.int64), ref)
    assert saturated == ref_sat
    assert torch.equal(codes, torch_fp4_encode(y.contiguous(), 2, 1))  # torchao's bit-twiddling encoder


def test_e2m1_ties_go_to_the_even_code_and_seven_saturates():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.9999995, -7.0, -0.2, 1e30])
    codes, saturated = encode_e2m1(y)
    assert decode_e2m1(codes).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -6.0, -0.0, 6.0]
    assert saturated == 3  # 7, -7 and 1e30 round past 6 (6 = 1.1b x 2^2 is odd: the tie 7 goes up to 8)
    assert int(codes[10]) == 0x8  # -0.2 keeps its sign


# ------------------------------------------------------------------------ integer codes
@pytest.mark.parametrize("name", ["int8", "int4", "uint4"])
@pytest.mark.parametrize("source", ["ties", "fp16"])
def test_integer_encoder_is_bit_exact(name, source):
    e = ELEMENTS[name]
    lo, hi = int(e.min), int(e.max)
    if source == "ties":  # every k + 0.5 from below the range to above it, and the fp32 neighbours
        k = torch.arange(lo - 3, hi + 3, dtype=F32) + 0.5
        inf = torch.full_like(k, math.inf)
        y = torch.cat([k, torch.nextafter(k, inf), torch.nextafter(k, -inf), k - 0.5, torch.tensor([-0.0])])
    else:
        y = all_finite_16bit(torch.float16)
        y = y[y.abs() < 2 * max(abs(lo), hi)]
    codes, saturated = encode_int(y, e)
    ref, ref_sat = rne_int(y, lo, hi)
    assert torch.equal(codes.to(torch.int64), ref) and saturated == ref_sat


def test_integer_edges_count_what_rounds_past_the_range():
    _, sat = encode_int(torch.tensor([127.49998, 127.5, -127.5, -127.49998, 128.0]), ELEMENTS["int8"])
    assert sat == 3  # 127.5 -> 128 and -127.5 -> -128 (ties to even), 128
    codes, sat = encode_int(torch.tensor([-0.5, -0.50000006, 15.5, 15.499999]), ELEMENTS["uint4"])
    assert sat == 2 and codes.tolist() == [0, 0, 15, 15]  # -0.5 rounds to -0: in range


# ------------------------------------------------------------------------------- e4m3
@pytest.mark.parametrize("source", ["sweep", "bf16"])
def test_e4m3_encoder_is_bit_exact(source):
    y = boundary_sweep(E4M3_TABLE, 1e9) if source == "sweep" else all_finite_16bit(torch.bfloat16)
    codes, saturated = encode_e4m3(y)
    ref, ref_sat = rne_on_table(y, E4M3_TABLE, 7)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.view(U8).to(torch.int64), ref) and saturated == ref_sat


# ------------------------------------------------------------------------------- e8m0
def test_e8m0_decodes_every_code_as_torch_does():
    codes = torch.arange(255, dtype=torch.int32).to(U8)  # 255 is NaN, never written
    ours = e8m0_to_float(codes.view(torch.float8_e8m0fnu))
    assert torch.equal(ours, codes.view(torch.float8_e8m0fnu).to(F32))
    assert ours.tolist() == [2.0 ** (c - 127) for c in range(255)]


def test_e8m0_encodes_every_exponent_as_torch_casts_its_power_of_two():
    exps = torch.arange(-127, 128, dtype=torch.int32)
    ours = e8m0_from_exponent(exps)
    theirs = torch.tensor([2.0**int(e) for e in exps], dtype=F32).to(torch.float8_e8m0fnu)
    assert ours.dtype == torch.float8_e8m0fnu and torch.equal(ours.view(U8), theirs.view(U8))


def test_floor_log2_is_exact_for_every_binade_and_its_edges():
    p = torch.ldexp(torch.ones(277), torch.arange(-149, 128, dtype=torch.int32))
    inf = torch.full_like(p, math.inf)
    a = torch.cat([p, torch.nextafter(p, inf)[:-1], torch.nextafter(p, -inf)[1:], p * 1.5])
    a = a[torch.isfinite(a) & (a > 0)]
    expected = torch.tensor([math.frexp(v)[1] - 1 for v in a.tolist()], dtype=torch.int32)
    assert torch.equal(floor_log2(a), expected)


# ----------------------------------------------------------------------------- packing
@pytest.mark.parametrize("shape", [(2,), (3, 5, 6), (7, 1, 34)])
def test_packing_puts_the_even_element_in_the_low_nibble(shape):
    codes = torch.randint(0, 16, shape, generator=seeded(1), dtype=torch.int64).to(U8)
    packed = pack_nibbles(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == U8
    flat_c, flat_p = codes.reshape(-1, shape[-1]), packed.reshape(-1, shape[-1] // 2)
    for row_c, row_p in zip(flat_c.tolist(), flat_p.tolist(), strict=True):
        assert row_p == [row_c[2 * i] | (row_c[2 * i + 1] << 4) for i in range(len(row_p))]
    assert torch.equal(packed, torch_pack_uint4(codes.contiguous()))  # torch's (torchao's) packer
    assert torch.equal(unpack_nibbles(packed), codes)
    # the bytes are float4_e2m1fn_x2's: a view as that dtype and back keeps them
    assert torch.equal(packed.view(torch.float4_e2m1fn_x2).view(U8), packed)


def test_signed_nibbles_are_twos_complement():
    values = torch.arange(-8, 8, dtype=torch.int16)
    nibbles = (values & 0xF).to(U8)
    assert torch.equal(signed_nibbles(nibbles), values)
    assert int(pack_nibbles(torch.tensor([-7, 7]) & 0xF)) == 0x79


@pytest.mark.parametrize("name", ["int8_token_head", "int4_token_head", "nvfp4", "mxfp4", "e4m3_b16", "e4m3_b32"])
def test_encode_rows_stores_what_quantize_stores(name):
    """The sync-free write path (a step's cache write) gives quantize's bytes, saturating rows included."""
    from fp8kv.kv_formats import codec as codec_of
    from fp8kv.kv_formats import encode_rows, kv_format, quantize

    c = kv_format(name).key
    x = torch.randn(5, 2, 64, generator=seeded(3)) * 4
    x[1, 0, :7] = torch.tensor([1e4, -3e3, 0.0, 1e-30, -1e-30, 2.5, -7.0])  # outliers, zeros, underflow
    ts = quantize(x, c).tensor_scale
    ref = quantize(x, c, tensor_scale=ts)
    codes, scales = encode_rows(x, codec_of(c.name), ts)
    view = (lambda t: t.view(torch.uint8)) if codes.element_size() == 1 else (lambda t: t)
    assert torch.equal(view(codes), view(ref.codes))
    sv = (lambda t: t.view(torch.uint8)) if scales.element_size() == 1 else (lambda t: t)
    assert torch.equal(sv(scales), sv(ref.scales.reshape(*x.shape[:-1], -1)))


@pytest.mark.parametrize("name", ["kivi4_key_g32", "kivi4_value_g32", "fp8_e4m3_token_head"])
def test_encode_rows_refuses_codecs_that_are_not_token_local(name):
    from fp8kv.kv_formats import codec as codec_of
    from fp8kv.kv_formats import encode_rows

    with pytest.raises(ValueError, match="not token-local"):
        encode_rows(torch.ones(4, 1, 64), codec_of(name))
