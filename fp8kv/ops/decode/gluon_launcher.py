"""The Gluon kernel's launch (:mod:`.gluon_kernel`): its default tile and ring depth, the shared memory its
rings take, the query heads a program holds, the launch (splits as :mod:`.splits` sizes them), the
programs an SM holds of it, its arguments and constexprs, and the launch itself with the split combine.

The kernel's module is imported in one place, :func:`kernel_module` (on first use: a Triton without the
Gluon dialect fails there, and the choice of kernel, :func:`fp8kv.ops.gluon_refusal`, says so).
"""

from __future__ import annotations

import functools
import math

import torch

from ... import checks
from ...cache import PagedKVCache
from ...capability import UnsupportedError, interpreter_on
from ..pages import page_strides
from . import splits
from .combine import combine_splits, split_partials
from .gluon_scope import (
    GLUON_QUANTIZED_FORMATS,
    NUM_WARPS,
    PACKED_CODES,
    head_pad,
    head_parts,
    max_rows,
    mma_rows,
)
from .splits import DecodeConfig

__all__ = ["GLUON_BLOCK_N", "GLUON_MIN_SPLIT_TOKENS", "GLUON_MIN_ROW_SPLIT_TOKENS", "GLUON_MIN_PACKED_SPLIT_TOKENS", "GLUON_STAGES", "GLUON_SMEM_EXTRA", "gluon_tile",
           "gluon_smem_bytes", "smem_per_block", "gluon_max_heads", "gluon_launch", "gluon_residency",
           "gluon_arguments", "gluon_runtime_arguments", "launch_constants", "run_gluon", "kernel_module", "gluon_codes",
           "cache_scales", "token_scale_strides"]


@functools.cache
def kernel_module():
    """The Gluon kernel's module (:mod:`.gluon_kernel`), imported on first use; ImportError where this Triton
    has no Gluon dialect."""
    from . import gluon_kernel

    return gluon_kernel


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
# The same bound for several new tokens per sequence (fp8kv.ops.decode.plan_rows), whose alternative is the multi-token
# Triton kernel, slower than the decode's: H100, 4k tokens, 2 and 4 drafts at 32/8/128 and 40/8/128, the rows forced
# (results/bench/nvidia-h100-80gb-hbm3/20261206T052141Z.csv) against the default (...052200Z.csv): with 704-token
# splits (B 16) the rows took 0.69-0.78x the Triton kernel's time (75.2 against 109.1 us at 32/8/128, 2 drafts), with
# 256 (B 4) 0.98-1.33x, with 128 (B 1) 1.33-2.03x: the bound lies between the two lengths measured (splits of 512-703
# tokens, other contexts, the H200 and token-head scales are not measured). Two parts (head dims above 128): the
# decode's bound, not measured for the rows.
GLUON_MIN_ROW_SPLIT_TOKENS = {1: 512, 2: 512}
# The decode's bound for INT4 codes (two a byte; head dims up to 128), whose alternative is the Triton quantized
# kernel: H100, INT4 per token and head at 32/8/128 and 8/1/128, B 1/16/64 x 4k/16k/32k, the Gluon kernel forced
# (results/bench/nvidia-h100-80gb-hbm3/20261207T093604Z.csv) against the default (...093218Z.csv): at the 3 points
# of 512-token splits the Gluon kernel took 0.79-0.85x the Triton kernel's time (32/8/128, 1 x 32k: 36.0 against
# 45.7 us), at the 6 of 128-256 tokens 1.02-1.63x. INT8 and the H200 are not measured there.
GLUON_MIN_PACKED_SPLIT_TOKENS = 512
GLUON_STAGES = (2, 3, 4)  # ring depths its GPU tests and benchmarks cover


