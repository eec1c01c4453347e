"""Host launchers for the Triton kernels: launch configuration, allocation, grid, dispatch.

A decode call launches the decode kernel (and the split combine) and nothing else: scales are read
in place and the fp8-mode query is quantized inside the kernel. No ``.item()``, no host sync, so
:func:`paged_decode` (and :func:`write_cache` with ``check=False, count_saturated=False``) can be
captured in a CUDA graph. The query, the cache and the scalars are validated by ``fp8kv.decode``, the entry point;
the launchers validate only the launch options they alone take. The kernels clamp block-table
entries and sequence lengths to the page pool, so even a table corrupted after validation cannot
make them read or write outside it.

Under the Triton interpreter (CPU), whose bf16 arithmetic and bf16 rounding are wrong, anything
that would be computed or stored in bf16 runs in fp32 and is rounded to bf16 by torch.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import checks, launch_table
from .cache import PagedKVCache
from .capability import UnsupportedError, check_query, current_arch, interpreter_on
from .device import gpu_slug
from .formats import UNQUANTIZED_DTYPES, saturation_bounds
from .kernels.cache_write import cache_write_kernel
from .kernels.copy import copy_kernel
from .kernels.paged_decode import (
    CONVERT_CAST,
    CONVERT_PTX,
    CONVERT_SOFTWARE,
    SCALE_CHANNEL,
    SCALE_PER_HEAD,
    SCALE_TOKEN_HEAD,
    combine_splits_kernel,
    paged_decode_kernel,
)
from .kernels.paged_decode_cuda_core import paged_decode_cuda_core_kernel

__all__ = ["paged_decode", "decode_launch", "decode_kernel", "gluon_refusal", "gluon_launch", "write_cache",
           "choose_num_splits", "launch_config", "DecodeConfig", "default_config", "stream_copy",
           "MAX_HEADS_PER_PROGRAM", "latency_waves", "combine_as_dependent"]

_SCALE_KIND = {"tensor": SCALE_PER_HEAD.value, "head": SCALE_PER_HEAD.value, "channel": SCALE_CHANNEL.value,
               "token_head": SCALE_TOKEN_HEAD.value}
_CONVERT = {"cast": CONVERT_CAST.value, "software": CONVERT_SOFTWARE.value, "ptx": CONVERT_PTX.value}
# Inline PTX conversion: 704 us vs 949 us for Triton's cast (H200, B=64, ctx=16k, Hq=32, Hkv=8, D=128,
# page 16, e4m3): the cast path stages FP8 tiles in shared memory and converts after the dot-operand
# load; converting in registers right after the global load does not.
DEFAULT_SM89_CONVERT = "ptx"
# mode -> (FP8 query and QKᵀ dot, FP8 probabilities and P·V dot)
_MODE_FLAGS = {"dequant": (False, False), "fp8": (True, True)}
_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
OUT_DTYPES = tuple(UNQUANTIZED_DTYPES.values())  # fp16, bf16, fp32: what the kernels store
WARP_COUNTS = launch_table.WARP_COUNTS  # the num_warps a Triton launch may ask for
MAX_BLOCK_N = launch_table.MAX_BLOCK_N  # the most tokens per tile


@functools.cache
def _gpu(device: torch.device) -> str | None:
    """The GPU's slug for the launch table (None off CUDA)."""
    return gpu_slug(device) if device.type == "cuda" else None


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Launch parameters of the decode kernel, by name: block_n, num_warps, num_stages, and from
# launch_config also num_splits and tokens_per_split (all ints).
DecodeConfig = dict[str, int]


def default_config(mode: str, kv_fp8: bool, head_dim: int, *, use_tensor_cores: bool = True,
                   gpu: str | None = None, group_pad: int = 16) -> DecodeConfig:
    """Tile and launch defaults (BLOCK_N >= 32: the FP8 dot's minimum K for P·V).

    Tensor cores on a ``gpu`` (slug) whose measured table (:mod:`fp8kv.launch_table`, written by
    ``python -m fp8kv.bench.tune``) holds this shape (``group_pad``: the program's padded query
    rows): the table's entry. Otherwise the rule below.

    Tensor cores, measured on an H200 (B=64, ctx=16k, Hq=32, Hkv=8, D=128, page 16): FP8 caches are
    fastest with 128-token tiles (704 us vs 947 us at 64), 16-bit caches with 64-token tiles (979 vs
    1072 us): the same 16 KiB per K tile. At D=64 that size is 128 16-bit tokens (12/4/64: 268 vs
    317 us; 14/2/64: 144 vs 177 us). 8 warps were slower in every configuration tried, 2 warps
    spill. A program of 128 FP8 rows at D <= 64 (a large MQA group in one program) takes 64-token tiles
    (71/1/64, B = 64 x 16k, 4 and 8 splits: 146.1 and 152.8 us against 156.1 and 162.7 in 128-token tiles;
    ``results/bench/nvidia-h200/20261204T182900Z-splits.json``). FP8 tiles use 2 pipeline stages: at 3 the
    single-split kernel needs 164 registers instead of 128 (3 CTAs per SM instead of 4; B=256: 2985 us vs
    2599 us), and split kernels time the same.

    CUDA cores (one query head per program): the per-slot state holds BLOCK_N x D fp32 values;
    32 x 128 over 128 threads is 32 registers a thread.
    """
    interp = interpreter_on()
    if not use_tensor_cores:
        return dict(block_n=32, num_warps=4, num_stages=1 if interp else 2)
    measured = None if interp else launch_table.lookup(gpu, kv_fp8, mode, head_dim, group_pad)
    if measured is not None:
        return measured
    block_n = 128 if kv_fp8 or head_dim <= 64 else 64
    if head_dim > 128 or (kv_fp8 and head_dim <= 64 and group_pad >= 128):
        block_n //= 2
    stages = 1 if interp else (2 if kv_fp8 else 3)
    return dict(block_n=block_n, num_warps=4, num_stages=stages)


# Query heads one tensor-core program takes at most in a latency-bound launch (:func:`latency_bound`): larger
# groups (Falcon-7B's 71 per KV head) are cut into several programs per KV head. H200, 71/1/64 FP8: B=1 x 4k
# 7.3 us in two programs of 36 against 9.9 us in one of 71 (16k: 10.5 vs 14.6 us). Bandwidth-bound, a group of
# up to MAX_HEADS_STREAMING at head dims up to MAX_STREAMING_HEAD_DIM runs in one program, which converts each
# FP8 tile once: B=64 x 16k, 64-token tiles, 8 splits, 152.8 us in one program of 71 heads against 162.4-213.5
# in two of 36 at 4-16 splits (``results/bench/nvidia-h200/20261204T182900Z-splits.json``); with the default
# launch 153.4 against 177.7 us, at B=16 x 16k 48.5 against 54.3 (``...20261204T184750Z-fill-waves.json``).
# Programs of 16 or 24 heads were slower at B=64 (78-304 us).
MAX_HEADS_PER_PROGRAM = 64
MAX_HEADS_STREAMING = 128
# ... at head dims up to this: at 128 columns, 128 rows of scores and output in 128-token tiles would take 256
# fp32 registers a thread (not tried)
MAX_STREAMING_HEAD_DIM = 64
MAX_SPLITS_FOR_LATENCY = 64  # at most this many one-tile splits (the combine holds splits x D partials)
# ... unless that leaves SMs idle (B x Hkv x head tiles x 64 < SMs: MQA at B <= 2): then up to 128. H200,
# B=1 x 16k FP8: 8/1/256 14.6 us with 128 splits against 21.0 us with 64; 8/1/128 9.6 against 12.1 us;
# 32/8/256 (512 programs already) 49.7 against 45.6 us, so the cap stays where the SMs are busy.
MAX_SPLITS_TO_FILL_SMS = 128


def padded_rows(heads_per_program: int) -> int:
    """The tensor-core kernel's GROUP_PAD: a program's query heads padded to a power of two, at least
    tl.dot's 16 rows (also the launch table's key, :func:`fp8kv.launch_table.entry_key`)."""
    return max(16, triton.next_power_of_2(heads_per_program))


# Waves of programs the latency rule of choose_num_splits fills (its min_waves), by head dim: four where it is
# a power of two, two where the Triton kernel pads it to one (latency_waves).
LATENCY_WAVES, LATENCY_WAVES_PADDED = 4.0, 2.0


