"""How a decode is cut into programs: tiles and their launch defaults, query heads per program, the split
count (flash-decoding) by waves of the GPU's SMs, and the programs an SM holds (residency), which whole
waves are filled with. Shared by the Triton and Gluon launches; nothing here launches a kernel."""

from __future__ import annotations

import functools
import math

import torch
import triton

from ... import checks, launch_table
from ...cache import PagedKVCache
from ...cache.quantized import QuantizedPagedKVCache
from ...capability import MODES, interpreter_on
from ...device import gpu_slug
from ...launch_options import FP8_DOT_MIN_K, check_block_n, check_stages, check_warps, least_block_n
from .gluon_scope import GLUON_QUANTIZED_FORMATS


@functools.cache
def table_gpu(device: torch.device) -> str | None:
    """The GPU's slug for the launch table (None off CUDA)."""
    return gpu_slug(device) if device.type == "cuda" else None


def sm_count(device: torch.device) -> int:
    """The SMs a launch on ``device`` fills: the GPU's, or 4 off CUDA (the interpreter's launches are planned as
    on a small GPU)."""
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


def clear_residency() -> None:
    """Forget the programs per SM found so far (:func:`kernel_residency`): a probe that changes the rule sizing
    the launches compiles again."""
    _RESIDENCY.clear()


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


def split_span(cache: PagedKVCache, window: int | None) -> int:
    """The tokens a decode's splits tile: the page table's capacity, or a shorter window."""
    capacity = cache.max_blocks_per_seq * cache.block_size
    return capacity if window is None else min(capacity, window)


def fills_waves(batch: int, cache: PagedKVCache, cfg: DecodeConfig, head_parts: int, window: int | None,
                 num_sms: int) -> bool:
    """Whether the programs an SM holds can change launch ``cfg``'s split count: a launch that is not
    :func:`latency_bound` (only those fill waves), so that a latency-bound one compiles nothing to find out."""
    return not latency_bound(batch, cache.num_kv_heads * cfg["head_tiles"] * head_parts, split_span(cache, window),
                             cfg["block_n"], num_sms, min_waves=latency_waves(cache.head_dim))


def launch_config(batch: int, cache: PagedKVCache, mode: str = "dequant", *, num_splits: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  device: torch.device | None = None, window: int | None = None,
                  use_tensor_cores: bool = True, group: int | None = None,
                  heads_per_program: int | None = None, head_parts: int = 1, num_sms: int | None = None,
                  programs_per_sm: int | None = None) -> DecodeConfig:
    """The launch :func:`fp8kv.ops.paged_decode` uses for ``batch`` sequences of ``cache``: defaults plus overrides.

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
    quantized = isinstance(cache, QuantizedPagedKVCache) and cache.fmt.name in GLUON_QUANTIZED_FORMATS
    if not (isinstance(cache, PagedKVCache) or quantized):
        what = f"format {cache.fmt.name!r}" if isinstance(cache, QuantizedPagedKVCache) else type(cache).__name__
        checks.fail(f"cache must be a fp8kv.PagedKVCache (or a quantized cache of {' or '.join(GLUON_QUANTIZED_FORMATS)}, "
                    f"which the Gluon kernel reads), got {what}", TypeError)
    batch = checks.positive_int(batch, "batch")
    one_byte = quantized or cache.is_fp8  # INT8 and INT4 codes tile as FP8 pages do
    checks.one_of(mode, "mode", MODES)
    checks.flag(use_tensor_cores, "use_tensor_cores")
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
    capacity = split_span(cache, window)
    sms = sm_count(device or cache.device) if num_sms is None else checks.positive_int(num_sms, "num_sms")
    gpu = table_gpu(device or cache.device)

    def defaults(heads: int) -> DecodeConfig:
        return default_config(mode, one_byte, cache.head_dim, use_tensor_cores=use_tensor_cores, gpu=gpu,
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
    num_warps, num_stages = check_warps(num_warps), check_stages(num_stages)
    # tl.dot's minimum; the CUDA-core kernel takes any power of two
    block_n = check_block_n(block_n, least=least_block_n("dequant", use_tensor_cores))
    if block_n < least_block_n(mode, use_tensor_cores):
        raise ValueError(f"block_n={block_n}: fp8 mode needs block_n >= {FP8_DOT_MIN_K} (FP8 dot minimum K)")
    if num_splits is None:
        programs = cache.num_kv_heads * (head_tiles * head_parts if use_tensor_cores else group)  # per sequence, split
        slots = None if programs_per_sm is None else sms * programs_per_sm
        num_splits = choose_num_splits(batch, programs, capacity, block_n, sms, min_waves=latency_waves(cache.head_dim),
                                       slots=slots)
    num_splits, tokens_per_split = whole_tile_splits(capacity, num_splits, block_n)
    return dict(block_n=block_n, num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
                num_splits=num_splits, tokens_per_split=tokens_per_split,
                head_tiles=head_tiles, heads_per_program=math.ceil(group / head_tiles) if use_tensor_cores else 1)
