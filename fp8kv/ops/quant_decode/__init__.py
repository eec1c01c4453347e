"""Paged decode attention over the pages of a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` (INT8 and INT4
per token and head, NVFP4, MXFP4): :func:`paged_decode_quantized`, checked once here (or planned once by
:func:`plan_decode_quantized` and run many times by :func:`run_quant_decode`), and its fp32 oracle
:func:`quantized_reference`.

Modules: :mod:`.kernel` (the Triton kernel: codes dequantized in registers), :mod:`.codes` (code tiles to fp16,
three ways), :mod:`.launcher` (its launch and the split combine), :mod:`.oracle` (kv_formats.dequantize, then fp8kv.reference's fp32 attention).
"""

from __future__ import annotations

import torch

from ... import checks
from ...cache.quantized import QuantizedPagedKVCache
from ...capability import UnsupportedError, interpreter_on
from ...launch_options import DOT_MIN_ROWS, check_block_n, check_stages, check_warps
from ..decode.gluon_launcher import launch_constants
from ..decode.gluon_scope import GLUON_QUANTIZED_FORMATS
from ..decode.planning import DecodePlan, decode_kernel, gluon_choice, gluon_config, plan_inputs
from .launcher import (
    QUANT_CONVERTS,
    QUANT_DECODE_FORMATS,
    QuantDecodeLaunch,
    quant_decode_launch,
    run_quant_decode,
)
from .oracle import kernel_tolerance, quantized_reference

__all__ = ["paged_decode_quantized", "plan_decode_quantized", "run_quant_decode", "check_launch_options",
           "QuantDecodeLaunch",
           "quantized_reference", "kernel_tolerance", "QUANT_DECODE_FORMATS", "QUANT_OUT_DTYPES", "QUANT_CONVERTS"]

QUANT_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_launch_options(num_splits, block_n, convert, num_warps, num_stages) -> tuple:
    """The launch options of :func:`paged_decode_quantized` (None: the default), checked by name: ``(num_splits,
    block_n, num_warps, num_stages)`` as ints or None."""
    if num_splits is not None:
        num_splits = checks.positive_int(num_splits, "num_splits")
    block_n = check_block_n(block_n, least=DOT_MIN_ROWS)
    if convert is not None:
        checks.one_of(convert, "convert", QUANT_CONVERTS)
    return num_splits, block_n, check_warps(num_warps), check_stages(num_stages)


