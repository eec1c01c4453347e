"""A plain streaming copy (:func:`stream_copy`, and its kernel): the bandwidth ceiling decode kernels are
measured against.

torch's ``copy_`` reaches only ~65 % of an H200's HBM bandwidth (2.8 of ~4.1 TB/s measured);
this kernel, 32 KiB per program with 16-byte vector accesses, reaches what a streaming kernel can.
"""

import torch
import triton
import triton.language as tl

from .. import checks

__all__ = ["stream_copy", "copy_kernel", "COPY_BLOCK"]


@triton.jit
def copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


COPY_BLOCK = 8192  # elements per program: 32 KiB of fp32, with 16-byte vector accesses


def stream_copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy contiguous ``src`` into ``dst`` (same numel and dtype, one device) with the streaming kernel.

    The bandwidth ceiling decode kernels are measured against (:func:`fp8kv.bench.measure_copy_bandwidth`).
    No host sync: it can be captured in a CUDA graph. Returns ``dst``. Overlapping ``src`` and ``dst`` are
    refused: the kernel's blocks run in any order, so a block could read what another already wrote.
    """
    checks.tensor(src, "src")
    checks.tensor(dst, "dst", dtypes=(src.dtype,), device=src.device)
    if not (src.is_contiguous() and dst.is_contiguous()) or src.numel() != dst.numel():
        checks.fail(f"src and dst must be contiguous with equal numel; got {tuple(src.shape)} "
                    f"(contiguous={src.is_contiguous()}) and {tuple(dst.shape)} (contiguous={dst.is_contiguous()})")
    n = src.numel()
    nbytes = n * src.element_size()
    if n and src.data_ptr() < dst.data_ptr() + nbytes and dst.data_ptr() < src.data_ptr() + nbytes:
        checks.fail("src and dst overlap in memory; copy into a separate tensor")
    copy_kernel[(triton.cdiv(n, COPY_BLOCK),)](src, dst, n, BLOCK=COPY_BLOCK)
    return dst
