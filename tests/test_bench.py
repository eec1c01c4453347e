"""fp8kv.bench: grid expansion, bytes accounting, synthetic caches, run rows, speedups, saving, CLI.

Runs on CPU. The reference backend runs in-process; the Triton backend and the ``smoke`` preset
run in subprocesses with ``TRITON_INTERPRET=1`` set before triton is imported.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from fixtures import LIBRARY_TAKES_SIGTERM, seeded

from fp8kv import bench, results
from fp8kv.bench import Case, bytes_moved, layout_table, run, save, speedup_table, sweep, synthetic_cache
from fp8kv.capability import UnsupportedError, check
from fp8kv.quant import broadcast_scale
from fp8kv.reference import FP8_MODE_TOL

REPO = Path(__file__).resolve().parents[1]
BIG = 2**40  # a memory budget nothing exceeds
REQUIRED = ["gpu", "gpu_slug", "arch", "torch", "triton", "flashinfer", "backend", "mode", "kv_dtype",
            "granularity", "batch", "context", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
            "num_splits", "time_us", "bytes", "gbps", "pct_copy_bw", "copy_gbps", "rel_err", "check_passed",
            "status", "reason", "timestamp"]


# Subprocess runs of the Triton interpreter: the CPU test path. A GPU machine runs the same cases
# compiled (gpu-marked tests), and its Triton may not match the installed numpy's interpreter API.
ON_CPU_MACHINES = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter run: CPU machines (CI)")


def _interpreted(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run python code in a fresh interpreter with TRITON_INTERPRET=1 (set before triton loads)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------ sweep
def test_sweep_expands_the_grid_and_keeps_unsupported_rows_with_reasons():
    cases = sweep([1, 3], [32, 50], heads=[(4, 2)], head_dims=[16], kv_dtypes=["fp16", "fp8_e4m3"],
                  modes=["dequant", "fp8"], backends=["reference"], memory_budget_bytes=BIG, device="cpu")
    # per shape: fp16 dequant, fp8 dequant, fp8 fp8 (fp16 x fp8 mode is not a combination)
    assert len(cases) == 2 * 2 * 3
    assert {(c.batch, c.context) for c in cases} == {(1, 32), (1, 50), (3, 32), (3, 50)}
    assert not any(c.mode == "fp8" and c.kv_dtype == "fp16" for c in cases)
    for c in cases:
        ok, why = check(c.backend, c.kv_dtype, c.mode, None, c.granularity, c.head_dim)
        assert c.status == ("ready" if ok else "unsupported"), c.label
        assert c.reason == ("" if ok else why)
    assert sum(c.status == "unsupported" for c in cases) == 4  # the reference has no fp8 mode
    assert all(c.q_dtype == "fp16" for c in cases)  # CPU default: the interpreter's bf16 is wrong


def test_sweep_variants_and_arch_specific_reasons():
    cases = sweep([2], [64], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                  backends=["triton", "flashinfer"], flashinfer_tensor_cores=[False, True], q_dtype="bf16",
                  memory_budget_bytes=BIG, device="cpu", arch="sm90")
    fi = [c for c in cases if c.backend == "flashinfer"]
    assert sorted({c.variant for c in fi}) == ["no-tc", "tc"]
    assert len(fi) == 2 * 3 and len(cases) == len(fi) + 3
    assert len({c.label for c in cases}) == len(cases)
    for c in cases:
        ok, why = check(c.backend, c.kv_dtype, c.mode, "sm90", c.granularity, c.head_dim)
        assert (c.status == "ready") == ok and (c.reason == ("" if ok else why))
    fp8_fi = [c for c in fi if c.mode == "fp8"]
    assert fp8_fi and all(c.status == "unsupported" and "sm100" in c.reason for c in fp8_fi)
    # FlashInfer pairs a 16-bit query with a cache of the same type
    mixed = sweep([2], [64], kv_dtypes=["bf16"], modes=["dequant"], backends=["flashinfer"], q_dtype="fp16",
                  flashinfer_tensor_cores=[True], memory_budget_bytes=BIG, device="cpu", arch="sm90")
    assert [c.status for c in mixed] == ["unsupported"] and "pairs a fp16 query" in mixed[0].reason


def test_sweep_collapses_granularity_of_16bit_caches_and_applies_triton_options():
    cases = sweep([1], [16], heads=[(2, 1)], head_dims=[16], kv_dtypes=["fp16", "fp8_e4m3"], modes=["dequant"],
                  backends=["triton"], granularities=["tensor", "head"], triton_options=[{}, {"num_splits": 2}],
                  memory_budget_bytes=BIG, device="cpu", arch="sm90")
    fp16 = [c for c in cases if c.kv_dtype == "fp16"]
    assert len(fp16) == 2 and {c.granularity for c in fp16} == {"tensor"}
    assert len([c for c in cases if c.kv_dtype == "fp8_e4m3"]) == 4
    assert {c.variant for c in cases} == {"", "num_splits=2"}


def test_a_convert_variant_over_16_bit_pages_is_skipped_with_the_reason():
    """The decode refuses convert over 16-bit pages (nothing to convert): the variant is skipped, not an error row;
    over FP8 pages and a quantized format's (its kernel's own conversion) it runs."""
    cases = sweep([1], [16], heads=[(2, 1)], head_dims=[32], kv_dtypes=["fp16", "fp8_e4m3", "int8_token_head"],
                  modes=["dequant"], backends=["triton"], triton_options=[{}, {"convert": "cast"}],
                  memory_budget_bytes=BIG, device="cpu", arch="sm90")
    by = {(c.kv_dtype, c.variant): c for c in cases}
    assert (by["fp16", "convert=cast"].status, by["fp16", "convert=cast"].reason) == (
        "skipped", "convert does not apply: fp16 pages are read as they are")
    assert {by[k].status for k in by if k != ("fp16", "convert=cast")} <= {"ready", "unsupported"}
    assert by["fp8_e4m3", "convert=cast"].reason == by["fp8_e4m3", ""].reason


def test_sweep_skips_cases_over_the_memory_budget():
    small, large = Case(1, 64, 4, 2, 16, kv_dtype="fp16"), Case(8, 4096, 4, 2, 16, kv_dtype="fp16")
    budget = (bench.footprint_bytes(small) + bench.footprint_bytes(large)) // 2
    cases = sweep([1, 8], [64, 4096], heads=[(4, 2)], head_dims=[16], kv_dtypes=["fp16"], modes=["dequant"],
                  backends=["reference"], memory_budget_bytes=budget, device="cpu")
    by = {(c.batch, c.context): c for c in cases}
    assert by[(1, 64)].status == "ready"
    assert by[(8, 4096)].status == "skipped" and by[(8, 4096)].reason.startswith("does not fit")
    assert bench.footprint_bytes(large) > budget >= bench.footprint_bytes(small)
    # small sizes keep their digits (not "needs ~0.0 GiB, budget 0.0 GiB")
    need, have = bench.footprint_bytes(large) / 2**30, budget / 2**30
    assert by[(8, 4096)].reason == f"does not fit: needs ~{need:.4g} GiB, budget {have:.4g} GiB" and have < 0.05


@pytest.mark.parametrize("kwargs, arg", [(dict(batch=0), "batch"), (dict(kv_dtype="int8"), "kv_dtype"),
                                         (dict(num_q_heads=6, num_kv_heads=4), "num_q_heads"),
                                         (dict(mode="fast"), "mode"), (dict(backend="cuda"), "backend")])
def test_case_rejects_bad_fields_naming_them(kwargs, arg):
    base = dict(batch=1, context=8)
    with pytest.raises(ValueError, match=arg):
        Case(**{**base, **kwargs})


@pytest.mark.parametrize("seed, exc", [(1.5, TypeError), ("x", TypeError), (True, TypeError), (-1, ValueError),
                                       (2**70, ValueError)])  # 2**70 surfaced only as an error row of run()
def test_case_refuses_a_seed_torch_cannot_take(seed, exc):
    with pytest.raises(exc, match="Case.seed"):
        Case(1, 8, seed=seed)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(kv_dtypes=["bogus"], modes=["fp8"]), ValueError, "kv_dtypes has 'bogus'"),  # made no case at all before
    (dict(modes=["fast"]), ValueError, "modes has 'fast'"), (dict(backends=["cuda"]), ValueError, "backends has 'cuda'"),
    (dict(granularities=["block"]), ValueError, "granularities has 'block'"),
    (dict(heads=[]), ValueError, "heads=\\[\\]"), (dict(heads=8), TypeError, "heads=8")])
def test_sweep_refuses_names_and_heads_it_cannot_take(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        bench.sweep([1], [16], device="cpu", **kwargs)


# ----------------------------------------------------------------------------------------- bytes
def test_bytes_moved_matches_hand_arithmetic():
    c = Case(3, 100, 8, 2, 64, kv_dtype="fp8_e4m3", granularity="token_head", q_dtype="fp16")
    by = bytes_moved(c)
    tokens = 3 * 100
    assert by["kv"] == tokens * 2 * 64 * 2 * 1
    assert by["scales"] == 2 * tokens * 2 * 4  # K and V, per token and KV head, fp32
    assert by["q"] == by["out"] == 3 * 8 * 64 * 2
    assert by["total"] == by["kv"] + by["scales"] + by["q"] + by["out"]

    ragged = bytes_moved(c, seq_lens=[10, 20, 31])
    assert ragged["kv"] == 61 * 2 * 64 * 2 and ragged["scales"] == 2 * 61 * 2 * 4

    bf16 = bytes_moved(Case(2, 50, 4, 4, 32, kv_dtype="bf16", backend="reference"))
    assert bf16["kv"] == 2 * 50 * 4 * 32 * 2 * 2 and bf16["scales"] == 0
    assert bf16["out"] == 2 * 4 * 32 * 4  # the reference returns fp32
    assert bytes_moved(Case(1, 10, 4, 2, 16, kv_dtype="fp8_e5m2", granularity="channel"))["scales"] == 2 * 2 * 16 * 4
    wide = Case(3, 100, 8, 2, 64, kv_dtype="fp8_e4m3", q_dtype="fp16", options={"out_dtype": torch.float32})
    assert bytes_moved(wide)["out"] == 3 * 8 * 64 * 4  # an fp32 output writes twice q's bytes


# ---------------------------------------------------------------------------------- synthetic cache
@pytest.mark.parametrize("granularity", ["tensor", "head", "channel", "token_head"])
def test_synthetic_cache_scales_come_from_the_generated_data(granularity):
    c = synthetic_cache(3, 37, 2, 16, kv_dtype="fp8_e4m3", granularity=granularity, chunk_elems=700, seed=5)
    assert c.seq_lens.tolist() == [37] * 3 and c.num_blocks == 3 * 3
    assert sorted(c.block_table.flatten().tolist()) == list(range(9))
    k_pages = c.k_pages.to(torch.float32)  # [blocks, bs, H, D]; amax over every page (tokens past 37 too)
    deq = k_pages * broadcast_scale(c.k_scale, 4, granularity) if granularity != "token_head" \
        else k_pages * c.k_scale.unsqueeze(-1)
    dims = {"tensor": (0, 1, 2, 3), "head": (0, 1, 3), "channel": (0, 1), "token_head": (3,)}[granularity]
    # amax scaling maps each group's largest value exactly onto e4m3's max (448)
    torch.testing.assert_close(deq.abs().amax(dim=dims), c.k_scale * 448.0)
    k, v = c.gather(2)
    assert 0.8 < float(k.std()) < 1.2 and 0.8 < float(v.std()) < 1.2  # N(0, 1) data
    assert not torch.equal(k, v)


def test_synthetic_cache_is_deterministic_and_layout_independent():
    a = synthetic_cache(2, 20, 2, 8, kv_dtype="fp16", seed=3, chunk_elems=300)
    b = synthetic_cache(2, 20, 2, 8, kv_dtype="fp16", seed=3, chunk_elems=300, layout="HND")
    c = synthetic_cache(2, 20, 2, 8, kv_dtype="fp16", seed=4, chunk_elems=300)
    for i in range(2):
        torch.testing.assert_close(a.gather(i), b.gather(i), rtol=0, atol=0)
        assert not torch.equal(a.gather(i)[0], c.gather(i)[0])


@pytest.mark.parametrize("kv_dtype,granularity", [("fp16", "tensor"), ("fp8_e4m3", "token_head"), ("fp8_e5m2", "head")])
def test_clone_copies_everything_and_select_shares_the_pages(kv_dtype, granularity):
    from fp8kv.reference import decode as ref_decode

    c = synthetic_cache(3, 37, 2, 16, kv_dtype=kv_dtype, granularity=granularity, chunk_elems=700, seed=2,
                        device="cpu")  # the reference below runs on the CPU tensors
    twin = c.clone()
    for name in ("k_pages", "v_pages", "block_table", "seq_lens", "k_scale", "v_scale"):
        a, b = getattr(c, name), getattr(twin, name)
        bits = (lambda t: t.view(torch.uint8)) if a.element_size() == 1 else (lambda t: t)  # fp8: compare codes
        assert a.data_ptr() != b.data_ptr() and torch.equal(bits(a), bits(b)), name
    assert (twin.kv_dtype, twin.granularity, twin.layout) == (c.kv_dtype, c.granularity, c.layout)
    twin.k_pages.zero_()  # independent storage: the original keeps its keys
    assert c.k_pages.to(torch.float32).abs().sum() > 0

    q = torch.randn(3, 4, 16, generator=seeded(0)).to(torch.float16)
    full, _ = ref_decode(q, c)
    sub = c.select([2, 0])
    assert sub.k_pages.data_ptr() == c.k_pages.data_ptr() and sub.batch_size == 2
    assert sub.block_table.tolist() == [c.block_table[2].tolist(), c.block_table[0].tolist()]
    part, _ = ref_decode(q[[2, 0]], sub)
    torch.testing.assert_close(part, full[[2, 0]], rtol=0, atol=0)
    torch.testing.assert_close(ref_decode(q[[1]], c.select(torch.tensor([1])))[0], full[[1]], rtol=0, atol=0)
    for bad, exc, needle in (([3], ValueError, "indices\\[0\\]=3"), ([], ValueError, "indices is empty"),
                             (1, TypeError, "indices=1"), ([0.5], TypeError, "indices\\[0\\]")):
        with pytest.raises(exc, match=needle):
            c.select(bad)


# -------------------------------------------------------------------------------------------- run
def test_run_reference_rows_are_checked_timed_and_consistent():
    cases = sweep([2, 3], [24], heads=[(4, 2)], head_dims=[16], kv_dtypes=["fp16", "fp8_e4m3"],
                  modes=["dequant", "fp8"], backends=["reference", "flashinfer"], flashinfer_tensor_cores=[True],
                  memory_budget_bytes=BIG, device="cpu")
    df = run(cases, copy_bandwidth=50.0, progress=False, cpu_reps=2, device="cpu")
    assert list(df.columns) == bench.COLUMNS and set(REQUIRED) <= set(df.columns)
    assert len(df) == len(cases)
    assert df["label"].tolist() == [c.label for c in cases]  # rows keep the cases' order
    ok = df[df["status"] == "ok"]
    assert len(ok) == 2 * 2 and set(ok["backend"]) == {"reference"}
    assert ok["check_passed"].all() and (ok["rel_err"] <= ok["tol"]).all()
    assert (ok["timing"] == "cpu-wallclock").all()
    assert ok["time_us"].map(math.isfinite).all() and (ok["time_us"] > 0).all()
    for _, r in ok.iterrows():
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["pct_copy_bw"] == pytest.approx(100 * r["gbps"] / 50.0)
    assert (df["copy_gbps"] == 50.0).all() and (df["gpu_slug"] == "cpu").all()
    assert df["timestamp"].nunique() == 1
    rest = df[df["status"] != "ok"]
    assert (rest["status"] == "unsupported").all() and rest["reason"].str.len().gt(0).all()
    assert rest["time_us"].isna().all()


def test_run_flags_a_failed_check(monkeypatch):
    case = Case(2, 16, 2, 1, 16, kv_dtype="fp16", backend="reference", q_dtype="fp16")
    monkeypatch.setattr(bench.measure, "tolerance", lambda c: -1.0)  # nothing passes a negative tolerance
    df = run([case], copy_bandwidth=False, progress=False, cpu_reps=1, device="cpu")
    assert df.loc[0, "status"] == "ok" and bool(df.loc[0, "check_passed"]) is False
    assert df.loc[0, "tol"] == -1.0 and df.loc[0, "rel_err"] >= 0
    assert math.isnan(df.loc[0, "pct_copy_bw"])  # copy bandwidth skipped


def test_an_interrupted_run_keeps_the_rows_it_measured(monkeypatch):
    cases = [Case(b, 16, 2, 1, 16, kv_dtype="fp16", backend="reference", q_dtype="fp16") for b in (1, 2, 3)]
    measure_one = bench.measure._measure
    calls = []

    def stop_at_the_second(c, *args, **kwargs):
        calls.append(c.batch)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measure_one(c, *args, **kwargs)

    monkeypatch.setattr(bench.measure, "_measure", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):  # by default an interrupt stops the caller (a notebook cell) too
        run(cases, copy_bandwidth=False, progress=False, cpu_reps=1, device="cpu")
    calls.clear()
    df = run(cases, copy_bandwidth=False, progress=False, cpu_reps=1, device="cpu", keep_partial=True)
    assert df.attrs["bench"]["interrupted"] is True
    assert list(df["status"]) == ["ok", "skipped", "skipped"] and bool(df.loc[0, "check_passed"])
    assert df.loc[1:, "reason"].str.contains("interrupted").all()
    assert run(cases[:1], copy_bandwidth=False, progress=False, cpu_reps=1, device="cpu", keep_partial=True).attrs[
        "bench"]["interrupted"] is False


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGQUIT", "SIGXCPU"])
def test_main_saves_what_it_measured_when_terminated(tmp_path, monkeypatch, capsys, signame):
    """SIGTERM (timeout, kill), SIGHUP (the terminal closed), ... during the second case: the first is written,
    the exit status is 130 (SIGHUP ended the process, the rows lost)."""
    import os
    import signal

    sig = signal.Signals[signame]
    real_run = bench.cli.run

    def terminated_after_the_first_case(cases, **kwargs):
        def terminated_on_the_second(c, *args, **kw):
            if c.batch == 2:
                os.kill(os.getpid(), sig)  # the CLI's handler raises KeyboardInterrupt here
            return measure_one(c, *args, **kw)

        monkeypatch.setattr(bench.measure, "_measure", terminated_on_the_second)
        return real_run(cases, **kwargs)

    measure_one = bench.measure._measure
    monkeypatch.setattr(bench.cli, "run", terminated_after_the_first_case)
    outer = signal.signal(sig, signal.SIG_DFL)  # as a shell starts the command (the test runner may hold SIGALRM...)
    try:
        rc = bench.main(["--batches", "1", "2", "--contexts", "16", "--heads", "2:1", "--head-dims", "16",
                         "--kv-dtypes", "fp16", "--modes", "dequant", "--backends", "reference", "--out",
                         str(tmp_path), "--quiet", "--device", "cpu"])
        assert signal.getsignal(sig) == signal.SIG_DFL  # the handler is the CLI's only while it runs
    finally:
        signal.signal(sig, outer)
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    files = list((tmp_path / "cpu").glob("*.csv"))
    assert len(files) == 1
    df = pd.read_csv(files[0])
    assert list(df["status"]) == ["ok", "skipped"] and df.loc[0, "check_passed"]
    # a partial run is never what load_table returns as the newest run
    assert results.load_table(tmp_path, "cpu") is None


def test_run_plans_flashinfer_once_and_times_run_only(monkeypatch):
    """The FlashInfer plumbing, on CPU through a stand-in decoder computing the reference."""
    import fp8kv.backends.flashinfer as fib
    from fp8kv.reference import decode as ref_decode

    events = []

    class StandIn:
        def __init__(self, cache, *, mode, use_tensor_cores=True, trusted=False):
            events.append(("init", mode, use_tensor_cores, trusted))
            self.cache = cache

        def plan(self, cache, *, num_qo_heads, q_dtype, sm_scale):
            assert sm_scale == 16 ** -0.5  # fp8kv.decode's default, resolved once where the input entered
            events.append(("plan", num_qo_heads, q_dtype))

        def run_trusted(self, q):  # validated where it entered, so the unchecked run
            events.append(("run",))
            out, lse = ref_decode(q, self.cache)
            return out.to(q.dtype), lse

    monkeypatch.setattr(fib, "FlashInferDecode", StandIn)
    import fp8kv.backends

    stand_in = lambda *a, **k: (True, "stand-in")  # noqa: E731
    monkeypatch.setattr(fp8kv.backends, "supported", stand_in)  # the one validation, before planning
    case = Case(2, 16, 4, 2, 16, kv_dtype="fp8_e4m3", backend="flashinfer", q_dtype="fp16",
                options={"use_tensor_cores": False})
    df = run([case], copy_bandwidth=1.0, progress=False, cpu_reps=3, device="cpu")
    assert df.loc[0, "status"] == "ok" and bool(df.loc[0, "check_passed"]) and df.loc[0, "variant"] == "no-tc"
    assert events[:2] == [("init", "dequant", False, True), ("plan", 4, torch.float16)]
    assert events[2:] == [("run",)] * (1 + 3)  # one checked call, then the timed calls: no re-planning


TRITON_RUN = r"""
import json, triton
from fp8kv.bench import Case, run
cases = [Case(2, 40, 4, 2, 32, kv_dtype=kv, mode=m, backend="triton", q_dtype="fp16")
         for kv, m in (("fp16", "dequant"), ("fp8_e4m3", "dequant"), ("fp8_e4m3", "fp8"))]
