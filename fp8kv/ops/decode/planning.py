"""A decode planned once, run many times: the choice of kernel (the Gluon kernel where it runs and pays, else
the Triton tensor-core or CUDA-core kernel), its launch, and :class:`DecodePlan`, which holds them with
everything else a run needs but the tensors. Why the Gluon kernel cannot run a decode is said here
(:func:`gluon_refusal`), from the facts of :mod:`.gluon_scope`.

A plan trusts its query: :func:`fp8kv.decode` (and :func:`fp8kv.ops.paged_decode`, called directly) checked it
before planning. What only the plan knows, its launch options, is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import checks
from ...cache import PagedKVCache
from ...cache.quantized import QuantizedPagedKVCache
from ...capability import UnsupportedError, current_arch, interpreter_on
from ...formats import UNQUANTIZED_DTYPES
from ...launch_options import backend_options, kernel_options
from . import splits
from .combine import MAX_PARTIAL_ELEMENTS
from .gluon_launcher import (
    GLUON_MIN_PACKED_SPLIT_TOKENS,
    GLUON_MIN_ROW_SPLIT_TOKENS,
    GLUON_MIN_SPLIT_TOKENS,
    cache_scales,
    gluon_codes,
    gluon_launch,
    kernel_module,
    launch_constants,
)
from .gluon_scope import (
    GLUON_GRANULARITIES,
    GLUON_QUANTIZED_FORMATS,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    NUM_WARPS,
    PACKED_CODES,
    PACKED_HEAD_DIM,
    head_parts,
    max_rows,
)
from .splits import DecodeConfig
from .triton_launcher import TritonLaunch, triton_launch, triton_residency

__all__ = ["DecodePlan", "plan", "plan_rows", "plan_inputs", "check_plan_inputs", "gluon_window", "decode_launch", "launch_for", "decode_kernel",
           "gluon_refusal", "gluon_choice", "codes_refusal", "gluon_config", "OUT_DTYPES", "GLUON_GRANULARITIES", "GLUON_QUANTIZED_FORMATS",
           "GLUON_OPTIONS", "PLAN_OPTIONS", "MAX_ROW_TILES"]

# The most programs a KV head's (token, head) rows are cut into by plan_rows: each program reads and converts every
# K/V tile of its KV head (from L2 after the first). H100, spec-verify, B 16 / 64 x 4k / 16k
# (results/bench/nvidia-h100-80gb-hbm3/20261206T023216Z.csv, ...022925Z.csv, ...023638Z.csv): two programs beat the
# attend kernel at every point (40/8/128 with 4 new tokens, 20 rows: 881 against 1453 us at B 64 x 16k; 32/8/128
# with 8, 32 rows: 903 against 1428), three lost at all four (40/8/128 with 8, 40 rows: 1286 against 1212 us at
# B 64 x 16k, 366 against 322 at 64 x 4k): beyond two the rows are the attend kernel's.
MAX_ROW_TILES = 2
OUT_DTYPES = tuple(UNQUANTIZED_DTYPES.values())  # fp16, bf16, fp32: what the kernels store
# Options the Gluon kernel takes when asked for by name; any other override means the Triton kernel.
GLUON_OPTIONS = kernel_options("gluon")
# The keyword arguments of plan() beyond mode and sm_scale: the Triton backend's options and the variants.
PLAN_OPTIONS = (*backend_options("triton"), "window", "soft_cap", "sinks")


@dataclass(frozen=True, eq=False)  # a plan is itself: it holds a tensor (sinks) and launch objects
class DecodePlan:
    """A decode of ``[B, Hq, D]`` queries of one dtype over one cache, planned: run it with :func:`fp8kv.ops.run`.

    ``kernel`` is ``"gluon"``, ``"triton"`` (the tensor-core kernel) or ``"triton-cuda-core"``, ``config`` its
    launch (block_n, num_warps, num_stages, num_splits, tokens_per_split, head_tiles, heads_per_program);
    ``launch`` what the launcher fixed once (a :class:`~.triton_launcher.TritonLaunch`, or the Gluon kernel's
    constexprs). The plan holds ``sinks`` (read when it runs) but no other tensor: it reads the query and the
    cache's tensors when run, so refill them in place between runs and plan again after the cache's tables
    change shape. ``qo_len`` > 1 (:func:`plan_rows`): that many new tokens per sequence, ``q`` ``[B qo_len, Hq, D]``."""
    kernel: str
    config: DecodeConfig
    mode: str
    sm_scale: float
    shape: tuple[int, int, int]
    q_dtype: torch.dtype
    out_dtype: torch.dtype
    sinks: torch.Tensor | None
    launch: TritonLaunch | dict
    qo_len: int = 1
    window: int | None = None  # the Gluon kernel's sliding window (the Triton kernels' is in their launch)
    inputs: tuple = ()  # plan_inputs(q, cache) of what it was planned for: run refuses anything else


def plan_inputs(q: torch.Tensor, cache) -> tuple:
    """What a plan fixes of its query and cache (shapes, dtypes, device, the cache's format and tables' shapes): a
    plan run on others would read them with the wrong strides, rows or codes, and return a wrong answer, not an
    error. Metadata only: no host sync."""
    fmt = cache.fmt.name if isinstance(cache, QuantizedPagedKVCache) else (cache.kv_dtype, cache.granularity,
                                                                           cache.layout)
    return (tuple(q.shape), q.dtype, q.device, q.stride(-1) == 1, type(cache).__name__, fmt, cache.num_kv_heads,
            cache.head_dim, cache.block_size, tuple(cache.block_table.shape), cache.k_pages.device)


def check_plan_inputs(inputs: tuple, q: torch.Tensor, cache) -> None:
    """ValueError unless ``q`` and ``cache`` are what the plan was made for (its :func:`plan_inputs`)."""
    if not isinstance(q, torch.Tensor):
        checks.fail(f"q must be a torch.Tensor, got {type(q).__name__}", TypeError)
    if not isinstance(cache, (PagedKVCache, QuantizedPagedKVCache)):
        checks.fail(f"cache must be a PagedKVCache or QuantizedPagedKVCache, got {type(cache).__name__}", TypeError)
    now = plan_inputs(q, cache)
    if inputs and now != inputs:
        names = ("q's shape", "q's dtype", "q's device", "q's head_dim contiguous", "the cache's type", "the cache's format", "the cache's KV heads",
                 "the cache's head_dim", "the cache's block_size", "the block table's shape", "the cache's device")
        i = next(i for i, (a, b) in enumerate(zip(now, inputs, strict=True)) if a != b)
        checks.fail(f"{names[i]} is {now[i]}, but the plan was made for {inputs[i]}: plan again for these inputs")


def plan(q: torch.Tensor, cache: PagedKVCache, *, mode: str = "dequant", sm_scale: float | None = None,
         **options) -> DecodePlan:
    """Plan the decode of ``q`` over ``cache`` (of ``q`` only its shape, dtype and device are read): the kernel
    and its launch for these options (:data:`PLAN_OPTIONS`: the launch options of
    :func:`fp8kv.ops.paged_decode` and the variants window, soft_cap and sinks), checked here. Trusted, as
    checked where they entered: ``q`` against the cache and the kernels (:func:`fp8kv.decode`), ``mode``,
    ``sm_scale`` and the variants."""
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        checks.fail(f"{unknown[0]}={options[unknown[0]]!r} is not an option of the triton backend; it takes "
                    f"{PLAN_OPTIONS}", TypeError)
    b, hq, d = q.shape
    group = hq // cache.num_kv_heads
    kernel, cfg = launch_for(b, cache, mode, group, q.device, q_dtype=q.dtype, **options)
    out_dtype = options.get("out_dtype")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    sm_scale = checks.resolved_softmax_scale(sm_scale, d)
    sinks = options.get("sinks")
    if kernel == "gluon":
        window = gluon_window(cache, options.get("window"))
        launch = launch_constants(cfg, group, cache, 1, window is not None)
        return DecodePlan(kernel, cfg, mode, sm_scale, (b, hq, d), q.dtype, out_dtype, sinks, launch, 1, window,
                          plan_inputs(q, cache))
    else:
        launch = triton_launch(cache, cfg, mode, tensor_cores=kernel == "triton", batch=b, num_q_heads=hq,
                               q_dtype=q.dtype, device=q.device, sm_scale=sm_scale, out_dtype=out_dtype,
                               window=options.get("window"), soft_cap=options.get("soft_cap"), sinks=sinks is not None,
                               convert=options.get("convert"), eviction_policy=options.get("eviction_policy", ""),
                               compute_dtype=options.get("compute_dtype"))
    return DecodePlan(kernel, cfg, mode, sm_scale, (b, hq, d), q.dtype, out_dtype, sinks, launch,
                      inputs=plan_inputs(q, cache))


def plan_rows(q: torch.Tensor, cache: PagedKVCache, qo_len: int, *, mode: str = "dequant",
              sm_scale: float | None = None, gluon: bool | None = None, out_dtype: torch.dtype | None = None,
              **others) -> DecodePlan | str:
    """The Gluon kernel's plan of ``qo_len`` new tokens per sequence (speculative verification: ``q``
    ``[B qo_len, Hq, D]``, the sequences' tokens back to back, each the last ``qo_len`` of its row), or why it
    does not take them (a str). A KV head's ``group x qo_len`` (token, head) rows run as a group does in a
    decode, cut into programs of at most :func:`fp8kv.ops.gluon_max_heads` rows, each masked causally, so
    every K/V tile is read once for all the drafts. ``others``: the options and variants of
    :func:`fp8kv.ops.paged_decode` (None = not given; any given is a refusal: this is the default launch).
    ``gluon=None`` refuses a launch whose splits hold fewer than GLUON_MIN_ROW_SPLIT_TOKENS tokens (small
    batches: latency-bound), True plans it anyway, False is a refusal. Trusted as :func:`plan` trusts."""
    qo_len = checks.positive_int(qo_len, "qo_len")
    if gluon is False:
        return "gluon=False: the Triton kernels"
    total_q, hq, d = q.shape
    group = hq // cache.num_kv_heads
    why = gluon_refusal(cache, mode, d, group, q.device, **others)
    given = sorted(k for k, v in others.items() if v is not None and k != "window")
    if why is None and given:
        why = f"{given}: plan_rows takes no launch option (it plans the default launch)"
    if why is not None:
        return why
    tiles = -(-group * qo_len // max_rows(d))
    if tiles > MAX_ROW_TILES:
        return (f"qo_len={qo_len}: {group} x {qo_len} rows per KV head would take {tiles} Gluon programs (at most "
                f"{MAX_ROW_TILES}, of {max_rows(d)} rows each at head_dim {d})")
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in OUT_DTYPES:
        checks.fail(f"out_dtype={out_dtype!r}; expected one of {OUT_DTYPES}", TypeError)
    window = gluon_window(cache, others.get("window"))
    cfg = gluon_launch(total_q // qo_len, cache, group, device=q.device, q_dtype=q.dtype, qo_len=qo_len, window=window)
    least = GLUON_MIN_ROW_SPLIT_TOKENS[head_parts(d)]
    if gluon is None and cfg["tokens_per_split"] < least:
        return (f"splits of {cfg['tokens_per_split']} tokens (fewer than {least}): a latency-bound launch, where the "
                "Gluon kernel's fixed cost per program outweighs its faster loop")
    if total_q * hq * cfg["num_splits"] * d > MAX_PARTIAL_ELEMENTS:
        return (f"{total_q} rows x {hq} heads x {cfg['num_splits']} splits x {d} partials exceed "
                f"{MAX_PARTIAL_ELEMENTS} elements (the kernel's and the combine's 32-bit offsets)")
    launch = launch_constants(cfg, group, cache, qo_len, window is not None)
    return DecodePlan("gluon", cfg, mode, checks.resolved_softmax_scale(sm_scale, d), (total_q, hq, d), q.dtype,
                      out_dtype, None, launch, qo_len, window, plan_inputs(q, cache))


def gluon_window(cache: PagedKVCache, window: int | None) -> int | None:
    """The sliding window the Gluon kernel is compiled with: None where there is none or where it is at least as long
    as the page table (no sequence is longer: the plain kernel)."""
    return None if window is None or window >= cache.max_blocks_per_seq * cache.block_size else window


def gluon_refusal(cache: PagedKVCache, mode: str, head_dim: int, group: int, device, **overrides) -> str | None:
    """Why the Gluon kernel cannot run this decode (None: it can). ``overrides``: the launch options
    and variants of :func:`fp8kv.ops.paged_decode` (None = not given)."""
    try:
        kernel_module()
    except ImportError as e:  # a Triton without the Gluon dialect
        return f"this Triton has no Gluon ({e})"
    device = torch.device(device)
    heads = overrides.get("heads_per_program")
    heads = None if heads is None else checks.positive_int(heads, "heads_per_program")
    others = sorted(k for k, v in overrides.items() if v is not None and k not in (*GLUON_OPTIONS, "window"))
    most_heads = max_rows(head_dim) if head_dim <= MAX_HEAD_DIM else 0
    codes = codes_refusal(cache)
    num_warps = overrides.get("num_warps")
    why = next((w for bad, w in (
        (bool(others), f"the Gluon kernel takes no {others}"),
        (mode != "dequant", f"mode={mode!r}: the Gluon kernel runs dequant mode"),
        (codes is not None, codes),
        (cache.block_size & (cache.block_size - 1), f"block_size={cache.block_size}: the Gluon kernel's tiles "
                                                     "take pages that divide them or that they divide (powers of two)"),
        (head_dim % 16 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM,
         f"head_dim={head_dim}: the Gluon kernel takes multiples of 16 from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}"),
        (heads is not None and heads > most_heads,
         f"heads_per_program={heads}: a Gluon program holds at most {most_heads} query heads at head_dim {head_dim}"),
        (num_warps not in (None, NUM_WARPS), f"num_warps={num_warps!r}: the Gluon kernel runs {NUM_WARPS}"),
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


def codes_refusal(cache) -> str | None:
    """Why the Gluon kernel cannot read ``cache``'s pages and scales (None: it can): FP8 pages with one tensor-wide
    scale or one per token and KV head, or a quantized cache of INT8 or INT4 codes per token and head (INT4 at head dims
    that are multiples of 32); per-token scales read with one set of strides for K and V."""
    if isinstance(cache, PagedKVCache):
        if not cache.is_fp8:
            return f"kv_dtype={cache.kv_dtype}: the Gluon kernel reads FP8 caches (and INT8 / INT4 per token and head)"
        if cache.granularity not in GLUON_GRANULARITIES:
            return (f"granularity={cache.granularity!r}: the Gluon kernel takes one tensor-wide scale or one per token "
                    "and KV head")
    elif not isinstance(cache, QuantizedPagedKVCache) or cache.fmt.name not in GLUON_QUANTIZED_FORMATS:
        name = cache.fmt.name if isinstance(cache, QuantizedPagedKVCache) else type(cache).__name__
        return f"{name}: of the quantized formats the Gluon kernel reads {' and '.join(map(repr, GLUON_QUANTIZED_FORMATS))}"
    codes, token_scales = gluon_codes(cache)
    if codes in PACKED_CODES and cache.head_dim % PACKED_HEAD_DIM:
        return (f"head_dim={cache.head_dim}: the Gluon kernel reads {cache.fmt.name} (two codes a byte) at head dims that "
                f"are multiples of {PACKED_HEAD_DIM} (whole 16-byte rows)")
    if token_scales:
        k_scale, v_scale = cache_scales(cache)
        if k_scale.stride()[:3] != v_scale.stride()[:3]:
            return (f"k and v scales with strides {tuple(k_scale.stride())} and {tuple(v_scale.stride())}: the Gluon "
                    "kernel reads both with one set (call .contiguous() on them)")
    return None


def gluon_choice(gluon) -> bool | None:
    """The ``gluon`` option checked: None (the faster kernel that runs), True or False; else a TypeError naming it."""
    if gluon is not None and not isinstance(gluon, bool):
        raise TypeError(f"gluon={gluon!r}; expected None (the faster kernel that runs), True or False")
    return gluon


def decode_kernel(cache: PagedKVCache, mode: str, head_dim: int, group: int, device, *, gluon: bool | None = None,
                  **overrides) -> str:
    """``"gluon"`` or ``"triton"``: the kernel these arguments allow (:func:`decode_launch` also weighs the
    batch: a latency-bound decode runs the Triton kernel).

    ``gluon=None`` picks Gluon where :func:`gluon_refusal` finds nothing and no override is given
    (launch overrides such as ``block_n`` address the Triton kernel); True raises UnsupportedError
    where Gluon cannot run; False is the Triton kernel."""
    gluon_choice(gluon)
    if gluon is False or (gluon is None and any(v is not None for v in overrides.values())):
        return "triton"
    why = gluon_refusal(cache, mode, head_dim, group, device, **overrides)
    if gluon:
        if why is not None:
            raise UnsupportedError(f"gluon=True: {why}; use the Triton kernel (gluon=False)")
        return "gluon"
    return "gluon" if why is None else "triton"


def gluon_config(batch: int, cache, group: int, device, *, gluon: bool | None, q_dtype: torch.dtype,
                 num_splits: int | None = None, block_n: int | None = None, num_stages: int | None = None,
                 heads_per_program: int | None = None, window: int | None = None) -> DecodeConfig | None:
    """The Gluon kernel's launch of a decode it can run (:func:`gluon_refusal` found nothing), or None where, unless
    ``gluon`` is True, the Triton kernel runs it: a group cut into several Gluon programs (each converts every tile;
    neither planned nor compiled then) or splits shorter than GLUON_MIN_SPLIT_TOKENS (latency-bound; INT4 codes:
    GLUON_MIN_PACKED_SPLIT_TOKENS where that is lower)."""
    head_dim = cache.head_dim
    if not gluon and group > (heads_per_program or max_rows(head_dim)):
        return None
    cfg = gluon_launch(batch, cache, group, num_splits=num_splits, block_n=block_n, num_stages=num_stages,
                       heads_per_program=heads_per_program, device=device, q_dtype=q_dtype,
                       window=gluon_window(cache, window))
    least = GLUON_MIN_SPLIT_TOKENS[head_parts(head_dim)]
    if gluon_codes(cache)[0] in PACKED_CODES:
        least = min(least, GLUON_MIN_PACKED_SPLIT_TOKENS)
    return cfg if gluon or cfg["tokens_per_split"] >= least else None


def launch_for(batch: int, cache: PagedKVCache, mode: str, group: int, device, *, q_dtype: torch.dtype,
               out_dtype: torch.dtype | None = None, eviction_policy: str = "", **options) -> tuple[str, DecodeConfig]:
    """The kernel and launch :func:`fp8kv.ops.paged_decode` takes for ``batch`` ``q_dtype`` queries with these of its
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
    """The kernel :func:`fp8kv.ops.paged_decode` runs for these arguments and its launch: ``("gluon", cfg)``,
    ``("triton", cfg)`` (the tensor-core kernel) or ``("triton-cuda-core", cfg)``. By default Gluon runs
    where :func:`decode_kernel` allows it, each split streams at least GLUON_MIN_SPLIT_TOKENS tokens (by
    the head's parts) and a
    KV head's query heads fit one program (:func:`fp8kv.ops.gluon_max_heads`); shorter splits (small batches:
    latency-bound) and larger groups go to the Triton kernel. A group cut into several Gluon programs
    converts every FP8 tile once per program, where the Triton kernel's one program of up to 64 heads
    converts it once (H200, 64 x 16k, ``results/bench/nvidia-h200/20261203T234329Z-gluon-groups.json``:
    48/1/128 213.0 us in three Gluon programs against 153.9 in one Triton program; 71/1/64 175.5 against
    176.5; a group of 20 in one Gluon program, 40/2/64: 134.7 against 202.4; with the block table clamped
    where used, ``...20261204T164000Z-gluon-page-clamp.json``: 48/1/128 206.5 against 153.9, 71/1/64 171.9
    against 176.1, one rule for both). ``others``: the
    remaining options and variants of :func:`fp8kv.ops.paged_decode` (convert, eviction_policy, compute_dtype,
    soft_cap, sinks; None = not given), which :func:`decode_kernel` weighs and, on a GPU, the Triton kernel
    is compiled with to read the programs an SM holds. On a GPU, unless ``num_splits`` is given, the splits
    fill the waves of those programs (:func:`fp8kv.ops.fill_waves`; the kernel compiled once per shape, for a
    ``q_dtype`` query)."""
    if use_tensor_cores is not None and not isinstance(use_tensor_cores, bool):
        raise TypeError(f"use_tensor_cores={use_tensor_cores!r}; expected True (or None, the default: tensor "
                        "cores) or False (the CUDA-core kernel)")
    kernel = decode_kernel(cache, mode, head_dim, group, device, gluon=gluon, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, heads_per_program=heads_per_program, window=window,
                           use_tensor_cores=None if use_tensor_cores is not False else False, **others)
    if kernel == "gluon":
        cfg = gluon_config(batch, cache, group, device, gluon=gluon, q_dtype=q_dtype, num_splits=num_splits,
                           block_n=block_n, num_stages=num_stages, heads_per_program=heads_per_program, window=window)
        if cfg is not None:
            return kernel, cfg
    tensor_cores = use_tensor_cores is not False

    def planned(programs_per_sm: int | None) -> DecodeConfig:
        return splits.launch_config(batch, cache, mode, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                                    num_stages=num_stages, device=device, window=window, use_tensor_cores=tensor_cores,
                                    group=group, heads_per_program=heads_per_program, programs_per_sm=programs_per_sm)

    cfg = planned(None)
    dev = torch.device(device)
    if tensor_cores and num_splits is None and dev.type == "cuda" and not interpreter_on() and \
            splits.fills_waves(batch, cache, cfg, 1, window, splits.sm_count(dev)):
        variants = dict(window=window, soft_cap=others.get("soft_cap"), sinks=others.get("sinks"),
                        convert=others.get("convert"), eviction_policy=others.get("eviction_policy") or "",
                        compute_dtype=others.get("compute_dtype"))
        cfg = planned(triton_residency(batch, cache, cfg, mode, group, q_dtype, dev, variants))
    return ("triton" if tensor_cores else "triton-cuda-core"), cfg
