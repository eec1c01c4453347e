"""fp8kv.analysis.breakeven: latency lines in the context, their crossing, its uncertainty and the refusals."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures import breakeven_rows as bench_rows

from fp8kv.analysis import breakeven as be
from fp8kv.analysis import measured

CONTEXTS = be.BREAKEVEN_GRID["contexts"]
SAVED = Path(__file__).resolve().parents[1] / "results" / "bench" / "nvidia-h200"


# ------------------------------------------------------------------------------- exact recovery
@pytest.mark.parametrize("relative", [True, False])
@pytest.mark.parametrize("bf16, fp8", [((10.0, 0.02), (30.0, 0.01)), ((5.0, 0.4), (900.0, 0.21)),
                                       ((12.5, 0.001), (14.0, 0.0006))])
def test_exact_lines_are_recovered(bf16, fp8, relative):
    lines, cr = be.breakeven_context(bench_rows({"bf16": bf16, "fp8_e4m3": fp8}), relative=relative)
    assert (lines["status"] == "ok").all()
    for kv, (a, b) in (("bf16", bf16), ("fp8_e4m3", fp8)):
        row = lines[lines["kv_dtype"] == kv].iloc[0]
        assert row["intercept_us"] == pytest.approx(a, rel=1e-9)
        assert row["slope_us_per_token"] == pytest.approx(b, rel=1e-9)
        assert row["r2"] == 1.0 and row["max_rel_residual"] < 1e-9 and row["n_contexts"] == len(CONTEXTS)
    truth = (fp8[0] - bf16[0]) / (bf16[1] - fp8[1])
    (row,) = cr.itertuples()
    assert row.crossing_tokens == pytest.approx(truth, rel=1e-9)
    assert row.crossing_se < 1e-6 * truth
    assert row.verdict == "beyond" and row.status == "ok"
    assert row.answer.startswith(f"on NVIDIA H200, with triton, FP8 KV pays beyond {truth:,.0f} tokens per "
                                 "sequence at batch 16")


def test_line_points_hold_the_residuals():
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}, rel_noise=0.01, seed=3)
    pts = be.line_points(rows)
    assert len(pts) == len(rows)
    lines = be.fit_lines(rows)
    for kv, g in pts.groupby("kv_dtype"):
        line = lines[lines["kv_dtype"] == kv].iloc[0]
        fitted = line["intercept_us"] + line["slope_us_per_token"] * g["tokens"]
        np.testing.assert_allclose(g["fitted_us"], fitted, rtol=1e-12)
        np.testing.assert_allclose(g["residual_us"], g["time_us"] - g["fitted_us"], rtol=1e-12)
        assert g["rel_residual"].abs().max() == pytest.approx(line["max_rel_residual"], rel=1e-12)


# ------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize("bf16, fp8, verdict, phrase", [
    ((10.0, 0.02), (30.0, 0.01), "beyond", "pays beyond 2,000 tokens per sequence"),
    ((10.0, 0.02), (12.0, 0.01), "every", "pays at every measured context (512-32,768 tokens per sequence"),
    ((10.0, 0.02), (400.0, 0.01), "never", "never pays within the measured range (512-32,768 tokens"),
    ((10.0, 0.02), (8.0, 0.03), "below", "pays only below 200 tokens"),  # crossing below the range: never
    ((30.0, 0.01), (10.0, 0.02), "below", "pays only below 2,000 tokens per sequence"),
    ((10.0, 0.02), (9.0, 0.02), "every", "pays at every measured context"),  # parallel, FP8 lower
    ((10.0, 0.02), (11.0, 0.02), "never", "never pays"),  # parallel, FP8 higher
])
def test_verdicts(bf16, fp8, verdict, phrase):
    _, cr = be.breakeven_context(bench_rows({"bf16": bf16, "fp8_e4m3": fp8}))
    row = cr.iloc[0]
    if phrase == "pays only below 200 tokens":  # the crossing (200) lies below the measured range
        assert row["verdict"] == "never" and "never pays" in row["answer"] and "outside it" in row["answer"]
        return
    assert row["verdict"] == verdict
    assert phrase in row["answer"]
    assert row["answer"].startswith("on NVIDIA H200, with triton, FP8 KV ")  # who and where, before the verdict


# ------------------------------------------------------------------------------- uncertainty
def test_noisy_intervals_cover_the_truth():
    """1 % timing noise, 200 draws: the 95 % interval of the crossing (delta method) covers the true one in
    about 95 % of them, and the standardized errors have unit spread (the standard error is right)."""
    bf16, fp8 = (10.0, 0.02), (30.0, 0.01)
    truth = (fp8[0] - bf16[0]) / (bf16[1] - fp8[1])
    covered, z, slopes_covered = [], [], []
    for seed in range(200):
        lines, cr = be.breakeven_context(bench_rows({"bf16": bf16, "fp8_e4m3": fp8}, rel_noise=0.01, seed=seed))
        row = cr.iloc[0]
        assert row["status"] == "ok", row["reason"]
        covered.append(row["crossing_lo"] <= truth <= row["crossing_hi"])
        z.append((row["crossing_tokens"] - truth) / row["crossing_se"])
        b = lines[lines["kv_dtype"] == "bf16"].iloc[0]
        slopes_covered.append(abs(b["slope_us_per_token"] - bf16[1]) <= 2.365 * b["slope_se"])  # t(7 dof)
    assert 0.9 <= np.mean(covered) <= 0.995
    assert 0.8 <= np.std(z) <= 1.25
    assert 0.9 <= np.mean(slopes_covered)


def test_nearly_parallel_lines_say_the_crossing_is_ill_determined():
    _, cr = be.breakeven_context(bench_rows({"bf16": (10.0, 0.020), "fp8_e4m3": (10.5, 0.01999)}, rel_noise=0.01, seed=1))
    row = cr.iloc[0]
    assert row["slope_gap_z"] < 2
    assert "ill-determined" in row["answer"]


# ------------------------------------------------------------------------------- refusals
NONLINEAR = {
    "quadratic": lambda c: 10 + 1e-6 * c * c,
    "step (a kernel switch at 4k)": lambda c: 10 + 0.01 * c + (60 if c >= 4096 else 0),
    "launch-bound then linear": lambda c: max(40.0, 0.01 * c),
    "square root": lambda c: 2 * math.sqrt(c),
}


@pytest.mark.parametrize("shape", list(NONLINEAR))
@pytest.mark.parametrize("relative", [True, False])
def test_nonlinear_lines_are_refused(shape, relative):
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": NONLINEAR[shape]})
    lines, cr = be.breakeven_context(rows, relative=relative, trim=False)
    bad = lines[lines["kv_dtype"] == "fp8_e4m3"].iloc[0]
    assert bad["status"] == "no fit"
    assert "R²" in bad["reason"] or "off the line" in bad["reason"]
    row = cr.iloc[0]
    assert row["status"] == "no fit" and math.isnan(row["crossing_tokens"]) and row["verdict"] == ""
    assert "no answer" in row["answer"] and "the FP8 line" in row["answer"]
    with pytest.raises(be.LineFitError):
        be.fit_line(CONTEXTS, [NONLINEAR[shape](c) for c in CONTEXTS], relative=relative)


@pytest.mark.parametrize("shape", ["quadratic", "square root"])
def test_trimming_never_rescues_a_curve(shape):
    """Leaving out short contexts cannot make a line of a curve: it stays refused with trimming on."""
    lines, cr = be.breakeven_context(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": NONLINEAR[shape]}))
    assert lines.set_index("kv_dtype").loc["fp8_e4m3", "status"] == "no fit"
    assert cr.iloc[0]["status"] == "no fit"


def test_a_launch_floor_is_left_out_and_said():
    """max(40, 0.01 c) against a line: the FP8 line holds from 4,096 tokens (the four shorter contexts sit on the
    floor); the pair's answer is read over 4,096-32,768 and says what the floor's contexts measured."""
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": NONLINEAR["launch-bound then linear"]})
    lines, cr = be.breakeven_context(rows)
    fp8 = lines.set_index("kv_dtype").loc["fp8_e4m3"]
    assert fp8["status"] == "ok" and fp8["tokens_min"] == 4096 and fp8["left_out"] == 4
    assert fp8["n_contexts"] == 5 and fp8["slope_us_per_token"] == pytest.approx(0.01, rel=1e-6)
    assert lines.set_index("kv_dtype").loc["bf16", "left_out"] == 0
    row = cr.iloc[0]
    assert row["status"] == "ok" and row["tokens_lo"] == 4096 and row["left_out"] == 4 and row["verdict"] == "every"
    assert "FP8 KV pays at every context where both lines hold (4,096-32,768 tokens per sequence" in row["answer"]
    # 16-bit 10 + 0.02 c against FP8's floor of 40 µs: slower up to 1,456 (39.1 µs), faster at 2,432 (58.6 µs)
    assert row["answer"].endswith("; below 4,096 tokens, off the lines, measured: FP8 faster from 2,432 tokens on "
                                  "(1.47x); slower at 512, 864, 1,456")
    pts = be.line_points(rows)
    fp8_pts = pts[pts["kv_dtype"] == "fp8_e4m3"]
    assert list(fp8_pts["in_fit"]) == [c >= 4096 for c in CONTEXTS]
    assert (fp8_pts.loc[~fp8_pts["in_fit"], "rel_residual"].abs() > 0.05).all()  # why they were left out
    assert be.line_points(rows, trim=False)["in_fit"].all()


def test_a_split_step_with_slower_short_contexts_is_fitted_past_it():
    """A split rule's step at 4,096 (shorter contexts slower than the long line): the line holds from 4,096 with
    the four shorter contexts left out, as a launch floor's would be."""
    step = lambda c: 10.0 + 0.001 * c if c < 4096 else 4.0 + 0.0004 * c  # noqa: E731
    fp8 = be.fit_lines(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": step})).set_index("kv_dtype").loc["fp8_e4m3"]
    assert fp8["status"] == "ok" and fp8["tokens_min"] == 4096 and fp8["left_out"] == 4


def test_short_contexts_faster_than_the_line_are_never_left_out():
    """Short contexts far *below* the line are no floor: trimming them away would hide a real effect, so the
    line stays refused."""
    fast_start = lambda c: 2.0 if c < 4096 else 10.0 + 0.01 * c  # noqa: E731
    lines, cr = be.breakeven_context(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": fast_start}))
    fp8 = lines.set_index("kv_dtype").loc["fp8_e4m3"]
    assert fp8["status"] == "no fit" and fp8["left_out"] == 0 and cr.iloc[0]["status"] == "no fit"


def test_trimming_keeps_at_least_five_contexts():
    """A floor covering six of nine contexts leaves too few on the line: refused, never fitted over three."""
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": lambda c: max(200.0, 0.01 * c)})
    fp8 = be.fit_lines(rows).set_index("kv_dtype").loc["fp8_e4m3"]
    assert fp8["status"] == "no fit" and fp8["left_out"] == 0 and fp8["tokens_min"] == 512


def _steps(c):  # a split rule's steps: the time drops where the program count changes, no line holds
    return 10.0 + 0.001 * c if c < 8192 else 4.0 + 0.0004 * c


@pytest.mark.parametrize("bf16, fp8, said", [
    (_steps, lambda c: _steps(c) * (1.05 if c < 864 else 0.8), "FP8 faster from 864 tokens on (1.25-1.25x); "
                                                                "slower at 512"),
    (_steps, lambda c: 0.9 * _steps(c), "FP8 faster at every measured context (512-32,768 tokens; 1.11-1.11x)"),
    (_steps, lambda c: 1.2 * _steps(c), "FP8 slower at every measured context"),
    (_steps, lambda c: _steps(c) * (0.9 if c < 4096 else 1.1),
     "FP8 faster at 512, 864, 1,456, 2,432 tokens only; slower at 4,096, 6,896, 11,584, 19,488, 32,768 (the longest, "
     "32,768: 0.91x)"),
    (_steps, lambda c: _steps(c) * (0.8 if c in (864, 4096) else 1.0),
     "FP8 faster at 864, 4,096 tokens only; level at 512, 1,456, 2,432, 6,896, 11,584, 19,488, 32,768"),
    (_steps, lambda c: _steps(c) * (1.0 if c < 4096 else 0.8), "FP8 faster from 4,096 tokens on (1.25-1.25x); level at "
                                                               "512, 864, 1,456, 2,432"),
    (_steps, lambda c: _steps(c) * 1.005, "FP8 level (within 1%) at every measured context"),
])
def test_a_pair_without_a_line_says_what_the_points_measured(bf16, fp8, said):
    """Lines refused (steps), the answer still reports the measured comparison, context by context; a speedup
    within 1 % of 1 is level, neither faster nor slower."""
    rows = bench_rows({"bf16": bf16, "fp8_e4m3": fp8})
    _, cr = be.breakeven_context(rows)
    row = cr.iloc[0]
    assert row["status"] == "no fit" and "no answer" in row["answer"]
    assert said in row["measured"] and row["answer"].endswith("measured, without a line: " + row["measured"])


def test_the_measured_start_and_best_speedup_of_a_pair_without_a_line():
    rows = bench_rows({"bf16": _steps, "fp8_e4m3": lambda c: _steps(c) * (1.05 if c < 864 else 0.8)})
    row = be.breakeven_context(rows)[1].iloc[0]
    assert row["measured_faster_from"] == 864 and row["measured_best_speedup"] == pytest.approx(1.25)
    rows = bench_rows({"bf16": _steps, "fp8_e4m3": lambda c: 1.2 * _steps(c)})
    row = be.breakeven_context(rows)[1].iloc[0]
    assert row["measured_faster_from"] == math.inf


@pytest.mark.parametrize("fp8, base, exc, match", [
    ([(512, float("nan"))], [(512, 1.0)], ValueError, r"fp8_points holds \(512.0, nan\); expected positive"),
    ([(512, 1.0)], [(512, -2.0)], ValueError, r"base_points holds \(512.0, -2.0\)"),
    ([(0, 1.0)], [(0, 1.0)], ValueError, "fp8_points holds"),
    (5, [(512, 1.0)], TypeError, "fp8_points must be \\(tokens, time_us\\) pairs"),
    ([(512, "x")], [(512, 1.0)], TypeError, "fp8_points must be"),
])
def test_measured_comparison_refuses_bad_points_by_name(fp8, base, exc, match):
    with pytest.raises(exc, match=match):
        measured.measured_comparison(fp8, base)


def test_measured_comparison_of_points_sharing_no_context_is_empty():
    assert measured.measured_comparison([(512, 1.0)], [(1024, 1.0)]) == ""


def test_a_pair_with_lines_has_no_measured_text():
    _, cr = be.breakeven_context(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}))
    assert cr.iloc[0]["status"] == "ok" and cr.iloc[0]["measured"] == "" and "measured" not in cr.iloc[0]["answer"]