cases.append(Case(3, 200, 4, 2, 32, kv_dtype="fp8_e5m2", granularity="token_head", backend="triton",
                  q_dtype="fp16", options={"num_splits": 2, "block_n": 32}))
df = run(cases, copy_bandwidth=10.0, progress=False, cpu_reps=1, check_seqs=2)
print("JSON" + df.to_json(orient="records"))
"""


@ON_CPU_MACHINES
def test_run_triton_under_the_interpreter():
    proc = _interpreted(TRITON_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.split("JSON", 1)[1])
    assert [r["status"] for r in rows] == ["ok"] * 4, [r["reason"] for r in rows]
    for r in rows:
        assert r["check_passed"] is True and r["rel_err"] <= r["tol"], r
        assert r["timing"] == "cpu-wallclock" and math.isfinite(r["time_us"]) and r["time_us"] > 0
        assert r["num_splits"] >= 1 and r["block_n"] >= 16
    # fp8 mode: the documented bound of fp8kv.reference (shared with tests/test_ops.py)
    assert rows[1]["tol"] == 2 * 2.0**-11 and rows[2]["tol"] == FP8_MODE_TOL == 0.08
    assert (rows[3]["num_splits"], rows[3]["block_n"]) == (2, 32)  # overrides reach the launch and the row
    assert rows[3]["variant"] == "block_n=32,num_splits=2"


# -------------------------------------------------------------------------------------- analysis
def _rows(spec):
    shape = dict(gpu_slug="nvidia-h200", batch=16, context=4096, num_q_heads=32, num_kv_heads=8, head_dim=128,
                 block_size=16, granularity="tensor")
    out = []
    for backend, variant, kv, mode, t, status, passed in spec:
        label = backend + (f"-{variant}" if variant else "") + f" {kv} {mode}"
        out.append(dict(shape, backend=backend, variant=variant, label=label, kv_dtype=kv, mode=mode, time_us=t,
                        status=status, check_passed=passed))
    return pd.DataFrame(out)


def test_speedup_table_against_best_bf16_and_flashinfer_fp8():
    df = _rows([
        ("triton", "", "bf16", "dequant", 100.0, "ok", True),
        ("flashinfer", "tc", "bf16", "dequant", 80.0, "ok", True),
        ("flashinfer", "no-tc", "bf16", "dequant", 90.0, "ok", True),
        ("triton", "", "fp8_e4m3", "dequant", 50.0, "ok", True),
        ("triton", "", "fp8_e4m3", "fp8", 40.0, "ok", True),
        ("triton", "", "fp8_e4m3", "fp8", 44.0, "ok", True),  # a repeat: the median (42) counts
        ("flashinfer", "tc", "fp8_e4m3", "dequant", 60.0, "ok", True),
        ("flashinfer", "no-tc", "fp8_e4m3", "dequant", 70.0, "ok", True),
        ("flashinfer", "tc", "fp8_e4m3", "fp8", float("nan"), "unsupported", None),
        ("triton", "num_splits=1", "fp8_e4m3", "dequant", 5.0, "ok", False),  # wrong output: ignored
        ("flashinfer", "tc", "bf16", "dequant", 1.0, "error", None),
    ])
    sp = speedup_table(df)
    assert len(sp) == 4 and (sp["kv_dtype"] == "fp8_e4m3").all()
    assert (sp["bf16_us"] == 80.0).all() and (sp["bf16_best"] == "flashinfer-tc bf16 dequant").all()
    assert (sp["flashinfer_fp8_us"] == 60.0).all()
    by = sp.set_index(["backend", "variant", "mode"])
    assert by.loc[("triton", "", "dequant"), "speedup_vs_bf16"] == pytest.approx(80 / 50)
    assert by.loc[("triton", "", "dequant"), "speedup_vs_flashinfer_fp8"] == pytest.approx(60 / 50)
    assert by.loc[("triton", "", "fp8"), "time_us"] == pytest.approx(42.0)
    assert by.loc[("triton", "", "fp8"), "speedup_vs_bf16"] == pytest.approx(80 / 42)
    assert by.loc[("flashinfer", "no-tc", "dequant"), "speedup_vs_flashinfer_fp8"] == pytest.approx(60 / 70)


def test_speedup_table_keeps_page_layouts_apart():
    """Runs of NHD and HND pages (saved runs concatenated) are different shapes: no median across them, each
    FP8 row against the BF16 decode of its own pages; runs saved without the column count as NHD."""
    spec = [("triton", "", "bf16", "dequant", 100.0, "ok", True), ("triton", "", "fp8_e4m3", "dequant", 50.0, "ok", True)]
    nhd, hnd = _rows(spec), _rows(spec).assign(layout="HND")
    hnd["time_us"] *= [0.8, 0.5]
    sp = speedup_table(pd.concat([nhd, hnd], ignore_index=True)).set_index("layout")
    assert sorted(sp.index) == ["HND", "NHD"]
    assert sp.loc["NHD", "time_us"] == 50.0 and sp.loc["NHD", "speedup_vs_bf16"] == pytest.approx(2.0)
    assert sp.loc["HND", "time_us"] == 25.0 and sp.loc["HND", "speedup_vs_bf16"] == pytest.approx(80 / 25)
    from fp8kv.viz import speedup_heatmap

    cells = speedup_heatmap(sp.reset_index()).data[0]  # one row per page layout, not their median
    assert sorted(cells.y) == ["triton fp8_e4m3 dequant · HND pages", "triton fp8_e4m3 dequant · NHD pages"]
    assert sorted(v for line in cells.text for v in line) == ["2.00×", "3.20×"]
    no_column = speedup_table(nhd.assign(layout=float("nan")))  # an all-NaN column: NHD, without a warning
    assert list(no_column["layout"]) == ["NHD"]


def test_speedup_table_keeps_saved_runs_apart():
    """Saved runs concatenated (other code, another day) are never pooled: each run's FP8 rows against that
    run's BF16 decode, one heatmap row per run named by its date; layout_table refuses several runs."""
    spec = [("triton", "", "bf16", "dequant", 100.0, "ok", True), ("triton", "", "fp8_e4m3", "dequant", 50.0, "ok", True)]
    old, new = _rows(spec).assign(timestamp="2026-12-02T15:07:36Z"), _rows(spec).assign(timestamp="2026-12-04T18:49:33Z")
    new["time_us"] *= [0.9, 0.6]
    both = pd.concat([old, new], ignore_index=True)
    sp = speedup_table(both).set_index("timestamp")
    assert sp.loc["2026-12-02T15:07:36Z", "speedup_vs_bf16"] == pytest.approx(2.0)
    assert sp.loc["2026-12-04T18:49:33Z", "speedup_vs_bf16"] == pytest.approx(90 / 30)
    from fp8kv.viz import speedup_heatmap

    cells = speedup_heatmap(sp.reset_index()).data[0]
    assert list(cells.y) == ["triton fp8_e4m3 dequant · run 2026-12-02 15:07Z",
                             "triton fp8_e4m3 dequant · run 2026-12-04 18:49Z"]
    assert [v for line in cells.text for v in line] == ["2.00×", "3.00×"]
    assert list(speedup_heatmap(speedup_table(old)).data[0].y) == ["triton fp8_e4m3 dequant"]  # one run: no date
    layout_cols = dict(kv_bytes=1e9, copy_gbps=4000.0)
    assert len(layout_table(old.assign(**layout_cols))) == 1
    with pytest.raises(ValueError, match="timestamp"):
        layout_table(both.assign(**layout_cols))


