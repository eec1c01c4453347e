"""The Triton decode kernels' launch: the tensor-core kernel (:mod:`.triton_kernel`) and the CUDA-core one
(:mod:`.cuda_core_kernel`). :func:`triton_launch` fixes, once per plan, everything of a launch but the tensors
(grid, constexprs, scalars, output types), checking the options only it takes; :func:`run_triton` allocates the
outputs and launches the kernel and, with splits, the combine. No ``.item()``, no host sync: a run can be
captured in a CUDA graph.

Under the Triton interpreter (CPU), whose bf16 arithmetic and bf16 rounding are wrong, anything that would be
computed or stored in bf16 runs in fp32 and is rounded to bf16 by torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...cache import PagedKVCache
from ...capability import UnsupportedError, current_arch, interpreter_on
from ...checks import resolved_softmax_scale
from ...launch_options import convert_refusal
from ..pages import format_bits, kernel_pages, page_strides, scale_kind
from . import splits
from .combine import combine_as_dependent, combine_splits, split_partials
from .cuda_core_kernel import paged_decode_cuda_core_kernel
from .splits import DecodeConfig, padded_rows
from .triton_helpers import CONVERT_CAST, CONVERT_PTX, CONVERT_SOFTWARE
from .triton_kernel import paged_decode_kernel

__all__ = ["TritonLaunch", "triton_launch", "triton_arguments", "run_triton", "triton_residency", "converts",
           "CONVERT_CODES", "DEFAULT_SM89_CONVERT", "MODE_FLAGS", "EVICTION_POLICIES"]

CONVERT_CODES = {"cast": CONVERT_CAST.value, "software": CONVERT_SOFTWARE.value, "ptx": CONVERT_PTX.value}
# Inline PTX conversion: 704 us vs 949 us for Triton's cast (H200, B=64, ctx=16k, Hq=32, Hkv=8, D=128,
# page 16, e4m3): the cast path stages FP8 tiles in shared memory and converts after the dot-operand
# load; converting in registers right after the global load does not.
DEFAULT_SM89_CONVERT = "ptx"
# mode -> (FP8 query and QKᵀ dot, FP8 probabilities and P·V dot)
MODE_FLAGS = {"dequant": (False, False), "fp8": (True, True)}
_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
EVICTION_POLICIES = ("", "evict_first", "evict_last")


def converts(convert: str | None, arch: str | None, kv_dtype: str, mode: str) -> tuple[str, str]:
    """The K and V tile conversions of dequant mode over pages of ``kv_dtype``, from ``convert`` ("name" or "K/V")
    and the arch. 16-bit pages are read as they are, and fp8 mode's dots take the FP8 tiles as they are: a
    ``convert`` given for either is refused, not ignored."""
    why = None if convert is None else convert_refusal(kv_dtype, mode)
    if why:
        raise ValueError(f"convert={convert!r} chooses how dequant mode turns FP8 codes into 16-bit values; {why}: "
                         "pass convert=None (the default)")
    sm = int(arch[2:]) if arch else None
    if convert is None:
        convert = "cast" if sm is None else ("software" if sm < 89 else DEFAULT_SM89_CONVERT)
    if not isinstance(convert, str):
        raise TypeError(f"convert must be a str such as 'ptx' or 'cast/ptx', got {type(convert).__name__}")
    names = convert.split("/")
    if len(names) == 1:
        names *= 2
    if len(names) != 2 or not set(names) <= set(CONVERT_CODES):
        raise ValueError(f"convert={convert!r}; expected one of {tuple(CONVERT_CODES)}, or 'K/V' with one per tile")
    for name in names:
        if name != "software" and sm is not None and sm < 89:
            raise UnsupportedError(f"convert={name!r} needs FP8 conversion instructions (sm89+); {arch} has none")
        if name == "ptx" and arch is None:
            raise UnsupportedError("convert='ptx' is inline GPU assembly: the Triton interpreter cannot run it")
    return names[0], names[1]


class TritonLaunch(NamedTuple):
    """A planned launch of a Triton decode kernel: everything but the tensors."""
    tensor_cores: bool  # the tensor-core kernel (else the CUDA-core one)
    cfg: DecodeConfig
    grid: tuple[int, int, int]
    constexprs: dict
    qk_scale: float  # sm_scale * log2(e), times 2 / cap with a soft cap
    window: int  # 0: none
    soft_cap_log2: float  # 0.0: none
    fp8_k_values: bool  # K pages read as FP8 values (Triton's cast or the FP8 dot), else as uint8 codes
    fp8_v_values: bool
    out_dtype: torch.dtype  # what the caller gets
    kernel_out_dtype: torch.dtype  # what the kernel stores (fp32 for bf16 under the interpreter)


def triton_launch(cache: PagedKVCache, cfg: DecodeConfig, mode: str, *, tensor_cores: bool, batch: int,
                  num_q_heads: int, q_dtype: torch.dtype, device: torch.device, sm_scale: float,
                  out_dtype: torch.dtype, window: int | None, soft_cap: float | None, sinks: bool,
                  convert: str | None, eviction_policy: str, compute_dtype: torch.dtype | None) -> TritonLaunch:
    """The launch of a decode of ``batch`` ``q_dtype`` queries of ``num_q_heads`` heads over ``cache`` with launch
    ``cfg`` (the tensor-core or CUDA-core kernel), ``sinks`` whether it has a sink term. Checked here: the
    device, ``convert``, ``eviction_policy`` and ``compute_dtype`` (the options only the Triton kernels take)."""
    if device.type != "cuda" and not interpreter_on():
        raise UnsupportedError("the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU")
    arch = current_arch(device) if device.type == "cuda" else None

    b, hq, d = batch, num_q_heads, cache.head_dim
    group = hq // cache.num_kv_heads
    hkv = cache.num_kv_heads
    if window is not None and window >= cache.max_blocks_per_seq * cache.block_size:
        window = None  # no sequence can be longer: the plain kernel, compiled as without a window
    block_n, num_splits = cfg["block_n"], cfg["num_splits"]
    convert_k, convert_v = converts(convert, arch, cache.kv_dtype, mode)
    fp8_qk, fp8_pv = MODE_FLAGS[mode]
    if eviction_policy not in EVICTION_POLICIES:
        raise ValueError(f"eviction_policy={eviction_policy!r}; expected '', 'evict_first' or 'evict_last'")

    if compute_dtype is None:
        compute_dtype = torch.float16 if cache.is_fp8 else q_dtype
    if compute_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"compute_dtype must be torch.float16 or torch.bfloat16, got {compute_dtype}")
    rescale_q = compute_dtype == torch.float16 and not fp8_qk and (
        q_dtype != torch.float16 or cache.granularity == "channel")
    if interpreter_on():  # the interpreter's bf16 is wrong: compute and store in fp32 instead
        compute_dtype = torch.float32 if compute_dtype == torch.bfloat16 else compute_dtype
    kernel_out_dtype = torch.float32 if interpreter_on() and out_dtype == torch.bfloat16 else out_dtype
    # Soft-capping takes tanh of score / cap, computed from e^(2 score / cap): fold that into q·k's factor.
    qk_scale = sm_scale * math.log2(math.e) * (1.0 if soft_cap is None else 2.0 / soft_cap)
    # D_PAD: head_dim padded to a power of two, at least 16 (tl.dot's smallest K on a GPU; the padding is masked)
    common = dict(GROUP=group, HEAD_DIM=d, D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=cache.block_size,
                  BLOCK_N=block_n, SPLIT=num_splits > 1, SCALE_KIND=scale_kind(cache),
                  SCALE_HEAD_STRIDE=int(cache.k_scale.numel() > 1), KV_FP8=cache.is_fp8,
                  CONVERT_K=CONVERT_CODES[convert_k], CONVERT_V=CONVERT_CODES[convert_v], KV_EVICTION=eviction_policy,
                  WINDOWED=window is not None, SOFT_CAP=soft_cap is not None, HAS_SINKS=sinks,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **format_bits(cache))
    scalars = dict(qk_scale=qk_scale, window=window or 0,
                   soft_cap_log2=0.0 if soft_cap is None else soft_cap * math.log2(math.e),
                   fp8_k_values=fp8_qk or convert_k == "cast", fp8_v_values=fp8_pv or convert_v == "cast",
                   out_dtype=out_dtype, kernel_out_dtype=kernel_out_dtype)
    if not tensor_cores:  # one program per query head
        return TritonLaunch(False, cfg, (b, hq, num_splits), common, **scalars)
    tiles = cfg["head_tiles"]
    pdl = num_splits > 1 and combine_as_dependent(b * hkv * tiles * num_splits, device)
    constexprs = dict(common, GROUP_PAD=padded_rows(cfg["heads_per_program"]), HEAD_TILES=tiles, FP8_QK=fp8_qk,
                      FP8_PV=fp8_pv, ROUND_HW=arch is not None, COMPUTE=_COMPUTE[compute_dtype],
                      RESCALE_Q=rescale_q, PDL=pdl)
    return TritonLaunch(True, cfg, (b, hkv * tiles, num_splits), constexprs, **scalars)


def _outputs(q: torch.Tensor, launch: TritonLaunch) -> tuple[torch.Tensor, ...]:
    """The output and LSE the caller gets, and what the kernel writes: the same, or the split partials."""
    b, hq, d = q.shape
    out = torch.empty(b, hq, d, dtype=launch.kernel_out_dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if launch.cfg["num_splits"] == 1:
        return out, lse, out, lse
    return (out, lse, *split_partials(b, hq, launch.cfg["num_splits"], d, q.device))


def triton_arguments(q: torch.Tensor, cache: PagedKVCache, launch: TritonLaunch, sinks: torch.Tensor | None,
                     lse: torch.Tensor, k_out: torch.Tensor, k_lse: torch.Tensor) -> tuple:
    """The kernel's runtime arguments for ``q`` over ``cache``: it writes ``k_out`` / ``k_lse`` (the output and
    ``lse``, or the split partials); ``lse`` stands in for absent sinks."""
    if launch.cfg["num_splits"] == 1:
        so = (k_out.stride(0), k_out.stride(1), 0)
    else:
        so = (k_out.stride(0), k_out.stride(1), k_out.stride(2))
    sl = (k_lse.stride(0), k_lse.stride(1))
    skb, skt, skh = page_strides(cache)
    return (q, kernel_pages(cache, cache.k_pages, launch.fp8_k_values),
            kernel_pages(cache, cache.v_pages, launch.fp8_v_values), cache.k_scale, cache.v_scale,
            cache.block_table, cache.seq_lens, k_out, k_lse,
            launch.qk_scale, launch.cfg["tokens_per_split"], cache.num_kv_heads, cache.num_blocks,
            cache.max_blocks_per_seq * cache.block_size, launch.window, launch.soft_cap_log2,
            sinks if sinks is not None else lse,
            q.stride(0), q.stride(1), skb, skt, skh, cache.block_table.stride(0), *so, *sl)


def _kernel(launch: TritonLaunch):
    return paged_decode_kernel if launch.tensor_cores else paged_decode_cuda_core_kernel


def run_triton(q: torch.Tensor, cache: PagedKVCache, launch: TritonLaunch,
               sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the planned kernel (and the split combine) for ``q`` over ``cache``: out ``[B, Hq, D]`` and lse
    ``[B, Hq]`` fp32."""
    out, lse, k_out, k_lse = _outputs(q, launch)
    _kernel(launch)[launch.grid](*triton_arguments(q, cache, launch, sinks, lse, k_out, k_lse), **launch.constexprs)
    if launch.cfg["num_splits"] > 1:
        combine_splits(k_out, k_lse, out, lse, sinks, dependent=launch.constexprs.get("PDL", False))
    return out.to(launch.out_dtype), lse


