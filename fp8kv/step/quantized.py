"""The step's KV in a quantized format of :mod:`fp8kv.kv_formats` (INT8 / INT4 per token and head, NVFP4,
MXFP4, block-scaled e4m3): which names the step takes, which backend reads each, the checks of a format
against a model, and the write of a step's new tokens into a
:class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` without a host sync.

A step's KV dtype is an element type of :data:`fp8kv.formats.KV_DTYPE_NAMES` (a
:class:`~fp8kv.cache.PagedKVCache`) or a format of :data:`STEP_FORMATS` (the formats a paged cache holds
token by token, :data:`fp8kv.kv_formats.PAGED_FORMATS`). The Triton backend reads a format through
:func:`fp8kv.ops.quant_decode.paged_decode_quantized` (the formats of
:data:`~fp8kv.ops.quant_decode.QUANT_DECODE_FORMATS`); the reference through its fp32 oracle
:func:`~fp8kv.ops.quant_decode.quantized_reference` (every paged format). A format is read one new token per
sequence: the multi-token attention reads 16-bit and FP8 pages only.

Why a write of its own: :meth:`QuantizedPagedKVCache.write` checks its slots and counts saturations (host
syncs), which a CUDA graph cannot hold. :func:`write_rows` stores the same bytes through the codec's own
sync-free encoder (:func:`fp8kv.kv_formats.encode_rows`) with neither; the step's slots are its own
(:meth:`DecodeStep.set_positions` checks them). ``tests/test_step_formats.py`` holds it to the cache's write,
byte for byte.
"""

from __future__ import annotations

import torch

from .. import checks
from ..capability import interpreter_on
from ..capability_formats import FORMAT_MODE
from ..checks import fail as _fail
from ..formats import KV_DTYPE_NAMES, kv_dtype_info
from ..kv_formats import PAGED_FORMATS, encode_rows, holding_formats, kv_format, page_shapes

__all__ = ["STEP_FORMATS", "STEP_KV_DTYPES", "step_kv_dtype", "is_format", "format_backends", "check_format_shape",
           "check_format_step", "check_one_token", "format_name", "kernel_formats", "write_rows"]

STEP_FORMATS: tuple[str, ...] = PAGED_FORMATS
STEP_KV_DTYPES: tuple[str, ...] = (*KV_DTYPE_NAMES, *STEP_FORMATS)


def step_kv_dtype(value, name: str = "kv_dtype") -> str:
    """The canonical name of a step's KV dtype: an element type (aliases as :func:`fp8kv.formats.kv_dtype_info`
    reads them) or a format of :data:`STEP_FORMATS` (aliases as :func:`fp8kv.kv_formats.kv_format` reads them,
    in any case). Anything else is a ValueError (TypeError for a non-string) naming ``name``, the value and
    :data:`STEP_KV_DTYPES`; a known format a paged cache cannot hold (KIVI, tensor-wide scales) says so."""
    if not isinstance(value, str):
        _fail(f"{name}={value!r} ({type(value).__name__}); expected a name among {STEP_KV_DTYPES}", TypeError)
    try:
        return kv_dtype_info(value)[0]
    except ValueError:
        pass
    try:
        fmt = kv_format(value).name
    except ValueError:
        _fail(f"{name}={value!r} is not a KV dtype the step runs; expected one of {STEP_KV_DTYPES}")
    if fmt not in STEP_FORMATS:
        _fail(f"{name}={value!r}: format {fmt!r} cannot be paged token by token (its scales span tokens or the "
              f"whole tensor), so no step cache holds it; expected one of {STEP_KV_DTYPES}")
    return fmt


def is_format(kv_dtype: str) -> bool:
    """Whether the canonical ``kv_dtype`` is a quantized format (a QuantizedPagedKVCache), not an element type."""
    return kv_dtype in STEP_FORMATS


def format_name(kv_dtype: str) -> str:
    """The :mod:`fp8kv.kv_formats` name of what a step's cache stores: the format itself, ``fp8_*_tensor`` for
    the FP8 pool (one scale per layer and tensor), ``""`` for a 16-bit cache (no format: the model's own
    numbers)."""
    if is_format(kv_dtype):
        return kv_dtype
    return f"{kv_dtype}_tensor" if kv_dtype_info(kv_dtype)[2] is not None else ""


def kernel_formats() -> tuple[str, ...]:
    """The formats fp8kv's quantized-page decode kernel reads (imported here, not above: it imports triton,
    which reads the interpreter switch once, and ``--interpret`` comes first)."""
    from ..ops.quant_decode import QUANT_DECODE_FORMATS

    return tuple(QUANT_DECODE_FORMATS)


def format_backends(kv_dtype: str) -> tuple[str, ...]:
    """The step backends that read format ``kv_dtype`` on some machine: the Triton kernel where it has one,
    and the fp32 oracle."""
    name = kv_format(kv_dtype).name  # an unknown name is refused here, not given the oracle
    return ("triton", "reference") if name in kernel_formats() else ("reference",)


