"""fp8kv.results' writers under concurrency and failure: every write goes through a temporary file of
its own beside the target, renamed into place, so two writers never share (or rename) one another's
half-written file, and a failed write leaves the previous file and no temporary behind."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from fp8kv import results
from fp8kv.notebooks import build_index
from fp8kv.results import load_results, save_results


def _hammer(target, n_threads: int, n_calls: int) -> list[BaseException]:
    """Run ``target(thread_index, call_index)`` from ``n_threads`` threads at once; the exceptions raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def work(i):
        start.wait()  # all threads begin together: their writes overlap
        for j in range(n_calls):
            try:
                target(i, j)
            except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_save_results_never_fail_nor_mix(tmp_path):
    """Two writers of one notebook's results (JupyterLab and a headless run, say): with one shared
    temporary name, one renamed the other's file away (FileNotFoundError) or its half-written file in."""
    pad = list(range(2000))  # big enough that a write is not instantaneous

    def write(i, j):
        save_results(tmp_path, "01_fp8_formats", {"who": i, "call": j, "pad": pad}, device="cpu")

    errors = _hammer(write, n_threads=2, n_calls=100)
    assert errors == [], f"{len(errors)} writes failed, first: {errors[0]!r}"
    doc = load_results(tmp_path, "01_fp8_formats")  # valid JSON, and one writer's whole document
    assert doc["results"]["who"] in (0, 1) and doc["results"]["call"] == 99 and doc["results"]["pad"] == pad
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_fp8_formats.json"]  # no temporary left


def test_every_write_has_a_temporary_of_its_own_beside_the_target(tmp_path, monkeypatch):
    """Deterministically what the threads above race on: no two writes share a temporary name."""
    renamed = []
    real = os.replace

    def record(src, dst):
        renamed.append((os.fspath(src), os.fspath(dst)))
        return real(src, dst)

    monkeypatch.setattr(results.os, "replace", record)
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "manifest.json").write_text(json.dumps({"notebooks": []}))
    for _ in range(2):
        save_results(tmp_path / "cpu", "00_x", {"v": 1}, device="cpu")
        build_index(tmp_path)
    sources = [src for src, _ in renamed]
    assert len(sources) == 4 and len(set(sources)) == 4, sources
    assert all(os.path.dirname(src) == os.path.dirname(dst) for src, dst in renamed)  # same folder: rename is atomic


def test_failed_save_keeps_the_previous_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    save_results(tmp_path, "00_x", {"v": 1}, device="cpu")

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(results.os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        save_results(tmp_path, "00_x", {"v": 2}, device="cpu")
    monkeypatch.undo()
    assert load_results(tmp_path, "00_x")["results"] == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_x.json"]


def test_saved_file_has_the_usual_permissions(tmp_path):
    """mkstemp makes its file private (0600); the published results are readable as any file written here."""
    umask = os.umask(0)
    os.umask(umask)
    path = save_results(tmp_path, "00_x", {"v": 1}, device="cpu")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_load_results_names_a_corrupt_file(tmp_path):
    (tmp_path / "00_x.json").write_text('{"notebook": ')
    with pytest.raises(ValueError, match=r"00_x\.json.*not valid JSON"):
        load_results(tmp_path, "00_x")
    (tmp_path / "00_x.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"00_x\.json.*expected .*object"):
        load_results(tmp_path, "00_x")


def test_concurrent_index_builds_never_fail(tmp_path):
    """Two runs finishing together both rebuild index.html: each through its own temporary file."""
    folder = tmp_path / "cpu"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"mode": "full", "notebooks": []}))  # a smoke run shows no numbers
    save_results(folder, "00_environment", {"copy_bandwidth": {"gbps": 1.0}}, device="cpu")

    errors = _hammer(lambda i, j: build_index(tmp_path), n_threads=2, n_calls=60)
    assert errors == [], f"{len(errors)} builds failed, first: {errors[0]!r}"
    assert "1 GB/s" in (tmp_path / "index.html").read_text(encoding="utf-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu", "index.html"]


def test_save_or_fallback_keeps_the_rows_when_the_folder_cannot_be_written(tmp_path, monkeypatch, capsys):
    """The bench, step and tune commands save through it: a failing save under --out goes to a named
    temporary folder instead of losing the run."""
    import tempfile

    from fp8kv.results import save_or_fallback

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []

    def save(df, where, meta=None):
        calls.append(str(where))
        if str(where) == "/unwritable":
            raise PermissionError(13, "Permission denied")
        return f"{where}/rows.csv"

    path, asked = save_or_fallback(save, "ROWS", "/unwritable", {"argv": []}, flag="--out")
    assert not asked and path.startswith(str(tmp_path / "fp8kv-results-")) and len(calls) == 2
    err = capsys.readouterr().err
    assert "could not write under --out /unwritable" in err and calls[1] in err
    assert save_or_fallback(save, "ROWS", str(tmp_path), {}) == (f"{tmp_path}/rows.csv", True)


def test_save_results_never_overwrites_another_gpus_results(tmp_path):
    path = save_results(tmp_path, "nb", {"x": 1}, device="cpu")
    doc = json.loads(path.read_text())
    doc["device"]["slug"] = "nvidia-h200"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"nb\.json.*'nvidia-h200'.*'cpu'"):
        save_results(tmp_path, "nb", {"x": 2}, device="cpu")
    assert json.loads(path.read_text())["device"]["slug"] == "nvidia-h200"
    doc["device"]["slug"] = "cpu"
    path.write_text(json.dumps(doc))
    save_results(tmp_path, "nb", {"x": 3}, device="cpu")  # the same device's results are replaced
    assert load_results(tmp_path, "nb")["results"] == {"x": 3}


def test_to_jsonable_refuses_keys_that_collide_as_strings():
    with pytest.raises(ValueError, match=r"keys 1 and '1' both become the JSON key '1'"):
        results.to_jsonable({1: "a", "1": "b"})
    assert results.to_jsonable({1: "a", 2: {"x": 1}}) == {"1": "a", "2": {"x": 1}}


def test_save_table_and_save_results_name_a_bad_tag_or_folder(tmp_path):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"gpu_slug": ["cpu"], "timestamp": ["2026-01-01T00:00:00Z"], "x": [1]})
    with pytest.raises(TypeError, match=r"tag=5 \(int\); expected a str"):
        results.save_table(df, tmp_path, tag=5)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match=r"out_dir=.*afile.* is an existing file; expected a folder"):
        results.save_table(df, afile)
    with pytest.raises(ValueError, match=r"out_dir='/proc/fp8kv-x': the folder cannot be made"):
        save_results("/proc/fp8kv-x", "nb", {"x": 1})
