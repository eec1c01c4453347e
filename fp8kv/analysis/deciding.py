"""The answer to "will an FP8 KV cache pay for me?", from the three measurements that decide it (notebook 09).

* :func:`headline`: two sentences for the first screen: per batch, where fp8kv's FP8 KV pays and where
  FlashInfer's best does (:mod:`fp8kv.analysis.breakeven`; the intervals, the reasons a line does not hold and
  each kernel's own line are the break-even section's, :func:`fp8kv.analysis.breakeven_text.speed_details`),
  then accuracy: the long-context verdict (:mod:`fp8kv.analysis.long_context`), the keep-16-bit advice with its
  price and what scale 1.0 (no checkpoint scales) does to the model (:mod:`fp8kv.analysis.scale_health`).
* :func:`heldout_scale_health` and :func:`heldout_advice`: whether the advice, chosen on one text, also
  brings the error under the tolerance on a text it has not seen (measured, not the advice's own arithmetic).
"""

from __future__ import annotations

import math

from .. import checks
from .breakeven_text import check_backend, check_crossings, number
from .errors import check_bf16_layers, check_layer_counts
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
_NAMES = {"triton": "fp8kv", "flashinfer": "FlashInfer"}  # how the answer names a backend
_VERDICT = ("entry", "mode", "error", "reference_context", "longest_context", "growth", "flat", "needle_ok")
_ADVICE = ("method", "n_layers_bf16", "n_layers", "error_all_fp8")
_COLLAPSES = ("layer", "method", "kind")


def _pair_key(r):
    """How early and how much FP8 pays for crossings row ``r``: ``(from, class, -gain)`` (smaller is better; class 0
    pays beyond ``from``, 1 only below a crossing, 2 never), None for a row with neither a line nor points."""
    if r["status"] == "ok":
        gain = number(r.get("fp8_speedup_at_hi", math.nan))
        gain = -gain if math.isfinite(gain) else 0.0
        start = {"every": r["tokens_lo"], "beyond": r["crossing_tokens"]}.get(r["verdict"], math.inf)
        return float(start), {"every": 0, "beyond": 0, "below": 1}.get(r["verdict"], 2), gain
    if not isinstance(r.get("measured", ""), str) or not r.get("measured", ""):
        return None
    start, best = number(r.get("measured_faster_from", math.nan)), number(r.get("measured_best_speedup", math.nan))
    start = start if math.isfinite(start) else math.inf
    return start, 0 if math.isfinite(start) else 2, -best if math.isfinite(best) else 0.0


def _pair_phrase(r, unit: bool, gain: bool) -> tuple[str, bool]:
    """Where FP8 pays for row ``r``, in a few words: "from 512 tokens, up to 1.81x" (the gain where ``gain``),
    "beyond 8,037 tokens, ill-determined", "only below 6,827 tokens", "never"; named by backend (its variant and a
    mode other than dequant). ``unit``: say "tokens" (the sentence has not said it yet). Returns the words and
    whether they said it."""
    name = _NAMES.get(r["backend"], r["backend"])
    start, kind, best = _pair_key(r)
    if kind == 2:
        return f"{name} never", False
    variant = r.get("variant", "")
    name += f"-{variant}" if isinstance(variant, str) and variant else ""
    name += f" ({r['mode']} mode)" if r["mode"] != "dequant" else ""
    tokens = " tokens" if unit else ""
    if kind == 1:
        return f"{name} only below {r['crossing_tokens']:,.0f}{tokens}", unit
    if r["status"] == "ok" and r["verdict"] == "beyond":
        shaky = ", ill-determined" if number(r.get("slope_gap_z", math.inf)) < 2 else ""
        return f"{name} beyond {start:,.0f}{tokens}{shaky}", unit
    return f"{name} from {start:,.0f}{tokens}" + (f", up to {-best:.2f}x" if gain and best < 0 else ""), unit


def _speed_sentence(gpu: str, crossings, backend: str | None) -> str:
    """One clause per batch: the best pair of fp8kv (Triton), then in brackets each other backend's (FlashInfer's)."""
    rows = crossings if backend is None else crossings[crossings["backend"] == backend]
    order = sorted(set(rows["backend"]), key=lambda b: (b != "triton", b))
    clauses, unit = [], True
    for batch, g in rows.groupby("batch", sort=True):
        said = []
        for b in order:
            keyed = [(k, i) for i, r in g[g["backend"] == b].iterrows() if (k := _pair_key(r)) is not None]
            if keyed:
                text, used = _pair_phrase(g.loc[min(keyed)[1]], unit, gain=not said)
                said.append(text)
                unit = unit and not used
        if said:
            others = f" ({'; '.join(said[1:])})" if len(said) > 1 else ""
            clauses.append(f"batch {number(batch):.0f}, {said[0]}{others}")
    if not clauses:
        return f"On {gpu}, no FP8 latency line held and no point was compared: no speed answer."
    return f"On {gpu}, FP8 KV decodes faster than 16-bit KV: " + "; ".join(clauses) + "."


def _check_advice(advice) -> None:
    from ..results import check_rows

    expected = "advice_capacity()'s or keep_bf16_advice()'s table"
    checks.dataframe(advice, "advice", _ADVICE, expected=expected)
    check_layer_counts(advice)  # "keep -3 of 2 layers" before
    check_rows(advice, "headline", (), whole=("tokens_lost",), expected=expected)
    for i, x in advice["error_all_fp8"].items():
        checks.real(x, f"advice['error_all_fp8'][{i}]")


