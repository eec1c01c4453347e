"""The multi-token benchmark (fp8kv.bench.attend) and its presets on the command line: bytes and FLOPs by hand,
the grid's refusals, a tiny interpreted run checked against the oracle and saved through the bench's results
path, and the CLI's options (dry runs of the presets, --q-lens / --chunks, contexts of 0)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from fp8kv.bench import main
from fp8kv.bench.attend import (
    ATTEND_COLUMNS,
    ATTEND_PRESETS,
    AttendCase,
    attend_bytes,
    attend_flops,
    attend_footprint,
    attend_run,
    attend_summary,
    attend_sweep,
)
from fp8kv.capability import interpreter_on

ON_GPU = torch.cuda.is_available()


# ----------------------------------------------------------------------------------- bytes and FLOPs
def test_bytes_count_every_token_once_and_the_query_and_output():
    c = AttendCase(3, 100, 4, 32, 8, 128, kv_dtype="fp8_e4m3", q_dtype="bf16")
    by = attend_bytes(c)
    assert by["kv"] == 3 * 104 * 8 * 128 * 2 * 1  # K and V of the cached and the new tokens, one byte each
    assert by["scales"] == 2 * 4  # one fp32 k and v scale
    assert by["q"] == by["out"] == 3 * 4 * 32 * 128 * 2
    assert by["total"] == by["kv"] + by["scales"] + by["q"] + by["out"]
    bf16 = attend_bytes(AttendCase(3, 100, 4, 32, 8, 128, kv_dtype="bf16", q_dtype="bf16"))
    assert bf16["kv"] == 2 * by["kv"] and bf16["scales"] == 0
    ref = attend_bytes(AttendCase(3, 100, 4, 32, 8, 128, backend="reference", q_dtype="bf16"))
    assert ref["out"] == 2 * ref["q"]  # the oracle answers in fp32
    out32 = attend_bytes(AttendCase(3, 100, 4, 32, 8, 128, q_dtype="bf16", options={"out_dtype": torch.float32}))
    assert out32["out"] == 2 * out32["q"]


@pytest.mark.parametrize("context,q_len", [(0, 1), (0, 5), (10, 1), (4096, 8), (32768, 8192)])
def test_flops_count_the_keys_each_row_attends(context, q_len):
    c = AttendCase(2, context, q_len, 32, 8, 128)
    keys = sum(context + j + 1 for j in range(q_len))  # query j attends the cached keys and new ones up to itself
    assert attend_flops(c) == 4 * 32 * 128 * 2 * keys


def test_the_footprint_grows_with_the_cache_and_the_rows():
    small = attend_footprint(AttendCase(4, 4096, 4))
    assert attend_footprint(AttendCase(8, 4096, 4)) > small and attend_footprint(AttendCase(4, 4096, 512)) > small
    assert small > 2 * 4 * 4100 * 8 * 128 * 2  # the pages at least


# ---------------------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(context=-1), ValueError, "AttendCase.context"),
    (dict(q_len=0), ValueError, "AttendCase.q_len"),
    (dict(batch=0), ValueError, "AttendCase.batch"),
    (dict(num_q_heads=6), ValueError, "not a multiple of num_kv_heads=8"),
    (dict(backend="cuda"), ValueError, "AttendCase.backend"),
    (dict(options={"heads_per_program": 4}), ValueError, "the triton backend takes"),
    (dict(options={"num_splits": 2}, backend="flashinfer"), ValueError, "the others none"),
    (dict(options=[("num_splits", 2)]), TypeError, "AttendCase.options must be a dict"),
])
def test_a_case_refuses_bad_fields_by_name(kwargs, exc, pattern):
    fields = {**dict(batch=2, context=64, q_len=2, num_q_heads=32, num_kv_heads=8, head_dim=128), **kwargs}
    with pytest.raises(exc, match=pattern):
        AttendCase(**fields)


def test_the_sweep_marks_what_cannot_run_and_what_does_not_fit():
    cases = attend_sweep([2], [0, 40], [1, 3], shapes=[(4, 2, 64)], kv_dtypes=["fp16", "fp8_e4m3"],
                         modes=["dequant", "fp8"], backends=["triton", "flashinfer"], device="cpu")
    assert not any(c.mode == "fp8" and c.kv_dtype == "fp16" for c in cases)  # not a combination
    assert len(cases) == 2 * 2 * (1 + 2) * 2
    fi = [c for c in cases if c.backend == "flashinfer"]
    assert fi and all(c.status == "unsupported" and "GPU" in c.reason for c in fi)
    if not ON_GPU and interpreter_on():
        assert all(c.status == "ready" for c in cases if c.backend == "triton")
    tight = attend_sweep([2], [40], [3], shapes=[(4, 2, 64)], kv_dtypes=["fp16"], backends=["triton"],
                         memory_budget_bytes=1000, device="cpu")
    assert tight[0].status in ("skipped", "unsupported")
    if tight[0].status == "skipped":
        assert tight[0].reason.startswith("does not fit")
    with pytest.raises(ValueError, match="shapes entry"):
        attend_sweep([2], [40], [3], shapes=[(4, 2)], device="cpu")
    with pytest.raises(ValueError, match="q_lens is empty"):
        attend_sweep([2], [40], [], device="cpu")
    with pytest.raises(ValueError, match="kv_dtypes='nvfp4'; expected one of"):  # not AttendCase.kv_dtype
        attend_sweep([2], [40], [3], kv_dtypes=["fp16", "nvfp4"], device="cpu")


# ------------------------------------------------------------------------------- a run, interpreted
needs_interpreter = pytest.mark.skipif(ON_GPU or not interpreter_on(),
                                       reason="the tiny CPU run needs the Triton interpreter (TRITON_INTERPRET=1)")


@needs_interpreter
def test_a_tiny_run_is_checked_against_the_oracle_and_timed():
    cases = attend_sweep([3], [0, 37], [1, 4], shapes=[(4, 2, 64)], kv_dtypes=["fp16", "fp8_e4m3"],
                         backends=["triton", "reference"], device="cpu",
                         triton_options=[{}, {"num_splits": 2, "block_n": 16}])
    df = attend_run(cases, progress=False, device="cpu", copy_bandwidth=10.0, cpu_reps=1, check_seqs=2)
    assert list(df.columns) == ATTEND_COLUMNS and len(df) == len(cases)
    assert (df.status == "ok").all(), df[df.status != "ok"].reason.tolist()
    assert df.check_passed.all() and (df.rel_err <= df.tol).all()
    assert (df.op == "attend").all() and set(df.q_len) == {1, 4} and set(df.context) == {0, 37}
    tri = df[(df.backend == "triton") & (df.variant == "")]
    # one new token per sequence runs the decode's plan (its kernel named, block_m its heads per program), several the
    # attend kernel (on a GPU the Gluon kernel's rows where they run: tests/test_attend_rows.py)
    assert set(tri[tri.q_len == 1].kernel) == {"decode-triton"} and (tri[tri.q_len == 1].block_m == 2).all()
    assert (tri[tri.q_len == 4].kernel == "triton-attend").all() and tri[tri.q_len == 4].block_m.notna().all()
    assert (df[df.variant != ""].kernel == "triton-attend").all()  # a launch option of its own: the attend kernel
    # two splits asked for: realised in whole 16-key tiles, so a row of 1 key keeps one, 38 keys take two
    assert (df[(df.variant != "") & (df.context == 37)].num_splits == 2).all()
    assert (df[(df.variant != "") & (df.context == 0) & (df.q_len == 1)].num_splits == 1).all()
    assert ((df.gbps / (df.bytes / df.time_us / 1e3) - 1).abs() < 1e-12).all()
    assert ((df.tflops / (df.flops / df.time_us / 1e6) - 1).abs() < 1e-12).all()
    assert ((df.pct_copy_bw / (100 * df.gbps / 10.0) - 1).abs() < 1e-12).all()
    assert df.math_peak_tflops.isna().all() and df.pct_math_peak.isna().all()  # a CPU has no tensor-core peak
    text = attend_summary(df)
    assert "TFLOP/s" in text and "q_len" in text and "%math" in text and "not known for this device" in text


@needs_interpreter
def test_each_row_carries_the_math_peak_of_its_modes_dot(monkeypatch):
    """On a GPU the table knows (its name faked here), dequant rows are measured against the 16-bit dot's peak, fp8
    rows against the FP8 dot's; the fp32 reference against neither."""
    from fp8kv import device

    real = device.describe_device
    monkeypatch.setattr(device, "describe_device", lambda dev=None: {**real(dev), "name": "NVIDIA H100 80GB HBM3"})
    cases = attend_sweep([2], [20], [3], shapes=[(4, 2, 64)], kv_dtypes=["fp16", "fp8_e4m3"],
                         modes=["dequant", "fp8"], backends=["triton", "reference"], device="cpu")
    df = attend_run(cases, progress=False, device="cpu", copy_bandwidth=False, cpu_reps=1)
    ran = df[df.status == "ok"]  # all but the reference in fp8 mode, which it has not
    assert len(ran) == 5 and ran.check_passed.all(), df[df.status != "ok"].reason.tolist()
    tri, ref = ran[ran.backend == "triton"], ran[ran.backend == "reference"]
    assert set(zip(tri["kv_dtype"], tri["mode"], strict=True)) == {("fp16", "dequant"), ("fp8_e4m3", "dequant"),
                                                                   ("fp8_e4m3", "fp8")}
    assert (tri.math_peak_tflops == tri["mode"].map({"dequant": 989.4, "fp8": 1978.9})).all()
    assert ((tri.pct_math_peak / (100 * tri.tflops / tri.math_peak_tflops) - 1).abs() < 1e-12).all()
    assert len(ref) and ref.math_peak_tflops.isna().all() and ref.pct_math_peak.isna().all()
    assert "dequant: 989.4 TFLOP/s, fp8: 1978.9 TFLOP/s" in attend_summary(df)


