"""What one FP8 cast does to values (notebook 01): round-trip error by magnitude, why a scale is
needed, and a bare ``.to(float8)`` against fp8kv's saturating cast."""

from __future__ import annotations

import torch

from .. import checks
from ..formats import format as get_format
from ..quant import quantize, relative_error
from .selection import format_names

__all__ = ["roundtrip_sweep", "scale_sweep", "cast_comparison"]


def roundtrip_sweep(magnitudes: torch.Tensor, formats, *, plot_points: int = 4000):
    """Relative round-trip error of positive ``magnitudes`` through each format with scale 1.

    Returns ``(curve, summary)``: ``curve`` a DataFrame (format, magnitude, rel_error) thinned to about
    ``plot_points`` points per format for plotting; ``summary`` per format: the largest relative error
    in the normal range (bounded by the unit roundoff), in the subnormal range, and the saturation /
    underflow counts of the sweep.
    """
    import pandas as pd

    checks.tensor(magnitudes, "magnitudes", ndim=1, shape_hint="of positive values")
    if not magnitudes.numel() or not bool((magnitudes > 0).all()):
        checks.fail("magnitudes must be a non-empty 1-D tensor of positive values")
    checks.positive_int(plot_points, "plot_points")
    mags = magnitudes.detach().to(torch.float32).cpu()
    step = max(1, mags.numel() // plot_points)
    curves, summary = [], {}
    for name in format_names(formats):
        f = get_format(name)
        q = quantize(magnitudes.view(-1, 1, 1), f, scale=1.0, nonfinite="saturate")
        rel = ((q.dequantize().view(-1).cpu() - mags).abs() / mags)
        normal = (mags >= f.min_normal) & (mags <= f.max)
        subnormal = mags < f.min_normal
        summary[name] = {
            "max_rel_error_normal": float(rel[normal].max()) if normal.any() else None,
            "unit_roundoff": f.unit_roundoff,
            "max_rel_error_subnormal_range": float(rel[subnormal].max()) if subnormal.any() else None,
            "points": mags.numel(),
            "points_normal": int(normal.sum()),
            "points_above_max": int((mags > f.max).sum()),
            "saturated": q.saturated,
            "underflow": q.underflow,
        }
        curves.append(pd.DataFrame({"format": name, "magnitude": mags[::step].numpy(),
                                    "rel_error": rel[::step].numpy()}))
    return pd.concat(curves, ignore_index=True), summary


def scale_sweep(base: torch.Tensor, sigmas, formats=("e4m3", "e5m2"), scales=(1.0, "amax")):
    """Relative error of ``base × σ`` quantized with each scale, for every spread σ.

    Shows why a scale is needed: with scale 1 only tensors inside the format's window survive;
    the amax scale makes the error independent of σ. Returns a tidy DataFrame.
    """
    import pandas as pd

    rows = []
    for sigma in sigmas:
        x = base * float(sigma)
        for name in format_names(formats):
            for scale in scales:
                q = quantize(x, name, scale=scale)
                rows.append({"format": name, "scale": str(scale), "setup": f"{name}, scale={scale}",
                             "sigma": float(sigma), "rel_error": relative_error(q.dequantize(), x),
                             "saturated_fraction": q.saturated_fraction,
                             "underflow_fraction": q.underflow_fraction})
    return pd.DataFrame(rows)


def cast_comparison(formats, factors=(0.9, 1.0, 1.02, 1.05, 1.1, 1.5, 2.0, 4.0), device=None):
    """A bare ``x.to(float8)`` against fp8kv's clamp-then-cast, for inputs ``factor × max``.

    Returns ``(table, summary)``: table rows (format, method, input, output) and per format the
    non-finite outputs of each method and fp8kv's saturation count.
    """
    import pandas as pd

    rows, summary = [], {}
    for name in format_names(formats):
        f = get_format(name)
        x = torch.tensor(factors, dtype=torch.float32, device=device) * f.max
        bare = x.to(f.torch_dtype).to(torch.float32).cpu()
        q = quantize(x.view(-1, 1, 1), f, scale=1.0)
        mine = q.dequantize().view(-1).cpu()
        for xi, b, m in zip(x.cpu().tolist(), bare.tolist(), mine.tolist(), strict=True):
            rows += [{"format": name, "method": "bare .to()", "input": xi, "output": b},
                     {"format": name, "method": "fp8kv clamp+cast", "input": xi, "output": m}]
        summary[name] = {"inputs": x.cpu().tolist(), "bare_cast": bare.tolist(), "fp8kv": mine.tolist(),
                         "bare_nonfinite": int((~torch.isfinite(bare)).sum()),
                         "fp8kv_nonfinite": int((~torch.isfinite(mine)).sum()), "fp8kv_saturated": q.saturated}
    return pd.DataFrame(rows), summary
