"""Host launcher of the multi-token paged attention kernel (``fp8kv/ops/attend/kernel.py``):
speculative-decode verification and chunked-prefill append over an FP8 (or 16-bit) paged cache.

:func:`run` launches a :class:`~.planning.AttendPlan` (the kernel and, with several KV splits, the decode's
split combine): allocation and launches only, no host sync, so a run can be captured in a CUDA graph.
:func:`attend` checks every argument, plans and runs. It answers what :func:`fp8kv.reference.attend` defines,
within the decode's tolerances. Under the Triton interpreter (CPU), whose bf16 arithmetic is wrong, what
would be computed or stored in bf16 runs in fp32 and is rounded to bf16 by torch, as the decode launcher does.
"""

from __future__ import annotations

import torch

from ... import checks
from ...attend_checks import attend_arguments, planned_qo_indptr
from ...cache import PagedKVCache
from ...capability import MODES, UnsupportedError, check_query, check_query_strides
from ...capability import check as supported
from ..decode.combine import combine_splits, split_partials
from ..decode.planning import check_plan_inputs
from ..pages import kernel_pages, page_strides
from .kernel import paged_attend_kernel
from .planning import AttendPlan, plan_attend

__all__ = ["attend", "run_attend"]


def run_attend(plan: AttendPlan, q: torch.Tensor, cache: PagedKVCache,
               qo_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run an attend :func:`~.planning.plan_attend` made for ``q``'s shape and dtype and ``qo_indptr``'s counts
    over ``cache``: out ``[total_q, Hq, D]`` (the plan's out_dtype) and lse ``[total_q, Hq]`` fp32 (natural
    log). Device work only, no host sync: ``q``, ``cache`` and ``qo_indptr`` are checked against the plan by their
    metadata alone (:func:`~fp8kv.ops.decode.planning.check_plan_inputs`), their values not again."""
    check_plan_inputs(plan.inputs, q, cache)
    planned_qo_indptr(qo_indptr, cache)
    total_q, hq, d = plan.shape
    out = torch.empty(total_q, hq, d, dtype=plan.kernel_out_dtype, device=q.device)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out.to(plan.out_dtype), lse
    splits = plan.config["num_splits"]
    if splits == 1:
        k_out, k_lse = out, lse
        so = (out.stride(0), out.stride(1), 0)
    else:
        k_out, k_lse = split_partials(total_q, hq, splits, d, q.device)
        so = (k_out.stride(0), k_out.stride(1), k_out.stride(2))
    sc = plan.scalars
    sinks = plan.sinks
    paged_attend_kernel[plan.grid](
        q, kernel_pages(cache, cache.k_pages, plan.fp8_values[0]), kernel_pages(cache, cache.v_pages, plan.fp8_values[1]),
        cache.k_scale, cache.v_scale, cache.block_table, cache.seq_lens, qo_indptr, k_out, k_lse,
        sc["qk_scale"], sc["tokens_per_split"], cache.num_kv_heads, cache.num_blocks, sc["row_capacity"],
        sc["total_q"], sc["batch"], sc["search_steps"], sc["window"], sc["soft_cap_log2"],
        sinks if sinks is not None else lse,
        q.stride(0), q.stride(1), *page_strides(cache), cache.block_table.stride(0), *so,
        k_lse.stride(0), k_lse.stride(1), **plan.constexprs)
    if splits > 1:
        combine_splits(k_out, k_lse, out, lse, sinks)
    return out.to(plan.out_dtype), lse


def attend(q: torch.Tensor, cache: PagedKVCache, qo_indptr: torch.Tensor, *, mode: str = "dequant",
           sm_scale: float | None = None, window: int | None = None, soft_cap: float | None = None,
           sinks: torch.Tensor | None = None, **options):
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
    options : ``out_dtype`` (default q's: float16, bfloat16 or float32), ``convert`` (how dequant mode
        converts FP8, as :func:`fp8kv.ops.paged_decode` takes it) and the launch overrides ``num_splits``,
        ``block_m``, ``block_n``, ``num_warps`` (:func:`~.planning.attend_launch`):
        :data:`fp8kv.attend_checks.ATTEND_OPTIONS`.

    Every argument is validated (``fp8kv.attend_checks.attend_arguments`` plus the mode, dtypes and launch
    options here): a ``TypeError``/``ValueError`` names it; a combination this machine cannot run raises
    :class:`~fp8kv.capability.UnsupportedError` with the capability table's reason. The checks read the
    tables and ``qo_indptr`` on the host, so a call is not captured in a CUDA graph: :func:`fp8kv.attend` is
    the checked entry, ``fp8kv.backends.planned_attend`` (or :func:`~.planning.plan_attend` then
    :func:`run_attend`) the capturable one.

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
    check_query_strides("triton", q)
    ok, why = supported("triton", cache.kv_dtype, mode, granularity=cache.granularity, head_dim=cache.head_dim,
                        layout=cache.layout, op="attend")
    if not ok:
        raise UnsupportedError(f"mode={mode}, kv_dtype={cache.kv_dtype}, granularity={cache.granularity}: {why}")
    plan = plan_attend(q, cache, qo_indptr, mode=mode, sm_scale=sm_scale, qo_lens=qo_lens, window=window,
                       soft_cap=soft_cap, sinks=sinks, **options)
    return run_attend(plan, q, cache, qo_indptr)