def _collapses(health):
    """The collapses table of ``health`` (a ScaleHealth, or its ``collapses`` table as saved), checked."""
    import pandas as pd

    if isinstance(health, ScaleHealth):
        return health.collapses
    if not isinstance(health, pd.DataFrame):
        checks.fail(f"health is a {type(health).__name__}; expected measure_scale_health()'s ScaleHealth or its "
                    "collapses table", TypeError)
    if health.empty and not len(health.columns):  # saved as [] (no collapse): no columns to read
        return pd.DataFrame(columns=list(_COLLAPSES))
    checks.dataframe(health, "health", _COLLAPSES, expected="ScaleHealth.collapses")
    return health


def headline(gpu: str, *, crossings=None, verdict=None, advice=None, health=None, model: str | None = None,
             smoke: bool = False, backend: str | None = None) -> str:
    """The answer in two sentences (Markdown) for ``gpu``: speed, then accuracy.

    ``crossings``: ``fp8kv.analysis.crossings``' table: per batch one clause, where fp8kv's (Triton's) FP8 KV
    pays against a 16-bit cache and where each other backend's best pair does (FlashInfer's), from a line that
    holds or the points measured where none does; the intervals, reasons and per-kernel lines are
    :func:`~fp8kv.analysis.breakeven_text.speed_details`'. ``verdict``: ``long_context_verdict``'s (its
    ``"total"`` rows); ``advice``: ``advice_capacity``'s or ``keep_bf16_advice``'s table for ``model``, read for
    its ``"amax"`` row (else the first); ``health``: the model's ScaleHealth (or its ``collapses`` table), read for
    what scale 1.0, the engines' default without checkpoint scales, collapses or saturates (else the advice's
    ``"1.0"`` row's ``collapsed_layers``). Each may be None (its part is left out), not all of crossings, verdict
    and advice (nor an advice of no row alone). ``backend`` restricts the speed answer to one backend (with
    ``crossings`` only). ``smoke``: says first that the numbers are a smoke run's, not a result.

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
        check_backend(backend, crossings)
    if crossings is not None:
        check_crossings(crossings, "headline")
    check_backend(backend, crossings)
    if verdict is not None:
        from ..results import check_rows

        checks.dataframe(verdict, "verdict", _VERDICT, expected="long_context_verdict()'s table")
        check_rows(verdict, "headline", (), whole=("reference_context", "longest_context"),
                   expected="long_context_verdict()'s table")
    if advice is not None:
        _check_advice(advice)
    collapses = _collapses(health) if health is not None else None
    if crossings is None and verdict is None and (advice is None or advice.empty):
        checks.fail("crossings and verdict are None and advice has no row: headline has nothing to answer from; "
                    "pass at least one of them")
    sentences = [_speed_sentence(gpu, crossings, backend)] if crossings is not None else []
    accuracy = []
    if verdict is not None:
        accuracy.append(_accuracy(verdict))
    if advice is not None and len(advice):
        accuracy.append(_advice(advice, model or "the model"))
    scale_one = _scale_one(collapses, advice)
    if scale_one:
        accuracy.append(scale_one)
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
    span = f"{int(total['reference_context'].iloc[0]):,}-{int(total['longest_context'].iloc[0]):,} tokens"
    text = (f"error flat over {span}" if bool(total["flat"].all()) else
            f"error grows over {span} (x{worst['growth']:.2f}, fp8kv.{worst['entry']} {worst['mode']} mode)")
    if bool(total["needle_ok"].all()):
        # a verdict without needle_weight_ok (saved before the kernel's weight was tested) says top-1 only
        return text + (", needle kept" if "needle_weight_ok" in total.columns else ", needle on top")
    lost = total[~total["needle_ok"].astype(bool)]
    return text + ", needle LOST in " + ", ".join(f"fp8kv.{r.entry} {r.mode} mode" for r in lost.itertuples())


def _layers(layers) -> str:
    layers = sorted(int(x) for x in layers)
    shown = ", ".join(map(str, layers[:4])) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    return ("layer " if len(layers) == 1 else "layers ") + shown


def _scale_one(collapses, advice) -> str:
    """What scale 1.0 (no checkpoint scales: the engines' default) collapses or saturates; "" where nothing."""
    if collapses is not None:
        one = collapses[collapses["method"].astype(str) == "1.0"]
        gone = set(one.loc[one["kind"] == "collapsed", "layer"])
        saturated = set(one.loc[one["kind"] == "saturates", "layer"]) - gone
    else:
        rows = advice[advice["method"].astype(str) == "1.0"] if advice is not None and "collapsed_layers" in advice \
            else []
        gone, saturated = (set(rows.iloc[0]["collapsed_layers"]) if len(rows) else set()), set()
    said = [f"{verb} {_layers(layers)}" for verb, layers in (("collapses", gone), ("saturates", saturated)) if layers]
    return "scale 1.0 (no checkpoint scales) " + " and ".join(said) if said else ""


def _advice(advice, name: str) -> str:
    rows = advice[advice["method"] == "amax"]
    r = (rows if len(rows) else advice).iloc[0]
    if int(r["n_layers_bf16"]) == 0:
        return f"{name} needs no 16-bit layer ({r['method']} scales)"
    cost = f", {int(r['tokens_lost']):,} tokens fewer" if "tokens_lost" in r else ""
    return f"{name} keeps {int(r['n_layers_bf16'])} of {int(r['n_layers'])} layers 16-bit ({r['method']} scales{cost})"