@pytest.mark.parametrize("contexts", [[4096], [4096, 16384], [4096, 4096, 16384, 16384]])
def test_too_few_contexts_are_refused(contexts):
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}, contexts=contexts)
    lines, cr = be.breakeven_context(rows)
    assert (lines["status"] == "no fit").all()
    assert lines["reason"].str.contains("a line needs at least 3").all()
    assert cr.iloc[0]["status"] == "no fit"
    with pytest.raises(be.LineFitError, match="distinct context"):
        be.fit_line(contexts, [10.0] * len(contexts))


def test_flat_noisy_line_is_refused_by_r2():
    rows = bench_rows({"bf16": lambda c: 10.0, "fp8_e4m3": (30.0, 0.01)}, rel_noise=0.01, seed=2)
    lines = be.fit_lines(rows)
    assert lines.set_index("kv_dtype").loc["bf16", "status"] == "no fit"
    assert "R²" in lines.set_index("kv_dtype").loc["bf16", "reason"]


def test_windowed_rows_attend_the_window():
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}, window=1024)
    lines = be.fit_lines(rows)
    assert (lines["tokens_max"] == 1024).all()  # contexts beyond the window attend the window


def test_missing_baseline_is_said():
    rows = bench_rows({"fp8_e4m3": (30.0, 0.01)})
    row = be.crossings(be.fit_lines(rows)).iloc[0]
    assert row["status"] == "no fit" and "no bf16 line" in row["reason"]