def check_format_shape(kv_dtype: str, num_kv_heads: int, head_dim: int, *, model: str = "the model",
                       name: str = "kv_dtype") -> None:
    """Refuse (ValueError) a format whose codec cannot hold ``head_dim`` (a block that does not divide it, an
    odd head_dim for 4-bit codes), naming ``name``, the model's head_dim and the formats that fit it."""
    c = kv_format(kv_dtype).key
    try:
        page_shapes(c, 1, 1, num_kv_heads, head_dim)
    except ValueError as e:
        fits = holding_formats(STEP_FORMATS, num_kv_heads=num_kv_heads, head_dim=head_dim)
        _fail(f"{name}={kv_dtype!r} cannot store {model}'s head_dim {head_dim}: {e}; formats that fit it: {fits}")


def check_format_step(kv_dtype: str, backend: str, mode: str = "auto", q_len: int = 1, *,
                      on_gpu: bool | None = None, names: dict | None = None) -> str:
    """The backend that reads format ``kv_dtype`` in a step of ``q_len`` new tokens, ``backend`` resolved
    (``"auto"``: the Triton kernel where the format has one and this machine runs it, a CUDA GPU or the Triton
    interpreter, else the fp32 oracle). Refused (ValueError naming the argument, its value and what is
    accepted): a backend that does not read the format, a ``mode`` but ``auto`` / ``dequant`` (codes become
    16-bit values in registers: no FP8 arithmetic), ``q_len`` above 1. ``on_gpu``: whether the step runs on a
    CUDA device (None: unknown; the machine is then not asked about). ``names``: what the messages call
    ``kv_dtype``, ``backend`` and ``mode`` where the caller's user gave them under other names (the CLI's
    ``--kv-dtypes``, ``--backend``, ``--mode``)."""
    names = {"kv_dtype": "kv_dtype", "backend": "backend", "mode": "mode", **(names or {})}
    kv = f"{names['kv_dtype']}={kv_dtype!r}"
    kv_format(kv_dtype)  # an unknown name is refused, not read by the oracle
    q_len = checks.positive_int(q_len, "q_len")
    if mode not in ("auto", FORMAT_MODE):
        _fail(f"{names['mode']}={mode!r} with {kv}: a quantized format's codes are dequantized in registers; "
              f"expected {names['mode']} 'auto' or {FORMAT_MODE!r}")
    check_one_token([kv_dtype], [(f"q_len={q_len}", q_len)], "q_len=1", "kv_dtype")
    readers = format_backends(kv_dtype)
    if backend == "auto":
        runs_here = on_gpu or interpreter_on()
        return "triton" if "triton" in readers and runs_here else "reference"
    if backend not in readers:
        kernel = (f"fp8kv's quantized-page decode kernel reads {kernel_formats()}, not {kv_dtype!r}"
                  if backend == "triton" else f"backend {backend!r} reads no quantized pages")
        _fail(f"{names['backend']}={backend!r} cannot read {kv} ({kernel}); expected {names['backend']} among "
              f"{('auto', *readers)}")
    return backend


def check_one_token(kv_dtypes, steps, one_token: str, name: str = "kv_dtypes") -> None:
    """Refuse a quantized format among ``kv_dtypes`` (canonical names) in a step of several new tokens per
    sequence: the multi-token attention reads 16-bit and FP8 pages only. ``steps``: ``(given, q_len)`` pairs,
    ``given`` the argument that asked for ``q_len`` new tokens as the caller's user gave it (``"q_len=3"``,
    ``"draft_lens[1]=2"``, ``"--chunks=512"``); ``one_token`` the value of it that asks for one; ``name``: what
    the user calls ``kv_dtypes``. ValueError naming the first such pair."""
    for given, q_len in steps:
        for kv in filter(is_format, kv_dtypes if q_len > 1 else ()):
            _fail(f"{given} with {name}={kv!r}: quantized pages are read by a decode of one new token per sequence "
                  f"(the multi-token attention reads 16-bit and FP8 pages); expected {one_token}, or {name} among "
                  f"{KV_DTYPE_NAMES}")


# --------------------------------------------------------------------------------- the step's write
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t  # index writes into fp8 / e8m0 need bytes


def write_rows(cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` ``[N, Hkv, D]`` (float) into ``cache`` (a QuantizedPagedKVCache) at ``slot_mapping``
    ``[N]`` (int64, every slot inside the pool: unchecked), as its :meth:`write` stores them, with no host sync
    (no checks, no saturation counts): a CUDA graph holds it. INT8 and INT4 per token and head go through the
    fused kernel (:func:`fp8kv.ops.write_quantized_rows`, the same bytes) where Triton runs."""
    from ..ops.quant_write import (  # imports triton: only when writing
        FUSED_WRITE_FORMATS,
        write_quantized_rows,
    )

    if cache.fmt.name in FUSED_WRITE_FORMATS and (k.is_cuda or interpreter_on()):
        write_quantized_rows(cache, k, v, slot_mapping)
        return
    blk, off = slot_mapping // cache.block_size, slot_mapping % cache.block_size
    for codec, pages, scales, tensor_scale, new in (
            (cache.fmt.key, cache.k_pages, cache.k_scales, cache.k_tensor_scale, k),
            (cache.fmt.value, cache.v_pages, cache.v_scales, cache.v_tensor_scale, v)):
        codes, sc = encode_rows(new, codec, tensor_scale)
        _bytes(pages)[blk, off] = _bytes(codes)
        _bytes(scales)[blk, off] = _bytes(sc)
