"""Speculative decoding's step: the target model verifies k draft tokens and the one after them in one forward
(``q_len = k + 1`` rows per sequence through every layer, :class:`~fp8kv.step.DecodeStep`), and the tokens per
second it accepts, BF16 against FP8 KV, from batch 1 to each KV dtype's ceiling.

The acceptance model (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"):
each draft token is accepted independently with probability ``a`` (the per-token acceptance rate), and the
verification yields the accepted prefix plus one token of the target's own (the correction, or the bonus token
after k accepted drafts). The tokens a step yields per sequence are then, in expectation,

    E(a, k) = 1 + a + a² + … + a^k = (1 − a^(k+1)) / (1 − a),   E(1, k) = k + 1,   E(a, 0) = 1

(:func:`expected_accepted`). Real drafts are not i.i.d. (acceptance falls along the draft and varies by text):
``a`` is a parameter to set from measured acceptance, not something this module measures.

The draft's cost per step is ``draft_us``, a parameter: 0 by default, the cost of drafts that come nearly free
beside the target's step (multi-token-prediction heads, n-gram / prompt-lookup drafts). A separate draft model
costs k decode steps of its own: pass it as ``draft_model`` and :func:`verify_sweep` times one of its decode
steps at each batch (:class:`~fp8kv.step.DecodeStep` on its shapes, KV in the same dtype as the target's) and
counts k of them as ``draft_us``; its weights and its KV per sequence come off the memory the ceiling is
planned in (:func:`~fp8kv.step.step_ceiling`). :func:`draft_cost_us` is that timing alone.

Accepted tokens per second = ``B × E / (t_verify + t_draft)``. ``draft_len = 0`` is the plain decode step
(``q_len = 1``, :func:`fp8kv.decode`), the baseline the other draft lengths are read against.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from ..checks import fail as _fail
from ..checks import flag, integer, positive_int, real, rep_ms
from ..results import utc_stamp
from ..sweeps import interruptible, machine_fields, release_memory, run_metadata
from .layers import step_shape
from .measure import (
    check_run_options,
    check_weights,
    load_weights,
    pool_blocks,
    run_pools,
    time_step,
    why_failed,
)
from .model import KVPool
from .plan import int_list, kv_dtype_names, plan_sweep, run_dtype
from .quantized import check_one_token

VERIFY_COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton", "fp8kv_source",
    "model", "weights", "kv_dtype", "backend", "mode", "batch", "context", "ceiling",
    "draft_model", "draft_len", "q_len", "acceptance", "accepted_per_step", "verify_us", "draft_us", "step_us",
    "accepted_tokens_per_s", "attention_us", "attention_share",
    "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "gpu_memory_gib", "utilization",
    "activation_bytes", "timing", "logits_finite", "status", "reason",
]


def expected_accepted(acceptance: float, draft_len: int) -> float:
    """Tokens a verification step yields per sequence in expectation, ``(1 − a^(k+1)) / (1 − a)`` (``k + 1`` at
    ``a = 1``): i.i.d. acceptance of each draft token with probability ``acceptance`` (a number in [0, 1]), the
    accepted prefix of the ``draft_len`` (an int >= 0) drafts plus the target's own token."""
    a = acceptance_arg(acceptance, "acceptance")
    k = draft_len_arg(draft_len, "draft_len")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_arg(value, name: str = "acceptance") -> float:
    """A per-token acceptance rate: a finite number in [0, 1]."""
    return real(value, name, minimum=0.0, maximum=1.0)


MAX_DRAFT_LEN = 1 << 20  # far past any draft a verification reads; its powers and counts stay finite floats


def draft_len_arg(value, name: str = "draft_len") -> int:
    """A draft length: an int in [0, MAX_DRAFT_LEN] (0: the plain decode step)."""
    return integer(value, name, minimum=0, maximum=MAX_DRAFT_LEN)


