"""Every rendered page read as a reader would, figure by figure.

Over a fresh smoke render of every notebook in ``notebooks/`` (made once per test session by the
``smoke_report`` fixture) and over every committed render under ``reports/<gpu>/``, each page's plotly
figures are parsed from its HTML, and the test fails on

* a log axis whose range, or an annotation placed on it, is not a plausible exponent (plotly.js reads
  those coordinates as log10 of the value: 448 there means 10^448), or a shape placed on it at a value
  that is not positive (plotly.js places shapes at the value itself, so they need no log10);
* an axis or legend title that is a raw column name (a snake_case identifier such as ``rel_err_p99``);
* two series of one figure in one colour (plotly's colour cycle included);
* anything the page loads from the network (``<script src>`` / ``<link href>`` with a URL);
* ``staging`` or an absolute path anywhere in a page or its folder's ``manifest.json``;
* a cell output showing an object's repr (``DecodeGrid(...)``, ``object at 0x...``) where a table or a
  sentence belongs;
* a page whose source notebook has changed since it was rendered (the manifest's ``source_sha256``
  against :func:`fp8kv.notebooks.notebook_hash` of ``notebooks/<name>.ipynb``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fp8kv import notebooks as runner
from fp8kv.notebooks import index as index_module

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
COMMITTED = sorted((REPO / "reports").glob("*/*.html"))
MAX_EXPONENT = 30  # |log10| of any value a figure here could show (1e-30 ... 1e30)
RAW_COLUMN = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")
WIDGET_CDN = re.compile(r"https?://[^'\"\s]*@jupyter-widgets", re.I)
NETWORK_LOAD = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.I)
# A path of some machine: /home/..., /work/..., /tmp/..., C:\Users\..., after a quote, space, = or (.
ABSOLUTE_PATH = re.compile(r"(?:^|[\s\"'=(>])(/(?:home|work|tmp|root|Users|usr|opt|var|mnt|private|scratch)/[^\s\"'<]*"
                           r"|[A-Za-z]:\\\\?(?:Users|Windows)[^\s\"'<]*)")


# --------------------------------------------------------------------------- reading a page


def plotly_figures(html: str) -> list[dict]:
    """Every ``Plotly.newPlot(id, data, layout, ...)`` of a page as ``{"data": [...], "layout": {...}}``."""
    decoder = json.JSONDecoder()
    figures = []
    for m in re.finditer(r"Plotly\.newPlot\(\s*", html):
        pos = m.end()
        args = []
        for _ in range(3):  # the div id, the traces, the layout
            value, pos = decoder.raw_decode(html, pos)
            args.append(value)
            pos = re.compile(r"\s*,\s*").match(html, pos).end()
        figures.append({"data": args[1], "layout": args[2]})
    return figures


def _axis_key(ref: str | None, letter: str) -> str | None:
    """Layout key of the axis an annotation/shape coordinate refers to ("y2" -> "yaxis2"); None for paper/domain."""
    ref = ref or letter
    if ref == "paper" or ref.endswith("domain"):
        return None
    return f"{letter}axis{ref[1:]}"


def log_axis_problems(fig: dict) -> list[str]:
    layout = fig["layout"]
    logs = {k for k, v in layout.items() if re.fullmatch(r"[xy]axis\d*", k) and v.get("type") == "log"}
    problems = []
    for key in sorted(logs):
        rng = layout[key].get("range") or []
        if any(isinstance(v, (int, float)) and abs(v) > MAX_EXPONENT for v in rng):
            problems.append(f"{key} range {rng}")
    for kind, coords in (("annotations", {"x": ["x"], "y": ["y"]}), ("shapes", {"x": ["x0", "x1"], "y": ["y0", "y1"]})):
        for item in layout.get(kind, []):
            for letter, names in coords.items():
                if _axis_key(item.get(f"{letter}ref"), letter) not in logs:
                    continue
                for n in names:
                    v = item.get(n)
                    if not isinstance(v, (int, float)):
                        continue
                    what = f"{kind[:-1]} {item.get('text', item.get('type', ''))!r} {n}={v} on a log axis"
                    if kind == "annotations" and abs(v) > MAX_EXPONENT:
                        problems.append(what)
                    elif kind == "shapes" and v <= 0:
                        problems.append(f"{what} (a shape sits at the value itself, which must be positive)")
    return problems


def _title_text(title) -> str:
    if isinstance(title, dict):
        return str(title.get("text") or "")
    return str(title or "")


def raw_title_problems(fig: dict) -> list[str]:
    layout = fig["layout"]
    titles = {k: _title_text(v.get("title")) for k, v in layout.items()
              if re.fullmatch(r"[xy]axis\d*", k) and isinstance(v, dict)}
    titles["legend"] = _title_text((layout.get("legend") or {}).get("title"))
    return [f"{k} title {t!r}" for k, t in titles.items() if RAW_COLUMN.fullmatch(t.strip())]


def repeated_colour_problems(fig: dict) -> list[str]:
    """Series (a legend group, else a trace name) sharing one colour; unset colours follow the colour cycle."""
    layout = fig["layout"]
    cycle = layout.get("colorway") or ((layout.get("template") or {}).get("layout") or {}).get("colorway") or []
    owner: dict[str, str] = {}
    problems = []
    for i, trace in enumerate(fig["data"]):
        if trace.get("type", "scatter") not in ("scatter", "scattergl", "bar") or not trace.get("name"):
            continue
        colour = (trace.get("line") or {}).get("color") or (trace.get("marker") or {}).get("color")
        if colour is None and cycle:
            colour = cycle[i % len(cycle)]
        if not isinstance(colour, str):
            continue  # per-point colours: not a series colour
        series = trace.get("legendgroup") or trace["name"]
        colour = colour.lower()
        if owner.setdefault(colour, series) != series:
            problems.append(f"{owner[colour]!r} and {series!r} are both {colour}")
    return problems


OBJECT_REPR = re.compile(r"DataFrame\(|DecodeGrid\(|Styler object|object at 0x|&lt;IPython\.core\.display\.")


def output_reprs(html: str) -> list[str]:
    """Object reprs in a page's cell outputs (its code cells' sources may name DataFrame( freely)."""
    found = []
    for cell in html.split('<div class="jp-Cell ')[1:]:
        at = cell.find("jp-OutputArea-output")
        if at >= 0:
            found += [cell[max(at, m.start() - 60):m.end() + 60] for m in OBJECT_REPR.finditer(cell, at)]
    return found


def page_problems(html: str) -> list[str]:
    problems = [f"object repr in an output: {r!r}" for r in output_reprs(html)]
    for m in NETWORK_LOAD.finditer(html):
        problems.append(f"loads from the network: {html[m.start():m.start() + 120]!r}")
    for m in WIDGET_CDN.finditer(html):  # a script that builds a <script src=URL> itself (nbconvert's widget loader)
        problems.append(f"fetches from the network: {html[max(0, m.start() - 60):m.end() + 40]!r}")
    if "staging" in html:
        i = html.index("staging")
        problems.append(f"mentions staging: {html[max(0, i - 60):i + 40]!r}")
    for m in list(ABSOLUTE_PATH.finditer(html))[:3]:
        problems.append(f"absolute path: {m.group(1)[:120]!r}")
    for n, fig in enumerate(plotly_figures(html)):
        title = _title_text(fig["layout"].get("title"))
        for p in log_axis_problems(fig) + raw_title_problems(fig) + repeated_colour_problems(fig):
            problems.append(f"figure {n} ({title[:60]!r}): {p}")
    return problems


def manifest_problems(folder: Path) -> list[str]:
    path = folder / "manifest.json"
    if not path.is_file():
        return [f"{folder.name} has no manifest.json"]
    text = path.read_text(encoding="utf-8")
    problems = ["manifest mentions staging"] if "staging" in text else []

    def walk(value, where):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{where}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]")
        elif isinstance(value, str) and (value.startswith("/") or re.match(r"^[A-Za-z]:\\", value)
                                         or ABSOLUTE_PATH.search(value)):
            problems.append(f"manifest{where} is an absolute path or holds one: {value[:120]!r}")

    walk(json.loads(text), "")
    return problems


def source_hash_problem(folder: Path, name: str) -> str | None:
    manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    entry = next((e for e in manifest.get("notebooks", []) if e.get("name") == name), None)
    source = REPO / "notebooks" / f"{name}.ipynb"
    if entry is None:
        return f"{name} is not in {folder.name}/manifest.json"
    if not source.is_file():
        return f"{folder.name}/{name}.html has no source notebook notebooks/{name}.ipynb"
    recorded = entry.get("source_sha256")
    if recorded is None:
        return f"{folder.name}/manifest.json records no source_sha256 for {name}: which notebook made it is unknown"
    if recorded != runner.notebook_hash(source):
        return f"{folder.name}/{name}.html was rendered from another version of notebooks/{name}.ipynb"
    return None


# --------------------------------------------------------------------------- the checks themselves


def test_the_reader_catches_what_it_looks_for():
    """The checks above fail on the faults they name (a test that cannot fail is no test)."""
    bad = {"data": [{"type": "scatter", "name": "a", "line": {"color": "#111111"}},
                    {"type": "scatter", "name": "b", "line": {"color": "#111111"}}],
           "layout": {"xaxis": {"type": "log", "title": {"text": "rel_err_p99"}}, "yaxis": {"type": "log"},
                      "shapes": [{"type": "line", "xref": "x", "x0": -2.65, "x1": 448, "yref": "paper"}],
                      "annotations": [{"text": "max", "xref": "x", "x": 2.65, "yref": "y", "y": 240}]}}
    shape = "(a shape sits at the value itself, which must be positive)"
    assert sorted(log_axis_problems(bad)) == ["annotation 'max' y=240 on a log axis",
                                              f"shape 'line' x0=-2.65 on a log axis {shape}"]
    assert raw_title_problems(bad) == ["xaxis title 'rel_err_p99'"]
    assert repeated_colour_problems(bad) == ["'a' and 'b' are both #111111"]
    cycle = {"data": [{"type": "scatter", "name": str(i)} for i in range(11)],
             "layout": {"template": {"layout": {"colorway": [f"#{i:06x}" for i in range(10)]}}}}
    assert repeated_colour_problems(cycle) == ["'0' and '10' are both #000000"]
    html = ('<script src="https://cdn.x/require.js"></script><div>/work/me/x.ipynb</div> OUT_DIR = ".cpu.staging-1"'
            '<script>Plotly.newPlot("d1", [{"type": "scatter", "name": "a"}], {"xaxis": {"title": "batch_size"}}, {})'
            '</script>')
    found = page_problems(html)
    assert any("network" in p for p in found) and any("staging" in p for p in found)
    shown = ('<div class="jp-Cell jp-CodeCell"><pre>grid = pd.DataFrame(x)</pre><div class="jp-OutputArea-output">'
             "<pre>DecodeGrid(batches=(1, 2))</pre></div></div>")
    assert len(output_reprs(shown)) == 1 and output_reprs(shown.replace("DecodeGrid(", "batches ")) == []
    assert any("absolute path" in p for p in found) and any("batch_size" in p for p in found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_fresh_render_reads_right(smoke_report, path):
    _, folder, _ = smoke_report
    page = folder / f"{path.stem}.html"
    assert page.is_file(), f"{path.stem} was not rendered"
    assert page_problems(page.read_text(encoding="utf-8")) == []
    assert source_hash_problem(folder, path.stem) is None


def test_fresh_render_manifest_and_index(smoke_report):
    _, folder, _ = smoke_report
    assert manifest_problems(folder) == []
    index = folder.parent / runner.INDEX
    assert index.is_file(), "the run did not build the index page"
    assert page_problems(index.read_text(encoding="utf-8")) == []


def flagged_stale(page: Path) -> bool:
    """The committed index links ``page`` as stale (rendered from an earlier version of its notebook)."""
    index = (REPO / "reports" / runner.INDEX).read_text(encoding="utf-8")
    return f'href="{page.parent.name}/{page.name}">{page.stem}</a> (stale)' in index


# Committed pages that fail a check made after they were rendered ("<gpu>/<notebook>": why), expected to fail strictly:
# each flips to a failure of its own once the page is rendered again, and is then taken out.
RENDERED_BEFORE_A_FIX: dict[str, str] = {}


def _committed(known: dict) -> list:
    ids = {f"{p.parent.name}/{p.stem}": p for p in COMMITTED}
    assert set(known) <= set(ids) or not COMMITTED, set(known) - set(ids)
    return [pytest.param(p, id=i, marks=pytest.mark.xfail(strict=True, reason=known[i])) if i in known
            else pytest.param(p, id=i) for i, p in ids.items()]


@pytest.mark.parametrize("page", _committed(RENDERED_BEFORE_A_FIX))
def test_committed_page_reads_right(page):
    """A current page reads right; a page rendered from an earlier notebook (a GPU that has not rerun it) may
    predate today's checks, and the index must say it is stale."""
    if source_hash_problem(page.parent, page.stem) is None:
        assert page_problems(page.read_text(encoding="utf-8")) == []
    else:
        assert flagged_stale(page), f"{page.parent.name}/{page.stem} is stale and the index does not say so"


