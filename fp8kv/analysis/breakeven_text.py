"""The break-even section's own text: per batch, where FP8 KV pays against a 16-bit cache in full, with the
intervals, the pairs measured point by point where no latency line holds and why, and each kernel's own line where
the decode changes kernel (:func:`speed_details`). The first screen's short answer is
:func:`fp8kv.analysis.deciding.headline`; both read :func:`fp8kv.analysis.crossings`' table, checked by
:func:`check_crossings`."""

from __future__ import annotations

import math
import numbers

from .. import checks
from .breakeven import PER_KERNEL, check_answered
from .measured import kernel_names

__all__ = ["CROSSINGS_COLUMNS", "check_crossings", "check_backend", "number", "speed_details"]

# The columns each table's sentences read; crossings' measured ones only where breakeven_context added them
CROSSINGS_COLUMNS = ("backend", "batch", "status", "mode", "verdict", "tokens_lo", "tokens_hi", "crossing_tokens")
_MEASURED = ("measured", "measured_faster_from", "measured_best_speedup")


def number(x) -> float:
    """``x`` as a float; NaN for what is no number (check_rows named a column of text already)."""
    return float(x) if isinstance(x, numbers.Real) and not isinstance(x, bool) else math.nan


def check_crossings(crossings, reader: str) -> None:
    """Refuse rows the sentences would misread: a batch that is no positive whole number (grouping by batch drops
    NaN: its lines vanished from the answer) and, where the lines held, a verdict outside
    :data:`~.breakeven.VERDICTS` or a non-finite number of tokens it is said in. ``reader`` names the caller."""
    from ..results import check_rows

    expected = "fp8kv.analysis.crossings()' table"
    checks.dataframe(crossings, "crossings", CROSSINGS_COLUMNS + (_MEASURED if "measured" in crossings else ()),
                     expected=expected)
    check_rows(crossings, reader, CROSSINGS_COLUMNS, expected=expected)  # a status of no value, a batch of text
    for i, r in crossings.iterrows():
        b = number(r["batch"])
        if not (b >= 1 and b % 1 == 0):  # NaN fails both
            checks.fail(f"crossings['batch'][{i}]={checks.show_value(r['batch'])}; expected a positive whole number")
        if r["status"] != "ok":
            continue
        check_answered(r, lambda col, i=i: f"crossings[{col!r}][{i}]")


def check_backend(backend, crossings) -> None:
    """``backend``: None or the name of a backend that has rows in ``crossings`` (an unknown one read as "no
    answer"); TypeError / ValueError naming it."""
    if backend is None:
        return
    if not isinstance(backend, str):
        checks.fail(f"backend={checks.show_value(backend)} ({type(backend).__name__}); expected None or a backend's "
                    "name", TypeError)
    if crossings is None:  # it restricts the speed answer, which needs crossings
        checks.fail(f"backend={backend!r} but crossings is None: there is no speed answer to restrict; pass crossings "
                    "(fp8kv.analysis.crossings()' table) or backend=None")
    if backend not in set(crossings["backend"]):
        checks.fail(f"backend={backend!r} has no row in crossings; expected None or one of "
                    f"{sorted(set(crossings['backend']))}")


def speed_details(gpu: str, crossings, *, backend: str | None = None) -> str:
    """Per batch, in sentences, the pair FP8 KV pays for from the shortest context (then the largest gain): a pair
    whose lines held, with its crossing's interval; a pair measured point by point where its lines did not hold
    (and why: the decode's change of kernel, each kernel's own line); the measured pairs not chosen that measured a
    larger speedup. ``backend`` restricts it to one backend. The tables are checked as ``headline`` checks them."""
    if not isinstance(gpu, str) or not gpu:
        checks.fail(f"gpu={checks.show_value(gpu)}; expected the GPU's name", TypeError)
    check_crossings(crossings, "speed_details")
    check_backend(backend, crossings)
    pays, chosen, measured = _speed(crossings, backend)
    sentences = []
    if pays:
        sentences.append(f"On {gpu}, FP8 KV decodes faster than a 16-bit cache " + "; ".join(pays) + ".")
    sentences += [_measured_sentence(r, not pays and i == 0, gpu) for i, r in enumerate(chosen)]
    pays = pays or chosen
    if measured:
        sentences.append(("Pairs whose latency lines did not hold, measured point by point: " if pays else
                          f"On {gpu}, no FP8 latency line held; point by point: ") + "; ".join(measured) + ".")
    if not pays and not measured:
        sentences.append(f"On {gpu}, no FP8 latency line held: no speed answer.")
    return " ".join(sentences)


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
