"""Paged decode attention with fp8kv's kernels: :func:`plan` a decode once (kernel, launch, everything but the
tensors), :func:`run` the plan many times, or :func:`paged_decode` for both in one call.

A decode launches the decode kernel (and the split combine) and nothing else: scales are read in place and
the fp8-mode query is quantized inside the kernel. No ``.item()``, no host sync, so a run can be captured in
a CUDA graph. The kernels clamp block-table entries and sequence lengths to the page pool, so even a table
corrupted after validation cannot make them read or write outside it.

Modules: :mod:`.planning` (the plan and the choice of kernel), :mod:`.splits` (tiles, splits, waves, residency),
:mod:`.triton_launcher` / :mod:`.triton_kernel` / :mod:`.cuda_core_kernel` / :mod:`.triton_helpers` (the Triton
kernels), :mod:`.gluon_launcher` / :mod:`.gluon_kernel` / :mod:`.gluon_scope` (the Gluon kernel), :mod:`.combine`
(the split combine), and :mod:`.gluon_build` (the Gluon kernel compiled offline; imported on its own).
"""

import torch

from ... import checks
from ...cache import PagedKVCache
from ...capability import MODES, UnsupportedError, check_query, check_query_strides, scales_refusal
from .gluon_launcher import run_gluon
from .planning import DecodePlan, check_plan_inputs, plan, plan_rows
from .triton_launcher import run_triton

__all__ = ["plan", "plan_rows", "run", "paged_decode", "DecodePlan"]


def run(plan: DecodePlan, q: torch.Tensor, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a decode :func:`plan` (or :func:`~.planning.plan_rows`) made for ``q``'s shape and dtype over ``cache``:
    out ``[B, Hq, D]`` (``[B qo_len, Hq, D]``; the plan's out_dtype) and lse ``[B, Hq]`` fp32 (natural log).
    Device work only: no host sync; q and cache must be what the plan was made for (shapes, dtypes, device, the
    cache's format: :func:`~.planning.check_plan_inputs`, metadata only), their values are not checked again."""
    check_plan_inputs(plan.inputs, q, cache)
    if plan.kernel == "gluon":
        return run_gluon(q, cache, plan.config, plan.launch, plan.sm_scale, plan.out_dtype, plan.window)
    return run_triton(q, cache, plan.launch, plan.sinks)


def paged_decode(q: torch.Tensor, cache: PagedKVCache, *, mode: str = "dequant", sm_scale: float | None = None,
                 **options):
    """Triton paged decode attention.

    :func:`plan` and :func:`run` in one call, ``fp8kv.decode(..., backend="triton")`` without its checks of the
    cache's contents and the query's values (host syncs): call that. Checked here, from shapes, types and scalars
    alone (no host sync): the cache's type, the query against it (:meth:`~fp8kv.cache.PagedKVCache.check_query`:
    a mismatched query read out of bounds) and against the kernels (its dtype; head_dim contiguous; no fp8 mode
    over token_head scales), ``mode``, ``sm_scale``, the variants' types and shapes
    (:func:`fp8kv.checks.attention_variant` without its values) and, by :func:`plan`, the launch options.

    Parameters
    ----------
    q : ``[B, Hq, D]`` bfloat16 / float16 (last dim contiguous), one query token per sequence.
    cache : :class:`~fp8kv.cache.PagedKVCache` (bf16 / fp16 / fp8_e4m3 / fp8_e5m2; NHD or HND).
    mode : ``"dequant"`` (FP8 → q's 16-bit type in registers) or ``"fp8"`` (FP8 query and probabilities,
        FP8 tensor cores; sm89+, tensor / head / channel scales).
    num_splits, block_n, num_warps, num_stages, heads_per_program : launch overrides (defaults from the
        shape; see :func:`fp8kv.ops.launch_config`).
    convert : how dequant mode turns FP8 codes into 16-bit values: ``"software"`` (integer ops, any
        GPU; the default before sm89, where Triton has no e4m3), ``"cast"`` (Triton's conversion; the
        default under the interpreter) or ``"ptx"`` (inline ``cvt.rn.f16x2.e4m3x2``, sm89+); one
        name for both tiles, or ``"K/V"`` (such as ``"cast/ptx"``) for one per tile. FP8 pages only: over
        16-bit pages (nothing to convert) a convert given is a ValueError.
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
        (:mod:`.gluon_kernel`: warps stream their own token slices, FP8 tiles
        converted in the tensor-core operand layout, copied through a cp.async ring) wherever it runs,
        no Triton launch override is given and each split holds GLUON_MIN_SPLIT_TOKENS tokens or more
        (1024; 512 for head dims above 128);
        else the Triton kernel (:func:`fp8kv.ops.decode_launch` says which). True asks for the Gluon kernel and
        raises UnsupportedError by name outside its shapes: a CUDA GPU (sm89+), dequant mode, an FP8
        cache with one tensor-wide scale or one per token and KV head, NHD or HND pages, head_dim 48-256 in multiples of 16, any group (cut
        into programs of at most :func:`fp8kv.ops.gluon_max_heads` query heads, or ``heads_per_program``), a
        sliding window but no soft cap or sinks; ``block_n`` 64 or 128 and ``num_stages`` its ring depth 2-4 (default:
        :func:`fp8kv.ops.gluon_tile`), 4 warps. False: the Triton kernel. H200, B=64 x 16k, e4m3: 32/8/128
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
    if not isinstance(cache, PagedKVCache):
        checks.fail(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}", TypeError)
    cache.check_query(q)  # a query of another shape than the cache's would be read past its end
    checks.one_of(mode, "mode", MODES)
    if sm_scale is not None:
        sm_scale = checks.softmax_scale(sm_scale, options.get("soft_cap"))
    window, soft_cap, sinks = checks.attention_variant(options.get("window"), options.get("soft_cap"),
                                                       options.get("sinks"), num_q_heads=q.shape[1], device=q.device,
                                                       contents=False)
    options = {**options, **{k: v for k, v in dict(window=window, soft_cap=soft_cap, sinks=sinks).items()
                             if k in options}}
    ok, why = check_query("triton", q.dtype, cache.kv_dtype)  # 16-bit, and fp16 only over FP8 or fp16 pages
    if not ok:
        raise TypeError(why)
    check_query_strides("triton", q)
    refusal = scales_refusal("triton", mode, cache.granularity)
    if refusal:
        raise UnsupportedError(refusal)
    return run(plan(q, cache, mode=mode, sm_scale=sm_scale, **options), q, cache)