def latency_waves(head_dim: int) -> float:
    """``min_waves`` of :func:`choose_num_splits`'s latency rule at ``head_dim``: :data:`LATENCY_WAVES`
    where it is a power of two, :data:`LATENCY_WAVES_PADDED` elsewhere. Measured with the Triton
    tensor-core kernel on an H200, FP8, B 1-4 x 1000-4096 (``scripts/split_rule_probe.py``): in
    ``results/bench/nvidia-h200/20261204T151534Z-split-rule.csv`` head dims 80, 96 and 112 (padded to a power
    of two in the kernel's tiles) were slower with four waves at all 5 points whose count changed (32/32/80,
    4 x 1000: 22.6 against 18.4 us; 32/32/96, 1 x 4k: 22.7 against 20.6; 32/8/112, 4 x 4k: 23.2 against
    21.5), while 32/32/128 at 1 x 4k took 18.3 against 21.1 us; in ``...103759Z-split-rule.csv`` 3 of the
    5 changed points (all at D = 128) were 1.18x faster, the other two within 1 %. The Gluon and CUDA-core
    launches size their splits with the same rule (not measured separately)."""
    return LATENCY_WAVES if head_dim & (head_dim - 1) == 0 else LATENCY_WAVES_PADDED


def resident_programs(registers: int, shared_bytes: int, num_warps: int, *, regs_per_sm: int = 65536,
                      smem_per_sm: int = 233472, threads_per_sm: int = 2048, max_programs: int = 32) -> int:
    """Programs of a compiled kernel (``registers`` a thread, ``shared_bytes``, ``num_warps``) that one SM holds at
    once, by the occupancy rules of sm80-sm90: registers are allocated per warp in units of 256, each of the
    SM's four sub-partitions holding whole warps of a quarter of its registers, and 1 KiB of shared memory is
    reserved per program, and an SM runs at most ``max_programs``. The defaults are an H100 / H200 SM
    (:func:`kernel_residency` reads the GPU's registers, shared memory and threads)."""
    per_warp = -(-registers * 32 // 256) * 256
    warps = 4 * (regs_per_sm // 4 // per_warp)
    return max(1, min(warps // num_warps, threads_per_sm // (32 * num_warps), smem_per_sm // (shared_bytes + 1024),
                      max_programs))


_RESIDENCY: dict = {}


def kernel_residency(key, device: torch.device, compile_kernel) -> int:
    """:func:`resident_programs` of the kernel ``compile_kernel()`` compiles (a Triton ``warmup``: the
    compiled kernel, not launched) on ``device``, computed once per ``key`` and device. The key is what the
    kernel's constexprs follow; Triton also specialises on runtime integers (equal to 1, multiples of 16),
    which the keys leave out but for one KV head: the first launch of a key stands for the rest."""
    index = torch.cuda.current_device() if device.index is None else device.index
    key = (key, index)
    if key not in _RESIDENCY:
        with torch.cuda.device(index):
            kernel = compile_kernel()
            kernel._init_handles()  # loads the binary: the registers ptxas gave it
        p = torch.cuda.get_device_properties(device)
        _RESIDENCY[key] = resident_programs(kernel.n_regs, kernel.metadata.shared, kernel.metadata.num_warps,
                                            regs_per_sm=getattr(p, "regs_per_multiprocessor", 65536),
                                            smem_per_sm=p.shared_memory_per_multiprocessor,
                                            threads_per_sm=p.max_threads_per_multi_processor)
    return _RESIDENCY[key]


# A bandwidth-bound launch may take up to this many times fewer splits than the rule's eight waves ask for,
# to fill the GPU's resident program slots (fill_waves).
FILL_WAVES_FEWER = 4


def fill_waves(programs_per_split: int, splits: int, slots: int, capacity: int, block_n: int) -> int:
    """The split count, from ``splits / FILL_WAVES_FEWER`` to ``splits``, whose programs fill the ``slots``
    (SMs x :func:`resident_programs`) best: with every sequence as long as the capacity all programs take the
    same time, so ``w`` waves of slots take ``ceil(w)`` waves' time, and the count with the highest
    ``w / ceil(w)`` wastes the least of its last wave (ties: the fewest splits, each program's prologue and
    partial output being fixed costs). Only counts of more than one wave are taken (or ``splits`` itself):
    in a single wave nothing fills the slots that the programs of short sequences leave. Counts are taken as
    :func:`launch_config` realises them (whole tiles per split), which can fall just below a quarter.

    Measured on an H200, FP8, 132 SMs, before / after in one call (``scripts/fill_waves_probe.py``,
    ``results/bench/nvidia-h200/20261204T184750Z-fill-waves.json``): B = 64 x 16k, the Gluon kernel at 8/1/256 (2
    programs an SM, 128 a split) 186.6 -> 157.8 us (9 -> 4 splits: 4.36 -> 1.94 waves), 28/4/128 308.2 -> 281.0
    (5 -> 3); at B = 16 x 16k 8/1/256 79.3 -> 59.4, 32/8/128 158.1 -> 149.7; 16/16/256 at B = 4 x 16k 170.3 ->
    147.6; none of the 24 points (6 layouts) slower by more than 0.2 %. With lengths drawn from 1 to 16k
    (B = 64) the new counts took 0.93-1.00x the time. A single wave (14/2/64 in 5 splits, 0.97 waves;
    ``...20261204T183700Z-fill-waves-variants.json``) was 1.08x faster at full lengths but 1.23x slower at
    drawn ones, hence more than one wave."""
    best, best_fill = splits, -1.0
    counts = range(math.ceil(splits / FILL_WAVES_FEWER), splits + 1)
    for s in sorted({whole_tile_splits(capacity, s, block_n)[0] for s in counts}):
        waves = programs_per_split * s / slots
        fill = waves / math.ceil(waves)
        if waves > 1 and fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def whole_tile_splits(capacity: int, splits: int, block_n: int) -> tuple[int, int]:
    """``splits`` as a launch realises it over ``capacity`` tokens: (splits, tokens per split), each split a
    whole number of ``block_n``-token tiles, so that none is empty."""
    tokens = triton.cdiv(triton.cdiv(capacity, splits), block_n) * block_n
    return max(1, triton.cdiv(capacity, tokens)), tokens


def _bandwidth_splits(base: int, tiles: int, num_sms: int, waves: float, min_tiles_per_split: int) -> int:
    return max(1, min(math.ceil(waves * num_sms / base), math.ceil(tiles / min_tiles_per_split)))


def latency_bound(batch: int, kv_heads: int, capacity: int, block_n: int, num_sms: int, waves: float = 8.0,
                  min_tiles_per_split: int = 4, min_waves: float = LATENCY_WAVES) -> bool:
    """Whether the eight-wave split count of :func:`choose_num_splits` (same arguments) leaves fewer than
    ``min_waves`` x ``num_sms`` programs (small batches, short contexts), which it then raises where the context
    has tiles enough."""
    base = batch * kv_heads
    tiles = math.ceil(capacity / block_n)
    return _bandwidth_splits(base, tiles, num_sms, waves, min_tiles_per_split) * base < min_waves * num_sms


def choose_num_splits(batch: int, kv_heads: int, capacity: int, block_n: int, num_sms: int,
                      waves: float = 8.0, min_tiles_per_split: int = 4, min_waves: float = LATENCY_WAVES,
                      slots: int | None = None) -> int:
    """Split-KV factor from the launch shape (flash-decoding).

    Enough (sequence, KV head, split) programs to fill ``waves`` x ``num_sms`` slots, but no split
    shorter than ``min_tiles_per_split`` tiles (the split's prologue and the combine would then
    weigh). Eight waves: on an H200 at B=16, ctx=16k (128 sequence-heads) 9 splits take 176 us, 5
    splits 196 us. Where that leaves fewer than ``min_waves`` x ``num_sms`` programs (small batch and
    short context: latency-bound), splits go down to one tile each until there are: H200, 32/8/128,
    B=1 x 4k FP8: 32 one-tile splits 10.5 us against 15.4 us for 8 four-tile splits; B=3 x 1000:
    8 splits 9.6 us against 15.0 us for 2. Four waves rather than two at power-of-two head dims
    (:func:`launch_config` passes :func:`latency_waves`; ``scripts/split_rule_probe.py``,
    ``results/bench/nvidia-h200/20261204T103759Z-split-rule.csv``): the five of 28 latency-bound points
    whose count changes took 1.18-1.19x less time where it doubled (32/32/128 at 1 x 4k 21.3 -> 18.0 us,
    32/8/128 and 40/8/128 at 4 x 4k 21.7 -> 18.3 and 21.9 -> 18.6 us) and 1.01x at the other two; the
    rest kept their count. Contexts of fewer than four tiles stay in one split, and
    the increase stops at :data:`MAX_SPLITS_FOR_LATENCY`, or at :data:`MAX_SPLITS_TO_FILL_SMS` where
    that many would leave SMs without a program (MQA at batch 1-2); no count exceeds the latter. The
    count is what is asked for;
    :func:`launch_config` rounds it to whole tiles per split. Given the GPU's resident program ``slots``
    (SMs x :func:`resident_programs` of the kernel), a count that is not raised for latency is then made
    to fill the slots' waves (:func:`fill_waves`).
    """
    for name, v in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity), ("block_n", block_n),
                    ("num_sms", num_sms)):
        checks.positive_int(v, name)
    base = batch * kv_heads
    tiles = math.ceil(capacity / block_n)
    splits = _bandwidth_splits(base, tiles, num_sms, waves, min_tiles_per_split)
    latency = latency_bound(batch, kv_heads, capacity, block_n, num_sms, waves, min_tiles_per_split, min_waves)
    if latency and tiles >= min_tiles_per_split:
        cap = MAX_SPLITS_FOR_LATENCY if base * MAX_SPLITS_FOR_LATENCY >= num_sms else MAX_SPLITS_TO_FILL_SMS
        splits = max(splits, min(math.ceil(min_waves * num_sms / base), tiles, cap))
    # The combine holds splits x D partials per program: no rule asks for more than it was measured with
    # (one sequence and one KV head at 1M tokens would otherwise ask for 1056).
    splits = min(splits, MAX_SPLITS_TO_FILL_SMS)
    if slots is not None and not latency:
        splits = fill_waves(base, splits, slots, capacity, block_n)
    return int(splits)


