"""Rotary position embedding (RoPE) in the rotate-half layout of Llama, Qwen and Hugging Face: channel ``i``
of a head pairs with channel ``i + D/2``, and the pair turns by ``position * theta^(-2i/D)``. Used by the
synthetic keys and queries (:mod:`fp8kv.synthetic`) and the decode step's attention (:mod:`fp8kv.step`)."""

from __future__ import annotations

import torch

from . import checks

__all__ = ["rope_inv_freq", "rope_cos_sin", "apply_rope", "rope_at_positions"]


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` inverse frequencies ``theta ** (-2i / head_dim)`` (the Hugging Face formula)."""
    head_dim = checks.positive_int(head_dim, "head_dim")
    if head_dim % 2:  # rotate-half pairs channel i with i + D/2
        checks.fail(f"head_dim={head_dim} is odd; expected an even head_dim (RoPE turns channel pairs)")
    theta = checks.positive_float(theta, "theta")  # 0 or below: no frequencies (NaN or inf angles)
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return (1.0 / (theta ** exps)).to(device)


def rope_cos_sin(positions, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin ``[B, D]`` (``dtype``, a floating dtype) of finite positions ``[B]`` (a tensor or a list); the
    two halves repeat (rotate-half RoPE). Angles in fp64, as :func:`rope_at_positions`: fp32 rounds positions
    past 2**24 and the fast pairs' angles well before."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        checks.fail(f"dtype={dtype!r}; expected a floating torch.dtype (cos and sin are fractions)", TypeError)
    inv_freq = checks.tensor(inv_freq, "inv_freq", ndim=1, shape_hint="[D/2] (rope_inv_freq)")
    positions = _positions(positions, inv_freq.device, "B")
    freqs = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _positions(positions, device, axis: str) -> torch.Tensor:
    """``positions``: a 1-D tensor or list of finite integer or real positions (checked), as a tensor; a list of
    floats in fp64 (the default fp32 would round positions past 2**24). ``axis`` names the positions' one dim."""
    if not isinstance(positions, torch.Tensor):
        try:
            given = torch.as_tensor(positions, device=device)
            positions = (torch.as_tensor(positions, dtype=torch.float64, device=device)
                         if given.is_floating_point() else given)
        except (TypeError, ValueError, RuntimeError):
            checks.fail(f"positions={checks.show_value(positions)}; expected a 1-D tensor or list of positions",
                        TypeError)
    checks.tensor(positions, "positions", ndim=1, shape_hint=f"[{axis}]")
    if positions.dtype == torch.bool or positions.is_complex():
        checks.fail(f"positions has dtype {positions.dtype}; expected integer or real positions", TypeError)
    checks.readable_tensor(positions, "positions")
    checks.finite_tensor(positions.to(torch.float64) if positions.is_floating_point() else positions, "positions")
    return positions


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, D]`` by position: channel i pairs with i + D/2 (Llama / Qwen layout); ``cos``,
    ``sin`` ``[B, D]`` as :func:`rope_cos_sin` gives them. Computed in the dtypes given."""
    checks.tensor(x, "x", ndim=3, shape_hint="[B, H, D]")
    b, _, d = x.shape
    if d % 2:
        checks.fail(f"x has shape {tuple(x.shape)}: odd D={d}; expected [B, H, D] with even D")
    for name, t in (("cos", cos), ("sin", sin)):
        checks.tensor(t, name, ndim=2, shape_hint="[B, D] (rope_cos_sin)")
        if tuple(t.shape) != (b, d):  # else torch broadcasts a wrong batch or fails deep inside
            checks.fail(f"{name} has shape {tuple(t.shape)}; expected [B, D] = {(b, d)} to match x {tuple(x.shape)}")
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_at_positions(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by RoPE at ``positions`` ``[T]`` (Hugging Face ``rotate_half`` layout).

    Returns a new fp32 tensor. Channel ``i < D/2`` pairs with ``i + D/2``; the pair's angle is
    ``position * theta^(-2i/D)``.
    """
    checks.tensor(x, "x", ndim=3, dtypes=checks.FLOAT_DTYPES, shape_hint="[T, H, D]")
    if x.shape[-1] % 2:
        raise ValueError(f"x must be [T, H, D] with even D; got shape {tuple(x.shape)}")
    checks.readable_tensor(x, "x")
    theta = checks.positive_float(theta, "theta")  # 0 or below gave NaN rows
    positions = _positions(positions, x.device, "T").to(device=x.device, dtype=torch.float64)
    if positions.numel() != x.shape[0]:
        raise ValueError(f"positions has {positions.numel()} entries but x has {x.shape[0]} tokens")
    d = x.shape[-1]
    half = d // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / d)
    # Angles in fp64: at 32k positions fp32 would lose the low bits of the fast-rotating pairs.
    ang = positions[:, None] * inv_freq[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return apply_rope(x.to(torch.float32), ang.cos().to(torch.float32), ang.sin().to(torch.float32))