def test_rows_that_did_not_run_are_left_out():
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)})
    extra = rows.iloc[:3].assign(status="unsupported", time_us=np.nan, backend="triton")
    lines = be.fit_lines(pd.concat([rows, extra], ignore_index=True))
    assert (lines["n_points"] == len(CONTEXTS)).all() and (lines["status"] == "ok").all()


def test_lines_are_kept_apart_by_batch_backend_and_mode():
    rows = pd.concat([bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}, batch=b, backend=bk)
                      for b in (1, 64) for bk in ("triton", "flashinfer")], ignore_index=True)
    lines, cr = be.breakeven_context(rows)
    assert len(lines) == 8 and len(cr) == 4
    assert sorted(cr["batch"]) == [1, 1, 64, 64]


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("drop", ["time_us", "context", "kv_dtype", "batch", "gpu"])
def test_missing_column_is_named(drop):
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}).drop(columns=drop)
    with pytest.raises(ValueError, match=f"lacks columns .*{drop}"):
        be.fit_lines(rows)


@pytest.mark.parametrize("bad", [None, [1, 2], {"time_us": [1.0]}, "rows.csv"])
def test_not_a_dataframe(bad):
    with pytest.raises(TypeError, match="DataFrame"):
        be.fit_lines(bad)


ROW_4 = "row 4 .*expected positive numbers"