def _split_span(cache: PagedKVCache, window: int | None) -> int:
    """The tokens a decode's splits tile: the page table's capacity, or a shorter window."""
    capacity = cache.max_blocks_per_seq * cache.block_size
    return capacity if window is None else min(capacity, window)


def _fills_waves(batch: int, cache: PagedKVCache, cfg: DecodeConfig, head_parts: int, window: int | None,
                 num_sms: int) -> bool:
    """Whether the programs an SM holds can change launch ``cfg``'s split count: a launch that is not
    :func:`latency_bound` (only those fill waves), so that a latency-bound one compiles nothing to find out."""
    return not latency_bound(batch, cache.num_kv_heads * cfg["head_tiles"] * head_parts, _split_span(cache, window),
                             cfg["block_n"], num_sms, min_waves=latency_waves(cache.head_dim))


def launch_config(batch: int, cache: PagedKVCache, mode: str = "dequant", *, num_splits: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  device: torch.device | None = None, window: int | None = None,
                  use_tensor_cores: bool = True, group: int | None = None,
                  heads_per_program: int | None = None, head_parts: int = 1, num_sms: int | None = None,
                  programs_per_sm: int | None = None) -> DecodeConfig:
    """The launch :func:`paged_decode` uses for ``batch`` sequences of ``cache``: defaults plus overrides.

    Returns block_n, num_warps, num_stages, num_splits, tokens_per_split (a multiple of block_n;
    num_splits is recomputed from it so that no split is empty by construction of the grid),
    head_tiles and heads_per_program. With a sliding ``window`` the splits tile the window, not the
    page table: the span is ``min(window, capacity)``. ``use_tensor_cores``: the kernel the launch is
    for (False: the CUDA-core kernel, which runs one program per query head, so its splits are sized
    for ``group`` x Hkv programs per sequence). ``group``: query heads per KV head (required for the
    CUDA-core kernel; default 1). ``heads_per_program`` (tensor cores): at most this many query heads
    of a group per program (default :data:`MAX_HEADS_PER_PROGRAM`, or a whole group of up to
    :data:`MAX_HEADS_STREAMING` at head dims up to :data:`MAX_STREAMING_HEAD_DIM` where the launch is not
    :func:`latency_bound`); a larger group is cut into
    ``head_tiles`` programs of ``heads_per_program = ceil(group / head_tiles)`` heads each.
    ``head_parts``: programs per head tile (the Gluon kernel cuts a head_dim above 128 into two), counted
    with them when the splits are sized. ``num_sms``: the GPU's SMs the splits fill (None: the device's).
    ``programs_per_sm``: the kernel's resident programs an SM (:func:`resident_programs`), with which a
    bandwidth-bound split count fills whole waves (:func:`fill_waves`); None: the count of
    :func:`choose_num_splits` alone.
    """
    if not isinstance(cache, PagedKVCache):
        checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
    batch = checks.positive_int(batch, "batch")
    checks.one_of(mode, "mode", tuple(_MODE_FLAGS))
    if not isinstance(use_tensor_cores, bool):
        checks.fail(f"use_tensor_cores={use_tensor_cores!r}; expected True or False", TypeError)
    if window is not None:
        window = checks.integer(window, "window", minimum=1)
    if not use_tensor_cores:
        if mode == "fp8":
            raise ValueError("use_tensor_cores=False with mode='fp8': FP8 arithmetic runs on tensor cores; "
                             "use mode='dequant' for the CUDA-core kernel")
        if group is None:
            raise ValueError("group (query heads per KV head) is required with use_tensor_cores=False: the "
                             "CUDA-core kernel runs one program per query head")
        if heads_per_program is not None:
            raise ValueError(f"heads_per_program={heads_per_program!r} with use_tensor_cores=False: the CUDA-core "
                             "kernel runs one query head per program")
    group = 1 if group is None else checks.positive_int(group, "group")
    if programs_per_sm is not None:
        programs_per_sm = checks.positive_int(programs_per_sm, "programs_per_sm")
    if block_n is not None:
        block_n = checks.positive_int(block_n, "block_n")
    capacity = _split_span(cache, window)
    sms = _num_sms(device or cache.device) if num_sms is None else checks.positive_int(num_sms, "num_sms")
    gpu = _gpu(device or cache.device)

    def defaults(heads: int) -> DecodeConfig:
        return default_config(mode, cache.is_fp8, cache.head_dim, use_tensor_cores=use_tensor_cores, gpu=gpu,
                              group_pad=padded_rows(heads))

    if heads_per_program is None:
        heads_per_program = MAX_HEADS_PER_PROGRAM
        if use_tensor_cores and cache.head_dim <= MAX_STREAMING_HEAD_DIM and \
                MAX_HEADS_PER_PROGRAM < group <= MAX_HEADS_STREAMING and not latency_bound(
                batch, cache.num_kv_heads, capacity, block_n or defaults(group)["block_n"], sms,
                min_waves=latency_waves(cache.head_dim)):
            heads_per_program = group
    heads_per_program = min(checks.positive_int(heads_per_program, "heads_per_program"), group)
    head_tiles = math.ceil(group / heads_per_program) if use_tensor_cores else 1
    head_parts = checks.positive_int(head_parts, "head_parts")
    cfg = defaults(math.ceil(group / head_tiles))
    block_n = cfg["block_n"] if block_n is None else block_n
    if num_splits is not None:
        num_splits = checks.positive_int(num_splits, "num_splits")
    if num_warps is not None:
        checks.one_of(checks.integer(num_warps, "num_warps"), "num_warps", WARP_COUNTS)
    if num_stages is not None:
        num_stages = checks.positive_int(num_stages, "num_stages")
    if mode == "fp8" and block_n < 32:
        raise ValueError(f"block_n={block_n}: fp8 mode needs block_n >= 32 (FP8 dot minimum K)")
    least = 16 if use_tensor_cores else 1  # tl.dot's minimum; the CUDA-core kernel takes any power of two
    if block_n < least or block_n > MAX_BLOCK_N or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two in [{least}, {MAX_BLOCK_N}]")
    if num_splits is None:
        programs = cache.num_kv_heads * (head_tiles * head_parts if use_tensor_cores else group)  # per sequence, split
        slots = None if programs_per_sm is None else sms * programs_per_sm
        num_splits = choose_num_splits(batch, programs, capacity, block_n, sms, min_waves=latency_waves(cache.head_dim),
                                       slots=slots)
    num_splits, tokens_per_split = whole_tile_splits(capacity, num_splits, block_n)
    return dict(block_n=block_n, num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
                num_splits=num_splits, tokens_per_split=tokens_per_split,
                head_tiles=head_tiles, heads_per_program=math.ceil(group / head_tiles) if use_tensor_cores else 1)


