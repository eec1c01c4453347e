"""What K and V look like (notebook 02): outlier channels, tails and spreads, which decide how well they quantize."""

from __future__ import annotations

import math

import torch

from .. import checks

__all__ = ["describe_kv", "channel_amax"]


def _check_kv(k, v) -> None:
    """k and v: float tensors ``[tokens, H, D]`` of one shape, at least one token (statistics over none are
    undefined)."""
    for name, x in (("k", k), ("v", v)):
        checks.tensor(x, name, ndim=3, shape_hint="[tokens, H, D]")
        if not x.is_floating_point():
            checks.fail(f"{name} has dtype {str(x.dtype).replace('torch.', '')}; expected a float tensor", TypeError)
    if v.shape != k.shape:
        checks.fail(f"k and v must have equal shapes [tokens, H, D]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[0] < 1:
        checks.fail(f"k and v have no tokens (shape {tuple(k.shape)}); give at least one")


def describe_kv(k: torch.Tensor, v: torch.Tensor, *, top_channels: int = 4) -> dict:
    """Summary statistics of ``k``, ``v`` ``[L, H, D]`` that decide how well they quantize.

    Returns a dict: tokens, num_kv_heads, head_dim; ``k_outlier_ratio`` (per head, the mean amax
    of the ``top_channels`` largest-amax channels over the median channel amax; averaged over
    heads), the same ``v_outlier_ratio``; ``k_kurtosis``, ``v_kurtosis`` (of all elements; 3 for
    a Gaussian); ``k_head_rms_ratio``, ``v_head_rms_ratio`` (largest over smallest per-head RMS);
    ``k_token_norm_ratio``, ``v_token_norm_ratio`` (95th over 5th percentile of token norms);
    ``k_amax``, ``v_amax``.
    """
    from ..synthetic import kurtosis

    _check_kv(k, v)
    checks.integer(top_channels, "top_channels", minimum=1, maximum=k.shape[-1])
    out = dict(tokens=k.shape[0], num_kv_heads=k.shape[1], head_dim=k.shape[2])
    for name, x in (("k", k), ("v", v)):
        x = x.detach().to(torch.float32)
        amax = x.abs().amax(dim=0)  # [H, D]
        top = amax.topk(top_channels, dim=-1).values.mean(-1)
        med = amax.median(dim=-1).values.clamp_min(torch.finfo(torch.float32).tiny)
        rms = x.pow(2).mean(dim=(0, 2)).sqrt()
        norms = x.norm(dim=(1, 2)).to(torch.float64)
        lo = float(norms.quantile(0.05)) if x.shape[0] > 1 else float(norms[0])
        hi = float(norms.quantile(0.95)) if x.shape[0] > 1 else float(norms[0])
        out.update({f"{name}_outlier_ratio": float((top / med).mean()), f"{name}_kurtosis": kurtosis(x),
                    f"{name}_head_rms_ratio": float(rms.max() / rms.min().clamp_min(1e-30)),
                    f"{name}_token_norm_ratio": hi / lo if lo > 0 else math.inf,
                    f"{name}_amax": float(amax.max())})
    return out


def channel_amax(k: torch.Tensor, v: torch.Tensor):
    """amax over tokens of every (head, channel) of K and V: rows tensor ("K"/"V"), head, channel, amax."""
    import pandas as pd

    _check_kv(k, v)
    frames = []
    for name, x in (("K", k), ("V", v)):
        a = x.detach().abs().to(torch.float32).amax(dim=0).cpu()  # [H, D]
        h, d = a.shape
        frames.append(pd.DataFrame({"tensor": name, "head": torch.arange(h).repeat_interleave(d).numpy(),
                                    "channel": torch.arange(d).repeat(h).numpy(), "amax": a.reshape(-1).numpy()}))
    return pd.concat(frames, ignore_index=True)
