"""fp8kv.formats: every fact is checked against torch's own decoding of the 256 codes."""

from __future__ import annotations

import math

import pytest
import torch

from fp8kv import formats
from fp8kv.formats import FORMATS, KV_DTYPES, FP8Format, kv_dtype_info

ALL = sorted(FORMATS)
# Spec values (OCP FP8 spec and AMD's fnuz variants), not outputs of the code under test.
SPEC_MAX = {"e4m3": 448.0, "e5m2": 57344.0, "e4m3fnuz": 240.0, "e5m2fnuz": 57344.0}
SPEC_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2,
              "e4m3fnuz": torch.float8_e4m3fnuz, "e5m2fnuz": torch.float8_e5m2fnuz}


def torch_decode(dtype: torch.dtype) -> torch.Tensor:
    """fp64 value of each of the 256 codes as torch decodes them (independent of formats.py)."""
    return torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).to(torch.float64)


def manual_decode(code: int, f: FP8Format) -> float:
    """Decode a finite code from its bit fields: the textbook formula, not torch."""
    m = f.mantissa_bits
    sign = -1.0 if code >> 7 else 1.0
    e = (code >> m) & ((1 << f.exponent_bits) - 1)
    mant = code & ((1 << m) - 1)
    if e == 0:
        return sign * mant * 2.0 ** (1 - f.bias - m)
    return sign * (1 + mant / 2**m) * 2.0 ** (e - f.bias)


@pytest.mark.parametrize("name", ALL)
def test_facts_match_torch_decoding(name):
    f = FORMATS[name]
    assert f.torch_dtype == SPEC_DTYPE[name]
    vals = torch_decode(f.torch_dtype)
    finite = vals[torch.isfinite(vals)]
    pos = finite[finite > 0]
    assert f.max == SPEC_MAX[name]
    assert f.max == float(finite.max()) == -float(finite.min())
    assert f.min_subnormal == float(pos.min())
    # The smallest normal is the first code with a non-zero exponent field: code 1 << m.
    assert f.min_normal == float(vals[1 << f.mantissa_bits])
    assert f.min_normal == f.min_subnormal * 2**f.mantissa_bits
    # 2^m codes per binade: count the positive codes in [min_normal, 2 * min_normal).
    in_binade = ((pos >= f.min_normal) & (pos < 2 * f.min_normal)).sum()
    assert int(in_binade) == 2**f.mantissa_bits
    assert f.exponent_bits + f.mantissa_bits == 7
    assert f.finite_codes == int(torch.isfinite(vals).sum())
    assert f.has_inf == bool(torch.isinf(vals).any())
    assert torch.equal(f.code_values.to(torch.float64).nan_to_num(123.0), vals.nan_to_num(123.0))
    # torch's own finfo agrees on range (eps is not compared: torch reports 2^-3 for e5m2fnuz).
    fi = torch.finfo(f.torch_dtype)
    assert (f.max, f.min_normal) == (fi.max, fi.smallest_normal)


@pytest.mark.parametrize("name", ALL)
def test_finite_code_count_follows_layout(name):
    f = FORMATS[name]
    if f.has_inf:  # IEEE-like: the top exponent holds ±inf and 2^m - 1 NaNs per sign
        expected = 256 - 2 * 2**f.mantissa_bits
    elif name.endswith("fnuz"):  # only 0x80 (the would-be -0) is NaN
        expected = 255
    else:  # OCP e4m3fn: S.1111.111 is NaN, one per sign
        expected = 254
    assert f.finite_codes == expected
    assert f.summary()["finite_codes"] == expected


