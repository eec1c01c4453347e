"""The answer to "will an FP8 KV cache pay for me?", from the three measurements that decide it (notebook 09).

* :func:`headline`: one or two sentences from the break-even crossings (:mod:`fp8kv.analysis.breakeven`),
  the long-context verdict (:mod:`fp8kv.analysis.long_context`) and the keep-16-bit advice with its price
  (:mod:`fp8kv.analysis.scale_health`).
* :func:`heldout_scale_health` and :func:`heldout_advice`: whether the advice, chosen on one text, also
  brings the error under the tolerance on a text it has not seen (measured, not the advice's own arithmetic).
"""

from __future__ import annotations

import math
import numbers

from .. import checks
from .breakeven import PER_KERNEL, check_answered
from .errors import check_bf16_layers, check_layer_counts
from .measured import kernel_names
from .scale_health import ScaleHealth, model_scale_health

__all__ = ["heldout_scale_health", "heldout_advice", "headline"]


# ------------------------------------------------------------------------------------ held-out advice
def heldout_scale_health(model: str = "smollm2-135m", num_tokens: int = 256, calibration_tokens: int = 256,
                         num_queries: int = 16, *, offset: int | None = None, device="cpu",
                         kv_dtype: str = "fp8_e4m3", granularity: str = "tensor", methods=None,
                         percentile: float = 99.9, key_gain: float = 1.0, key_layers=()) -> ScaleHealth:
    """:func:`~fp8kv.analysis.model_scale_health` on another stretch of the evaluation text: ``num_tokens``
    tokens from token ``offset`` (default ``num_tokens + calibration_tokens``, right after the text that
    ``model_scale_health`` captures and calibrates on), with the *same* calibrated scales (from tokens
    ``num_tokens .. num_tokens + calibration_tokens``); ``key_gain`` / ``key_layers`` as there. ImportError as
    ``model_scale_health``'s."""
    num_tokens = checks.positive_int(num_tokens, "num_tokens")
    calibration_tokens = checks.positive_int(calibration_tokens, "calibration_tokens")
    offset = num_tokens + calibration_tokens if offset is None else checks.nonnegative_int(offset, "offset")
    return model_scale_health(model, num_tokens, calibration_tokens, num_queries, offset=offset, device=device,
                              kv_dtype=kv_dtype, granularity=granularity, methods=methods, percentile=percentile,
                              key_gain=key_gain, key_layers=key_layers)


def _rms(values) -> float:
    values = [float(v) for v in values]
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else float("nan")


def heldout_advice(advice, heldout: ScaleHealth):
    """The advice (``keep_bf16_advice``'s or ``advice_capacity``'s table) measured on ``heldout``
    (:func:`heldout_scale_health`, the same model and methods): adds ``heldout_all_fp8`` (the RMS over
    layers of the held-out error, every layer FP8), ``heldout_after`` (the advised layers 16-bit, error 0),
    ``heldout_reduces`` (after < all; None where no layer is kept: not applicable) and ``heldout_holds`` (after <= the tolerance)."""
    import pandas as pd

    if not isinstance(advice, pd.DataFrame) or {"method", "layers_bf16", "tolerance", "n_layers"} - set(advice.columns):
        checks.fail("advice must be keep_bf16_advice()'s (or advice_capacity()'s) table", TypeError)
    if not isinstance(heldout, ScaleHealth):
        checks.fail(f"heldout is a {type(heldout).__name__}; expected heldout_scale_health()'s ScaleHealth",
                    TypeError)
    check_bf16_layers(advice)  # int() read 1.5 as layer 1; a layer past the model's was kept unseen
    for i, t in advice["tolerance"].items():
        checks.positive_float(t, f"advice['tolerance'][{i}]")  # a NaN tolerance held nowhere, silently
    out = advice.copy()
    before, after = [], []
    for r in advice.itertuples(index=False):
        lay = heldout.layers[heldout.layers["method"] == r.method]
        if lay.empty:
            checks.fail(f"heldout has no layers measured with method {r.method!r}; it holds {list(heldout.methods)}")
        if len(lay) != r.n_layers:
            checks.fail(f"heldout measured {len(lay)} layers, the advice {r.n_layers}; expected the same model")
        kept = set(int(x) for x in r.layers_bf16)
        before.append(_rms(lay["error"]))
        after.append(math.sqrt(sum(float(e) ** 2 for layer, e in zip(lay["layer"], lay["error"], strict=True)
                                   if int(layer) not in kept) / len(lay)))
    out["heldout_all_fp8"], out["heldout_after"] = before, after
    out["heldout_reduces"] = [bool(a < b) if len(r.layers_bf16) else None for a, b, r in  # None: nothing kept
                              zip(after, before, advice.itertuples(index=False), strict=True)]
    out["heldout_holds"] = [a <= t for a, t in zip(after, advice["tolerance"], strict=True)]
    return out


