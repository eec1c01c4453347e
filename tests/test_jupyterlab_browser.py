"""Exploring a notebook in JupyterLab, as a person does it, in a real browser.

JupyterLab is started headless on a free local port (token set); Chromium (Debian's ``chromium``,
driven by Playwright's Python client) opens ``03_kv_capacity``, runs all cells with the notebook's
own defaults, picks another model in the dropdown of the tokens-per-GPU figure, and the figure must
redraw with different numbers; no cell output may show an object's repr (``DataFrame(``, ``object at
0x``) where a table or a sentence belongs. Skipped only where no Chromium is installed (CI installs it).

``FP8KV_SCREENSHOT=docs/jupyterlab.png pytest tests/test_jupyterlab_browser.py`` also saves the page.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = "03_kv_capacity.ipynb"
CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or "")
                 if p and os.access(p, os.X_OK)), None)

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)"),
              pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server over a copy of the notebook: ``(base url, token)``."""
    shutil.copy(REPO / "notebooks" / NOTEBOOK, tmp_path / NOTEBOOK)
    port, token = _free_port(), "fp8kv-test-token"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TRITON_INTERPRET", None)  # the notebook decides, as on a person's machine
    env.pop("FP8KV_HEADLESS", None)
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / ".jupyter")  # no user settings, no workspace restore
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / ".workspaces")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={tmp_path}", "--ServerApp.open_browser=False",
         "--LabApp.news_url=", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "jupyterlab.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "JupyterLab did not start in 60 s"
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


FIGURE_NUMBERS = """() => {
    const plots = Array.from(document.querySelectorAll('.jp-OutputArea-output .js-plotly-plot'))
        .filter(p => p.closest('.widget-output, .jupyter-widgets-output-area'));
    if (!plots.length || !plots[0]._fullData) return null;  // _fullData: arrays decoded
    return JSON.stringify(plots[0]._fullData.map(t => [t.name, Array.from(t.y || [])]));
}"""

BUSY = r"""() => {
    const prompts = Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'));
    const running = prompts.filter(p => p.textContent.includes('*')).length;
    const done = prompts.filter(p => /\[\d+\]/.test(p.textContent)).length;
    return {running, done, total: prompts.length};
}"""


# What a cell shows when it displays an object instead of what it holds.
OBJECT_REPR = re.compile(r"DataFrame\(|DecodeGrid\(|Styler object|object at 0x|<IPython\.core\.display\.")

OUTPUT_TEXTS = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(o => o.innerText)"""


def test_widget_redraws_the_figure_in_jupyterlab(jupyterlab, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-CodeCell")
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
            page.wait_for_timeout(2000)  # the kernel's first idle comes before the notebook's toolbar settles
            # The toolbar's "restart the kernel and run all cells", then the dialog's confirmation.
            page.click("jp-button[data-command='notebook:restart-run-all'], "
                       "button[data-command='notebook:restart-run-all']")
            page.click(".jp-Dialog .jp-mod-accept")
            deadline = time.monotonic() + 150
            while True:  # every code cell has run: no [*], no empty prompt, the kernel idle
                state = page.evaluate(BUSY)
                if state["total"] and not state["running"] and state["done"] == state["total"] and page.query_selector(
                        ".jp-Notebook-ExecutionIndicator[data-status='idle']"):
                    break
                assert time.monotonic() < deadline, f"cells still running after 150 s: {state}"
                page.wait_for_timeout(500)
            errors = page.query_selector_all(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] "
                                             ":text('Traceback')")
            assert not errors, errors[0].inner_text()[:2000]
            reprs = [t[:200] for t in page.evaluate(OUTPUT_TEXTS) if OBJECT_REPR.search(t)]
            assert not reprs, reprs
            page.wait_for_function(f"({FIGURE_NUMBERS})() !== null")
            before = page.evaluate(FIGURE_NUMBERS)
            dropdown = page.locator(".widget-dropdown select").first
            dropdown.scroll_into_view_if_needed()
            # by position, not by label: an option's label and its rendered text may differ in whitespace
            chosen, count = dropdown.evaluate("s => [s.selectedIndex, s.options.length]")
            assert count >= 2, f"the first dropdown offers {count} option(s)"
            dropdown.select_option(index=(chosen + 1) % count)
            page.wait_for_function(f"({FIGURE_NUMBERS})() !== null && ({FIGURE_NUMBERS})() !== {before!r}",
                                   timeout=30_000)
            after = page.evaluate(FIGURE_NUMBERS)
            assert after != before and any(v for _, ys in __import__("json").loads(after) for v in ys)
            page.locator(".widget-output .js-plotly-plot").first.scroll_into_view_if_needed()
            for button in page.locator(".jp-toast-button:text-is('No')").all():  # the news prompt
                button.click()
            page.wait_for_timeout(500)
            shot = os.environ.get("FP8KV_SCREENSHOT")
            page.screenshot(path=str(REPO / shot) if shot else str(tmp_path / "jupyterlab.png"))
        finally:
            browser.close()