COUNT_4 = "row 4 of rows that ran has {}; expected a positive whole number"


@pytest.mark.parametrize("column, value, pattern", [
    ("time_us", np.nan, ROW_4), ("time_us", -3.0, ROW_4), ("time_us", 0.0, ROW_4), ("context", 0, ROW_4),
    ("time_us", "fast", "column 'time_us' of df holds object values, not numbers"),  # as every reader names it
    ("num_q_heads", "x", "column 'num_q_heads' of df holds object values, not numbers"),
    # counts that became 0 or were truncated, windows that overflowed or read as none
    ("head_dim", np.nan, COUNT_4.format("head_dim=nan")), ("batch", 1.5, COUNT_4.format("batch=1.5")),
    ("window", np.inf, COUNT_4.format("window=inf")), ("window", "wide", COUNT_4.format("window='wide'")),
    ("window", 0, COUNT_4.format("window=0"))])
def test_bad_values_in_rows_that_ran(column, value, pattern):
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)})
    rows[column] = rows[column].astype(object) if column in rows.columns else None  # window: none recorded
    rows.loc[4, column] = value
    with pytest.raises(ValueError, match=pattern):
        be.fit_lines(rows)


@pytest.mark.parametrize("column, value, pattern", [
    # a blank key read "on , with triton"; a misspelt dtype passed for FP8 by its prefix
    ("gpu", np.nan, "row 4 of rows that ran has gpu=nan; expected a name"),
    ("backend", "", "row 4 of rows that ran has backend=''; expected a name"),
    ("kv_dtype", "fp8_bogus", "row 4 of rows that ran has kv_dtype='fp8_bogus'; expected a KV dtype or format among")])