# ------------------------------------------------------------------------------------ the answer
def _fitted(g):
    """A batch's best pair whose lines held: ``(pays from, clause, the gain at the longest context)``. Of the pairs
    paying at every context they hold over, the one holding from the shortest context, then the one FP8 gains most
    with at the longest; else the one paying beyond the smallest context; else one paying only below a crossing
    (from = inf: it does not pay where contexts grow); else none pays (from = inf)."""
    batch = g["batch"].iloc[0]
    every = g[g["verdict"] == "every"].copy()
    every["_gain"] = -every["fp8_speedup_at_hi"].fillna(0.0) if "fp8_speedup_at_hi" in every.columns else 0.0
    every = every.sort_values(["tokens_lo", "_gain"], kind="stable")
    beyond = g[g["verdict"] == "beyond"].sort_values("crossing_tokens")
    below = g[g["verdict"] == "below"].sort_values("crossing_tokens", ascending=False)
    if not every.empty:
        r = every.iloc[0]
        gain = r.get("fp8_speedup_at_hi", math.nan)
        at = f"; {gain:.2f}x at {r['tokens_hi']:,.0f}" if isinstance(gain, float) and math.isfinite(gain) else ""
        span = "every context where its lines hold" if r.get("left_out", 0) else "every measured context"
        return (r["tokens_lo"], f"at {span} ({r['tokens_lo']:,.0f}-{r['tokens_hi']:,.0f} tokens{at}) at batch "
                f"{batch} ({_what(r)})", gain)
    if not beyond.empty:
        r = beyond.iloc[0]
        return (r["crossing_tokens"], f"beyond {r['crossing_tokens']:,.0f} tokens per sequence{_interval(r)} at "
                f"batch {batch} ({_what(r)})", r.get("fp8_speedup_at_hi", math.nan))
    if not below.empty:
        r = below.iloc[0]
        # pays only at short contexts: ranked after any pair paying at long ones (a measured pair included)
        return (math.inf, f"only below {r['crossing_tokens']:,.0f} tokens per sequence{_interval(r)} at "
                f"batch {batch} ({_what(r)})", r.get("fp8_speedup_at_hi", math.nan))
    held = ", ".join(sorted({_what(r) for _, r in g.iterrows()}))
    return (math.inf, f"at no measured context ({g['tokens_lo'].min():,.0f}-{g['tokens_hi'].max():,.0f} tokens) at "
            f"batch {batch} (the pairs whose lines held: {held})", max(g.get("fp8_speedup_at_hi", [math.nan])))


def _measured_best(g):
    """A batch's best pair without a line (``crossings``' ``measured``, its points compared context by context):
    the one FP8 is faster for from the earliest context, then the largest speedup; None where none measured."""
    if "measured" not in g.columns:
        return None
    g = g[(g["status"] != "ok") & (g["measured"].fillna("").astype(str) != "")]
    if g.empty:
        return None
    return g.assign(_from=g["measured_faster_from"].fillna(math.inf),
                    _best=-g["measured_best_speedup"].fillna(0.0)).sort_values(["_from", "_best"]).iloc[0]


def _measured_sentence(r, first: bool, gpu: str) -> str:
    """The measured answer of pair ``r`` as a sentence of its own (its text keeps its semicolons), saying it is no
    fit and why: the decode's change of kernel only where that is the one thing refused (the 16-bit line held);
    then each kernel's own line where its FP8 rows ran several (``by_kernel``)."""
    kernels = kernel_names(r.get("kernels", ""))
    why = (f"no line holds across the decode's change of kernel ({' and '.join(kernels)})"
           if len(kernels) > 1 and bool(r.get("baseline_held", True))
           else "its latency lines do not hold" + ("; its FP8 rows also change kernel" if len(kernels) > 1 else ""))
    lead = f"On {gpu}, at" if first else "At"
    per_kernel = r.get("by_kernel", "")  # each kernel's own line, where the FP8 rows ran several
    tail = f"; {PER_KERNEL}{per_kernel}" if isinstance(per_kernel, str) and per_kernel else ""
    return f"{lead} batch {r['batch']} with {_what(r)}, measured point by point ({why}): {r['measured']}{tail}."