@pytest.mark.parametrize("apart, value_a, value_b, says", [
    ("num_q_heads", 32, 64, ["32/8/128", "64/8/128"]),  # a head-layout sweep (--heads 32:8 64:8)
    ("block_size", 16, 32, ["page 16", "page 32"]),
    ("window", float("nan"), 1024, ["no window", "window 1024"]),
    ("gpu_slug", "nvidia-h100", "nvidia-h200", ["nvidia-h100", "nvidia-h200"]),
])
def test_speedup_heatmap_never_takes_a_median_across_shapes(apart, value_a, value_b, says):
    """Rows that differ in more than batch and context get a heatmap row each, named by what differs:
    FP8 2.0x on one and 1.0x on the other is never one cell of 1.50x."""
    from fp8kv.viz import speedup_heatmap

    a = _rows([("triton", "", "bf16", "dequant", 100.0, "ok", True), ("triton", "", "fp8_e4m3", "dequant", 50.0, "ok", True)])
    b = _rows([("triton", "", "bf16", "dequant", 100.0, "ok", True), ("triton", "", "fp8_e4m3", "dequant", 100.0, "ok", True)])
    sp = speedup_table(pd.concat([a.assign(**{apart: value_a}), b.assign(**{apart: value_b})], ignore_index=True))
    cells = speedup_heatmap(sp).data[0]
    assert sorted(cells.y) == [f"triton fp8_e4m3 dequant · {w}" for w in says]
    assert sorted(v for line in cells.text for v in line) == ["1.00×", "2.00×"]


