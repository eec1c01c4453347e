"""What reads the KV storage formats of :mod:`fp8kv.kv_formats` (INT8, INT4, KIVI, NVFP4, MXFP4, block-scaled
e4m3) where: format x backend x arch -> supported, with the reason, in :func:`fp8kv.capability.capability`'s
columns (arch, backend, kv_dtype, mode, supported, granularities, reason) and two more that say what
"supported" is made of (:data:`FACT_COLUMNS`): ``kernel_reads``, whether the backend's kernel reads the format's
pages on that arch (by its library's source and the hardware), and ``fp8kv_passes``, whether fp8kv hands those
pages to that kernel. ``supported`` is both: fp8kv runs the format on that backend, as in ``capability()``'s rows,
so ``pd.concat([capability(arch), format_capability(arch)])`` is one table (its 16-bit and FP8 rows without the
two fact columns).

The backends are :data:`fp8kv.capability.BACKEND_NAMES`: ``triton`` is fp8kv's kernel over quantized pages
(:func:`fp8kv.ops.quant_decode.paged_decode_quantized`), ``reference`` the fp32 oracle
(:func:`fp8kv.ops.quant_decode.quantized_reference` over pages, ``kv_formats.dequantize`` dense). The facts, each
with its source:

* fp8kv's quantized-page kernel reads :data:`TRITON_FORMATS` (INT8 and INT4 per token and head, NVFP4, MXFP4; the
  names of ``fp8kv.ops.quant_decode.QUANT_DECODE_FORMATS``) on sm80 and newer: codes and their scales are loaded as
  integers and dequantized in registers (e4m3 / e8m0 scales decoded from their bits, so no FP8 conversion
  instruction is needed), the dots in fp16. On CPU it runs under the Triton interpreter. On sm89 and newer
  :data:`GLUON_FORMATS` (``fp8kv.ops.decode.gluon_scope.GLUON_QUANTIZED_FORMATS``; INT4, whose codes are two a
  byte, at head dims that are multiples of :data:`GLUON_PACKED_HEAD_DIM`) run by default in the FP8 decode's Gluon
  kernel where its splits are long (:func:`fp8kv.ops.quant_decode.paged_decode_quantized`'s ``gluon``). The other
  token-local formats (e4m3_b16, MXFP8) have a paged cache but no kernel yet.
* KIVI's keys share a scale and zero point over a group of tokens and its values carry zero points: it is not paged
  token by token (:data:`fp8kv.kv_formats.PAGED_FORMATS`) but by :class:`fp8kv.cache.KIVIPagedKVCache` (whole key
  groups a page, the unfilled one in a residual), which no kernel here reads yet; the reference does.
* FlashInfer reads NVFP4 pages (e2m1 codes with their e4m3 block scales, ``kv_cache_sf``) in its TRT-LLM-generated
  decode (``trtllm_batch_decode_with_kv_cache``), built for sm100 (it takes an FP8 query there); its FA2 decode
  reads 16-bit and FP8 pages only.
* vLLM's ``unified_attention`` (``vllm/v1/attention/ops/triton_unified_attention.py`` at vllm-project/vllm commit
  :data:`VLLM_COMMIT`, the file fp8kv's vLLM backend follows) dispatches on ``kv_quant_mode``: 16-bit
  (``NONE``), FP8 per tensor and per token-head, and INT8 per token-head in its own kernel (the per-token-head
  scales in ``k_scale_cache`` / ``v_scale_cache``, fp32 ``[num_blocks, block_size, Hkv]``), and the packed
  sub-byte modes, INT4 and INT2 per token-head, to the backends of ``vllm.v1.attention.ops.triton_quant_kv``. So
  vLLM reads :data:`VLLM_FORMATS` (:data:`VLLM_MODES` maps its modes to fp8kv's formats); it has no NVFP4, MXFP4 or
  KIVI mode, and fp8kv has no 2-bit format. fp8kv's kernel shim ships the INT4 backend's dispatch but not the
  backend, so its packing (nibble order, scale layout) is not checked against fp8kv's int4_token_head.
* What fp8kv passes (:data:`FP8KV_PASSES`): its own kernel and the oracle take a
  :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache`; its FlashInfer and vLLM backends take a
  :class:`~fp8kv.cache.PagedKVCache` of 16-bit or FP8 pages only (``fp8kv.decode`` refuses a quantized cache by
  type, and the vLLM backend sets ``kv_quant_mode`` to ``NONE`` or ``FP8_PER_TENSOR``), so no peer is handed a
  quantized format yet, and the bench has no FlashInfer or vLLM rows of one.
* The fp8_* formats are fp8kv.quant's FP8 caches: :func:`fp8kv.capability.capability`'s rows (kv_dtype fp8_e4m3 /
  fp8_e5m2 with their granularities) answer for them, and they are not repeated here (:data:`FORMAT_NAMES`).
"""