@needs_interpreter
def test_a_failed_check_is_said_by_the_row(monkeypatch):
    import fp8kv.bench.attend as attend_bench

    monkeypatch.setattr(attend_bench, "output_tolerance", lambda *a, **k: 0.0)  # no answer is that exact
    cases = attend_sweep([2], [20], [3], shapes=[(4, 2, 64)], kv_dtypes=["fp8_e4m3"], backends=["triton"],
                         device="cpu")
    df = attend_run(cases, progress=False, device="cpu", copy_bandwidth=False, cpu_reps=1)
    assert df.status.tolist() == ["ok"] and df.check_passed.tolist() == [False]


@pytest.mark.parametrize("value", [1, "yes", None])
def test_run_refuses_a_keep_partial_that_is_not_a_bool(value):
    with pytest.raises(TypeError, match=rf"keep_partial={value!r} \({type(value).__name__}\); expected True or False"):
        attend_run([], copy_bandwidth=False, device="cpu", keep_partial=value)


def test_the_handlers_are_taken_back_after_each_case_and_its_first_call(monkeypatch):
    """A case's first call compiles (and LLVM inside Triton may take the stop signals then): the run takes
    them back right after it, before the timing, and again after the case."""
    import fp8kv.bench.attend as attend_bench

    taken_back = []
    monkeypatch.setattr(attend_bench, "reclaim_stop_signals", lambda: taken_back.append(1))
    cases = attend_sweep([1, 2], [20], [3], shapes=[(4, 2, 64)], kv_dtypes=["fp8_e4m3"], backends=["reference"],
                         device="cpu")
    df = attend_run(cases, progress=False, device="cpu", copy_bandwidth=False, cpu_reps=1)
    assert (df.status == "ok").all() and len(taken_back) == 2 * len(df) == 4


