"""The split-KV combine: the partials' buffers, the kernel that merges them (flash-decoding's reduction), and
its launch, as a programmatic dependent of the decode where that lets it start early (:func:`combine_as_dependent`).
Every decode kernel of more than one split writes its partials here."""

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ...capability import current_arch, interpreter_on
from . import splits
from .triton_helpers import LN2

__all__ = ["combine_splits_kernel", "split_partials", "combine_splits", "combine_as_dependent", "pdl_capable",
           "COMBINE_PDL", "MAX_PARTIAL_ELEMENTS"]

# The split partials ([rows, Hq, splits, D] fp32) are addressed with 32-bit offsets in the kernels and the combine.
MAX_PARTIAL_ELEMENTS = 2**31 - 1


@triton.jit
def combine_splits_kernel(
    part_out_ptr,  # [B, Hq, num_splits, D] fp32 normalised partial outputs
    part_lse_ptr,  # [B, Hq, num_splits] fp32 partial log2-sum-exp (-inf for empty splits)
    out_ptr,  # [B, Hq, D] output (query dtype or fp32)
    lse_ptr,  # [B, Hq] fp32 natural-log LSE
    stride_pb, stride_ph, stride_ps,  # partial-output strides: batch, head, split
    stride_qb_lse, stride_qh_lse,  # partial-LSE strides: batch, head (split stride is 1)
    stride_ob, stride_oh,
    stride_lb, stride_lh,
    num_splits,
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 sink logits (natural log)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits padded to a power of two
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the decode (sm90+)
):
    """out = Σ_s w_s out_s / Σ_s w_s with w_s = 2^(lse_s - max lse): the flash-decoding reduction.

    A sink is one more term of the denominator with no output: ``2^(sink·log2 e - max)``. With PDL the
    programs may start before the decode has finished: they wait for its partials first.
    """
    if PDL:
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    lse = tl.load(part_lse_ptr + b * stride_qb_lse + h * stride_qh_lse + offs_s,
                  mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * (1.0 / LN2)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)
    den = tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.math.exp2(sink - m_safe)
    parts = tl.load(part_out_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    den_safe = tl.where(den > 0, den, 1.0)
    out = tl.sum(parts * w[:, None], axis=0) / den_safe
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    lse_out = tl.where(den > 0, (m_safe + tl.math.log2(den_safe)) * LN2, float("-inf"))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse_out)


# Programmatic dependent launch (sm90+, the Triton tensor-core kernel): where the decode's programs leave at
# least half the SMs free, each lets the split combine launch as it starts, and the combine's programs wait on
# the free SMs for the partials, so no launch gap separates the two. H200, FP8, B 1-4 x 1000-4096 tokens
# (scripts/pdl_probe.py, results/bench/nvidia-h200/20261204T145216Z-pdl.csv): faster at all 12 such points,
# by 0.05-0.89 us (32/8/128, 1 x 1000: 7.40 against 8.19 us; 14/2/64, 1 x 4k: 5.97 against 6.71). With 128
# programs it was level or slower (28/4/128, 1 x 4k: 9.64 against 9.37 us), with more up to 2.4 us slower
# (32/8/128, 4 x 4k: 20.31 against 18.43 us), and a dependent launch without the early start was slower than
# a plain one at 26 of 29 points (median +0.22-0.25 us): those launches stay plain. False: plain everywhere.
COMBINE_PDL = True


@functools.cache
def pdl_capable(device: torch.device) -> bool:
    """Whether ``device`` takes programmatic dependent launches: an sm90+ CUDA GPU, not the interpreter."""
    if device.type != "cuda" or interpreter_on():
        return False
    arch = current_arch(device) or ""
    return arch.startswith("sm") and int(arch[2:]) >= 90


def combine_as_dependent(programs: int, device: torch.device) -> bool:
    """Whether a split decode of ``programs`` programs launches its combine as a programmatic dependent:
    :data:`COMBINE_PDL`, a device that takes it, and programs that leave at least half its SMs free."""
    return COMBINE_PDL and pdl_capable(device) and programs <= splits.sm_count(device) // 2


def split_partials(b: int, hq: int, splits: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs ``[B, Hq, splits, D]`` and log2-LSEs ``[B, Hq, splits]`` of a split decode."""
    return (torch.empty(b, hq, splits, d, dtype=torch.float32, device=device),
            torch.empty(b, hq, splits, dtype=torch.float32, device=device))


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    sinks: torch.Tensor | None = None, dependent: bool = False) -> None:
    """Merge a split decode's partials into ``out`` and ``lse`` (:func:`combine_splits_kernel`), with
    the sinks' term in the denominator when given; ``dependent``: launched as a programmatic dependent of
    the decode, which let it start early (:func:`combine_as_dependent`)."""
    b, hq, splits, d = part_out.shape
    pdl = dict(PDL=True, launch_pdl=True) if dependent else {}
    combine_splits_kernel[(b, hq)](
        part_out, part_lse, out, lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), splits,
        sinks if sinks is not None else lse,
        HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), SPLITS_PAD=triton.next_power_of_2(splits),
        HAS_SINKS=sinks is not None, num_warps=4, **pdl)
