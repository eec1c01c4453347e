"""fp8kv.checks: every refusal names the argument, the value and what is accepted; the accepted
values come back converted."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from fp8kv import checks


@pytest.mark.parametrize("value, exc, match", [
    (True, TypeError, r"n=True \(bool\); expected an int"),
    (2.0, TypeError, r"n=2.0 \(float\); expected an int"),
    ("3", TypeError, r"n='3' \(str\); expected an int"),
    (torch.tensor(1.5), TypeError, "expected an int"),
    (0, ValueError, r"n=0; expected an int >= 1"),
])
def test_positive_int_refusals(value, exc, match):
    with pytest.raises(exc, match=match):
        checks.positive_int(value, "n")


def test_integer_accepts_ints_numpy_ints_and_int_tensors_within_bounds():
    assert checks.positive_int(np.int64(7), "n") == 7 and type(checks.positive_int(np.int64(7), "n")) is int
    assert checks.integer(torch.tensor(3), "n") == 3
    assert checks.nonnegative_int(0, "n") == 0
    with pytest.raises(ValueError, match=r"n=9; expected an int <= 8"):
        checks.integer(9, "n", maximum=8)


@pytest.mark.parametrize("value, exc, match", [
    (math.nan, ValueError, "x=nan; expected a finite number"),
    (math.inf, ValueError, "x=inf; expected a finite number"),
    (0.0, ValueError, r"x=0.0; expected a finite number > 0.0"),
    (False, TypeError, r"x=False \(bool\)"),
    ("1", TypeError, r"x='1' \(str\)"),
])
def test_positive_float_refusals(value, exc, match):
    with pytest.raises(exc, match=match):
        checks.positive_float(value, "x")


def test_real_bounds_inclusive_and_not():
    assert checks.real(1, "x", minimum=1.0) == 1.0
    with pytest.raises(ValueError, match=r"x=1.0; expected a finite number > 1.0 and < 2.0"):
        checks.real(1, "x", minimum=1.0, maximum=2.0, inclusive=False)


def test_one_of_and_many_of():
    assert checks.one_of("a", "k", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"k='c'; expected one of \('a', 'b'\)"):
        checks.one_of("c", "k", ("a", "b"))
    with pytest.raises(ValueError, match="expected one of"):
        checks.one_of(["a"], "k", ("a", "b"))  # unhashable: refused, not a crash
    assert checks.many_of("a", "ks", ("a", "b")) == ["a"]
    with pytest.raises(ValueError, match=r"ks has \['z'\]"):
        checks.many_of(["a", "z"], "ks", ("a", "b"))
    with pytest.raises(ValueError, match="ks is empty"):
        checks.many_of([], "ks", ("a",))
    with pytest.raises(TypeError, match="expected a list"):
        checks.many_of(3, "ks", ("a",))


def test_dataframe_names_the_table_and_the_columns_it_lacks_in_the_order_given():
    import pandas as pd

    frame = pd.DataFrame(dict(a=[1]))
    assert checks.dataframe(frame, "t", ["a"], expected="x()'s table") is frame
    with pytest.raises(TypeError, match=r"^t is a list; expected x\(\)'s table$"):
        checks.dataframe([1], "t", ["a"], expected="x()'s table")
    with pytest.raises(ValueError, match=r"^t lacks columns \['c', 'b'\]; expected x\(\)'s table$"):
        checks.dataframe(frame, "t", ["c", "a", "b"], expected="x()'s table")


def test_tensor_checks_name_rank_dtype_device_and_contents():
    t = torch.zeros(2, 3)
    assert checks.tensor(t, "t", ndim=2, dtypes=(torch.float32,), device="cpu") is t
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        checks.tensor([1.0], "t")
    with pytest.raises(ValueError, match=r"t must be 3-D \[B, H, D\]; got shape \(2, 3\)"):
        checks.tensor(t, "t", ndim=3, shape_hint="[B, H, D]")
    with pytest.raises(TypeError, match="t has dtype float32; expected one of: int32, int64"):
        checks.int_tensor(t, "t", ndim=2)
    bad = torch.tensor([1.0, float("nan"), float("inf")])
    with pytest.raises(ValueError, match=r"t has 2 non-finite value\(s\).*index \(1,\)"):
        checks.finite_tensor(bad, "t")


def test_fp32_range_tensor_refuses_float64_values_float32_cannot_hold():
    t = torch.tensor([[1.0, 3.4e38], [-1e39, 1e300]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"t has 2 value\(s\) beyond float32's range; the first is at index "
                                         r"\(1, 0\) \(value -1e\+39\); expected \|values\| <= 3.40282346"):
        checks.fp32_range_tensor(t, "t")
    ok = torch.tensor([torch.finfo(torch.float32).max, float("inf"), float("nan")], dtype=torch.float64)
    assert checks.fp32_range_tensor(ok, "t") is ok  # NaN / Inf are finite_tensor's business
    wide16 = torch.full((2,), 3e38, dtype=torch.bfloat16)  # narrower dtypes always fit
    assert checks.fp32_range_tensor(wide16, "t") is wide16


@pytest.mark.parametrize("value, exc, match", [
    (True, TypeError, r"s=True \(bool\); expected a positive number"),
    ("amax", TypeError, r"s='amax' \(str\); expected a positive number"),
    (["a"], TypeError, r"s=\['a'\] is not a list of numbers; expected a positive number"),
    (torch.tensor([True]), TypeError, r"s has dtype torch.bool"),
    (0, ValueError, r"s must be positive and finite; got 0.0"),
    (torch.tensor([1.0, -5.0]), ValueError, r"s must be positive and finite; got -5.0 at index \(1,\)"),
    (math.nan, ValueError, r"s must be positive and finite; got nan"),
    (1e-300, ValueError, r"s=1e-300 underflows float32 \(it becomes 0.0 there"),
    ([[1.0, 1e300]], ValueError, r"s\[0, 1\]=1e\+300 overflows float32 \(it becomes inf there"),
])
def test_positive_fp32_refusals(value, exc, match):
    with pytest.raises(exc, match=match):
        checks.positive_fp32(value, "s", expected="a positive number")


def test_positive_fp32_returns_fp32_of_the_given_shape():
    assert torch.equal(checks.positive_fp32(2, "s", expected=""), torch.tensor(2.0))
    got = checks.positive_fp32([[0.5, 1e-40]], "s", expected="")  # a float32 subnormal is still positive
    assert got.dtype == torch.float32 and got.shape == (1, 2) and float(got[0, 1]) > 0
    assert torch.equal(checks.positive_fp32(torch.tensor([3], dtype=torch.int64), "s", expected=""),
                       torch.tensor([3.0]))


def test_device_refusals():
    assert checks.device("cpu") == torch.device("cpu")
    with pytest.raises(TypeError, match="device=3"):
        checks.device(3)
    with pytest.raises(ValueError, match="is not a device"):
        checks.device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            checks.device("cuda")


def test_output_folder(tmp_path):
    assert checks.output_folder(tmp_path / "new" / "deeper", "--out") == str(tmp_path / "new" / "deeper")
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is an existing file"):
        checks.output_folder(f, "--out")
    with pytest.raises(ValueError, match="is a file, so no folder can be made under it"):
        checks.output_folder(f / "sub", "--out")
    with pytest.raises(TypeError, match="expected a folder path"):
        checks.output_folder(3, "--out")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="is not writable"):
            checks.output_folder(ro / "x", "--out")


def test_attention_variant():
    sinks = torch.zeros(4)
    assert checks.attention_variant(8, 30, sinks, num_q_heads=4, device="cpu") == (8, 30.0, sinks)
    with pytest.raises(ValueError, match="window=0"):
        checks.attention_variant(0, None, None, num_q_heads=4, device="cpu")
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\); expected \[4\]"):
        checks.attention_variant(None, None, torch.zeros(3), num_q_heads=4, device="cpu")
    with pytest.raises(ValueError, match="sinks has 1 non-finite"):
        checks.attention_variant(None, None, torch.tensor([0.0, 0, 0, math.inf]), num_q_heads=4, device="cpu")
    # contents=False (a timed or captured call): no host sync, so no contents check
    checks.attention_variant(None, None, torch.tensor([0.0, 0, 0, math.inf]), num_q_heads=4, device="cpu",
                             contents=False)


def test_argument_parser_errors_are_one_line(capsys):
    p = checks.ArgumentParser(prog="fp8kv x")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("fp8kv x: error: ")


def test_ints_past_floats_range_or_too_long_to_print_are_refused_by_name():
    """10**400 as a float argument raised float()'s OverflowError; an int of more digits than Python prints raised
    repr's ValueError from inside the message."""
    with pytest.raises(ValueError, match=r"sm_scale=1000.*past float64's range"):
        checks.real(10**400, "sm_scale")
    with pytest.raises(ValueError, match=r"sm_scale=<an int of 16610 bits>; expected a finite number"):
        checks.real(10**5000, "sm_scale")
    with pytest.raises(ValueError, match=r"n=<an int of 16610 bits>; expected an int <= 5"):
        checks.integer(10**5000, "n", maximum=5)
