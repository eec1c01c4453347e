"""What machine is this: the device, its architecture and the software stack.

Every report names the hardware it was produced on, so each results file carries
:func:`describe_device` and each report folder is named by :func:`gpu_slug`.

``device`` arguments everywhere accept ``None`` or ``"auto"`` (first CUDA device
if there is one, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an ``int``
GPU index or a :class:`torch.device`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

__all__ = [
    "refuse_past_free_memory",
    "resolve_device",
    "describe_device",
    "gpu_slug",
    "current_arch",
    "package_version",
    "source_digest",
    "free_memory_bytes",
    "DOT_TYPES",
    "MATH_PEAK_TFLOPS",
    "math_peak_tflops",
]

DOT_TYPES = ("16-bit", "fp8")  # the operand types of a tensor-core dot: bf16 / fp16, or e4m3 / e5m2
_NAN = float("nan")
# The dense tensor-core peak (TFLOP/s: no 2:4 sparsity, fp32 accumulate) of a GPU per dot type, keyed by a piece of
# the name torch reports ("NVIDIA H100 80GB HBM3"); the longest key in a name wins, so an "H100 PCIe" is not read
# as the SXM part. NVIDIA's H100 whitepaper gives the SXM5 parts' dense figures; its datasheets (H100, H200, A100)
# give the others with sparsity, of which the dense figure is half. NaN: the GPU has no such tensor cores.
MATH_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"16-bit": 989.4, "fp8": 1978.9},  # H100 SXM5 (torch names it "NVIDIA H100 80GB HBM3")
    "H100 PCIe": {"16-bit": 756.5, "fp8": 1513.0},
    "H100 NVL": {"16-bit": 835.5, "fp8": 1670.5},
    "H200": {"16-bit": 989.4, "fp8": 1978.9},  # H200 SXM: the H100 SXM5's tensor cores and clocks (and GH200's)
    "H200 NVL": {"16-bit": 835.5, "fp8": 1670.5},
    "A100": {"16-bit": 312.0, "fp8": _NAN},  # sm80: no FP8 tensor cores
}


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

    Imported lazily: optional packages (flashinfer, vllm) may be absent or fail to import
    (missing CUDA libraries, ABI mismatch), which must not break a device description.
    """
    try:
        module = importlib.import_module(module_name)
    except Exception:  # ImportError, OSError from missing .so, RuntimeError from CUDA init...
        return None
    return str(getattr(module, "__version__", "unknown"))


def source_digest(root: str | Path | None = None) -> str:
    """The first 12 hex digits of a SHA-256 over fp8kv's own files (every ``.py`` and ``data/`` file of the
    package at ``root``, default the one imported, by relative path): which code made a saved number, on a
    machine without the repository's history. Equal digests: the same kernels, launch rules and tables.
    ``published/`` is left out: it writes the README from saved results and makes no number itself, so
    editing it must not mark every rendered page as made by other code."""
    return _package_digest() if root is None else _digest(Path(root))


_NOT_DIGESTED = ("published",)


@functools.lru_cache(maxsize=1)
def _package_digest() -> str:  # once per process: the imported code does not change under it
    return _digest(Path(__file__).resolve().parent)


def _digest(base: Path) -> str:
    h = hashlib.sha256()
    files = sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                   and p.relative_to(base).parts[0] not in _NOT_DIGESTED
                   and (p.suffix == ".py" or p.relative_to(base).parts[0] == "data"))
    for path in files:
        h.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def free_memory_bytes(device: str | int | torch.device | None = None) -> int | None:
    """Memory a new allocation on ``device`` can take: a GPU's free memory (``cudaMemGetInfo``), or the
    host's available memory (MemAvailable: free plus reclaimable caches; the free pages where that is
    unknown). None where neither can be read."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def refuse_past_free_memory(nbytes: int, device, what: str) -> None:
    """A ValueError naming ``what`` (the request, by its arguments) and the bytes it needs where they pass the
    memory free on ``device`` (:func:`free_memory_bytes`): said before allocating, not by the allocator's
    RuntimeError or MemoryError. Nothing is refused where the free memory cannot be read."""
    free = free_memory_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {nbytes:,} bytes ({nbytes / 2**30:.4g} GiB), more than the "
                         f"{free / 2**30:.4g} GiB free on {device}; ask for fewer tokens")


def math_peak_tflops(gpu: str | None, dot: str) -> float:
    """The dense tensor-core peak, TFLOP/s, of the GPU named ``gpu`` (as :func:`describe_device` names it: "NVIDIA
    H200") for a ``dot`` of :data:`DOT_TYPES` (``"16-bit"``: bf16 / fp16 operands; ``"fp8"``: e4m3 / e5m2), from
    :data:`MATH_PEAK_TFLOPS` (case ignored; the longest key found in the name). NaN on a CPU (``gpu`` ``"cpu"``
    or None), on a GPU the table does not hold, and where the GPU has no tensor cores of that type.

    ``gpu`` not a str (or None) is a TypeError naming it; ``dot`` not one of :data:`DOT_TYPES` a ValueError."""
    if gpu is not None and not isinstance(gpu, str):
        raise TypeError(f"gpu={gpu!r} ({type(gpu).__name__}); expected a GPU's name such as 'NVIDIA H100 80GB HBM3', "
                        "'cpu' or None")
    if not isinstance(dot, str) or dot not in DOT_TYPES:
        raise ValueError(f"dot={dot!r}; expected one of {DOT_TYPES}")
    name = (gpu or "").lower()
    keys = [k for k in MATH_PEAK_TFLOPS if k.lower() in name]
    return MATH_PEAK_TFLOPS[max(keys, key=len)][dot] if keys and name != "cpu" else _NAN


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
        ``python``, ``torch``, ``triton``, ``flashinfer``, ``vllm`` (the package providing vLLM's
        kernel: a vLLM install or a shim), ``numpy`` (None when not importable), and ``fp8kv_source``
        (:func:`source_digest`: which fp8kv code ran).
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
        "vllm": package_version("vllm"),
        "numpy": package_version("numpy"),
        "fp8kv_source": source_digest(),
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
