"""The notebook runner under a real signal, its command-line checks, the index page, headless widgets.

* ``python -m fp8kv.notebooks run`` in a real subprocess, stopped by SIGTERM, SIGINT, SIGHUP, ... while a
  notebook's cell runs: it exits promptly and non-zero, its kernel is gone, no staging folder is
  left, and the previous report folder is byte-for-byte what it was.
* Bad ``run`` arguments exit with status 2 and one ``error:`` line on stderr, never a traceback.
* ``index``: one row per GPU folder, links to its pages, nothing loaded from the network.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from fp8kv import notebooks as runner
from fp8kv import ui
from fp8kv.device import gpu_slug
from fp8kv.notebooks.interrupted import PARTIAL_DIR, cell_times
from fp8kv.notebooks.pages import HTML_EXPORT_FAILED

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# SIGTERM and SIGINT (timeout, kill, Ctrl-C), SIGHUP (the terminal closed: it left the staging folder behind),
# SIGQUIT (Ctrl-\\) and SIGXCPU (a CPU-time limit): every signal that would end the runner stops it cleanly.
RUN_STOPPERS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGXCPU]


@pytest.mark.parametrize("sig", RUN_STOPPERS, ids=[s.name for s in RUN_STOPPERS])
def test_signal_stops_the_run_and_keeps_the_previous_report(tmp_path, sig, write_notebook):
    books, out = tmp_path / "books", tmp_path / "reports"
    books.mkdir()
    marker = tmp_path / "kernel.pid"
    # The cell announces its kernel's pid, then would run for minutes.
    write_notebook(books, "00_slow", f'import os, time\nopen({str(marker)!r}, "w").write(str(os.getpid()))\n'
                                'time.sleep(600)')
    previous = out / gpu_slug("cpu")
    previous.mkdir(parents=True)
    (previous / "manifest.json").write_text('{"notebooks": []}\n')
    (previous / "00_slow.html").write_text("<html>previous report</html>")
    snapshot = {p.name: p.read_bytes() for p in previous.iterdir()}

    proc = subprocess.Popen([sys.executable, "-m", "fp8kv.notebooks", "run", "--device", "cpu", "--notebooks",
                             str(books), "--out", str(out), "--no-progress", "--timeout", "900"],
                            env=_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))  # as a shell starts it, not nohup
    try:
        deadline = time.monotonic() + 120
        while not (marker.is_file() and marker.read_text().strip()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the notebook's cell never started"
            time.sleep(0.2)
        kernel_pid = int(marker.read_text())
        assert any(p.name.startswith(f".{gpu_slug('cpu')}.staging-") for p in out.iterdir())
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err
    assert took < 10, f"the runner took {took:.1f} s to stop"
    assert "Traceback" not in err and signal.Signals(sig).name in err
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != PARTIAL_DIR], \
        "staging folder left behind"
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == snapshot
    # the stopped notebook's executed cells are kept beside the reports, with the cell that was running
    kept = out / PARTIAL_DIR / gpu_slug("cpu") / "00_slow.ipynb"
    running = [c for c in cell_times(kept) if c["status"] == "stopped"]
    assert [c["first_line"] for c in running] == ["import os, time"] and running[0]["seconds"] >= 0
    assert "00_slow: stopped in code cell" in err and "(`import os, time`)" in err and str(kept) in err
    for _ in range(50):  # the kernel was stopped with the runner
        if not _alive(kernel_pid):
            break
        time.sleep(0.1)
    assert not _alive(kernel_pid), "the notebook kernel outlived the runner"


@pytest.mark.parametrize("args, needle", [
    (["--out", "FILE"], "--out"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "-5"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "2.5"], "--timeout"),
    (["--only", "99_missing"], "only='99_missing'"),
    (["--device", "cuda:7"], "--device"),
    (["--device", "tpu"], "--device"),
])
def test_bad_run_arguments_exit_2_with_one_line(tmp_path, args, needle, write_notebook):
    books = tmp_path / "books"
    books.mkdir()
    write_notebook(books, "00_x", "pass")
    afile = tmp_path / "a_file"
    afile.write_text("not a folder")
    args = [str(afile) if a == "FILE" else a for a in args]
    if args[0] == "--device" and args[1].startswith("cuda"):
        torch = pytest.importorskip("torch")
        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
    r = subprocess.run([sys.executable, "-m", "fp8kv.notebooks", "run", "--notebooks", str(books),
                        "--out", str(tmp_path / "reports"), *args], env=_env(), cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("fp8kv notebooks run: error: ") and needle in lines[0], lines
    assert afile.read_text() == "not a folder"
    assert not (tmp_path / "reports").exists() or not any((tmp_path / "reports").iterdir())


def test_setup_notebook_detects_the_machine(capsys, monkeypatch):
    import types

    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)  # as in a fresh kernel
    setup = runner.setup_notebook(None, "cpu")
    assert setup.smoke is True and setup.device == "cpu" and setup.triton_interpret is True
    said = capsys.readouterr().out
    assert "smoke sizes" in said and "set TRITON_INTERPRET=1" in said
    assert os.environ["TRITON_INTERPRET"] == "1"
    # Too late once triton is imported: said so, not silently ignored.
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert runner.setup_notebook(None, "cpu").triton_interpret is False
    assert "restart the kernel" in capsys.readouterr().out
    assert runner.setup_notebook(False, "cpu").smoke is False  # what the runner injects is kept
    with pytest.raises(TypeError, match="smoke"):
        runner.setup_notebook("yes", "cpu")
    if torch.cuda.is_available():
        assert runner.setup_notebook(None, "cuda").smoke is False


def test_headless_kernels_never_display_widgets(monkeypatch):
    shown = []
    monkeypatch.setattr(ui, "display", lambda obj: shown.append(obj))
    monkeypatch.setenv(ui.HEADLESS_ENV, "1")
    ui.interactive(lambda n: f"n={n}", {"n": ui.int_slider(1, 5, value=2)}, show_widgets=True)
    assert shown == ["n=2"]  # the static result, no widget box


def test_notebook_hash_ignores_outputs_and_injected_parameters(tmp_path, write_notebook):
    path = write_notebook(tmp_path, "00_h", "x = 1")
    h = runner.notebook_hash(path)
    nb = nbformat.read(path, as_version=4)
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="1")]
    nb.cells[2].execution_count = 3
    injected = nbformat.v4.new_code_cell("SMOKE = True")
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(2, injected)
    nbformat.write(nb, path)
    assert runner.notebook_hash(path) == h
    nb.cells[3].source = "x = 2"
    nbformat.write(nb, path)
    assert runner.notebook_hash(path) != h


def test_drop_network_loads():
    page = ('<script src="https://cdn.example/require.js"></script><script src="plotly-1.min.js"></script>'
            '<link rel="stylesheet" href="//cdn.example/x.css"><script>var a = 1;</script>')
    assert runner.drop_network_loads(page) == '<script src="plotly-1.min.js"></script><script>var a = 1;</script>'
    # nbconvert's inline loader of the widget renderer, as its lab template writes it, and a script that names
    # no CDN kept
    loader = ("<script>\n(function() {\n  function addWidgetsRenderer() {\n    var widgetRendererSrc = "
              "'https://unpkg.com/@jupyter-widgets/html-manager@*/dist/embed-amd.js';\n  }\n})();\n</script>")
    kept = "<script>var b = '@jupyter-widgets is a name';</script>"
    assert runner.drop_network_loads(loader + kept + page) == kept + runner.drop_network_loads(page)


def test_index_has_a_row_per_gpu_and_loads_nothing_from_the_network(tmp_path):
    for slug, name, gbps in (("cpu", "cpu", 12.5), ("nvidia-x1", "NVIDIA X1", 3000.0)):
        folder = tmp_path / slug
        folder.mkdir()
        device = {"name": name, "arch": None if slug == "cpu" else "sm90", "torch": "2.13", "type": "cpu"}
        (folder / "manifest.json").write_text(json.dumps(
            {"mode": "smoke" if slug == "cpu" else "full", "device": device,
             "notebooks": [{"name": "00_environment", "html": "00_environment.html"}]}))
        runner.save_results(folder, "00_environment", {
            "device": device, "copy_bandwidth": {"gbps": gbps},
            "capability_here": [{"supported": True}, {"supported": False}]}, device="cpu")
        rows = [{"status": "ok", "label": "triton fp8_e4m3 dequant", "batch": b, "context": c, "time_us": 1.0 * b * c,
                 "gbps": 1.0, "pct_copy_bw": 10.0 * b} for b in (1, 4) for c in (64, 128)]
        # the column summarises fp8kv's default FP8 decode only: FlashInfer's and fp8 mode's rows stay out
        kv = dict(num_q_heads=4, num_kv_heads=2, kv_dtype="fp8_e4m3")
        speed = [dict(kv, backend="triton", variant="", mode="dequant", speedup_vs_bf16=v) for v in (1.5, 1.9)] + [
            dict(kv, backend=b, variant=var, mode=m, speedup_vs_bf16=0.5)
            for b, var, m in (("flashinfer", "tc", "dequant"), ("triton", "", "fp8"))]
        runner.save_results(folder, "04_decode_latency", {"rows": rows, "speedup": speed,
                                                          "timings_meaningful_for_gpu": slug != "cpu"}, device="cpu")
    path = runner.build_index(tmp_path)
    page = path.read_text(encoding="utf-8")
    assert page.count("<tr>") == 4  # full runs: header + the GPU; smoke runs: header + the CPU
    assert "NVIDIA X1" in page and "3000 GB/s" in page and "12.5 GB/s" not in page  # a smoke run's numbers: none
    assert 'href="cpu/00_environment.html"' in page and "1 of 2 run here" in page
    assert "median 1.70×, best 1.90×" in page
    assert "http://" not in page.split("<body>")[0] and "https://" not in page.split("<body>")[0]
    assert page.count("Plotly.newPlot(") == 2
    r = subprocess.run([sys.executable, "-m", "fp8kv.notebooks", "index", "--out", str(tmp_path)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "2 report folder(s)" in r.stdout, r.stderr


# --------------------------------------------------------------------------- damaged or foreign report folders


def _good_report(root: Path, slug: str = "cpu") -> Path:
    """A report folder as the runner writes it, with 04's speed-up rows (head layout 4:2)."""
    folder = root / slug
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps(
        {"mode": "full", "device": {"name": slug, "arch": None}, "notebooks": [
            {"name": "00_environment", "html": "00_environment.html", "status": "ok", "error": None}]}))
    runner.save_results(folder, "00_environment", {"copy_bandwidth": {"gbps": 12.5},
                                                   "capability_here": [{"supported": True}]}, device="cpu")
    speed = [dict(num_q_heads=4, num_kv_heads=2, backend="triton", kv_dtype="fp8_e4m3", mode="dequant", variant="",
                  speedup_vs_bf16=v) for v in (1.5, 1.9)]
    rows = [{"status": "ok", "label": "triton fp8_e4m3 dequant", "batch": b, "context": 64, "time_us": 1.0 * b,
             "gbps": 1.0, "pct_copy_bw": 10.0} for b in (1, 4)]
    runner.save_results(folder, "04_decode_latency", {"rows": rows, "speedup": speed}, device="cpu")
    return folder


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(edit(doc) or doc))


