"""How the attend (``fp8kv.attend``: several new tokens per sequence, causal among them) runs on each backend: the
facts :func:`fp8kv.capability.check` adds for ``op="attend"`` to a combination whose decode runs
(:func:`attend_facts`), and, per class of new-token counts (:data:`QUERY_CLASSES`), the kernel that runs and why
(:func:`query_kernel`; the table :func:`fp8kv.capability.attend_capability` with ``by_queries=True``).

The facts, from the dispatch of ``fp8kv.backends`` (its attend planners) and the kernels' own refusals, for the
default launch (no launch option of the attend kernel):

* fp8kv's Triton backend. One new token in every sequence is a decode: the decode's plan (``fp8kv.ops.decode.plan``,
  so ``fp8kv.attend`` gives ``fp8kv.decode``'s answer bit for bit): the Gluon decode kernel where it runs (dequant
  mode, FP8 pages with one tensor-wide scale or one per token and KV head, a compiled sm89+ GPU, a power-of-two page
  size, head_dim a multiple of 16 from 48 to 256: ``fp8kv.ops.decode.planning.gluon_refusal``) and pays (a KV
  head's group in one program, splits of at least ``GLUON_MIN_SPLIT_TOKENS``: 1024 tokens, 512 above head_dim 128),
  else the Triton tensor-core decode kernel. As many new tokens in every sequence run the Gluon kernel's (token,
  head) rows where ``fp8kv.ops.decode.plan_rows`` takes them: the same conditions, a KV head's ``group x count``
  rows in at most ``MAX_ROW_TILES`` (2) programs of ``max_rows(head_dim)`` rows (32 up to head_dim 64, 16 above: 64
  or 32 rows a KV head) and splits of at least ``GLUON_MIN_ROW_SPLIT_TOKENS`` (512) tokens; else, and for counts
  that differ, the Triton attend kernel (``fp8kv.ops.attend``), in both modes.
* FlashInfer: ``BatchPrefillWithPagedKVCacheWrapper`` (FA2, 16-bit query) for every count, one included, in dequant
  mode only: its FP8-query paths are not wired for the attend.
* vLLM: ``unified_attention`` with ``cu_seqlens_q = qo_indptr`` and ``max_seqlen_q`` the longest count; its split
  ("3D") launch only where every count is one (and at most ``128 // Hkv`` sequences), else its 2D launch.
* The reference: the fp32 oracle, whatever the counts.
"""

from __future__ import annotations

from . import checks
from .formats import is_fp8

__all__ = ["QUERY_CLASSES", "QUERY_CLASS_TEXT", "attend_facts", "query_kernel"]

# The classes of new-token counts whose kernels differ. "2+ equal": the same count, two or more, in every sequence
# (speculative verification) with a KV head's (token, head) rows in two Gluon programs; "ragged or long": counts that
# differ (chunked prefill beside decodes), or equal ones with more rows than that.
QUERY_CLASSES = ("1", "2+ equal", "ragged or long")
QUERY_CLASS_TEXT = {
    "1": "one new token in every sequence (a decode)",
    "2+ equal": ("as many new tokens, two or more, in every sequence, a KV head's group x count (token, head) rows "
                 "within two Gluon programs: at most 64 rows at head_dim <= 64, 32 above (8 new tokens at a group "
                 "of 4, head_dim 128)"),
    "ragged or long": "counts that differ between sequences, or as many in each with more rows than that",
}
_GLUON_WHERE = ("tensor or token_head scales, a power-of-two page size, head_dim a multiple of 16 from 48 to 256")
_ATTEND_KERNEL = ("the Triton attend kernel (fp8kv.ops.attend): a tile's rows are (query, head) pairs of one KV head's "
                  "group, so each K/V tile is read once for them, and no key past a tile's last row is read")


def attend_facts(backend: str, mode: str, why: str) -> tuple[bool, str]:
    """The attend of a combination whose decode runs (``why``: how): how the multi-token query runs, or why not.
    Trusted: :func:`fp8kv.capability.check` checked ``backend`` and ``mode``."""
    if backend == "reference":
        return True, "fp32 torch oracle: each query row is the decode of the cache cut after the row's position"
    if backend == "triton":
        return True, (f"{why}; the multi-token kernel (fp8kv.ops.attend): a tile's rows are (query, head) pairs of "
                      "one KV head's group, so each K/V tile is read once for them, and no key past a tile's last "
                      "row is read; one new token per sequence runs the decode's plan, as many in every sequence "
                      "the Gluon decode kernel's rows where it runs (fp8kv.ops.decode.plan_rows)")
    if backend == "flashinfer":
        if mode == "fp8":
            return False, ("fp8kv runs FlashInfer's BatchPrefillWithPagedKVCacheWrapper with a 16-bit query (dequant "
                           "mode); its FP8-query kernels are not wired for the attend")
        return True, ("FlashInfer's BatchPrefillWithPagedKVCacheWrapper (FA2) over the same pages, causal from the "
                      "bottom right; per-head/channel scales folded into q and out as for its decode")
    return True, ("vLLM's unified_attention with cu_seqlens_q = qo_indptr and max_seqlen_q = the longest count "
                  "(its split launch only where every count is 1); returns no LSE")