def gluon_tile(group: int, head_dim: int, streams: int, num_sms: int, packed: bool = False) -> tuple[int, int]:
    """The Gluon kernel's default (block_n, ring depth) for a layout, ``streams`` = batch x KV heads; ``packed``:
    the cache holds two 4-bit codes a byte (INT4).

    Measured on the H200 (B = 64 x 16k: ``results/bench/nvidia-h200/20261203T210039Z-gluon-probe.json``;
    MHA at B = 4: ``...20261203T234329Z-gluon-mha.json``): one query head per KV head streams best in
    tiles of 128 tokens, 3 deep, where the (sequence, KV head) streams alone fill 8 waves of programs, so
    that each streams a whole sequence (32/32/128: 2072 us against 2101 for 64 / 4; 32/32/80: 2066 against
    2147), and in tiles of 64 otherwise (32/32/128, B = 4 x 16k, 9 splits: 154.0 us against 166.6); head
    dims up to 64 in tiles of 64, 3 deep (12/4/64: 185.5 against 190.9); the rest in tiles of 64, 4 deep
    (32/8/128: 535.6 against 542.6 for 64 / 3 and 558.5 for 128 / 3; 28/4/128: 307.8, within 1 % of
    128 / 3's 304.9). Head dims above 128 (two parts) in tiles of 128, 2 deep
    (``...20261204T120140Z-gluon-wide.json``: 8/1/256 191.7 us against 207.8-212.4 for 64 / 2-4; 16/8/256
    1175.7 against 1287.8-1334.9; 16/16/256 2312.3 against 2546.3-2602.9).

    INT4 codes at head dims up to 128 in tiles of 128, 3 deep: a tile's half-size rows leave the ring room, and
    a longer tile spreads each tile's fixed instructions (its scales, the online softmax's rescale) over twice the
    tokens, where INT4 is bound by instructions issued rather than bytes (``results/sass/sm90/``; H100, 32/8/128,
    B 64 x 32k: 930 us against 1048 for 64 / 4, ``results/bench/nvidia-h100-80gb-hbm3/20261207T084002Z.csv``
    against ``...083949Z.csv``; 1070 two deep, ``...083902Z.csv``)."""
    if head_dim > 128:
        return 128, 2
    if packed:
        return 128, 3
    if group == 1 and streams >= 8 * num_sms:
        return 128, 3
    return (64, 3) if head_dim <= 64 else (64, 4)


# Shared memory the Gluon kernel takes besides its K and V rings (its layout conversions), bytes, at most: sm90
# builds (Triton 3.6 and 3.9, .gluon_build) take 8 KiB more than the rings in 128-wide tiles, 4-8 KiB
# in 64-wide ones (tests/test_gluon_build.py checks the default tiles).
GLUON_SMEM_EXTRA = 8192


def gluon_smem_bytes(block_n: int, num_stages: int, head_dim: int, packed: bool = False,
                     token_scales: bool = False) -> int:
    """Shared memory one Gluon program needs: the K and V rings of ``num_stages`` tiles (K in each part's
    width, V in its own part's; half the bytes for ``packed`` codes, two a byte), with ``token_scales`` the ring of
    their fp32 K and V scales, and the rest."""
    row_bytes = head_pad(head_dim) // (2 if packed else 1)
    scale_bytes = 8 if token_scales else 0  # a token's K and V scale
    return ((head_parts(head_dim) + 1) * row_bytes + scale_bytes) * num_stages * block_n + GLUON_SMEM_EXTRA