@pytest.mark.parametrize("name", ALL)
def test_overflow_threshold_against_torch_unclamped_cast(name):
    """Magnitudes >= max + half an ulp round past max; just below it they round down to max."""
    f = FORMATS[name]
    ulp_at_max = 2.0 ** (math.floor(math.log2(f.max)) - f.mantissa_bits)
    assert f.overflow_threshold == f.max + ulp_at_max / 2
    thr = torch.tensor([f.overflow_threshold], dtype=torch.float32)
    below = torch.nextafter(thr, torch.zeros_like(thr))
    assert float(below.to(f.torch_dtype).float()) == f.max
    # The threshold is a tie between max and the next (non-finite) code: round-to-nearest-even
    # goes up, past max, when max's mantissa is odd (e5m2, both fnuz: torch gives inf/NaN) and
    # down to max when it is even (e4m3fn: 448 = 1.110b x 2^8, so 464 -> 448).
    vals = torch_decode(f.torch_dtype)
    max_code = int(torch.nonzero(vals == f.max)[0])
    at = float(thr.to(f.torch_dtype).float())
    if max_code & 1:
        assert not math.isfinite(at)
    else:
        assert at == f.max


@pytest.mark.parametrize("name", ALL)
def test_codes_table_kinds_consistent(name):
    f = FORMATS[name]
    df = f.codes()
    vals = torch_decode(f.torch_dtype)
    assert list(df["code"]) == list(range(256))
    assert all(b == f"{c:08b}" for c, b in zip(df["code"], df["bits"], strict=True))
    counts = df["kind"].value_counts().to_dict()
    assert counts.get("nan", 0) == int(torch.isnan(vals).sum())
    assert counts.get("inf", 0) == int(torch.isinf(vals).sum())
    assert counts.get("zero", 0) == (1 if name.endswith("fnuz") else 2)
    assert counts["subnormal"] == 2 * (2**f.mantissa_bits - 1)
    assert counts["zero"] + counts["subnormal"] + counts["normal"] == f.finite_codes
    for row in df.itertuples():
        v = float(vals[row.code])
        if row.kind in ("nan", "inf"):
            assert not math.isfinite(row.value)
            continue
        assert row.value == v == manual_decode(row.code, f), (name, row.code)
        assert row.sign == row.code >> 7 and row.exponent == (row.code >> f.mantissa_bits) & (
            2**f.exponent_bits - 1)
        if row.kind == "subnormal":
            assert row.exponent == 0 and 0 < abs(v) < f.min_normal
        elif row.kind == "normal":
            assert row.exponent > 0 and f.min_normal <= abs(v) <= f.max
        else:
            assert v == 0.0


@pytest.mark.parametrize("name", ALL)
def test_summary_and_derived_quantities(name):
    f = FORMATS[name]
    s = f.summary()
    assert s["name"] == name and s["max"] == f.max and s["min_subnormal"] == f.min_subnormal
    assert (s["mantissa_bits"], s["exponent_bits"], s["bias"]) == (f.mantissa_bits, f.exponent_bits, f.bias)
    assert s["unit_roundoff"] == f.unit_roundoff == f.epsilon / 2


def test_epsilon_is_spacing_above_one():
    for f in FORMATS.values():
        vals = torch_decode(f.torch_dtype)
        above_one = vals[(vals > 1.0) & torch.isfinite(vals)]
        assert f.epsilon == float(above_one.min()) - 1.0, f.name


@pytest.mark.parametrize(
    "alias, name",
    [("e4m3", "e4m3"), ("E4M3FN", "e4m3"), ("fp8_e4m3", "e4m3"), ("float8_e4m3fn", "e4m3"),
     ("fp8_e5m2", "e5m2"), ("float8_e5m2", "e5m2"), ("float8_e4m3fnuz", "e4m3fnuz"),
     ("e5m2fnuz", "e5m2fnuz"), (torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2fnuz, "e5m2fnuz")],
)
def test_lookup_aliases(alias, name):
    assert formats.format(alias) is FORMATS[name]
    assert formats.format(FORMATS[name]) is FORMATS[name]