from __future__ import annotations

from collections.abc import Sequence

from . import checks
from .capability import BACKEND_NAMES, FP8_MODE_NEEDS_FP8, MODES, arch_number, current_arch, interpreter_on
from .formats import is_fp8
from .kv_formats import KV_FORMATS, PAGED_FORMATS, kv_format

__all__ = ["FORMAT_NAMES", "TRITON_FORMATS", "GLUON_FORMATS", "GLUON_PACKED_FORMATS", "GLUON_PACKED_HEAD_DIM",
           "FLASHINFER_FORMATS", "VLLM_COMMIT", "VLLM_KERNEL_FILE", "VLLM_MODES", "VLLM_PACKED_MODES", "VLLM_FORMATS",
           "FP8KV_PASSES", "FORMAT_MODE", "FACT_COLUMNS", "format_facts", "check_format", "format_capability",
           "mode_refusal"]

# The formats beside FP8 (the fp8_* formats are the FP8 cache's, in fp8kv.capability's own rows).
FORMAT_NAMES: tuple[str, ...] = tuple(name for name, f in KV_FORMATS.items() if f.key.rule != "fp8")
# What fp8kv's quantized-page kernel reads (fp8kv.ops.quant_decode.QUANT_DECODE_FORMATS holds the same names).
TRITON_FORMATS = ("int8_token_head", "int4_token_head", "nvfp4", "mxfp4")
# What the FP8 decode's Gluon kernel reads of them on sm89+ (fp8kv.ops.decode.gluon_scope.GLUON_QUANTIZED_FORMATS),
# those whose codes are two a byte, and the head dims it reads of those (gluon_scope.PACKED_HEAD_DIM).
GLUON_FORMATS = ("int8_token_head", "int4_token_head")
GLUON_PACKED_FORMATS = ("int4_token_head",)
GLUON_PACKED_HEAD_DIM = 32
_GLUON_ARCH = 89  # its FP8 conversions (cvt.rn.f16x2.e4m3x2) need sm89+ (fp8kv.ops.decode.planning)
FLASHINFER_FORMATS = {"nvfp4": 100}  # format -> the one arch number FlashInfer reads it on
# vLLM's kernel file as fp8kv's vLLM backend follows it (the shim's COMMIT holds the same hash).
VLLM_COMMIT = "86a153bd"
VLLM_KERNEL_FILE = "vllm/v1/attention/ops/triton_unified_attention.py"
# Every KVQuantMode member unified_attention dispatches at VLLM_COMMIT -> the fp8kv format of those pages; None where
# fp8kv.capability's rows answer (16-bit and FP8 pages) or fp8kv has no such format (2-bit codes).
VLLM_MODES = {"NONE": None, "FP8_PER_TENSOR": None, "FP8_PER_TOKEN_HEAD": None,
              "INT8_PER_TOKEN_HEAD": "int8_token_head", "INT4_PER_TOKEN_HEAD": "int4_token_head",
              "INT2_PER_TOKEN_HEAD": None}
# The modes it hands to the packed-KV backends of vllm.v1.attention.ops.triton_quant_kv (get_backend), not its kernel.
VLLM_PACKED_MODES = ("INT4_PER_TOKEN_HEAD", "INT2_PER_TOKEN_HEAD")
VLLM_FORMATS: tuple[str, ...] = tuple(f for f in VLLM_MODES.values() if f is not None)
_VLLM_PAGES = {"INT8_PER_TOKEN_HEAD": "int8 codes with one fp32 scale per token and head (k_scale_cache / "
                                      "v_scale_cache, [num_blocks, block_size, Hkv]), in its own kernel",
               "INT4_PER_TOKEN_HEAD": "int4 codes two a byte with a scale per token and head, in the packed-KV "
                                      "backend of vllm.v1.attention.ops.triton_quant_kv (not in fp8kv's kernel shim: "
                                      "its packing is not checked against fp8kv's int4_token_head)"}