@pytest.mark.parametrize("page", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_page_is_current_or_flagged_stale(page):
    problem = source_hash_problem(page.parent, page.stem)
    assert problem is None or flagged_stale(page), problem
    assert (problem is None) != flagged_stale(page), f"{page.parent.name}/{page.stem}: current but flagged stale"


def test_stale_pages_compares_each_recorded_hash_with_the_notebook_today(tmp_path):
    books = tmp_path / "notebooks"
    books.mkdir()
    nb = {"cells": [{"cell_type": "code", "source": "x = 1", "metadata": {}}], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}
    (books / "a.ipynb").write_text(json.dumps(nb))
    (books / "b.ipynb").write_text(json.dumps(nb))
    good = runner.notebook_hash(books / "a.ipynb")
    manifest = {"notebooks": [{"name": "a", "source_sha256": good}, {"name": "b", "source_sha256": "0" * 64},
                              {"name": "c", "source_sha256": good}, {"name": "d"}]}
    assert index_module.stale_pages(manifest, books) == {"b", "c", "d"}
    nb["cells"][0]["source"] = "x = 2"  # the notebook changes after the run: its page is stale now
    (books / "a.ipynb").write_text(json.dumps(nb))
    assert index_module.stale_pages(manifest, books) == {"a", "b", "c", "d"}


def test_code_changed_pages_compare_each_page_s_fp8kv_digest_with_today_s():
    """A page's own ``fp8kv_source`` decides; a page rendered before the runner recorded one takes its run's
    (``device.fp8kv_source``); a page with neither is not known to be current, so it is flagged."""
    manifest = {"device": {"fp8kv_source": "aaaaaaaaaaaa"},
                "notebooks": [{"name": "now", "fp8kv_source": "cccccccccccc"},
                              {"name": "older", "fp8kv_source": "bbbbbbbbbbbb"},
                              {"name": "before_per_page"},  # rendered before entries had their own digest
                              {"name": "empty", "fp8kv_source": ""}, "not an entry", {"fp8kv_source": "x"}]}
    assert index_module.recorded_code(manifest) == {"now": "cccccccccccc", "older": "bbbbbbbbbbbb",
                                                    "before_per_page": "aaaaaaaaaaaa", "empty": "aaaaaaaaaaaa"}
    assert index_module.code_changed_pages(manifest, "cccccccccccc") == {"older", "before_per_page", "empty"}
    assert index_module.code_changed_pages(manifest, "aaaaaaaaaaaa") == {"now", "older"}
    del manifest["device"]
    assert index_module.code_changed_pages(manifest, "cccccccccccc") == {"older", "before_per_page", "empty"}
    assert index_module.recorded_code(manifest)["before_per_page"] is None
    from fp8kv.device import source_digest

    current = {"notebooks": [{"name": "a", "fp8kv_source": source_digest()}]}
    assert index_module.code_changed_pages(current) == set()  # default: the code imported now


def test_index_flags_each_page_whose_code_changed_since_it_was_rendered(tmp_path):
    """A constructed report: one page rendered with today's code, one with other code, one from before the runner
    recorded a digest per page (its run's digest decides). The index says which, and with what code, and stays the
    same page whatever today's digest is (it is never printed)."""
    _report(tmp_path, "nvidia-h200", "full", name="NVIDIA H200", kl=1e-3, time_us=10.0, meaningful=True)
    manifest_path = tmp_path / "nvidia-h200" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["device"]["fp8kv_source"] = "run000000000"
    digests = {"00_environment": "today0000000", "04_decode_latency": "older0000000"}
    for e in manifest["notebooks"]:
        if e["name"] in digests:
            e["fp8kv_source"] = digests[e["name"]]
    manifest_path.write_text(json.dumps(manifest))
    row = index_module.gpu_summary(tmp_path / "nvidia-h200", code="today0000000")
    assert row["code_changed"] == {"04_decode_latency", "06_model_accuracy"}
    html = runner.build_index(tmp_path, code="today0000000").read_text(encoding="utf-8")
    assert 'href="nvidia-h200/00_environment.html">00_environment</a> (stale) ·' in html  # no source hash: stale
    for name in ("04_decode_latency", "06_model_accuracy"):
        assert f'href="nvidia-h200/{name}.html">{name}</a> (stale) (code changed)' in html  # both flags
    assert ("code changed since this page was rendered: 04_decode_latency (fp8kv older0000000); 06_model_accuracy "
            "(fp8kv run000000000)") in html
    assert "today0000000" not in html
    assert page_problems(html) == []
    other = runner.build_index(tmp_path, code="another00000").read_text(encoding="utf-8")
    assert other.count("(code changed)") == 3 and "another00000" not in other
    now = runner.build_index(tmp_path, code="run000000000").read_text(encoding="utf-8")
    assert now.count("(code changed)") == 2 and "06_model_accuracy</a> (stale) (code changed)" not in now


@pytest.mark.parametrize("folder", sorted({p.parent for p in COMMITTED}), ids=lambda p: p.name)
def test_committed_manifest(folder):
    assert manifest_problems(folder) == []


def test_committed_index():
    index = REPO / "reports" / runner.INDEX
    if not COMMITTED:
        pytest.skip("no committed report folders")
    assert index.is_file(), "reports/index.html is missing: python -m fp8kv.notebooks index"
    html = index.read_text(encoding="utf-8")
    assert page_problems(html) == []
    for folder in sorted({p.parent.name for p in COMMITTED}):
        assert f'href="{folder}/' in html, f"the index does not link {folder}"


def test_committed_index_is_what_the_index_builder_writes(tmp_path):
    """The index of the committed reports is rebuilt byte for byte (built in a copy: reports/ is not
    written): reading damaged folders safely changed nothing for valid ones, and the page is current."""
    import shutil

    index = REPO / "reports" / runner.INDEX
    if not index.is_file():
        pytest.skip("no committed index")
    copy = tmp_path / "reports"
    shutil.copytree(REPO / "reports", copy, ignore=shutil.ignore_patterns("*.ipynb", "*.html"))
    assert runner.build_index(copy).read_bytes() == index.read_bytes()


# --------------------------------------------------------------------------- smoke runs on the index


def _report(root: Path, slug: str, mode: str, *, name: str, kl: float, time_us: float, meaningful: bool) -> None:
    """A report folder as the runner leaves one: a manifest (each notebook's mode) and results of 00, 04 and 06."""
    folder = root / slug
    folder.mkdir(parents=True)
    rows = [dict(status="ok", label=f"triton {kv} dequant", backend="triton", kv_dtype=kv, mode="dequant", batch=b,
                 context=c, time_us=time_us * (2 if kv == "bf16" else 1) * b * c / 1024, gbps=1.0, pct_copy_bw=50.0)
            for kv in ("bf16", "fp8_e4m3") for b in (1, 16) for c in (1024, 4096)]
    speedup = [dict(r, speedup_vs_bf16=2.0, num_q_heads=32, num_kv_heads=8) for r in rows if r["kv_dtype"] != "bf16"]
    results = {"00_environment": {"capability_here": [{"supported": True}], "copy_bandwidth": {"gbps": 123.0}},
               "04_decode_latency": {"rows": rows, "speedup": speedup, "timings_meaningful_for_gpu": meaningful,
                                     "grid": {"smoke": mode == "smoke"}},
               "06_model_accuracy": {"summary": [{"model": "smollm2-135m", "config": "e4m3 tensor amax",
                                                  "kl_mean": kl}]}}
    for nb, res in results.items():
        (folder / f"{nb}.json").write_text(json.dumps({"notebook": nb, "results": res}))
        (folder / f"{nb}.html").write_text("<html></html>")
    entries = [dict(name=nb, status="ok", mode=mode, html=f"{nb}.html", results=f"{nb}.json") for nb in results]
    (folder / "manifest.json").write_text(json.dumps({"mode": mode, "device": {"name": name},
                                                      "notebooks": entries}))


def test_index_keeps_smoke_runs_apart_and_never_shows_their_numbers(tmp_path):
    """A CPU smoke run beside a GPU's full run: its KL (7.77e-01) and timings appear nowhere on the index;
    it is listed under the smoke runs, linked; the overlays draw the GPU alone and say what grid they show."""
    _report(tmp_path, "nvidia-h200", "full", name="NVIDIA H200", kl=1.23e-3, time_us=10.0, meaningful=True)
    _report(tmp_path, "cpu", "smoke", name="cpu", kl=7.77e-1, time_us=50_000.0, meaningful=False)
    html = runner.build_index(tmp_path).read_text(encoding="utf-8")
    full, smoke = html.split("<h2>Smoke runs")
    assert "NVIDIA H200" in full and "1.23e-03" in full and 'href="cpu/' not in full
    assert "7.77e-01" not in html and 'href="cpu/04_decode_latency.html"' in smoke
    assert "over 4 shapes, B 1–16 × 1k–4k tokens" in full  # what the median is over
    figures = plotly_figures(html)
    assert len(figures) == 2
    for fig in figures:
        names = {t.get("name") for t in fig["data"]}
        assert names and all(n.startswith("nvidia-h200 · ") for n in names), names
        assert "nvidia-h200" in _title_text(fig["layout"].get("title"))
        assert max(v for t in fig["data"] for v in _numbers(t["y"])) < 50_000


def _numbers(values) -> list[float]:
    """A trace's values as the page holds them: a list, or plotly's typed array (base64 ``bdata``)."""
    import base64

    import numpy as np

    if isinstance(values, dict) and "bdata" in values:
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).tolist()
    return [v for v in values if isinstance(v, (int, float))]


