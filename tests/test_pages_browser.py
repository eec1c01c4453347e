"""Every committed page (``reports/<gpu>/<notebook>.html``) as a reader sees it, in a real browser at 1280 × 800.

Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright's Python client) opens each page once, offline, and

* the page's headline — the first-screen answer that :func:`fp8kv.notebooks.pages.headline_first` moves under the
  title (:mod:`fp8kv.notebooks.headlines` writes it) — has its first line on the first screen, and starts "On <the
  GPU of the run>" (a full run) or names a smoke run (a smoke run's page);
* no two annotations of one plotly figure (panel titles, threshold and crossing labels) overlap;
* no table that a page lays out for reading (``viz.style.readable_table``'s, a Markdown table) is wider than the
  output that holds it. A plain DataFrame's repr is left to scroll inside its output, as notebooks show one.

A page that the index flags stale (rendered from an earlier version of its notebook: it may predate today's checks)
is skipped where it fails a check, with what failed. Skipped as a whole where Playwright or Chromium is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted((REPO / "reports").glob("*/*.html"))
CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1280, "height": 800}

try:
    import playwright.sync_api  # noqa: F401
except ImportError:
    _MISSING = "Playwright's Python client is not installed (pip install playwright: the dev extra)"
else:
    _MISSING = None if os.access(CHROMIUM, os.X_OK) else f"no Chromium at {CHROMIUM} (apt-get install chromium)"

pytestmark = [pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""), pytest.mark.timeout(300),
              pytest.mark.xdist_group("pages-browser")]

# What the page shows, measured in the browser: the headline's text and its first line, each figure's annotation
# boxes that overlap, and the tables laid out for reading with their width and their output's.
MEASURE = r"""() => {
    const out = {headline: null, overlaps: [], tables: []};
    const head = document.querySelector('.celltag_headline .jp-OutputArea-output');
    if (head) {
        const range = document.createRange();
        range.selectNodeContents(head);
        const first = Array.from(range.getClientRects()).find(r => r.height > 0 && r.width > 0);
        out.headline = {text: head.innerText.trim(), first_top: first ? first.top : null,
                        first_bottom: first ? first.bottom : null};
    }
    document.querySelectorAll('.js-plotly-plot').forEach((plot, i) => {
        const boxes = Array.from(plot.querySelectorAll('g.annotation')).map(a => {
            const r = a.getBoundingClientRect();
            return {l: r.left, t: r.top, r: r.right, b: r.bottom, text: a.textContent};
        }).filter(b => b.r - b.l > 0 && b.b - b.t > 0);
        for (let x = 0; x < boxes.length; x++) for (let y = x + 1; y < boxes.length; y++) {
            const A = boxes[x], B = boxes[y];
            const w = Math.min(A.r, B.r) - Math.max(A.l, B.l), h = Math.min(A.b, B.b) - Math.max(A.t, B.t);
            if (w > 1 && h > 1) out.overlaps.push({figure: i, a: A.text, b: B.text, w: Math.round(w), h: Math.round(h)});
        }
    });
    document.querySelectorAll('.jp-OutputArea-output table').forEach(t => {
        const plain = t.classList.contains('dataframe') && !t.classList.contains('fp8kv-readable');
        if (plain) return;  // a DataFrame's repr: it scrolls inside its output
        const box = t.closest('.jp-OutputArea-output');
        out.tables.push({width: t.getBoundingClientRect().width, container: box.clientWidth,
                         head: Array.from(t.querySelectorAll('th')).slice(0, 4).map(th => th.innerText.trim())});
    });
    return out;
}"""


TABS = 2  # pages measured side by side, each in its own renderer process


def _serve(root: Path):
    """``reports/`` over HTTP on a free local port (a started server): unlike file:// pages, Chromium caches the
    compiled plotly.js that every page loads, which halves the time to open them all."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