# backend -> the formats fp8kv hands to its kernel: its own kernel and the oracle take a QuantizedPagedKVCache; the
# FlashInfer and vLLM backends a PagedKVCache of 16-bit or FP8 pages only (fp8kv.decode refuses a quantized cache).
FP8KV_PASSES: dict[str, tuple[str, ...]] = {"reference": FORMAT_NAMES, "triton": TRITON_FORMATS, "flashinfer": (),
                                            "vllm": ()}
_PEER_TAKES = {"flashinfer": "a PagedKVCache of 16-bit or FP8 pages only",
               "vllm": "a PagedKVCache of 16-bit or FP8 pages only, with kv_quant_mode NONE or FP8_PER_TENSOR"}
FORMAT_MODE = "dequant"  # codes are dequantized to 16 bits in registers: no low-precision arithmetic mode
# What a row's "supported" is made of: the backend's kernel reads the pages there; fp8kv hands them to it.
FACT_COLUMNS = ("kernel_reads", "fp8kv_passes")


def _arch_number(arch: str) -> int:
    try:
        return arch_number(arch)
    except ValueError as e:
        checks.fail(f"{e}, or None for this machine")


def _not_paged(name: str) -> str:
    return (f"{name} has no paged cache (its scales span tokens or the whole tensor; paged formats: "
            f"{PAGED_FORMATS}), so no kernel here reads it")


def _triton_reads(name: str, n: int) -> str:
    why = ("fp8kv's quantized-page kernel: codes and scales loaded as integers, dequantized in registers, fp16 dots "
           "(no FP8 conversion instruction needed)")
    if name in GLUON_FORMATS and n >= _GLUON_ARCH:
        at = f", at head dims that are multiples of {GLUON_PACKED_HEAD_DIM}" if name in GLUON_PACKED_FORMATS else ""
        why += (f"; by default the FP8 decode's Gluon kernel where its splits are long (codes turned to fp16 by their "
                f"bits, the scales as FP8's per-token ones{at}; gluon=False keeps this kernel)")
    return why


def _vllm_reads(name: str) -> tuple[bool, str]:
    mode = next((m for m, f in VLLM_MODES.items() if f == name), None)
    if mode is None:
        return False, (f"vLLM's Triton kernel has no {name} KV cache: unified_attention (commit {VLLM_COMMIT}) "
                       "dispatches 16-bit pages, FP8 per tensor and per token-head, and INT8 / INT4 / INT2 per "
                       "token-head (VLLM_MODES)")
    return True, (f"vLLM's unified_attention (commit {VLLM_COMMIT}) reads {name} pages as KVQuantMode.{mode}: "
                  f"{_VLLM_PAGES[mode]}")


def _reads(backend: str, name: str, n: int) -> tuple[bool, str]:
    """Whether ``backend``'s kernel reads format ``name`` on arch number ``n``, by library and hardware facts."""
    if backend == "reference":
        return True, "fp32 oracle: kv_formats.dequantize, then fp8kv.reference.attention"
    if n < 80:
        return False, f"sm{n} predates sm80; fp8kv targets sm80 and newer"
    if backend == "triton":
        if name in TRITON_FORMATS:
            return True, _triton_reads(name, n)
        if name.startswith("kivi4_"):
            return False, (f"{name} has a paged cache (fp8kv.cache.KIVIPagedKVCache: whole key groups a page, the "
                           "unfilled one in a residual) but no decode kernel reads it yet; the reference does")
        if name not in PAGED_FORMATS:
            return False, _not_paged(name)
        return False, f"{name} has a paged cache but no decode kernel yet (the kernel reads {TRITON_FORMATS})"
    if backend == "flashinfer":
        if name not in FLASHINFER_FORMATS:
            return False, f"FlashInfer has no {name} KV cache (it reads 16-bit, FP8, and NVFP4 on sm100)"
        if n != FLASHINFER_FORMATS[name]:
            return False, (f"FlashInfer reads {name} pages only in its TRT-LLM-generated decode, built for "
                           f"sm{FLASHINFER_FORMATS[name]}; its FA2 decode reads 16-bit and FP8 pages")
        return True, ("FlashInfer's TRT-LLM-generated decode (trtllm_batch_decode_with_kv_cache) reads NVFP4 pages and "
                      "their e4m3 block scales (kv_cache_sf), FP8 query")
    return _vllm_reads(name)


