"""What reads the KV storage formats of :mod:`fp8kv.kv_formats` (INT8, INT4, KIVI, NVFP4, MXFP4, block-scaled
e4m3) where: format x backend x arch -> supported, with the reason, in :func:`fp8kv.capability.capability`'s
columns (arch, backend, kv_dtype, mode, supported, granularities, reason), so that
``pd.concat([capability(arch), format_capability(arch)])`` is one table.

The backends are :data:`fp8kv.capability.BACKEND_NAMES`: ``triton`` is fp8kv's kernel over quantized pages
(:func:`fp8kv.ops.quant_decode.paged_decode_quantized`), ``reference`` the fp32 oracle. The facts, each with its
source:

* fp8kv's quantized-page kernel reads :data:`TRITON_FORMATS` (INT8 and INT4 per token and head, NVFP4, MXFP4) on
  sm80 and newer: codes and their scales are loaded as integers and dequantized in registers (e4m3 / e8m0 scales
  decoded from their bits, so no FP8 conversion instruction is needed), the dots in fp16. On CPU it runs under the
  Triton interpreter. On sm89 and newer INT8 and INT4 per token and head (INT4 at head dims that are multiples of
  32) run by default in the FP8 decode's Gluon kernel where its splits are long (:func:`fp8kv.ops.quant_decode.paged_decode_quantized`'s ``gluon``). The other
  token-local formats (e4m3_b16, MXFP8) have a paged cache but no kernel yet.
* KIVI's keys share a scale and zero point over a group of tokens and its values carry zero points: no paged cache
  holds it (:data:`fp8kv.kv_formats.PAGED_FORMATS`), so no kernel here reads it; the reference does, dense.
* FlashInfer reads NVFP4 pages (e2m1 codes with their e4m3 block scales, ``kv_cache_sf``) in its TRT-LLM-generated
  decode (``trtllm_batch_decode_with_kv_cache``), built for sm100 (it takes an FP8 query there); its FA2 decode
  reads 16-bit and FP8 pages only. fp8kv's FlashInfer backend does not pass NVFP4 pages yet: the row says where the
  peer reads the format, and the bench has no FlashInfer NVFP4 rows.
* vLLM's Triton unified-attention kernel reads INT8 pages with a scale per token and head
  (``kv_quant_mode`` INT8 per token-head, ``k_scale_cache`` / ``v_scale_cache``), on sm80 and newer; no 4-bit
  format. fp8kv's vLLM backend passes FP8 per-tensor only, so no bench rows for it either.
* The fp8_* formats are fp8kv.quant's FP8 caches: :func:`fp8kv.capability.capability`'s rows (kv_dtype fp8_e4m3 /
  fp8_e5m2 with their granularities) answer for them, and they are not repeated here (:data:`FORMAT_NAMES`).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import checks
from .capability import BACKEND_NAMES, FP8_MODE_NEEDS_FP8, MODES, arch_number, current_arch, interpreter_on
from .formats import is_fp8
from .kv_formats import KV_FORMATS, PAGED_FORMATS, kv_format

__all__ = ["FORMAT_NAMES", "TRITON_FORMATS", "FLASHINFER_FORMATS", "VLLM_FORMATS", "FORMAT_MODE", "check_format",
           "format_capability", "mode_refusal"]

# The formats beside FP8 (the fp8_* formats are the FP8 cache's, in fp8kv.capability's own rows).
FORMAT_NAMES: tuple[str, ...] = tuple(name for name, f in KV_FORMATS.items() if f.key.rule != "fp8")
# What fp8kv's quantized-page kernel reads (fp8kv.ops.quant_decode.QUANT_DECODE_FORMATS holds the same names).
TRITON_FORMATS = ("int8_token_head", "int4_token_head", "nvfp4", "mxfp4")
FLASHINFER_FORMATS = {"nvfp4": 100}  # format -> the one arch number FlashInfer reads it on
VLLM_FORMATS = ("int8_token_head",)
FORMAT_MODE = "dequant"  # codes are dequantized to 16 bits in registers: no low-precision arithmetic mode


def _arch_number(arch: str) -> int:
    try:
        return arch_number(arch)
    except ValueError as e:
        checks.fail(f"{e}, or None for this machine")


def _not_paged(name: str) -> str:
    return (f"{name} has no paged cache (its scales span tokens or the whole tensor; paged formats: "
            f"{PAGED_FORMATS}), so no kernel here reads it")


def _facts(backend: str, name: str, n: int) -> tuple[bool, str]:
    """Support of format ``name`` by ``backend`` on arch number ``n``, by library and hardware facts alone."""
    if backend == "reference":
        return True, "fp32 oracle: kv_formats.dequantize, then fp8kv.reference.attention"
    if n < 80:
        return False, f"sm{n} predates sm80; fp8kv targets sm80 and newer"
    if backend == "triton":
        if name in TRITON_FORMATS:
            why = ("fp8kv's quantized-page kernel: codes and scales loaded as integers, dequantized in registers, "
                   "fp16 dots (no FP8 conversion instruction needed)")
            if name in ("int8_token_head", "int4_token_head") and n >= 89:  # gluon_scope.GLUON_QUANTIZED_FORMATS
                why += ("; by default the FP8 decode's Gluon kernel where its splits are long (codes turned to fp16 by "
                        "their bits, the scales as FP8's per-token ones" + (", at head dims that are multiples of 32"
                                                                            if name == "int4_token_head" else "")
                        + "; gluon=False keeps this kernel)")
            return True, why
        if name not in PAGED_FORMATS:
            return False, _not_paged(name)
        return False, f"{name} has a paged cache but no decode kernel yet (the kernel reads {TRITON_FORMATS})"
    if backend == "flashinfer":
        if name in FLASHINFER_FORMATS:
            if n != FLASHINFER_FORMATS[name]:
                return False, (f"FlashInfer reads {name} pages only in its TRT-LLM-generated decode, built for "
                               f"sm{FLASHINFER_FORMATS[name]}; its FA2 decode reads 16-bit and FP8 pages")
            return True, ("FlashInfer's TRT-LLM-generated decode (trtllm_batch_decode_with_kv_cache) reads NVFP4 "
                          "pages and their e4m3 block scales (kv_cache_sf), FP8 query; not wired in fp8kv's "
                          "FlashInfer backend (no bench rows)")
        return False, f"FlashInfer has no {name} KV cache (it reads 16-bit, FP8, and NVFP4 on sm100)"
    if name in VLLM_FORMATS:
        return True, ("vLLM's Triton unified-attention kernel reads INT8 pages with a scale per token and head "
                      "(k_scale_cache / v_scale_cache); not wired in fp8kv's vLLM backend (no bench rows)")
    return False, f"vLLM's Triton kernel has no {name} KV cache (it reads 16-bit, FP8 and INT8 per token-head)"


def check_format(backend: str, fmt: str, arch: str | None = None) -> tuple[bool, str]:
    """Whether ``backend`` (:data:`fp8kv.capability.BACKEND_NAMES`) reads KV format ``fmt`` (a name of
    :data:`FORMAT_NAMES`) in decode, and why (not).

    ``arch=None`` asks about this machine: its GPU, or on CPU the reference, and fp8kv's kernel where the Triton
    interpreter is on (FlashInfer and vLLM's kernels need a GPU for these formats). An explicit ``arch``
    ("sm90") asks about that arch. A backend, format or arch outside its set is a ValueError naming it.
    """
    checks.one_of(backend, "backend", BACKEND_NAMES)
    name = kv_format(fmt).name
    if name not in FORMAT_NAMES:
        checks.fail(f"fmt={fmt!r} is an FP8 format: fp8kv.capability.check answers for it (kv_dtype "
                    f"{name[:8]!r} with its granularity); expected one of {FORMAT_NAMES}")
    if arch is not None:
        return _facts(backend, name, _arch_number(arch))
    here = current_arch()
    if here is not None:
        return _facts(backend, name, _arch_number(here))
    if backend == "reference":
        return _facts(backend, name, 90)
    ok, why = _facts(backend, name, 90)
    if not ok or backend != "triton":
        return False, f"no GPU: {why if not ok else backend + ' reads ' + name + ' on CUDA GPUs only'}"
    if not interpreter_on():
        return False, "no GPU: Triton kernels run on CPU only under TRITON_INTERPRET=1"
    return True, "CPU: fp8kv's quantized-page kernel under the Triton interpreter (TRITON_INTERPRET=1), correctness only"


def mode_refusal(kv_dtype: str, mode: str) -> str | None:
    """Why a cache of ``kv_dtype`` (an element type of :data:`fp8kv.formats.KV_DTYPE_NAMES` or a format of
    :data:`FORMAT_NAMES`) has no ``mode`` (one of :data:`fp8kv.capability.MODES`), or None where it has: fp8 mode
    reads FP8 pages only, and a quantized format runs in :data:`FORMAT_MODE` only."""
    checks.one_of(mode, "mode", MODES)
    if kv_dtype in FORMAT_NAMES:
        return None if mode == FORMAT_MODE else (f"{kv_dtype} is a quantized format: its codes are dequantized to "
                                                 f"16 bits in registers, so it runs in {FORMAT_MODE} mode only")
    return FP8_MODE_NEEDS_FP8 if mode == "fp8" and not is_fp8(kv_dtype) else None


def format_capability(arch: str | Sequence[str] | None = None, formats: Sequence[str] | None = None):
    """Table of backend x KV format for ``arch`` (this machine when None; a list of archs: their tables one after
    another), in :func:`fp8kv.capability.capability`'s columns: arch, backend, kv_dtype (the format), mode
    (``"dequant"``: codes become 16-bit values in registers), supported, granularities (``""``: the format names
    its scales) and reason. ``formats`` defaults to :data:`FORMAT_NAMES`."""
    import pandas as pd

    if isinstance(arch, (list, tuple)):
        if not arch:
            checks.fail("arch=[]: give one arch such as 'sm90', a list of them, or None for this machine")
        return pd.concat([format_capability(a, formats) for a in arch], ignore_index=True)
    names = FORMAT_NAMES if formats is None else checks.many_of(formats, "formats", FORMAT_NAMES)
    label = arch or current_arch() or "cpu"
    rows = [dict(arch=label, backend=b, kv_dtype=f, mode=FORMAT_MODE, supported=ok, granularities="", reason=why)
            for b in BACKEND_NAMES for f in names for ok, why in [check_format(b, f, arch)]]
    return pd.DataFrame(rows)
