"""The launch of :mod:`.kernel` over a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache`:
:func:`quant_decode_launch` fixes everything but the tensors (grid, constexprs, split count), :func:`run_quant_decode`
allocates the outputs and launches the kernel and, with splits, :mod:`fp8kv.ops.decode.combine`. No ``.item()``,
no host sync. Splits are sized by the FP8 decode's rule (:func:`fp8kv.ops.decode.splits.choose_num_splits`).

Under the Triton interpreter (CPU), whose bf16 arithmetic is wrong, a bf16 query is widened to fp32 by torch
(exact) and a bf16 output is stored in fp32 and rounded by torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from ... import checks
from ...cache.quantized import QuantizedPagedKVCache
from ...capability import interpreter_on
from ..decode.combine import combine_splits, split_partials
from ..decode.gluon_launcher import run_gluon
from ..decode.planning import DecodePlan, check_plan_inputs
from ..decode.splits import choose_num_splits, latency_waves, padded_rows, sm_count, whole_tile_splits
from ..decode.triton_launcher import CONVERT_CODES
from .kernel import FORMAT_INT4, FORMAT_INT8, FORMAT_MXFP4, FORMAT_NVFP4, quant_decode_kernel

__all__ = ["QUANT_DECODE_FORMATS", "QUANT_CONVERTS", "QUANT_LAUNCH_DEFAULTS", "QuantDecodeLaunch",
           "quant_decode_launch", "quant_decode_arguments", "run_quant_decode", "quant_launch_defaults"]

# format name -> the kernel's FORMAT
QUANT_DECODE_FORMATS = {"int8_token_head": FORMAT_INT8.value, "int4_token_head": FORMAT_INT4.value,
                        "nvfp4": FORMAT_NVFP4.value, "mxfp4": FORMAT_MXFP4.value}
# How code tiles become fp16 (fp8kv.ops.quant_decode.codes), named as the FP8 decode's conversions are: "cast"
# (integer-to-float conversions, a quarter-rate instruction per value), "software" (the codes' bits placed into
# fp16's fields) and "ptx" (the same bit moves on four codes per instruction; GPU only). The same values every way.
QUANT_CONVERTS = tuple(CONVERT_CODES)
# Each format's launch where the caller names none: the launch of `fp8kv bench --preset formats-tune --batches 64`
# (32k tokens; results/bench/nvidia-h100-80gb-hbm3/20261205T180924Z.csv, H100, every row checked) whose time,
# relative to the fastest row of its head layout, is lowest on average over 32/8/128 and 8/1/128 (the fastest of
# each where they agree: INT8 and MXFP4). The preset varies one option at a time around the previous defaults
# (software / ptx / cast, 64- or 128-token tiles, 1-3 stages, 8 warps); its time there against the previous
# default, at 32/8/128 and 8/1/128, in the comments (at B = 16, in the 32/8/128 rows of ...20261205T180156Z.csv,
# each change is faster than the previous default too). tests/test_quant_decode_defaults.py reads the file again.
QUANT_LAUNCH_DEFAULTS = {
    "int8_token_head": {"convert": "software", "block_n": 128, "num_warps": 4, "num_stages": 3},  # 0.93x, 0.99x
    "int4_token_head": {"convert": "ptx", "block_n": 128, "num_warps": 4, "num_stages": 1},  # 0.98x, 0.94x
    "nvfp4": {"convert": "ptx", "block_n": 64, "num_warps": 4, "num_stages": 2},  # 0.89x, 0.96x
    "mxfp4": {"convert": "ptx", "block_n": 128, "num_warps": 4, "num_stages": 1},  # 0.65x, 0.70x
}


def quant_launch_defaults(cache: QuantizedPagedKVCache) -> dict:
    """:data:`QUANT_LAUNCH_DEFAULTS` of the cache's format as this process runs them: tiles halved above head_dim
    128 (registers; not yet measured); under the Triton interpreter "software" for "ptx" (inline assembly it
    cannot run; the same values) and one stage."""
    launch = dict(QUANT_LAUNCH_DEFAULTS[cache.fmt.name])
    if cache.head_dim > 128:
        launch["block_n"] //= 2
    if interpreter_on():
        launch.update(convert="software" if launch["convert"] == "ptx" else launch["convert"], num_stages=1)
    return launch


class QuantDecodeLaunch(NamedTuple):
    """A planned launch of :func:`.kernel.quant_decode_kernel`: everything but the tensors."""
    grid: tuple[int, int, int]
    constexprs: dict
    qk_scale: float  # sm_scale x log2(e)
    num_splits: int
    tokens_per_split: int
    widen_query: bool  # the interpreter's bf16: the query is widened to fp32 by torch first
    out_dtype: torch.dtype  # what the caller gets
    kernel_out_dtype: torch.dtype  # what the kernel stores
    convert: str  # how code tiles become fp16 (QUANT_CONVERTS)
    inputs: tuple = ()  # fp8kv.ops.decode.planning.plan_inputs of what it was planned for: run refuses anything else

    @property
    def block_n(self) -> int:
        return self.constexprs["BLOCK_N"]


def quant_decode_launch(cache: QuantizedPagedKVCache, *, batch: int, num_q_heads: int, q_dtype: torch.dtype,
                        device: torch.device, sm_scale: float, out_dtype: torch.dtype, num_splits: int | None,
                        block_n: int | None, convert: str | None = None,
                        num_warps: int | None = None, num_stages: int | None = None) -> QuantDecodeLaunch:
    """The launch for ``batch`` queries of ``num_q_heads`` heads over ``cache`` (arguments already checked by
    :func:`fp8kv.ops.quant_decode.paged_decode_quantized`): ``num_splits`` (the FP8 decode's rule) / ``block_n`` /
    ``convert`` / ``num_warps`` / ``num_stages`` None for the format's defaults (:func:`quant_launch_defaults`)."""
    hkv, d = cache.num_kv_heads, cache.head_dim
    group = num_q_heads // hkv
    given = {"convert": convert, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
    launch = {k: v if given[k] is None else given[k] for k, v in quant_launch_defaults(cache).items()}
    convert, block_n = launch["convert"], launch["block_n"]
    capacity = cache.max_blocks_per_seq * cache.block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, hkv, capacity, block_n, sm_count(device), min_waves=latency_waves(d))
    num_splits, tokens_per_split = whole_tile_splits(capacity, num_splits, block_n)
    interp = interpreter_on()
    widen = interp and q_dtype == torch.bfloat16
    c = d // 2 if cache.fmt.key.packed else d
    constexprs = dict(GROUP=group, GROUP_PAD=padded_rows(group), HEAD_DIM=d, C=c,
                      C_PAD=max(16, triton.next_power_of_2(c)), BLOCK_SIZE=cache.block_size, BLOCK_N=block_n,
                      SPLIT=num_splits > 1, FORMAT=QUANT_DECODE_FORMATS[cache.fmt.name],
                      RESCALE_Q=q_dtype != torch.float16, CONVERT=CONVERT_CODES[convert],
                      num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    kernel_out = torch.float32 if interp and out_dtype == torch.bfloat16 else out_dtype
    return QuantDecodeLaunch((batch, hkv, num_splits), constexprs, sm_scale * math.log2(math.e), num_splits,
                             tokens_per_split, widen, out_dtype, kernel_out, convert)


def _scales(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t  # e4m3 / e8m0 scales are read as their bits


def _scale_strides(ks: torch.Tensor, vs: torch.Tensor) -> tuple[int, int, int]:
    """The block, token and head strides the kernel reads both scale arrays with. It takes one set for K and V,
    reads each token's scales as consecutive elements, and tells Triton they start at a multiple of the
    largest power of two dividing their count (the FP4 scales then load as one vector): what contiguous arrays
    give. A stride of a size-1 dimension never moves an address (its index is 0), so it is not compared;
    anything else that breaks this is refused by name, never read wrong."""
    count = ks.shape[-1]
    align = count & -count

    def used(t: torch.Tensor) -> list[int]:  # block, token, head strides; 0 for a size-1 dimension
        return [stride if size > 1 else 0 for size, stride in zip(t.shape[:3], t.stride()[:3], strict=True)]

    for name, t in (("k_scales", ks), ("v_scales", vs)):
        if (count > 1 and t.stride(-1) != 1) or any(stride % align for stride in used(t)):
            checks.fail(f"{name} has strides {tuple(t.stride())} for shape {tuple(t.shape)}; the kernel reads "
                        "contiguous scales (call .contiguous() on them and plan again)")
    k_used = used(ks)
    if k_used != used(vs):
        checks.fail(f"k_scales has strides {tuple(ks.stride())} and v_scales {tuple(vs.stride())}; the kernel reads "
                    "both with one set of strides (call .contiguous() on them and plan again)")
    return tuple(k_used)


def quant_decode_arguments(q: torch.Tensor, cache: QuantizedPagedKVCache, launch: QuantDecodeLaunch, out: torch.Tensor,
                           lse: torch.Tensor) -> list:
    """The kernel's runtime arguments, in its order, for ``q`` over ``cache`` writing ``out`` and ``lse`` (the
    final ones, or the split partials of :func:`~fp8kv.ops.decode.combine.split_partials`)."""
    so = (out.stride(0), out.stride(1), out.stride(2) if launch.num_splits > 1 else 0)
    ks, vs = _scales(cache.k_scales), _scales(cache.v_scales)
    k_ts = cache.k_tensor_scale if cache.k_tensor_scale is not None else ks
    v_ts = cache.v_tensor_scale if cache.v_tensor_scale is not None else vs
    cp, sp = cache.k_pages.stride(), _scale_strides(ks, vs)
    return [q, cache.k_pages, cache.v_pages, ks, vs, k_ts, v_ts, cache.block_table, cache.seq_lens, out, lse,
            launch.qk_scale, launch.tokens_per_split, cache.num_blocks, cache.max_blocks_per_seq * cache.block_size,
            q.stride(0), q.stride(1), cp[0], cp[1], cp[2], sp[0], sp[1], sp[2], cache.block_table.stride(0), *so,
            lse.stride(0), lse.stride(1)]


def run_quant_decode(q: torch.Tensor, cache: QuantizedPagedKVCache,
                     launch: QuantDecodeLaunch | DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the planned kernel (and the split combine) for ``q`` ``[B, Hq, D]`` over ``cache``: out ``[B, Hq, D]``
    (the launch's out_dtype) and lse ``[B, Hq]`` fp32 (natural log). A :class:`~fp8kv.ops.decode.DecodePlan` is the
    Gluon kernel's (INT8 and INT4 per token and head). ``q`` and ``cache`` must be what it was planned for
    (:func:`~fp8kv.ops.decode.planning.check_plan_inputs`: metadata only, no host sync)."""
    if not isinstance(launch, (QuantDecodeLaunch, DecodePlan)):
        checks.fail(f"launch must be a plan_decode_quantized launch, got {type(launch).__name__}", TypeError)
    check_plan_inputs(launch.inputs, q, cache)
    if isinstance(launch, DecodePlan):
        return run_gluon(q, cache, launch.config, launch.launch, launch.sm_scale, launch.out_dtype)
    if launch.widen_query:
        q = q.to(torch.float32)
    b, hq, d = q.shape
    out = torch.empty(b, hq, d, dtype=launch.kernel_out_dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if launch.num_splits > 1:
        k_out, k_lse = split_partials(b, hq, launch.num_splits, d, q.device)
    else:
        k_out, k_lse = out, lse
    quant_decode_kernel[launch.grid](*quant_decode_arguments(q, cache, launch, k_out, k_lse), **launch.constexprs)
    if launch.num_splits > 1:
        combine_splits(k_out, k_lse, out, lse)
    return out.to(launch.out_dtype), lse
