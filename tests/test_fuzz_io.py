"""Property fuzzing of fp8kv's file readers and command lines (tests/test_fuzz.py has the property, the
profiles and the kernel / cache / quantizer families).

Readers (``fp8kv.results``, ``fp8kv.bench.report``, ``fp8kv.step.report``, the notebooks' index) are
given generated files in ``tmp_path``, intact and damaged (empty, truncated, not JSON, a JSON list,
missing or all-NaN columns, FP8-only runs): each either reads them or refuses with a ValueError /
TypeError naming the file or the column; never a pandas, json or Unicode error, a KeyError or an
IndexError. Command lines (``python -m fp8kv.bench``, ``fp8kv.step``, ``fp8kv.notebooks``,
``fp8kv.bench.tune``) get generated argv through their ``main(argv)``, with ``--dry-run`` or on paths
where nothing is run: each exits 0 or returns its documented status, or exits 2 with one line on
stderr naming the flag; never a traceback.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from test_fuzz import Refused, attempt, fuzz

from fp8kv import results
from fp8kv.bench import report as bench_report
from fp8kv.step import report as step_report

FOREIGN_ERRORS = ("pandas", "json", "numpy")


def read(call, names):
    """:func:`test_fuzz.attempt`, refusing also a named ValueError raised by pandas / json / a codec
    (its message names no file) and a bare FileNotFoundError that names none of ``names``."""
    try:
        return attempt(call, names)
    except Refused as r:
        exc = r.__cause__
        assert not type(exc).__module__.startswith(FOREIGN_ERRORS) and not isinstance(exc, UnicodeError), \
            f"a {type(exc).__module__}.{type(exc).__name__} escaped: {exc}"
        raise
    except FileNotFoundError as exc:
        assert any(n in str(exc) for n in names), f"FileNotFoundError names none of {names}: {exc}"
        raise Refused from exc


# ------------------------------------------------------------------------------------------ damaged files
VALID_DOC = {"device": "cpu", "results": {"a": 1.5, "b": [1, 2]}}
DAMAGE = st.sampled_from(["intact", "empty", "truncated", "list", "results-list", "garbage-bytes", "nan-literal",
                          "folder", "missing", "utf16", "null"])


def damaged_json(path, damage: str, text: str, cut: int = 7) -> None:
    if damage == "missing":
        return
    if damage == "folder":
        path.mkdir()
        return
    body = {"intact": text, "empty": "", "truncated": text[: max(1, len(text) * cut // 10)],
            "list": "[1, 2]", "results-list": json.dumps({"results": [1]}), "nan-literal": '{"results": NaN}',
            "null": "null"}.get(damage)
    if damage == "garbage-bytes":
        path.write_bytes(b"\xff\xfe\x00{\x80")
    elif damage == "utf16":
        path.write_bytes(text.encode("utf-16"))
    else:
        path.write_text(body)


@fuzz(10)
@given(damage=DAMAGE, cut=st.integers(1, 9))
def test_load_results(tmp_path_factory, damage, cut):
    out = tmp_path_factory.mktemp("results") / "cpu"  # a report root of one GPU folder
    out.mkdir()
    damaged_json(out / "nb.json", damage, json.dumps(VALID_DOC), cut)
    try:
        doc = read(lambda: results.load_results(out, "nb"), ("nb.json",))
    except Refused:
        assert damage != "intact"
        return
    assert damage == "intact" and doc["results"] == VALID_DOC["results"]
    assert results.collect_results("nb", out.parent).get(out.name) == doc


def bench_rows(seed: int, kv_dtypes=("bf16", "fp8_e4m3"), backends=("triton", "flashinfer")) -> pd.DataFrame:
    """Tidy rows as ``fp8kv.bench.run`` returns them (every column it writes), for a tiny grid."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch in (1, 4):
        for context in (16, 64):
            for backend in backends:
                for kv in kv_dtypes:
                    t = float(rng.uniform(5, 50))
                    rows.append(dict(
                        timestamp="20260101T000000Z", gpu="NVIDIA H200", gpu_slug="nvidia-h200", arch="sm90",
                        device="cuda:0", torch="2.13", triton="3.9", flashinfer="0.5", label=f"{backend} {kv} dequant",
                        backend=backend, variant="tc" if backend == "flashinfer" else "", mode="dequant", kv_dtype=kv,
                        granularity="tensor", layout="NHD", q_dtype="bf16", batch=batch, context=context,
                        window=np.nan, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, tensor_cores=True,
                        num_splits=1, block_n=64, num_warps=4, num_stages=2, timing="cuda-graph", time_us=t,
                        bytes=1e6, kv_bytes=9e5, gbps=1e6 / t / 1e3, pct_copy_bw=1e6 / t / 1e3 / 40.0, copy_gbps=4000.0,
                        kv_copies=1, rel_err=1e-3, tol=8e-3, check_passed=True, status="ok", reason=""))
    return pd.DataFrame(rows)