def _speed(crossings, backend: str | None) -> tuple[list[str], list, list[str]]:
    """Per batch, the pair FP8 pays for from the shortest context, then the largest gain — a pair whose lines held
    (:func:`_fitted`: its clause, first) or one measured point by point (its lines did not hold: a split rule, a
    launch floor or a change of kernel makes the latency steppy; its row, second); the fitted pair wins a tie. Third: the
    measured pairs not chosen that measured a larger speedup than the chosen fitted pair reaches (the fit did
    not confirm them, but a reader choosing a backend must see them)."""
    rows = crossings if backend is None else crossings[crossings["backend"] == backend]
    first, chosen, second = [], [], []
    for batch, g in rows.groupby("batch", sort=True):
        ok = g[g["status"] == "ok"]
        fitted, m = (_fitted(ok) if not ok.empty else None), _measured_best(g)
        f_gain = fitted[2] if fitted is not None and math.isfinite(fitted[2]) else 0.0
        f_key = (fitted[0], -f_gain) if fitted is not None else (math.inf, 0.0)
        m_from = float(m["measured_faster_from"]) if m is not None else math.inf
        if math.isfinite(m_from) and (m_from, -float(m["measured_best_speedup"])) < f_key:
            chosen.append(m)
            continue
        if fitted is not None:
            first.append(fitted[1])
        if m is not None and (fitted is None or m["measured_best_speedup"] > f_gain):
            second.append(f"at batch {batch} with {_what(m)}, {m['measured']}")
    return first, chosen, second


def _interval(r) -> str:
    """`` (95 %: lo-hi)``, and a warning where the lines are nearly parallel (the crossing is ill-determined)."""
    lo, hi, z = r.get("crossing_lo", math.nan), r.get("crossing_hi", math.nan), r.get("slope_gap_z", math.inf)
    text = f" (95 %: {max(lo, 0):,.0f}-{hi:,.0f})" if math.isfinite(lo) and math.isfinite(hi) else ""
    return text + (" (ill-determined: the lines are nearly parallel)" if z < 2 else "")


def _what(r) -> str:
    variant = f"-{r['variant']}" if isinstance(r.get("variant", ""), str) and r.get("variant", "") else ""
    return f"{r['backend']}{variant}, {r['mode']} mode"


# The columns each table's sentences read; crossings' measured ones only where breakeven_context added them
_CROSSINGS = ("backend", "batch", "status", "mode", "verdict", "tokens_lo", "tokens_hi", "crossing_tokens")
_MEASURED = ("measured", "measured_faster_from", "measured_best_speedup")
_VERDICT = ("entry", "mode", "error", "reference_context", "longest_context", "growth", "flat", "needle_ok")
_ADVICE = ("method", "n_layers_bf16", "n_layers", "error_all_fp8")


def _check_crossings(crossings) -> None:
    """Refuse rows the sentences would misread: a batch that is no positive whole number (grouping by batch drops
    NaN: its lines vanished from the answer) and, where the lines held, a verdict outside
    :data:`~.breakeven.VERDICTS` or a non-finite number of tokens it is said in."""
    from ..results import check_rows

    expected = "fp8kv.analysis.crossings()' table"
    checks.dataframe(crossings, "crossings", _CROSSINGS + (_MEASURED if "measured" in crossings else ()),
                     expected=expected)
    check_rows(crossings, "headline", _CROSSINGS, expected=expected)  # a status of no value, a batch of text
    for i, r in crossings.iterrows():
        b = _number(r["batch"])
        if not (b >= 1 and b % 1 == 0):  # NaN fails both
            checks.fail(f"crossings['batch'][{i}]={checks.show_value(r['batch'])}; expected a positive whole number")
        if r["status"] != "ok":
            continue
        check_answered(r, lambda col, i=i: f"crossings[{col!r}][{i}]")


def _number(x) -> float:
    """``x`` as a float; NaN for what is no number (check_rows named a column of text already)."""
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else math.nan


def _check_advice(advice) -> None:
    from ..results import check_rows

    expected = "advice_capacity()'s or keep_bf16_advice()'s table"
    checks.dataframe(advice, "advice", _ADVICE, expected=expected)
    check_layer_counts(advice)  # "keep -3 of 2 layers" before
    check_rows(advice, "headline", (), whole=("tokens_lost",), expected=expected)
    for i, x in advice["error_all_fp8"].items():
        checks.real(x, f"advice['error_all_fp8'][{i}]")


