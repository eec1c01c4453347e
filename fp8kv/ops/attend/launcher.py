"""Host launcher of the multi-token paged attention kernel (``fp8kv/ops/attend/kernel.py``):
speculative-decode verification and chunked-prefill append over an FP8 (or 16-bit) paged cache.

:func:`attend` validates every argument (``fp8kv.attend_checks``: one host sync, which also reads the
new-token counts that size the launch), picks the launch (:func:`attend_launch`), runs the kernel and,
with several KV splits, the combine. It answers what :func:`fp8kv.reference.attend` defines, within the
decode's tolerances. Under the Triton interpreter (CPU), whose bf16 arithmetic is wrong, what would be
computed or stored in bf16 runs in fp32 and is rounded to bf16 by torch, as the decode launcher does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import checks, launch_options
from ...attend_checks import attend_arguments
from ...cache import PagedKVCache
from ...capability import UnsupportedError, check_query, current_arch, interpreter_on
from ...capability import check as supported
from ...formats import UNQUANTIZED_DTYPES
from .kernel import (
    CONVERT_CAST,
    CONVERT_PTX,
    CONVERT_SOFTWARE,
    SCALE_CHANNEL,
    SCALE_PER_HEAD,
    SCALE_TOKEN_HEAD,
    combine_attend_splits,
    paged_attend_kernel,
)

__all__ = ["attend", "attend_launch", "AttendConfig", "MODES", "BLOCK_M_CHOICES"]

MODES = ("dequant", "fp8")
_MODE_FLAGS = {"dequant": (False, False), "fp8": (True, True)}  # (FP8 query and QK dot, FP8 p and P.V dot)
_SCALE_KIND = {"tensor": SCALE_PER_HEAD.value, "head": SCALE_PER_HEAD.value, "channel": SCALE_CHANNEL.value,
               "token_head": SCALE_TOKEN_HEAD.value}
_CONVERT = {"cast": CONVERT_CAST.value, "software": CONVERT_SOFTWARE.value, "ptx": CONVERT_PTX.value}
_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
OUT_DTYPES = tuple(UNQUANTIZED_DTYPES.values())  # what the kernel stores: fp16, bf16, fp32
BLOCK_M_CHOICES = (16, 32, 64, 128)  # rows per program: tl.dot's minimum 16, at most 128 (registers)
MAX_SPLITS = 64  # the combine holds splits x D partials per program
# Splits are added while the programs fill fewer than LATENCY_WAVES waves of SMs where tiles are small
# (block_m <= LATENCY_BLOCK_M: a few draft tokens, which stream K/V like a decode), and one wave where they
# are large (a chunk: each program already has work enough, and partials of many rows cost traffic).
LATENCY_WAVES = 4
LATENCY_BLOCK_M = 32
MIN_TILES_PER_SPLIT = 2  # a split of fewer key tiles would spend more on its prologue and the combine

# Launch parameters by name: block_m, block_n, num_warps, num_stages, num_splits, tokens_per_split.
AttendConfig = dict[str, int]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs per split decision, as the decode launcher assumes


def attend_launch(qo_lens: list[int], seq_lens: list[int], cache: PagedKVCache, group: int, mode: str, *,
                  window: int | None = None, num_splits: int | None = None, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_sms: int | None = None) -> AttendConfig:
    """The launch of :func:`attend` for sequences of ``qo_lens`` new tokens and ``seq_lens`` cached ones
    (both ints, already checked), ``group`` query heads per KV head: defaults, then the overrides.

    * ``block_m``: rows (query, head) per program, one of :data:`BLOCK_M_CHOICES`. Default: the longest
      sequence's rows (``max(qo_len) x group``) rounded up to a power of two, at most 128 (64 at head dims
      above 128): spec-verify takes one program per (sequence, KV head), a chunk tiles of 128 rows.
    * ``block_n``: keys per tile, a power of two in [16, 256] (fp8 mode: >= 32, the FP8 dot's minimum K).
      Default 64 (32 at head dims above 128: the K and V tiles then hold as many bytes).
    * ``num_warps``: one of ``launch_options.WARP_COUNTS``; default 8 for tiles of 128 x 128 or more
      (query rows x padded head dim: the fp32 accumulator would take 128 registers a thread in 4 warps), else 4.
    * ``num_splits``: KV splits (a positive int). Default: one, unless the programs fill fewer than
      :data:`LATENCY_WAVES` waves of ``num_sms`` SMs (tiles of at most :data:`LATENCY_BLOCK_M` rows, as in
      spec-verify at small batch; one wave for larger tiles); then as
      many as fill them, each at least :data:`MIN_TILES_PER_SPLIT` key tiles of the longest span a program
      reads (the longest sequence, or the window plus the tile's queries), at most :data:`MAX_SPLITS`.
      The count is realised in whole key tiles per split (``tokens_per_split``), so none is empty.
    """
    d_pad = max(16, triton.next_power_of_2(cache.head_dim))
    if block_m is None:
        rows = max(max(qo_lens, default=1), 1) * group
        block_m = min(max(16, triton.next_power_of_2(rows)), 128 if d_pad <= 128 else 64)
    else:
        block_m = checks.one_of(checks.integer(block_m, "block_m"), "block_m", BLOCK_M_CHOICES)
    if block_n is None:
        block_n = 64 if d_pad <= 128 else 32
    else:
        block_n = checks.integer(block_n, "block_n")
        if block_n < 16 or block_n > launch_options.MAX_BLOCK_N or block_n & (block_n - 1):
            checks.fail(f"block_n={block_n}; expected a power of two in [16, {launch_options.MAX_BLOCK_N}]")
    if mode == "fp8" and block_n < 32:
        checks.fail(f"block_n={block_n}: fp8 mode needs block_n >= 32 (the FP8 dot's minimum K)")
    if num_warps is None:
        num_warps = 8 if block_m * d_pad >= 128 * 128 else 4
    else:
        num_warps = checks.one_of(checks.integer(num_warps, "num_warps"), "num_warps", launch_options.WARP_COUNTS)
    longest = max(max(seq_lens, default=1), 1)
    span = longest if window is None else min(longest, window + block_m // group + 1)
    if num_splits is None:
        sms = _num_sms(cache.device) if num_sms is None else num_sms
        programs = cache.num_kv_heads * sum(math.ceil(n * group / block_m) for n in qo_lens)
        waves = LATENCY_WAVES if block_m <= LATENCY_BLOCK_M else 1
        wanted = math.ceil(waves * sms / max(programs, 1))
        num_splits = max(1, min(wanted, math.ceil(span / (block_n * MIN_TILES_PER_SPLIT)), MAX_SPLITS))
    else:
        num_splits = checks.positive_int(num_splits, "num_splits")
    tokens_per_split = math.ceil(math.ceil(span / num_splits) / block_n) * block_n
    num_splits = max(1, math.ceil(span / tokens_per_split))
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=1 if interpreter_on() else 2,
                num_splits=num_splits, tokens_per_split=tokens_per_split)


def _converts(cache: PagedKVCache, fp8_qk: bool, arch: str | None) -> str:
    """How dequant mode converts FP8 codes: Triton's cast under the interpreter, inline PTX on sm89+,
    integer ops before sm89 (where Triton has no e4m3). fp8 mode feeds the FP8 values to its dots."""
    if not cache.is_fp8 or fp8_qk or arch is None:
        return "cast"
    return "ptx" if int(arch[2:]) >= 89 else "software"


def attend(q: torch.Tensor, cache: PagedKVCache, qo_indptr: torch.Tensor, *, mode: str = "dequant",
           sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
           sinks: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, num_splits: int | None = None,
           block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None):
    """Triton paged attention of several new tokens per sequence (spec-verify, chunked prefill).

    Parameters
    ----------
    q : ``[total_q, Hq, D]`` bfloat16 / float16 (last dim contiguous; fp16 only over an FP8 or fp16
        cache), finite: the new tokens of every sequence, back to back.
    cache : :class:`~fp8kv.cache.PagedKVCache` holding the new tokens already (the last ``qo_len[i]`` of
        row i): bf16 / fp16 / fp8_e4m3 / fp8_e5m2, NHD or HND, any scale granularity (fp8 mode: tensor,
        head, channel), head dims up to 256 (not powers of two: padded and masked).
    qo_indptr : int32 / int64 ``[B + 1]`` on the cache's device; see :func:`fp8kv.reference.attend`.
    mode : ``"dequant"`` (FP8 converted to 16 bits in registers, 16-bit dots) or ``"fp8"`` (each query
        row quantized to e4m3 with scale amax / 448, as the decode does; FP8 x FP8 dots; sm89+).
    sm_scale, window, soft_cap, sinks : as in :func:`fp8kv.reference.attend`.
    out_dtype : output dtype (default q's): float16, bfloat16 or float32.
    num_splits, block_m, block_n, num_warps : launch overrides (:func:`attend_launch`).

    Every argument is validated (``fp8kv.attend_checks.attend_arguments`` plus the mode, dtypes and launch
    options here): a ``TypeError``/``ValueError`` names it; a combination this machine cannot run raises
    :class:`~fp8kv.capability.UnsupportedError` with the capability table's reason. The checks read the
    tables and ``qo_indptr`` on the host (one sync), so a call is not captured in a CUDA graph.

    Returns
    -------
    out ``[total_q, Hq, D]`` (out_dtype) and lse ``[total_q, Hq]`` fp32, natural log, as the decode's.
    """
    qo_lens, sm_scale, window, soft_cap, sinks = attend_arguments(q, cache, qo_indptr, sm_scale, window,
                                                                  soft_cap, sinks)
    checks.one_of(mode, "mode", MODES)
    ok, why = check_query("triton", q.dtype, cache.kv_dtype)  # 16-bit; fp16 only over FP8 or fp16 pages
    if not ok:
        checks.fail(why, TypeError)
    if q.stride(-1) != 1:
        checks.fail(f"q has strides {tuple(q.stride())}; it must be contiguous in its last (head_dim) dimension: "
                    "call .contiguous()")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        checks.fail(f"out_dtype={out_dtype!r}; expected one of {OUT_DTYPES}", TypeError)
    ok, why = supported("triton", cache.kv_dtype, mode, granularity=cache.granularity,
                        head_dim=cache.head_dim, layout=cache.layout)
    if not ok:
        raise UnsupportedError(f"mode={mode}, kv_dtype={cache.kv_dtype}, granularity={cache.granularity}: {why}")
    capacity = cache.max_blocks_per_seq * cache.block_size
    if window is not None and window >= capacity:
        window = None  # no sequence is longer: the plain kernel
    group = q.shape[1] // cache.num_kv_heads
    cfg = attend_launch(qo_lens, cache.seq_lens.tolist(), cache, group, mode, window=window, num_splits=num_splits,
                        block_m=block_m, block_n=block_n, num_warps=num_warps)
    return _run(q, cache, qo_indptr, cfg, mode, group, sm_scale, window, soft_cap, sinks, out_dtype)


def _run(q, cache, qo_indptr, cfg, mode, group, sm_scale, window, soft_cap, sinks, out_dtype):
    """Allocate, launch the kernel (and the combine with several splits), return (out, lse)."""
    total_q, hq, d = q.shape
    kernel_out_dtype = torch.float32 if interpreter_on() and out_dtype == torch.bfloat16 else out_dtype
    out = torch.empty(total_q, hq, d, dtype=kernel_out_dtype, device=q.device)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out.to(out_dtype), lse
    fp8_qk, fp8_pv = _MODE_FLAGS[mode]
    arch = current_arch(q.device) if q.device.type == "cuda" else None
    convert = _converts(cache, fp8_qk, arch)
    compute = torch.float16 if cache.is_fp8 else q.dtype
    rescale_q = compute == torch.float16 and not fp8_qk and (q.dtype != torch.float16 or cache.granularity == "channel")
    if interpreter_on() and compute == torch.bfloat16:
        compute = torch.float32  # the interpreter's bf16 is wrong
    splits = cfg["num_splits"]
    if splits == 1:
        k_out, k_lse = out, lse
        so, sl = (out.stride(0), out.stride(1), 0), (lse.stride(0), lse.stride(1))
    else:
        k_out = torch.empty(total_q, hq, splits, d, dtype=torch.float32, device=q.device)
        k_lse = torch.empty(total_q, hq, splits, dtype=torch.float32, device=q.device)
        so, sl = (k_out.stride(0), k_out.stride(1), k_out.stride(2)), (k_lse.stride(0), k_lse.stride(1))
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    qk_scale = sm_scale * math.log2(math.e) * (1.0 if soft_cap is None else 2.0 / soft_cap)
    s = cache.k_pages.stride()
    page_strides = (s[0], s[1], s[2]) if cache.layout == "NHD" else (s[0], s[2], s[1])
    # FP8 pages as FP8 values for Triton's cast and the FP8 dots, as uint8 codes for the integer and PTX paths
    as_codes = cache.is_fp8 and convert != "cast"
    k_pages, v_pages = (t.view(torch.uint8) if as_codes else t for t in (cache.k_pages, cache.v_pages))
    b = cache.batch_size
    block_m = cfg["block_m"]
    grid = (total_q * group // block_m + b, cache.num_kv_heads, splits)
    fmt = cache.fmt
    paged_attend_kernel[grid](
        q, k_pages, v_pages, cache.k_scale, cache.v_scale, cache.block_table, cache.seq_lens, qo_indptr, k_out, k_lse,
        qk_scale, cfg["tokens_per_split"], cache.num_kv_heads, cache.num_blocks,
        cache.max_blocks_per_seq * cache.block_size, total_q, b, max(0, math.ceil(math.log2(b))),
        window or 0, 0.0 if soft_cap is None else soft_cap * math.log2(math.e), sinks if sinks is not None else lse,
        q.stride(0), q.stride(1), *page_strides, cache.block_table.stride(0), *so, *sl,
        GROUP=group, BLOCK_M=block_m, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=cache.block_size, BLOCK_N=cfg["block_n"], SPLIT=splits > 1,
        SCALE_KIND=_SCALE_KIND[cache.granularity] if cache.is_fp8 else SCALE_PER_HEAD.value,
        SCALE_HEAD_STRIDE=int(cache.k_scale.numel() > 1), KV_FP8=cache.is_fp8,
        CONVERT_K=_CONVERT[convert], CONVERT_V=_CONVERT[convert],
        MANT=fmt.mantissa_bits if fmt else 0, BIAS=fmt.bias if fmt else 0, FP8_QK=fp8_qk, FP8_PV=fp8_pv,
        COMPUTE=_COMPUTE[compute], RESCALE_Q=rescale_q, WINDOWED=window is not None, SOFT_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        combine_attend_splits[(total_q, hq)](
            k_out, k_lse, out, lse, k_out.stride(0), k_out.stride(1), k_out.stride(2), k_lse.stride(0),
            k_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), splits,
            sinks if sinks is not None else lse, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
            SPLITS_PAD=triton.next_power_of_2(splits), HAS_SINKS=sinks is not None, num_warps=4)
    return out.to(out_dtype), lse

