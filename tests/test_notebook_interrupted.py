"""A stopped notebook's executed cells: kept beside the reports (never as a page), and read for where the
time went (papermill's per-cell metadata)."""

from __future__ import annotations

import datetime as dt

import nbformat
import pytest

from fp8kv.notebooks import runner
from fp8kv.notebooks import runner as nb_runner
from fp8kv.notebooks.interrupted import PARTIAL_DIR, cell_times, keep_partial, summary

T0 = dt.datetime(2026, 12, 5, 23, 0, tzinfo=dt.timezone.utc)


def _stamp(seconds: float) -> str:
    return (T0 + dt.timedelta(seconds=seconds)).isoformat()


def _executed(path, running: str = "papermill"):
    """A notebook of four code cells: two finished (3 s and 40 s), the third stopped 100 s in, one pending.
    ``running``: how the stopped cell looks, as papermill leaves it when the runner is stopped mid-cell
    ("papermill": status running, no end) or when papermill closed it after the kernel died ("closed")."""
    nb = nbformat.v4.new_notebook()
    done = {"iopub.execute_input": "x", "shell.execute_reply": "y"}
    for i, (src, secs) in enumerate([("# setup\nimport fp8kv", 3.0), ("rows = bench.run(cases)", 40.0)]):
        cell = nbformat.v4.new_code_cell(src)
        start = 0.0 if i == 0 else 3.0
        cell.metadata.update(execution=done, papermill=dict(status="completed", duration=secs,
                                                            start_time=_stamp(start), end_time=_stamp(start + secs)))
        nb.cells.append(cell)
    stopped = nbformat.v4.new_code_cell("verify = step.verify_sweep(MODEL)\nprint(verify)")
    meta = dict(status="running", start_time=_stamp(43.0), end_time=None, duration=None)
    if running == "closed":
        meta = dict(status="completed", start_time=_stamp(43.0), end_time=_stamp(143.0), duration=100.0)
    stopped.metadata.update(execution={"iopub.execute_input": "x"}, papermill=meta)
    nb.cells.append(stopped)
    nb.cells.append(nbformat.v4.new_code_cell("save_results(OUT_DIR, 'x', {})"))
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("running", ["papermill", "closed"])
def test_cell_times_find_the_stopped_cell_and_its_time(tmp_path, running):
    cells = cell_times(_executed(tmp_path / "x.ipynb", running), now=T0 + dt.timedelta(seconds=143))
    assert [c["status"] for c in cells] == ["completed", "completed", "stopped", "pending"]
    assert [c["seconds"] for c in cells] == [3.0, 40.0, 100.0, None]
    assert cells[0]["first_line"] == "import fp8kv"  # the comment line is not what the cell does
    text = summary(tmp_path / "x.ipynb", now=T0 + dt.timedelta(seconds=143), slowest=1)
    assert text == ("stopped in code cell 3 of 4 after 100 s in it (`verify = step.verify_sweep(MODEL)`); slowest "
                    "finished: cell 2 40 s (`rows = bench.run(cases)`); 43 s in the 2 finished cells")


def test_keep_partial_moves_a_notebook_and_leaves_a_half_written_file(tmp_path):
    staging, root = tmp_path / "staging", tmp_path / "reports"
    staging.mkdir()
    _executed(staging / "08_multi_token.ipynb")
    (staging / "09_will_fp8_pay.ipynb").write_text('{"cells": [')  # cut mid-write
    kept = keep_partial(staging, root, "nvidia-h100-80gb-hbm3", "08_multi_token")
    assert kept == root / PARTIAL_DIR / "nvidia-h100-80gb-hbm3" / "08_multi_token.ipynb" and kept.is_file()
    assert not (staging / "08_multi_token.ipynb").exists()
    assert keep_partial(staging, root, "nvidia-h100-80gb-hbm3", "09_will_fp8_pay") is None
    assert keep_partial(staging, root, "nvidia-h100-80gb-hbm3", "10_missing") is None


def test_an_interrupted_run_keeps_the_stopped_notebook_beside_the_reports(tmp_path, write_notebook, monkeypatch,
                                                                          capsys):
    """The runner publishes what finished (the previous page of the stopped one stays), keeps the stopped
    notebook's executed cells under <out>/.interrupted/<gpu>/ and says where its time went."""
    books = tmp_path / "books"
    books.mkdir()
    for name in ("00_first", "01_second"):
        write_notebook(books, name, "pass")
    calls = []

    def run_one(book, staging, *args, **kwargs):
        calls.append(book.stem)
        if book.stem == "01_second":
            _executed(staging / "01_second.ipynb")
            raise KeyboardInterrupt
        return _fake(book, staging)

    monkeypatch.setattr(nb_runner, "_run_one", run_one)
    out = tmp_path / "reports"
    with pytest.raises(KeyboardInterrupt):
        runner.run_notebooks(books, out, smoke=True, device="cpu", seed=0, progress=False)
    kept = out / PARTIAL_DIR / "cpu" / "01_second.ipynb"
    assert kept.is_file() and not (out / "cpu" / "01_second.ipynb").exists()  # never a page of the report
    err = capsys.readouterr().err
    assert "01_second: stopped in code cell 3 of 4 after " in err and str(kept) in err
    assert sorted(p.name for p in out.iterdir()) == [PARTIAL_DIR, "cpu", "index.html"]


def _fake(book, staging):
    import json

    name = book.stem
    for ext in ("ipynb", "html"):
        (staging / f"{name}.{ext}").write_text(f"{name} {ext}")
    (staging / f"{name}.json").write_text(json.dumps({"results": {}}))
    return {"name": name, "status": "ok", "error": None, "mode": "smoke", "duration_s": 0.0,
            "ipynb": f"{name}.ipynb", "html": f"{name}.html", "results": f"{name}.json"}
