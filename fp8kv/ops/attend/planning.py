"""A multi-token attention planned once, run many times: the launch (:func:`attend_launch`: rows per program,
key tiles, warps, splits) and :class:`AttendPlan`, which holds it with the grid, the kernel's constexprs and
scalars: everything a run needs but the tensors.

A plan trusts what :func:`fp8kv.attend` (or :func:`fp8kv.ops.attend.attend`, called directly) checked before
planning: the query against the cache, ``qo_indptr`` (whose counts it reads once, on the host), ``mode``,
``sm_scale`` and the variants. What only the plan knows, its launch options, is checked here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import checks, launch_options
from ...attend_checks import ATTEND_KERNEL_OPTIONS, ATTEND_OPTIONS, qo_indptr_arg
from ...cache import PagedKVCache
from ...capability import UnsupportedError, arch_number, current_arch, interpreter_on
from ..decode.combine import MAX_PARTIAL_ELEMENTS
from ..decode.gluon_launcher import smem_per_block
from ..decode.planning import OUT_DTYPES, plan_inputs
from ..decode.splits import LATENCY_WAVES, sm_count
from ..decode.triton_launcher import CONVERT_CODES, MODE_FLAGS, converts
from ..pages import format_bits, scale_kind

__all__ = ["AttendPlan", "plan_attend", "attend_launch", "AttendConfig", "BLOCK_M_CHOICES", "ATTEND_MAX_SPLITS",
           "LATENCY_BLOCK_M", "MIN_TILES_PER_SPLIT", "CHUNK_TILES", "chunk_smem_bytes",
           "attend_constexprs"]

BLOCK_M_CHOICES = (16, 32, 64, 128)  # rows per program: tl.dot's minimum 16, at most 128 (registers)
ATTEND_MAX_SPLITS = 64  # the combine holds splits x D partials per program
# Splits are added while the programs fill fewer than LATENCY_WAVES (the decode's four) waves of SMs where tiles
# are small (block_m <= LATENCY_BLOCK_M: a few draft tokens, which stream K/V like a decode), and one wave where
# they are large (a chunk: each program already has work enough, and partials of many rows cost traffic).
LATENCY_BLOCK_M = 32
MIN_TILES_PER_SPLIT = 2  # a split of fewer key tiles would spend more on its prologue and the combine
# A chunk's (block_n, num_stages), the first whose tiles fit the GPU's shared memory: on an H100, 128-key tiles
# three deep took 2048-token chunks after 16k cached tokens 6736 -> 6077 us (bf16), 9970 -> 7638 (e4m3 pages,
# dequant) against 64 two deep (results/bench/nvidia-h100-80gb-hbm3/20261207T125722Z.csv, ...125855Z.csv)
CHUNK_TILES = ((128, 3), (128, 2))
_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# Launch parameters by name: block_m, block_n, num_warps, num_stages, num_splits, tokens_per_split.
AttendConfig = dict[str, int]


def attend_launch(qo_lens: list[int], seq_lens: list[int], cache: PagedKVCache, group: int, mode: str, *,
                  window: int | None = None, num_splits: int | None = None, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  num_sms: int | None = None, smem_bytes: int | None = None, arch: str | None = None) -> AttendConfig:
    """The launch of a multi-token attention for sequences of ``qo_lens`` new tokens and ``seq_lens`` cached
    ones (both ints, already checked), ``group`` query heads per KV head: defaults, then the overrides.

    * ``block_m``: rows (query, head) per program, one of :data:`BLOCK_M_CHOICES`. Default: the longest
      sequence's rows (``max(qo_len) x group``) rounded up to a power of two, at most 128 (64 at head dims
      above 128): spec-verify takes one program per (sequence, KV head), a chunk tiles of 128 rows.
    * ``block_n``: keys per tile, a power of two in [16, 256] (fp8 mode: >= 32, the FP8 dot's minimum K).
      Default 64 (32 at head dims above 128: the K and V tiles then hold as many bytes); on sm90 and newer
      (``arch``, default the cache's GPU's: warpgroup MMA; sm80's builds of them spill 0.6-3 KB a thread) a chunk's
      tiles (128 rows, head dims 65-128, where they were timed) take the first of :data:`CHUNK_TILES` that fits
      ``smem_bytes`` (default: the shared memory a program may use on the GPU; :func:`chunk_smem_bytes`), with
      its ``num_stages``.
    * ``num_warps``: one of ``launch_options.WARP_COUNTS``; default 8 for tiles of 128 x 128 or more
      (query rows x padded head dim: the fp32 accumulator would take 128 registers a thread in 4 warps), else 4.
    * ``num_stages``: software-pipeline stages of the key loop (a positive int); default 2 (1 under the
      interpreter).
    * ``num_splits``: KV splits (a positive int). Default: one, unless the programs fill fewer than
      :data:`~fp8kv.ops.LATENCY_WAVES` waves of ``num_sms`` SMs (tiles of at most :data:`LATENCY_BLOCK_M`
      rows, as in spec-verify at small batch; one wave for larger tiles); then as many as fill them, each at
      least :data:`MIN_TILES_PER_SPLIT` key tiles of the longest span a program reads (the longest sequence,
      or the window plus the tile's queries), at most :data:`ATTEND_MAX_SPLITS`. The count is realised in
      whole key tiles per split (``tokens_per_split``), so none is empty; the last split also takes any keys past
      them (sequences grown since planning).
    """
    d_pad = max(16, triton.next_power_of_2(cache.head_dim))
    if block_m is None:
        rows = max(max(qo_lens, default=1), 1) * group
        block_m = min(max(16, triton.next_power_of_2(rows)), 128 if d_pad <= 128 else 64)
    else:
        block_m = checks.one_of(checks.integer(block_m, "block_m"), "block_m", BLOCK_M_CHOICES)
    block_n = launch_options.check_block_n(block_n, least=launch_options.DOT_MIN_ROWS)
    if arch is None and cache.device.type == "cuda":
        arch = current_arch(cache.device)
    if block_n is None and num_stages is None and block_m == 128 and d_pad == 128 and arch is not None \
            and arch_number(arch) >= 90:
        if smem_bytes is None and not interpreter_on():
            smem_bytes = smem_per_block(cache.device)
        elem = 1 if cache.is_fp8 else 2  # the pages' bytes an element, as the tiles hold them
        fits = [t for t in CHUNK_TILES if smem_bytes is not None and chunk_smem_bytes(*t, d_pad, elem) <= smem_bytes]
        block_n, num_stages = fits[0] if fits else (None, None)
    if block_n is None:
        block_n = 64 if d_pad <= 128 else 32
    if block_n < launch_options.least_block_n(mode):
        checks.fail(f"block_n={block_n}: fp8 mode needs block_n >= {launch_options.FP8_DOT_MIN_K} (the FP8 dot's "
                    "minimum K)")
    num_warps, num_stages = launch_options.check_warps(num_warps), launch_options.check_stages(num_stages)
    if num_warps is None:
        num_warps = 8 if block_m * d_pad >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 1 if interpreter_on() else 2
    longest = max(max(seq_lens, default=1), 1)
    span = longest if window is None else min(longest, window + block_m // group + 1)
    if num_splits is None:
        sms = sm_count(cache.device) if num_sms is None else num_sms
        programs = cache.num_kv_heads * sum(math.ceil(n * group / block_m) for n in qo_lens)
        waves = LATENCY_WAVES if block_m <= LATENCY_BLOCK_M else 1
        wanted = math.ceil(waves * sms / max(programs, 1))
        num_splits = max(1, min(wanted, math.ceil(span / (block_n * MIN_TILES_PER_SPLIT)), ATTEND_MAX_SPLITS))
    else:
        num_splits = checks.positive_int(num_splits, "num_splits")
    tokens_per_split = math.ceil(math.ceil(span / num_splits) / block_n) * block_n
    num_splits = max(1, math.ceil(span / tokens_per_split))
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                num_splits=num_splits, tokens_per_split=tokens_per_split)


def attend_constexprs(cache: PagedKVCache, q_dtype: torch.dtype, num_q_heads: int, cfg: AttendConfig, mode: str, *,
                      arch: str | None, window: bool = False, soft_cap: bool = False, sinks: bool = False,
                      convert: str | None = None, interpret: bool = False) -> dict:
    """The attend kernel's constexprs and launch (warps, stages) for a planned launch ``cfg`` over ``cache``:
    what :func:`plan_attend` passes, with no device needed (``arch``: the GPU's, e.g. ``"sm90"``, None off CUDA;
    ``interpret``: Triton's interpreter, whose bf16 is wrong, so the dots then run in fp32), so an offline build
    (scripts/attend_sass.py) compiles what a GPU runs."""
    fp8_qk, fp8_pv = MODE_FLAGS[mode]
    convert_k, convert_v = converts(convert, arch, cache.kv_dtype, mode)
    compute = torch.float16 if cache.is_fp8 else q_dtype
    rescale_q = compute == torch.float16 and not fp8_qk and (q_dtype != torch.float16 or cache.granularity == "channel")
    if interpret:
        compute = torch.float32 if compute == torch.bfloat16 else compute
    d = cache.head_dim
    return dict(
        GROUP=num_q_heads // cache.num_kv_heads, BLOCK_M=cfg["block_m"], HEAD_DIM=d,
        D_PAD=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=cache.block_size, BLOCK_N=cfg["block_n"],
        SPLIT=cfg["num_splits"] > 1, SCALE_KIND=scale_kind(cache), SCALE_HEAD_STRIDE=int(cache.k_scale.numel() > 1),
        KV_FP8=cache.is_fp8, CONVERT_K=CONVERT_CODES[convert_k], CONVERT_V=CONVERT_CODES[convert_v], FP8_QK=fp8_qk,
        FP8_PV=fp8_pv, ROUND_HW=arch is not None, COMPUTE=_COMPUTE[compute], RESCALE_Q=rescale_q, WINDOWED=window,
        SOFT_CAP=soft_cap, HAS_SINKS=sinks, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **format_bits(cache))


def chunk_smem_bytes(block_n: int, num_stages: int, d_pad: int, elem: int, block_m: int = 128) -> int:
    """Shared memory of the attend kernel's tiles: ``num_stages`` K and V tiles of ``block_n`` keys of ``elem``
    bytes each, and the 16-bit query tile (the sm90 builds: 98304 bytes at 64 keys, 2 stages, bf16 pages; 65536
    over e4m3 pages, scripts/attend_sass.py)."""
    return num_stages * block_n * d_pad * elem * 2 + block_m * d_pad * 2


@dataclass(frozen=True, eq=False)  # a plan is itself: it holds a tensor (sinks)
class AttendPlan:
    """A multi-token attention of ``[total_q, Hq, D]`` queries of one dtype over one cache, planned: run it with
    :func:`fp8kv.ops.attend.run`.

    ``config`` is the launch (:func:`attend_launch`), ``qo_lens`` the new-token counts it was sized for,
    ``grid`` / ``constexprs`` / ``scalars`` what the kernel is launched with. The plan holds ``sinks`` (read
    when it runs) but no other tensor: it reads the query, ``qo_indptr`` and the cache's tensors when run, so
    refill them in place between runs. The cache's lengths and tables may change within its row capacity (read on
    the device; the last split takes the keys past the planned longest); ``q``, the cache's shapes and format and
    ``qo_indptr``'s shape are checked when it runs (metadata only); the counts' sum must stay ``total_q``."""
    config: AttendConfig
    mode: str
    sm_scale: float
    shape: tuple[int, int, int]
    q_dtype: torch.dtype
    out_dtype: torch.dtype
    kernel_out_dtype: torch.dtype  # what the kernel stores (fp32 for bf16 under the interpreter)
    qo_lens: tuple[int, ...]
    sinks: torch.Tensor | None
    grid: tuple[int, int, int]
    constexprs: dict
    scalars: dict  # the kernel's runtime scalars but strides
    fp8_values: tuple[bool, bool]  # K / V pages read as FP8 values (else as uint8 codes)
    inputs: tuple = ()  # plan_inputs(q, cache) of what it was planned for: run refuses anything else


def plan_attend(q, cache: PagedKVCache, qo_indptr: torch.Tensor, *, mode: str = "dequant",
                sm_scale: float | None = None, qo_lens: list[int] | None = None, window: int | None = None,
                soft_cap: float | None = None, sinks: torch.Tensor | None = None, **options) -> AttendPlan:
    """Plan the attention of ``q`` over ``cache`` (of ``q`` only its shape and dtype are read: a tensor on the
    cache's device, or a meta tensor of its shape): the host work, done once. Reads the new-token counts of ``qo_indptr`` (one
    host sync; none where ``qo_lens``, the counts already read, are given) and the cache's lengths, picks the
    launch (:func:`attend_launch`) for the options of :data:`fp8kv.attend_checks.ATTEND_OPTIONS` (``out_dtype``,
    ``convert`` as :func:`fp8kv.ops.paged_decode` takes it, and the launch overrides), checked here, and fixes
    the grid, the constexprs and the scalars. Trusted, as checked where they entered: ``q`` against the cache,
    ``qo_indptr``, ``mode``, ``sm_scale`` and the variants."""
    unknown = sorted(set(options) - set(ATTEND_OPTIONS))
    if unknown:
        checks.fail(f"{unknown[0]}={options[unknown[0]]!r} is not an option of the triton attend; it takes "
                    f"{ATTEND_OPTIONS}", TypeError)
    device = cache.device  # q's (checked where it entered); a meta query plans for the cache's device
    if device.type != "cuda" and not interpreter_on():
        raise UnsupportedError("the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU")
    total_q, hq, d = q.shape
    group = hq // cache.num_kv_heads
    out_dtype = options.get("out_dtype")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        checks.fail(f"out_dtype={out_dtype!r}; expected one of {OUT_DTYPES}", TypeError)
    if window is not None and window >= cache.max_blocks_per_seq * cache.block_size:
        window = None  # no sequence is longer: the plain kernel
    qo_lens = qo_indptr_arg(qo_indptr, cache, total_q) if qo_lens is None else list(qo_lens)  # read once, checked
    arch = current_arch(device) if device.type == "cuda" else None
    cfg = attend_launch(qo_lens, cache.seq_lens.tolist(), cache, group, mode, window=window, arch=arch,
                        **{k: options.get(k) for k in ATTEND_KERNEL_OPTIONS})
    splits = cfg["num_splits"]
    if splits > 1 and total_q * hq * splits * d > MAX_PARTIAL_ELEMENTS:
        checks.fail(f"num_splits={splits}: {total_q} rows x {hq} heads x {splits} splits x {d} partials exceed "
                    f"{MAX_PARTIAL_ELEMENTS} elements (the combine's 32-bit offsets); ask for fewer splits")
    kernel_out_dtype = torch.float32 if interpreter_on() and out_dtype == torch.bfloat16 else out_dtype
    sm_scale = checks.resolved_softmax_scale(sm_scale, d)
    b = cache.batch_size
    block_m = cfg["block_m"]
    constexprs = attend_constexprs(cache, q.dtype, hq, cfg, mode, arch=arch, window=window is not None,
                                   soft_cap=soft_cap is not None, sinks=sinks is not None,
                                   convert=options.get("convert"), interpret=interpreter_on())
    # Soft-capping takes tanh of score / cap, computed from e^(2 score / cap): fold that into q.k's factor.
    scalars = dict(qk_scale=sm_scale * math.log2(math.e) * (1.0 if soft_cap is None else 2.0 / soft_cap),
                   tokens_per_split=cfg["tokens_per_split"], row_capacity=cache.max_blocks_per_seq * cache.block_size,
                   total_q=total_q, batch=b, search_steps=max(0, math.ceil(math.log2(b))), window=window or 0,
                   soft_cap_log2=0.0 if soft_cap is None else soft_cap * math.log2(math.e))
    inputs = plan_inputs(q, cache)
    inputs = (*inputs[:2], device, *inputs[3:])  # a meta query plans for the cache's device
    return AttendPlan(cfg, mode, sm_scale, (total_q, hq, d), q.dtype, out_dtype, kernel_out_dtype, tuple(qo_lens),
                      sinks, (total_q * group // block_m + b, cache.num_kv_heads, splits), constexprs, scalars,
                      tuple(constexprs[f"FP8_{dot}"] or constexprs[f"CONVERT_{kv}"] == CONVERT_CODES["cast"]
                            for dot, kv in (("QK", "K"), ("PV", "V"))), inputs)