async def _measure_all(paths: list[Path], root: Path = REPO / "reports") -> dict[str, dict]:
    import asyncio

    from playwright.async_api import async_playwright

    found = {}
    server = _serve(root)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        async with async_playwright() as pw:
            # nothing leaves the machine: a page's own request for a CDN script (the widget manager's) fails at once
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"])
            try:
                queue = list(paths)

                async def tab():
                    page = await browser.new_page(viewport=VIEWPORT)
                    page.set_default_timeout(60_000)
                    while queue:
                        path = queue.pop(0)
                        await page.goto(f"{base}/{path.relative_to(root).as_posix()}", wait_until="load")
                        await page.wait_for_function("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                                                     ".every(p => p._fullLayout)")  # every figure drawn
                        found[_key(path)] = await page.evaluate(MEASURE)
                    await page.close()

                await asyncio.gather(*(tab() for _ in range(min(TABS, len(paths)))))
            finally:
                await browser.close()
    finally:
        server.shutdown()
        server.server_close()
    return found


@pytest.fixture(scope="module")
def seen(request, tmp_path_factory) -> dict[str, dict]:
    """Each page's measurements, ``{"<gpu>/<notebook>": MEASURE's result}``: one browser, each page loaded once, in
    a few tabs at a time; under pytest-xdist the first worker measures and the others read its file."""
    import asyncio

    if getattr(request.config, "workerinput", None) is None:  # one process
        return asyncio.run(_measure_all(PAGES))
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "pages_browser.json"
    with FileLock(str(shared) + ".lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(asyncio.run(_measure_all(PAGES))), encoding="utf-8")
        return json.loads(shared.read_text(encoding="utf-8"))


def _key(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def _manifest(path: Path) -> dict:
    return json.loads((path.parent / "manifest.json").read_text(encoding="utf-8"))


def _stale(path: Path) -> bool:
    from fp8kv.notebooks.index import stale_pages

    return path.stem in stale_pages(_manifest(path))


def _failed(path: Path, problems: list[str], what: str) -> None:
    """Fail with ``problems``; on a page the index flags stale, skip with them instead."""
    if not problems:
        return
    if _stale(path):
        pytest.skip(f"{_key(path)} is stale (rendered from an earlier version of its notebook; the index says so) "
                    f"and {what}: " + "; ".join(problems))
    pytest.fail(f"{_key(path)}: {what}:\n" + "\n".join(problems))


def _pages(known: dict[str, str]):
    """The pages, those in ``known`` (``{"<gpu>/<notebook>": why}``) expected to fail, strictly: each flips to a
    failure of its own once it is fixed, and is then taken out of ``known``."""
    assert set(known) <= {_key(p) for p in PAGES} or not PAGES, set(known) - {_key(p) for p in PAGES}
    return [pytest.param(p, id=_key(p), marks=pytest.mark.xfail(strict=True, reason=known[_key(p)]))
            if _key(p) in known else pytest.param(p, id=_key(p)) for p in PAGES]


# ----------------------------------------------------------------------------------------------- the headline
@pytest.mark.parametrize("path", _pages({}))
def test_the_headline_is_on_the_first_screen_and_names_the_machine(seen, path):
    got = seen[_key(path)]["headline"]
    if got is None:
        _failed(path, ["no headline cell (a cell tagged 'headline')"], "has no first-screen answer")
        return
    entry = next(e for e in _manifest(path)["notebooks"] if e["name"] == path.stem)
    device = json.loads((path.parent / f"{path.stem}.json").read_text(encoding="utf-8")).get("device") or {}
    problems = []
    if got["first_bottom"] is None or not 0 <= got["first_top"] < got["first_bottom"] <= VIEWPORT["height"]:
        problems.append(f"its first line lies at {got['first_top']}–{got['first_bottom']} px, not on the first "
                        f"{VIEWPORT['height']} px")
    if entry.get("mode") == "smoke":
        if not got["text"].startswith("Smoke run"):
            problems.append(f"a smoke run's headline that does not say so: {got['text'][:120]!r}")
    elif not got["text"].startswith(f"On {device.get('name')}"):
        problems.append(f"starts {got['text'][:80]!r}, not 'On {device.get('name')}'")
    _failed(path, problems, "its headline does not read as the first-screen answer")


# -------------------------------------------------------------------------------------------- the annotations
OVERLAPPING = {
    "nvidia-h200/09_will_fp8_pay": "the break-even figure's crossing labels (fp8kv.viz.deciding_figures._mark_crossings, "
                                   "at the top of the panel) sit on the subplot titles at batch 64; fixed there, the "
                                   "page needs 09 rerun on the H200",
}


@pytest.mark.parametrize("path", _pages(OVERLAPPING))
def test_no_two_annotations_of_a_figure_overlap(seen, path):
    problems = [f"figure {o['figure']}: {o['a']!r} and {o['b']!r} overlap by {o['w']} × {o['h']} px"
                for o in seen[_key(path)]["overlaps"]]
    _failed(path, problems, "annotations print over each other")


# ------------------------------------------------------------------------------------------------- the tables
# Pages whose tables are known to be wider than their output ("<gpu>/<notebook>": why); none since notebook 03's model
# table shows only what sizes the KV cache (its 16 config columns ran past 1280 px)
WIDE_TABLES: dict[str, str] = {}


@pytest.mark.parametrize("path", _pages(WIDE_TABLES))
def test_no_table_laid_out_for_reading_is_wider_than_its_output(seen, path):
    problems = [f"the table headed {t['head']} is {t['width']:.0f} px wide in an output of {t['container']} px"
                for t in seen[_key(path)]["tables"] if t["width"] > t["container"] + 1]
    _failed(path, problems, "a table is wider than the output that holds it")


def test_the_pages_are_there():
    assert PAGES, "no committed page under reports/<gpu>/"


# ------------------------------------------------------------------------------------------ the checks can fail
_BROKEN = """<!DOCTYPE html><html><head><meta charset="utf-8"><script src="{plotly}"></script></head><body>
<div style="height: 1200px">a long title cell</div>
<div class="jp-Cell celltag_headline"><div class="jp-OutputArea-output"><p>On Some GPU, the answer.</p></div></div>
<div id="fig" style="width: 600px; height: 400px"></div>
<script>Plotly.newPlot("fig", [{{x: [1, 2], y: [1, 2]}}], {{annotations: [
    {{x: 1, y: 1, text: "a crossing label", showarrow: false}}, {{x: 1, y: 1, text: "a panel title", showarrow: false}},
    {{x: 2, y: 2, text: "apart", showarrow: false, yshift: 40}}]}});</script>
<div class="jp-OutputArea-output" style="width: 500px; overflow-x: auto"><table class="dataframe fp8kv-readable">
<tr><th>source</th></tr><tr><td style="min-width: 900px">https://example.org/a/long/link</td></tr></table></div>
<div class="jp-OutputArea-output" style="width: 500px; overflow-x: auto"><table class="dataframe">
<tr><th>repr</th></tr><tr><td style="min-width: 900px">a DataFrame's repr scrolls</td></tr></table></div>
</body></html>
"""


def test_the_checks_find_a_buried_headline_overlapping_labels_and_a_wide_table(tmp_path):
    """A page built to break each rule: its headline below the first screen, two labels at one place, a table laid
    out for reading wider than its output (and a DataFrame repr as wide, which is left to scroll)."""
    import asyncio
    import shutil

    library = next((REPO / "reports").glob("plotly-*.min.js"), None)
    if library is None:
        pytest.skip("no plotly.js under reports/ to draw the page's figure with")
    folder = tmp_path / "gpu"
    folder.mkdir()
    shutil.copy(library, folder / library.name)
    (folder / "page.html").write_text(_BROKEN.format(plotly=library.name), encoding="utf-8")
    got = asyncio.run(_measure_all([folder / "page.html"], tmp_path))["gpu/page"]
    assert got["headline"]["text"] == "On Some GPU, the answer." and got["headline"]["first_top"] > VIEWPORT["height"]
    assert [(o["a"], o["b"]) for o in got["overlaps"]] == [("a crossing label", "a panel title")]
    assert [t["head"] for t in got["tables"]] == [["source"]]  # the DataFrame repr is not measured
    assert got["tables"][0]["width"] > got["tables"][0]["container"] + 1