def test_blank_or_unknown_names_in_rows_that_ran(column, value, pattern):
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)})
    rows[column] = rows[column].astype(object)
    rows.loc[4, column] = value
    with pytest.raises(ValueError, match=pattern):
        be.breakeven_answers(rows)


def test_only_fp8_dtypes_make_fp8_lines():
    """A format whose name starts "fp8" (a KV format, not an FP8 KV dtype) is no FP8 line to cross with 16-bit."""
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01), "fp8_e4m3_tensor": (30.0, 0.01)})
    assert list(be.crossings(be.fit_lines(rows))["kv_dtype"]) == ["fp8_e4m3"]
    lines = be.fit_lines(rows).replace({"kv_dtype": {"fp8_e4m3_tensor": "fp8_bogus"}})
    with pytest.raises(ValueError, match=r"crossings: lines has kv_dtype \['fp8_bogus'\]"):
        be.crossings(lines)


def test_answer_text_refuses_a_row_it_cannot_say():
    (row,) = [r for _, r in be.breakeven_context(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}))[1].iterrows()]
    assert row["verdict"] in be.VERDICTS
    with pytest.raises(ValueError, match=r"row\['verdict'\]='xx'; expected one of \('beyond'"):  # said "never pays"
        be.answer_text(dict(row, verdict="xx"))
    beyond = dict(row, verdict="beyond", crossing_tokens=math.nan)  # said "pays beyond  tokens ... ()"
    with pytest.raises(ValueError, match="row\\['crossing_tokens'\\]=nan with verdict 'beyond'; expected a finite"):
        be.answer_text(beyond)
    with pytest.raises(TypeError, match=r"row=None \(NoneType\); expected a row of crossings\(\)"):
        be.answer_text(None)


def test_answer_text_names_what_a_row_lacks():
    with pytest.raises(ValueError, match=r"row lacks \['gpu', 'backend'"):
        be.answer_text({})
    (row,) = [r for _, r in be.breakeven_context(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}))[1].iterrows()]
    with pytest.raises(ValueError, match=r"row lacks \['verdict'\]"):  # a Series row, as iterrows gives it
        be.answer_text(row.drop("verdict"))


def test_no_row_ran():
    rows = bench_rows({"bf16": (10.0, 0.02)}).assign(status="skipped")
    with pytest.raises(ValueError, match="none ran"):
        be.fit_lines(rows)


@pytest.mark.parametrize("kw, match", [(dict(min_tokens=10**6), "no row attends"),
                                       (dict(min_contexts=2), "min_contexts=2"),
                                       (dict(min_r2=1.5), "min_r2=1.5"),
                                       (dict(max_rel_residual=0), "max_rel_residual=0"),
                                       (dict(relative=1), "relative=1"), (dict(relative="yes"), "relative='yes'")])
def test_bad_options(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        be.fit_lines(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}), **kw)


@pytest.mark.parametrize("tokens, times, match", [([1, 2, 3], [1.0, 2.0], "tokens has 3 values but time_us has 2"),
                                                  ([1, 2, np.nan], [1.0, 2.0, 3.0], r"tokens\[2\]"),
                                                  ([1, 2, 3], [1.0, -2.0, 3.0], r"time_us\[1\]")])
def test_fit_line_bad_input(tokens, times, match):
    with pytest.raises(ValueError, match=match):
        be.fit_line(tokens, times)


def test_crossings_wants_fit_lines_table():
    with pytest.raises(TypeError, match="fit_lines"):
        be.crossings([1, 2])
    with pytest.raises(ValueError, match="lacks"):
        be.crossings(pd.DataFrame({"kv_dtype": ["bf16"]}))
    with pytest.raises(ValueError, match="no FP8 line"):
        be.crossings(be.fit_lines(bench_rows({"bf16": (10.0, 0.02)})))


# ------------------------------------------------------------------------------- the grid, saved runs
def test_grid_is_log_spaced_and_sweeps():
    from fp8kv.bench import sweep

    ctx = np.array(CONTEXTS)
    assert len(ctx) >= 8 and ctx[0] == 512 and ctx[-1] == 32768 and (ctx % 16 == 0).all()
    ratios = ctx[1:] / ctx[:-1]
    assert ratios.max() / ratios.min() < 1.02  # log-spaced (to a block's rounding)
    cases = sweep(**be.BREAKEVEN_GRID, arch="sm90", memory_budget_bytes=2**50)
    assert {c.backend for c in cases} == {"triton", "flashinfer"}
    assert {c.kv_dtype for c in cases} == {"bf16", "fp8_e4m3"}
    assert {c.batch for c in cases} == {1, 16, 64} and {c.context for c in cases} == set(CONTEXTS)