def paged_decode_quantized(q: torch.Tensor, cache: QuantizedPagedKVCache, *, sm_scale: float | None = None,
                           out_dtype: torch.dtype | None = None, num_splits: int | None = None,
                           block_n: int | None = None, convert: str | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           check: bool = True, gluon: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per sequence over a quantized paged cache, with fp8kv's kernels (the
    quantized-page Triton kernel; INT8 and INT4 per token and head in the FP8 decode's Gluon kernel where it runs, see
    ``gluon``): :func:`plan_decode_quantized` (every check, the launch) and :func:`run_quant_decode`.

    Parameters
    ----------
    q : ``[B, Hq, D]`` float16 / bfloat16 / float32 (last dim contiguous), Hq a multiple of the cache's Hkv;
        rounded to fp16 for the dots (a non-fp16 query first brought to fp16's range per head, exactly).
    cache : a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` of a format in :data:`QUANT_DECODE_FORMATS`.
    sm_scale : softmax scale, positive and finite; default ``1 / sqrt(D)``.
    out_dtype : float16 / bfloat16 / float32; default q's dtype.
    num_splits : split-KV factor (default: the FP8 decode's rule); block_n : tokens per tile, a power of two in
        [16, MAX_BLOCK_N].
    convert : how code tiles become fp16, one of :data:`QUANT_CONVERTS` (:mod:`.codes`; the same values every
        way): "software", "cast", or "ptx" (inline assembly: a CUDA GPU only).
    num_warps : warps per program, one of WARP_COUNTS; num_stages : software-pipeline stages, 1 to MAX_STAGES.
        Each option None: the format's measured default (:data:`.launcher.QUANT_LAUNCH_DEFAULTS`; under the
        interpreter "software" for "ptx" and one stage).
    check : also check the scales' values and the tables (a host sync; a sequence of length 0 refused). Off,
        the kernel still clamps block-table entries and lengths into the pool.
    gluon : which kernel reads INT8 and INT4 per token and head: None (default) the FP8 decode's Gluon kernel
        (:mod:`fp8kv.ops.decode.gluon_kernel`, its codes turned to fp16 by their bits) where it runs and no launch
        option is given, as :func:`fp8kv.ops.paged_decode` picks it (a bf16 / fp16 query on a CUDA GPU, sm89+, splits
        of GLUON_MIN_SPLIT_TOKENS or more, INT4's of GLUON_MIN_PACKED_SPLIT_TOKENS, the group in one program), else
        the Triton kernel; True the Gluon kernel
        (UnsupportedError where it cannot run; it takes num_splits, block_n 64 / 128, num_stages 2-4 and
        num_warps 4; INT4 at head dims that are multiples of 32); False the Triton kernel. Other formats run the
        Triton kernel.

    Returns
    -------
    out ``[B, Hq, D]`` (out_dtype) and lse ``[B, Hq]`` fp32 (natural log), as :func:`quantized_reference`.
    """
    launch = plan_decode_quantized(q, cache, sm_scale=sm_scale, out_dtype=out_dtype, num_splits=num_splits,
                                   block_n=block_n, convert=convert, num_warps=num_warps, num_stages=num_stages,
                                   check=check, gluon=gluon)
    return run_quant_decode(q, cache, launch)


def plan_decode_quantized(q: torch.Tensor, cache: QuantizedPagedKVCache, *, sm_scale: float | None = None,
                          out_dtype: torch.dtype | None = None, num_splits: int | None = None,
                          block_n: int | None = None, convert: str | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          check: bool = True, gluon: bool | None = None) -> QuantDecodeLaunch | DecodePlan:
    """The checked launch of :func:`paged_decode_quantized` (same arguments): run it any number of times on
    ``q`` and ``cache`` of the same shapes, dtypes and device with ``run_quant_decode(q, cache, launch)``, no
    host work left. A :class:`QuantDecodeLaunch` of the Triton kernel, or the Gluon kernel's
    :class:`~fp8kv.ops.decode.DecodePlan`."""
    gluon = gluon_choice(gluon)
    if not isinstance(cache, QuantizedPagedKVCache):
        checks.fail(f"cache must be a fp8kv.cache.quantized.QuantizedPagedKVCache, got {type(cache).__name__}",
                    TypeError)
    if cache.fmt.name not in QUANT_DECODE_FORMATS:
        raise UnsupportedError(f"cache format {cache.fmt.name!r} has no decode kernel; the kernel reads "
                               f"{tuple(QUANT_DECODE_FORMATS)}")
    checks.flag(check, "check")
    cache.check_query(q)
    if q.stride(-1) != 1:
        checks.fail(f"q has strides {tuple(q.stride())}; its last dim (head_dim) must be contiguous")
    if q.device.type != "cuda" and not interpreter_on():
        raise UnsupportedError("the quantized-page decode kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU")
    if sm_scale is not None:
        sm_scale = checks.softmax_scale(sm_scale)
    sm_scale = checks.resolved_softmax_scale(sm_scale, q.shape[-1])
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in QUANT_OUT_DTYPES:
        checks.fail(f"out_dtype={out_dtype!r}; expected one of {QUANT_OUT_DTYPES}", TypeError)
    num_splits, block_n, num_warps, num_stages = check_launch_options(num_splits, block_n, convert, num_warps,
                                                                      num_stages)
    if convert == "ptx" and q.device.type != "cuda":
        raise UnsupportedError("convert='ptx' is inline GPU assembly: the Triton interpreter cannot run it; "
                               f"use one of {tuple(c for c in QUANT_CONVERTS if c != 'ptx')}")
    cache.validate_arrays(contents=check)
    if check:
        checks.finite_tensor(q, "q")  # as fp8kv.decode refuses it: a NaN query is no result
        cache.validate_tables(nonempty=True)
    options = dict(num_splits=num_splits, block_n=block_n, convert=convert, num_warps=num_warps, num_stages=num_stages)
    plan = _gluon_plan(q, cache, sm_scale, out_dtype, gluon, options)
    if plan is not None:
        return plan
    launch = quant_decode_launch(cache, batch=q.shape[0], num_q_heads=q.shape[1], q_dtype=q.dtype, device=q.device,
                                 sm_scale=sm_scale, out_dtype=out_dtype, num_splits=num_splits, block_n=block_n,
                                 convert=convert, num_warps=num_warps, num_stages=num_stages)
    return launch._replace(inputs=plan_inputs(q, cache))


def _gluon_plan(q: torch.Tensor, cache: QuantizedPagedKVCache, sm_scale: float, out_dtype: torch.dtype,
                gluon: bool | None, options: dict) -> DecodePlan | None:
    """The Gluon kernel's plan of a checked decode (see :func:`paged_decode_quantized`'s ``gluon``), or None: the
    Triton kernel's. UnsupportedError where gluon=True cannot run."""
    if gluon is False or cache.fmt.name not in GLUON_QUANTIZED_FORMATS and not gluon:
        return None
    b, hq, d = q.shape
    group = hq // cache.num_kv_heads
    if q.dtype not in (torch.float16, torch.bfloat16):  # the Triton kernel also takes fp32 queries
        if gluon:
            raise UnsupportedError(f"gluon=True: q has dtype {q.dtype}: the Gluon kernel takes a float16 or bfloat16 "
                                   "query; use the Triton kernel (gluon=False)")
        return None
    # the decode's choice: any launch option means the Triton kernel unless gluon=True (then refused by name)
    if decode_kernel(cache, "dequant", d, group, q.device, gluon=gluon, **options) != "gluon":
        return None
    cfg = gluon_config(b, cache, group, q.device, gluon=gluon, q_dtype=q.dtype, num_splits=options["num_splits"],
                       block_n=options["block_n"], num_stages=options["num_stages"])
    if cfg is None:
        return None
    return DecodePlan("gluon", cfg, "dequant", sm_scale, (b, hq, d), q.dtype, out_dtype, None,
                      launch_constants(cfg, group, cache), inputs=plan_inputs(q, cache))
