"""fp8kv.device: device resolution, description, slug and arch.

The CUDA code paths are exercised on CPU machines through a fake ``torch.cuda`` (monkeypatched
properties of an H200).
"""

import os
import platform
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from fp8kv import device as D

H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=143771 * 2**20,
                             multi_processor_count=132, gcnArchName="")


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend one CUDA device is present, with the given properties (default: an H200)."""

    def install(props=H200, count=1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: props)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(D, "_nvidia_driver_version", lambda: "570.86.15")
        return props

    return install


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# --------------------------------------------------------------------------- resolve_device


@pytest.mark.parametrize("arg", [None, "auto", "AUTO", "cpu", torch.device("cpu")])
def test_resolve_device_cpu(no_gpu, arg):
    assert D.resolve_device(arg) == torch.device("cpu")


def test_resolve_device_auto_prefers_cuda(fake_gpu):
    fake_gpu()
    assert D.resolve_device("auto") == torch.device("cuda", 0)
    assert D.resolve_device("cuda") == torch.device("cuda", 0)
    assert D.resolve_device(0) == torch.device("cuda", 0)


def test_resolve_device_cuda_index_out_of_range(fake_gpu):
    fake_gpu(count=1)
    with pytest.raises(ValueError, match="index 3 out of range"):
        D.resolve_device("cuda:3")


def test_resolve_device_cuda_without_gpu(no_gpu):
    with pytest.raises(ValueError, match="no CUDA device"):
        D.resolve_device("cuda")


@pytest.mark.parametrize("arg", ["gpu0", "meta", "mps"])
def test_resolve_device_rejects_other_devices(arg):
    with pytest.raises(ValueError, match=re.escape(repr(arg))):
        D.resolve_device(arg)


@pytest.mark.parametrize("arg", [1.5, True, ["cpu"]])
def test_resolve_device_rejects_types(arg):
    with pytest.raises(TypeError, match="device must be"):
        D.resolve_device(arg)


# --------------------------------------------------------------------------- package_version


def test_package_version_missing_module_is_none():
    assert D.package_version("fp8kv_no_such_module_xyz") is None


def test_package_version_broken_import_is_none(tmp_path, monkeypatch):
    # An installed package whose import fails (missing CUDA library, ABI mismatch) must not raise.
    (tmp_path / "fp8kv_broken_pkg.py").write_text("raise OSError('libcuda.so.1: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert D.package_version("fp8kv_broken_pkg") is None


def test_package_version_reads_dunder_version(tmp_path, monkeypatch):
    (tmp_path / "fp8kv_versioned_pkg.py").write_text("__version__ = '1.2.3'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert D.package_version("fp8kv_versioned_pkg") == "1.2.3"
    sys.modules.pop("fp8kv_versioned_pkg", None)


# --------------------------------------------------------------------------- describe / slug / arch


def test_describe_device_cpu(no_gpu):
    info = D.describe_device()
    assert info["type"] == "cpu" and info["name"] == "cpu" and info["slug"] == "cpu"
    assert info["arch"] is None and info["memory_gib"] is None and info["multiprocessors"] is None
    assert info["python"] == platform.python_version()
    assert info["torch"] == torch.__version__
    assert info["triton"] == D.package_version("triton")
    assert info["flashinfer"] == D.package_version("flashinfer")
    assert info["fp8kv_source"] == D.source_digest() and re.fullmatch(r"[0-9a-f]{12}", info["fp8kv_source"])


def test_source_digest_names_the_code_that_ran(tmp_path):
    """Two copies of the package agree; a changed kernel or launch table changes the digest, a cache file does not."""
    import shutil

    import fp8kv

    pkg = Path(fp8kv.__file__).parent
    a, b = tmp_path / "a", tmp_path / "b"
    for copy in (a, b):
        shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert D.source_digest(a) == D.source_digest(b) == D.source_digest(pkg) == D.source_digest()
    (b / "__pycache__").mkdir(exist_ok=True)
    (b / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert D.source_digest(b) == D.source_digest(a)
    kernel = b / "ops" / "decode" / "triton_kernel.py"
    kernel.write_text(kernel.read_text() + "\n")
    assert D.source_digest(b) != D.source_digest(str(a))
    readme_writer = a / "published" / "readme.py"
    readme_writer.write_text(readme_writer.read_text() + "\n")
    assert D.source_digest(a) == D.source_digest(pkg)  # the README writer makes no number
    table = a / "data" / "launch_nvidia-h200.json"
    table.write_text(table.read_text() + " ")
    assert D.source_digest(a) != D.source_digest(pkg)


def test_describe_device_gpu(fake_gpu):
    props = fake_gpu()
    info = D.describe_device("cuda")
    assert info["device"] == "cuda:0" and info["type"] == "cuda"
    assert info["name"] == props.name
    assert info["slug"] == "nvidia-h200"
    assert info["arch"] == "sm90" and info["compute_capability"] == "9.0"
    assert info["memory_gib"] == pytest.approx(props.total_memory / 2**30, abs=0.01)
    assert info["multiprocessors"] == props.multi_processor_count
    assert info["driver_version"] == "570.86.15"


def test_describe_device_flashinfer_import_failure_is_none(no_gpu, monkeypatch):
    real = D.importlib.import_module

    def fake_import(name, *a, **k):
        if name == "flashinfer":
            raise RuntimeError("flashinfer: CUDA driver too old")
        return real(name, *a, **k)

    monkeypatch.setattr(D.importlib, "import_module", fake_import)
    assert D.describe_device("cpu")["flashinfer"] is None


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "nvidia-h200"),
    ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA A100-SXM4-40GB", "nvidia-a100-sxm4-40gb"),
    ("  NVIDIA RTX PRO 6000 Blackwell (Server)  ", "nvidia-rtx-pro-6000-blackwell-server"),
])
def test_gpu_slug(fake_gpu, name, slug):
    fake_gpu(types.SimpleNamespace(**{**vars(H200), "name": name}))
    got = D.gpu_slug()
    assert got == slug
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", got)


def test_gpu_slug_cpu(no_gpu):
    assert D.gpu_slug() == "cpu"
    assert D.gpu_slug("cpu") == "cpu"


@pytest.mark.parametrize("major, minor", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_current_arch(fake_gpu, major, minor):
    fake_gpu(types.SimpleNamespace(**{**vars(H200), "major": major, "minor": minor}))
    assert D.current_arch() == f"sm{major}{minor}"


def test_current_arch_rocm_uses_gfx_name(fake_gpu, monkeypatch):
    fake_gpu(types.SimpleNamespace(**{**vars(H200), "name": "AMD Instinct MI300X", "major": 9, "minor": 4,
                                      "gcnArchName": "gfx942:sramecc+:xnack-"}))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert D.current_arch() == "gfx942"


def test_current_arch_cpu(no_gpu):
    assert D.current_arch() is None


def test_free_memory_bytes_of_the_host(no_gpu):
    free = D.free_memory_bytes("cpu")
    assert free is None or 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- the dense tensor-core peaks
@pytest.mark.parametrize("name,bf16,fp8", [
    ("NVIDIA H100 80GB HBM3", 989.4, 1978.9),  # the SXM part: torch's name says neither SXM nor PCIe
    ("NVIDIA H200", 989.4, 1978.9),
    ("NVIDIA H100 PCIe", 756.5, 1513.0),  # the longest key wins: not the SXM part's "H100"
    ("nvidia h200 nvl", 835.5, 1670.5),  # case ignored
])
def test_the_math_peak_of_a_known_gpu(name, bf16, fp8):
    assert D.math_peak_tflops(name, "16-bit") == bf16 and D.math_peak_tflops(name, "fp8") == fp8


def test_the_math_peak_is_nan_on_a_cpu_an_unknown_gpu_and_a_dot_the_gpu_lacks(no_gpu):
    import math

    for name in (D.describe_device("cpu")["name"], None, "NVIDIA GeForce RTX 4090", "NVIDIA H20"):
        assert math.isnan(D.math_peak_tflops(name, "16-bit")) and math.isnan(D.math_peak_tflops(name, "fp8")), name
    assert D.math_peak_tflops("NVIDIA A100-SXM4-80GB", "16-bit") == 312.0
    assert math.isnan(D.math_peak_tflops("NVIDIA A100-SXM4-80GB", "fp8"))  # sm80 has no FP8 tensor cores


@pytest.mark.parametrize("gpu,dot,exc,pattern", [
    ("NVIDIA H200", "bf16", ValueError, r"dot='bf16'; expected one of \('16-bit', 'fp8'\)"),
    ("NVIDIA H200", None, ValueError, "dot=None"),
    (90, "fp8", TypeError, r"gpu=90 \(int\); expected a GPU's name"),
])
def test_the_math_peak_refuses_bad_arguments_by_name(gpu, dot, exc, pattern):
    with pytest.raises(exc, match=pattern):
        D.math_peak_tflops(gpu, dot)