def test_saved_h200_target_run():
    """The saved H200 target run (contexts 4k/16k/32k, the three a line needs): every FP8 line gets an answer
    or a stated refusal; Triton's FP8 line is the flatter one at every batch that fits."""
    from fp8kv.results import read_table

    csv = SAVED / "20261202T150736Z.csv"
    if not csv.is_file():
        pytest.skip(f"{csv} is not in this checkout")
    lines, cr = be.breakeven_context(read_table(csv))
    assert len(cr) == (lines["kv_dtype"] != "bf16").sum()
    assert (cr["status"].isin(["ok", "no fit"])).all()
    assert (cr.loc[cr["status"] == "no fit", "reason"].str.len() > 0).all()
    ok = lines[(lines["status"] == "ok") & (lines["backend"] == "triton") & (lines["mode"] == "dequant")]
    slope = ok.set_index(["batch", "kv_dtype"])["slope_us_per_token"]
    for batch in (16, 64, 256):
        assert slope[(batch, "fp8_e4m3")] < slope[(batch, "bf16")]


def test_a_line_across_a_change_of_kernel_is_refused_and_says_so():
    """The H200's case: the decode takes the Triton kernel at short contexts and the Gluon kernel from 4,096 tokens on,
    a step in FP8's latency no single line follows. The pair is refused (never fitted across the step), its crossing
    row names both kernels, its answer says why, and notebook 09's break-even text still answers with the measured
    points, then with each kernel's own line (its first-screen headline with the measured points alone)."""
    from fp8kv.analysis import deciding as dc
    from fp8kv.analysis.breakeven_text import speed_details

    step = lambda c: 10.0 + 0.02 * c if c < 4096 else 45.0 + 0.009 * c  # noqa: E731
    rows = bench_rows({"bf16": (10.0, 0.03), "fp8_e4m3": step}, batch=64)
    fp8 = rows["kv_dtype"] == "fp8_e4m3"
    rows["kernel"] = "triton"
    rows.loc[fp8 & (rows["context"] >= 4096), "kernel"] = "gluon"
    lines, cr = be.breakeven_context(rows)
    (r,) = cr.to_dict("records")
    assert r["status"] == "no fit" and r["kernels"] == "gluon,triton"
    assert "its rows ran the gluon and triton kernels (the decode changes kernel)" in r["answer"]
    assert list(lines.loc[lines["kv_dtype"] == "bf16", "kernels"]) == ["triton"]
    # Each kernel gets its own line over the contexts it ran, crossed with the 16-bit line over the same contexts:
    # 10 + 0.02c against 10 + 0.03c (1.41x at 2,432), 45 + 0.009c against it (crossing at 1,667, 2.92x at 32,768).
    # The 16-bit line held: each kernel is crossed with it (no refit), over the kernel's own contexts.
    per_kernel = ("triton kernel, 512-2,432 tokens: FP8 pays at every context (1.41x at 2,432); gluon kernel, "
                  "4,096-32,768 tokens: FP8 pays at every context (2.92x at 32,768)")
    assert r["by_kernel"] == per_kernel and r["answer"].endswith("; fitted per kernel: " + per_kernel)
    assert r["kernel_verdicts"] == "triton:every,gluon:every"
    # rows that record no page size (block_size 0 once read) split by kernel alike
    for unrecorded in (rows.drop(columns="block_size"), rows.assign(block_size=np.nan)):
        assert be.breakeven_context(unrecorded)[1]["by_kernel"].tolist() == [per_kernel]
    text = speed_details("H200", cr)
    assert text == ("On H200, at batch 64 with triton, dequant mode, measured point by point (no line holds across the "
                    "decode's change of kernel (gluon and triton)): " + r["measured"] + "; fitted per kernel: "
                    + per_kernel + ".")
    assert dc.headline("H200", crossings=cr) == ("On H200, FP8 KV decodes faster than 16-bit KV: batch 64, fp8kv from "
                                                 "512 tokens, up to 2.92x.")
    assert r["measured"].startswith("FP8 faster at every measured context")
    # Notebook 09's points and figures: each kernel's points against its own line (exact here), one fitted trace
    # per kernel; the 16-bit line, one kernel, stays whole.
    from fp8kv.viz.deciding_figures import breakeven_lines

    pts = be.line_points(rows)
    own = pts[pts["kv_dtype"] == "fp8_e4m3"]
    assert set(own["kernel"]) == {"triton", "gluon"} and own["rel_residual"].abs().max() < 1e-9
    assert set(pts.loc[pts["kv_dtype"] == "bf16", "kernel"]) == {""}
    fits = [t.name for t in breakeven_lines(pts).data if t.mode == "lines"]
    assert fits == ["bf16 dequant (fit)", "fp8_e4m3 dequant, triton kernel (fit)",
                    "fp8_e4m3 dequant, gluon kernel (fit)"], fits
    # A kernel whose contexts hold no line says why.
    bent = rows.copy()
    bent.loc[fp8 & (bent["context"] == 864), "time_us"] *= 1.3
    (b,) = be.breakeven_context(bent)[1].to_dict("records")
    assert b["by_kernel"].startswith("triton kernel, 512-2,432 tokens: no line holds (the FP8 line: R² 0.92")
    assert b["kernel_verdicts"] == "triton:no fit,gluon:every"
    # A refused 16-bit line is refitted over each kernel's contexts, and the clause says so.
    bent = rows.copy()
    bent.loc[(bent["kv_dtype"] == "bf16") & (bent["context"] == 4096), "time_us"] *= 1.3
    (b,) = be.breakeven_context(bent)[1].to_dict("records")
    assert b["by_kernel"].startswith("triton kernel, 512-2,432 tokens (bf16 line refitted over them): FP8 pays at "
                                     "every context (1.41x at 2,432); gluon kernel, 4,096-32,768 tokens (bf16 line "
                                     "refitted over them): no line holds (the bf16 line: "), b["by_kernel"]
    # No per-kernel lines where the kernels cannot split the line: one kernel, a row naming none, kernels interleaving.
    for kernels in (["triton"] * len(rows), rows["kernel"].where(rows["context"] != 864, None),
                    ["triton" if c in (512, 1456, 4096, 11584) else "gluon" for c in rows["context"]]):
        (b,) = be.breakeven_context(rows.assign(kernel=kernels))[1].to_dict("records")
        assert b["status"] == "no fit" and b["by_kernel"] == "" and b["kernel_verdicts"] == ""


