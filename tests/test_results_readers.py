"""Reading saved runs back, damaged: every reader of a saved table (fp8kv.results.load_table / load_tables, the
bench's speedup_table, layout_table, summary, results_markdown, best_per_configuration, the step's reading,
summary, reading_markdown and figures, the heatmaps drawn from them) meets every kind of damage with a
ValueError naming the file and what is missing or broken, never a pandas / json / KeyError traceback; where
a partial answer means something (an FP8-only run), it says so by name.

One small run of each command is measured once (the bench: Triton under the interpreter and the reference;
the step: the smoke toy through the reference), its 16-bit rows labelled bf16 as a GPU run's are; each test
saves what it damages under its own folder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pandas as pd
import pytest

from fp8kv import bench, results, viz
from fp8kv import step as S
from fp8kv.results import PartialResultWarning

SLUG, STEM = "cpu", "20260101T000000Z"


@pytest.fixture(scope="module")
def bench_rows() -> pd.DataFrame:
    cases = bench.sweep([2], [32], heads=[(4, 2)], head_dims=[16], kv_dtypes=["fp16", "fp8_e4m3"], modes=["dequant"],
                        backends=["triton", "reference"], device="cpu")
    df = bench.run(cases, progress=False, device="cpu", rep=1)
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    return df.assign(kv_dtype=df["kv_dtype"].replace("fp16", "bf16"), label=df["label"].str.replace("fp16", "bf16"))


@pytest.fixture(scope="module")
def step_rows() -> pd.DataFrame:
    df = S.sweep([S.TOY_QWEN], [32], ["fp16", "fp8_e4m3"], batches=[1, 2], gpu_memory_gib=0.0016, weights="random",
                 backend="reference", device="cpu", progress=False, cpu_reps=1, copy_bandwidth=100.0)
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    return df.assign(kv_dtype=df["kv_dtype"].replace("fp16", "bf16"))


BENCH_READERS = {
    "load_table": lambda df: df,
    "speedup_table": bench.speedup_table,
    "layout_table": bench.layout_table,
    "summary": bench.summary,
    "results_markdown": bench.results_markdown,
    "best_per_configuration": bench.best_per_configuration,
    "speedup_heatmap": lambda df: viz.speedup_heatmap(bench.speedup_table(df)),
    "layout_speedups": lambda df: viz.layout_speedups(bench.layout_table(df)),
}
STEP_READERS = {
    "load_table": lambda df: df,
    "reading": S.reading,
    "summary": S.summary,
    "reading_markdown": S.reading_markdown,
    "tokens_per_s_figure": S.tokens_per_s_figure,
    "attention_share_figure": S.attention_share_figure,
}
READERS = [("bench", name) for name in BENCH_READERS] + [("step", name) for name in STEP_READERS]


def _write(rows: pd.DataFrame, out: Path) -> Path:
    """``rows`` as save_table leaves a run (the CSV and its metadata, consistent), returning the CSV: a run saved
    by code that wrote these columns."""
    folder = out / SLUG
    folder.mkdir(parents=True)
    rows.to_csv(folder / f"{STEM}.csv", index=False)
    (folder / f"{STEM}.json").write_text(json.dumps({"rows": len(rows), "columns": list(rows.columns)}))
    return folder / f"{STEM}.csv"


def _read(kind: str, name: str, out: Path, *, many: bool = False):
    """Reader ``name`` of ``kind`` ("bench" or "step") over the run saved under ``out``, as a notebook reads it."""
    df = (results.load_tables if many else results.load_table)(out, SLUG)
    assert df is not None
    return (BENCH_READERS if kind == "bench" else STEP_READERS)[name](df)


def _rows(kind, bench_rows, step_rows) -> pd.DataFrame:
    return bench_rows if kind == "bench" else step_rows


def test_the_undamaged_runs_read(tmp_path, bench_rows, step_rows):
    """The runs the damages start from: every reader answers, with no partial-answer warning."""
    for kind, name in READERS:
        out = tmp_path / f"{kind}-{name}"
        _write(_rows(kind, bench_rows, step_rows), out)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PartialResultWarning)
            assert _read(kind, name, out) is not None


# ------------------------------------------------------------------------------------ damaged files
def _cut_inside_the_last_row(csv: Path, meta: Path):
    csv.write_bytes(csv.read_bytes()[:-7])


def _cut_at_a_row_end(csv: Path, meta: Path):
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(lines[:-1]))


FILE_DAMAGES = {
    # (damage, which file the message names, what it says)
    "empty CSV": (lambda csv, meta: csv.write_text(""), "csv", "is empty"),
    "header only": (lambda csv, meta: csv.write_text(csv.read_text().splitlines(keepends=True)[0]), "csv",
                    "has a header but no rows"),
    "cut inside a row": (_cut_inside_the_last_row, "csv", "ends inside a row"),
    "cut at a row's end": (_cut_at_a_row_end, "csv", "rows but its metadata"),
    "not a CSV": (lambda csv, meta: csv.write_bytes(b'a,b\n"1,2\n'), "csv", "is not a CSV table"),
    "truncated JSON beside": (lambda csv, meta: meta.write_text(meta.read_text()[:20]), "json", "is not valid JSON"),
    "JSON beside not an object": (lambda csv, meta: meta.write_text("[1, 2]"), "json", "holds a JSON list"),
    "a column cut off": (lambda csv, meta: csv.write_text("\n".join(",".join(line.split(",")[:-1])
                                                                    for line in csv.read_text().splitlines()) + "\n"),
                         "csv", "has columns other than its metadata records"),
}


@pytest.mark.parametrize("damage", list(FILE_DAMAGES))
@pytest.mark.parametrize("kind, name", READERS)
def test_a_damaged_file_is_named(tmp_path, bench_rows, step_rows, kind, name, damage):
    csv = _write(_rows(kind, bench_rows, step_rows), tmp_path)
    damage_it, named, says = FILE_DAMAGES[damage]
    damage_it(csv, csv.with_suffix(".json"))
    for many in (False, True):  # the newest run, and every run concatenated
        with pytest.raises(ValueError) as exc:
            _read(kind, name, tmp_path, many=many)
        msg = str(exc.value)
        assert str(csv if named == "csv" else csv.with_suffix(".json")) in msg and says in msg, msg


def test_a_damaged_run_among_several_is_named(tmp_path, bench_rows):
    """load_tables reads every run: the damaged one is named, not the first or the last."""
    folder = _write(bench_rows, tmp_path).parent
    bench_rows.to_csv(folder / "20260102T000000Z.csv", index=False)
    (folder / "20260102T000000Z.json").write_text('{"rows": ')
    bench_rows.to_csv(folder / "20260103T000000Z.csv", index=False)
    with pytest.raises(ValueError, match=r"20260102T000000Z\.json \(the metadata of 20260102T000000Z\.csv\) is not "
                                         "valid JSON"):
        results.load_tables(tmp_path, SLUG)


# ------------------------------------------------------------------------------- damaged columns
THROUGHPUT = {"bench": "time_us", "step": "tokens_per_s"}


def _each_column_damaged(tmp_path, rows, kind, name, damage):
    """For every column of ``rows``: the run saved with it ``damage``d ("dropped" or "all NaN") and read by
    ``name``. Returns the columns refused; fails on any other exception, or a refusal that does not name the
    file and the column."""
    refused = []
    for i, col in enumerate(rows.columns):
        out = tmp_path / f"{i}"
        csv = _write(rows.drop(columns=col) if damage == "dropped" else rows.assign(**{col: float("nan")}), out)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PartialResultWarning)
                _read(kind, name, out)
        except ValueError as exc:
            assert str(csv) in str(exc) and repr(col) in str(exc), (col, str(exc))
            refused.append(col)
    return refused


@pytest.mark.parametrize("damage", ["dropped", "all NaN"])
@pytest.mark.parametrize("kind, name", [r for r in READERS if r[1] != "load_table"])
def test_every_column_a_reader_needs_is_named_with_the_file(tmp_path, bench_rows, step_rows, kind, name, damage):
    """A run saved without a column (older code, another tool) or with one that holds nothing: each reader answers
    or refuses by a ValueError naming the file and the column; the throughput column is always refused."""
    refused = _each_column_damaged(tmp_path, _rows(kind, bench_rows, step_rows), kind, name, damage)
    throughput = THROUGHPUT[kind]
    if name == "attention_share_figure":  # draws attention's share, not tokens per second
        throughput = "attention_share"
    assert throughput in refused, refused


# ------------------------------------------------------------------------------------- FP8 only
def _fp8_only(rows):
    return rows[rows["kv_dtype"] == "fp8_e4m3"].reset_index(drop=True)


@pytest.mark.parametrize("name", ["speedup_table", "layout_table", "results_markdown"])
def test_an_fp8_only_bench_run_gives_a_partial_table_said_by_name(tmp_path, bench_rows, name):
    csv = _write(_fp8_only(bench_rows), tmp_path)
    with pytest.warns(PartialResultWarning, match="holds no") as caught:
        table = _read("bench", name, tmp_path)
    (said,) = [str(w.message) for w in caught if issubclass(w.category, PartialResultWarning)]
    assert str(csv) in said and f"{name}:" in said
    assert len(table)  # the FP8 side is there


@pytest.mark.parametrize("name", ["speedup_heatmap", "layout_speedups"])
def test_an_fp8_only_bench_run_draws_no_blank_speedup_figure(tmp_path, bench_rows, name):
    """Nothing to draw (every speed-up NaN: no bf16 rows, no peers on a CPU): the figure refuses, naming why."""
    csv = _write(_fp8_only(bench_rows), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartialResultWarning)
        with pytest.raises(ValueError, match="holds no") as exc:
            _read("bench", name, tmp_path)
    assert str(csv) in str(exc.value)


@pytest.mark.parametrize("name", ["summary", "best_per_configuration"])
def test_an_fp8_only_bench_run_reads_whole_where_it_needs_no_baseline(tmp_path, bench_rows, name):
    _write(_fp8_only(bench_rows), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialResultWarning)
        assert len(_read("bench", name, tmp_path))


def test_an_fp8_only_step_run_is_said_by_name(tmp_path, step_rows):
    csv = _write(_fp8_only(step_rows), tmp_path)
    with pytest.warns(PartialResultWarning, match=r"reading: .* holds no bf16 rows that ran"):
        assert _read("step", "reading", tmp_path) == {}
    assert _read("step", "reading_markdown", tmp_path) == f"no pair of bf16 and fp8_e4m3 rows ran in {csv}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialResultWarning)
        for name in ("summary", "tokens_per_s_figure", "attention_share_figure"):  # FP8's curve alone is an answer
            assert _read("step", name, tmp_path) is not None


def test_results_helpers_refuse_what_they_cannot_read_by_name(tmp_path):
    """A KeyError, AttributeErrors deep inside before."""
    from fp8kv import results

    with pytest.raises(ValueError, match=r"r: df lacks columns \['zz'\] \(the values it reads\)"):
        results.check_rows(pd.DataFrame({"a": [1]}), "r", ["a"], values=["zz"], expected="rows")
    # the attend rows' math-peak columns are numbers to every reader that reads them
    for col in ("math_peak_tflops", "pct_math_peak"):
        with pytest.raises(ValueError, match=f"r: column '{col}' of df holds .* values, not numbers"):
            results.check_rows(pd.DataFrame({col: ["9.9e2"]}), "r", [], values=[col], expected="rows")
    with pytest.raises(TypeError, match="meta is a list"):
        results.read_table(tmp_path / "x.csv", meta=[])
    with pytest.raises(TypeError, match="df is a list"):
        results.save_table([], tmp_path)