def check_drafts_fit(drafts, contexts, name: str = "contexts") -> None:
    """Refuse a draft length whose ``k + 1`` new tokens (k drafts and the bonus token) do not fit the shortest of
    ``contexts`` (they are the last tokens of each sequence's context). ``drafts``: ``(given, k)`` pairs, ``given``
    the draft length as the caller's user gave it (``"draft_lens[1]=8"``, ``"--draft-lens=8"``); ``name``: what
    the user calls ``contexts``. No contexts: nothing to refuse here (the planner names them)."""
    shortest = min(contexts, default=None)
    for given, k in drafts:
        if shortest is not None and k + 1 > shortest:
            _fail(f"{given}: its {k + 1} new tokens (k drafts and the bonus token) are the last of a sequence's "
                  f"context, and {name} holds one of {shortest} tokens")


def many_values(values, name: str, check) -> list:
    """A non-empty list (or one value) of ``check``-ed values, duplicates dropped in order."""
    if isinstance(values, (numbers.Number, torch.Tensor)) and not isinstance(values, bool) or values is None:
        values = [values]
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        _fail(f"{name}={values!r}; expected a list of values", TypeError)
    if not values:
        _fail(f"{name} is empty; give at least one value")
    return list(dict.fromkeys(check(v, name) for v in values))


def draft_us_arg(value, name: str = "draft_us") -> float:
    """A draft cost per step: finite microseconds >= 0."""
    return real(value, name, minimum=0.0)


