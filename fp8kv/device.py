"""What machine is this: the device, its architecture, the software stack, and a copy-bandwidth ceiling.

Every report names the hardware it was produced on, so each results file carries
:func:`describe_device` and each report folder is named by :func:`gpu_slug`.
:func:`measure_copy_bandwidth` gives the practical memory-bandwidth ceiling
(a large device-to-device copy) that decode-kernel bandwidth is compared against.

``device`` arguments everywhere accept ``None`` or ``"auto"`` (first CUDA device
if there is one, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an ``int``
GPU index or a :class:`torch.device`.
"""

from __future__ import annotations

import importlib
import platform
import re
import statistics
import subprocess
import time

import torch

__all__ = [
    "resolve_device",
    "describe_device",
    "gpu_slug",
    "current_arch",
    "measure_copy_bandwidth",
    "package_version",
]


def resolve_device(device: str | int | torch.device | None = None) -> torch.device:
    """Normalise a device argument to a :class:`torch.device`.

    Parameters
    ----------
    device : None, "auto", "cpu", "cuda", "cuda:N", int or torch.device
        ``None``/``"auto"`` picks ``cuda:<current>`` when CUDA is available, else ``cpu``.

    Raises
    ------
    ValueError
        For an unparsable device string, a device type other than cpu/cuda, or a CUDA
        device that is not available here.
    TypeError
        For any other argument type.
    """
    if device is None or (isinstance(device, str) and device.lower() == "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device must be None, 'auto', a device string, an int or a torch.device; "
            f"got {type(device).__name__} {device!r}"
        )
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device={device!r} is not a device; expected 'auto', 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} has type {dev.type!r}; expected 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} asks for CUDA but no CUDA device is available here")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}: index {index} out of range, {torch.cuda.device_count()} CUDA device(s)"
            )
        dev = torch.device("cuda", index)
    return dev


def package_version(module_name: str) -> str | None:
    """``module.__version__`` of an importable package, or ``None`` if importing it fails.

    Imported lazily: optional packages (flashinfer) may be absent or fail to import
    (missing CUDA libraries, ABI mismatch), which must not break a device description.
    """
    try:
        module = importlib.import_module(module_name)
    except Exception:  # ImportError, OSError from missing .so, RuntimeError from CUDA init...
        return None
    return str(getattr(module, "__version__", "unknown"))


def _arch_string(props) -> str:
    """``"sm90"`` for NVIDIA; the gfx name (``"gfx942"``) for ROCm, whose capability numbers are not SM archs."""
    if torch.version.hip:
        return str(getattr(props, "gcnArchName", f"gfx{props.major}{props.minor}")).split(":")[0]
    return f"sm{props.major}{props.minor}"


def current_arch(device: str | int | torch.device | None = None) -> str | None:
    """Architecture string of a GPU (``"sm80"``, ``"sm90"``, ``"sm100"``, ``"sm120"``...), ``None`` on CPU."""
    dev = resolve_device(device)
    if dev.type != "cuda":
        return None
    return _arch_string(torch.cuda.get_device_properties(dev))


def _nvidia_driver_version() -> str | None:
    """Kernel-driver version string (``"550.54.15"``) from NVML or nvidia-smi, ``None`` if neither answers."""
    try:
        import pynvml  # optional; shipped as nvidia-ml-py

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        pass
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0].strip() or None
    except Exception:
        return None


def describe_device(device: str | int | torch.device | None = None) -> dict:
    """Describe the device and software stack as a flat, JSON-ready dict.

    Returns
    -------
    dict with keys
        ``device`` ("cuda:0" / "cpu"), ``type`` ("cuda" / "cpu"), ``name`` (GPU name or "cpu"),
        ``slug`` (:func:`gpu_slug`), ``arch`` ("sm90"-style or None), ``compute_capability``
        ("9.0" or None), ``memory_gib`` (total device memory, None on CPU),
        ``multiprocessors`` (SM count, None on CPU), ``driver_version`` (kernel driver, None if
        unknown), ``cuda_version`` (CUDA runtime torch was built with, None on CPU builds),
        ``hip_version``, ``cpu`` (processor description), ``platform``, and the versions of
        ``python``, ``torch``, ``triton``, ``flashinfer``, ``numpy`` (None when not importable).
    """
    dev = resolve_device(device)
    info: dict = {
        "device": str(dev),
        "type": dev.type,
        "name": "cpu",
        "slug": "cpu",
        "arch": None,
        "compute_capability": None,
        "memory_gib": None,
        "multiprocessors": None,
        "driver_version": None,
        "cuda_version": torch.version.cuda,
        "hip_version": torch.version.hip,
        "cpu": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "flashinfer": package_version("flashinfer"),
        "numpy": package_version("numpy"),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(
            name=props.name,
            slug=_slugify(props.name),
            arch=_arch_string(props),
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 2),
            multiprocessors=props.multi_processor_count,
            driver_version=None if torch.version.hip else _nvidia_driver_version(),
        )
    return info


def _slugify(name: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "unknown-gpu"


def gpu_slug(device: str | int | torch.device | None = None) -> str:
    """Folder-safe name of the device: ``"nvidia-h200"``, ``"nvidia-geforce-rtx-4090"``, ``"cpu"``.

    Lowercase, only ``[a-z0-9-]``; derived from the GPU's marketing name so two machines
    with the same GPU model share a report folder.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        return "cpu"
    return _slugify(torch.cuda.get_device_properties(dev).name)


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
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0):
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")

    if dev.type == "cuda":
        if nbytes is None:
            free, _ = torch.cuda.mem_get_info(dev)
            nbytes = min(2**30, free // 8)
        src = torch.randn(nbytes // 4, dtype=torch.float32, device=dev)
        nbytes = src.numel() * 4
        dst = torch.empty_like(src)
        from triton.testing import do_bench_cudagraph  # lazy: triton is only needed on a GPU path

        from .ops import stream_copy  # lazy: the launchers import triton and the kernels

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