def _converts(convert: str | None, arch: str | None) -> tuple[str, str]:
    """The K and V tile conversions of dequant mode, from ``convert`` ("name" or "K/V") and the arch."""
    sm = int(arch[2:]) if arch else None
    if convert is None:
        convert = "cast" if sm is None else ("software" if sm < 89 else DEFAULT_SM89_CONVERT)
    if not isinstance(convert, str):
        raise TypeError(f"convert must be a str such as 'ptx' or 'cast/ptx', got {type(convert).__name__}")
    names = convert.split("/")
    if len(names) == 1:
        names *= 2
    if len(names) != 2 or not set(names) <= set(_CONVERT):
        raise ValueError(f"convert={convert!r}; expected one of {tuple(_CONVERT)}, or 'K/V' with one per tile")
    for name in names:
        if name != "software" and sm is not None and sm < 89:
            raise UnsupportedError(f"convert={name!r} needs FP8 conversion instructions (sm89+); {arch} has none")
        if name == "ptx" and arch is None:
            raise UnsupportedError("convert='ptx' is inline GPU assembly: the Triton interpreter cannot run it")
    return names[0], names[1]


def _scale_kind(cache: PagedKVCache) -> int:
    return _SCALE_KIND[cache.granularity] if cache.is_fp8 else SCALE_PER_HEAD.value


def _kernel_pages(cache: PagedKVCache, pages: torch.Tensor, fp8_values: bool = False) -> torch.Tensor:
    """Pages as the kernels read them: FP8 as uint8 codes (Triton has no e4m3 before sm89), or as
    FP8 values where the kernel feeds them to Triton's own conversion or FP8 dot."""
    return pages.view(torch.uint8) if cache.is_fp8 and not fp8_values else pages


def _format_bits(cache: PagedKVCache) -> dict:
    """MANT / BIAS constexprs of the cache's FP8 format (unused, 0, for 16-bit caches)."""
    fmt = cache.fmt
    return dict(MANT=fmt.mantissa_bits if fmt else 0, BIAS=fmt.bias if fmt else 0)


def _page_strides(cache: PagedKVCache):
    s = cache.k_pages.stride()
    return (s[0], s[1], s[2]) if cache.layout == "NHD" else (s[0], s[2], s[1])


def paged_decode(q: torch.Tensor, cache: PagedKVCache, *, mode: str = "dequant", sm_scale: float | None = None,
                 num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, convert: str | None = None, eviction_policy: str = "",
                 out_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                 window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                 use_tensor_cores: bool | None = None, heads_per_program: int | None = None,
                 gluon: bool | None = None):
    """Triton paged decode attention.

    The launcher behind ``fp8kv.decode(..., backend="triton")``, which validates ``q``, ``cache``,
    ``mode`` and ``sm_scale`` and checks capability; call that. Validated here: the launch options.

    Parameters
    ----------
    q : ``[B, Hq, D]`` bfloat16 / float16 (last dim contiguous), one query token per sequence.
    cache : :class:`~fp8kv.cache.PagedKVCache` (bf16 / fp16 / fp8_e4m3 / fp8_e5m2; NHD or HND).
    mode : ``"dequant"`` (FP8 → q's 16-bit type in registers) or ``"fp8"`` (FP8 query and probabilities,
        FP8 tensor cores; sm89+, tensor / head / channel scales).
    num_splits, block_n, num_warps, num_stages, heads_per_program : launch overrides (defaults from the
        shape; see :func:`launch_config`).
    convert : how dequant mode turns FP8 codes into 16-bit values: ``"software"`` (integer ops, any
        GPU; the default before sm89, where Triton has no e4m3), ``"cast"`` (Triton's conversion; the
        default under the interpreter) or ``"ptx"`` (inline ``cvt.rn.f16x2.e4m3x2``, sm89+); one
        name for both tiles, or ``"K/V"`` (such as ``"cast/ptx"``) for one per tile.
    eviction_policy : cache eviction hint of the K/V tile loads (``"evict_first"``: streamed once).
    out_dtype : output dtype (default q's).
    compute_dtype : 16-bit type of the dequant-mode dots. Default: float16 for FP8 caches (every
        e4m3/e5m2 value is exact in fp16, and sm89+ converts FP8 to fp16 in one instruction, while
        FP8 to bf16 takes several), else q's dtype. A bf16 query (and a query with per-channel K
        scales folded in) is rescaled per head by a power of two before it is rounded to fp16, so
        any finite bf16 query keeps fp16's precision and range (the factor is exact in the scores).
    use_tensor_cores : True or None (default): the ``tl.dot`` kernel (the query group padded to 16
        rows). False: the CUDA-core kernel (FMAs in fp32, one query head per program; dequant mode
        only), meant for groups of 1-2, where the padding wastes most of the dot. Opt-in: on an H200
        (``python -m fp8kv.bench --preset layouts-cuda-core``, B=64 x 16k, FP8) it is faster only at
        16/16/256 (2598 us against 3750 us), and slower at 32/32/128 (2831 vs 2583 us), 32/32/80 and
        /96 (3522 / 3570 vs 2990 us) and 16/8/128 (1188 vs 669 us).
    gluon : which kernel: None (default) picks the Gluon kernel
        (:mod:`fp8kv.kernels.paged_decode_gluon`: warps stream their own token slices, FP8 tiles
        converted in the tensor-core operand layout, copied through a cp.async ring) wherever it runs,
        no Triton launch override is given and each split holds GLUON_MIN_SPLIT_TOKENS tokens or more
        (1024; 512 for head dims above 128);
        else the Triton kernel (:func:`decode_launch` says which). True asks for the Gluon kernel and
        raises UnsupportedError by name outside its shapes: a CUDA GPU (sm89+), dequant mode, an FP8
        cache with one tensor-wide scale, NHD or HND pages, head_dim 48-256 in multiples of 16, any group (cut
        into programs of at most :func:`gluon_max_heads` query heads, or ``heads_per_program``), no
        variant; ``block_n`` 64 or 128 and ``num_stages`` its ring depth 2-4 (default:
        :func:`gluon_tile`), 4 warps. False: the Triton kernel. H200, B=64 x 16k, e4m3: 32/8/128
        533.8 us against 668.6 us for the Triton kernel in the same run, 32/32/128 2077.5 against 2556.9.
    window, soft_cap, sinks : attention variants, as :func:`fp8kv.reference.decode` defines them
        (checked by :func:`fp8kv.decode`; trusted here). A window reads only the window's pages;
        one at least as long as the page table is the plain kernel.

    Returns
    -------
    out ``[B, Hq, D]`` (out_dtype) and lse ``[B, Hq]`` fp32 (natural log). A sequence of length 0
    gives out = 0 and lse = -inf (with sinks: lse = the sink logit); the reference and FlashInfer
    refuse such a sequence instead.
    """
    ok, why = check_query("triton", q.dtype, cache.kv_dtype)  # 16-bit, and fp16 only over FP8 or fp16 pages
    if not ok:
        raise TypeError(why)
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last (head_dim) dimension; call .contiguous()")
    b, hq, d = q.shape
    group = hq // cache.num_kv_heads
    kernel, cfg = launch_for(b, cache, mode, group, q.device, q_dtype=q.dtype, gluon=gluon, num_splits=num_splits,
                             block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                             heads_per_program=heads_per_program, use_tensor_cores=use_tensor_cores,
                             window=window, convert=convert, eviction_policy=eviction_policy,
                             compute_dtype=compute_dtype, soft_cap=soft_cap, sinks=sinks)
    if kernel == "gluon":
        return _paged_decode_gluon(q, cache, sm_scale, cfg, out_dtype)
    launch = _triton_call(q, cache, cfg, mode, tensor_cores=kernel == "triton", sm_scale=sm_scale, out_dtype=out_dtype,
                          window=window, soft_cap=soft_cap, sinks=sinks, convert=convert,
                          eviction_policy=eviction_policy, compute_dtype=compute_dtype)
    launch.kernel[launch.grid](*launch.args, **launch.constexprs)
    if cfg["num_splits"] > 1:
        _combine_splits(launch.k_out, launch.k_lse, launch.out, launch.lse, sinks, dependent=launch.pdl)
    return launch.out.to(launch.out_dtype), launch.lse


class _TritonCall(NamedTuple):
    kernel: triton.runtime.JITFunction
    grid: tuple[int, int, int]
    args: tuple
    constexprs: dict
    out: torch.Tensor  # the output and LSE the caller gets (the kernel's, or the combine's with splits)
    lse: torch.Tensor
    k_out: torch.Tensor  # what the kernel writes: out / lse, or the split partials
    k_lse: torch.Tensor
    out_dtype: torch.dtype
    pdl: bool