def triton_residency(batch: int, cache: PagedKVCache, cfg: DecodeConfig, mode: str, group: int,
                     q_dtype: torch.dtype, device: torch.device, variants: dict) -> int:
    """The tensor-core Triton programs an SM of ``device`` holds for launch ``cfg`` with these ``variants``
    (window, soft_cap, sinks, convert, eviction_policy, compute_dtype): :func:`.splits.kernel_residency` of the kernel
    compiled for them, not run, for ``batch`` sequences (whether the combine is a dependent launch is compiled
    in). Keyed by what the kernel's constexprs follow, so that a launch seen before allocates nothing. The
    kernel compiled is the provisional launch's (the eight-wave splits); the planned one differs only in its
    split count, a runtime argument, unless that count is 1 (no partials) or changes the dependent launch."""
    flags = ("window", "soft_cap", "sinks")  # compiled in or out: their values are runtime arguments
    key = ("triton", mode, q_dtype, cache.kv_dtype, cache.granularity, cache.layout, cache.head_dim,
           cache.block_size, cache.num_kv_heads == 1, cache.k_scale.numel() > 1, group, cfg["num_splits"] > 1,
           cfg["num_splits"] > 1 and combine_as_dependent(
               batch * cache.num_kv_heads * cfg["head_tiles"] * cfg["num_splits"], device),
           tuple(sorted((k, v) for k, v in cfg.items() if k not in ("num_splits", "tokens_per_split"))),
           tuple(sorted((k, v is not None if k in flags else v) for k, v in variants.items())))


    def compile_kernel():
        # allocated, not filled: no kernel runs (a graph may be capturing)
        q = torch.empty(batch, group * cache.num_kv_heads, cache.head_dim, dtype=q_dtype, device=device)
        sinks = variants.get("sinks")
        launch = triton_launch(cache, cfg, mode, tensor_cores=True, batch=batch, num_q_heads=q.shape[1],
                               q_dtype=q_dtype, device=device, sm_scale=resolved_softmax_scale(None, cache.head_dim),
                               out_dtype=q_dtype, window=variants.get("window"), soft_cap=variants.get("soft_cap"),
                               sinks=sinks is not None, convert=variants.get("convert"),
                               eviction_policy=variants.get("eviction_policy") or "",
                               compute_dtype=variants.get("compute_dtype"))
        _, lse, k_out, k_lse = _outputs(q, launch)
        return _kernel(launch).warmup(*triton_arguments(q, cache, launch, sinks, lse, k_out, k_lse), grid=launch.grid,
                                      **launch.constexprs)

    return splits.kernel_residency(key, device, compile_kernel)