# ---------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("preset", sorted(ATTEND_PRESETS))
def test_each_attend_preset_lists_its_cases(preset, capsys):
    assert main(["--preset", preset, "--dry-run", "--device", "cpu", "--interpret"]
                if interpreter_on() else ["--preset", preset, "--dry-run", "--device", "cpu"]) in (0, 2)
    out = capsys.readouterr().out
    grid = ATTEND_PRESETS[preset]
    for n in grid["q_lens"]:
        assert f"q_len={n} " in out
    assert "cases would run" in out or "none of the" in out


@needs_interpreter
@pytest.mark.parametrize("preset,counts", [("spec-verify", ["--q-lens", "1", "3"]),
                                           ("chunked-prefill", ["--chunks", "20"])])
def test_a_preset_runs_interpreted_and_saves_its_rows(preset, counts, tmp_path, capsys):
    code = main(["--preset", preset, "--interpret", "--batches", "2", "--contexts", "0", "40", *counts, "--heads",
                 "4:2", "--head-dims", "64", "--backends", "triton", "--out", str(tmp_path), "--quiet"])
    assert code == 0
    (csv,) = tmp_path.glob("*/*.csv")
    df = pd.read_csv(csv)
    ran = df[df.status == "ok"]
    repeat = (df.variant == "gluon=False") & (df.kv_dtype == "fp16")  # spec-verify's gluon=False over 16-bit pages
    assert list(df.columns) == ATTEND_COLUMNS and ran.check_passed.all() and len(ran) == int((~repeat).sum())
    assert (df[repeat].status == "skipped").all() and (preset == "spec-verify") == bool(repeat.any())
    assert set(df.context) == {0, 40} and set(ran.kv_dtype) == {"fp16", "fp8_e4m3"}  # fp16 on CPU, not bf16
    assert "TFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv,pattern", [
    (["--preset", "target", "--q-lens", "2"], "is a decode grid"),
    (["--q-lens", "2", "--chunks", "8", "--batches", "2", "--contexts", "8"], "not allowed with argument"),
    (["--q-lens", "0", "--batches", "2", "--contexts", "8"], "--q-lens"),
    (["--q-lens", "2", "--batches", "2", "--contexts", "-1"], "--contexts"),
    (["--preset", "smoke", "--contexts", "0"], "--contexts"),  # a decode reads at least one token
    (["--preset", "spec-verify", "--tensor-cores", "on"], "prefill wrapper"),
    (["--preset", "spec-verify", "--heads", "4:2"], "both --heads and --head-dims"),
    (["--q-lens", "2"], "give --preset, or --batches and --contexts"),
    (["--preset", "spec-verify", "--triton-opt", "heads_per_program=16"], "heads_per_program"),  # a decode option
    # by the flag, not by the case (AttendCase.kv_dtype) the grid would have made
    (["--q-lens", "2", "--batches", "2", "--contexts", "8", "--kv-dtypes", "fp16", "int4_token_head"],
     "--kv-dtypes int4_token_head: the multi-token attention (--q-lens, --chunks) reads bf16, fp16, fp8_e4m3, "
     "fp8_e5m2 pages"),
])
def test_bad_attend_options_are_refused_by_name(argv, pattern, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--dry-run", "--device", "cpu"])
    assert e.value.code == 2
    assert pattern in capsys.readouterr().err


def test_a_convert_variant_in_fp8_mode_is_skipped_with_the_reason():
    """fp8 mode converts no FP8 tile, so a convert variant there would time the default launch again."""
    cases = attend_sweep([2], [40], [2], shapes=[(4, 2, 64)], kv_dtypes=["fp8_e4m3"], modes=["dequant", "fp8"],
                         backends=["triton"], device="cpu", arch="sm90", triton_options=[{}, {"convert": "cast"}])
    by = {(c.mode, c.options.get("convert")): c for c in cases}
    assert by[("fp8", "cast")].status == "skipped" and "convert does not apply" in by[("fp8", "cast")].reason
    assert {by[k].status for k in (("dequant", None), ("dequant", "cast"), ("fp8", None))} == {"ready"}
    # so would one over 16-bit pages, which the attend refuses (nothing to convert)
    fp16 = attend_sweep([2], [40], [2], shapes=[(4, 2, 64)], kv_dtypes=["fp16"], backends=["triton"], device="cpu",
                        arch="sm90", triton_options=[{}, {"convert": "cast"}])
    assert [(c.status, c.reason) for c in fp16][1] == ("skipped", "convert does not apply: fp16 pages are read as "
                                                                  "they are")
    assert fp16[0].status == "ready"


def test_gluon_false_where_the_gluon_kernel_cannot_read_the_pages_is_skipped_with_the_reason():
    """The Gluon kernel reads FP8 pages with one scale per tensor or per token and head only, so over 16-bit pages or
    per-head scales gluon=False would time the default again."""
    cases = attend_sweep([2], [40], [2], shapes=[(4, 2, 64)], kv_dtypes=["fp16", "fp8_e4m3"], backends=["triton"],
                         device="cpu", arch="sm90", triton_options=[{}, {"gluon": False}],
                         granularities=["tensor", "token_head", "head"])
    by = {(c.kv_dtype, c.granularity, c.options.get("gluon")): c for c in cases}
    for skipped in (("fp16", "tensor", False), ("fp8_e4m3", "head", False)):
        assert by[skipped].status == "skipped" and "the Gluon kernel reads FP8 pages with" in by[skipped].reason
    assert {by[k].status for k in (("fp16", "tensor", None), ("fp8_e4m3", "tensor", None), ("fp8_e4m3", "tensor", False),
                                   ("fp8_e4m3", "token_head", False), ("fp8_e4m3", "head", None))} == {"ready"}