def _triton_call(q: torch.Tensor, cache: PagedKVCache, cfg: DecodeConfig, mode: str, *, tensor_cores: bool,
                 sm_scale: float | None, out_dtype: torch.dtype | None, window: int | None, soft_cap: float | None,
                 sinks: torch.Tensor | None, convert: str | None, eviction_policy: str,
                 compute_dtype: torch.dtype | None) -> _TritonCall:
    """The Triton kernel's launch for a decode of ``q`` with ``cfg`` (tensor-core or CUDA-core kernel), its
    outputs allocated: what :func:`paged_decode` launches, and what :func:`_triton_residency` compiles."""
    if mode == "fp8" and cache.granularity == "token_head":
        raise UnsupportedError("fp8 mode takes tensor, head and channel scales; token_head needs dequant mode")
    if q.device.type != "cuda" and not interpreter_on():
        raise UnsupportedError("the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU")
    arch = current_arch(q.device) if q.device.type == "cuda" else None

    b, hq, d = q.shape
    group = hq // cache.num_kv_heads
    hkv = cache.num_kv_heads
    if window is not None and window >= cache.max_blocks_per_seq * cache.block_size:
        window = None  # no sequence can be longer: the plain kernel, compiled as without a window
    block_n, num_splits, tokens_per_split = cfg["block_n"], cfg["num_splits"], cfg["tokens_per_split"]
    convert_k, convert_v = _converts(convert, arch)
    fp8_qk, fp8_pv = _MODE_FLAGS[mode]
    if eviction_policy not in ("", "evict_first", "evict_last"):
        raise ValueError(f"eviction_policy={eviction_policy!r}; expected '', 'evict_first' or 'evict_last'")

    if compute_dtype is None:
        compute_dtype = torch.float16 if cache.is_fp8 else q.dtype
    if compute_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"compute_dtype must be torch.float16 or torch.bfloat16, got {compute_dtype}")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    rescale_q = compute_dtype == torch.float16 and not fp8_qk and (
        q.dtype != torch.float16 or cache.granularity == "channel")
    if interpreter_on():  # the interpreter's bf16 is wrong: compute and store in fp32 instead
        compute_dtype = torch.float32 if compute_dtype == torch.bfloat16 else compute_dtype
    kernel_out_dtype = torch.float32 if interpreter_on() and out_dtype == torch.bfloat16 else out_dtype
    out = torch.empty(b, hq, d, dtype=kernel_out_dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        k_out, k_lse = out, lse
        so = (out.stride(0), out.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1))
    else:
        k_out, k_lse = _split_partials(b, hq, num_splits, d, q.device)
        so = (k_out.stride(0), k_out.stride(1), k_out.stride(2))
        sl = (k_lse.stride(0), k_lse.stride(1))
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    # Soft-capping takes tanh of score / cap, computed from e^(2 score / cap): fold that into q·k's factor.
    qk_scale = sm_scale * math.log2(math.e) * (1.0 if soft_cap is None else 2.0 / soft_cap)
    skb, skt, skh = _page_strides(cache)
    args = (q, _kernel_pages(cache, cache.k_pages, fp8_qk or convert_k == "cast"),
            _kernel_pages(cache, cache.v_pages, fp8_pv or convert_v == "cast"), cache.k_scale, cache.v_scale,
            cache.block_table, cache.seq_lens, k_out, k_lse,
            qk_scale, tokens_per_split, hkv, cache.num_blocks, cache.max_blocks_per_seq * cache.block_size,
            window or 0, 0.0 if soft_cap is None else soft_cap * math.log2(math.e),
            sinks if sinks is not None else lse,
            q.stride(0), q.stride(1), skb, skt, skh, cache.block_table.stride(0), *so, *sl)
    common = dict(GROUP=group, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=cache.block_size,
                  BLOCK_N=block_n, SPLIT=num_splits > 1, SCALE_KIND=_scale_kind(cache),
                  SCALE_HEAD_STRIDE=int(cache.k_scale.numel() > 1), KV_FP8=cache.is_fp8,
                  CONVERT_K=_CONVERT[convert_k], CONVERT_V=_CONVERT[convert_v], KV_EVICTION=eviction_policy,
                  WINDOWED=window is not None, SOFT_CAP=soft_cap is not None, HAS_SINKS=sinks is not None,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_format_bits(cache))
    if not tensor_cores:  # one program per query head
        return _TritonCall(paged_decode_cuda_core_kernel, (b, hq, num_splits), args, common, out, lse, k_out, k_lse,
                           out_dtype, False)
    tiles = cfg["head_tiles"]
    pdl = num_splits > 1 and combine_as_dependent(b * hkv * tiles * num_splits, q.device)
    constexprs = dict(common, GROUP_PAD=padded_rows(cfg["heads_per_program"]), HEAD_TILES=tiles, FP8_QK=fp8_qk,
                      FP8_PV=fp8_pv, COMPUTE=_COMPUTE[compute_dtype], RESCALE_Q=rescale_q, PDL=pdl)
    return _TritonCall(paged_decode_kernel, (b, hkv * tiles, num_splits), args, constexprs, out, lse, k_out, k_lse,
                       out_dtype, pdl)


