"""The fp32 oracle: paged decode attention computed plainly from the dequantized cache, and the
tolerances every comparison with it uses.

Every backend (Triton, FlashInfer, vLLM's kernel) is checked against :func:`decode`. It favours being obviously
right over being fast: one sequence at a time, fp32 throughout.

Tolerances (kernel error: a backend against :func:`decode` on the *same dequantized* cache, not
quantization error). :func:`output_tolerance` bounds ``||out - ref|| / ||ref||``,
:func:`lse_tolerance` bounds ``max |lse - ref_lse|``. The benchmark, the backend matrix and the
tests all take them from here.
"""

from __future__ import annotations

import torch

from . import checks
from .attend_checks import attend_arguments
from .cache import PagedKVCache, check_paged_cache
from .cache.tables import PagedTables
from .capability import BACKEND_NAMES, MODES
from .formats import FORMATS, UNQUANTIZED_DTYPES
from .quant import GRANULARITIES

__all__ = ["decode", "attend", "attention", "paged_attention", "paged_attend", "UNIT_ROUNDOFF", "FP8_MODE_TOL", "REFERENCE_TOL",
           "unit_roundoff", "output_tolerance", "score_bound", "folded_query", "lse_tolerance"]

# Unit roundoff u (relative error of one round-to-nearest) of the types a backend rounds to.
UNIT_ROUNDOFF = {**{name: torch.finfo(dtype).eps / 2 for name, dtype in UNQUANTIZED_DTYPES.items()},
                 "e4m3": FORMATS["e4m3"].unit_roundoff}
_DTYPE_NAMES = {dtype: name for name, dtype in UNQUANTIZED_DTYPES.items()}  # torch dtype -> its name
# fp8 mode rounds q and p to e4m3 (u = 2^-4 each). The errors are independent across D and the
# tokens and average out: measured ~0.03 on N(0, 1) data (~u/2). 0.08 (~1.3u) leaves room for
# structured data (outlier channels, head spread); a dropped or doubled scale, or a broken P path,
# gives errors of order 1.
FP8_MODE_TOL = 0.08
REFERENCE_TOL = 1e-5  # the reference against itself: same arithmetic, fp32 summation order only


def unit_roundoff(dtype, name: str = "dtype") -> float:
    """u of ``dtype`` (the argument ``name``): ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"e4m3"`` or a torch 16/32-bit
    float dtype."""
    key = dtype if isinstance(dtype, (str, torch.dtype)) else None  # a list is unhashable: refused below
    key = _DTYPE_NAMES.get(key, key)
    if key not in UNIT_ROUNDOFF:
        checks.fail(f"{name}={checks.show_value(dtype)}; expected one of {tuple(UNIT_ROUNDOFF)} or one of {tuple(_DTYPE_NAMES)}")
    return UNIT_ROUNDOFF[key]


def output_tolerance(backend: str, mode: str, q_dtype, granularity: str = "tensor", *,
                     score_bound: float = 1.0) -> float:
    """Allowed ``||out - ref|| / ||ref||`` of ``backend`` against :func:`decode` on the same cache.

    * reference: it is the oracle (same arithmetic): :data:`REFERENCE_TOL`.
    * dequant mode: FP8 → 16-bit is exact and scores accumulate in fp32, so the error comes from
      rounding p (for the P·V dot) and the output to the query's type ``q_dtype``, each ≤ u
      relative (bf16 u = 2^-8, fp16 u = 2^-11): 2u. K scales folded into the query round q once
      more, which moves each score by up to u x ``score_bound`` (:func:`score_bound`: the largest
      ``sm_scale x sum |q_d k_d|``; 1 stands for scores of order one): (2 + max(1, score_bound))u
      (every backend folds per-channel K scales; FlashInfer also folds per-head ones).
      vLLM's kernel rounds every dequantized K and V element (stored × scale) to the query's type
      before its dots: two roundings more than p and the output, 4u (also for its 16-bit caches,
      where those two are exact: one bound per backend). Rounding K moves each score by up to
      u·|q·k|, so the bound holds for scores of order one (the synthetic caches of the matrix and
      the benchmark); on caches whose scores reach tens its error grows past 4u and its check fails:
      a vLLM row is then marked failed and is never taken as a peer, never passed.
    * fp8 mode: :data:`FP8_MODE_TOL` (q and p rounded to e4m3).

    ``backend``, ``mode`` and ``granularity`` are names of :data:`fp8kv.capability.BACKEND_NAMES`, ``MODES`` and
    :data:`fp8kv.quant.GRANULARITIES` (an unknown one got the default bound, silently); ``score_bound`` a finite
    number >= 0; ``q_dtype`` one :func:`unit_roundoff` takes.
    """
    score_bound = _tolerance_arguments(backend, mode, q_dtype, granularity, score_bound)
    if backend == "reference":
        return REFERENCE_TOL
    if mode == "fp8":
        return FP8_MODE_TOL
    if backend == "vllm":
        return 4 * unit_roundoff(q_dtype)
    if folded_query(backend, granularity):
        return (2 + max(1.0, score_bound)) * unit_roundoff(q_dtype)
    return 2 * unit_roundoff(q_dtype)