# ------------------------------------------------------------------------------------------------ sweep
def verify_sweep(models, contexts, draft_lens=(0, 2, 4, 8), acceptance=0.7, kv_dtypes=("bf16", "fp8_e4m3"), *,
                 batches=None, draft_us: float | None = None, draft_model=None, backend: str = "auto", mode: str = "auto",
                 gpu_memory_gib=None, utilization: float = 0.9, block_size: int = 16, weights: str = "auto",
                 device=None, dtype=None, rep: int = 50, progress: bool = True, seed: int = 0, cpu_reps: int = 3,
                 keep_partial: bool = False):
    """Time the verification step of each draft length from batch 1 to each KV dtype's ceiling (at that
    ``q_len``: :func:`~fp8kv.step.step_ceiling`); one tidy row per (model, context, kv_dtype, draft_len, batch,
    acceptance) (columns :data:`VERIFY_COLUMNS`).

    Parameters
    ----------
    models, contexts, kv_dtypes, batches, backend, mode, gpu_memory_gib, utilization, block_size, weights, device,
    dtype, rep, seed, cpu_reps, keep_partial : as :func:`fp8kv.step.sweep`. ``contexts``: tokens per sequence the step attends,
        its new ``draft_len + 1`` included (so every draft length holds the same KV per sequence).
    draft_lens : ints >= 0 (0: the decode step, the baseline).
    acceptance : per-token acceptance rate(s) in [0, 1]; each is a row of the same timing.
    draft_us : the draft's cost per step in µs (default 0: MTP heads or n-gram drafts; see the module docstring).
    draft_model : a separate draft model (registry name or ModelShape) on the same GPU: its weights and KV in the
        ceiling, and (unless ``draft_us`` is given) ``draft_len`` of its decode steps timed at each batch as the
        draft's cost.

    The timing is the step's (CUDA graph on a GPU); every argument is checked before anything is built.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from ..bench import time_call
    from ..device import describe_device, resolve_device

    draft_lens = many_values(draft_lens, "draft_lens", draft_len_arg)
    accept = many_values(acceptance, "acceptance", acceptance_arg)
    timed_draft = draft_model is not None and draft_us is None  # the draft model's own steps are its cost
    draft_us = 0.0 if draft_us is None else draft_us_arg(draft_us)
    draft = None if draft_model is None else step_shape(draft_model, "draft_model")
    flag(keep_partial, "keep_partial")
    check_run_options(backend=backend, mode=mode, rep=rep, cpu_reps=cpu_reps, seed=seed, progress=progress, dtype=dtype)
    dev = resolve_device(device)
    dtype = run_dtype(dev, dtype)
    lengths = [positive_int(c, "contexts") for c in int_list(contexts, "contexts")]  # none: plan_sweep says so
    given = [(f"draft_lens[{i}]={k}", k) for i, k in enumerate(draft_lens)]  # named as given: the planner sees k + 1
    check_drafts_fit(given, lengths)
    check_one_token(kv_dtype_names(kv_dtypes), [(g, k + 1) for g, k in given], "draft_lens of 0 (the decode)")
    plans = {k: plan_sweep(models, contexts, kv_dtypes, batches=batches, gpu_memory_gib=gpu_memory_gib,
                           utilization=utilization, block_size=block_size, device=dev, dtype=dtype, q_len=k + 1,
                           draft_model=draft)
             for k in draft_lens}
    shapes = list(dict.fromkeys(p["shape"] for p in plans[draft_lens[0]]))
    check_weights(shapes, weights)
    if draft is not None:
        check_weights([draft], "random" if weights == "auto" else weights)
    _check_host(plans, dev, dtype)
    info = describe_device(dev)
    stamp = utc_stamp()
    base = machine_fields(stamp, info, float("nan"))
    base = {k: v for k, v in base.items() if k in VERIFY_COLUMNS}
    total = sum(len(p["batches"]) for group in plans.values() for p in group)
    bar = tqdm(total=total, disable=not progress, desc="verify", unit="point")
    drafted = draft.name if draft else ""

    def mine(shape, kv=None):  # draft length -> its plans of this model (and KV dtype)
        return {k: [p for p in group if p["shape"] is shape and kv in (None, p["kv_dtype"])] for k, group in plans.items()}

    def points(shape, kv=None):
        return [(k, p, b) for k, group in mine(shape, kv).items() for p in group for b in p["batches"]]

    def failed(shape, kv, w, reason):
        got = {"status": "error", "reason": reason, "draft_model": drafted, **({"weights": w.source} if w else {})}
        failing = points(shape, kv)
        bar.update(len(failing))
        return [r for k, p, b in failing for r in _rows(base, shape, p, b, k, accept, draft_us, backend, mode,
                                                          block_size, got)]

    rows = []

    def measure(shape, kv, w, pool):
        one_draft = {}  # (context, batch) -> µs of one draft decode step (or the reason it has none)
        for k, p, b in points(shape, kv):
            bar.set_postfix_str(f"{shape.name} {kv} ctx={p['context']} k={k} B={b}")
            got = time_step(shape, w, pool, b, p["context"], k + 1, backend, mode, dev, rep, cpu_reps, seed, time_call)
            cost = draft_us
            if timed_draft and k > 0 and got.get("status") == "ok":
                key = (p["context"], b)
                if key not in one_draft:
                    one_draft[key] = _one_draft_step(draft, b, p["context"], kv, backend, mode, block_size, weights,
                                                     dev, dtype, rep, seed, cpu_reps)
                if isinstance(one_draft[key], str):
                    got = {"status": "error", "reason": f"the draft model's step: {one_draft[key]}"}
                else:
                    cost = k * one_draft[key]
            rows.extend(_rows(base, shape, p, b, k, accept, cost, backend, mode, block_size,
                              dict(got, weights=w.source, draft_model=drafted)))
            bar.update(1)

    interrupted = interruptible(lambda: run_pools(
        shapes, lambda shape: dict.fromkeys(p["kv_dtype"] for p in plans[draft_lens[0]] if p["shape"] is shape),
        lambda shape, kv: max(pool_blocks(g, dev) for g in mine(shape, kv).values()), measure, failed, rows=rows,
        weights=weights, dtype=dtype, dev=dev, seed=seed, block_size=block_size), keep_partial=keep_partial, dev=dev)
    bar.close()
    df = pd.DataFrame(rows, columns=VERIFY_COLUMNS)
    df.attrs["step"] = run_metadata(stamp, info, None, {"rep": rep, "backend": backend, "mode": mode,
                                                        "utilization": utilization, "block_size": block_size,
                                                        "weights": weights, "dtype": str(dtype),
                                                        "draft_lens": draft_lens, "acceptance": accept,
                                                        "draft_us": "timed" if timed_draft else draft_us,
                                                        "draft_model": draft.name if draft else None,
                                                        "kind": "verify"}, interrupted=interrupted)
    return df


def _one_draft_step(draft, batch, context, kv, backend, mode, block_size, weights, dev, dtype, rep, seed,
                    cpu_reps):
    """µs of one decode step of the draft model at ``batch`` × ``context`` (:func:`_time_draft_step`), or the reason
    it did not run (a string: the verify rows of that batch say it)."""
    try:
        got = _time_draft_step(draft, batch, context, kv, backend, mode, block_size,
                               "random" if weights == "auto" else weights, dev, dtype, rep, seed, cpu_reps)
    except Exception as e:
        release_memory(dev)
        return why_failed(e)
    return got["step_us"] if got["status"] == "ok" else f"{got['status']}: {got['reason']}"


def _time_draft_step(draft, batch, context, kv, backend, mode, block_size, weights, dev, dtype, rep, seed,
                     cpu_reps) -> dict:
    """One decode step of the draft model at ``batch`` × ``context`` over its own weights and a pool just large
    enough (freed after), timed (:func:`~fp8kv.step.measure.time_step`'s dict). Loading the weights or allocating
    the pool raises."""
    from ..bench import time_call

    w = load_weights(draft, weights, dtype, dev, seed)
    pool = KVPool(draft, batch * math.ceil(context / block_size), kv, block_size=block_size, device=dev)
    got = time_step(draft, w, pool, batch, context, 1, backend, mode, dev, rep, cpu_reps, seed, time_call)
    del w, pool
    release_memory(dev)
    return got


def _check_host(plans: dict, dev, dtype) -> None:
    """Off a GPU, the largest pool of any draft length against the host's memory (:func:`check_host_memory`)."""
    from .measure import check_host_memory

    merged = []
    for group in plans.values():
        merged += group
    check_host_memory(merged, dev, dtype)


def _rows(base, shape, p, batch, draft_len, accept, draft_us, backend, mode, block_size, got) -> list[dict]:
    """The rows of one timed (or failed) point, one per acceptance rate."""
    plan = p["plan"]
    row = dict.fromkeys(VERIFY_COLUMNS)
    row.update(base, model=shape.name, kv_dtype=p["kv_dtype"], backend=backend, mode=mode, batch=batch,
               context=p["context"], ceiling=plan["ceiling"], draft_len=draft_len, q_len=draft_len + 1,
               draft_us=draft_us, num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
               num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, block_size=block_size,
               gpu_memory_gib=float(plan["gpu_memory_gib"]), utilization=plan["utilization"],
               activation_bytes=plan["activation_bytes"], status="ok", reason="")
    row.update({k: v for k, v in got.items() if k in VERIFY_COLUMNS and k != "step_us"})
    if got.get("status") == "ok":
        verify = got["step_us"]
        row.update(verify_us=verify, step_us=verify + draft_us, attention_share=got["attention_us"] / verify)
    out = []
    for a in accept:
        r = dict(row, acceptance=a, accepted_per_step=expected_accepted(a, draft_len))
        if got.get("status") == "ok":
            r["accepted_tokens_per_s"] = batch * r["accepted_per_step"] / (r["step_us"] * 1e-6)
        out.append(r)
    return out


def draft_cost_us(draft_model, batch: int, context: int, draft_len: int, kv_dtype: str = "bf16", *,
                  backend: str = "auto", mode: str = "auto", block_size: int = 16, weights: str = "random",
                  device=None, dtype=None, rep: int = 50, seed: int = 0, cpu_reps: int = 3) -> float:
    """Microseconds a draft model spends on ``draft_len`` drafts of ``batch`` sequences at ``context``: that many
    of its decode steps, one measured (:class:`~fp8kv.step.DecodeStep` over a pool just large enough, its KV in
    ``kv_dtype``). Pass the result as :func:`verify_sweep`'s ``draft_us``. Raises what the step raises (an
    unsupported combination, out of memory) rather than return a number that was not measured."""
    from ..device import resolve_device

    shape = step_shape(draft_model, "draft_model")
    batch, context = positive_int(batch, "batch"), positive_int(context, "context")
    draft_len, rep = draft_len_arg(draft_len), rep_ms(rep)
    if draft_len == 0:
        return 0.0
    dev = resolve_device(device)
    dtype = run_dtype(dev, dtype)
    check_weights([shape], weights)
    got = _time_draft_step(shape, batch, context, kv_dtype, backend, mode, block_size, weights, dev, dtype, rep, seed,
                           cpu_reps)
    if got["status"] != "ok":
        _fail(f"the draft model {shape.name}'s decode step did not run ({got['status']}): {got['reason']}")
    return draft_len * got["step_us"]