def smem_per_block(device: torch.device) -> int | None:
    """The most shared memory one program may use on ``device`` (None off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def gluon_max_heads(head_dim: int) -> int:
    """The most query heads one Gluon program holds at ``head_dim`` (its MMA rows: 32 in a 64-wide tile,
    16 in a 128-wide one or two parts of 128); a larger group is cut into several programs per KV head."""
    return max_rows(head_dim)


def gluon_launch(batch: int, cache: PagedKVCache, group: int, *, num_splits: int | None = None,
                 block_n: int | None = None, num_stages: int | None = None, heads_per_program: int | None = None,
                 device: torch.device | None = None, num_sms: int | None = None,
                 q_dtype: torch.dtype = torch.bfloat16, programs_per_sm: int | None = None,
                 qo_len: int = 1, window: int | None = None) -> DecodeConfig:
    """The launch of the Gluon kernel for ``group`` query heads per KV head and ``qo_len`` new tokens per
    sequence (``group x qo_len`` rows per KV head, cut as a group is): :func:`gluon_tile` unless
    ``block_n`` / ``num_stages`` are given, the group in as few programs per KV head as
    :func:`gluon_max_heads` allows (or of at most ``heads_per_program`` heads; :func:`fp8kv.ops.gluon_refusal`
    checked it), splits as :func:`fp8kv.ops.launch_config` sizes them. On a GPU with less shared memory per
    program than the default needs (sm89 / sm120: 99 KiB) the default ring is made shallower, and where
    even the shallowest does not fit, the default tile is 64 tokens; an explicit tile that does not fit
    raises UnsupportedError naming it. ``num_sms``: the GPU's SMs (None: the device's), for a launch
    planned on another machine (:mod:`.gluon_build`). The splits fill whole waves of the programs an SM
    holds (:func:`fp8kv.ops.fill_waves`): ``programs_per_sm``, or on a CUDA device those of the kernel compiled for this
    launch and a ``q_dtype`` query (:func:`fp8kv.ops.kernel_residency`). A sliding ``window`` (one shorter than the
    page table) is tiled from a whole tile below it: its splits cover ``window + qo_len - 1 + block_n - 1`` tokens."""
    dev = torch.device(device) if device is not None else cache.device
    sms = splits.sm_count(dev) if num_sms is None else checks.positive_int(num_sms, "num_sms")
    rows = group * checks.positive_int(qo_len, "qo_len")
    codes, token_scales = gluon_codes(cache)
    rings = dict(packed=codes in PACKED_CODES, token_scales=token_scales)
    tile, depth = gluon_tile(rows, cache.head_dim, batch * cache.num_kv_heads, sms, packed=rings["packed"])
    default_tile = block_n is None
    block_n = tile if block_n is None else checks.one_of(checks.integer(block_n, "block_n"), "block_n",
                                                         GLUON_BLOCK_N)
    stages = depth if num_stages is None else checks.one_of(checks.integer(num_stages, "num_stages"), "num_stages",
                                                           GLUON_STAGES)
    limit = smem_per_block(dev)
    if limit is not None:
        def fitting(block_n: int, stages: int) -> int:  # the default depth made shallower until its rings fit
            while num_stages is None and stages > min(GLUON_STAGES) and \
                    gluon_smem_bytes(block_n, stages, cache.head_dim, **rings) > limit:
                stages -= 1
            return stages

        stages = fitting(block_n, stages)
        if default_tile and block_n > min(GLUON_BLOCK_N) and gluon_smem_bytes(block_n, stages, cache.head_dim, **rings) > limit:
            block_n = min(GLUON_BLOCK_N)  # smaller tiles
            stages = fitting(block_n, max(GLUON_STAGES) if num_stages is None else stages)
        need = gluon_smem_bytes(block_n, stages, cache.head_dim, **rings)
        if need > limit:
            fell_back = " (the default tile made smaller)" if default_tile and block_n != tile else ""
            raise UnsupportedError(f"block_n={block_n}{fell_back}, num_stages={stages}: the Gluon kernel's rings need "
                                   f"{need} bytes of shared memory, this GPU gives a program {limit}; ask for fewer")
    # the tokens a window's splits cover from its first tile, whatever its start (None: the page table's capacity)
    span = None if window is None else window + qo_len - 1 + block_n - 1
    span = None if span is not None and span >= cache.max_blocks_per_seq * cache.block_size else span

    def planned(programs_per_sm: int | None) -> DecodeConfig:
        cfg = splits.launch_config(batch, cache, "dequant", num_splits=num_splits, block_n=block_n, device=device,
                                   window=span,
                                   group=rows, heads_per_program=heads_per_program or gluon_max_heads(cache.head_dim),
                                   head_parts=head_parts(cache.head_dim), num_sms=sms, programs_per_sm=programs_per_sm)
        return {**cfg, "num_warps": 4, "num_stages": stages}

    cfg = planned(programs_per_sm)
    if num_splits is None and programs_per_sm is None and dev.type == "cuda" and not interpreter_on() and \
            splits.fills_waves(batch, cache, cfg, head_parts(cache.head_dim), span, sms):
        cfg = planned(gluon_residency(cache, cfg, group, q_dtype, dev, qo_len, window is not None))
    return cfg


def gluon_residency(cache: PagedKVCache, cfg: DecodeConfig, group: int, q_dtype: torch.dtype,
                     device: torch.device, qo_len: int = 1, windowed: bool = False) -> int:
    """The Gluon programs an SM of ``device`` holds for launch ``cfg`` (:func:`fp8kv.ops.kernel_residency`): the kernel
    is compiled for the launch's constexprs (what its registers and shared memory depend on), not run."""
    d, hq = cache.head_dim, group * cache.num_kv_heads
    # what launch_constants follows (and the query's type)
    key = ("gluon", q_dtype, *gluon_codes(cache), d, cache.block_size, cache.num_kv_heads == 1, group, qo_len, windowed,
           *(cfg[k] for k in ("block_n", "num_stages", "heads_per_program", "head_tiles")))

    def compile_kernel():
        q = torch.empty(qo_len, hq, d, dtype=q_dtype, device=device)  # allocated, not filled (as above)
        part_out, part_lse = split_partials(qo_len, hq, cfg["num_splits"], d, device)
        grid, args, constants = gluon_arguments(q, cache, cfg, 1.0, part_out, part_lse, qo_len,
                                                1 if windowed else None)
        return kernel_module().gluon_decode_kernel.warmup(*args, grid=grid, **constants, num_warps=NUM_WARPS)

    return splits.kernel_residency(key, device, compile_kernel)


