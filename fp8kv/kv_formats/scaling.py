"""Scale groups and the rules that choose their scales (one function per rule of :data:`.registry.RULES`).

A tensor ``[..., H, D]`` is viewed so that the values sharing one scale lie along one *group dim*
(:func:`group_view`); each rule reduces over it with ``keepdim`` and returns fp32 factors shaped to
broadcast against the view, beside the scales as stored (the codec's ``scale_dtype``). Every
quantity here is fp32, as a kernel would compute it, so that what :mod:`.codec` encodes and decodes
is what a kernel reading the same bytes computes.
"""

from __future__ import annotations

import torch

from ..quant import scale_from_stat
from .elements import E8M0_MAX_EXPONENT, E8M0_MIN_EXPONENT, e8m0_from_exponent, e8m0_to_float, floor_log2
from .registry import Codec

__all__ = ["group_view", "group_amax", "amax_scale", "min_max_scale", "two_level_scale", "effective_two_level",
           "pow2_scale", "tensor_scale_for", "E4M3_BLOCK_SCALE_MIN", "TENSOR_SCALE_MIN", "FP16_MAX", "FP16_TINY"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# NVFP4's block scales are clamped to e4m3's normal range (torchao's E4M3_EPS): a subnormal block
# scale rounds by up to half its value, and rounded down it would push the block's amax past the
# element's max. Clamped up, the block only loses resolution.
E4M3_BLOCK_SCALE_MIN = 2.0**-6
# The tensor scale of a two-level codec is at least 2^-143, so that block scale (>= 2^-6) x tensor
# scale is never below fp32's smallest subnormal 2^-149: never a zero divisor. Only a tensor whose
# values are all below ~2^-131 (deep fp32 subnormals) gets a larger scale than amax / (448 x max).
TENSOR_SCALE_MIN = 2.0**-143
FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal)


def group_view(t: torch.Tensor, c: Codec) -> tuple[torch.Tensor, int]:
    """``t`` (``[..., H, D]``, shape already checked) viewed as ``(grouped, dim)``: the values sharing
    one scale lie along ``dim`` of ``grouped``."""
    shape = t.shape
    if c.scaling == "tensor":
        return t.reshape(1, -1), -1
    if c.scaling == "token_head":
        return t, -1
    if c.scaling == "block":
        return t.reshape(*shape[:-1], shape[-1] // c.block, c.block), -1
    if c.scaling == "channel_group":
        return t.reshape(*shape[:-3], shape[-3] // c.block, c.block, *shape[-2:]), -3
    raise ValueError(f"codec {c.name!r} has scaling {c.scaling!r}, which fp8kv.quant handles")  # fp8 codecs


def group_amax(a: torch.Tensor, dim: int) -> torch.Tensor:
    """amax of |a| along ``dim`` (keepdim); 0 for an empty group."""
    if a.shape[dim] == 0 or a.numel() == 0:
        shape = list(a.shape)
        shape[dim] = 1
        return a.new_zeros(shape)
    return a.abs().amax(dim=dim, keepdim=True)


def tensor_scale_for(amax: torch.Tensor, c: Codec) -> torch.Tensor:
    """A two-level codec's fp32 tensor scale from the tensor's amax: ``amax / (448 x element max)``
    (1 for an all-zero tensor), at least :data:`TENSOR_SCALE_MIN`."""
    s = scale_from_stat(amax.reshape(()).to(torch.float32), E4M3_MAX * c.element.max)
    return s.clamp(min=TENSOR_SCALE_MIN)


def amax_scale(stat_src: torch.Tensor, dim: int, c: Codec, given: torch.Tensor | None) -> torch.Tensor:
    """Symmetric: fp32 ``amax / element max`` per group (1 for an all-zero group; deep subnormal
    quotients rounded up, :func:`fp8kv.quant.scale_from_stat`), or the ``given`` scale."""
    if given is not None:
        return given.reshape([1] * stat_src.ndim)
    return scale_from_stat(group_amax(stat_src, dim), c.element.max)


def min_max_scale(lo_src: torch.Tensor, hi_src: torch.Tensor, dim: int, c: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric (KIVI): fp16 ``(scale, zero)`` per group, ``zero = min``, ``scale = (max - min) / levels``.

    ``lo_src`` / ``hi_src``: the values with non-finite ones made neutral (+inf / -inf). Both round to
    nearest fp16 (KIVI computes and stores them in the model's fp16). A group with no range (constant)
    gets scale 1; a range so small that its scale rounds to 0 in fp16 gets fp16's smallest, 2^-24;
    both saturate at ±65504 (values beyond fp16's range then saturate, and are counted).
    """
    if lo_src.shape[dim] == 0 or lo_src.numel() == 0:
        shape = list(lo_src.shape)
        shape[dim] = 1
        one = lo_src.new_ones(shape).to(torch.float16)
        return one, torch.zeros_like(one)
    lo = lo_src.amin(dim=dim, keepdim=True)
    hi = hi_src.amax(dim=dim, keepdim=True)
    empty = lo > hi  # no finite value in the group (only with nonfinite="saturate")
    lo = torch.where(empty, 0.0, lo)
    hi = torch.where(empty, 0.0, hi)
    span = (hi - lo) / (c.element.max - c.element.min)
    scale = span.clamp(max=FP16_MAX).to(torch.float16)
    scale = torch.where(span > 0, scale.clamp(min=FP16_TINY), 1.0).to(torch.float16)
    zero = lo.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
    return scale, zero


def two_level_scale(block_amax: torch.Tensor, c: Codec,
                    tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's block scales: ``(e4m3 block scale, fp32 effective scale)`` per block.

    ``block scale = e4m3(clamp(fp32(block_amax / element max) / tensor_scale, 2^-6, 448))``, rounded to
    nearest even; the values are divided by ``fp32(block scale x tensor_scale)`` (torchao's
    ``total_scale``), which is also what they are multiplied by on the way back.
    """
    per_block = (block_amax / c.element.max) / tensor_scale
    block = per_block.clamp(E4M3_BLOCK_SCALE_MIN, E4M3_MAX).to(E4M3)
    return block, effective_two_level(block, tensor_scale)


def effective_two_level(block: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``block scale x tensor scale``: the factor of a two-level block."""
    return block.to(torch.float32) * tensor_scale.to(torch.float32)


def pow2_scale(block_amax: torch.Tensor, c: Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX: ``(e8m0 scale, fp32 2^e)`` per block with ``e = floor(log2(amax)) - emax_elem``, clamped
    to e8m0's [-127, 127]; an all-zero block gets 2^-127 (any scale decodes its zeros)."""
    exp = floor_log2(block_amax) - c.element.emax
    exp = torch.where(block_amax > 0, exp, E8M0_MIN_EXPONENT).clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)
    code = e8m0_from_exponent(exp)
    return code, e8m0_to_float(code)