def test_speedup_table_without_baselines_gives_nan_and_rejects_foreign_frames():
    with pytest.warns(results.PartialResultWarning, match="speedup_table: df holds no bf16 rows that ran"):
        sp = speedup_table(_rows([("triton", "", "fp8_e4m3", "dequant", 50.0, "ok", True)]))
    assert len(sp) == 1 and math.isnan(sp.loc[0, "speedup_vs_bf16"]) and math.isnan(sp.loc[0, "speedup_vs_flashinfer_fp8"])
    with pytest.raises(ValueError, match="lacks columns"):
        speedup_table(pd.DataFrame({"time_us": [1.0]}))


def test_speedup_table_of_a_run_where_nothing_ran_is_empty():
    sp = speedup_table(_rows([("triton", "", "fp8_e4m3", "dequant", float("nan"), "unsupported", None),
                              ("triton", "", "bf16", "dequant", 10.0, "ok", False)]))  # a failed check never counts
    assert sp.empty and {"speedup_vs_bf16", "speedup_vs_flashinfer_fp8", "label"} <= set(sp.columns)


# ------------------------------------------------------------------------------------------- save
def test_save_writes_a_new_file_under_the_slug_folder_only(tmp_path):
    other = tmp_path / "nvidia-a100"
    other.mkdir()
    (other / "20250101T000000Z.csv").write_text("keep me\n")
    df = _rows([("triton", "", "bf16", "dequant", 100.0, "ok", True)])
    df["timestamp"] = "2025-01-01T00:00:00Z"
    df.attrs["bench"] = {"device": {"name": "NVIDIA H200"}}
    first = save(df, tmp_path, meta={"argv": ["--preset", "target"]})
    second = save(df, tmp_path)
    assert first == tmp_path / "nvidia-h200" / "20250101T000000Z.csv"
    assert second == tmp_path / "nvidia-h200" / "20250101T000000Z-2.csv"  # never overwritten
    assert pd.read_csv(first)["time_us"].tolist() == [100.0]
    meta = json.loads(first.with_suffix(".json").read_text())
    assert meta["rows"] == 1 and meta["argv"] == ["--preset", "target"] and meta["device"]["name"] == "NVIDIA H200"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvidia-a100", "nvidia-h200"]
    assert [p.name for p in other.iterdir()] == ["20250101T000000Z.csv"]
    assert (other / "20250101T000000Z.csv").read_text() == "keep me\n"


def test_save_comparison_writes_one_tagged_file_per_run_never_overwriting(tmp_path, capsys):
    """A probe's rows under each value of a launch setting: one file tagged with the probe, a column
    naming the value, the two printed side by side; a second run in the same second gets -2."""
    runs = {}
    for value, t in ((False, 10.0), (True, 9.0)):
        df = _rows([("triton", "", "fp8_e4m3", "dequant", t, "ok", True)])
        runs[value] = df.assign(timestamp="2025-01-01T00:00:00Z", num_splits=8)
    path = bench.save_comparison(runs, "pdl", "pdl", tmp_path)
    assert path == tmp_path / "nvidia-h200" / "20250101T000000Z-pdl.csv"
    rows = pd.read_csv(path)
    assert rows["pdl"].tolist() == [False, True] and rows["time_us"].tolist() == [10.0, 9.0]
    assert json.loads(path.with_suffix(".json").read_text())["setting"] == "pdl"
    assert "10.00" in capsys.readouterr().out
    assert bench.save_comparison(runs, "pdl", "pdl", tmp_path).name == "20250101T000000Z-pdl-2.csv"
    with pytest.raises(ValueError, match="folder-safe"):
        bench.save_comparison(runs, "pdl", "../x", tmp_path)


def test_save_refuses_mixed_or_unsafe_slugs(tmp_path):
    df = _rows([("triton", "", "bf16", "dequant", 1.0, "ok", True)] * 2)
    df["timestamp"] = "2025-01-01T00:00:00Z"
    df.loc[1, "gpu_slug"] = "nvidia-a100"
    with pytest.raises(ValueError, match="one device"):
        save(df, tmp_path)
    df["gpu_slug"] = "../escape"
    with pytest.raises(ValueError, match="folder-safe"):
        save(df, tmp_path)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------------------------- CLI
