"""fp8kv.kv_formats codecs: bit-exact against a reference written here from each format's definition (group
by group, in Python), round-trip error bounds from each format's precision, bytes per token against hand
counts, pages that quantize alone, and bad input refused by name."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from fixtures import seeded
from kv_format_oracles import E2M1_TABLE, E4M3_TABLE, E4M3_VALUES, boundary_sweep, rne_int, rne_on_table

from fp8kv import kv_formats as kvf
from fp8kv.formats import FORMATS
from fp8kv.quant import kv_scale_bytes
from fp8kv.quant import quantize as fp8_quantize

F32, F16, U8 = torch.float32, torch.float16, torch.uint8
OWN = [n for n in kvf.CODEC_NAMES if not n.startswith("fp8_")]  # codecs beside fp8kv.quant's
FP8 = [n for n in kvf.CODEC_NAMES if n.startswith("fp8_")]


def f32(v: float) -> float:
    """Round a Python float to fp32 (one rounding, to nearest even)."""
    return float(torch.tensor(v, dtype=torch.float64).to(F32))


def e4m3_round(v: float) -> float:
    code, _ = rne_on_table(torch.tensor([v]), E4M3_TABLE, 7)
    return E4M3_VALUES[int(code)]


def groups(c: kvf.Codec, shape: tuple) -> list[list[tuple]]:
    """The index tuples of each scale group of data ``shape``, in the order of the scales' flattening."""
    idx = list(torch.cartesian_prod(*[torch.arange(n) for n in shape]).reshape(-1, len(shape)).tolist())
    index = [tuple(i) for i in idx]
    if c.scaling == "tensor":
        key = lambda i: ()
    elif c.scaling == "token_head":
        key = lambda i: i[:-1]
    elif c.scaling == "block":
        key = lambda i: (*i[:-1], i[-1] // c.block)
    else:  # channel_group: a channel of a head over a group of tokens along dim -3
        key = lambda i: (*i[:-3], i[-3] // c.block, i[-2], i[-1])
    out: dict[tuple, list[tuple]] = {}
    for i in index:
        out.setdefault(key(i), []).append(i)
    return [out[k] for k in sorted(out)]


def reference(x: torch.Tensor, c: kvf.Codec, tensor_scale: float | None = None) -> dict:
    """Quantize ``x`` from the definitions: per group, scale (and zero), then the element's RNE.

    Returns element codes (unpacked, with sign bits as stored), scales and zero points (fp64 values of
    what is stored), the tensor scale, the saturated count and the decoded values (fp32).
    """
    xs = x.to(F32)
    tensor_scale = None if tensor_scale is None else f32(tensor_scale)  # scales are fp32
    el = c.element
    n = el.max
    codes = torch.zeros(x.shape, dtype=torch.int64)
    decoded = torch.zeros(x.shape, dtype=F32)
    scales, zeros, saturated = [], [], 0
    ts = None
    if c.rule == "two_level":
        amax = float(xs.abs().max())
        ts = tensor_scale if tensor_scale is not None else max(f32(amax / (448.0 * n)), 2.0**-143)
    for g in groups(c, tuple(x.shape)):
        vals = torch.stack([xs[i] for i in g])
        if c.rule == "amax":
            amax = float(vals.abs().max())
            s = tensor_scale if tensor_scale is not None else (f32(amax / n) if amax > 0 else 1.0)
            y, off = vals / s, 0.0
        elif c.rule == "min_max":
            lo, hi = float(vals.min()), float(vals.max())
            span = f32(f32(hi - lo) / 15)
            s = float(torch.tensor(span).to(F16)) if span > 0 else 1.0
            s = max(s, 2.0**-24) if span > 0 else 1.0
            off = float(torch.tensor(lo).to(F16))
            zeros.append(off)
            y = (vals - off) / s
        elif c.rule == "two_level":
            per_block = f32(f32(float(vals.abs().max()) / n) / ts)
            block = e4m3_round(min(max(per_block, 2.0**-6), 448.0))
            scales.append(block)
            s, off = f32(block * ts), 0.0
            y = vals / s
        else:  # pow2: X = 2^(floor(log2(amax)) - emax_elem), e8m0's range
            amax = float(vals.abs().max())
            e = math.frexp(amax)[1] - 1 - el.emax if amax > 0 else -127
            s, off = 2.0 ** max(-127, min(127, e)), 0.0
            y = vals / s
        if c.rule != "two_level":
            scales.append(s)
        if el.name == "e2m1":
            q, sat = rne_on_table(y, E2M1_TABLE, 3)
            value = torch.tensor([E2M1_TABLE[int(k) & 7] * (-1 if int(k) & 8 else 1) for k in q])
        elif el.name == "e4m3":
            q, sat = rne_on_table(y, E4M3_TABLE, 7)
            value = torch.tensor([E4M3_VALUES[int(k)] for k in q])
        else:
            q, sat = rne_int(y, int(el.min), int(el.max))
            value = q.to(F32)
        saturated += sat
        for i, k, v in zip(g, q.tolist(), value.tolist(), strict=True):
            codes[i] = k
            decoded[i] = f32(f32(v * s) + off) if c.rule == "min_max" else f32(v * s)
    return dict(codes=codes, scales=scales, zeros=zeros, tensor_scale=ts, saturated=saturated, decoded=decoded)


def element_codes(enc: kvf.Encoded) -> torch.Tensor:
    """The stored codes as int64 element codes, unpacked here (low nibble first) without the library."""
    c = enc.codec
    if c.packed:
        lo, hi = enc.codes & 0xF, enc.codes >> 4
        nib = torch.stack((lo, hi), dim=-1).flatten(-2).to(torch.int64)
        return torch.where(nib >= 8, nib - 16, nib) if c.element.name == "int4" else nib
    if c.element.name == "e4m3":
        return enc.codes.view(U8).to(torch.int64)
    return enc.codes.to(torch.int64)


def stored_scales(enc: kvf.Encoded) -> list[float]:
    s = enc.scales
    return s.to(torch.float64).reshape(-1).tolist() if s.dtype != torch.float8_e8m0fnu else \
        [2.0 ** (int(b) - 127) for b in s.view(U8).reshape(-1)]


def data(kind: str, shape: tuple, dtype=F32, seed: int = 0) -> torch.Tensor:
    g = seeded(seed)
    x = torch.randn(shape, generator=g)
    if kind == "outliers":  # heavy tails and a few outlier channels, as real keys have
        x = x * torch.exp(2 * torch.randn(shape, generator=g))
        x[..., 1] *= 50
    return x.to(dtype)


# Per element and rule: (values on and around every rounding tie of the scaled grid, the anchor values put
# first in every group so that its scale is exactly 1, the tensor scale to give).
def _int_ties(lo: int, hi: int) -> list[float]:
    k = torch.arange(lo, hi, dtype=F32) + 0.5
    inf = torch.full_like(k, math.inf)
    return torch.cat([k, torch.nextafter(k, inf), torch.nextafter(k, -inf)]).tolist()


def _float_ties(table: list[float], top: float) -> list[float]:
    v = boundary_sweep(table, top)
    return v[v.abs() <= top].tolist()


SWEEPS = {
    ("int8", "amax"): (_int_ties(-127, 127), [127.0], None),
    ("int4", "amax"): (_int_ties(-7, 7), [7.0], None),
    ("uint4", "min_max"): (_int_ties(0, 15), [15.0, 0.0], None),  # z = 0, s = 15 / 15
    ("e2m1", "pow2"): (_float_ties(E2M1_TABLE, 7.5), [7.5], None),  # X = 2^(floor(log2 7.5) - 2) = 1
    ("e2m1", "two_level"): (_float_ties(E2M1_TABLE, 6.0), [6.0], 1.0),  # block scale 6 / 6 / 1
    ("e4m3", "pow2"): (_float_ties(E4M3_TABLE, 480.0), [480.0], None),  # X = 2^(8 - 8)
    ("e4m3", "two_level"): (_float_ties(E4M3_TABLE, 448.0), [448.0], 1.0),
}


def sweep(c: kvf.Codec, shape: tuple, seed: int = 0) -> tuple[torch.Tensor, float | None]:
    """Data whose every group has scale 1 (its anchors first along the group dim) and whose other values lie
    on and around the code grid's ties and saturation edges; the tensor scale that goes with it."""
    ties, anchors, ts = SWEEPS[(c.element.name, c.rule)]
    pool = torch.tensor(ties, dtype=F32)
    x = pool[torch.randint(0, len(pool), shape, generator=seeded(seed))]
    for i, a in enumerate(anchors):
        if c.scaling == "channel_group":
            x[..., i::c.block, :, :] = a
        elif c.scaling == "block":
            x[..., i::c.block] = a
        elif c.scaling == "token_head":
            x[..., i] = a
        else:
            x.view(-1)[i] = a
    if c.scaling == "tensor":
        ts = 1.0
    return x, ts


def shape_for(c: kvf.Codec) -> tuple:
    d = 96 if (c.block or 0) <= 32 else 128  # odd head count, a head_dim of 3 blocks of 32 or 6 of 16
    t = (c.block if c.scaling == "channel_group" else 5)
    return (2 * t, 3, 16) if c.scaling == "channel_group" else (t, 3, d)


# --------------------------------------------------------------------------- (a) bit-exact
def assert_matches_reference(x: torch.Tensor, c: kvf.Codec, tensor_scale=None) -> kvf.Encoded:
    enc = kvf.quantize(x, c, tensor_scale=tensor_scale)
    ref = reference(x, c, tensor_scale)
    assert torch.equal(element_codes(enc), ref["codes"])
    assert stored_scales(enc) == ref["scales"]
    assert enc.scales.dtype == c.scale_dtype and tuple(enc.scales.shape) == c.scale_shape(x.shape)
    if c.zero_point:
        assert enc.zero_points.dtype == c.scale_dtype
        assert enc.zero_points.to(torch.float64).reshape(-1).tolist() == ref["zeros"]
    else:
        assert enc.zero_points is None
    if c.tensor_scale:
        assert enc.tensor_scale.dtype == F32 and float(enc.tensor_scale) == ref["tensor_scale"]
    else:
        assert enc.tensor_scale is None
    assert enc.saturated == ref["saturated"]
    assert torch.equal(enc.dequantize(), ref["decoded"])
    assert enc.underflow == int(((x != 0) & (ref["decoded"] == 0)).sum())
    return enc


@pytest.mark.parametrize("name", OWN)
@pytest.mark.parametrize("kind,dtype", [("normal", F32), ("normal", F16), ("normal", torch.bfloat16),
                                        ("outliers", F32)])
def test_codec_is_bit_exact_against_the_definition(name, kind, dtype):
    c = kvf.codec(name)
    shape = shape_for(c)
    if c.scaling == "channel_group" and kind != "normal":
        shape = (c.block, 1, 8)  # the per-group Python reference is slow for a 128-token key group
    assert_matches_reference(data(kind, shape, dtype), c)


@pytest.mark.parametrize("name", OWN)
def test_codec_is_bit_exact_on_every_tie_and_saturation_edge(name):
    c = kvf.codec(name)
    shape = (2 * c.block, 1, 8) if c.scaling == "channel_group" else (7, 3, 128)
    x, ts = sweep(c, shape)
    enc = assert_matches_reference(x, c, ts)
    s = _factor(enc)
    y = (x - _zero(enc)) / s
    assert bool((s == 1).all())  # the anchors made every scale 1: y is x, ties included
    grid = 2 * y if c.element.name != "e4m3" else y  # ties sit on odd multiples of half a step
    assert bool(((grid - torch.floor(grid)) == 0).any())
    if c.element.name == "e2m1" and c.rule == "pow2":
        assert enc.saturated == int((x.abs() >= 7).sum()) > 0  # MX: (7, 7.5] round past 6


@pytest.mark.parametrize("name,tensor_scale", [("int8_tensor", 1.0), ("int8_tensor", 0.01), ("nvfp4", 1.0),
                                               ("nvfp4", 2.0**-12), ("e4m3_b16", 2.0**-20), ("e4m3_b16", 1.0)])
def test_given_tensor_scales_saturate_and_count_as_the_definition_says(name, tensor_scale):
    c = kvf.codec(name)
    x = data("outliers", (5, 3, 32), seed=2)
    enc = kvf.quantize(x, c, tensor_scale=tensor_scale)
    ref = reference(x, c, tensor_scale)
    assert torch.equal(element_codes(enc), ref["codes"]) and stored_scales(enc) == ref["scales"]
    assert enc.saturated == ref["saturated"] and torch.equal(enc.dequantize(), ref["decoded"])
    if tensor_scale in (0.01, 2.0**-12, 2.0**-20):
        assert enc.saturated > 0  # the outliers pass the codes' range at this scale


@pytest.mark.parametrize("name", FP8)
def test_fp8_codecs_are_fp8kv_quant(name):
    c = kvf.codec(name)
    x = data("outliers", (5, 3, 24))
    enc = kvf.quantize(x, c)
    q = fp8_quantize(x, c.element.name, c.scaling)
    assert torch.equal(enc.codes.view(U8), q.data.view(U8)) and torch.equal(enc.scales, q.scale)
    assert (enc.saturated, enc.underflow) == (q.saturated, q.underflow)
    assert torch.equal(enc.dequantize(), q.dequantize())


# ---------------------------------------------------------------------- (b) error bounds
def _factor(enc: kvf.Encoded) -> torch.Tensor:
    """Each element's scale (fp32, data-shaped): decode a tensor of ones' codes, less the zero points."""
    ones = torch.zeros(enc.shape)
    g = {"tensor": lambda s: s, "token_head": lambda s: s.unsqueeze(-1)}
    c = enc.codec
    if c.rule == "amax":
        return g[c.scaling](enc.scales).expand(enc.shape).to(F32) + ones
    s = enc.scales
    if c.rule == "pow2":
        s = torch.ldexp(torch.ones(s.shape), s.view(U8).to(torch.int32) - 127)
    s = s.to(F32) * (enc.tensor_scale if c.tensor_scale else 1.0)
    if c.scaling == "block":
        return s.repeat_interleave(c.block, dim=-1)
    return s.repeat_interleave(c.block, dim=-3)  # channel_group


def _zero(enc: kvf.Encoded) -> torch.Tensor:
    """Each element's zero point (fp32, data-shaped; zeros for symmetric codecs)."""
    c = enc.codec
    if not c.zero_point:
        return torch.zeros(enc.shape)
    return enc.zero_points.to(F32).repeat_interleave(c.block, dim=-3 if c.scaling == "channel_group" else -1)


@pytest.mark.parametrize("name", OWN)
@pytest.mark.parametrize("kind", ["normal", "outliers"])
def test_round_trip_error_within_half_a_step_of_the_code_grid(name, kind):
    """|x - x̂| <= half the grid spacing at the scaled value, times the scale: s/2 for the integer codes;
    for e2m1 0.25 s below 2, 0.5 s below 4, s above (6 .. 7 rounds to 6 with error < s); for e4m3
    2^-4 |x| (2^-10 s among the subnormals). What rounds past the top is saturated (counted): its error
    is |x| - max x s. fp32 arithmetic adds at most a few ulps of |x| (+ |zero|)."""
    c = kvf.codec(name)
    x = data(kind, shape_for(c), seed=5)
    enc = kvf.quantize(x, c)
    s = _factor(enc)
    err = (x - enc.dequantize()).abs()
    zero = _zero(enc)
    y = (x - zero) / s
    a = y.abs()
    if c.element.name == "e2m1":
        half = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
        past = (a - 6).clamp(min=0)
    elif c.element.name == "e4m3":
        half = torch.maximum(a * 2.0**-4, torch.full_like(a, 2.0**-10))
        past = (a - FORMATS["e4m3"].max).clamp(min=0)
    else:
        half = torch.full_like(a, 0.5)
        past = torch.zeros_like(a)
    bound = torch.maximum(half, past) * s + 4 * 2.0**-24 * (x.abs() + zero.abs())
    assert bool((err <= bound).all()), f"{name}: worst excess {float((err - bound).max())}"
    if c.rule in ("amax", "min_max", "two_level") and c.element.name != "e4m3":
        assert enc.saturated == 0  # scales from the data leave every value in range
    if c.element.name == "e2m1" or c.element.name == "e4m3":
        first_overflow = 7.0 if c.element.name == "e2m1" else FORMATS["e4m3"].first_overflow  # ties: 7 up, 464 down
        assert enc.saturated == int((a >= first_overflow).sum())


# -------------------------------------------------------------------- (c) bytes per token
D128 = {  # bytes per token per head at head_dim 128, counted by hand: codes + per-token scales (+ zero points)
    "int8_tensor": (128, 4),  # 128 int8 codes; one fp32 scale per tensor
    "int8_token_head": (128 + 4, 0),  # + one fp32 scale
    "int4_token_head": (64 + 4, 0),  # 128 nibbles in 64 bytes + one fp32 scale
    "kivi4_key_g32": (64 + 16, 0),  # per channel, an fp16 scale and zero every 32 tokens: 128 x 4 / 32
    "kivi4_value_g32": (64 + 16, 0),  # 4 groups of 32 channels x (fp16 scale + zero)
    "kivi4_key_g64": (64 + 8, 0),
    "kivi4_value_g64": (64 + 8, 0),
    "kivi4_key_g128": (64 + 4, 0),
    "kivi4_value_g128": (64 + 4, 0),
    "nvfp4": (64 + 8, 4),  # 8 e4m3 block scales; the fp32 tensor scale once
    "mxfp4": (64 + 4, 0),  # 4 e8m0 block scales
    "e4m3_b16": (128 + 8, 4),
    "e4m3_b32": (128 + 4, 0),
    "fp8_e4m3_tensor": (128, 4), "fp8_e5m2_tensor": (128, 4),
    "fp8_e4m3_head": (128, 4), "fp8_e5m2_head": (128, 4),  # one head: one scale
    "fp8_e4m3_token_head": (132, 0), "fp8_e5m2_token_head": (132, 0),
    "fp8_e4m3_channel": (128, 4 * 128), "fp8_e5m2_channel": (128, 4 * 128),
}


@pytest.mark.parametrize("name", kvf.CODEC_NAMES)
def test_bytes_per_token_match_the_hand_count(name):
    assert set(D128) == set(kvf.CODEC_NAMES)
    per_token, fixed = D128[name]
    fp = kvf.footprint(name, 1, 128)
    assert (fp.per_token, fp.fixed) == (per_token, fixed)
    fp3 = kvf.footprint(name, 3, 128)  # three heads: per-token bytes x 3; fixed per-head / per-channel x 3
    assert fp3.per_token == 3 * per_token
    assert fp3.fixed == (3 * fixed if kvf.codec(name).scaling in ("head", "channel") else fixed)


def test_fractional_bytes_per_token_and_kv_totals():
    # KIVI keys at head_dim 80, groups of 128 tokens: 40 code bytes + 80 x 4 / 128 = 2.5 scale bytes
    assert kvf.footprint("kivi4_key_g128", 1, 80).per_token == Fraction(85, 2)
    assert kvf.footprint("kivi4_key_g128", 1, 80).nbytes(256) == 85 * 128
    with pytest.raises(ValueError, match="tokens=3"):
        kvf.footprint("kivi4_key_g128", 1, 80).nbytes(3)
    # a part of a group whose bytes happen to be whole is still part of a group (K's group of 32 with V per token)
    kivi = kvf.kv_footprint("kivi4_g32", num_kv_heads=2, head_dim=32)
    assert kivi.token_group == 32 and kivi.nbytes(64) == 2 * kivi.nbytes(32)
    with pytest.raises(ValueError, match=r"tokens=5 does not fill whole token groups \(a scale spans 32 tokens\)"):
        kivi.nbytes(5)
    # a cache: 2 layers, 8 KV heads, head_dim 128, NVFP4 K and V: (72 x 8) x 2 x 2 per token, 4 x 2 x 2 fixed
    fp = kvf.kv_footprint("nvfp4", num_kv_heads=8, head_dim=128, num_layers=2)
    assert (fp.per_token, fp.fixed) == (72 * 8 * 4, 16)
    fp = kvf.kv_footprint("kivi4_g32", num_kv_heads=8, head_dim=128, num_layers=2)
    assert (fp.per_token, fp.fixed) == (80 * 8 * 4, 0)


@pytest.mark.parametrize("name", FP8)
def test_fp8_scale_bytes_agree_with_fp8kv_quant(name):
    c = kvf.codec(name)
    fixed, per_token = kv_scale_bytes(c.scaling, num_layers=3, num_kv_heads=5, head_dim=64)
    fp = kvf.kv_footprint(name, num_kv_heads=5, head_dim=64, num_layers=3)
    assert (fp.per_token, fp.fixed) == (per_token + 3 * 2 * 5 * 64, fixed)


@pytest.mark.parametrize("name", kvf.CODEC_NAMES)
@pytest.mark.parametrize("lead", [(), (2,)])
def test_stored_bytes_are_what_the_footprint_counts(name, lead):
    c = kvf.codec(name)
    t = c.block if c.scaling == "channel_group" else 7
    shape = (*lead, t, 3, 128)
    enc = kvf.quantize(data("normal", shape), c)
    tokens = math.prod(shape[:-2])
    assert enc.nbytes == kvf.footprint(c, 3, 128).nbytes(tokens)
    assert enc.codes.dtype == c.code_dtype and tuple(enc.codes.shape) == c.code_shape(shape)
    assert enc.shape == shape


@pytest.mark.parametrize("name", kvf.CODEC_NAMES)
def test_no_tokens_and_all_zeros_store_and_decode(name):
    c = kvf.codec(name)
    empty = kvf.quantize(torch.zeros(0, 3, 128), c)
    assert empty.dequantize().shape == (0, 3, 128) and empty.nbytes == kvf.footprint(c, 3, 128).nbytes(0)
    t = c.block if c.scaling == "channel_group" else 5
    zeros = kvf.quantize(torch.zeros(t, 3, 128), c)
    assert bool((zeros.dequantize() == 0).all()) and (zeros.saturated, zeros.underflow) == (0, 0)


@pytest.mark.parametrize("name", kvf.CODEC_NAMES)
def test_decoding_past_fp16s_range_is_refused_not_inf(name):
    """Values of 1e6 decode to fp32 and bf16; to fp16 a ValueError naming the dtype where the decoded values pass its
    largest (they were inf; KIVI's fp16 scales saturate them when they are stored); values within fp16's range decode
    to it."""
    c = kvf.codec(name)
    t = c.block if c.scaling == "channel_group" else 4
    big = kvf.quantize(torch.full((t, 2, 128), 1e6), c)
    peak = float(big.dequantize().abs().max())
    assert peak > 6e4 and bool(torch.isfinite(big.dequantize(torch.bfloat16)).all())
    if peak > torch.finfo(torch.float16).max:
        with pytest.raises(ValueError, match=r"dtype=torch.float16: the decoded values reach .* past torch.float16's"):
            big.dequantize(torch.float16)
    else:
        assert bool(torch.isfinite(big.dequantize(torch.float16)).all())
    small = kvf.quantize(torch.full((t, 2, 128), 3.0), c).dequantize(torch.float16)
    assert small.dtype == torch.float16 and bool(torch.isfinite(small).all())


# ----------------------------------------------------------------------- pages stand alone
@pytest.mark.parametrize("name", OWN)
def test_a_page_quantizes_and_decodes_alone(name):
    """Scales local to tokens: a page of the cache (a run of tokens) is stored and decoded by itself, with
    the tensor scale given for the codecs that have one."""
    c = kvf.codec(name)
    page = c.block if c.scaling == "channel_group" else 4
    x = data("outliers", (3 * page, 2, 128), seed=7)
    whole = kvf.quantize(x, c)
    ts = None
    if c.tensor_scale:
        ts = float(whole.tensor_scale)
    elif c.scaling == "tensor":
        ts = float(whole.scales)
    decoded = whole.dequantize()
    for p in range(3):
        part = kvf.quantize(x[p * page:(p + 1) * page], c, tensor_scale=ts)
        assert torch.equal(part.codes.view(U8), whole.codes[p * page:(p + 1) * page].view(U8))
        alone = kvf.dequantize(c, part.codes, part.scales, zero_points=part.zero_points, tensor_scale=part.tensor_scale)
        assert torch.equal(alone, decoded[p * page:(p + 1) * page])


# ----------------------------------------------------------------------------- NaN / Inf
@pytest.mark.parametrize("name", OWN + ["fp8_e4m3_token_head"])
def test_nonfinite_raises_by_default_and_saturates_when_asked(name):
    c = kvf.codec(name)
    shape = shape_for(c)
    x = data("normal", shape, seed=3)
    x[1, 1, 5], x[2, 0, 7], x[0, 2, 9] = math.inf, -math.inf, math.nan
    with pytest.raises(ValueError, match=r"x has 3 non-finite value\(s\).*index \(0, 2, 9\).*nonfinite='saturate'"):
        kvf.quantize(x, c)
    enc = kvf.quantize(x, c, nonfinite="saturate")
    assert enc.nonfinite == 3 and enc.saturated >= 2
    clean = x.clone()
    clean[1, 1, 5] = clean[2, 0, 7] = clean[0, 2, 9] = 0.0
    out = enc.dequantize()
    assert bool(torch.isfinite(out).all())
    assert enc.underflow == int((torch.isfinite(x) & (x != 0) & (out == 0)).sum())  # NaN -> 0 is no underflow
    others = torch.ones(shape, dtype=torch.bool)
    others[1, 1, 5] = others[2, 0, 7] = others[0, 2, 9] = False
    if not c.zero_point:  # scales come from the finite values: the others are stored as without them
        ref = kvf.quantize(clean, c)
        assert torch.equal(out[others], ref.dequantize()[others])
        assert float(out[0, 2, 9]) == 0.0  # NaN -> 0
    # +Inf decodes to its group's largest value, -Inf to the smallest
    assert float(out[1, 1, 5]) == float(out[group_of(c, (1, 1, 5))].max())
    assert float(out[2, 0, 7]) == float(out[group_of(c, (2, 0, 7))].min())


@pytest.mark.parametrize("value", [5.0, -5.0])
def test_a_nan_in_a_kivi_group_decodes_near_zero_and_is_not_saturated(value):
    """The asymmetric grid spans its group's min..max: a NaN (encoded as 0) outside that range decoded to the
    group's edge, 5.0, and was counted as saturated. It joins the range as 0 now."""
    x = value * torch.linspace(0.8, 1.0, 32)[:, None, None].expand(32, 1, 32).clone()  # |x| in [4, 5]
    x[3, 0, 2] = math.nan
    enc = kvf.quantize(x, "kivi4_key_g32", nonfinite="saturate")
    out = enc.dequantize()
    step = abs(value) / 15  # the group's range is 0..|5|, over uint4's 15 steps
    assert abs(float(out[3, 0, 2])) <= step / 2 and (value < 0 or float(out[3, 0, 2]) == 0.0)
    assert (enc.saturated, enc.nonfinite) == (0, 1)
    others = torch.isfinite(x)
    assert float((out[others] - x[others]).abs().max()) <= step / 2 * 1.01  # fp16 scale and zero


def group_of(c: kvf.Codec, i: tuple) -> tuple:
    """Index of the scale group holding element ``i`` of a [T, H, D] tensor."""
    t, h, d = i
    if c.scaling in ("tensor", "fp8") or c.rule == "fp8" and c.scaling == "tensor":
        return (slice(None),) * 3
    if c.scaling == "token_head":
        return (t, h, slice(None))
    if c.scaling == "block":
        return (t, h, slice(d // c.block * c.block, (d // c.block + 1) * c.block))
    return (slice(t // c.block * c.block, (t // c.block + 1) * c.block), h, d)


# ------------------------------------------------------------------------- (d) bad input
@pytest.mark.parametrize("bad,exc,match", [
    ([[1.0, 2.0]], TypeError, "x must be a torch.Tensor, got list"),
    (torch.ones(4, 2, 32, dtype=torch.int32), TypeError, "x has dtype torch.int32"),
    (torch.ones(4, 2, 32).to(torch.float8_e4m3fn), TypeError, "x has dtype torch.float8_e4m3fn"),
    (torch.ones(32), ValueError, r"at least 2 dims.*got shape \(32,\)"),
    (torch.ones(4, 2, 32, device="meta"), ValueError, "x is on meta"),
])
@pytest.mark.parametrize("name", ["int8_token_head", "nvfp4", "mxfp4", "fp8_e4m3_tensor"])
def test_bad_x_is_refused_by_name(name, bad, exc, match):
    with pytest.raises(exc, match=match):
        kvf.quantize(bad, name)


@pytest.mark.parametrize("name,shape,match", [
    ("nvfp4", (4, 2, 40), "head_dim 40.*multiple of its block size 16"),
    ("mxfp4", (4, 2, 48), "head_dim 48.*multiple of its block size 32"),
    ("e4m3_b16", (4, 2, 24), "head_dim 24.*block size 16"),
    ("e4m3_b32", (4, 2, 16), "head_dim 16.*block size 32"),
    ("kivi4_value_g64", (4, 2, 96), "head_dim 96.*block size 64"),
    ("int4_token_head", (4, 2, 7), "head_dim 7.*even head_dim"),
    ("kivi4_key_g32", (33, 2, 8), "33 tokens along dim -3.*multiple of 32"),
    ("kivi4_key_g64", (2, 8), "at least 3 dims"),
    ("int8_token_head", (4, 2, 0), "head_dim 0"),
])
def test_shapes_a_codec_cannot_store_are_refused(name, shape, match):
    with pytest.raises(ValueError, match=match):
        kvf.quantize(torch.ones(shape), name)


@pytest.mark.parametrize("name,head_dim,match", [
    ("nvfp4", 40, "head_dim 40.*block size 16"), ("mxfp4", 48, "head_dim 48.*block size 32"),
    ("kivi4_value_g128", 96, "head_dim 96.*block size 128"), ("int4_token_head", 7, "even head_dim"),
])
def test_footprint_refuses_a_head_dim_the_codec_cannot_store(name, head_dim, match):
    with pytest.raises(ValueError, match=match):
        kvf.footprint(name, 2, head_dim)
    with pytest.raises(ValueError, match=match):
        kvf.kv_footprint(kvf.KV_FORMATS[name] if name in kvf.KV_FORMATS else "kivi4_g128", num_kv_heads=2,
                         head_dim=head_dim)


@pytest.mark.parametrize("arg,value,exc", [("num_heads", 0, ValueError), ("head_dim", -1, ValueError),
                                           ("num_heads", 2.0, TypeError), ("head_dim", True, TypeError)])
def test_footprint_refuses_bad_sizes_by_name(arg, value, exc):
    kwargs = dict(num_heads=2, head_dim=64) | {arg: value}
    with pytest.raises(exc, match=f"{arg}={value}"):
        kvf.footprint("int8_token_head", **kwargs)


@pytest.mark.parametrize("group", [16, 48, 256, 0, -32, 32.0, True, "32", None])
def test_kivi_group_sizes_outside_32_64_128_are_refused(group):
    with pytest.raises(ValueError, match=rf"group_size={group!r}; expected one of \(32, 64, 128\)"):
        kvf.kivi(group)


@pytest.mark.parametrize("lookup,bad,exc", [(kvf.codec, "int3", ValueError), (kvf.codec, "kivi4_key_g48", ValueError),
                                            (kvf.codec, 8, TypeError), (kvf.kv_format, "nvfp8", ValueError),
                                            (kvf.kv_format, None, TypeError)])
def test_unknown_names_are_refused_with_the_choices(lookup, bad, exc):
    with pytest.raises(exc, match=rf"{bad!r}.*(expected one of|among) \("):
        lookup(bad)


@pytest.mark.parametrize("name,ts,exc,match", [
    ("int8_token_head", 1.0, ValueError, "tensor_scale=1.0 is given, but codec 'int8_token_head' has no per-tensor"),
    ("mxfp4", 1.0, ValueError, "no per-tensor scale"),
    ("kivi4_value_g32", 0.5, ValueError, "no per-tensor scale"),
    ("nvfp4", 0.0, ValueError, "tensor_scale must be positive and finite; got 0.0"),
    ("nvfp4", -1.0, ValueError, "positive and finite"),
    ("int8_tensor", math.nan, ValueError, "positive and finite"),
    ("int8_tensor", math.inf, ValueError, "positive and finite"),
    ("nvfp4", 2.0**-144, ValueError, "below .*2\\^-143"),
    ("int8_tensor", "amax", TypeError, "tensor_scale='amax'"),
    ("int8_tensor", True, TypeError, "tensor_scale=True"),
    ("nvfp4", torch.ones(2), ValueError, r"tensor_scale has shape \(2,\); expected one number"),
])
def test_bad_tensor_scales_are_refused(name, ts, exc, match):
    with pytest.raises(exc, match=match):
        kvf.quantize(torch.ones(4, 2, 32), name, tensor_scale=ts)


@pytest.mark.parametrize("mode", ["clip", "", None, 0, "RAISE"])
def test_bad_nonfinite_mode_is_refused(mode):
    with pytest.raises(ValueError, match=rf"nonfinite={mode!r}; expected one of \('raise', 'saturate'\)"):
        kvf.quantize(torch.ones(4, 2, 32), "nvfp4", nonfinite=mode)


def test_float64_beyond_float32_is_refused_in_both_modes():
    x = torch.ones(4, 2, 32, dtype=torch.float64)
    x[1, 1, 3] = 1e300
    for mode in ("raise", "saturate"):
        with pytest.raises(ValueError, match=r"x has 1 value\(s\) beyond float32's range.*\(1, 1, 3\)"):
            kvf.quantize(x, "mxfp4", nonfinite=mode)


@pytest.mark.parametrize("name", ["int4_token_head", "kivi4_key_g32", "nvfp4", "e4m3_b32", "fp8_e5m2_channel"])
def test_decode_codes_takes_a_codec_name_and_checks_the_codes(name):
    """Its codec argument was read as a Codec: a name failed with "'str' object has no attribute 'element'"."""
    enc = kvf.quantize(data("normal", (32, 2, 64)), name)
    assert torch.equal(kvf.decode_codes(enc.codes, name), kvf.decode_codes(enc.codes, kvf.codec(name)))
    with pytest.raises(ValueError, match="codec='bogus' is not a known codec"):
        kvf.decode_codes(enc.codes, "bogus")
    with pytest.raises(TypeError, match="codes has dtype float32"):
        kvf.decode_codes(enc.codes.float(), name)


@pytest.mark.parametrize("name", ["int4_token_head", "kivi4_key_g32", "nvfp4", "e4m3_b32", "fp8_e5m2_channel"])
def test_dequantize_refuses_pieces_that_do_not_fit_the_codec(name):
    c = kvf.codec(name)
    enc = kvf.quantize(data("normal", (32, 2, 64)), c)
    pieces = dict(zero_points=enc.zero_points, tensor_scale=enc.tensor_scale)
    with pytest.raises(TypeError, match="codes has dtype"):
        kvf.dequantize(c, enc.codes.to(torch.int32), enc.scales, **pieces)
    with pytest.raises(TypeError, match="scales has dtype"):
        kvf.dequantize(c, enc.codes, enc.scales.to(torch.float64), **pieces)
    with pytest.raises(ValueError, match="scales has shape"):
        kvf.dequantize(c, enc.codes, enc.scales.reshape(-1)[:1].reshape(1, 1, 1, 1), **pieces)
    if c.zero_point:
        with pytest.raises(ValueError, match="zero_points is None, but codec"):
            kvf.dequantize(c, enc.codes, enc.scales, tensor_scale=enc.tensor_scale)
    else:
        with pytest.raises(ValueError, match="zero_points is given, but codec"):
            kvf.dequantize(c, enc.codes, enc.scales, zero_points=enc.scales, tensor_scale=enc.tensor_scale)
    if c.tensor_scale:
        with pytest.raises(ValueError, match="tensor_scale is None, but codec"):
            kvf.dequantize(c, enc.codes, enc.scales, zero_points=enc.zero_points)
    else:
        with pytest.raises(ValueError, match="tensor_scale is given, but codec"):
            kvf.dequantize(c, enc.codes, enc.scales, zero_points=enc.zero_points, tensor_scale=torch.ones(()))
    with pytest.raises(TypeError, match="dtype=torch.int8"):
        kvf.dequantize(c, enc.codes, enc.scales, **pieces, dtype=torch.int8)
    assert torch.equal(kvf.dequantize(c, enc.codes, enc.scales, **pieces), enc.dequantize())


def _bad_stored_pieces():
    """(codec, piece, bad value) for each piece a codec stores that can hold the value: NaN anywhere, -1 where the
    dtype holds it and the piece is a scale (zero points may be negative; e8m0 holds no sign)."""
    cases = []
    for name in ("int8_token_head", "kivi4_key_g32", "nvfp4", "mxfp4", "fp8_e5m2_channel"):
        c = kvf.codec(name)
        pieces = {"scales": c.scale_dtype, "zero_points": c.scale_dtype if c.zero_point else None,
                  "tensor_scale": torch.float32 if c.tensor_scale else None}
        for piece, dtype in pieces.items():
            for bad in (float("nan"), -1.0):
                holds = dtype is not None and torch.tensor(bad).to(dtype).float().isnan().item() is math.isnan(bad) \
                    and (math.isnan(bad) or torch.tensor(bad).to(dtype).float().item() == bad)
                if holds and not (piece == "zero_points" and bad < 0):
                    cases.append((name, piece, bad))
    return cases


@pytest.mark.parametrize("name, piece, bad", _bad_stored_pieces())
def test_dequantize_refuses_scales_quantize_never_writes(name, piece, bad):
    """A NaN scale decodes to NaN and a negative one flips signs: both refused by name, as quantize refuses them."""
    c = kvf.codec(name)
    enc = kvf.quantize(data("normal", (32, 2, 64)), c)
    pieces = dict(scales=enc.scales, zero_points=enc.zero_points, tensor_scale=enc.tensor_scale)
    t = pieces[piece].float().clone()
    t.view(-1)[t.numel() // 2] = bad
    pieces[piece] = t.to(pieces[piece].dtype)
    with pytest.raises(ValueError, match=f"{piece} has 1 value"):
        kvf.dequantize(c, enc.codes, **pieces)


def test_the_listing_names_every_format_once_with_its_codecs():
    assert len(set(kvf.KV_FORMAT_NAMES)) == len(kvf.KV_FORMAT_NAMES)
    used = {c.name for f in kvf.KV_FORMATS.values() for c in f.codecs}
    assert used == set(kvf.CODEC_NAMES)
    assert kvf.kivi(64).key.name == "kivi4_key_g64" and kvf.kivi(64).value.name == "kivi4_value_g64"
    assert kvf.kv_format("MXFP8") is kvf.KV_FORMATS["e4m3_b32"]
    table = kvf.summary_table(head_dim=128)
    assert list(table["name"]) == list(kvf.KV_FORMAT_NAMES)
    assert dict(zip(table["name"], table["bytes_per_token"], strict=True))["nvfp4"] == 2 * 72
    assert "kivi4_g128" not in set(kvf.summary_table(head_dim=96)["name"])  # 96 is no multiple of 128


def test_holding_formats_keeps_those_whose_blocks_divide_the_head_dim():
    from fp8kv.kv_formats import holding_formats

    names = ["nvfp4", "mxfp4", "kivi4_g128", "int8_token_head", "e4m3_b32"]
    assert holding_formats(names, num_kv_heads=2, head_dim=48) == ["nvfp4", "int8_token_head"]
    assert holding_formats(names, num_kv_heads=2, head_dim=128) == names
    assert holding_formats(["int4_token_head"], num_kv_heads=1, head_dim=63) == []  # two 4-bit codes a byte


@pytest.mark.parametrize("call, exc, pattern", [
    # what was an empty answer, a negative size or a crash of another kind before
    (lambda: kvf.holding_formats(["nvfp4"], num_kv_heads=0, head_dim=64), ValueError, "num_kv_heads=0"),
    (lambda: kvf.holding_formats(["nvfp4", "nvfp5"], num_kv_heads=2, head_dim=64), ValueError, "'nvfp5'"),
    (lambda: kvf.holding_formats(["nvfp4", "NVFP4"], num_kv_heads=2, head_dim=64), ValueError,
     r"formats=\['nvfp4', 'NVFP4'\] names \['nvfp4'\] more than once"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64) * -1, ValueError, r"Footprint \* n=-1"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64) * 0, ValueError, r"Footprint \* n=0"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64) * 0.5, TypeError, r"Footprint \* n=0.5"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64) + 1, TypeError, r"Footprint \+ 1 \(int\)"),
    (lambda: kvf.summary_table(head_dim=0), ValueError, "head_dim=0"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64).nbytes(-5), ValueError, "tokens=-5"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64).nbytes(2.5), TypeError, "tokens"),
    (lambda: kvf.kv_footprint("nvfp4", num_kv_heads=2, head_dim=64).nbytes(True), TypeError, "tokens"),
    (lambda: kvf.page_shapes("nvfp4", -3, 16, 2, 32), ValueError, "num_blocks=-3"),
    (lambda: kvf.page_shapes("nvfp4", 2.5, 16, 2, 32), TypeError, "num_blocks"),
    (lambda: kvf.page_shapes(5, 2, 16, 2, 32), TypeError, "codec=5"),
    (lambda: kvf.scale_groups(kvf.codec("nvfp4"), 20), ValueError, "multiple of its block size 16"),
    (lambda: kvf.scale_groups("kivi4_key_g32", 64), ValueError, r"'kivi4_key_g32' \(channel_group scales\)"),
    (lambda: kvf.page_shapes("int8_tensor", 2, 16, 2, 64), ValueError, r"'int8_tensor' \(tensor scales\)"),
    (lambda: kvf.packing.pack_nibbles(torch.zeros(3, 5, dtype=torch.int8)), ValueError, "D even"),
    (lambda: kvf.packing.pack_nibbles(torch.tensor(3)), ValueError, "codes has shape"),
    (lambda: kvf.packing.pack_nibbles([1, 2]), TypeError, "codes must be an integer tensor"),
    (lambda: kvf.packing.pack_nibbles(torch.zeros(4)), TypeError, "codes must be an integer tensor"),
    (lambda: kvf.packing.unpack_nibbles(torch.zeros(4)), TypeError, "packed must be a uint8 tensor"),
])
def test_format_helpers_refuse_bad_arguments_by_name(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("name", [c for c in kvf.CODEC_NAMES if kvf.codec(c).tensor_scale])
def test_dequantize_refuses_a_tensor_scale_of_zero_and_meta_codes(name):
    """A tensor scale of 0 decoded everything to 0 (quantize writes >= 2^-143); codes on 'meta' crashed in torch."""
    c = kvf.codec(name)
    enc = kvf.quantize(data("normal", (8, 2, 64)), c)
    with pytest.raises(ValueError, match=r"tensor_scale has 1 value\(s\) that are not finite and >= 8.96831e-44"):
        kvf.dequantize(c, enc.codes, enc.scales, zero_points=enc.zero_points, tensor_scale=torch.tensor(0.0))
    meta = {k: (None if t is None else t.to("meta")) for k, t in
            dict(scales=enc.scales, zero_points=enc.zero_points, tensor_scale=enc.tensor_scale).items()}
    with pytest.raises(ValueError, match="codes are on meta; the codecs take tensors on 'cpu' or a CUDA device"):
        kvf.dequantize(c, enc.codes.to("meta"), **meta)


@pytest.mark.parametrize("codec_name,scale,exc,pattern", [
    # deep inside before: a NaN / zero / negative scale encoded quietly, the others failed in torch's arithmetic
    ("nvfp4", torch.tensor(-1.0), ValueError, "tensor_scale must be positive and finite; got -1.0"),
    ("nvfp4", 0.0, ValueError, "tensor_scale must be positive and finite; got 0.0"),
    ("e4m3_b16", torch.tensor(float("nan")), ValueError, "tensor_scale must be positive and finite; got nan"),
    ("nvfp4", torch.tensor(1e-45), ValueError, r"tensor_scale=.* is below .* \(2\^-143\)"),
    ("nvfp4", torch.tensor([1.0, 2.0]), ValueError, r"tensor_scale has shape \(2,\); expected one number"),
    ("nvfp4", "a", TypeError, "tensor_scale='a' \\(str\\); expected None or a positive number"),
    ("nvfp4", None, ValueError, "tensor_scale is None, but codec 'nvfp4' scales its blocks by a fixed fp32"),
    ("int8_token_head", torch.tensor(1e-3), ValueError, "codec 'int8_token_head' has no per-tensor scale"),
    ("mxfp4", 0.5, ValueError, "codec 'mxfp4' has no per-tensor scale"),  # it was ignored
    ("int8_tensor", None, ValueError, "codec 'int8_tensor' .* is not token-local"),  # torch's reshape error before
])
def test_encode_rows_refuses_a_bad_tensor_scale_by_name(codec_name, scale, exc, pattern):
    x = data("normal", (4, 2, 32))
    with pytest.raises(exc, match=pattern):
        kvf.encode_rows(x, codec_name, scale)


@pytest.mark.parametrize("codec_name", ["nvfp4", "e4m3_b16"])
def test_encode_rows_takes_a_tensor_scale_as_a_number_or_a_tensor(codec_name):
    """A float, a float64 tensor and an fp32 [1] tensor encode as the fp32 scalar quantize stores."""
    x = data("normal", (4, 2, 32))
    want = kvf.quantize(x, codec_name, tensor_scale=0.01)
    for scale in (0.01, torch.tensor(0.01, dtype=torch.float64), torch.tensor([0.01])):
        codes, scales = kvf.encode_rows(x, codec_name, scale)
        assert torch.equal(codes.view(torch.uint8), want.codes.view(torch.uint8))
        assert torch.equal(scales.view(torch.uint8), want.scales.view(torch.uint8).reshape(scales.shape))


def test_encode_rows_takes_a_codec_name_and_refuses_a_shape_it_cannot_store():
    x = data("normal", (4, 2, 64))
    by_name, by_codec = kvf.encode_rows(x, "int8_token_head"), kvf.encode_rows(x, kvf.codec("int8_token_head"))
    assert all(torch.equal(a, b) for a, b in zip(by_name, by_codec, strict=True))
    with pytest.raises(ValueError, match="x has head_dim 30 .* multiple of its block size 32"):
        kvf.encode_rows(data("normal", (4, 2, 30)), "mxfp4")


@pytest.mark.parametrize("name", kvf.CODEC_NAMES)
def test_data_of_two_dims_stores_and_decodes_or_is_refused_by_name(name):
    """[H, D] data: every codec but KIVI's keys (which group tokens) stores it; an IndexError of the scale shape before."""
    c = kvf.codec(name)
    x = data("normal", (3, 128))
    if c.scaling == "channel_group":
        with pytest.raises(ValueError, match=r"x must have at least 3 dims \[..., tokens, heads, head_dim\]"):
            kvf.quantize(x, c)
        return
    enc = kvf.quantize(x, c)
    want = kvf.quantize(x[None], c).dequantize()[0]
    assert torch.equal(enc.dequantize(), want)
    got = kvf.dequantize(c, enc.codes, enc.scales, zero_points=enc.zero_points, tensor_scale=enc.tensor_scale)
    assert torch.equal(got, want)


@pytest.mark.parametrize("codec_name", ["int8_token_head", "int4_token_head", "nvfp4", "mxfp4"])
def test_encode_rows_takes_no_rows_and_refuses_meta_rows(codec_name):
    """No rows gave torch's reshape RuntimeError (-1 is ambiguous for 0 elements); rows on meta crashed or passed."""
    c = kvf.codec(codec_name)
    ts = 0.01 if c.tensor_scale else None
    codes, scales = kvf.encode_rows(torch.zeros(0, 2, 64), c, ts)
    assert codes.shape == c.code_shape((0, 2, 64)) and scales.shape == (0, 2, kvf.scale_groups(c, 64))
    with pytest.raises(ValueError, match="x is on meta; expected a tensor on 'cpu' or a CUDA device"):
        kvf.encode_rows(torch.zeros(3, 2, 64, device="meta"), c, ts)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (1.5, TypeError), (None, TypeError)])
def test_kv_footprint_names_num_kv_heads_as_given(value, exc):
    with pytest.raises(exc, match=rf"num_kv_heads={value}"):  # 'num_heads', footprint's name, before
        kvf.kv_footprint("nvfp4", num_kv_heads=value, head_dim=64)


def test_dequantize_dtype_is_a_float_dtype():
    enc = kvf.quantize(data("normal", (4, 2, 32)), "int8_token_head")
    for bad in (True, "float16", None):
        with pytest.raises(TypeError, match=rf"dtype={bad!r}; expected a torch dtype among: float16"):
            enc.dequantize(bad)