@pytest.mark.parametrize("how", ["manifest mode", "results flag", "cpu timings"])
def test_a_smoke_run_is_known_however_it_is_recorded(tmp_path, how):
    """The manifest's entry mode, else the results' smoke flag or CPU timings, mark a run as smoke."""
    from fp8kv.notebooks.index import smoke_notebooks

    _report(tmp_path, "cpu", "smoke" if how == "manifest mode" else "full", name="cpu", kl=0.5, time_us=1.0,
            meaningful=how != "cpu timings")
    manifest = json.loads((tmp_path / "cpu" / "manifest.json").read_text())
    if how != "manifest mode":
        for e in manifest["notebooks"]:
            e.pop("mode")
        manifest.pop("mode")
    if how == "results flag":
        doc = json.loads((tmp_path / "cpu" / "04_decode_latency.json").read_text())
        doc["results"]["grid"]["smoke"] = True
        (tmp_path / "cpu" / "04_decode_latency.json").write_text(json.dumps(doc))
    assert "04_decode_latency" in smoke_notebooks(manifest, tmp_path / "cpu")


# --------------------------------------------------------------------------- each page's first screen


def _saved(name: str) -> dict:
    """A committed results file of notebook ``name``: the H200's full run, else the CPU's."""
    for slug in ("nvidia-h200", "cpu"):
        path = REPO / "reports" / slug / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    pytest.skip(f"no committed results of {name}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_page_opens_with_its_answer(path):
    """Each notebook ends in one cell tagged "headline" that writes its answer from the results it saved; the
    page moves it to the first screen. From real results the sentence names the machine and gives numbers;
    as a smoke run it gives none of them."""
    from fp8kv.notebooks.headlines import page_headline

    nb = json.loads(path.read_text(encoding="utf-8"))
    tagged = [c for c in nb["cells"] if "headline" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1 and f'"{path.stem}"' in "".join(tagged[0]["source"])
    doc = _saved(path.stem)
    full = page_headline(path.stem, doc["results"], doc["device"], smoke=False)
    smoke = page_headline(path.stem, doc["results"], doc["device"], smoke=True)
    name = doc["device"]["name"]
    assert full.startswith(f"On **{name}**") and re.search(r"\d", full.split(":", 1)[1])
    assert smoke.startswith(f"**Smoke run** on **{name}**") and "no result" in smoke
    assert full.split(": ", 1)[1] not in smoke


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_page_answers_in_at_most_two_sentences_of_400_characters(path):
    """The first screen answers at a glance: what follows the machine and the measurement is at most two sentences
    and 400 characters (notebook 09's answer ran to 1,300: its per-kernel refits belong to its break-even section)."""
    from fp8kv.notebooks.headlines import page_headline

    doc = _saved(path.stem)
    said = page_headline(path.stem, doc["results"], doc["device"], smoke=False).split(": ", 1)[1]
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z*])", said)
    assert len(sentences) <= 2 and len(said) <= 400, (len(sentences), len(said), said)