def _tolerance_arguments(backend, mode, q_dtype, granularity, score_bound) -> float:
    """The arguments :func:`output_tolerance` and :func:`lse_tolerance` share, checked by name: ``score_bound``
    as a float. Every one is checked, also where the bound at hand does not read it."""
    checks.one_of(backend, "backend", BACKEND_NAMES)
    checks.one_of(mode, "mode", MODES)
    checks.one_of(granularity, "granularity", GRANULARITIES)
    unit_roundoff(q_dtype, "q_dtype")
    return checks.real(score_bound, "score_bound", minimum=0.0)


def folded_query(backend: str, granularity: str) -> bool:
    """Whether ``backend`` folds the K scales of ``granularity`` into the query (rounding it once more)."""
    return granularity == "channel" or (backend == "flashinfer" and granularity == "head")


def score_bound(q: torch.Tensor, cache: PagedKVCache, sm_scale: float | None = None) -> float:
    """``max sm_scale x sum_d |q_d| |k_d|`` over sequences, query heads and cached keys (dequantized):
    the most a relative rounding of q's elements by u moves a score is u times it. The tolerances take
    it (``score_bound``) where a backend rounds a query with K's scales folded in. fp32 arithmetic.
    ``q``: a decode's query ``[B, Hq, D]`` for ``cache`` (a PagedKVCache or QuantizedPagedKVCache);
    ``sm_scale``: None (``1 / sqrt(D)``) or a positive number."""
    if not isinstance(cache, PagedTables):  # a PagedKVCache or a QuantizedPagedKVCache
        checks.fail(f"cache must be a paged KV cache (fp8kv.PagedKVCache), got {type(cache).__name__}", TypeError)
    cache.check_query(q)
    sm_scale = checks.softmax_scale_or_default(sm_scale, cache.head_dim)
    group = q.shape[1] // cache.num_kv_heads
    cache.validate_arrays(contents=True)  # once, not per sequence
    best = 0.0
    for i in range(q.shape[0]):
        k, _ = cache.gather(i, check_scales=False)  # [L, Hkv, D] fp32
        if k.shape[0] == 0:
            continue
        qa = q[i].float().abs().reshape(cache.num_kv_heads, group, -1)
        s = torch.einsum("hgd,lhd->hgl", qa, k.abs().to(qa.device))
        best = max(best, float(s.max()) * sm_scale)
    return best