def test_kernel_spans():
    assert be.kernel_spans(["a", "a", "b"], [1, 2, 3]) == [("a", 1.0, 2.0), ("b", 3.0, 3.0)]
    assert be.kernel_spans(["b", "a", "a"], [9, 2, 5]) == [("a", 2.0, 5.0), ("b", 9.0, 9.0)]  # ordered by context
    for kernels in (["a", "a"], ["a", None], ["a", float("nan")], ["a", "b", "a"]):
        assert be.kernel_spans(kernels, [1, 2, 3][:len(kernels)]) is None


@pytest.mark.parametrize("kernels, tokens, exc, match", [
    (["a", "a", "b"], [1, 2], ValueError, r"tokens has shape \(2,\).*expected 3 finite numbers"),
    (["a", "b"], 5, ValueError, r"tokens has shape \(\)"),
    (["a", "b", "b"], [1, float("nan"), 3], ValueError, "1 non-finite"),
    (None, None, TypeError, "kernels must be a sequence"),
    ("ab", [1, 2], TypeError, "kernels must be a sequence"),
    (["a", "b"], ["x", "y"], TypeError, "tokens must be a sequence of numbers")])
def test_kernel_spans_refuses_bad_input(kernels, tokens, exc, match):
    with pytest.raises(exc, match=match):
        be.kernel_spans(kernels, tokens)


def test_line_statistics_refuse_bad_input():
    from fp8kv.analysis import linefit

    assert linefit.t975(1) == 12.706 and linefit.t975(60) == 2.0 and 1.96 < linefit.t975(120) < 2.0
    for bad in (0, -3, 1.5, "2", True):
        with pytest.raises((ValueError, TypeError), match="dof"):
            linefit.t975(bad)
    for tokens, times, match in (([1, 2], [1, 2], "three points or more over two contexts"),
                                 ([5, 5, 5], [1, 2, 3], "over 1 context"),
                                 ([1, 2, 3], [1, 2], "tokens has 3 values but time_us has 2"),
                                 ([1, 2, 3], [1, 0, 2], r"time_us\[1\]=0\.0"),
                                 ([1, float("nan"), 3], [1, 2, 3], r"tokens\[1\]=nan")):
        with pytest.raises(ValueError, match=match):
            linefit.least_squares(tokens, times)
    fit = linefit.least_squares([1, 2, 3], [2.0, 3.0, 4.0])
    assert fit.slope == pytest.approx(1.0) and fit.intercept == pytest.approx(1.0) and fit.dof == 1
    for tokens, times, exc, match in ((["1", "2", "3"], [1, 2, 3], TypeError, "tokens must be a 1-D sequence of real"),
                                      ([True, True, 2], [1, 2, 3], TypeError, "tokens must be"),
                                      ({1: 2}, [1], TypeError, "tokens must be"),
                                      ([1, 2, 3], [[1, 2, 3]], ValueError, r"time_us has shape \(1, 3\)"),
                                      ([1e-300, 2e-300, 3e-300], [1, 2, 3.1], ValueError, "beyond float64's range")):
        with pytest.raises(exc, match=match):
            linefit.least_squares(tokens, times)