def gluon_codes(cache) -> tuple[str, bool]:
    """What the Gluon kernel reads of ``cache``: its codes (a key of the kernel's CODE_TYPES: "fp8_e4m3", "fp8_e5m2",
    or "int8" / "int4" for a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` of INT8 / INT4 per token and head)
    and whether its scales are one per token and KV head (else one per tensor). :func:`fp8kv.ops.gluon_refusal`
    checked the cache."""
    if isinstance(cache, PagedKVCache):
        return cache.kv_dtype, cache.granularity == "token_head"
    return GLUON_QUANTIZED_FORMATS[cache.fmt.name], True


def token_scale_strides(cache) -> tuple[int, int, int]:
    """The (page, token, head) strides of a cache's per-token-head scales (``[num_blocks, block_size, Hkv]``, or with a
    trailing group of 1 in a quantized cache), one set for K and V; zeros for tensor-wide scales."""
    _, token_scales = gluon_codes(cache)
    if not token_scales:
        return 0, 0, 0
    return tuple(cache_scales(cache)[0].stride()[:3])


def cache_scales(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V scale arrays of ``cache``, either kind."""
    return (cache.k_scale, cache.v_scale) if isinstance(cache, PagedKVCache) else (cache.k_scales, cache.v_scales)


def launch_constants(cfg: dict, group: int, cache, qo_len: int = 1, windowed: bool = False) -> dict:
    """The kernel's constexprs for a launch ``cfg`` (:func:`gluon_launch`) of ``group`` query heads per
    KV head and ``qo_len`` new tokens per sequence over ``cache`` (its head_dim, page size, codes and scales:
    :func:`gluon_codes`), ``windowed``: with a sliding window."""
    kernel = kernel_module()
    codes, token_scales = gluon_codes(cache)
    if codes not in kernel.CODE_TYPES:
        raise ValueError(f"codes={codes!r}: the Gluon kernel reads {sorted(kernel.CODE_TYPES)}")
    heads, head_dim, block_size = cfg["heads_per_program"], cache.head_dim, cache.block_size
    return dict(GROUP=group, QO=qo_len, WINDOWED=windowed, HEADS=heads, HEAD_TILES=cfg["head_tiles"],
                ROWS=mma_rows(heads), PARTS=head_parts(head_dim), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                CODE_TY=kernel.CODE_TYPES[codes], TOKEN_SCALES=token_scales, STAGES=cfg["num_stages"],
                **kernel.make_layouts(cfg["block_n"], head_dim, codes in PACKED_CODES))


def gluon_arguments(q: torch.Tensor, cache: PagedKVCache, cfg: DecodeConfig, sm_scale: float,
                    part_out: torch.Tensor, part_lse: torch.Tensor, qo_len: int = 1,
                    window: int | None = None) -> tuple[tuple, tuple, dict]:
    """The Gluon kernel's grid, runtime arguments and constexprs for a decode of ``q`` (``qo_len`` new tokens
    per sequence, back to back) over ``cache`` with launch ``cfg`` into the split partials ``part_out`` /
    ``part_lse`` (:func:`.combine.split_partials`): what :mod:`.gluon_build` compiles (a decode launches
    :func:`gluon_runtime_arguments` with the constants it planned). ``window``: a sliding window, or None."""
    grid, args = gluon_runtime_arguments(q, cache, cfg, sm_scale, part_out, part_lse, qo_len, window)
    return grid, args, launch_constants(cfg, q.shape[1] // cache.num_kv_heads, cache, qo_len, window is not None)


def gluon_runtime_arguments(q: torch.Tensor, cache: PagedKVCache, cfg: DecodeConfig, sm_scale: float,
                            part_out: torch.Tensor, part_lse: torch.Tensor, qo_len: int = 1,
                            window: int | None = None) -> tuple[tuple, tuple]:
    """The grid and runtime arguments of :func:`gluon_arguments` (those that follow the tensors)."""
    total_q, hq, d = q.shape
    b = total_q // qo_len  # sequences
    k_pages, v_pages = (t.view(torch.uint8) for t in (cache.k_pages, cache.v_pages))
    s = page_strides(cache)  # (page, token, head): NHD or HND
    # grid (Hkv x head tiles x parts, B, splits): a sequence's KV heads (and a KV head's programs) run side by side,
    # so the DRAM pages of its tokens are read together (H200, 64 x 16k: 32/8/128 535.6 against 545.4 us
    # batch-first; 12/4/64 185.5 against 207.4)
    grid = (cache.num_kv_heads * cfg["head_tiles"] * head_parts(d), b, cfg["num_splits"])
    k_scale, v_scale = cache_scales(cache)
    args = (q, k_pages, v_pages, k_scale, v_scale, cache.block_table, cache.seq_lens, part_out, part_lse,
            sm_scale * math.log2(math.e), cfg["tokens_per_split"], cache.num_blocks,
            cache.max_blocks_per_seq * cache.block_size, window or 0, q.stride(0), q.stride(1), s[0], s[1], s[2],
            cache.block_table.stride(0), *token_scale_strides(cache), part_out.stride(0), part_out.stride(1),
            part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    return grid, args


def run_gluon(q: torch.Tensor, cache: PagedKVCache, cfg: DecodeConfig, constants: dict, sm_scale: float,
              out_dtype: torch.dtype, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the Gluon kernel (and the split combine) for a decode of ``q`` over ``cache`` (``constants["QO"]``
    new tokens per sequence: ``q`` ``[B QO, Hq, D]``): the launch ``cfg`` and its ``constants``
    (:func:`launch_constants`) as planned, ``out_dtype`` the output's, ``window`` the sliding window the constants
    were planned with (``constants["WINDOWED"]``), or None."""
    if constants["WINDOWED"] != (window is not None):  # a window of 0 would mask every key: silently zero
        raise ValueError(f"window={window!r} but the launch was planned with WINDOWED={constants['WINDOWED']}; plan "
                         "the launch with the window it runs")
    codes, token_scales = gluon_codes(cache)  # constants of other pages would read these codes or scales wrong
    if constants["CODE_TY"] != kernel_module().CODE_TYPES[codes] or constants["TOKEN_SCALES"] != token_scales:
        raise ValueError(f"the launch was planned with CODE_TY={constants['CODE_TY']}, TOKEN_SCALES="
                         f"{constants['TOKEN_SCALES']}, but this cache holds {codes} codes with "
                         f"{'per-token' if token_scales else 'tensor-wide'} scales; plan the launch for the cache it runs on")
    total_q, hq, d = q.shape
    part_out, part_lse = split_partials(total_q, hq, cfg["num_splits"], d, q.device)
    out = torch.empty(total_q, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    grid, args = gluon_runtime_arguments(q, cache, cfg, sm_scale, part_out, part_lse, constants["QO"], window)
    kernel_module().gluon_decode_kernel[grid](*args, **constants, num_warps=NUM_WARPS)
    combine_splits(part_out, part_lse, out, lse)
    return out, lse
