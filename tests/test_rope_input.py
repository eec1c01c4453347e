"""fp8kv.rope refuses what it cannot turn, by name."""

from __future__ import annotations

import pytest
import torch

from fp8kv.rope import apply_rope, rope_at_positions, rope_cos_sin, rope_inv_freq


def test_rope_inv_freq_refuses_an_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        rope_inv_freq(7, 1e4)


def test_rope_cos_sin_refuses_bad_dtype_and_positions_and_takes_a_list():
    inv = rope_inv_freq(8, 1e4)
    with pytest.raises(TypeError, match="dtype=torch.int64; expected a floating"):
        rope_cos_sin(torch.arange(2), inv, torch.int64)
    with pytest.raises(ValueError, match="positions has 1 non-finite"):
        rope_cos_sin(torch.tensor([0.0, float("nan")]), inv, torch.float32)
    cos, sin = rope_cos_sin([0, 1], inv, torch.float32)
    assert cos.shape == sin.shape == (2, 8)


def test_rope_cos_sin_keeps_large_positions_exact():
    inv = rope_inv_freq(8, 1e4)
    p = 2**24 + 1  # fp32 rounds it to 2**24
    cos, _ = rope_cos_sin(torch.tensor([p]), inv, torch.float64)
    torch.testing.assert_close(cos[0, 0], torch.tensor(float(p), dtype=torch.float64).cos())


def test_apply_rope_checks_shapes_by_name():
    cos, sin = rope_cos_sin(torch.arange(3), rope_inv_freq(8, 1e4), torch.float32)
    with pytest.raises(ValueError, match=r"x must be 3-D \[B, H, D\]"):
        apply_rope(torch.randn(3, 8), cos, sin)
    with pytest.raises(ValueError, match=r"cos has shape \(3, 8\); expected \[B, D\] = \(2, 8\)"):
        apply_rope(torch.randn(2, 4, 8), cos, sin)
    with pytest.raises(ValueError, match=r"cos has shape \(3, 8\); expected \[B, D\] = \(3, 16\)"):
        apply_rope(torch.randn(3, 4, 16), cos, sin)
    assert apply_rope(torch.randn(3, 4, 8), cos, sin).shape == (3, 4, 8)


def test_a_list_of_float_positions_keeps_fp64():
    """Positions past 2**24 given as Python floats: as exact as an fp64 tensor (torch's default fp32 rounded them)."""
    x = torch.randn(1, 1, 8)
    exact = rope_at_positions(x, torch.tensor([16777217.0], dtype=torch.float64))
    assert torch.equal(rope_at_positions(x, [16777217.0]), exact)
    cos, _ = rope_cos_sin([16777217.0], rope_inv_freq(8, 10000.0), torch.float32)
    assert torch.equal(cos, rope_cos_sin(torch.tensor([16777217], dtype=torch.int64), rope_inv_freq(8, 10000.0),
                                         torch.float32)[0])