def test_will_fp8_pay_page_answers_from_its_saved_tables():
    """Page 09's answer is written from the tables the notebook saved, not the long answer it saved then: per batch
    fp8kv's and FlashInfer's verdicts, then accuracy; the machine is named once, by the page."""
    from fp8kv.notebooks.headlines import page_headline

    doc = _saved("09_will_fp8_pay")
    r = doc["results"]
    said = page_headline("09_will_fp8_pay", r, doc["device"], smoke=False).split(": ", 1)[1]
    assert said.startswith("FP8 KV decodes faster than 16-bit KV: batch 1, fp8kv ") and said not in r["answer"]
    assert "Pairs whose latency lines did not hold" in r["answer"] and "Pairs whose" not in said
    assert "FlashInfer" in said and f"On {doc['device']['name']}" not in said
    gone = dict(r, crossings=None, long_context_verdict=None, advice=None)  # an older results file: its saved answer
    assert page_headline("09_will_fp8_pay", gone, doc["device"], smoke=False).endswith(r["answer"])


def test_formats_page_answers_with_the_pick_from_its_table():
    from fp8kv.notebooks.headlines import page_headline

    doc = _saved("10_kv_formats")
    r = doc["results"]
    said = page_headline("10_kv_formats", r, doc["device"], smoke=False).split(": ", 1)[1]
    assert said.startswith(f"pick **{r['pick']}** for {r['capacity_model']}, the smallest format on the Pareto front")
    assert "× bf16's tokens." in said and "In a whole decode step" in said
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z*])", r["answer"].split("** ", 1)[-1] if r["smoke"] else r["answer"])[0]
    no_row = dict(r, table=[])  # no row of the pick: the first sentence of the answer it saved
    assert page_headline("10_kv_formats", no_row, doc["device"], smoke=False).split(": ", 1)[1].startswith(first[:40])