FRAME_DAMAGE = st.sampled_from(["intact", "fp8-only", "bf16-only", "empty", "drop-column", "nan-column",
                                "all-failed", "all-error", "no-flashinfer", "string-times", "duplicate-rows"])
READERS = {"speedup_table": bench_report.speedup_table, "best_per_configuration": bench_report.best_per_configuration,
           "layout_table": bench_report.layout_table, "summary": bench_report.summary,
           "results_markdown": bench_report.results_markdown, "all_checks_passed": bench_report.all_checks_passed,
           "layout_markdown": lambda df: bench_report.layout_markdown(bench_report.layout_table(df))}


def damaged_frame(damage: str, seed: int, column: str) -> pd.DataFrame:
    df = bench_rows(seed)
    if damage == "fp8-only":
        return df[df["kv_dtype"] != "bf16"].reset_index(drop=True)
    if damage == "bf16-only":
        return df[df["kv_dtype"] == "bf16"].reset_index(drop=True)
    if damage == "no-flashinfer":
        return df[df["backend"] != "flashinfer"].reset_index(drop=True)
    if damage == "empty":
        return df.iloc[:0]
    if damage == "drop-column":
        return df.drop(columns=[column])
    if damage == "nan-column":
        return df.assign(**{column: np.nan})
    if damage == "all-failed":
        return df.assign(check_passed=False)
    if damage == "all-error":
        return df.assign(status="error", time_us=np.nan, reason="boom")
    if damage == "string-times":
        return df.assign(time_us=df["time_us"].astype(str))
    if damage == "duplicate-rows":
        return pd.concat([df, df], ignore_index=True)
    return df


@fuzz(25)
@given(reader=st.sampled_from(sorted(READERS)), damage=FRAME_DAMAGE, seed=st.integers(0, 5),
       column=st.sampled_from(["time_us", "kv_dtype", "status", "check_passed", "label", "backend", "batch",
                               "context", "gbps", "pct_copy_bw", "layout", "timestamp", "variant", "mode"]))
@example(reader="results_markdown", damage="fp8-only", seed=0, column="time_us")
@example(reader="results_markdown", damage="drop-column", seed=0, column="gbps")
@example(reader="summary", damage="drop-column", seed=0, column="batch")
@example(reader="results_markdown", damage="nan-column", seed=0, column="kv_dtype")
@example(reader="best_per_configuration", damage="drop-column", seed=0, column="kv_dtype")
@example(reader="all_checks_passed", damage="drop-column", seed=0, column="status")
@example(reader="layout_markdown", damage="empty", seed=0, column="time_us")
@example(reader="results_markdown", damage="string-times", seed=0, column="time_us")
@example(reader="layout_markdown", damage="all-failed", seed=0, column="time_us")
@example(reader="summary", damage="no-flashinfer", seed=0, column="time_us")
def test_bench_readers(reader, damage, seed, column):
    """Every reader of a run's rows: a named refusal (the column, or ``df``) or an answer; and where the
    rows are intact, speedups that are the ratio of the times they name."""
    df = damaged_frame(damage, seed, column)
    try:
        out = read(lambda: READERS[reader](df), (column, "df", "rows", "no ", "none", "nothing"))
    except Refused:
        assert damage not in ("intact", "duplicate-rows", "no-flashinfer"), f"{reader} refused {damage} rows"
        return
    if reader == "speedup_table" and len(out):
        ratio = out["bf16_us"] / out["time_us"]
        both = ratio.notna() & out["speedup_vs_bf16"].notna()
        assert np.allclose(ratio[both], out["speedup_vs_bf16"][both])
        if damage == "intact":
            assert both.all() and (out["speedup_vs_bf16"] > 0).all()
    if isinstance(out, str):
        assert "nan" not in out.lower().replace("nanoseconds", "") or damage in ("nan-column", "all-error"), out


