"""The bandwidth ceiling decode kernels are drawn against: one large device-to-device copy, timed
in the same run as the kernels it judges (:func:`measure_copy_bandwidth`)."""

from __future__ import annotations

import statistics
import time

import torch

from .. import checks
from ..device import resolve_device
from ..ops import stream_copy

__all__ = ["measure_copy_bandwidth"]


def measure_copy_bandwidth(
    nbytes: int | None = None,
    device: str | int | torch.device | None = None,
    *,
    repeats: int = 20,
) -> dict:
    """Achieved memory bandwidth of one large device-to-device copy.

    Bytes moved count both directions: ``2 * nbytes`` (read ``src`` + write ``dst``), the
    same accounting decode kernels use for bytes read, so this is the practical ceiling
    their GB/s are drawn against.

    On CUDA the copy is a streaming Triton kernel (:func:`fp8kv.ops.stream_copy`; torch's own
    ``copy_`` reaches only ~65 % of an H200's bandwidth), timed with
    ``triton.testing.do_bench_cudagraph`` (captured into a CUDA graph, so launch overhead is
    excluded); the median is reported.
    On CPU a copy is timed with :func:`time.perf_counter` (median of ``repeats``); that
    number says nothing about any GPU and is flagged ``meaningful_for_gpu=False``.

    Parameters
    ----------
    nbytes : int, optional
        Size of each of the two buffers. Default: 1 GiB on a GPU (far larger than any L2,
        capped at 1/8 of free memory), 16 MiB on CPU.
    device : see module docstring.
    repeats : int
        CPU only: number of timed copies.

    Returns
    -------
    dict
        ``device``, ``nbytes``, ``bytes_moved``, ``time_ms`` (median per copy), ``gbps``
        (``bytes_moved / time / 1e9``), ``method`` ("cuda_graph" / "perf_counter"),
        ``meaningful_for_gpu`` (bool).
    """
    dev = resolve_device(device)
    if nbytes is not None:
        checks.positive_int(nbytes, "nbytes")
    checks.positive_int(repeats, "repeats")

    if dev.type == "cuda":
        if nbytes is None:
            free, _ = torch.cuda.mem_get_info(dev)
            nbytes = min(2**30, free // 8)
        src = torch.randn(nbytes // 4, dtype=torch.float32, device=dev)
        nbytes = src.numel() * 4
        dst = torch.empty_like(src)
        from triton.testing import do_bench_cudagraph

        with torch.cuda.device(dev):
            time_ms = float(do_bench_cudagraph(lambda: stream_copy(src, dst), return_mode="median"))
        if not torch.equal(dst[:4096], src[:4096]):  # the timed op really copied
            raise RuntimeError("copy bandwidth measurement: destination does not match source")
        method, meaningful = "cuda_graph", True
        del src, dst
    else:
        if nbytes is None:
            nbytes = 16 * 2**20
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: page in dst
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        time_ms = statistics.median(times) * 1e3
        method, meaningful = "perf_counter", False

    bytes_moved = 2 * nbytes
    return {
        "device": str(dev),
        "nbytes": nbytes,
        "bytes_moved": bytes_moved,
        "time_ms": time_ms,
        "gbps": bytes_moved / (time_ms * 1e-3) / 1e9,
        "method": method,
        "meaningful_for_gpu": meaningful,
    }
