"""Does an FP8 KV cache stay accurate at long context? Error and needle retrieval from 4k to 128k tokens.

For each context ``L`` one sequence (batch 1) of synthetic K/V (:func:`fp8kv.synthetic.kv_like_llm`:
outlier key channels, per-head and per-token spread, heavy-tailed V, RoPE) is written into an FP8 paged
cache, and its last ``q_len`` tokens' queries (:func:`fp8kv.synthetic.queries_like_llm`, RoPE'd at their
positions) attend it through fp8kv's kernels, in both modes (``"dequant"``, ``"fp8"``) and through both
entries: :func:`fp8kv.decode` (the last query alone, ``q_len = 1``) and :func:`fp8kv.attend` (all
``q_len`` queries, causal among them). Three errors are measured per query head, so a reader sees each
source apart:

* ``"kernel"``: the kernel against the fp32 oracle (:func:`fp8kv.reference.paged_attention` /
  :func:`~fp8kv.reference.paged_attend`) on the *same* FP8 cache: the kernel's own arithmetic (the 16-bit
  or e4m3 rounding of q and p, fp32 accumulation over the splits). This is what may grow with the context
  if a kernel accumulates badly.
* ``"quantization"``: the oracle on the FP8 cache against exact attention (fp32 arithmetic on the
  unquantized fp32 K/V, same queries): what FP8 storage costs, whatever reads it. The oracle sees no
  mode, so these rows carry the same numbers in both modes (repeated so each mode's rows stand alone).
* ``"total"``: the kernel against exact attention: what a user gets.

Each is the relative error ``||out_h - ref_h|| / ||ref_h||`` of a query head (pooled over the queries of
an attend), summarised over heads by its median and maximum.

**The needle.** At a random depth of each context (uniform over the positions every query sees) one key per
KV head is replaced by a *needle*: a key along a random unit direction ``u``, its length chosen so that in
exact attention the needle's score ``sm_scale q·k`` beats every other position's by at least ``margin``
(logits, natural units) for every query head and query of the *needle queries*: the same queries drawn
towards ``u`` (``q += 2 |q| u``). Its value is a random direction orthogonal to the mean of the head's other
values (as long as their median), so what an output holds along it is the needle's weight. The errors above
are measured with the plain queries, for which the needle is one short key among many (its length is reported
over the median key's). Two tests, per entry and mode, on the needle queries as that mode's kernel reads them
(rounded to e4m3 per query row and head in fp8 mode, as fp8kv's kernels round them):

* ``needle_top1``: the needle is the argmax of the fp32 scores ``sm_scale q·k̂`` on the *dequantized* cache
  (what the kernel reads); ``margin_fp8``, the smallest margin over the runner-up, says how close a flip came.
* ``needle_weight_ok``: the weight the *kernel's output* gives the needle (``needle_weight_kernel``: the
  oracle's weight plus the kernel's output minus the oracle's along the needle's value, over its length²)
  is the oracle's: that difference, over the output's norm (``needle_weight_err``, pooled over queries, the
  worst head), within :func:`fp8kv.reference.output_tolerance` of the backend and mode
  (``needle_weight_tol``). A kernel that drops or scales the needle fails it where the fp32 top-1 holds.

:func:`long_context_verdict`: per entry x mode x error, *flat* when the error (median over heads) at the
longest context is within ``max_growth`` (1.5) times its value at ``reference_context`` (4096), and both
needle tests at every context; :func:`long_context_text` says it in sentences.

Memory: the fp32 K/V of the longest context (``2 x L x Hkv x D x 4`` bytes: 256 MiB at 128k with the
default 2 KV heads of 128) plus its FP8 cache; the scores are ``Hq x L`` per query. On a CPU (Triton's
interpreter, ``TRITON_INTERPRET=1``) keep contexts to about 2k.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import checks
from ..formats import kv_dtype_info

__all__ = ["LONG_CONTEXTS", "SMOKE_CONTEXTS", "LONG_CONTEXT_MODES", "ENTRIES", "ERRORS", "DEFAULT_MARGIN",
           "MAX_GROWTH", "long_context_error", "long_context_verdict", "long_context_text"]

LONG_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)  # a GPU's run: 4k to 128k, doubling
SMOKE_CONTEXTS = (128, 256, 512)  # what Triton's interpreter does in seconds (a smoke run, not a result)
LONG_CONTEXT_MODES = ("dequant", "fp8")
ENTRIES = ("decode", "attend")
ERRORS = ("kernel", "quantization", "total")
BACKENDS = ("triton", "flashinfer", "reference")  # those that return an LSE (the needle's kernel weight needs it)
# The needle's score margin over the runner-up, in logits: e^1 = 2.7x the runner-up's weight, a clear retrieval.
# FP8 moves the needle queries' scores (of order ten to twenty) by up to about a logit: over 48 draws (8/2 heads of
# 128, 128-512 tokens) the smallest margin left was 0.21 in dequant mode and 0.02 in fp8 mode (its query in e4m3
# too), no flip; at 64-dim heads an fp8-mode flip happens. A flip is possible, not expected.
DEFAULT_MARGIN = 1.0
# Past ~30 logits the needle holds all the weight (e^-30 = 1e-13 for the rest) and its key grows to several times the
# longest: the planted key, not the cache, sets the scales (a margin of 1e30 gave a quantization error of 0.96)
MAX_MARGIN = 30.0
MAX_GROWTH = 1.5  # "flat": the longest context's error within 1.5x the reference context's
MAX_CONTEXT = 1 << 20
_NEEDLE_PULL = 2.0  # q += 2|q|u: q·u >= |q| > 0 whatever q was, so a longer needle always scores higher


# ------------------------------------------------------------------------------------ input
def _contexts(contexts, q_len: int) -> list[int]:
    if isinstance(contexts, (str, bytes)) or not hasattr(contexts, "__iter__"):
        checks.fail(f"contexts={checks.show_value(contexts)} ({type(contexts).__name__}); expected a non-empty "
                    "list of ints (tokens per sequence)", TypeError)
    values = list(contexts)
    if not values:
        checks.fail("contexts is empty; expected at least one context (tokens per sequence)")
    out = [checks.integer(c, f"contexts[{i}]", minimum=q_len + 1, maximum=MAX_CONTEXT) for i, c in enumerate(values)]
    if len(set(out)) != len(out):
        checks.fail(f"contexts={out} names a context twice; expected distinct contexts")
    return sorted(out)


def _q_dtype(q_dtype, device: torch.device) -> torch.dtype:
    named = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if q_dtype is None:  # Triton's interpreter computes bf16 wrongly: fp16 queries on a CPU
        return torch.bfloat16 if device.type == "cuda" else torch.float16
    if isinstance(q_dtype, str) and q_dtype in named:
        return named[q_dtype]
    if isinstance(q_dtype, torch.dtype) and q_dtype in named.values():
        return q_dtype
    checks.fail(f"q_dtype={checks.show_value(q_dtype)}; expected None (bf16 on a GPU, fp16 on a CPU), 'bf16', "
                "'fp16', torch.bfloat16 or torch.float16", TypeError if not isinstance(q_dtype, str) else ValueError)


def _check_runnable(backend: str, kv_dtype: str, modes, entries, head_dim: int) -> None:
    """Every (mode, entry) runs here, or an UnsupportedError with the capability table's reason, before any work."""
    from ..capability import UnsupportedError, check

    for entry in entries:
        for mode in modes:
            ok, why = check(backend, kv_dtype, mode, head_dim=head_dim, op=entry)
            if not ok:
                raise UnsupportedError(f"long_context_error: backend={backend}, mode={mode}, entry={entry} "
                                       f"(fp8kv.{entry}), kv_dtype={kv_dtype}, head_dim={head_dim}: {why}")