def lse_tolerance(backend: str, mode: str, q_dtype, ref_lse: torch.Tensor, granularity: str = "tensor", *,
                  score_bound: float = 1.0) -> float:
    """Allowed ``max |lse - ref_lse|`` (natural log) against :func:`decode`'s ``ref_lse``.

    The scores inherit the relative error of the query's rounding: e4m3 in fp8 mode (2^-4; we allow
    2^-3), the query's 16-bit type in dequant mode (u; we allow 4u, which also covers per-channel K
    scales folded into the query), none for the reference (1e-5). An absolute LSE error scales with
    the scores, hence the factor ``max(1, max |ref_lse|)``; where the backend folds K's scales into the
    query (:func:`folded_query`), the scores move by up to u x ``score_bound`` (:func:`score_bound`),
    which may exceed |lse| (a soft cap or a window bounds the lse, not the scores before them).

    The names and ``score_bound`` are checked as :func:`output_tolerance` checks them; ``ref_lse`` is a float
    tensor with at least one value, all finite (an infinite one made the bound infinite: every comparison passed).
    """
    score_bound = _tolerance_arguments(backend, mode, q_dtype, granularity, score_bound)
    checks.readable_tensor(checks.tensor(ref_lse, "ref_lse", dtypes=checks.FLOAT_DTYPES), "ref_lse")
    if ref_lse.numel() == 0:
        checks.fail(f"ref_lse has shape {tuple(ref_lse.shape)}: no values; expected the reference's lse, at least one")
    checks.finite_tensor(ref_lse, "ref_lse")
    scale = max(1.0, float(ref_lse.abs().max()))
    if mode != "fp8" and folded_query(backend, granularity):
        scale = max(scale, score_bound)
    if backend == "reference":
        return REFERENCE_TOL * scale
    if mode == "fp8":
        return 2 * UNIT_ROUNDOFF["e4m3"] * scale
    return 4 * unit_roundoff(q_dtype) * scale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None, *,
              window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    """One query token against one sequence, GQA by head groups, in fp32.

    q: ``[Hq, D]``; k, v: ``[L, Hkv, D]`` with Hq a multiple of Hkv (query head h reads KV head
    ``h // (Hq // Hkv)``), float tensors on one device, finite and within fp32's range, ``L >= 1``: the
    query is the token at position ``L - 1`` (the last one cached), so an empty sequence has no output.

    ``sm_scale`` and the variants are checked as :func:`decode` checks them (see it for the conventions):
    ``sm_scale`` positive and finite (``fp8kv.checks.softmax_scale``), None for ``1 / sqrt(D)``; ``window``
    W >= 1 keeps positions ``>= L - W``; ``soft_cap`` c replaces each scaled score s by ``c * tanh(s / c)``;
    ``sinks`` ``[Hq]`` adds ``exp(sinks[h])`` to head h's softmax denominator.

    Returns out ``[Hq, D]`` and the natural-log LSE ``[Hq]`` of the softmax denominator (the sink
    term included), both fp32.
    """
    checks.tensor(q, "q", ndim=2, dtypes=checks.FLOAT_DTYPES, shape_hint="[Hq, D]")
    for name, t in (("k", k), ("v", v)):
        checks.tensor(t, name, ndim=3, dtypes=checks.FLOAT_DTYPES, device=q.device, shape_hint="[L, Hkv, D]")
    if v.shape != k.shape:
        checks.fail(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; expected equal shapes [L, Hkv, D]")
    if min(q.shape) < 1 or min(k.shape[1:]) < 1:
        checks.fail(f"q has shape {tuple(q.shape)} and k {tuple(k.shape)}; expected at least one head and channel")
    if k.shape[0] < 1:
        checks.fail(f"k and v have shape {tuple(k.shape)}: 0 tokens; expected at least one (the query is the last "
                    "cached token: a query attending nothing has no output)")
    if q.shape[1] != k.shape[2]:
        checks.fail(f"q has head_dim {q.shape[1]} but k and v have head_dim {k.shape[2]}; expected equal")
    if q.shape[0] % k.shape[1]:
        checks.fail(f"q has {q.shape[0]} heads, not a multiple of k's {k.shape[1]} KV heads")
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.fp32_range_tensor(checks.finite_tensor(t, name), name)
    window, soft_cap, sinks = checks.attention_variant(window, soft_cap, sinks, num_q_heads=q.shape[0],
                                                       device=q.device)
    if sm_scale is not None:
        sm_scale = checks.softmax_scale(sm_scale, soft_cap)
    return _attention(q, k, v, checks.resolved_softmax_scale(sm_scale, q.shape[1]), window=window,
                      soft_cap=soft_cap, sinks=sinks)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, *, window: int | None,
               soft_cap: float | None, sinks: torch.Tensor | None):
    """:func:`attention` on inputs already checked (by it, or once per call by :func:`decode` / :func:`attend`)."""
    hq, hkv = q.shape[0], k.shape[1]
    length = k.shape[0]
    group = hq // hkv
    qf = q.to(torch.float32).reshape(hkv, group, -1)  # [Hkv, G, D]
    kf = k.to(torch.float32).transpose(0, 1)  # [Hkv, L, D]
    vf = v.to(torch.float32).transpose(0, 1)
    s = torch.einsum("hgd,hld->hgl", qf, kf) * sm_scale
    if soft_cap is not None:  # in checks' [MIN_SOFT_CAP, MAX_SOFT_CAP]: 1 / cap and cap * tanh stay in fp32's range
        s = soft_cap * torch.tanh(s / soft_cap)
    if window is not None and window < length:  # W >= L is the whole sequence (and W may exceed int64)
        outside = torch.arange(length, device=s.device) < length - window
        s = s.masked_fill(outside, float("-inf"))
    if sinks is not None:  # one more logit per head, with no value: it only enlarges the denominator
        sink_col = sinks.to(device=s.device, dtype=torch.float32).reshape(hkv, group, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("hgl,hld->hgd", p, vf)
    return out.reshape(hq, -1), lse.reshape(hq)


def decode(q: torch.Tensor, cache: PagedKVCache, sm_scale: float | None = None, *, window: int | None = None,
           soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    """fp32 paged decode attention over the dequantized cache.

    Parameters
    ----------
    q : ``[B, Hq, D]`` float16 / bfloat16 / float32, one query token per sequence.
    cache : a :class:`~fp8kv.cache.PagedKVCache` with every ``seq_lens[i] >= 1``.
    sm_scale : softmax scale, a positive finite number; default ``1 / sqrt(D)``. With the soft cap
        it must pass ``fp8kv.checks.softmax_scale`` (the kernels' folded fp32 factor
        ``sm_scale x log2(e) (x 2 / cap)`` within [2^-126, 2^64]).
    window : sliding window W (int >= 1) or None. The query of sequence i is its last cached token,
        at position ``L - 1`` with ``L = seq_lens[i]``; it attends positions ``[max(0, L - W), L)``:
        W tokens, itself included. This is transformers' ``sliding_window`` (Gemma-3, Mistral: key j
        is seen by query p when ``p - W < j <= p``) and FlashInfer's ``window_left = W - 1``
        (``window_left`` counts the keys left of the query). ``W >= L`` is the whole sequence.
    soft_cap : logit soft-capping with 1e-6 <= c <= 1e30 (``fp8kv.checks.MIN_SOFT_CAP``,
        ``MAX_SOFT_CAP``) or None: each scaled score ``s = sm_scale * q·k`` becomes
        ``c * tanh(s / c)`` before the softmax (Gemma-2's ``attn_logit_softcapping``).
    sinks : fp32 ``[Hq]`` (any strides) or None: per query head a learned logit that joins the
        softmax denominator without a value (gpt-oss): ``p_j = exp(s_j) / (exp(sink_h) + Σ_k exp(s_k))``.
        It is not scaled by sm_scale and not soft-capped. Finite, ``|sink| <= 1e38``
        (``fp8kv.checks.MAX_SINK``).

    Returns
    -------
    out : ``[B, Hq, D]`` float32.
    lse : ``[B, Hq]`` float32, natural-log log-sum-exp of the softmax denominator: over the scores
        in the window (after capping), plus the sink term when there is one. So
        ``out * exp(lse) = Σ_j exp(s_j) v_j`` holds with or without sinks.
    """
    check_paged_cache(cache)
    cache.validate_arrays(contents=True)  # scales edited in place: a NaN or negative one decoded silently
    cache.check_query(q)
    checks.finite_tensor(q, "q")  # as fp8kv.decode and the attend oracle refuse it: a NaN query is no result
    window, soft_cap, sinks = checks.attention_variant(window, soft_cap, sinks, num_q_heads=q.shape[1],
                                                       device=q.device)
    if sm_scale is not None:
        sm_scale = checks.softmax_scale(sm_scale, soft_cap)
    return paged_attention(q, cache, sm_scale, window=window, soft_cap=soft_cap, sinks=sinks)


def paged_attention(q: torch.Tensor, cache: PagedKVCache, sm_scale: float | None = None, *,
                    window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    """The computation of :func:`decode` on inputs already validated (by it, or ``fp8kv.decode``).

    The cache's tables are checked here on every call (``PagedKVCache.validate_tables``), also under
    ``fp8kv.decode(..., check=False)``: the oracle refuses a corrupt table rather than answer for it.
    """
    sm_scale = checks.resolved_softmax_scale(sm_scale, q.shape[-1])
    # Always, even after fp8kv.decode(check=False): the oracle gathers through the tables on the
    # host, so a corrupt entry would index out of range or answer for pages it does not own.
    cache.validate_tables()
    lens = cache.seq_lens.tolist()
    if min(lens) < 1:
        i = lens.index(min(lens))
        raise ValueError(f"seq_lens[{i}]={lens[i]}: decode needs at least one cached token "
                         "per sequence (empty sequences have no attention output)")
    outs, lses = [], []
    for i in range(q.shape[0]):
        k, v = cache.gather(i, check_scales=False)  # the arrays: checked by the entry
        o, lse = _attention(q[i], k, v, sm_scale, window=window, soft_cap=soft_cap, sinks=sinks)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def attend(q: torch.Tensor, cache: PagedKVCache, qo_indptr: torch.Tensor, *, sm_scale: float | None = None,
           window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
           return_lse: bool = False):
    """fp32 attention of several new tokens per sequence over the dequantized cache: speculative-decode
    verification (a few draft tokens) and chunked-prefill append (a chunk of the prompt).

    Parameters
    ----------
    q : ``[total_q, Hq, D]`` float16 / bfloat16 / float32, finite: the new tokens of every sequence, back
        to back (sequence i's are rows ``qo_indptr[i] .. qo_indptr[i + 1]``).
    cache : a :class:`~fp8kv.cache.PagedKVCache` that already holds the new tokens (written before
        attention, as vLLM and FlashInfer do): they are the last ``qo_len[i]`` tokens of row i.
    qo_indptr : int32 / int64 ``[B + 1]`` on the cache's device: ``qo_indptr[0] = 0``, non-decreasing,
        ``qo_indptr[B] = total_q``, ``qo_len[i] = qo_indptr[i + 1] - qo_indptr[i] <= seq_lens[i]``
        (0: the sequence has no rows).
    sm_scale, window, soft_cap, sinks : as in :func:`decode`, per query. Query j of sequence i sits at
        position ``p = seq_lens[i] - qo_len[i] + j`` and attends keys ``0 .. p`` (causal among the new
        tokens); a window W keeps keys ``p - W < key <= p``, counted back from the query's own position.
    return_lse : also return the LSE.

    Every argument is validated at entry (``fp8kv.attend_checks.attend_arguments``), the cache's tables
    and scales included. Each query row is computed exactly as :func:`decode` computes the last token
    of a cache truncated after position p (same arithmetic, same order): with ``qo_len = 1`` the two
    agree bit for bit.

    Returns
    -------
    out : ``[total_q, Hq, D]`` float32; with ``return_lse`` also lse ``[total_q, Hq]`` float32, natural
        log, defined as :func:`decode`'s.
    """
    qo_lens, sm_scale, window, soft_cap, sinks = attend_arguments(q, cache, qo_indptr, sm_scale, window,
                                                                  soft_cap, sinks)
    checks.flag(return_lse, "return_lse")
    out, lse = paged_attend(q, cache, qo_lens, sm_scale, window=window, soft_cap=soft_cap, sinks=sinks)
    return (out, lse) if return_lse else out


def paged_attend(q: torch.Tensor, cache: PagedKVCache, qo_lens: list[int], sm_scale: float | None = None, *,
                 window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None):
    """The computation of :func:`attend` on inputs already validated (by it, or ``fp8kv.attend``), with the
    new-token counts ``qo_lens`` already read: ``(out, lse)``, both float32. The counts are checked against ``q``
    and the cache's rows here too (a count that left rows of ``q`` unread returned them unwritten)."""
    sm_scale = checks.resolved_softmax_scale(sm_scale, q.shape[-1])
    lens = cache.seq_lens.tolist()  # the oracle reads the cache on the host anyway
    qo_lens = [checks.integer(n, f"qo_lens[{i}]") for i, n in enumerate(checks.listed(qo_lens, "qo_lens", "ints"))]
    if len(qo_lens) != len(lens) or sum(qo_lens) != q.shape[0]:
        checks.fail(f"qo_lens={checks.show_value(list(qo_lens))} for q of {q.shape[0]} rows over {len(lens)} "
                    "sequences; expected one count per sequence, summing to q's rows")
    for i, (n, length) in enumerate(zip(qo_lens, lens, strict=True)):
        if not 0 <= n <= length:
            checks.fail(f"qo_lens[{i}]={n}; expected 0 to the sequence's {length} tokens (its new tokens are its last)")
    hq, d = q.shape[1:]
    out = torch.empty(q.shape[0], hq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[0], hq, dtype=torch.float32, device=q.device)
    row = 0
    for i, n in enumerate(qo_lens):
        if n == 0:
            continue
        k, v = cache.gather(i, check_scales=False)  # the arrays: checked by the entry
        first = k.shape[0] - n  # position of the sequence's first new token
        for j in range(n):
            p = first + j
            # the keys up to p are what a decode of the cache truncated after p reads
            out[row], lse[row] = _attention(q[row], k[:p + 1], v[:p + 1], sm_scale, window=window,
                                            soft_cap=soft_cap, sinks=sinks)
            row += 1
    return out, lse