def headline(gpu: str, *, crossings=None, verdict=None, advice=None, model: str | None = None,
             smoke: bool = False, backend: str | None = None) -> str:
    """The answer in one or two sentences (Markdown) for ``gpu``.

    ``crossings``: ``fp8kv.analysis.crossings``' table (speed); ``verdict``: ``long_context_verdict``'s
    (accuracy at length; its ``"total"`` rows); ``advice``: ``advice_capacity``'s or ``keep_bf16_advice``'s
    table for ``model``, read for its ``"amax"`` row (else the first). Each may be None (its part is left
    out), not all three (nor an advice of no row alone: there would be nothing to say). ``backend``
    restricts the speed answer to one backend (with ``crossings`` only). ``smoke``: says first that the
    numbers are a smoke run's, not a result.

    Each table is checked where it enters: ValueError / TypeError naming it and the columns it lacks, or the
    row and column of a value its sentence would misread (a batch that is no positive whole number, a verdict
    outside :data:`~.breakeven.VERDICTS`, a non-finite context a verdict is said in, advice counts outside
    ``0 <= n_layers_bf16 <= n_layers``). NaN ``crossing_tokens`` is crossings()' "no crossing" where the
    verdict is ``"every"`` or ``"never"``, and is read so.
    """
    if not isinstance(gpu, str) or not gpu:
        checks.fail(f"gpu={checks.show_value(gpu)}; expected the GPU's name", TypeError)
    if not isinstance(smoke, bool):
        checks.fail(f"smoke={smoke!r}; expected True or False", TypeError)
    if backend is not None and not isinstance(backend, str):
        checks.fail(f"backend={checks.show_value(backend)} ({type(backend).__name__}); expected None or a backend's "
                    "name", TypeError)
    if crossings is not None:
        _check_crossings(crossings)
    elif backend is not None:  # it restricts the speed answer, which needs crossings
        checks.fail(f"backend={backend!r} but crossings is None: there is no speed answer to restrict; pass crossings "
                    "(fp8kv.analysis.crossings()' table) or backend=None")
    if verdict is not None:
        from ..results import check_rows

        checks.dataframe(verdict, "verdict", _VERDICT, expected="long_context_verdict()'s table")
        check_rows(verdict, "headline", (), whole=("reference_context", "longest_context"),
                   expected="long_context_verdict()'s table")
    if advice is not None:
        _check_advice(advice)
    if crossings is None and verdict is None and (advice is None or advice.empty):
        checks.fail("crossings and verdict are None and advice has no row: headline has nothing to answer from; "
                    "pass at least one of them")
    sentences = []
    if crossings is not None:
        if backend is not None and backend not in set(crossings["backend"]):  # an unknown one read as "no answer"
            checks.fail(f"backend={backend!r} has no row in crossings; expected None or one of "
                        f"{sorted(set(crossings['backend']))}")
        pays, chosen, measured = _speed(crossings, backend)
        if pays:
            sentences.append(f"On {gpu}, FP8 KV decodes faster than a 16-bit cache " + "; ".join(pays) + ".")
        sentences += [_measured_sentence(r, not pays and i == 0, gpu) for i, r in enumerate(chosen)]
        pays = pays or chosen
        if measured:
            sentences.append(("Pairs whose latency lines did not hold, measured point by point: " if pays else
                              f"On {gpu}, no FP8 latency line held; point by point: ") + "; ".join(measured) + ".")
        if not pays and not measured:
            sentences.append(f"On {gpu}, no FP8 latency line held: no speed answer.")
    accuracy = []
    if verdict is not None:
        accuracy.append(_accuracy(verdict))
    if advice is not None and len(advice):
        accuracy.append(_advice(advice, model or "the model"))
    if accuracy:
        text = "; ".join(accuracy)
        sentences.append(text[0].upper() + text[1:] + ".")
    text = " ".join(sentences)
    if smoke:
        text = ("**Smoke run (no GPU: Triton's interpreter at toy sizes): the numbers below exercise the code and "
                "are not a result for any GPU.** " + text)
    return text


def _accuracy(verdict) -> str:
    total = verdict[verdict["error"] == "total"]
    if total.empty:
        checks.fail("verdict has no 'total' rows; expected long_context_verdict()'s table")
    worst = total.loc[total["growth"].idxmax()]
    span = f"{int(total['reference_context'].iloc[0]):,} to {int(total['longest_context'].iloc[0]):,} tokens"
    where = f"x{worst['growth']:.2f} at worst, fp8kv.{worst['entry']} {worst['mode']} mode"
    text = (f"its attention error stays flat from {span} ({where})" if bool(total["flat"].all()) else
            f"its attention error grows from {span} ({where})")
    return text + (" and a planted needle stays the top position" if bool(total["needle_ok"].all()) else
                   ", and a planted needle is NOT always the top position")


def _advice(advice, name: str) -> str:
    rows = advice[advice["method"] == "amax"]
    r = (rows if len(rows) else advice).iloc[0]
    if int(r["n_layers_bf16"]) == 0:
        return f"{name} needs no 16-bit layer with {r['method']} scales (RMS error {r['error_all_fp8']:.1%})"
    cost = f", {int(r['tokens_lost']):,} tokens fewer than all-FP8" if "tokens_lost" in r else ""
    return (f"{name} should keep {int(r['n_layers_bf16'])} of {int(r['n_layers'])} layers 16-bit with "
            f"{r['method']} scales{cost}")