def test_headline_cells_move_to_the_first_screen():
    import nbformat

    from fp8kv.notebooks.pages import headline_first

    v4 = nbformat.v4
    head = v4.new_code_cell("Markdown(answer)", metadata={"tags": ["headline"]})
    nb = v4.new_notebook(cells=[v4.new_markdown_cell("# title"), v4.new_code_cell("x = 1"),
                                v4.new_markdown_cell("## results"), head])
    assert [c.source for c in headline_first(nb).cells] == ["# title", "Markdown(answer)", "x = 1", "## results"]
    untagged = v4.new_notebook(cells=[v4.new_markdown_cell("# t"), v4.new_code_cell("y")])
    assert [c.source for c in headline_first(untagged).cells] == ["# t", "y"]


@pytest.mark.parametrize("bad, error", [(("99_x", {}, {}), ValueError), (("00_environment", [], {}), TypeError),
                                        (("04_decode_latency", {}, None), TypeError)])
def test_page_headline_refuses_what_it_cannot_read(bad, error):
    from fp8kv.notebooks.headlines import page_headline

    with pytest.raises(error, match="name=|results and device"):
        page_headline(*bad, smoke=False)


def test_formats_headline_reads_the_whole_step_from_its_rows():
    """Page 10's first screen adds the whole-step reading: the fastest KV dtype at its best batch against the
    16-bit one, computed from the rows (a ratio of the two, not a typed number); none without a 16-bit row."""
    from fp8kv.notebooks.headlines import _step_sentence

    rows = [{"model": "Qwen3-8B", "context": 16384, "kv_dtype": "bf16", "kv_format": "", "ceiling": 49,
             "best_tokens_per_s": 2000.0, "best_batch": 49},
            {"model": "Qwen3-8B", "context": 16384, "kv_dtype": "nvfp4", "kv_format": "nvfp4", "ceiling": 175,
             "best_tokens_per_s": 5000.0, "best_batch": 175},
            {"model": "Qwen3-8B", "context": 16384, "kv_dtype": "fp8_e4m3", "kv_format": "fp8_e4m3_tensor",
             "ceiling": 98, "best_tokens_per_s": 3500.0, "best_batch": 98}]
    said = _step_sentence(rows)
    assert "nvfp4 KV reaches 5,000 tokens/s at batch 175" in said and "2.50x bf16 KV's best (2,000" in said
    assert _step_sentence(rows[1:]) == "" and _step_sentence([]) == ""
    assert "no format outran bf16" in _step_sentence([rows[0], {**rows[1], "best_tokens_per_s": 100.0}])