# ------------------------------------------------------------------------------------ one context
def _plant_needle(k, v, q, position: int, margin: float, sm_scale: float, rng: np.random.Generator, q_dtype):
    """Put a needle key at ``position`` of every KV head of ``k`` ``[L, Hkv, D]`` and its value in ``v`` (fp32, in
    place; module docstring), and pull the queries ``q`` ``[n, Hq, D]`` (fp32, causal: query j sits at position
    ``L - n + j``) towards it. The value's elements are of a typical value's size: V's scale hardly moves.

    Returns the pulled queries in ``q_dtype`` (the needle's length is set for them as rounded) and the needle
    keys' lengths over the KV head's median key length."""
    length, hkv, d = k.shape
    n, hq, _ = q.shape
    group = hq // hkv
    u = torch.from_numpy(rng.standard_normal((hkv, d))).to(k)
    u = u / u.norm(dim=-1, keepdim=True)
    u_q = u.repeat_interleave(group, dim=0)  # [Hq, D]: query head h reads KV head h // group
    rounded = (q + _NEEDLE_PULL * q.norm(dim=-1, keepdim=True) * u_q).to(q_dtype)
    q = rounded.float()
    others = torch.ones(length, dtype=torch.bool, device=k.device)
    others[position] = False
    w = torch.from_numpy(rng.standard_normal((hkv, d))).to(v)
    lengths = []
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        qh = q[:, heads]  # [n, G, D]
        s = torch.einsum("ngd,ld->ngl", qh, k[:, h]) * sm_scale
        visible = torch.arange(length, device=k.device)[None, :] <= (length - n + torch.arange(n, device=k.device))[:, None]
        s = s.masked_fill(~(visible & others)[:, None, :], float("-inf"))
        best = s.amax(dim=-1)  # [n, G]: the runner-up's score of every query head
        per_length = torch.einsum("ngd,d->ng", qh, u[h]) * sm_scale  # score per unit of needle length, > 0
        length_needed = float(((best + margin) / per_length).amax())
        k[position, h] = length_needed * u[h]
        lengths.append(length_needed / float(k[:, h].norm(dim=-1).median()))
        mean = v[others, h].mean(dim=0)
        if float(mean.norm()) > 0:
            w[h] -= (w[h] @ mean) / (mean @ mean) * mean
        v[position, h] = w[h] / w[h].norm() * v[others, h].norm(dim=-1).median()
    return rounded, lengths