def _passes(backend: str, name: str) -> tuple[bool, str]:
    """Whether fp8kv hands pages of format ``name`` to ``backend``'s kernel, and, where it does not but the peer's
    kernel reads the format (on some arch), why."""
    if name in FP8KV_PASSES[backend]:
        return True, ""
    peer_reads = {"flashinfer": tuple(FLASHINFER_FORMATS), "vllm": VLLM_FORMATS}.get(backend, ())
    if name not in peer_reads:
        return False, ""  # nothing reads it there: the read's reason says why, or fp8kv's own kernel says what it reads
    return False, (f"fp8kv's {backend} backend does not pass {name} pages to it (it takes {_PEER_TAKES[backend]}), "
                   "so the bench has no such rows")


def _reads_here(backend: str, name: str) -> tuple[bool, str]:
    """:func:`_reads` on this machine: its GPU, or on CPU the reference and fp8kv's kernel under the interpreter."""
    here = current_arch()
    if here is not None:
        return _reads(backend, name, _arch_number(here))
    ok, why = _reads(backend, name, 90)
    if backend == "reference":
        return ok, why
    if not ok or backend != "triton":
        return False, f"no GPU: {why if not ok else backend + ' reads ' + name + ' on CUDA GPUs only'}"
    if not interpreter_on():
        return False, "no GPU: Triton kernels run on CPU only under TRITON_INTERPRET=1"
    return True, "CPU: fp8kv's quantized-page kernel under the Triton interpreter (TRITON_INTERPRET=1), correctness only"


def format_facts(backend: str, fmt: str, arch: str | None = None) -> tuple[bool, bool, str]:
    """``(kernel_reads, fp8kv_passes, reason)`` of ``backend`` (:data:`fp8kv.capability.BACKEND_NAMES`) and KV format
    ``fmt`` (a name of :data:`FORMAT_NAMES`) in decode: whether the backend's kernel reads the format's pages on
    ``arch`` (its library's source and the hardware), whether fp8kv hands those pages to it (:data:`FP8KV_PASSES`),
    and why (not). :func:`check_format` is the two together.

    ``arch=None`` asks about this machine: its GPU, or on CPU the reference, and fp8kv's kernel where the Triton
    interpreter is on (FlashInfer and vLLM's kernels need a GPU for these formats). An explicit ``arch``
    ("sm90") asks about that arch. A backend, format or arch outside its set is a ValueError naming it.
    """
    checks.one_of(backend, "backend", BACKEND_NAMES)
    name = kv_format(fmt).name
    if name not in FORMAT_NAMES:
        checks.fail(f"fmt={fmt!r} is an FP8 format: fp8kv.capability.check answers for it (kv_dtype "
                    f"{name[:8]!r} with its granularity); expected one of {FORMAT_NAMES}")
    reads, why = _reads(backend, name, _arch_number(arch)) if arch is not None else _reads_here(backend, name)
    passes, pass_why = _passes(backend, name)
    return reads, passes, why + (f"; {pass_why}" if pass_why else "")


def check_format(backend: str, fmt: str, arch: str | None = None) -> tuple[bool, str]:
    """Whether fp8kv runs KV format ``fmt`` (a name of :data:`FORMAT_NAMES`) on ``backend``
    (:data:`fp8kv.capability.BACKEND_NAMES`) in decode, and why (not): the backend's kernel reads the format's pages
    there and fp8kv passes them to it (:func:`format_facts`, which gives the two apart). ``arch`` as there."""
    reads, passes, why = format_facts(backend, fmt, arch)
    return reads and passes, why


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
    (``"dequant"``: codes become 16-bit values in registers), supported (fp8kv runs it: both facts below),
    granularities (``""``: the format names its scales) and reason; then :data:`FACT_COLUMNS`: ``kernel_reads``
    (the backend's kernel reads the pages there) and ``fp8kv_passes`` (fp8kv hands them to it).
    ``formats`` defaults to :data:`FORMAT_NAMES`."""
    import pandas as pd

    if isinstance(arch, (list, tuple)):
        if not arch:
            checks.fail("arch=[]: give one arch such as 'sm90', a list of them, or None for this machine")
        return pd.concat([format_capability(a, formats) for a in arch], ignore_index=True)
    names = FORMAT_NAMES if formats is None else checks.many_of(formats, "formats", FORMAT_NAMES)
    label = arch or current_arch() or "cpu"
    rows = [dict(arch=label, backend=b, kv_dtype=f, mode=FORMAT_MODE, supported=reads and passes, granularities="",
                 reason=why, kernel_reads=reads, fp8kv_passes=passes)
            for b in BACKEND_NAMES for f in names for reads, passes, why in [format_facts(b, f, arch)]]
    return pd.DataFrame(rows)