CSV_DAMAGE = st.sampled_from(["intact", "empty-csv", "header-only", "truncated-csv", "meta-truncated", "meta-list",
                              "meta-missing", "meta-empty", "binary-csv", "csv-folder", "ragged-csv"])


@fuzz(12)
@given(damage=CSV_DAMAGE, loader=st.sampled_from(["load_table", "load_tables"]), preset=st.sampled_from([None, "smoke"]))
@example(damage="empty-csv", loader="load_table", preset=None)
@example(damage="meta-truncated", loader="load_tables", preset=None)
@example(damage="meta-list", loader="load_table", preset=None)
@example(damage="meta-empty", loader="load_table", preset=None)
@example(damage="ragged-csv", loader="load_table", preset=None)
@example(damage="binary-csv", loader="load_tables", preset=None)
@example(damage="csv-folder", loader="load_table", preset=None)
def test_saved_tables(tmp_path_factory, damage, loader, preset):
    """A saved bench table damaged after it was written: read, or refused naming the file."""
    out = tmp_path_factory.mktemp("bench")
    df = bench_rows(0)
    path = results.save_table(df, out, meta={"preset": "smoke"})
    meta = path.with_suffix(".json")
    text = path.read_text()
    {"intact": lambda: None, "empty-csv": lambda: path.write_text(""),
     "header-only": lambda: path.write_text(text.splitlines()[0] + "\n"),
     "truncated-csv": lambda: path.write_text(text[: len(text) // 3]),
     "meta-truncated": lambda: meta.write_text(meta.read_text()[:20]),
     "meta-list": lambda: meta.write_text("[]"), "meta-missing": lambda: meta.unlink(),
     "meta-empty": lambda: meta.write_text(""), "binary-csv": lambda: path.write_bytes(b"\xff\xfe\x00\x01\x80,\n\x00"),
     "csv-folder": lambda: (path.unlink(), path.mkdir()),
     "ragged-csv": lambda: path.write_text(text + "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,"
                                           "24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44\n")}[damage]()
    try:
        got = read(lambda: getattr(results, loader)(out, "nvidia-h200", preset=preset), (path.name, meta.name, "slug"))
    except Refused:
        assert damage not in ("intact", "meta-missing"), f"{loader} refused a {damage} table"
        return
    if damage == "intact":
        assert got is not None and len(got) == len(df)
    if got is not None and damage not in ("header-only", "truncated-csv"):
        assert len(got) >= len(df) or damage == "ragged-csv"


STEP_DAMAGE = st.sampled_from(["intact", "fp8-only", "empty", "drop-column", "nan-column", "all-error"])


def step_rows(seed: int) -> pd.DataFrame:
    from fp8kv.step.measure import COLUMNS

    rng = np.random.default_rng(seed)
    rows = []
    for kv in ("bf16", "fp8_e4m3"):
        for batch in (1, 4, 16):
            r = dict.fromkeys(COLUMNS)
            step_us = float(rng.uniform(100, 1000))
            r.update(timestamp="20260101T000000Z", gpu_slug="nvidia-h200", model="Qwen3-0.6B", kv_dtype=kv,
                     backend="triton", mode="dequant", batch=batch, context=4096, ceiling=16, step_us=step_us,
                     tokens_per_s=batch / step_us * 1e6, attention_us=step_us / 3, attention_share=1 / 3,
                     gbps=100.0, pct_copy_bw=10.0, status="ok", reason="", logits_finite=True)
            rows.append(r)
    return pd.DataFrame(rows)


@fuzz(10)
@given(reader=st.sampled_from(["reading", "reading_markdown", "summary"]), damage=STEP_DAMAGE,
       column=st.sampled_from(["step_us", "kv_dtype", "status", "batch", "tokens_per_s", "model", "context"]))
@example(reader="summary", damage="drop-column", column="step_us")
@example(reader="reading", damage="drop-column", column="model")
@example(reader="reading", damage="nan-column", column="tokens_per_s")
@example(reader="reading", damage="nan-column", column="batch")
def test_step_readers(reader, damage, column):
    df = step_rows(0)
    df = {"intact": df, "fp8-only": df[df["kv_dtype"] != "bf16"], "empty": df.iloc[:0],
          "drop-column": df.drop(columns=[column]), "nan-column": df.assign(**{column: np.nan}),
          "all-error": df.assign(status="error", step_us=np.nan)}[damage]
    try:
        read(lambda: getattr(step_report, reader)(df), (column, "df", "rows", "no "))
    except Refused:
        assert damage != "intact", f"{reader} refused intact rows"


# ------------------------------------------------------------------------------------------ command lines
def run_cli(main, argv, capsys):
    """``(status, stderr)`` of ``main(argv)``: its return value or SystemExit code."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def assert_refused_by_flag(code, err, flags):
    """Exit status 2 and one line naming one of ``flags`` (as ``--flag-name`` or as its parameter, ``flag_name``)."""
    assert code == 2, f"exit status {code} for a bad argument; stderr: {err}"
    assert "Traceback" not in err and err.strip().count("\n") == 0, f"not one line: {err!r}"
    names = [*flags, *(f.lstrip("-").replace("-", "_") for f in flags if f.startswith("--"))]
    assert any(f in err for f in names), f"stderr names none of {flags}: {err}"


BENCH_OPTS = st.sampled_from([
    (["--batches", "1", "2"], True), (["--contexts", "16"], True), (["--heads", "4:2"], True),
    (["--head-dims", "16"], True), (["--block-sizes", "16"], True), (["--kv-dtypes", "fp16", "fp8_e4m3"], True),
    (["--modes", "dequant"], True), (["--backends", "reference"], True), (["--triton-opt", "num_splits=2"], True),
    (["--page-layout", "HND"], True), (["--memory-budget-gb", "1"], True), (["--rep", "3"], True),
    (["--batches", "0"], False), (["--batches", "1.5"], False), (["--contexts", "-4"], False),
    (["--heads", "4:3"], False), (["--heads", "0:0"], False), (["--head-dims", "nan"], False),
    (["--block-sizes", "12"], True), (["--block-sizes", "0"], False), (["--kv-dtypes", "fp4"], False),
    (["--triton-opt", "num_splits=0"], False), (["--triton-opt", "gluon=2"], False),
    (["--triton-opt", "bogus=1"], False), (["--memory-budget-gb", "nan"], False),
    (["--memory-budget-gb", "-1"], False), (["--memory-budget-gb", "inf"], False), (["--rep", "0"], False),
    (["--device", "meta"], False), (["--device", "cuda:7"], False), (["--preset", "nope"], False),
    (["--q-dtype", "fp64"], False), (["--contexts", "99999999999999999999"], True),
])


def flags_of(opts):
    return [o[0] for o, ok in opts if not ok]


@fuzz(20)
@given(opts=st.lists(BENCH_OPTS, min_size=0, max_size=4, unique_by=lambda o: o[0][0]),
       base=st.sampled_from([["--preset", "smoke"], ["--batches", "1", "--contexts", "16"], []]))
@example(opts=[(["--block-sizes", "0"], False)], base=["--batches", "1", "--contexts", "16"])
def test_bench_cli(opts, base, capsys):
    argv = ["--dry-run", "--device", "cpu", "--interpret", *base, *[a for o, _ in opts for a in o]]
    code, err = run_cli(__import__("fp8kv.bench.cli", fromlist=["main"]).main, argv, capsys)
    bad = flags_of(opts)
    if bad and not base:  # no grid asked for is a usage error too: naming it or a bad flag is right
        bad = [*bad, "--preset", "--batches"]
    if bad:
        assert_refused_by_flag(code, err, bad)
    elif code != 0:  # a legal grid that cannot run here is refused in one line (nothing to run)
        assert code == 2 and "Traceback" not in err and err.strip().count("\n") == 0, (code, err)


STEP_OPTS = st.sampled_from([
    (["--batches", "1"], True), (["--kv-dtypes", "fp8_e4m3"], True), (["--utilization", "0.5"], True),
    (["--block-size", "16"], True), (["--block-size", "32"], True), (["--gpu-memory", "H200"], True),
    (["--gpu-memory", "80"], True), (["--rep", "3"], True), (["--mode", "dequant"], True),
    (["--batches", "0"], False), (["--batches", "2.5"], False), (["--utilization", "nan"], False),
    (["--utilization", "0"], False), (["--utilization", "2"], False), (["--utilization", "inf"], False),
    (["--block-size", "12"], True), (["--block-size", "1"], True), (["--block-size", "0"], False),
    (["--gpu-memory", "-3"], False), (["--gpu-memory", "nan"], False), (["--gpu-memory", "B9000"], False),
    (["--gpu-memory", "1e-300"], False), (["--kv-dtypes", "fp4"], False), (["--rep", "0"], False),
    (["--device", "meta"], False), (["--model", "Qwen9"], False), (["--contexts", "0"], False),
])


@fuzz(20)
@given(opts=st.lists(STEP_OPTS, min_size=0, max_size=3, unique_by=lambda o: o[0][0]))
@example(opts=[(["--block-size", "0"], False)])
@example(opts=[(["--block-size", "-2"], False)])
@example(opts=[(["--kv-dtypes", "fp4"], False)])
def test_step_cli(opts, capsys):
    from fp8kv.step import cli as step_cli

    given_flags = {o[0] for o, _ in opts}
    argv = ([] if "--model" in given_flags else ["--model", "Qwen3-0.6B"]) + \
        ([] if "--contexts" in given_flags else ["--contexts", "64"]) + \
        ([] if "--gpu-memory" in given_flags else ["--gpu-memory", "H200"]) + \
        ["--dry-run", "--device", "cpu"] + [a for o, _ in opts for a in o]
    code, err = run_cli(step_cli.main, argv, capsys)
    bad = flags_of(opts)
    if bad:
        assert_refused_by_flag(code, err, bad)
    else:
        assert code == 0, f"exit {code} for legal {argv}: {err}"


NOTEBOOK_OPTS = st.sampled_from([
    (["--smoke"], True), (["--timeout", "30"], True), (["--seed", "3"], True), (["--no-progress"], True),
    (["--timeout", "0"], False), (["--timeout", "1.5"], False), (["--timeout", "nan"], False),
    (["--timeout", "inf"], False), (["--seed", "1.5"], False), (["--device", "meta"], False),
    (["--device", "cuda:9"], False), (["--only", "99_nothing"], False), (["--smoke", "--full"], False),
])


@fuzz(12)
@given(opts=st.lists(NOTEBOOK_OPTS, min_size=1, max_size=3, unique_by=lambda o: o[0][0]),
       action=st.sampled_from(["run", "list", "index", "render"]),
       folder=st.sampled_from(["empty", "damaged-notebook", "damaged-manifest", "missing"]))
@example(opts=[(["--only", "99_nothing"], False)], action="run", folder="damaged-notebook")
@example(opts=[(["--seed", "3"], True)], action="render", folder="damaged-manifest")
def test_notebooks_cli(tmp_path_factory, opts, action, folder, capsys):
    """``python -m fp8kv.notebooks``: bad options and damaged folders refused in one line; the run action
    is only ever given arguments it refuses before a kernel starts (a bad option, or --only a name that
    is not there)."""
    from fp8kv.notebooks import cli as nb_cli

    root = tmp_path_factory.mktemp("nb")
    books, out = root / "books", root / "reports"
    books.mkdir()
    out.mkdir()
    if folder == "damaged-notebook":
        (books / "01_broken.ipynb").write_text('{"cells": [')
    if folder == "damaged-manifest":
        (out / "cpu").mkdir()
        (out / "cpu" / "manifest.json").write_text('{"notebooks": [1, 2')
    bad = flags_of(opts)
    if action == "run":
        if not bad:
            opts = [*opts, (["--only", "99_nothing"], False)]  # never start a kernel
            bad = ["--only"]
        nb = [] if folder == "missing" else ["--notebooks", str(books)]
        argv = ["run", *nb, "--out", str(out), *[a for o, _ in opts for a in o]]
        code, err = run_cli(nb_cli.main, argv, capsys)
        assert_refused_by_flag(code, err, bad + ["99_nothing", "notebooks", "01_broken"])
        return
    if action == "list":
        argv = ["list", "--notebooks", str(books if folder != "missing" else root / "nowhere")]
    elif action == "index":
        argv = ["index", "--out", str(out if folder != "missing" else root / "nowhere")]
    else:
        argv = ["render", str(out / "cpu" if folder != "missing" else root / "nowhere")]
    code, err = run_cli(nb_cli.main, argv, capsys)
    if code != 0:
        assert_refused_by_flag(code, err, ["notebooks", "out", "nowhere", "manifest", "folder", "01_broken",
                                           str(root)])


TUNE_OPTS = st.sampled_from([
    (["--head-dims", "64"], True), (["--kv-dtypes", "fp8_e4m3"], True), (["--rep", "5"], True),
    (["--head-dims", "72"], False), (["--head-dims", "64.0"], False), (["--kv-dtypes", "fp4"], False),
    (["--kv-dtypes", "fp8_e4m3", "fp8_e5m2"], False), (["--rep", "0"], False), (["--rep", "-1"], False),
    (["--rep", "nan"], False),
])


@fuzz(10)
@given(opts=st.lists(TUNE_OPTS, min_size=1, max_size=3, unique_by=lambda o: o[0][0]))
def test_tune_cli(tmp_path_factory, opts, capsys):
    """``python -m fp8kv.bench.tune``: bad options refused by flag. Legal options without a GPU and without
    --interpret are refused too (no table to tune), so nothing is timed here."""
    from fp8kv.bench import tune

    tmp = tmp_path_factory.mktemp("tune")
    argv = [a for o, _ in opts for a in o] + ["--out", str(tmp / "rows")]
    code, err = run_cli(tune.main, argv, capsys)
    bad = flags_of(opts)
    if bad:
        assert_refused_by_flag(code, err, bad)
    else:
        assert code == 2 and "Traceback" not in err and ("GPU" in err or "--interpret" in err), (code, err)


# ------------------------------------------------------------------------------------------ index
@fuzz(8)
@given(damage=st.sampled_from(["manifest-truncated", "manifest-list", "results-truncated", "results-nan",
                               "manifest-wrong-types", "intact-empty"]))
def test_report_index(tmp_path_factory, damage):
    """The notebooks' index over report folders holding damaged files: a page (naming what it skipped) or
    a named refusal; never a traceback from json."""
    from fp8kv.notebooks.index import build_index, gpu_summary

    root = tmp_path_factory.mktemp("reports")
    folder = root / "cpu"
    folder.mkdir()
    body = {"manifest-truncated": ('manifest.json', '{"notebooks": [{"name": "01'),
            "manifest-list": ("manifest.json", "[]"),
            "results-truncated": ("01_formats.json", '{"results": {"a": '),
            "results-nan": ("01_formats.json", '{"results": {"a": NaN}}'),
            "manifest-wrong-types": ("manifest.json", json.dumps({"notebooks": "x", "failed": 3, "ran": None,
                                                                   "duration_s": "slow", "mode": 7})),
            "intact-empty": ("manifest.json", json.dumps({"notebooks": [], "failed": [], "ran": []}))}[damage]
    (folder / body[0]).write_text(body[1])
    for call in (lambda: gpu_summary(folder), lambda: build_index(root)):
        try:
            out = read(call, ("manifest", "01_formats", "cpu", str(folder)))
        except Refused:
            continue
        assert out is not None


@pytest.mark.parametrize("fails", ["csv", "json"])
def test_a_save_that_fails_leaves_no_table_behind(tmp_path, monkeypatch, fails):
    """A disk that fills while the table or its metadata is written: neither file stays (a cut-short CSV without
    metadata was read back as the newest run, its last row NaN), and the run saved before is still the newest."""
    import pandas as pd

    first = results.save_table(bench_rows(0), tmp_path, meta={"preset": "smoke"})
    later = bench_rows(0).assign(timestamp="2099-01-01T00:00:00Z")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if fails == "csv":
        monkeypatch.setattr(pd.DataFrame, "to_csv", full)
    else:
        monkeypatch.setattr(results.json, "dumps", full)
    with pytest.raises(OSError, match="No space left"):
        results.save_table(later, tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in first.parent.iterdir()) == sorted([first.name, first.with_suffix(".json").name])
    assert results.load_table(tmp_path, first.parent.name).attrs["path"] == str(first)