def _exact(q, k, v, sm_scale: float):
    """Exact attention (fp32 on the unquantized K/V) of queries ``q`` ``[n, Hq, D]`` at the last ``n`` positions."""
    from ..reference import attention

    n, length = q.shape[0], k.shape[0]
    outs, lses = [], []
    for j in range(n):
        p = length - n + j
        o, lse = attention(q[j], k[:p + 1], v[:p + 1], sm_scale)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _scores(q, k, sm_scale: float):
    """fp32 scores ``[n, Hq, L]`` of queries at the last ``n`` positions (causal: unseen keys -inf)."""
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    # query head h reads KV head h // group: group the query heads rather than copy K per query head
    s = torch.einsum("nhgd,lhd->nhgl", q.float().reshape(n, hkv, hq // hkv, d), k.float()).reshape(n, hq, length)
    s = s * sm_scale
    visible = torch.arange(length, device=k.device)[None, :] <= (length - n + torch.arange(n, device=k.device))[:, None]
    return s.masked_fill(~visible[:, None, :], float("-inf"))


def _per_head(out, ref) -> np.ndarray:
    """Relative error per query head, pooled over the queries: ``[Hq]`` float64."""
    o, r = out.double(), ref.double()
    return (((o - r) ** 2).sum(dim=(0, 2)) / (r ** 2).sum(dim=(0, 2))).sqrt().cpu().numpy()


def _mode_query(q, mode: str, backend: str):
    """The queries ``q`` ``[n, Hq, D]`` (16-bit) as the kernel's scores read them, fp32: as they are in dequant
    mode; in fp8 mode rounded to e4m3 with one amax scale per query row and head, as fp8kv's kernels quantize them
    (FlashInfer's FP8 query: one scale for the whole query tensor)."""
    from ..quant import quantize

    if mode != "fp8":
        return q.float()
    return quantize(q.float(), "e4m3", "tensor" if backend == "flashinfer" else "token_head").dequantize()


def _needle_weight(out, oracle_out, weight_oracle, w_hat) -> tuple[torch.Tensor, np.ndarray]:
    """The needle's weight read from a kernel's output ``out`` ``[n, Hq, D]``, and its error per query head.

    ``w_hat`` ``[Hq, D]``: the needle's dequantized value as each query head reads it. The weight: the oracle's
    (``weight_oracle`` ``[n, Hq]``) plus ``(out - oracle_out) . w / |w|^2`` (the value is orthogonal to the
    others' mean: a kernel that drops or scales the needle moves it). The error: ``|(out - oracle_out) . w| /
    |w|`` over the output's norm, pooled over the queries: a part of what ``output_tolerance`` bounds."""
    diff = torch.einsum("nhd,hd->nh", (out - oracle_out).double(), w_hat.double())
    norm_sq = (w_hat.double() ** 2).sum(dim=-1)
    weight = weight_oracle.double() + diff / norm_sq
    err = ((diff ** 2 / norm_sq).sum(dim=0) / (oracle_out.double() ** 2).sum(dim=(0, 2))).sqrt()
    return weight, err.cpu().numpy()


def _needle(scores_exact, scores_mode, position: int, lse_exact, lse_oracle) -> dict:
    """The needle's rank and weights; scores ``[n, Hq, L]``, LSEs ``[n, Hq]``."""

    def margin(s):
        others = torch.cat([s[..., :position], s[..., position + 1:]], dim=-1)
        return s[..., position] - others.amax(dim=-1)

    top = scores_mode.argmax(dim=-1) == position
    row = dict(needle_top1_exact=bool((scores_exact.argmax(dim=-1) == position).all()),
               needle_top1=bool(top.all()), needle_top1_frac=float(top.float().mean()),
               margin_exact=float(margin(scores_exact).min()), margin_fp8=float(margin(scores_mode).min()))
    row["needle_weight_exact"] = float(torch.exp(scores_exact[..., position] - lse_exact).median())
    row["needle_weight_oracle"] = float(torch.exp(scores_mode[..., position] - lse_oracle).median())
    return row


def _kernel(entry: str, q, cache, *, backend: str, mode: str, sm_scale: float):
    """``(out fp32, lse)`` of ``q`` through ``fp8kv.decode`` (one query) or ``fp8kv.attend`` (all of them)."""
    from ..backends import attend, decode

    if entry == "decode":
        out, lse = decode(q, cache, backend=backend, mode=mode, sm_scale=sm_scale)
    else:
        indptr = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        out, lse = attend(q, cache, indptr, backend=backend, mode=mode, sm_scale=sm_scale)
    return out.float(), lse


def _oracle(entry: str, q, cache, sm_scale: float):
    from ..reference import paged_attend, paged_attention

    return paged_attention(q, cache, sm_scale) if entry == "decode" else paged_attend(q, cache, [q.shape[0]], sm_scale)


def _one_context(k_all, v_all, length, *, q_len, num_q_heads, modes, entries, kv_dtype, backend, q_dtype,
                 block_size, margin, seed, device):
    from ..cache import PagedKVCache
    from ..reference import output_tolerance
    from ..synthetic import queries_like_llm

    rng = np.random.default_rng([seed, length])  # the needle's depth and direction: per context, reproducible
    d = k_all.shape[-1]
    sm_scale = checks.resolved_softmax_scale(None, d)
    k, v = k_all[:length].clone(), v_all[:length].clone()
    q = queries_like_llm(q_len, num_q_heads, d, seed=seed + 1, position=list(range(length - q_len, length)),
                         device=device)
    position = int(rng.integers(0, length - q_len))  # every query sees it
    # The queries every path reads, rounded once: their rounding is input, not error. The error is measured
    # with the plain queries (attention spread over the context, the needle one small key among many); the
    # needle test with the queries drawn towards it.
    q_needle, lengths = _plant_needle(k, v, q, position, margin, sm_scale, rng, q_dtype)
    q = q.to(q_dtype)
    cache = PagedKVCache.from_dense([k], [v], [length], block_size=block_size, kv_dtype=kv_dtype)
    k_hat, v_hat = (x.to(k.device) for x in cache.gather(0))
    w_hat = v_hat[position].repeat_interleave(num_q_heads // k.shape[1], dim=0)  # [Hq, D]
    exact_out, _ = _exact(q.float(), k, v, sm_scale)
    _, needle_exact_lse = _exact(q_needle.float(), k, v, sm_scale)
    s_exact = _scores(q_needle, k, sm_scale)
    base = dict(context=length, needle_position=position, needle_depth=position / length,
                needle_length_ratio=float(np.median(lengths)))
    errors, needles = [], []
    for entry in entries:
        rows = slice(None) if entry == "attend" else slice(q_len - 1, q_len)  # decode: the last query alone
        qe, qn = q[rows].contiguous(), q_needle[rows].contiguous()
        oracle_out, _ = _oracle(entry, qe, cache, sm_scale)
        quant = _per_head(oracle_out, exact_out[rows])
        for mode in modes:
            out, _ = _kernel(entry, qe, cache, backend=backend, mode=mode, sm_scale=sm_scale)
            head = dict(base, entry=entry, q_len=qe.shape[0], mode=mode)
            for error, per_head in (("kernel", _per_head(out, oracle_out)), ("quantization", quant),
                                    ("total", _per_head(out, exact_out[rows]))):
                errors.append(dict(head, error=error, rel_err_median=float(np.median(per_head)),
                                   rel_err_max=float(per_head.max()), n_heads=len(per_head)))
            # The needle as this mode's kernel reads it: its queries rounded as the kernel rounds them
            qm = _mode_query(qn, mode, backend)
            needle_oracle_out, needle_oracle_lse = _oracle(entry, qm, cache, sm_scale)
            s_mode = _scores(qm, k_hat, sm_scale)
            row = dict(head, **_needle(s_exact[rows], s_mode, position, needle_exact_lse[rows], needle_oracle_lse))
            needle_out, _ = _kernel(entry, qn, cache, backend=backend, mode=mode, sm_scale=sm_scale)
            weight_oracle = torch.exp(s_mode[..., position] - needle_oracle_lse)
            weight, err = _needle_weight(needle_out, needle_oracle_out, weight_oracle, w_hat)
            tol = output_tolerance(backend, mode, q_dtype)
            row.update(needle_weight_kernel=float(weight.median()), needle_weight_err=float(err.max()),
                       needle_weight_tol=tol, needle_weight_ok=bool(err.max() <= tol))
            needles.append(row)
    return errors, needles


# ------------------------------------------------------------------------------------ the sweep
def long_context_error(contexts=LONG_CONTEXTS, *, modes=LONG_CONTEXT_MODES, entries=ENTRIES, num_q_heads: int = 8,
                       num_kv_heads: int = 2, head_dim: int = 128, q_len: int = 4, kv_dtype: str = "fp8_e4m3",
                       backend: str = "triton", q_dtype=None, block_size: int = 16, margin: float = DEFAULT_MARGIN,
                       seed: int = 0, device=None):
    """Error against context and the needle test, for fp8kv's kernels (module docstring).

    Parameters
    ----------
    contexts : distinct ints in ``[q_len + 1, 2**20]``, tokens in the cache (the queries' tokens included);
        measured in increasing order, each a prefix of one generated sequence (so contexts share their early
        tokens) with its own needle.
    modes : among ``("dequant", "fp8")``. entries : among ``("decode", "attend")``.
    num_q_heads, num_kv_heads, head_dim : the head layout (Hq a multiple of Hkv; head_dim even, for RoPE).
    q_len : queries of an attend (>= 2); a decode reads the last of them.
    kv_dtype : ``"fp8_e4m3"`` or ``"fp8_e5m2"``, one per-tensor amax scale per K and per V.
    backend : ``"triton"`` (fp8kv's kernels), ``"flashinfer"`` or ``"reference"`` (a check of the
        method: its kernel error is 0; dequant mode only); every (mode, entry) must run here, else
        :class:`~fp8kv.capability.UnsupportedError` before anything runs.
    q_dtype : the queries' type: None (bf16 on a GPU, fp16 on a CPU, where Triton's interpreter gets bf16
        wrong), ``"bf16"``, ``"fp16"`` or the torch dtype. Every path reads the same rounded queries.
    block_size : the cache's page size. margin : the needle's exact score margin, logits (> 0).
    seed : an int >= 0; K/V, queries and each context's needle follow from it.
    device : None / ``"auto"`` (a GPU where there is one), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.

    Returns
    -------
    (errors, needles) : two DataFrames. ``errors``: one row per context x entry x mode x error (:data:`ERRORS`)
        with ``context``, ``entry``, ``q_len``, ``mode``, ``error``, ``rel_err_median``, ``rel_err_max``
        (over query heads), ``n_heads``, and the needle's ``needle_position``, ``needle_depth`` (position /
        context) and ``needle_length_ratio`` (its length over the median key's). ``needles``: one row per
        context x entry x mode with those keys and ``needle_top1`` (every query head's top-scored position on
        the dequantized cache, the mode's query rounding applied, is the needle), ``needle_top1_frac``,
        ``needle_top1_exact`` (on exact scores: True by construction), ``margin_exact`` / ``margin_fp8`` (the
        smallest score margin over the runner-up, logits), ``needle_weight_exact`` / ``_oracle`` / ``_kernel``
        (median over heads and queries; the kernel's read from its output), ``needle_weight_err``,
        ``needle_weight_tol`` and ``needle_weight_ok`` (module docstring).
    """
    import pandas as pd

    from ..device import resolve_device
    from ..synthetic import kv_like_llm

    modes = list(dict.fromkeys(checks.many_of(modes, "modes", LONG_CONTEXT_MODES)))
    entries = list(dict.fromkeys(checks.many_of(entries, "entries", ENTRIES)))
    hq = checks.positive_int(num_q_heads, "num_q_heads")
    hkv = checks.positive_int(num_kv_heads, "num_kv_heads")
    if hq % hkv:
        checks.fail(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}; expected whole GQA groups")
    d = checks.positive_int(head_dim, "head_dim")
    if d % 2:
        checks.fail(f"head_dim={d}; expected an even number (RoPE rotates channel pairs)")
    q_len = checks.integer(q_len, "q_len", minimum=2, maximum=4096)
    contexts = _contexts(contexts, q_len)
    kv_dtype = checks.one_of(kv_dtype, "kv_dtype", ("fp8_e4m3", "fp8_e5m2"))
    kv_dtype_info(kv_dtype)
    backend = checks.one_of(backend, "backend", BACKENDS)
    block_size = checks.positive_int(block_size, "block_size")
    margin = checks.real(margin, "margin", minimum=0.0, maximum=MAX_MARGIN)
    if margin == 0:
        checks.fail("margin=0.0; expected a margin in (0, MAX_MARGIN]: a needle tied with the runner-up is no needle")
    seed = checks.nonnegative_int(seed, "seed")
    device = resolve_device(device)
    q_dtype = _q_dtype(q_dtype, device)
    _check_runnable(backend, kv_dtype, modes, entries, d)

    k_all, v_all = kv_like_llm(contexts[-1], hkv, d, seed=seed, device=device)
    errors, needles = [], []
    for length in contexts:
        e, n = _one_context(k_all, v_all, length, q_len=q_len, num_q_heads=hq, modes=modes, entries=entries,
                            kv_dtype=kv_dtype, backend=backend, q_dtype=q_dtype, block_size=block_size,
                            margin=margin, seed=seed, device=device)
        errors += e
        needles += n
    meta = dict(backend=backend, kv_dtype=kv_dtype, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                q_dtype=str(q_dtype).replace("torch.", ""), margin=margin)
    return pd.DataFrame(errors).assign(**meta), pd.DataFrame(needles).assign(**meta)


# ------------------------------------------------------------------------------------ the verdict
_ERROR_COLUMNS = ("context", "entry", "mode", "error", "rel_err_median")
_NEEDLE_COLUMNS = ("context", "entry", "mode", "needle_top1", "needle_weight_ok")


def _table(df, name: str, columns) -> None:
    from ..results import check_rows

    expected = f"long_context_error()'s {name} table"
    checks.dataframe(df, name, columns, expected=expected)
    if df.empty:
        checks.fail(f"{name} has no rows; expected {expected}")
    check_rows(df, "long_context_verdict", (), whole=("context",), expected=expected)


def long_context_verdict(errors, needles, *, reference_context: int = 4096, max_growth: float = MAX_GROWTH,
                         statistic: str = "rel_err_median"):
    """Flat and needle verdicts per entry x mode x error.

    ``errors`` / ``needles``: :func:`long_context_error`'s tables. For each entry, mode and error, the
    ``statistic`` (``"rel_err_median"`` or ``"rel_err_max"``) at the longest context over its value at
    ``reference_context`` (which the tables must hold, and which must be shorter than the longest) is the
    ``growth``; ``flat`` when ``growth <= max_growth`` (> 1), or when both errors are exactly 0 (the
    reference against itself). ``needle_top1_ok``: the needle was the top-scored position at every context of that
    entry and mode; ``needle_weight_ok``: the kernel's output gave it the oracle's weight, within the mode's
    tolerance, at every context; ``needle_ok``: both (``needle_contexts_failed`` lists the contexts where either
    failed). ``passed``: flat and needle_ok.

    Returns one row per entry x mode x error: ``entry``, ``mode``, ``error``, ``reference_context``,
    ``longest_context``, ``err_reference``, ``err_longest``, ``growth``, ``flat``, ``needle_top1_ok``,
    ``needle_weight_ok``, ``needle_ok``, ``needle_contexts_failed``, ``passed``.
    """
    import pandas as pd

    _table(errors, "errors", _ERROR_COLUMNS + (checks.one_of(statistic, "statistic",
                                                              ("rel_err_median", "rel_err_max")),))
    _table(needles, "needles", _NEEDLE_COLUMNS)
    for column in ("needle_top1", "needle_weight_ok"):
        not_bool = ~needles[column].map(lambda v: isinstance(v, (bool, np.bool_)))
        if not_bool.any():  # NaN or the string "False" would read as True: a needle never shown top-1 would pass
            i = int(np.flatnonzero(not_bool.to_numpy())[0])
            seen = needles[column].iloc[i]
            seen = seen.item() if isinstance(seen, np.generic) else seen
            checks.fail(f"needles[{column!r}] row {needles.index[i]} is {checks.show_value(seen)}; expected True or "
                        "False (long_context_error's needles table)")
    reference_context = checks.integer(reference_context, "reference_context", minimum=1)
    max_growth = checks.real(max_growth, "max_growth", minimum=1.0, inclusive=False)
    contexts = sorted(int(c) for c in errors["context"].unique())
    if reference_context not in contexts:
        checks.fail(f"reference_context={reference_context} is not among the measured contexts {contexts}")
    longest = contexts[-1]
    if longest <= reference_context:
        checks.fail(f"reference_context={reference_context} is the longest measured context; flatness needs a "
                    f"longer one (contexts {contexts})")
    values = pd.to_numeric(errors[statistic], errors="coerce")
    if not (np.isfinite(values) & (values >= 0)).all():
        i = int(np.flatnonzero(~(np.isfinite(values) & (values >= 0)))[0])
        seen = errors[statistic].iloc[i]
        seen = seen.item() if isinstance(seen, np.generic) else seen  # nan, not np.float64(nan)
        checks.fail(f"errors[{statistic!r}] row {errors.index[i]} is {checks.show_value(seen)}; expected finite "
                    "errors >= 0")
    out = []
    for (entry, mode, error), g in errors.groupby(["entry", "mode", "error"], sort=False):
        counts = g["context"].astype(int).value_counts()
        if (counts > 1).any():
            checks.fail(f"errors has {int(counts.max())} rows for {entry} {mode} {error} at context "
                        f"{int(counts.idxmax())}; expected one per context, entry, mode and error (one run)")
        at = dict(zip(g["context"].astype(int), values[g.index], strict=True))
        if reference_context not in at or longest not in at:
            checks.fail(f"errors has no {entry} {mode} {error} row at context "
                        f"{reference_context if reference_context not in at else longest}; expected every "
                        "context for every entry, mode and error")
        ref, last = float(at[reference_context]), float(at[longest])
        growth = last / ref if ref > 0 else (1.0 if last == 0 else math.inf)
        nd = needles[(needles["entry"] == entry) & (needles["mode"] == mode)]
        if nd.empty:
            checks.fail(f"needles has no row for entry {entry!r}, mode {mode!r}; expected the needles table of "
                        "the same run as errors")
        top1, weight = nd["needle_top1"].astype(bool), nd["needle_weight_ok"].astype(bool)
        failed = sorted(int(c) for c in nd.loc[~(top1 & weight), "context"])
        flat = bool(growth <= max_growth)
        out.append(dict(entry=entry, mode=mode, error=error, reference_context=reference_context,
                        longest_context=longest, err_reference=ref, err_longest=last, growth=growth, flat=flat,
                        needle_top1_ok=bool(top1.all()), needle_weight_ok=bool(weight.all()), needle_ok=not failed,
                        needle_contexts_failed=failed, passed=flat and not failed))
    return pd.DataFrame(out)


def long_context_text(verdict, error: str = "total") -> list[str]:
    """One sentence per entry x mode of :func:`long_context_verdict`'s table, for ``error`` (one of :data:`ERRORS`)."""
    import pandas as pd

    checks.one_of(error, "error", ERRORS)
    need = {"entry", "mode", "error", "flat", "growth", "needle_ok", "needle_contexts_failed", "err_reference",
            "err_longest", "reference_context", "longest_context"}
    if not isinstance(verdict, pd.DataFrame) or need - set(verdict.columns):
        checks.fail("verdict must be long_context_verdict()'s table", TypeError)
    rows = verdict[verdict["error"] == error]
    if rows.empty:
        checks.fail(f"verdict has no {error!r} rows; it holds {sorted(set(verdict['error']))}")
    lines = []
    for r in rows.itertuples(index=False):
        flat = "flat" if r.flat else "NOT flat"
        at = ", ".join(f"{c:,}" for c in r.needle_contexts_failed)
        top1, weight = getattr(r, "needle_top1_ok", r.needle_ok), getattr(r, "needle_weight_ok", r.needle_ok)
        if r.needle_ok:
            needle = "the needle stays top-1 and the kernel gives it the oracle's weight at every context"
        elif not top1 and weight:
            needle = f"the needle is NOT top-1 at {at} tokens"
        elif top1:
            needle = f"the kernel does NOT give the needle the oracle's weight at {at} tokens"
        else:
            needle = f"the needle is NOT top-1, or the kernel does NOT give it the oracle's weight, at {at} tokens"
        lines.append(f"fp8kv.{r.entry}, {r.mode} mode: {error} error {flat} ({r.err_reference:.3%} at "
                     f"{r.reference_context:,} tokens, {r.err_longest:.3%} at {r.longest_context:,}: "
                     f"x{r.growth:.2f}); {needle}")
    return lines