def _gluon_refusal(kv_dtype: str, mode: str, arch: int | None) -> str | None:
    """Why the Gluon kernel cannot run any attend of ``kv_dtype`` in ``mode`` (None: it can, by these facts)."""
    if mode != "dequant":
        return f"mode={mode!r}: the Gluon kernel runs dequant mode"
    if not is_fp8(kv_dtype):
        return f"kv_dtype={kv_dtype}: the Gluon kernel reads FP8 pages"
    if arch is None:
        return "the Gluon kernel runs on a CUDA GPU only (not under the Triton interpreter)"
    if arch < 89:
        return f"sm{arch}: the Gluon kernel's FP8 conversions (cvt.rn.f16x2.e4m3x2 / e5m2x2) need sm89+"
    return None


def query_kernel(backend: str, kv_dtype: str, mode: str, queries: str, arch: int | None) -> tuple[str, str]:
    """``(kernel, reason)``: the kernel ``backend`` runs for an attend of ``kv_dtype`` pages in ``mode`` whose new-token
    counts are of class ``queries`` (:data:`QUERY_CLASSES`), by the module's facts, for a combination
    :func:`fp8kv.capability.check` lets run. ``arch``: the compute capability the kernels are compiled for (90), None
    where they are not (a CPU, the Triton interpreter). A Triton kernel named as "A or B" is A where its conditions
    (the reason) hold for the cache, shape and batch, else B.

    ``queries`` not one of :data:`QUERY_CLASSES` is a ValueError naming it; the rest is trusted."""
    checks.one_of(queries, "queries", QUERY_CLASSES)
    if backend == "reference":
        return "reference (fp32 torch)", "the fp32 oracle: each query row is the decode of the cache cut after its position"
    if backend == "flashinfer":
        return ("FlashInfer BatchPrefillWithPagedKVCacheWrapper (FA2)",
                "the prefill wrapper for every count, one included (its decode wrapper is fp8kv.decode's), causal from "
                "the bottom right, 16-bit query")
    if backend == "vllm":
        if queries == "1":
            return ("vLLM unified_attention (3D split or 2D)",
                    "max_seqlen_q = 1: its split (3D) launch at up to 128 // Hkv sequences (VLLM_BATCH_INVARIANT "
                    "off), else its 2D launch; returns no LSE")
        return ("vLLM unified_attention (2D)", "cu_seqlens_q = qo_indptr, max_seqlen_q = the longest count: its 2D "
                                               "launch (a count above 1 turns the split path off); returns no LSE")
    no_gluon = _gluon_refusal(kv_dtype, mode, arch)
    if queries == "1":
        plan = ("one new token per sequence is a decode: fp8kv.ops.decode.plan, fp8kv.decode's answer bit for bit; ")
        if no_gluon:
            return "decode plan: Triton decode kernel", plan + f"the Triton tensor-core decode kernel ({no_gluon})"
        return ("decode plan: Gluon or Triton decode kernel",
                plan + f"the Gluon decode kernel where it runs ({_GLUON_WHERE}) and pays (a KV head's group in one "
                       "program, splits of at least 1024 tokens, 512 above head_dim 128), else the Triton tensor-core "
                       "decode kernel")
    if queries == "ragged or long":
        return "Triton attend kernel", f"counts that differ, or more rows than two Gluon programs hold: {_ATTEND_KERNEL}"
    if no_gluon:
        return "Triton attend kernel", f"{_ATTEND_KERNEL} ({no_gluon})"
    return ("Gluon rows or Triton attend kernel",
            "fp8kv.ops.decode.plan_rows: the Gluon decode kernel, a KV head's (token, head) rows in at most two "
            f"programs that read each K/V tile once for all of them, where its conditions hold ({_GLUON_WHERE}, "
            f"splits of at least 512 tokens); else {_ATTEND_KERNEL}")