def test_lookup_errors():
    with pytest.raises(ValueError, match=r"name='int8' is not a known FP8 format; expected one of"):
        formats.format("int8")
    with pytest.raises(ValueError, match=r"dtype torch.float16 is not an FP8 format"):
        formats.format(torch.float16)
    with pytest.raises(TypeError, match=r"name must be a format name or torch dtype, got int"):
        formats.format(3)  # fp8kv.format's own argument, not a caller's "fmt"


@pytest.mark.parametrize(
    "given, name, dtype",
    [("bf16", "bf16", torch.bfloat16), ("bfloat16", "bf16", torch.bfloat16), ("half", "fp16", torch.float16),
     ("fp8", "fp8_e4m3", torch.float8_e4m3fn), ("E5M2", "fp8_e5m2", torch.float8_e5m2),
     (torch.float8_e4m3fn, "fp8_e4m3", torch.float8_e4m3fn), (torch.float16, "fp16", torch.float16)],
)
def test_kv_dtype_info(given, name, dtype):
    got_name, got_dtype, fmt = kv_dtype_info(given)
    assert (got_name, got_dtype) == (name, dtype)
    assert fmt is KV_DTYPES[name][1]
    assert (fmt is None) == (name in ("bf16", "fp16"))
    if fmt is not None:
        assert fmt.torch_dtype == dtype


@pytest.mark.parametrize("bad", ["int8", torch.float32, "fp8_e4m3fnuz"])
def test_kv_dtype_info_errors(bad):
    with pytest.raises(ValueError, match=r"kv_dtype=.* is not supported; expected one of \['bf16'"):
        kv_dtype_info(bad)


@pytest.mark.parametrize("given", [torch.float8_e5m2, FORMATS["e4m3"], "fp8_e4m3", ["e5m2", torch.float8_e4m3fnuz]])
def test_summary_table_takes_what_format_takes(given):
    """One format given as a dtype or an FP8Format used to be iterated (TypeError): it is one row, as a name is."""
    table = formats.summary_table(given)
    expected = [formats.format(g).name for g in (given if isinstance(given, list) else [given])]
    assert table["name"].tolist() == expected
    assert formats.summary_table().shape[0] == len(FORMATS)


def test_summary_table_refuses_what_is_not_a_format():
    with pytest.raises(TypeError, match=r"names=5 \(int\); expected None, a format"):
        formats.summary_table(5)
    with pytest.raises(ValueError, match=r"names\[1\]='xx' is not a known FP8 format"):
        formats.summary_table(["e4m3", "xx"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_saturation_bounds_of_wide_dtypes(dtype):
    """No fp32 input rounds past fp32's or fp64's max: the threshold is inf (fp64's tie overflowed a Python
    float: OverflowError)."""
    fmax, overflow = formats.saturation_bounds(dtype)
    assert fmax == torch.finfo(dtype).max and overflow == math.inf


def test_saturation_bounds_of_storage_dtypes_and_refusals():
    for kv_name, (dtype, fmt) in KV_DTYPES.items():
        fmax, overflow = formats.saturation_bounds(dtype)
        assert fmax == torch.finfo(dtype).max, kv_name
        if fmt is not None:
            assert (fmax, overflow) == (fmt.max, fmt.first_overflow)
        else:  # a 16-bit cache: the first overflow rounds to inf there, the fp32 just below it to max
            below = torch.nextafter(torch.tensor(overflow), torch.tensor(0.0))
            assert float(below.to(dtype)) == fmax and torch.isinf(torch.tensor(overflow).to(dtype)), kv_name
    for bad in (torch.int8, "bf16", None):
        with pytest.raises(TypeError, match=r"dtype=.*; expected a torch float dtype among: float8_e4m3fn"):
            formats.saturation_bounds(bad)


@pytest.mark.parametrize("value", [["fp8_e4m3"], {"fp8_e4m3": 1}, None, 8])
def test_is_fp8_answers_false_for_what_is_no_name(value):
    assert formats.is_fp8(value) is False  # a list or dict raised 'unhashable type' before
    assert formats.is_fp8("fp8_e5m2") and not formats.is_fp8("bf16")