def _triton_residency(batch: int, cache: PagedKVCache, cfg: DecodeConfig, mode: str, group: int,
                      q_dtype: torch.dtype, device: torch.device, variants: dict) -> int:
    """The tensor-core Triton programs an SM of ``device`` holds for launch ``cfg`` with these ``variants``
    (window, soft_cap, sinks, convert, eviction_policy, compute_dtype): :func:`kernel_residency` of the kernel
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
        call = _triton_call(q, cache, cfg, mode, tensor_cores=True, sm_scale=None, out_dtype=None, **variants)
        return call.kernel.warmup(*call.args, grid=call.grid, **call.constexprs)

    return kernel_residency(key, device, compile_kernel)


GLUON_BLOCK_N = (64, 128)
# Below this many tokens per split (the span of the cache's capacity a split covers, whatever the sequences'
# lengths), by the programs per head tile (head_parts), the Gluon kernel's fixed cost per program (its ring
# prologue and the merge of its warps' slices) outweighs its faster loop. H200, B 1-16 x 4k-16k on three
# layouts (results/bench/nvidia-h200/20261203T211700Z-gluon-crossover.json): at <= 512 tokens per split 11
# of 13 points slower than the Triton kernel (32/8/128, 1 x 4k: 15.0 against 10.5 us), at >= 1024 all 5
# faster. Head dims above 128, two parts (8/1, 16/8, 16/16 and 32/8 at D = 256, B 1-16 x 4k-16k:
# ...20261204T144946Z-gluon-wide-crossover.json and ...145432Z-...): at 512 tokens all 17 points faster,
# by 1.03-1.15x (16/8/256, 1 x 16k: 39.5 against 44.5 us; 8/1/256, 8 x 16k: 44.9 against 46.1), at <= 256
# all 16 slower (8/1/256, 4 x 16k: 38.2 against 25.6 us).
GLUON_MIN_SPLIT_TOKENS = {1: 1024, 2: 512}
GLUON_STAGES = (2, 3, 4)  # ring depths its GPU tests and benchmarks cover


def gluon_tile(group: int, head_dim: int, streams: int, num_sms: int) -> tuple[int, int]:
    """The Gluon kernel's default (block_n, ring depth) for a layout, ``streams`` = batch x KV heads.

    Measured on the H200 (B = 64 x 16k: ``results/bench/nvidia-h200/20261203T210039Z-gluon-probe.json``;
    MHA at B = 4: ``...20261203T234329Z-gluon-mha.json``): one query head per KV head streams best in
    tiles of 128 tokens, 3 deep, where the (sequence, KV head) streams alone fill 8 waves of programs, so
    that each streams a whole sequence (32/32/128: 2072 us against 2101 for 64 / 4; 32/32/80: 2066 against
    2147), and in tiles of 64 otherwise (32/32/128, B = 4 x 16k, 9 splits: 154.0 us against 166.6); head
    dims up to 64 in tiles of 64, 3 deep (12/4/64: 185.5 against 190.9); the rest in tiles of 64, 4 deep
    (32/8/128: 535.6 against 542.6 for 64 / 3 and 558.5 for 128 / 3; 28/4/128: 307.8, within 1 % of
    128 / 3's 304.9). Head dims above 128 (two parts) in tiles of 128, 2 deep
    (``...20261204T120140Z-gluon-wide.json``: 8/1/256 191.7 us against 207.8-212.4 for 64 / 2-4; 16/8/256
    1175.7 against 1287.8-1334.9; 16/16/256 2312.3 against 2546.3-2602.9)."""
    if head_dim > 128:
        return 128, 2
    if group == 1 and streams >= 8 * num_sms:
        return 128, 3
    return (64, 3) if head_dim <= 64 else (64, 4)


# Shared memory the Gluon kernel takes besides its K and V rings (its layout conversions), bytes, at most: sm90
# builds (Triton 3.6 and 3.9, fp8kv.gluon_build) take 8 KiB more than the rings in 128-wide tiles, 4-8 KiB
# in 64-wide ones (tests/test_gluon_build.py checks the default tiles).
GLUON_SMEM_EXTRA = 8192


def gluon_smem_bytes(block_n: int, num_stages: int, head_dim: int) -> int:
    """Shared memory one Gluon program needs: the K and V rings of ``num_stages`` tiles (K in each part's
    width, V in its own part's), and the rest."""
    from .kernels.paged_decode_gluon import head_pad, head_parts

    return (head_parts(head_dim) + 1) * num_stages * block_n * head_pad(head_dim) + GLUON_SMEM_EXTRA


def _smem_per_block(device: torch.device) -> int | None:
    """The most shared memory one program may use on ``device`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def gluon_max_heads(head_dim: int) -> int:
    """The most query heads one Gluon program holds at ``head_dim`` (its MMA rows: 32 in a 64-wide tile,
    16 in a 128-wide one or two parts of 128); a larger group is cut into several programs per KV head."""
    from .kernels.paged_decode_gluon import max_rows

    return max_rows(head_dim)


def gluon_launch(batch: int, cache: PagedKVCache, group: int, *, num_splits: int | None = None,
                 block_n: int | None = None, num_stages: int | None = None, heads_per_program: int | None = None,
                 device: torch.device | None = None, num_sms: int | None = None,
                 q_dtype: torch.dtype = torch.bfloat16, programs_per_sm: int | None = None) -> DecodeConfig:
    """The launch of the Gluon kernel for ``group`` query heads per KV head: :func:`gluon_tile` unless
    ``block_n`` / ``num_stages`` are given, the group in as few programs per KV head as
    :func:`gluon_max_heads` allows (or of at most ``heads_per_program`` heads; :func:`gluon_refusal`
    checked it), splits as :func:`launch_config` sizes them. On a GPU with less shared memory per
    program than the default needs (sm89 / sm120: 99 KiB) the default ring is made shallower, and where
    even the shallowest does not fit, the default tile is 64 tokens; an explicit tile that does not fit
    raises UnsupportedError naming it. ``num_sms``: the GPU's SMs (None: the device's), for a launch
    planned on another machine (:mod:`fp8kv.gluon_build`). The splits fill whole waves of the programs an SM
    holds (:func:`fill_waves`): ``programs_per_sm``, or on a CUDA device those of the kernel compiled for this
    launch and a ``q_dtype`` query (:func:`kernel_residency`)."""
    dev = torch.device(device) if device is not None else cache.device
    sms = _num_sms(dev) if num_sms is None else checks.positive_int(num_sms, "num_sms")
    tile, depth = gluon_tile(group, cache.head_dim, batch * cache.num_kv_heads, sms)
    default_tile = block_n is None
    block_n = tile if block_n is None else checks.one_of(checks.integer(block_n, "block_n"), "block_n",
                                                         GLUON_BLOCK_N)
    stages = depth if num_stages is None else checks.one_of(checks.integer(num_stages, "num_stages"), "num_stages",
                                                           GLUON_STAGES)
    limit = _smem_per_block(dev)
    if limit is not None:
        def fitting(block_n: int, stages: int) -> int:  # the default depth made shallower until its rings fit
            while num_stages is None and stages > min(GLUON_STAGES) and \
                    gluon_smem_bytes(block_n, stages, cache.head_dim) > limit:
                stages -= 1
            return stages

        stages = fitting(block_n, stages)
        if default_tile and block_n > min(GLUON_BLOCK_N) and gluon_smem_bytes(block_n, stages, cache.head_dim) > limit:
            block_n = min(GLUON_BLOCK_N)  # smaller tiles
            stages = fitting(block_n, max(GLUON_STAGES) if num_stages is None else stages)
        need = gluon_smem_bytes(block_n, stages, cache.head_dim)
        if need > limit:
            fell_back = " (the default tile made smaller)" if default_tile and block_n != tile else ""
            raise UnsupportedError(f"block_n={block_n}{fell_back}, num_stages={stages}: the Gluon kernel's rings need "
                                   f"{need} bytes of shared memory, this GPU gives a program {limit}; ask for fewer")
    from .kernels.paged_decode_gluon import head_parts

    def planned(programs_per_sm: int | None) -> DecodeConfig:
        cfg = launch_config(batch, cache, "dequant", num_splits=num_splits, block_n=block_n, device=device, group=group,
                            heads_per_program=heads_per_program or gluon_max_heads(cache.head_dim),
                            head_parts=head_parts(cache.head_dim), num_sms=sms, programs_per_sm=programs_per_sm)
        return {**cfg, "num_warps": 4, "num_stages": stages}

    cfg = planned(programs_per_sm)
    if num_splits is None and programs_per_sm is None and dev.type == "cuda" and not interpreter_on() and \
            _fills_waves(batch, cache, cfg, head_parts(cache.head_dim), None, sms):
        cfg = planned(_gluon_residency(cache, cfg, group, q_dtype, dev))
    return cfg


def _gluon_residency(cache: PagedKVCache, cfg: DecodeConfig, group: int, q_dtype: torch.dtype,
                     device: torch.device) -> int:
    """The Gluon programs an SM of ``device`` holds for launch ``cfg`` (:func:`kernel_residency`): the kernel
    is compiled for the launch's constexprs (what its registers and shared memory depend on), not run."""
    from .kernels import paged_decode_gluon as g

    d, hq = cache.head_dim, group * cache.num_kv_heads
    # what launch_constants follows (and the query's type)
    key = ("gluon", q_dtype, cache.kv_dtype, d, cache.block_size, cache.num_kv_heads == 1, group,
           *(cfg[k] for k in ("block_n", "num_stages", "heads_per_program", "head_tiles")))

    def compile_kernel():
        constants = g.launch_constants(cfg, group, d, cache.block_size, cache.kv_dtype)
        q = torch.empty(1, hq, d, dtype=q_dtype, device=device)  # allocated, not filled (as above)
        part_out, part_lse = _split_partials(1, hq, cfg["num_splits"], d, device)
        grid, args, _ = gluon_arguments(q, cache, cfg, 1.0, part_out, part_lse)
        return g.gluon_decode_kernel.warmup(*args, grid=grid, **constants, num_warps=g.NUM_WARPS)

    return kernel_residency(key, device, compile_kernel)


# Options the Gluon kernel takes when asked for by name; any other override means the Triton kernel.
_GLUON_OPTIONS = ("block_n", "num_stages", "heads_per_program")


def gluon_refusal(cache: PagedKVCache, mode: str, head_dim: int, group: int, device, **overrides) -> str | None:
    """Why the Gluon kernel cannot run this decode (None: it can). ``overrides``: the launch options
    and variants of :func:`paged_decode` (None = not given)."""
    try:
        from .kernels import paged_decode_gluon as g
    except ImportError as e:  # a Triton without the Gluon dialect
        return f"this Triton has no Gluon ({e})"
    device = torch.device(device)
    heads = overrides.get("heads_per_program")
    heads = None if heads is None else checks.positive_int(heads, "heads_per_program")
    others = sorted(k for k, v in overrides.items() if v is not None and k not in _GLUON_OPTIONS + ("num_warps",))
    most_heads = gluon_max_heads(head_dim) if head_dim <= g.MAX_HEAD_DIM else 0
    num_warps = overrides.get("num_warps")
    why = next((w for bad, w in (
        (bool(others), f"the Gluon kernel takes no {others}"),
        (mode != "dequant", f"mode={mode!r}: the Gluon kernel runs dequant mode"),
        (not cache.is_fp8, f"kv_dtype={cache.kv_dtype}: the Gluon kernel reads FP8 caches"),
        (cache.granularity != "tensor", f"granularity={cache.granularity!r}: the Gluon kernel takes one "
                                        "tensor-wide scale"),
        (head_dim % 16 or not g.MIN_HEAD_DIM <= head_dim <= g.MAX_HEAD_DIM,
         f"head_dim={head_dim}: the Gluon kernel takes multiples of 16 from {g.MIN_HEAD_DIM} to {g.MAX_HEAD_DIM}"),
        (heads is not None and heads > most_heads,
         f"heads_per_program={heads}: a Gluon program holds at most {most_heads} query heads at head_dim {head_dim}"),
        (num_warps not in (None, g.NUM_WARPS), f"num_warps={num_warps!r}: the Gluon kernel runs {g.NUM_WARPS}"),
        (interpreter_on() or device.type != "cuda", "Gluon kernels run on a CUDA GPU only (not under the "
                                                    "Triton interpreter)"),
    ) if bad), None)
    if why is None:
        arch = current_arch(device)
        if int(arch[2:]) < 89:
            why = f"{arch}: the Gluon kernel's FP8 conversions (cvt.rn.f16x2.e4m3x2 / e5m2x2) need sm89+"
    if why is None:
        pages = (cache.k_pages, cache.v_pages)
        if any(t.data_ptr() % 16 or any(s % 16 for s in t.stride()[:3]) for t in pages) or \
                cache.k_pages.stride() != cache.v_pages.stride():
            why = "the cp.async copies need 16-byte aligned pages and strides shared by K and V"
    return why


def decode_kernel(cache: PagedKVCache, mode: str, head_dim: int, group: int, device, *, gluon: bool | None = None,
                  **overrides) -> str:
    """``"gluon"`` or ``"triton"``: the kernel these arguments allow (:func:`decode_launch` also weighs the
    batch: a latency-bound decode runs the Triton kernel).

    ``gluon=None`` picks Gluon where :func:`gluon_refusal` finds nothing and no override is given
    (launch overrides such as ``block_n`` address the Triton kernel); True raises UnsupportedError
    where Gluon cannot run; False is the Triton kernel."""
    if gluon is not None and not isinstance(gluon, bool):
        raise TypeError(f"gluon={gluon!r}; expected None (the faster kernel that runs), True or False")
    if gluon is False or (gluon is None and any(v is not None for v in overrides.values())):
        return "triton"
    why = gluon_refusal(cache, mode, head_dim, group, device, **overrides)
    if gluon:
        if why is not None:
            raise UnsupportedError(f"gluon=True: {why}; use the Triton kernel (gluon=False)")
        return "gluon"
    return "gluon" if why is None else "triton"


def launch_for(batch: int, cache: PagedKVCache, mode: str, group: int, device, *, q_dtype: torch.dtype,
               out_dtype: torch.dtype | None = None, eviction_policy: str = "", **options) -> tuple[str, DecodeConfig]:
    """The kernel and launch :func:`paged_decode` takes for ``batch`` ``q_dtype`` queries with these of its
    keyword arguments (``options``: launch overrides and variants): the one mapping from its arguments to
    :func:`decode_launch`, so that a benchmark row names the kernel and launch that ran. ``out_dtype``
    changes no launch; an empty ``eviction_policy`` is none."""
    del out_dtype  # what the kernels store: every kernel takes it
    return decode_launch(batch, cache, mode, cache.head_dim, group, device, q_dtype=q_dtype,
                         eviction_policy=eviction_policy or None, **options)


def decode_launch(batch: int, cache: PagedKVCache, mode: str, head_dim: int, group: int, device, *,
                  gluon: bool | None = None, num_splits: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  heads_per_program: int | None = None, use_tensor_cores: bool | None = None,
                  window: int | None = None, q_dtype: torch.dtype = torch.bfloat16,
                  **others) -> tuple[str, DecodeConfig]:
    """The kernel :func:`paged_decode` runs for these arguments and its launch: ``("gluon", cfg)``,
    ``("triton", cfg)`` (the tensor-core kernel) or ``("triton-cuda-core", cfg)``. By default Gluon runs
    where :func:`decode_kernel` allows it, each split streams at least GLUON_MIN_SPLIT_TOKENS tokens (by
    the head's parts) and a
    KV head's query heads fit one program (:func:`gluon_max_heads`); shorter splits (small batches:
    latency-bound) and larger groups go to the Triton kernel. A group cut into several Gluon programs
    converts every FP8 tile once per program, where the Triton kernel's one program of up to 64 heads
    converts it once (H200, 64 x 16k, ``results/bench/nvidia-h200/20261203T234329Z-gluon-groups.json``:
    48/1/128 213.0 us in three Gluon programs against 153.9 in one Triton program; 71/1/64 175.5 against
    176.5; a group of 20 in one Gluon program, 40/2/64: 134.7 against 202.4; with the block table clamped
    where used, ``...20261204T164000Z-gluon-page-clamp.json``: 48/1/128 206.5 against 153.9, 71/1/64 171.9
    against 176.1, one rule for both). ``others``: the
    remaining options and variants of :func:`paged_decode` (convert, eviction_policy, compute_dtype,
    soft_cap, sinks; None = not given), which :func:`decode_kernel` weighs and, on a GPU, the Triton kernel
    is compiled with to read the programs an SM holds. On a GPU, unless ``num_splits`` is given, the splits
    fill the waves of those programs (:func:`fill_waves`; the kernel compiled once per shape, for a
    ``q_dtype`` query)."""
    if use_tensor_cores is not None and not isinstance(use_tensor_cores, bool):
        raise TypeError(f"use_tensor_cores={use_tensor_cores!r}; expected True (or None, the default: tensor "
                        "cores) or False (the CUDA-core kernel)")
    kernel = decode_kernel(cache, mode, head_dim, group, device, gluon=gluon, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, heads_per_program=heads_per_program, window=window,
                           use_tensor_cores=None if use_tensor_cores is not False else False, **others)
    # a group cut into several Gluon programs goes to the Triton kernel unless Gluon is asked for: then it is
    # neither planned nor compiled
    if kernel == "gluon" and (gluon or group <= (heads_per_program or gluon_max_heads(head_dim))):
        cfg = gluon_launch(batch, cache, group, num_splits=num_splits, block_n=block_n, num_stages=num_stages,
                           heads_per_program=heads_per_program, device=device, q_dtype=q_dtype)
        from .kernels.paged_decode_gluon import head_parts

        least = GLUON_MIN_SPLIT_TOKENS[head_parts(head_dim)]
        if gluon or cfg["tokens_per_split"] >= least:
            return kernel, cfg
    tensor_cores = use_tensor_cores is not False

    def planned(programs_per_sm: int | None) -> DecodeConfig:
        return launch_config(batch, cache, mode, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                             num_stages=num_stages, device=device, window=window, use_tensor_cores=tensor_cores,
                             group=group, heads_per_program=heads_per_program, programs_per_sm=programs_per_sm)

    cfg = planned(None)
    dev = torch.device(device)
    if tensor_cores and num_splits is None and dev.type == "cuda" and not interpreter_on() and \
            _fills_waves(batch, cache, cfg, 1, window, _num_sms(dev)):
        variants = dict(window=window, soft_cap=others.get("soft_cap"), sinks=others.get("sinks"),
                        convert=others.get("convert"), eviction_policy=others.get("eviction_policy") or "",
                        compute_dtype=others.get("compute_dtype"))
        cfg = planned(_triton_residency(batch, cache, cfg, mode, group, q_dtype, dev, variants))
    return ("triton" if tensor_cores else "triton-cuda-core"), cfg


def gluon_arguments(q: torch.Tensor, cache: PagedKVCache, cfg: DecodeConfig, sm_scale: float,
                    part_out: torch.Tensor, part_lse: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """The Gluon kernel's grid, runtime arguments and constexprs for a decode of ``q`` over ``cache`` with
    launch ``cfg`` into the split partials ``part_out`` / ``part_lse`` (:func:`_split_partials`): what
    :func:`paged_decode` launches, and what :mod:`fp8kv.gluon_build` compiles."""
    from .kernels import paged_decode_gluon as g

    b, hq, d = q.shape
    k_pages, v_pages = (t.view(torch.uint8) for t in (cache.k_pages, cache.v_pages))
    s = _page_strides(cache)  # (page, token, head): NHD or HND
    # grid (Hkv x head tiles x parts, B, splits): a sequence's KV heads (and a KV head's programs) run side by side,
    # so the DRAM pages of its tokens are read together (H200, 64 x 16k: 32/8/128 535.6 against 545.4 us
    # batch-first; 12/4/64 185.5 against 207.4)
    grid = (cache.num_kv_heads * cfg["head_tiles"] * g.head_parts(d), b, cfg["num_splits"])
    args = (q, k_pages, v_pages, cache.k_scale, cache.v_scale, cache.block_table, cache.seq_lens, part_out, part_lse,
            sm_scale * math.log2(math.e), cfg["tokens_per_split"], cache.num_blocks,
            cache.max_blocks_per_seq * cache.block_size, q.stride(0), q.stride(1), s[0], s[1], s[2],
            cache.block_table.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1))
    return grid, args, g.launch_constants(cfg, hq // cache.num_kv_heads, d, cache.block_size, cache.kv_dtype)


def _paged_decode_gluon(q, cache, sm_scale, cfg, out_dtype):
    """The Gluon launch of :func:`paged_decode` (:func:`decode_launch` chose it and its ``cfg``)."""
    from .kernels import paged_decode_gluon as g

    b, hq, d = q.shape
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    part_out, part_lse = _split_partials(b, hq, cfg["num_splits"], d, q.device)
    out = torch.empty(b, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    grid, args, constants = gluon_arguments(q, cache, cfg, sm_scale, part_out, part_lse)
    g.gluon_decode_kernel[grid](*args, **constants, num_warps=g.NUM_WARPS)
    _combine_splits(part_out, part_lse, out, lse)
    return out, lse


# Programmatic dependent launch (sm90+, the Triton tensor-core kernel): where the decode's programs leave at
# least half the SMs free, each lets the split combine launch as it starts, and the combine's programs wait on
# the free SMs for the partials, so no launch gap separates the two. H200, FP8, B 1-4 x 1000-4096 tokens
# (scripts/pdl_probe.py, results/bench/nvidia-h200/20261204T145216Z-pdl.csv): faster at all 12 such points,
# by 0.05-0.89 us (32/8/128, 1 x 1000: 7.40 against 8.19 us; 14/2/64, 1 x 4k: 5.97 against 6.71). With 128
# programs it was level or slower (28/4/128, 1 x 4k: 9.64 against 9.37 us), with more up to 2.4 us slower
# (32/8/128, 4 x 4k: 20.31 against 18.43 us), and a dependent launch without the early start was slower than
# a plain one at 26 of 29 points (median +0.22-0.25 us): those launches stay plain. False: plain everywhere.
COMBINE_PDL = True


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    """Whether ``device`` takes programmatic dependent launches: an sm90+ CUDA GPU, not the interpreter."""
    if device.type != "cuda" or interpreter_on():
        return False
    arch = current_arch(device) or ""
    return arch.startswith("sm") and int(arch[2:]) >= 90


def combine_as_dependent(programs: int, device: torch.device) -> bool:
    """Whether a split decode of ``programs`` programs launches its combine as a programmatic dependent:
    :data:`COMBINE_PDL`, a device that takes it, and programs that leave at least half its SMs free."""
    return COMBINE_PDL and _pdl_capable(device) and programs <= _num_sms(device) // 2


def _split_partials(b: int, hq: int, splits: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs ``[B, Hq, splits, D]`` and log2-LSEs ``[B, Hq, splits]`` of a split decode."""
    return (torch.empty(b, hq, splits, d, dtype=torch.float32, device=device),
            torch.empty(b, hq, splits, dtype=torch.float32, device=device))


def _combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    sinks: torch.Tensor | None = None, dependent: bool = False) -> None:
    """Merge a split decode's partials into ``out`` and ``lse`` (:func:`combine_splits_kernel`), with
    the sinks' term in the denominator when given; ``dependent``: launched as a programmatic dependent of
    the decode, which let it start early (:func:`combine_as_dependent`)."""
    b, hq, splits, d = part_out.shape
    pdl = dict(PDL=True, launch_pdl=True) if dependent else {}
    combine_splits_kernel[(b, hq)](
        part_out, part_lse, out, lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), splits,
        sinks if sinks is not None else lse,
        HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), SPLITS_PAD=triton.next_power_of_2(splits),
        HAS_SINKS=sinks is not None, num_warps=4, **pdl)


def write_cache(cache: PagedKVCache, k_new: torch.Tensor, v_new: torch.Tensor, slot_mapping: torch.Tensor,
                *, count_saturated: bool = True, check: bool = True) -> torch.Tensor:
    """Fused quantize + scatter of ``k_new``/``v_new`` ``[N, Hkv, D]`` into the cache's pages.

    The Triton twin of :meth:`PagedKVCache.write` (bit-identical pages and scales). ``slot_mapping``:
    ``[N]`` int32/int64 slots, < 0 skipped. Returns the saturation count as a device int32 tensor
    ``[1]`` (no host sync); with ``count_saturated`` it is also added to ``cache.saturated`` (a sync:
    a CUDA-graph capture passes ``check=False, count_saturated=False``).

    ``check`` (default) validates the contents before launching (one host sync): finite rows,
    slots inside the pool, no write into a page that two block-table entries holding tokens
    reference (see :meth:`PagedKVCache.check_write`). With ``check=False`` (a CUDA-graph capture)
    only shapes, dtypes and devices are checked; the kernel still skips slots outside the pool.
    """
    if not isinstance(check, bool):
        raise TypeError(f"check={check!r}; expected True or False")
    slots = cache.check_write(k_new, v_new, slot_mapping, contents=check)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension; call .contiguous()")
    if cache.device.type != "cuda" and not interpreter_on():
        raise UnsupportedError("the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU")
    slots = slots.contiguous()
    sat = torch.zeros(1, dtype=torch.int32, device=cache.device)
    n = k_new.shape[0]
    if n == 0:
        return sat
    skb, skt, skh = _page_strides(cache)
    hkv = cache.num_kv_heads
    # overflow: the first fp32 magnitude that rounds past max (e4m3's tie 464 goes to 448: not counted),
    # the rule of PagedKVCache.write; the kernel clamps in fp32 as it does, so both store ±max alike.
    fmax, overflow = saturation_bounds(cache.dtype)
    # The interpreter rounds fp32 -> bf16 wrongly: there bf16 pages are written as rounded bits.
    bf16_bits = interpreter_on() and cache.dtype == torch.bfloat16
    for x, pages, scale in ((k_new, cache.k_pages, cache.k_scale), (v_new, cache.v_pages, cache.v_scale)):
        cache_write_kernel[(n,)](
            x, slots, pages.view(torch.int16) if bf16_bits else _kernel_pages(cache, pages), scale, sat,
            x.stride(0), x.stride(1), skb, skt, skh, hkv, cache.num_blocks * cache.block_size,
            HKV_PAD=triton.next_power_of_2(hkv), HEAD_DIM=cache.head_dim,
            D_PAD=triton.next_power_of_2(cache.head_dim), BLOCK_SIZE=cache.block_size, SCALE_KIND=_scale_kind(cache),
            SCALE_HEAD_STRIDE=int(scale.numel() > 1), KV_FP8=cache.is_fp8, FMAX=fmax, OVERFLOW=overflow,
            BF16_BITS=bf16_bits, **_format_bits(cache),
        )
    if count_saturated:
        cache.saturated += int(sat.item())
    return sat


COPY_BLOCK = 8192  # elements per program: 32 KiB of fp32, with 16-byte vector accesses


def stream_copy(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy contiguous ``src`` into ``dst`` (same numel and dtype, one device) with the streaming kernel.

    The bandwidth ceiling decode kernels are measured against (:func:`fp8kv.bench.measure_copy_bandwidth`).
    No host sync: it can be captured in a CUDA graph. Returns ``dst``. Overlapping ``src`` and ``dst`` are
    refused: the kernel's blocks run in any order, so a block could read what another already wrote.
    """
    checks.tensor(src, "src")
    checks.tensor(dst, "dst", dtypes=(src.dtype,), device=src.device)
    if not (src.is_contiguous() and dst.is_contiguous()) or src.numel() != dst.numel():
        checks.fail(f"src and dst must be contiguous with equal numel; got {tuple(src.shape)} "
                    f"(contiguous={src.is_contiguous()}) and {tuple(dst.shape)} (contiguous={dst.is_contiguous()})")
    n = src.numel()
    nbytes = n * src.element_size()
    if n and src.data_ptr() < dst.data_ptr() + nbytes and dst.data_ptr() < src.data_ptr() + nbytes:
        checks.fail("src and dst overlap in memory; copy into a separate tensor")
    copy_kernel[(triton.cdiv(n, COPY_BLOCK),)](src, dst, n, BLOCK=COPY_BLOCK)
    return dst
