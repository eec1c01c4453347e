"""The bench's rows of the quantized KV formats: cases and their grid (what runs, what is refused and why), bytes
moved from kv_footprint, every row checked against quantized_reference before it is timed (and a wrong kernel
caught), the formats presets and --kv-dtypes on the CLI, under the Triton interpreter on CPU."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from fp8kv import bench
from fp8kv import kv_formats as kvf
from fp8kv.bench import Case, bytes_moved, run, sweep
from fp8kv.bench.cli import PRESETS, build_parser, preset_grid
from fp8kv.bench.formats import QUANT_KV_DTYPES, format_bytes, quantized_cache
from fp8kv.ops.quant_decode import QUANT_DECODE_FORMATS

SMALL = dict(batches=[2], contexts=[40], shapes=[(4, 2, 64)], block_sizes=[16], modes=["dequant"],
             granularities=["tensor"], memory_budget_bytes=2**30, device="cpu")


def test_the_bench_times_every_format_the_kernel_reads():
    assert set(QUANT_KV_DTYPES) == set(QUANT_DECODE_FORMATS) == {"int8_token_head", "int4_token_head", "nvfp4",
                                                                 "mxfp4"}


@pytest.mark.parametrize("fmt", QUANT_KV_DTYPES)
@pytest.mark.parametrize("hkv,d,ctx,batch,window", [(8, 128, 4096, 3, None), (1, 64, 77, 2, None),
                                                     (2, 32, 100, 1, None)])
def test_bytes_moved_are_kv_footprints(fmt, hkv, d, ctx, batch, window):
    c = Case(batch, ctx, 2 * hkv, hkv, d, kv_dtype=fmt)
    fp = kvf.kv_footprint(fmt, num_kv_heads=hkv, head_dim=d)
    by = bytes_moved(c)
    tokens = batch * ctx
    assert by["kv"] == fp.codes * tokens
    assert by["scales"] == fp.per_token_scales * tokens + fp.fixed
    assert by["kv"] + by["scales"] == fp.nbytes(tokens)
    assert format_bytes(fmt, tokens, hkv, d) == (by["kv"], by["scales"])


def test_the_4bit_formats_move_about_a_quarter_of_bf16():
    bf16, fp8 = bytes_moved(Case(16, 4096, kv_dtype="bf16")), bytes_moved(Case(16, 4096, kv_dtype="fp8_e4m3"))
    for fmt, lo, hi in (("int8_token_head", 0.5, 0.52), ("int4_token_head", 0.25, 0.27), ("nvfp4", 0.28, 0.29),
                        ("mxfp4", 0.26, 0.27)):
        by = bytes_moved(Case(16, 4096, kv_dtype=fmt))
        assert lo < (by["kv"] + by["scales"]) / bf16["kv"] < hi, fmt
    assert fp8["kv"] * 2 == bf16["kv"]


@pytest.mark.parametrize("bad,match", [
    (dict(kv_dtype="nvfp4", mode="fp8"), r"Case.mode='fp8' with kv_dtype='nvfp4': .*runs in dequant mode only"),
    (dict(kv_dtype="kivi4_g32"), r"Case.kv_dtype='kivi4_g32'; expected one of"),
    (dict(kv_dtype="e4m3_b16"), r"Case.kv_dtype='e4m3_b16'; expected one of"),
])
def test_cases_a_format_cannot_make_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        Case(1, 16, 4, 2, 64, **bad)


def test_the_grid_marks_what_does_not_run_and_why():
    cases = sweep(**{**SMALL, "kv_dtypes": ["nvfp4", "int8_token_head"], "modes": ["dequant", "fp8"],
                     "backends": ["triton", "flashinfer", "vllm", "reference"], "windows": [None, 8]},
                  arch="sm90")
    assert {c.mode for c in cases} == {"dequant"}  # no fp8 mode for a quantized format
    by = {(c.kv_dtype, c.backend, c.window): c for c in cases}
    assert by[("nvfp4", "triton", None)].status == "ready" and by[("int8_token_head", "reference", None)].status == "ready"
    assert "sm100" in by[("nvfp4", "flashinfer", None)].reason
    vllm = by[("int8_token_head", "vllm", None)]
    assert vllm.status == "unsupported" and "does not pass int8_token_head pages" in vllm.reason
    assert by[("nvfp4", "triton", 8)].status == "unsupported" and "window" in by[("nvfp4", "triton", 8)].reason
    huge = sweep(**{**SMALL, "kv_dtypes": ["mxfp4"], "batches": [64], "contexts": [32768], "backends": ["triton"],
                    "memory_budget_bytes": 2**20}, arch="sm90")
    assert huge[0].status == "skipped" and "does not fit" in huge[0].reason


@pytest.mark.parametrize("fmt", QUANT_KV_DTYPES)
def test_the_cache_holds_n01_tokens_in_the_format(fmt):
    c = Case(2, 40, 4, 2, 64, kv_dtype=fmt, block_size=16, seed=3)
    cache = quantized_cache(c, torch.device("cpu"))
    assert cache.fmt.name == fmt and cache.seq_lens.tolist() == [40, 40]
    k, v = cache.gather(1)
    assert k.shape == (40, 2, 64) and 0.8 < float(k.std()) < 1.2 and 0.8 < float(v.std()) < 1.2


def test_every_row_is_checked_against_the_oracle_before_timing():
    cases = sweep(**{**SMALL, "kv_dtypes": [*QUANT_KV_DTYPES, "fp8_e4m3", "fp16"], "backends": ["triton", "reference"]})
    df = run(cases, copy_bandwidth=False, progress=False, device="cpu", cpu_reps=1)
    assert (df.status == "ok").all(), df[["label", "reason"]]
    assert df.check_passed.all() and (df.rel_err <= df.tol).all()
    q = df[df.kv_dtype.isin(QUANT_KV_DTYPES)]
    assert len(q) == 8 and q.tol.map(math.isfinite).all() and (q[q.backend == "triton"].rel_err > 0).all()
    assert set(q.kernel) == {"triton-quantized-software", "reference-quantized"}
    for r in q.itertuples():
        fp = kvf.kv_footprint(r.kv_dtype, num_kv_heads=2, head_dim=64)
        assert r.kv_bytes == fp.codes * 2 * 40 and r.time_us > 0


def test_a_wrong_kernel_fails_its_check(monkeypatch):
    from fp8kv.bench import formats

    real = formats.run_quant_decode

    def off_by_a_percent(q, cache, launch):
        out, lse = real(q, cache, launch)
        return out * 1.01, lse

    monkeypatch.setattr(formats, "run_quant_decode", off_by_a_percent)
    cases = sweep(**{**SMALL, "kv_dtypes": ["int4_token_head"], "backends": ["triton"]})
    df = run(cases, copy_bandwidth=False, progress=False, device="cpu", cpu_reps=1)
    assert df.status.tolist() == ["ok"] and not df.check_passed.any() and (df.rel_err > df.tol).all()


def test_the_formats_presets():
    grid = PRESETS["formats"]
    assert grid["batches"] == [1, 16, 64] and grid["contexts"] == [4096, 16384, 32768]
    assert grid["shapes"] == [(32, 8, 128), (8, 1, 128)]
    assert grid["kv_dtypes"] == ["int8_token_head", "int4_token_head", "nvfp4", "mxfp4", "fp8_e4m3", "bf16"]
    assert preset_grid("formats", device="cpu")["kv_dtypes"][-1] == "fp16"  # the interpreter's bf16 is wrong
    assert grid["granularities"] == ["tensor", "token_head"] and grid["triton_options"] == [{}, {"gluon": False}]
    cases = sweep(**grid, arch="sm90", memory_budget_bytes=2**40, device="cpu", q_dtype="bf16")
    # 18 points x (6 formats, FP8 with token-head scales too) x (the default, gluon=False)
    assert len(cases) == 3 * 3 * 2 * 7 * 2
    ready = {(c.kv_dtype, c.granularity, c.variant) for c in cases if c.status == "ready"}
    assert ready == {("int8_token_head", "tensor", ""), ("int4_token_head", "tensor", ""), ("nvfp4", "tensor", ""),
                     ("mxfp4", "tensor", ""), ("fp8_e4m3", "tensor", ""), ("fp8_e4m3", "token_head", ""), ("bf16", "tensor", ""),
                     ("int8_token_head", "tensor", "gluon=False"), ("int4_token_head", "tensor", "gluon=False"),
                     ("fp8_e4m3", "tensor", "gluon=False"),
                     ("fp8_e4m3", "token_head", "gluon=False")}
    skipped = [c for c in cases if c.status != "ready"]  # gluon=False where the default is the Triton kernel anyway
    assert len(skipped) == 18 * 3 and {c.status for c in skipped} == {"skipped"}
    assert {c.kv_dtype for c in skipped} == {"nvfp4", "mxfp4", "bf16"}
    assert all("gluon=False runs the default" in c.reason for c in skipped)


def test_the_formats_tune_preset_varies_one_launch_option_at_a_time():
    grid = PRESETS["formats-tune"]
    assert grid["kv_dtypes"] == ["int8_token_head", "int4_token_head", "nvfp4", "mxfp4"]
    cases = sweep(**grid, arch="sm90", memory_budget_bytes=2**40, device="cpu", q_dtype="bf16")
    # B 16 / 64 x 32k, two head layouts, four formats, each format's default and nine options one at a time
    assert len(cases) == 2 * 1 * 2 * 4 * 10 and {c.status for c in cases} == {"ready"}
    assert {c.variant for c in cases} == {"", "convert=software", "convert=ptx", "convert=cast", "block_n=64",
                                          "block_n=128", "num_stages=1", "num_stages=2", "num_stages=3", "num_warps=8"}
    assert all(len(o) <= 1 for o in grid["triton_options"])  # one option at a time


def test_a_row_records_the_launch_it_timed():
    """The quantized rows carry their planned launch (splits, tile, warps, stages), read from the plan."""
    cases = sweep(**{**SMALL, "kv_dtypes": ["nvfp4"], "backends": ["triton"], "triton_options": [{"block_n": 32}]})
    df = run(cases, copy_bandwidth=False, progress=False, device="cpu", cpu_reps=1)
    assert df.status.tolist() == ["ok"] and df.block_n.tolist() == [32] and (df.num_splits >= 1).all()
    assert df.num_warps.tolist() == [4] and df.num_stages.tolist() == [1]


def test_the_cli_takes_the_formats():
    args = build_parser().parse_args(["--kv-dtypes", "nvfp4", "mxfp4", "fp8_e4m3", "--batches", "1",
                                      "--contexts", "16"])
    assert args.kv_dtypes == ["nvfp4", "mxfp4", "fp8_e4m3"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-dtypes", "kivi4_g32"])


def test_main_under_the_interpreter(tmp_path, capsys):
    rc = bench.main(["--batches", "1", "--contexts", "24", "--heads", "2:1", "--head-dims", "32",
                     "--kv-dtypes", "nvfp4", "int8_token_head", "fp16", "--modes", "dequant", "--backends", "triton",
                     "--out", str(tmp_path), "--quiet", "--interpret"])
    out = capsys.readouterr().out
    assert rc == 0 and "triton nvfp4 dequant" in out and "say nothing about any GPU" in out
    df = pd.read_csv(next((tmp_path / "cpu").glob("*.csv")))
    assert df.check_passed.all() and set(df.kv_dtype) == {"nvfp4", "int8_token_head", "fp16"}


def test_gluon_false_is_timed_only_where_the_gluon_kernel_reads_the_format():
    """INT4 through the Gluon kernel needs head dims that are multiples of 32: at D 80 its default is the Triton kernel,
    so a gluon=False row would time the same kernel twice and is skipped; at D 96 both are timed."""
    cases = sweep(batches=[2], contexts=[64], shapes=[(4, 2, 80), (4, 2, 96)], block_sizes=[16],
                  kv_dtypes=["int4_token_head"], modes=["dequant"], backends=["triton"], granularities=["tensor"],
                  triton_options=[{}, {"gluon": False}], arch="sm90", device="cpu", q_dtype="bf16")
    status = {(c.head_dim, c.variant): c.status for c in cases}
    assert status == {(80, ""): "ready", (80, "gluon=False"): "skipped", (96, ""): "ready", (96, "gluon=False"): "ready"}
    assert "multiples of 32" in next(c.reason for c in cases if c.status == "skipped")