BAD_MANIFESTS = {
    "truncated": '{"device": ',
    "a list": "[]",
    "no notebooks": "{}",
    "notebooks not a list": '{"notebooks": {"name": "x"}}',
    "entry without name": '{"notebooks": [{"html": "x.html"}]}',
    "entry name a path": '{"notebooks": [{"name": "../x"}]}',
    "html outside the folder": '{"notebooks": [{"name": "x", "html": "/etc/passwd"}]}',
}


@pytest.mark.parametrize("text", BAD_MANIFESTS.values(), ids=BAD_MANIFESTS.keys())
def test_index_leaves_out_and_names_a_folder_whose_manifest_is_unreadable(tmp_path, text):
    _good_report(tmp_path, "cpu")
    bad = tmp_path / "nvidia-x1"
    bad.mkdir()
    (bad / "manifest.json").write_text(text)
    (tmp_path / "foreign").mkdir()  # some JSON but no manifest: not a report at all, and no note either
    (tmp_path / "foreign" / "launch_x.json").write_text('{"a": 1}')
    r = subprocess.run([sys.executable, "-m", "fp8kv.notebooks", "index", "--out", str(tmp_path)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "(1 report folder(s))" in r.stdout
    assert "nvidia-x1/ left out: nvidia-x1/manifest.json" in r.stderr and "foreign" not in r.stderr
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert page.count("<tr>") == 2 and "<code>cpu</code>" in page and "<code>foreign</code>" not in page
    assert "Not shown:" in page and "nvidia-x1/ left out: nvidia-x1/manifest.json" in page
    assert str(tmp_path) not in page  # named relative to the page, no absolute path


def test_index_leaves_out_a_folder_whose_manifest_is_another_gpus(tmp_path):
    """A report folder copied or renamed: its manifest's gpu_slug is not the folder's name, so its pages would be
    shown as the folder name's GPU. Left out and named, as an unreadable one."""
    from fp8kv.notebooks.index import report_folders

    for slug in ("cpu", "nvidia-h200"):
        folder = _good_report(tmp_path, slug)
        _edit_json(folder / "manifest.json", lambda doc: doc.update(gpu_slug="cpu"))
    skipped: list[str] = []
    assert [f.name for f in report_folders(tmp_path, skipped)] == ["cpu"]
    assert skipped == ["nvidia-h200/ left out: its manifest.json is the report of 'cpu', not of 'nvidia-h200' (a "
                       "copied or renamed folder; each GPU's report is reports/<its slug>/)"]


def test_index_reads_missing_or_foreign_result_fields_as_missing(tmp_path):
    folder = _good_report(tmp_path)

    def damage(doc):
        for row in doc["results"]["speedup"]:
            row.pop("num_q_heads")
        for row in doc["results"]["rows"]:
            row.pop("label")
    _edit_json(folder / "04_decode_latency.json", damage)
    _edit_json(folder / "00_environment.json", lambda doc: {**doc, "results": [1]})
    runner.save_results(folder, "03_kv_capacity", {"rows": [{"gpu": "this device", "fits": True,
                                                             "kv_dtype": "fp8_e4m3"}]}, device="cpu")
    runner.save_results(folder, "06_model_accuracy", {"summary": [{"config": "e4m3 tensor amax"}]}, device="cpu")
    (tmp_path / "nvidia-x1").mkdir()
    (tmp_path / "nvidia-x1" / "manifest.json").write_text('{"notebooks": [], "device": {"name": "X1"}}')
    (tmp_path / "nvidia-x1" / "04_decode_latency.json").write_text('{"results": ')  # truncated

    page = runner.build_index(tmp_path).read_text(encoding="utf-8")
    assert page.count("<tr>") == 3
    assert "Hq:Hkv –:2: median 1.70×, best 1.90×" in page  # the head count missing, the numbers not
    assert "–: – M FP8 / – M bf16" in page and "–: – nats/token" in page
    assert "Plotly.newPlot(" not in page  # no row has what the figures plot
    assert "cpu/00_environment.json read as missing" in page
    assert "nvidia-x1/04_decode_latency.json read as missing" in page and "not valid JSON" in page
    row = runner.gpu_summary(folder)
    assert row["capability"] == "–" and row["copy_gbps"] is None


RENDER_FAILURES = {
    "truncated manifest": ('{"notebooks": [', "manifest.json is unreadable"),
    "manifest a list": ("[]", "manifest.json holds a JSON list"),
    "no notebooks": ("{}", "'notebooks' is missing"),
    "entry without name": ('{"notebooks": [{"ipynb": "x.ipynb"}]}', "notebooks[0] has name None"),
    "ipynb missing": (json.dumps({"notebooks": [{"name": "01_x", "ipynb": "01_x.ipynb", "html": None,
                                                 "status": "failed", "results": "01_x.json",
                                                 "error": HTML_EXPORT_FAILED + "OSError"}]}),
                      "01_x.ipynb is missing"),
}


@pytest.mark.parametrize("text, needle", RENDER_FAILURES.values(), ids=RENDER_FAILURES.keys())
def test_render_of_a_damaged_folder_fails_with_one_line(tmp_path, text, needle):
    folder = tmp_path / "gpu"
    folder.mkdir()
    (folder / "manifest.json").write_text(text)
    r = subprocess.run([sys.executable, "-m", "fp8kv.notebooks", "render", str(folder)], env=_env(),
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("fp8kv notebooks render: error: ") and needle in lines[0], lines
    assert (folder / "manifest.json").read_text() == text  # nothing written


# --------------------------------------------------------------------------- a path written is a folder


def _plotly_name() -> str:
    from plotly.offline import get_plotlyjs_version

    return f"plotly-{get_plotlyjs_version()}.min.js"


def _page_to_render(root: Path, write_notebook) -> Path:
    """A report folder whose 01_x ran but whose page was not exported (what ``render`` is for)."""
    folder = root / "cpu"
    folder.mkdir(parents=True)
    write_notebook(folder, "01_x", "x = 1")
    (folder / "manifest.json").write_text(json.dumps({"notebooks": [
        {"name": "01_x", "ipynb": "01_x.ipynb", "html": None, "status": "failed", "results": "01_x.json",
         "error": HTML_EXPORT_FAILED + "OSError"}]}))
    return folder


# Every path the index, render and the results writer put a file at, made a folder beforehand:
# (set-up returning the blocked path, the call that writes there, the command line that does, if any).
BLOCKED = {
    "the index page": (lambda root, wn: (_good_report(root), root / "index.html")[1],
                       lambda root: runner.build_index(root), ["index", "--out", "{root}"]),
    "the index's plotly.js": (lambda root, wn: (_good_report(root), root / _plotly_name())[1],
                              lambda root: runner.build_index(root), ["index", "--out", "{root}"]),
    "a rendered page": (lambda root, wn: _page_to_render(root, wn) / "01_x.html",
                        lambda root: runner.render_report(root / "cpu"), ["render", "{root}/cpu"]),
    "a results file": (lambda root, wn: root / "00_x.json",
                       lambda root: runner.save_results(root, "00_x", {"a": 1}), None),
}


@pytest.mark.parametrize("what", list(BLOCKED))
def test_a_path_written_that_is_a_folder_is_named(tmp_path, what, write_notebook, capsys):
    """os.replace onto a folder raised IsADirectoryError naming the temporary file (or nothing useful):
    now one ValueError naming the path, from the library and as one line from the command line."""
    from fp8kv.notebooks import cli as nb_cli

    set_up, call, argv = BLOCKED[what]
    blocked = set_up(tmp_path, write_notebook)
    blocked.mkdir()
    with pytest.raises(ValueError, match=f"{blocked} is a folder; a file is written there"):
        call(tmp_path)
    assert blocked.is_dir() and not any(blocked.iterdir())  # left as it was
    if argv:
        rc = nb_cli.main([a.format(root=tmp_path) for a in argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and f"{blocked} is a folder" in err and "Traceback" not in err, err


def test_results_folder_that_is_a_file_is_named(tmp_path):
    afile = tmp_path / "results"
    afile.write_text("not a folder")
    for out in (afile, afile / "cpu"):
        with pytest.raises(ValueError, match=f"{afile} is a file, not a folder"):
            runner.save_results(out, "00_x", {"a": 1})
    assert afile.read_text() == "not a folder"


def test_a_report_folder_that_is_a_file_is_refused_before_the_run(tmp_path, write_notebook, capsys):
    """The swap would rename the file aside and leave it there, beside the new report."""
    books, out = tmp_path / "books", tmp_path / "reports"
    books.mkdir()
    write_notebook(books, "00_x", "pass")
    out.mkdir()
    (out / gpu_slug("cpu")).write_text("not a folder")
    with pytest.raises(ValueError, match=f"{out / gpu_slug('cpu')} is a file, not a report folder"):
        runner.run_notebooks(books, out, device="cpu", progress=False)
    assert runner.main(["--notebooks", str(books), "--out", str(out), "--device", "cpu", "--no-progress"]) == 2
    assert "is a file, not a report folder" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [gpu_slug("cpu")]  # no staging folder, nothing else


def test_a_reports_root_inside_another_gpus_report_is_refused(tmp_path, write_notebook, capsys):
    """--out reports/<gpu> put this machine's report, the index and a staging folder inside that GPU's report."""
    from fp8kv.notebooks import cli as nb_cli

    books, other = tmp_path / "books", tmp_path / "reports" / "nvidia-h200"
    books.mkdir()
    write_notebook(books, "00_x", "pass")
    other.mkdir(parents=True)
    (other / "manifest.json").write_text(json.dumps({"notebooks": []}))
    for out in (other, other / "sub"):
        with pytest.raises(ValueError, match=f"{other}' is a report folder"):
            runner.run_notebooks(books, out, device="cpu", progress=False)
        for argv in (["run", "--notebooks", str(books), "--device", "cpu"], ["index"]):
            with pytest.raises(SystemExit) as exc:
                nb_cli.main([*argv, "--out", str(out)])
            err = capsys.readouterr().err
            assert exc.value.code == 2 and err.count("\n") == 1 and "is a report folder" in err, err
    assert sorted(p.name for p in other.iterdir()) == ["manifest.json"]


def test_a_run_whose_index_page_is_a_folder_publishes_and_names_it(tmp_path, write_notebook, monkeypatch, capsys):
    from fp8kv.notebooks import runner as nb_runner

    def fake_run_one(book, staging, params, *args, **kwargs):
        (staging / f"{book.stem}.json").write_text(json.dumps({"results": {}}))
        return {"name": book.stem, "status": "ok", "error": None, "duration_s": 0.0, "ipynb": None, "html": None,
                "results": f"{book.stem}.json"}

    books, out = tmp_path / "books", tmp_path / "reports"
    books.mkdir()
    write_notebook(books, "00_x", "pass")
    (out / "index.html").mkdir(parents=True)
    monkeypatch.setattr(nb_runner, "_run_one", fake_run_one)
    assert runner.run_notebooks(books, out, device="cpu", progress=False)["ok"]
    assert (out / gpu_slug("cpu") / "00_x.json").is_file()
    assert f"{out.resolve() / 'index.html'} is a folder" in capsys.readouterr().err
