"""Oracles for fp8kv.kv_formats, written from the formats' definitions without fp8kv's code, and torch's own
FP4 encoder, decoder and packer (torch/testing/_internal/common_quantized.py, from torchao)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import torch

F32 = torch.float32
U8 = torch.uint8


def _torch_fp4_helpers() -> dict:
    """torch's FP4 encoder, decoder and packer, read from torch/testing/_internal/common_quantized.py.

    Importing that module needs ``expecttest`` (a torch test-suite dependency fp8kv does not have), so
    the functions and the constants they use are taken from its source, as they are.
    """
    path = Path(torch.__file__).parent / "testing" / "_internal" / "common_quantized.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wanted = {"_n_ones", "EBITS_F32", "MBITS_F32", "F32_EXP_BIAS", "_f32_to_floatx_unpacked",
              "_floatx_unpacked_to_f32", "down_size", "pack_uint4"}
    nodes = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in wanted) or (
        isinstance(n, ast.Assign) and {getattr(t, "id", None) for t in ast.walk(n.targets[0])} & wanted)]
    found = {n.name for n in nodes if isinstance(n, ast.FunctionDef)}
    assert found >= {"_f32_to_floatx_unpacked", "_floatx_unpacked_to_f32", "pack_uint4"}, f"{path}: has {found}"
    namespace = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


_TORCH_FP4 = _torch_fp4_helpers()
torch_fp4_encode = _TORCH_FP4["_f32_to_floatx_unpacked"]  # (fp32 x, ebits, mbits) -> uint8 codes
torch_fp4_decode = _TORCH_FP4["_floatx_unpacked_to_f32"]  # (uint8 codes, ebits, mbits) -> fp32
torch_pack_uint4 = _TORCH_FP4["pack_uint4"]  # uint8 codes [..., 2n] -> [..., n], element 2i low


# ------------------------------------------------------------------ oracles from the definitions
def e2m1_value(code: int) -> float:
    """OCP FP4 E2M1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2))


def rne_on_table(y: torch.Tensor, table: list[float], sign_bit: int) -> tuple[torch.Tensor, int]:
    """Saturating round-to-nearest-even onto increasing magnitudes ``table`` (index = code without sign).

    An exact tie takes the even index. Past the top, the next (unrepresentable) magnitude is top + the
    last gap; a value rounds past the top (saturated, counted) when above the midpoint, or on it with
    the top's index odd. Returns (index | sign << sign_bit, as int64; saturated).
    """
    t = torch.tensor(table, dtype=torch.float64)
    a = y.to(torch.float64).abs().reshape(-1)
    top, gap = table[-1], table[-1] - table[-2]
    over_tie = top + gap / 2
    top_odd = (len(table) - 1) % 2 == 1
    saturated = int(((a > over_tie) | ((a == over_tie) & top_odd)).sum())
    a = a.clamp(max=top)
    hi = torch.searchsorted(t, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - t[lo], t[hi] - a
    idx = torch.where(d_lo < d_hi, lo, hi)
    idx = torch.where((d_lo == d_hi) & (lo != hi), torch.where(lo % 2 == 0, lo, hi), idx)
    idx = torch.where(a == t[hi], hi, idx)
    sign = torch.signbit(y.reshape(-1)).to(torch.int64) << sign_bit
    return (idx | sign).reshape(y.shape), saturated


E2M1_TABLE = [e2m1_value(c) for c in range(8)]
# e4m3fn as torch decodes it: codes 0x00 .. 0x7E are +0 .. 448, increasing (0x7F is NaN)
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(U8).view(torch.float8_e4m3fn).to(F32).tolist()
E4M3_TABLE = E4M3_VALUES[:127]


def rne_int(y: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, int]:
    """Round half to even by floor and an explicit tie rule (in fp64, exact for fp32 y), then clamp."""
    y = y.to(torch.float64)
    f = torch.floor(y)
    frac = y - f
    r = torch.where((frac > 0.5) | ((frac == 0.5) & (torch.remainder(f, 2) == 1)), f + 1, f)
    saturated = int(((r > hi) | (r < lo)).sum())
    return r.clamp(lo, hi).to(torch.int64), saturated


def all_finite_16bit(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit float dtype, as fp32."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    v = bits.view(dtype).to(F32)
    return v[torch.isfinite(v)]


def boundary_sweep(table: list[float], extra: float) -> torch.Tensor:
    """Each representable magnitude, each midpoint (tie) between neighbours and the tie past the top,
    with the fp32 neighbours of all of them, up to ``extra``; both signs and ±0."""
    points = list(table) + [(a + b) / 2 for a, b in zip(table[:-1], table[1:], strict=True)]
    points += [table[-1] + (table[-1] - table[-2]) / 2, extra]
    p = torch.tensor(points, dtype=F32)
    inf = torch.full_like(p, math.inf)
    around = torch.cat([p, torch.nextafter(p, inf), torch.nextafter(p, -inf)])
    around = around[around >= 0]
    return torch.cat([around, -around, torch.tensor([0.0, -0.0])])