@pytest.mark.parametrize("unit", [1e-160, 1e-6, 1.0, 1e6, 1e120])
def test_a_line_is_the_same_in_any_unit_of_time(unit):
    """Fitted in normalized units: times of 1e-160 gave NaN weights (1 / y² overflows), and NaN passed as a line."""
    from fp8kv.analysis import linefit

    tokens, times = [512, 1024, 2048, 4096], [10.0, 20.5, 40.0, 81.0]
    base = linefit.fit_line(tokens, times)
    fit = linefit.fit_line(tokens, [t * unit for t in times])
    assert fit.slope == pytest.approx(base.slope * unit, rel=1e-9)
    assert fit.intercept == pytest.approx(base.intercept * unit, rel=1e-9, abs=1e-9 * unit)
    assert fit.slope_se == pytest.approx(base.slope_se * unit, rel=1e-9)
    assert fit.r2 == pytest.approx(base.r2, rel=1e-12)


@pytest.mark.parametrize("col, value", [("dof", math.inf), ("dof", 2.5), ("dof", math.nan), ("left_out", math.inf),
                                        ("left_out", 0.5)])
def test_crossings_name_a_count_that_is_no_whole_number(col, value):
    """int() of it raised OverflowError (inf) or "cannot convert float NaN" before, or rounded a fraction."""
    lines = be.fit_lines(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}))
    assert (lines["status"] == "ok").all()
    lines[col] = lines[col].astype(float)
    lines.loc[lines.index[-1], col] = value
    with pytest.raises(ValueError, match=re.escape(f"crossings: column {col!r} of df holds {value!r} in row "
                                                   f"{lines.index[-1]} (a row that ran); expected a finite whole "
                                                   "number there; expected fit_lines()' table")):
        be.crossings(lines)


@pytest.mark.parametrize("drop", ["tokens_max", "dof", "slope_se"])
def test_crossings_name_a_missing_fit_column(drop):
    """A KeyError from inside the crossing's arithmetic before."""
    lines = be.fit_lines(bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)})).drop(columns=drop)
    with pytest.raises(ValueError, match=re.escape(f"crossings: df lacks columns ['{drop}']; expected fit_lines()' table")):
        be.crossings(lines)


# ------------------------------------------------------------------------------------ python -m fp8kv.bench --preset breakeven
def _bench_rows(**extra):
    """What fp8kv.bench.run returns for a breakeven run (the columns its summary reads), on exact lines."""
    rows = bench_rows({"bf16": (10.0, 0.02), "fp8_e4m3": (30.0, 0.01)}, batch=16, **extra)
    rows = rows.assign(label=[f"triton {k} dequant" for k in rows["kv_dtype"]], reason="", num_splits=1, gbps=1.0,
                       pct_copy_bw=1.0, rel_err=0.0, check_passed=True, copy_gbps=100.0, timing="cuda-graph",
                       gpu_slug="nvidia-h200", layout="NHD", q_dtype="bf16", timestamp="20261206T095853Z")
    rows.attrs["bench"] = {"interrupted": False}
    return rows


@pytest.mark.parametrize("preset, said", [("breakeven", True), ("smoke", False)])
def test_the_breakeven_preset_prints_what_its_rows_answer(monkeypatch, capsys, tmp_path, preset, said):
    """After a --preset breakeven run the CLI prints breakeven_answers of its rows (it only saved them before); other
    presets print their summary alone."""
    from fp8kv import bench

    rows = _bench_rows()
    monkeypatch.setattr(bench.cli, "run", lambda cases, **kw: rows)
    assert bench.main(["--preset", preset, "--out", str(tmp_path), "--quiet", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    answer = be.breakeven_answers(rows)[0]
    assert ("break-even (fp8kv.analysis.breakeven_answers):\n  " + answer in out) is said
    assert "pays beyond 2,000 tokens per sequence at batch 16" in answer and "wrote " in out


def test_rows_the_breakeven_analysis_refuses_are_still_saved_with_the_reason(monkeypatch, capsys, tmp_path):
    from fp8kv import bench

    rows = _bench_rows(window=0)  # a window of 0 tokens: breakeven_context refuses the rows
    monkeypatch.setattr(bench.cli, "run", lambda cases, **kw: rows)
    assert bench.main(["--preset", "breakeven", "--out", str(tmp_path), "--quiet", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "break-even: no answer from these rows: breakeven: row 0 of rows that ran has window=" in out
    assert "wrote " in out and len(list(tmp_path.rglob("*.csv"))) == 1