def test_main_in_process_with_the_reference(tmp_path, capsys):
    rc = bench.main(["--batches", "1", "2", "--contexts", "16", "--heads", "2:1", "--head-dims", "16",
                     "--kv-dtypes", "fp16", "--modes", "dequant", "--backends", "reference", "--out",
                     str(tmp_path), "--quiet", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "reference fp16 dequant" in out and "say nothing about any GPU" in out
    files = list((tmp_path / "cpu").glob("*.csv"))
    assert len(files) == 1 and len(pd.read_csv(files[0])) == 2


def test_main_keeps_its_rows_when_out_cannot_be_written(tmp_path, monkeypatch, capsys):
    """--out passed the checks, but the save fails (a full disk, /proc): the rows go to a temporary folder that
    stderr names, and the exit status says so (1), instead of a traceback that loses the measurements."""
    import tempfile

    out = tmp_path / "out"
    real_save = bench.cli.save

    def failing_under_out(df, where, meta=None):
        if str(where) == str(out):
            raise OSError(28, "No space left on device")
        return real_save(df, where, meta=meta)

    monkeypatch.setattr(bench.cli, "save", failing_under_out)  # the save the CLI hands to save_or_fallback
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rc = bench.main(["--batches", "1", "--contexts", "16", "--heads", "2:1", "--head-dims", "16",
                     "--kv-dtypes", "fp16", "--modes", "dequant", "--backends", "reference", "--out",
                     str(out), "--quiet", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "could not write under --out" in err and "No space left" in err
    saved = list(tmp_path.glob("fp8kv-results-*/cpu/*.csv"))
    assert len(saved) == 1 and str(saved[0].parent.parent) in err
    assert pd.read_csv(saved[0])["status"].tolist() == ["ok"]


def test_main_refuses_an_interpret_flag_that_would_come_too_late(monkeypatch, capsys):
    import triton  # noqa: F401  (imported, as in any process that imported fp8kv.bench)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        bench.main(["--preset", "smoke", "--interpret", "--no-save"])
    assert "before triton is imported" in capsys.readouterr().err


def test_main_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        bench.main(["--batches", "1"])  # no contexts and no preset
    with pytest.raises(SystemExit):
        bench.main(["--preset", "smoke", "--heads", "32x8"])


def test_a_page_size_no_cache_takes_is_a_usage_error(capsys):
    """Refused before any case is built (exit 2, one line), not case by case after the run started."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "1", "--contexts", "32", "--block-sizes", "16", "0", "--backends", "reference",
                    "--no-save", "--device", "cpu"])
    assert exc.value.code == 2 and "--block-sizes=0; expected an int >= 1" in capsys.readouterr().err


@ON_CPU_MACHINES
def test_main_smoke_preset_as_a_module(tmp_path):
    # --interpret alone (TRITON_INTERPRET unset): the module imports triton before it parses its options,
    # so it starts itself again with the variable set
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "fp8kv.bench", "--preset", "smoke", "--interpret", "--out",
                           str(tmp_path), "--quiet"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list((tmp_path / "cpu").glob("*.csv"))
    assert len(files) == 1 and files[0].with_suffix(".json").exists()
    df = pd.read_csv(files[0])
    ok = df[df["status"] == "ok"]
    assert {"triton", "reference"} <= set(ok["backend"]) and ok["check_passed"].all()
    assert (df[df["backend"] == "flashinfer"]["status"] == "unsupported").all()
    assert "wrote " in proc.stdout and "unsupported" in proc.stdout


# -------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_run_on_the_gpu_times_cold_caches_with_cuda_graphs():
    cases = sweep([4], [1000], heads=[(8, 2)], head_dims=[128], kv_dtypes=["bf16", "fp8_e4m3"],
                  modes=["dequant", "fp8"], backends=["triton", "flashinfer"], flashinfer_tensor_cores=[True])
    df = run(cases, rep=20, progress=False)
    ok = df[df["status"] == "ok"]
    assert set(ok["backend"]) >= {"triton"}, df[["label", "status", "reason"]]
    assert (ok["timing"] == "cuda-graph").all() and ok["check_passed"].all()
    assert (ok["kv_copies"] > 1).all()  # a 4 x 1000-token cache is far smaller than 4 x L2: rotated
    assert (ok["gbps"] > 0).all() and ok["copy_gbps"].gt(0).all()
    assert (df["status"] != "error").all(), df.loc[df["status"] == "error", ["label", "reason"]]


def test_results_markdown_side_by_side():
    import pandas as pd

    from fp8kv.bench import results_markdown

    base = dict(status="ok", check_passed=True, batch=64, context=16384, gbps=3000.0, pct_copy_bw=75.0)
    rows = [dict(base, backend="triton", variant=None, kv_dtype="fp8_e4m3", mode="dequant", time_us=600.0),
            dict(base, backend="triton", variant=None, kv_dtype="bf16", mode="dequant", time_us=960.0),
            dict(base, backend="flashinfer", variant="tc", kv_dtype="fp8_e4m3", mode="dequant", time_us=900.0),
            dict(base, backend="flashinfer", variant="tc", kv_dtype="bf16", mode="dequant", time_us=990.0),
            dict(base, backend="triton", variant=None, kv_dtype="fp8_e4m3", mode="fp8", time_us=5.0,
                 check_passed=False)]  # a failed check never reaches the table
    md = results_markdown(pd.DataFrame(rows)).splitlines()
    assert md[0].startswith("| B | ctx | Triton fp8 µs | Triton bf16 µs | FlashInfer fp8 µs |")
    assert "fp8-mode" not in md[0]
    assert md[2] == "| 64 | 16384 | 600.0 | 960.0 | 900.0 | 990.0 | 3000 | 75 | 1.60 | 1.50 |"


def test_tune_preset_varies_one_launch_option_at_a_time():
    from fp8kv.bench import PRESETS, sweep

    cases = sweep(**PRESETS["tune"])
    assert len(cases) == 3 * 11
    variants = {c.variant for c in cases}
    assert "" in variants and "convert=cast" in variants and "convert=cast/ptx" in variants and "num_splits=16" in variants
    assert all(len(c.options) <= 1 for c in cases)  # each variant changes one option from the defaults


# ------------------------------------------------------------------------------------- planned calls
def test_planned_call_validates_once_and_matches_decode():
    """The benchmark times fp8kv.backends.planned: checked when planned, identical to fp8kv.decode."""
    import fp8kv
    from fp8kv.backends import planned

    c = synthetic_cache(3, 21, 2, 16, kv_dtype="fp8_e4m3", granularity="head", chunk_elems=500, seed=1, device="cpu")
    q = torch.randn(3, 4, 16, generator=seeded(3)).to(torch.float16)
    call = planned(q, c, "reference", "dequant", window=8)
    for got, want in zip(call(), fp8kv.decode(q, c, backend="reference", mode="dequant", window=8), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="num_splits"):  # launch options are checked against the backend
        planned(q, c, "reference", "dequant", num_splits=2)
    bad = c.clone()
    bad.block_table[0, 0] = c.num_blocks  # a table edited in place: caught when planning, not per call
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]"):
        planned(q, bad, "reference", "dequant")
    with pytest.raises(ValueError, match="q"):
        planned(torch.full_like(q, float("nan")), c, "reference", "dequant")


# ---------------------------------------------------------------------------------------- page sizes
def test_page_sizes_preset_covers_1_to_128_with_peers_and_runs_fp8kv_everywhere():
    from fp8kv.bench import PAGE_SIZES, PRESETS

    cases = sweep(**{**PRESETS["page-sizes"], "q_dtype": "bf16"}, arch="sm90", memory_budget_bytes=2**50)
    assert {c.block_size for c in cases} == set(PAGE_SIZES) and min(PAGE_SIZES) == 1 and max(PAGE_SIZES) == 128
    assert any(p & (p - 1) for p in PAGE_SIZES)  # a page size that is not a power of two
    assert {c.backend for c in cases} == {"triton", "flashinfer", "vllm"}
    ours = [c for c in cases if c.backend == "triton"]
    assert all(c.status == "ready" for c in ours), [(c.block_size, c.reason) for c in ours if c.status != "ready"]


def test_page_size_table_reads_each_decode_against_its_own_16_token_pages():
    rows = []
    for backend, tc in (("triton", None), ("flashinfer", True)):
        for page, fp8_us in ((1, 40.0), (16, 30.0), (100, 33.0)):
            for kv, us in (("fp8_e4m3", fp8_us), ("bf16", 60.0)):
                for rep in (0.99, 1.01):  # repeats: the median
                    rows.append(dict(backend=backend, variant=None, tensor_cores=tc, kv_dtype=kv, batch=64,
                                     context=16384, block_size=page, time_us=us * rep * (2 if tc else 1),
                                     status="ok", check_passed=True))
    rows.append(dict(rows[0], time_us=1.0, check_passed=False))  # a row that failed its check does not count
    t = bench.page_size_table(pd.DataFrame(rows)).set_index(["backend", "block_size"])
    assert len(t) == 6
    assert t.loc[("triton", 1), "fp8_us"] == pytest.approx(40.0)
    assert t.loc[("triton", 1), "fp8_rate_of_page_16"] == pytest.approx(0.75)
    assert t.loc[("flashinfer", 100), "fp8_rate_of_page_16"] == pytest.approx(30 / 33)
    assert t.loc[("triton", 16), "fp8_x_bf16"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="page_size_table"):
        bench.page_size_table(pd.DataFrame(rows).assign(status="error"))
    with pytest.raises(ValueError, match=r"baseline_page=32, .* pages of \[1, 16, 100\]"):
        bench.page_size_table(pd.DataFrame(rows), baseline_page=32)


# ---------------------------------------------------------------------------------------- layouts
def test_layouts_preset_sweeps_model_head_layouts_not_every_pairing():
    from fp8kv.bench import PRESETS

    grid = PRESETS["layouts"]
    cases = sweep(**grid, arch="sm90", memory_budget_bytes=2**50)
    shapes = {(c.num_q_heads, c.num_kv_heads, c.head_dim) for c in cases}
    assert shapes == set(grid["shapes"])  # the triples, not heads x head_dims
    groups = {hq // hkv for hq, hkv, _ in shapes}
    assert {1, 4, 5, 7, 8, 71} <= groups and {64, 80, 96, 112, 128, 256} <= {d for *_, d in shapes}
    assert any(c.batch * c.context >= 64 * 1024 for c in cases) and any(c.batch == 1 for c in cases)
    fi = [c for c in cases if c.backend == "flashinfer"]
    # FlashInfer builds head dims 64/128/256 only: the others are rows with the reason, not launches
    assert all(c.status == "unsupported" and "head_dim" in c.reason for c in fi if c.head_dim not in (64, 128, 256))
    with pytest.raises(ValueError, match="shapes entry"):
        sweep([1], [16], shapes=[(32, 8)], memory_budget_bytes=2**40)


def _layout_rows():
    key = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, batch=64, context=16384, status="ok", check_passed=True,
               copy_gbps=4000.0)
    fp8_kv, bf16_kv = 1_000_000_000, 2_000_000_000
    return pd.DataFrame([
        dict(key, backend="triton", label="triton bf16 dequant", kv_dtype="bf16", time_us=500.0, kv_bytes=bf16_kv),
        dict(key, backend="triton", label="triton fp8_e4m3 dequant", kv_dtype="fp8_e4m3", time_us=300.0, kv_bytes=fp8_kv,
             rel_err=1e-3),
        dict(key, backend="triton", label="triton fp8_e4m3 fp8", kv_dtype="fp8_e4m3", time_us=280.0, kv_bytes=fp8_kv,
             kernel="triton-tc", rel_err=1.5e-3),
        dict(key, backend="triton", label="triton-x fp8_e4m3 dequant", kv_dtype="fp8_e4m3", time_us=10.0,
             kv_bytes=fp8_kv, check_passed=False),  # a wrong answer never wins
        dict(key, backend="flashinfer", label="flashinfer-tc bf16 dequant", kv_dtype="bf16", time_us=520.0,
             kv_bytes=bf16_kv, rel_err=1e-4),  # a 16-bit peer's error is no FP8 comparison
        dict(key, backend="flashinfer", label="flashinfer-tc fp8_e4m3 dequant", kv_dtype="fp8_e4m3", time_us=540.0,
             kv_bytes=fp8_kv, rel_err=3e-3),
        dict(key, backend="vllm", label="vllm fp8_e4m3 dequant", kv_dtype="fp8_e4m3", time_us=600.0,
             kv_bytes=fp8_kv, rel_err=2e-3),  # the most accurate FP8 peer, though not the fastest
        dict(key, num_q_heads=32, num_kv_heads=32, backend="triton", label="triton bf16 dequant", kv_dtype="bf16",
             time_us=2000.0, kv_bytes=4 * bf16_kv),
    ])


def test_layout_table_rates_speedups_and_limit_by_hand():
    from fp8kv.bench import layout_markdown, layout_table

    t = layout_table(_layout_rows())
    assert len(t) == 2
    r = t[t["num_kv_heads"] == 8].iloc[0]
    assert r["fp8_us"] == 280.0 and r["fp8_row"] == "triton fp8_e4m3 fp8" and r["fp8_kernel"] == "triton-tc"
    assert r["peer_us"] == 520.0 and r["peer"] == "flashinfer-tc bf16 dequant" and r["bf16_us"] == 500.0
    assert r["fp8_x_peer"] == pytest.approx(520 / 280) and r["fp8_x_bf16"] == pytest.approx(500 / 280)
    assert r["bf16_gbps"] == pytest.approx(2e9 / 500e-6 / 1e9) and r["fp8_gbps"] == pytest.approx(1e9 / 280e-6 / 1e9)
    assert r["fp8_rate_of_bf16"] == pytest.approx((1e9 / 280) / (2e9 / 500))
    assert r["pct_of_limit"] == pytest.approx(100 * (1e9 / 280e-6 / 1e9) / 4000)
    assert r["fp8_rel_err"] == 1.5e-3 and r["peer_fp8_rel_err"] == 2e-3  # the row named; the peers' lowest FP8
    assert r["fp8_err_x_peer"] == pytest.approx(0.75)
    mha = t[t["num_kv_heads"] == 32].iloc[0]  # BF16 only: the FP8 and peer columns are NaN, not invented
    assert mha["bf16_us"] == 2000.0 and math.isnan(mha["fp8_us"]) and math.isnan(mha["fp8_x_bf16"])
    md = layout_markdown(t).splitlines()
    assert md[0].startswith("| Hq/Hkv/D | B × ctx | best peer (µs) |") and len(md) == 4
    assert "| 32/8/128 | 64 × 16k | 520.0 (FlashInfer tc bf16 dequant) | 500.0 | 280.0 (triton-tc) | 1.86 | 1.79 |" in md[3] + md[2]
    assert "| 32/32/128 | 64 × 16k | — | 2000.0 | — | — | — |" in md[2] + md[3]
    assert md[0].endswith("| FP8 error ÷ peers' lowest |") and "| 0.75 |" in md[2] + md[3]
    with pytest.raises(ValueError, match="lacks columns"):
        layout_table(pd.DataFrame({"time_us": [1.0]}))
    old = layout_table(_layout_rows().drop(columns="kernel"))  # a run saved before the kernel column
    assert old["fp8_kernel"].isna().all() and old["fp8_us"].equals(t["fp8_us"])
    assert "| 280.0 | 1.86 |" in layout_markdown(old)


def test_sweep_seed_reaches_every_case_and_is_checked():
    cases = sweep([1], [16], kv_dtypes=["fp16"], backends=["reference"], modes=["dequant"], seed=7,
                  memory_budget_bytes=2**40)
    assert cases and all(c.seed == 7 for c in cases)
    with pytest.raises(TypeError, match="seed"):
        sweep([1], [16], seed=1.5, memory_budget_bytes=2**40)


def test_best_per_configuration_takes_the_highest_share_of_each():
    from fp8kv.bench import best_per_configuration

    base = dict(status="ok", batch=1, context=16, time_us=1.0, gbps=1.0, mode="dequant")
    df = pd.DataFrame([dict(base, label="a", backend="triton", variant="", kv_dtype="bf16", pct_copy_bw=50.0),
                       dict(base, label="a", backend="triton", variant="", kv_dtype="bf16", pct_copy_bw=70.0, batch=8),
                       dict(base, label="b", backend="triton", variant="", kv_dtype="fp8_e4m3", pct_copy_bw=60.0),
                       dict(base, label="b", backend="triton", variant="", kv_dtype="fp8_e4m3", pct_copy_bw=99.0,
                            status="error")])
    best = best_per_configuration(df).set_index("label")
    assert best.loc["a", "pct_copy_bw"] == 70.0 and best.loc["a", "batch"] == 8
    assert best.loc["b", "pct_copy_bw"] == 60.0  # an errored row never counts


def test_saved_runs_by_preset_newest_first(tmp_path):
    from fp8kv.results import load_table, load_tables

    folder = tmp_path / "nvidia-h200"
    folder.mkdir()
    for stem, meta in (("20260101T000000Z", {"argv": ["--preset", "target"]}),  # named in argv only (older runs)
                       ("20260102T000000Z", {"preset": "layouts"}),
                       ("20260103T000000Z", {"preset": "target"})):
        pd.DataFrame({"x": [int(stem[6:8])]}).to_csv(folder / f"{stem}.csv", index=False)
        (folder / f"{stem}.json").write_text(json.dumps(meta))
    newest = load_table(tmp_path, "nvidia-h200", preset="target")
    assert newest["x"].tolist() == [3] and newest.attrs["csv"] == "20260103T000000Z.csv"
    both = load_tables(tmp_path, "nvidia-h200", preset="target")
    assert both["x"].tolist() == [1, 3] and both.attrs["csv"] == ["20260101T000000Z.csv", "20260103T000000Z.csv"]
    assert load_table(tmp_path, "nvidia-h200")["x"].tolist() == [3]
    assert load_table(tmp_path, "nvidia-h200", preset="window") is None
    assert load_tables(tmp_path, "nvidia-a100") is None
    with pytest.raises(ValueError, match="slug"):
        load_table(tmp_path, "../etc")


def test_layout_table_names_its_page_layout():
    from fp8kv.bench import layout_table
    from fp8kv.viz import layout_speedups

    assert set(layout_table(_layout_rows())["layout"]) == {"NHD"}  # runs saved without the column: NHD
    hnd = layout_table(_layout_rows().assign(layout="HND"))
    assert set(hnd["layout"]) == {"HND"}
    assert layout_speedups(hnd).layout.title.text.endswith(", HND pages")
    assert "pages" not in layout_speedups(layout_table(_layout_rows().assign(layout="NHD"))).layout.title.text
    with pytest.raises(ValueError, match="mixes layout"):
        layout_table(pd.concat([_layout_rows().assign(layout="NHD"), _layout_rows().assign(layout="HND")]))


def test_layout_table_refuses_rows_of_mixed_page_sizes():
    from fp8kv.bench import layout_table

    df = _layout_rows().assign(block_size=16)
    df.loc[0, "block_size"] = 32
    with pytest.raises(ValueError, match="mixes block_size"):
        layout_table(df)


def test_layouts_preset_takes_whole_layouts_from_the_command_line():
    from fp8kv.bench.cli import _grid_from_args, build_parser

    parser = build_parser()
    grid = _grid_from_args(parser.parse_args(["--preset", "layouts", "--heads", "8:2", "--head-dims", "64"]),
                           torch.device("cpu"))
    assert "shapes" not in grid and grid["heads"] == [(8, 2)] and grid["head_dims"] == [64]
    with pytest.raises(ValueError, match="both --heads and --head-dims"):
        _grid_from_args(parser.parse_args(["--preset", "layouts", "--head-dims", "96"]), torch.device("cpu"))


def test_probe_us_is_the_middle_of_three_timings_per_decode():
    calls = []
    us = bench.probe_us(lambda: calls.append(time.sleep(0.002)), 2, "cpu")  # two "decodes" of ~1 ms each
    assert len(calls) == 4  # one call first, then three timings (one call each on a CPU)
    assert 1000 <= us < 50_000


def test_page_layout_from_the_command_line(capsys):
    """--page-layout HND reaches every case (and the dry-run listing); vLLM's kernel (NHD only) stays in the
    table, refused by name."""
    from fp8kv.bench.cli import _grid_from_args, build_parser

    parser = build_parser()
    assert "layout" not in _grid_from_args(parser.parse_args(["--preset", "smoke"]), torch.device("cpu"))
    grid = _grid_from_args(parser.parse_args(["--preset", "smoke", "--page-layout", "HND"]), torch.device("cpu"))
    cases = bench.sweep(**{**grid, "backends": ["triton", "vllm"]}, device="cpu")
    assert cases and all(c.layout == "HND" for c in cases)
    vllm = [c for c in cases if c.backend == "vllm"]
    assert vllm and all(c.status == "unsupported" and "NHD" in c.reason for c in vllm)
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "smoke", "--page-layout", "hnd"])
    assert bench.main(["--preset", "smoke", "--page-layout", "HND", "--dry-run", "--device", "cpu"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if "page=" in line]
    assert listed and all(" HND " in line for line in listed)


def test_saved_runs_of_one_second_in_save_order(tmp_path):
    from fp8kv.results import load_table

    folder = tmp_path / "nvidia-h200"
    folder.mkdir()
    for n, stem in enumerate(("20260101T000000Z", "20260101T000000Z-2", "20260101T000000Z-10")):
        pd.DataFrame({"x": [n]}).to_csv(folder / f"{stem}.csv", index=False)
        (folder / f"{stem}.json").write_text(json.dumps({"argv": ["--preset=layouts"]}))
    assert load_table(tmp_path, "nvidia-h200", preset="layouts")["x"].tolist() == [2]  # -10 is the newest


def test_layouts_cuda_core_preset_times_both_kernels_on_small_groups():
    from fp8kv.bench import PRESETS

    cases = sweep(**PRESETS["layouts-cuda-core"], arch="sm90", memory_budget_bytes=2**50)
    tri = [c for c in cases if c.backend == "triton"]
    assert {(c.num_q_heads // c.num_kv_heads) for c in tri} == {1, 2}
    kernels = {c.options.get("use_tensor_cores", True) for c in tri if c.kv_dtype == "fp8_e4m3"}
    assert kernels == {True, False}
    assert any(c.backend == "flashinfer" and c.status == "ready" for c in cases)


def _row_launch(case: Case, cache):
    """What a bench row says of the Triton launch of ``case`` over ``cache``: its planned call's plan."""
    from fp8kv.backends import planned

    q = torch.randn(case.batch, case.num_q_heads, case.head_dim, dtype=torch.bfloat16)  # planned, never run
    return bench.measure.planned_launch(planned(q, cache, "triton", case.mode, **case.options))


def test_triton_opt_gluon_is_a_switch(monkeypatch):
    import argparse

    from fp8kv import ops
    from fp8kv.bench.cli import _kv_opt

    assert _kv_opt("gluon=1") == ("gluon", True)
    assert _kv_opt("gluon=0") == ("gluon", False)
    with pytest.raises(argparse.ArgumentTypeError, match="gluon=1"):
        _kv_opt("gluon=2")
    assert _kv_opt("block_n=64") == ("block_n", 64)
    cache = synthetic_cache(2, 64, 2, 128, kv_dtype="fp8_e4m3", device="cpu")
    case = Case(2, 64, 8, 2, 128, kv_dtype="fp8_e4m3", options={"gluon": True, "block_n": 128})
    with pytest.raises(UnsupportedError, match="CUDA GPU only"):  # no GPU here: the row says unsupported
        _row_launch(case, cache)
    monkeypatch.setattr(ops.decode.planning, "gluon_refusal", lambda *a, **k: None)  # as on a GPU where it runs
    launch = _row_launch(case, cache)
    assert launch["kernel"] == "gluon"
    assert (launch["block_n"], launch["num_stages"], launch["num_warps"]) == (128, 4, 4)  # the Gluon launch
    auto = _row_launch(Case(2, 64, 8, 2, 128, kv_dtype="fp8_e4m3"), cache)
    assert auto["kernel"] == "triton"  # splits of 64 tokens: latency-bound, the Triton kernel's
    monkeypatch.setitem(ops.GLUON_MIN_SPLIT_TOKENS, 1, 64)
    auto = _row_launch(Case(2, 64, 8, 2, 128, kv_dtype="fp8_e4m3"), cache)
    assert (auto["kernel"], auto["block_n"]) == ("gluon", 64)  # the default where Gluon runs
    tuned = Case(2, 64, 8, 2, 128, kv_dtype="fp8_e4m3", options={"block_n": 32})
    assert _row_launch(tuned, cache)["kernel"] == "triton"  # a Triton override


def test_a_rows_kernel_is_the_kernel_its_plan_runs(monkeypatch):
    """A row names the kernel and launch of the plan its timed call runs (read from it, not worked out again),
    and paged_decode maps the same options to the same choice: out_dtype and an empty eviction_policy among a
    case's options reach the kernel choice as no option ("" is no policy, out_dtype changes no launch); passed
    raw, they made the Gluon kernel refuse on paper, so a row named the Triton kernel while the Gluon kernel ran."""
    from fp8kv import ops

    seen = []

    class Chosen(Exception):
        pass

    def recording(batch, cache, mode, head_dim, group, device, **kw):
        seen.append(kw)
        if len(seen) > 1:
            raise Chosen  # paged_decode's choice is made: nothing to launch
        return "gluon", dict(num_splits=4, tokens_per_split=16, block_n=128, num_warps=4, num_stages=3,
                             heads_per_program=4, head_tiles=1)

    monkeypatch.setattr(ops.decode.planning, "decode_launch", recording)
    case = Case(2, 64, 8, 2, 64, kv_dtype="fp8_e4m3", options={"out_dtype": torch.float32, "eviction_policy": ""})
    cache = synthetic_cache(2, 64, 2, 64, kv_dtype="fp8_e4m3", device="cpu")
    row = _row_launch(case, cache)
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)  # the case's q_dtype
    with pytest.raises(Chosen):
        ops.paged_decode(q, cache, out_dtype=torch.float32, eviction_policy="")
    assert (row["kernel"], row["num_splits"], row["block_n"], row["num_stages"]) == ("gluon", 4, 128, 3)
    given = [{k: v for k, v in kw.items() if v is not None} for kw in seen]  # None: not given, either way
    assert given[0] == given[1] and "out_dtype" not in seen[0] and seen[0]["eviction_policy"] is None


@pytest.mark.parametrize("opt, match", [("block_n=48", "block_n=48; expected a power of two up to 256"),
                                        ("num_warps=3", r"num_warps=3; expected one of \(1, 2, 4, 8, 16\)"),
                                        ("num_stages=99", "num_stages=99; expected 1 to 8")])
def test_a_triton_opt_no_kernel_takes_is_a_usage_error_before_a_dry_run(opt, match, capsys):
    """A dry run called such rows ready, and every real run then failed each case."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--preset", "formats-smoke", "--interpret", "--dry-run", "--triton-opt", opt])
    assert exc.value.code == 2 and re.search(match, capsys.readouterr().err)


def test_one_triton_opt_key_twice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "1", "--contexts", "32", "--backends", "triton", "--no-save", "--device", "cpu",
                    "--triton-opt", "num_splits=2", "--triton-opt", "num_splits=3"])
    assert exc.value.code == 2 and "--triton-opt num_splits is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("given, exc, words", [({"gbps": -5.0}, ValueError, r"copy_bandwidth\['gbps'\]=-5.0"),
                                               ({"x": 1}, ValueError, "holds 'gbps'"),
                                               (float("inf"), ValueError, "copy_bandwidth=inf"),
                                               (-1, ValueError, "copy_bandwidth=-1")])
def test_a_copy_bandwidth_that_is_no_bandwidth_is_refused(given, exc, words):
    """Every row's % of copy is a share of it: a negative or infinite one would print as a number."""
    with pytest.raises(exc, match=words):
        bench.measure.resolve_copy_bandwidth(given, torch.device("cpu"))


def test_a_run_where_every_case_was_refused_at_launch_exits_2(capsys):
    """gluon=True outside the Gluon kernel's shapes is known only when a case launches: nothing ran, which is no
    success (exit 0 said every case ran and passed)."""
    rc = bench.main(["--batches", "1", "--contexts", "32", "--heads", "4:2", "--head-dims", "16", "--kv-dtypes",
                     "fp8_e4m3", "--modes", "dequant", "--backends", "triton", "--triton-opt", "gluon=1", "--no-save",
                     "--quiet", "--device", "cpu"])
    assert rc == 2 and "none of the 1 cases ran here" in capsys.readouterr().err


GRID = ["--heads", "4:2", "--head-dims", "64", "--backends", "reference", "--kv-dtypes", "fp16", "--device", "cpu",
        "--no-save", "--quiet"]


@pytest.mark.parametrize("argv, refused, batches, contexts", [
    # one case, too large for the default budget (the free memory)
    (["--batches", "4096", "--contexts", "1000000"], "1 of 1 cases", "4096", "1000000"),
    # several, all too large for a budget given
    (["--batches", "2", "8", "--contexts", "48", "96", "--memory-budget-gb", "1e-9"], "4 of 4 cases", "2 8", "48 96"),
    # too large beside cases refused for another reason: both said, the memory with its arguments
    (["--batches", "2", "--contexts", "48", "--modes", "dequant", "fp8", "--kv-dtypes", "fp16", "fp8_e4m3",
      "--memory-budget-gb", "1e-9"], "2 of 3 cases", "2", "48"),
])
def test_a_grid_that_does_not_fit_names_batches_and_contexts(capsys, argv, refused, batches, contexts):
    """Nothing fits: one line naming the arguments to change (--batches, --contexts, --memory-budget-gb) with the
    sizes asked and the least a case needs (it said only 'does not fit: needs ~X GiB, budget Y GiB')."""
    with pytest.raises(SystemExit) as exc:
        bench.main([*GRID, *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "none of the" in err and "does not fit the memory budget of" in err and f"({refused};" in err
    assert f"pass smaller --batches (now {batches}) or --contexts (now {contexts}), or a larger --memory-budget-gb" \
        in err


def test_a_grid_that_partly_fits_says_which_arguments_bring_the_rest_in(capsys):
    rc = bench.main([*GRID, "--batches", "2", "4096", "--contexts", "48", "1000000", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 0 and "warning: does not fit the memory budget of" in err and "(1 of 4 cases;" in err
    assert "batch 4096 x context 1000000" in err and "--batches (now 2 4096) or --contexts (now 48 1000000)" in err


# The first case's compile lets a library (LLVM inside Triton) take SIGTERM; a `timeout` then stops the run
# during the second. In a child process: where the CLI does not take the handler back, the signal ends it.
TIMEOUT_AFTER_A_LIBRARY_TOOK_SIGTERM = LIBRARY_TAKES_SIGTERM + """
import os, sys
from fp8kv import bench
measure_one = bench.measure._measure
def measured(c, *args, **kwargs):
    if c.batch == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    row = measure_one(c, *args, **kwargs)
    library_takes_sigterm()
    return row
bench.measure._measure = measured
if sys.argv[2] == "as-is":
    bench.measure.reclaim_stop_signals = lambda: None
sys.exit(bench.main(["--batches", "1", "2", "--contexts", "16", "--heads", "2:1", "--head-dims", "16",
                     "--kv-dtypes", "fp16", "--modes", "dequant", "--backends", "reference", "--out", sys.argv[1],
                     "--quiet", "--device", "cpu"]))
"""


@pytest.mark.parametrize("reclaim", [True, False])
def test_a_timeout_after_triton_took_sigterm_keeps_the_rows(tmp_path, reclaim):
    import signal

    got = subprocess.run([sys.executable, "-c", TIMEOUT_AFTER_A_LIBRARY_TOOK_SIGTERM, str(tmp_path),
                          "reclaim" if reclaim else "as-is"], capture_output=True, text=True, timeout=300)
    saved = list(tmp_path.glob("*/*.csv"))
    if not reclaim:  # the control: without taking the handler back the process ends and the row is lost
        assert got.returncode == -signal.SIGTERM and not saved, (got.returncode, got.stderr)
        return
    assert got.returncode == 130 and "interrupted" in got.stderr, (got.returncode, got.stderr)
    rows = pd.read_csv(saved[0])
    assert list(rows["status"]) == ["ok", "skipped"] and list(rows["batch"]) == [1, 2]


def test_the_stages_preset_sets_two_stages_against_three_on_the_triton_kernel(monkeypatch):
    """Each point: the default launch, the Triton kernel with its rule (two stages) and with three, and
    FlashInfer's two decodes where it builds the head dim."""
    from fp8kv.bench import PRESETS, sweep

    grid = PRESETS["stages"]
    assert grid["triton_options"] == [{}, {"gluon": False}, {"gluon": False, "num_stages": 3}]
    cases = sweep(**grid, arch="sm90", memory_budget_bytes=2**40, device="cpu", q_dtype="bf16")
    triton = [c for c in cases if c.backend == "triton"]
    assert {c.status for c in triton} == {"ready"} and len(triton) == 3 * 3 * 2 * 6
    assert {c.head_dim for c in cases if c.backend == "flashinfer" and c.status != "ready"} == {80}
    # what the two Triton rows launch: the Triton kernel, with the rule's two stages and with three
    import torch

    from fp8kv.cache import PagedKVCache
    from fp8kv.ops.decode import splits
    from fp8kv.ops.decode.planning import launch_for

    monkeypatch.setattr(splits, "interpreter_on", lambda: False)  # the rule as a GPU takes it (no table here)
    for hq, hkv, d in grid["shapes"]:
        cache = PagedKVCache.empty(1, 4096, hkv, d, block_size=16, kv_dtype="fp8_e4m3")
        for options, stages in ((grid["triton_options"][1], 2), (grid["triton_options"][2], 3)):
            kernel, cfg = launch_for(64, cache, "dequant", hq // hkv, torch.device("cpu"), q_dtype=torch.bfloat16,
                                     **options)
            assert (kernel, cfg["num_stages"]) == ("triton", stages), (hq, hkv, d, options)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_run_refuses_a_keep_partial_that_is_not_a_bool(value):
    case = Case(2, 16, 2, 1, 16, kv_dtype="fp16", backend="reference", q_dtype="fp16")
    with pytest.raises(TypeError, match=rf"keep_partial={value!r} \({type(value).__name__}\); expected True or False"):
        run([case], copy_bandwidth=False, progress=False, cpu_reps=1, device="cpu", keep_partial=value)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: bench.time_call(lambda: None, "cpu", graph=False, rep=1, warmup=0, cpu_reps=0), ValueError, "cpu_reps=0"),
    (lambda: bench.probe_us(lambda: None, 0, "cpu"), ValueError, "calls=0"),  # a ZeroDivisionError before
    (lambda: bench.probe_us(lambda: None, -1, "cpu"), ValueError, "calls=-1")])  # negative microseconds before
def test_timing_helpers_refuse_counts_that_are_not_positive(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_time_call_takes_a_device_name():
    seconds, how = bench.time_call(lambda: None, "cpu", graph=False, rep=1, warmup=0, cpu_reps=2)
    assert how == "cpu-wallclock" and seconds >= 0


def test_time_long_call_times_a_cpu_call_by_wall_clock_and_checks_rep():
    calls = []
    seconds, how = bench.time_long_call(lambda: calls.append(time.sleep(0.002)), "cpu", graph=True, rep=5, cpu_reps=3)
    assert how == "cpu-wallclock" and len(calls) == 3 and 0.002 <= seconds < 1.0
    with pytest.raises(ValueError, match="rep=0"):
        bench.time_long_call(lambda: None, "cpu", graph=True, rep=0, cpu_reps=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_long_call_agrees_with_time_call_on_a_gpu():
    """A ~1-ms matmul chain timed replay by replay (time_long_call) and by do_bench_cudagraph (time_call): the
    same time within 15 %, as many calls as its replays say (1 warm-up, 1 estimate, >= 3 timed; capture runs
    nothing)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    ran = []

    def fn():
        ran.append(1)  # counted where Python runs it: the warm-up and the capture
        for _ in range(8):
            torch.matmul(a, a, out=out)

    long_s, how = bench.time_long_call(fn, "cuda", graph=True, rep=20, cpu_reps=1)
    assert how == "cuda-graph-replays" and len(ran) == 2
    ref_s, _ = bench.time_call(fn, "cuda", graph=True, rep=20, warmup=5, cpu_reps=1)
    assert abs(long_s / ref_s - 1) < 0.15, (long_s, ref_s)


def test_sweep_and_run_take_only_bools_for_their_flags():
    """bool("no") is True: a flag given as a string was read as its truthiness."""
    with pytest.raises(TypeError, match=r"flashinfer_tensor_cores\[0\]='no'"):
        bench.sweep([1], [16], backends=["flashinfer"], flashinfer_tensor_cores=["no"], device="cpu")
    with pytest.raises(TypeError, match="check='no'"):
        bench.run([], check="no")


def test_a_grid_with_no_case_says_why(capsys):
    """It said "none of the 0 cases can run here:" and nothing after the colon."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "2", "--contexts", "16", "--backends", "reference", "--kv-dtypes", "bf16",
                    "--modes", "fp8", "--dry-run", "--device", "cpu"])
    assert exc.value.code == 2 and "the grid holds no case" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtypes,why", [
    (["int4_token_head"], "(int4_token_head is a quantized format: its codes are dequantized to 16 bits in registers, "
                          "so it runs in dequant mode only)"),  # it said: an unquantized KV dtype has no fp8 mode
    (["bf16", "nvfp4"], "(fp8 mode needs an FP8 KV cache; a 16-bit cache runs in dequant mode; nvfp4 is a quantized "
                        "format"),
])
def test_a_grid_with_no_case_gives_each_dtypes_reason(kv_dtypes, why, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "2", "--contexts", "16", "--backends", "reference", "--kv-dtypes", *kv_dtypes,
                    "--modes", "fp8", "--dry-run", "--device", "cpu"])
    assert exc.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--kv-dtypes", "int8_token_head", "fp8_e4m3"], ["--preset", "formats-smoke"]])
def test_granularities_beside_a_quantized_format_are_refused(argv, capsys):
    """A format's rows dropped the granularities given (its scales have their own layout), silently."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "2", "--contexts", "16", "--backends", "reference", *argv, "--granularities", "head",
                    "--dry-run", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--granularities head: the scale layout of FP8 pages; the quantized formats " in err
    assert "int8_token_head" in err and "drop --granularities" in err
    assert bench.main(["--batches", "2", "--contexts", "16", "--backends", "reference", "--kv-dtypes", "fp8_e4m3",
                       "bf16", "--granularities", "head", "--dry-run", "--device", "cpu"]) == 0


def test_mode_refusal_is_the_capability_tables_fact():
    """What the bench drops and what the tables say come from one place."""
    from fp8kv.capability import check
    from fp8kv.capability_formats import FORMAT_MODE, format_capability, mode_refusal

    assert mode_refusal("fp8_e4m3", "fp8") is None and mode_refusal("int8_token_head", FORMAT_MODE) is None
    assert mode_refusal("bf16", "fp8") == check("triton", "bf16", "fp8", "sm90")[1]
    assert set(format_capability("sm90")["mode"]) == {FORMAT_MODE}
    with pytest.raises(ValueError, match="mode='int8'"):
        mode_refusal("bf16", "int8")


def test_a_page_layout_quantized_pages_do_not_have_is_refused(capsys):
    """QuantizedPagedKVCache stores NHD pages only: the rows of --page-layout HND said HND over NHD pages."""
    with pytest.raises(ValueError, match=r"layout='HND' \(--page-layout HND\): the quantized formats nvfp4 of kv_dtypes"):
        sweep([1], [16], heads=[(2, 1)], head_dims=[32], kv_dtypes=["fp16", "nvfp4"], backends=["reference"],
              modes=["dequant"], layout="HND", device="cpu", memory_budget_bytes=BIG)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "1", "--contexts", "16", "--heads", "2:1", "--head-dims", "32", "--kv-dtypes", "nvfp4",
                    "--backends", "reference", "--page-layout", "HND", "--dry-run", "--device", "cpu"])
    assert exc.value.code == 2 and "--page-layout HND" in capsys.readouterr().err
    cases = sweep([1], [16], heads=[(2, 1)], head_dims=[32], kv_dtypes=["nvfp4"], backends=["reference"],
                  modes=["dequant"], layout="NHD", device="cpu", memory_budget_bytes=BIG)
    assert [c.layout for c in cases] == ["NHD"]


@pytest.mark.parametrize("flags, words", [(["--triton-opt", "num_splits=2", "--backends", "reference"],
                                           "--triton-opt applies to the triton backend only, and the grid's backends "
                                           "(reference) have none"),
                                          (["--tensor-cores", "off", "--backends", "triton"],
                                           "--tensor-cores applies to the flashinfer backend only, and the grid's "
                                           "backends (triton) have none")])
def test_backend_flags_with_no_backend_to_take_them_are_refused(flags, words, capsys):
    """They were accepted and applied to nothing."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--batches", "1", "--contexts", "16", "--kv-dtypes", "fp16", *flags, "--dry-run", "--device", "cpu"])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_timing_longer_than_max_rep_ms_is_refused_by_name(capsys):
    """rep and warmup are milliseconds per timing, at most fp8kv.checks.MAX_REP_MS (a huge --rep ran for ever)."""
    from fp8kv.bench.attend import AttendCase, attend_run
    from fp8kv.bench.tune import tune
    from fp8kv.checks import MAX_REP_MS

    too_many = MAX_REP_MS + 1
    case = Case(2, 16, 2, 1, 16, kv_dtype="fp16", backend="reference", q_dtype="fp16")
    for name in ("rep", "warmup"):
        with pytest.raises(ValueError, match=rf"{name}={too_many}; expected an int <= {MAX_REP_MS}"):
            run([case], copy_bandwidth=False, progress=False, cpu_reps=1, device="cpu", **{name: too_many})
        with pytest.raises(ValueError, match=rf"{name}={too_many}; expected an int <= {MAX_REP_MS}"):
            attend_run([AttendCase(1, 16, 2, num_q_heads=2, num_kv_heads=1, head_dim=16, kv_dtype="fp16", backend="reference")],
                       copy_bandwidth=False, progress=False, device="cpu", **{name: too_many})
    with pytest.raises(ValueError, match=rf"rep={too_many}; expected an int <= {MAX_REP_MS}"):
        tune([(4, 2, 64)], device="cpu", rep=too_many)
    with pytest.raises(SystemExit) as exc:
        bench.main([*GRID, "--batches", "1", "--contexts", "16", "--rep", str(too_many)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--rep={too_many}; expected an int <= {MAX_REP_MS}" in err, err


def test_a_grid_too_large_by_its_new_tokens_names_q_lens(capsys):
    """A multi-token grid over the budget through --q-lens: the refusal names that flag and the least case's q_len,
    not only --batches and --contexts."""
    with pytest.raises(SystemExit) as exc:
        bench.main(["--preset", "spec-verify", "--q-lens", "100000000", "--backends", "reference", "--batches", "1",
                    "--contexts", "64", "--dry-run"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "x q_len 100000000, needs" in err and "or --q-lens (now 100000000)" in err, err
