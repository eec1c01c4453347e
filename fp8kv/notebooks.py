"""Run the notebooks headless and publish them as a per-GPU report; the results-JSON helpers they use.

Command line (``python -m fp8kv.notebooks`` is the same as ``fp8kv notebooks``; ``run`` is the default)::

    python -m fp8kv.notebooks run [--smoke | --full] [--only NAME ...] [--timeout S] [--out reports]
                                  [--device auto] [--seed 0] [--notebooks notebooks] [--no-progress]
    python -m fp8kv.notebooks list

What a run does
---------------
1. Finds ``notebooks/*.ipynb`` (sorted by name, so ``00_...`` runs first); ``--only`` picks some.
2. Executes each with papermill (kernel ``python3``, a per-cell ``execution_timeout``), injecting the
   parameters ``SMOKE``, ``DEVICE``, ``OUT_DIR``, ``SEED`` and ``SHOW_WIDGETS=False`` (always False:
   displaying widgets under papermill can stall the run). The working directory is the notebook's
   folder, as in JupyterLab. Each notebook writes its numbers with :func:`save_results` to
   ``OUT_DIR/<name>.json``.
3. Renders every executed notebook to HTML (nbconvert), plotly figures included and viewable offline:
   the pages load plotly.js from one ``plotly-<version>.min.js`` beside them instead of embedding the
   4.6 MB library each (:func:`externalize_plotlyjs`); the executed ``.ipynb`` keeps every figure but
   not the library (:func:`strip_embedded_plotlyjs`).
4. Publishes ``<out>/<gpu-slug>/``: ``<name>.html``, ``<name>.ipynb`` (executed), ``<name>.json``,
   ``plotly-<version>.min.js`` and ``manifest.json`` (device, versions, mode, timestamps, and per
   notebook its status, duration and source hash; relative paths only). The pages load nothing
   from the network, and their parameters show ``OUT_DIR`` as the published folder.
5. Rebuilds ``<out>/index.html``: every GPU folder there on one page (also ``python -m fp8kv.notebooks index``).

Report folders
--------------
Everything is written into a hidden staging folder beside the target (``<out>/.<slug>.staging-*``)
and moved into place only at the end: the old ``<out>/<slug>`` is renamed aside, the staging folder
renamed to ``<out>/<slug>``, then the old one deleted. A reader never sees a half-written report, and
a run on one GPU never touches another GPU's folder. If the runner itself is interrupted or crashes,
the staging folder is deleted and the previous report stays as it was; SIGTERM and SIGINT stop the
run promptly (the running kernel is killed) and exit with status 128 + the signal number.

With ``--only``, the other notebooks' files and manifest entries are carried over from the previous
report, so rerunning one notebook does not drop the others.

Failures
--------
A notebook that raises, exceeds the per-cell timeout, or finishes without writing its
``<name>.json`` is marked ``"failed"`` in the manifest (with the error), and the remaining notebooks
still run. The report is published all the same, including the failing notebook's executed
``.ipynb`` and ``.html`` (papermill marks the failing cell), because that is what one needs to
inspect; the previous report of that GPU remains in version control. The command then lists the
failed notebooks and exits with status 1.

Defaults
--------
Mode: ``--full`` when ``DEVICE`` is a CUDA device (``auto`` on a GPU machine), else ``--smoke``
(small sizes, a minute or two on a CPU).
Per-cell timeout: ``DEFAULT_TIMEOUT_S[mode]``. When ``DEVICE`` is not a CUDA device the kernels get
``TRITON_INTERPRET=1`` (unless it is set already), so Triton kernels run in the interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

# Results IO lives in fp8kv.results; notebooks import it from here too.
from .results import _now, collect_results, load_results, save_results, to_jsonable

__all__ = [
    "PARAMETER_NAMES",
    "DEFAULT_TIMEOUT_S",
    "save_results",
    "load_results",
    "collect_results",
    "to_jsonable",
    "discover_notebooks",
    "run_notebooks",
    "render_html",
    "render_report",
    "strip_embedded_plotlyjs",
    "externalize_plotlyjs",
    "add_run_arguments",
    "run_from_args",
    "main",
    "setup_notebook",
    "machine_defaults",
    "MachineSetup",
    "notebook_hash",
    "drop_network_loads",
    "build_index",
    "gpu_summary",
    "RunInterrupted",
]

# Parameters every notebook declares in its cell tagged "parameters" (and the runner injects).
PARAMETER_NAMES = ("SMOKE", "DEVICE", "OUT_DIR", "SEED", "SHOW_WIDGETS")
# Per-cell execution timeout, seconds, by mode.
DEFAULT_TIMEOUT_S = {"smoke": 600, "full": 1800}
KERNEL_NAME = "python3"
MANIFEST = "manifest.json"
INDEX = "index.html"


# --------------------------------------------------------------------------- the machine a notebook runs on


@dataclasses.dataclass(frozen=True)
class MachineSetup:
    """What :func:`setup_notebook` decided: ``smoke`` sizes, the ``device``, the Triton interpreter."""

    smoke: bool
    device: str
    triton_interpret: bool
    message: str


def machine_defaults(device="auto") -> tuple[bool, bool]:
    """``(smoke, triton_interpret)`` for a device: without a CUDA device, small sizes and the interpreter.

    The one rule the runner and the notebooks' defaults share.
    """
    from .device import resolve_device

    on_gpu = resolve_device(device).type == "cuda"
    return not on_gpu, not on_gpu


def setup_notebook(smoke: bool | None = None, device="auto") -> MachineSetup:
    """Decide a notebook's sizes and Triton mode for this machine, as the runner does; print what was done.

    ``smoke=None`` (a notebook's default) detects: smoke sizes without a CUDA device, full sizes on one;
    True/False (what the runner injects) is kept. Without a CUDA device ``TRITON_INTERPRET=1`` is set,
    which works only before triton is first imported: call this first, in the cell after the parameters.
    """
    from .device import resolve_device

    if smoke is not None and not isinstance(smoke, bool):
        raise TypeError(f"smoke={smoke!r} must be None (detect), True or False")
    dev = resolve_device(device)
    default_smoke, interpret = machine_defaults(dev)
    smoke = default_smoke if smoke is None else smoke
    notes = [f"device {dev}: {'smoke' if smoke else 'full'} sizes"
             + (" (no GPU here)" if dev.type != "cuda" else "")]
    if interpret:
        if os.environ.get("TRITON_INTERPRET") == "1":
            notes.append("Triton kernels run in the Triton interpreter (TRITON_INTERPRET=1)")
        elif sys.modules.get("triton") is not None:
            notes.append("WARNING: triton was imported before TRITON_INTERPRET could be set; restart the kernel "
                         "and run this cell before anything imports triton")
        else:
            os.environ["TRITON_INTERPRET"] = "1"
            notes.append("set TRITON_INTERPRET=1: Triton kernels run in the Triton interpreter")
    message = "; ".join(notes)
    print(message)
    return MachineSetup(smoke=smoke, device=str(dev), triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
                        message=message)


# --------------------------------------------------------------------------- discovery and rendering


def _default_notebook_dir() -> Path:
    """``./notebooks`` if present (the repository root is the usual working directory), else the
    ``notebooks`` folder beside the installed (editable) package."""
    here = Path.cwd() / "notebooks"
    if here.is_dir():
        return here
    return Path(__file__).resolve().parent.parent / "notebooks"


def discover_notebooks(notebook_dir: str | os.PathLike | None = None,
                       only: Sequence[str] | None = None) -> list[Path]:
    """Notebooks to run, sorted by file name.

    Parameters
    ----------
    notebook_dir : folder of ``*.ipynb`` (default ``./notebooks``).
    only : names to keep; each matches a notebook by stem (``"01_fp8_formats"``), file name
        (``"01_fp8_formats.ipynb"``) or number prefix (``"01"``). An unknown name is a ValueError.
    """
    folder = Path(notebook_dir) if notebook_dir is not None else _default_notebook_dir()
    if not folder.is_dir():
        raise ValueError(f"notebook_dir={str(folder)!r} is not a folder; pass the folder holding the .ipynb files")
    books = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    if only is None:
        return books
    if isinstance(only, str):
        only = [only]
    chosen = []
    for want in only:
        hits = [p for p in books if want in (p.stem, p.name) or p.stem.split("_")[0] == want]
        if not hits:
            raise ValueError(f"only={want!r} matches no notebook; available: {[p.stem for p in books]}")
        chosen.extend(h for h in hits if h not in chosen)
    return sorted(chosen)


# <script src="http(s)://..."></script> and <link href="http(s)://..."> : what a page would fetch from the network.
_NETWORK_SCRIPT = re.compile(r'<script\b[^>]*\bsrc\s*=\s*["\']?(?:https?:)?//[^>]*>\s*</script>', re.IGNORECASE)
_NETWORK_LINK = re.compile(r'<link\b[^>]*\bhref\s*=\s*["\']?(?:https?:)?//[^>]*>', re.IGNORECASE)


def drop_network_loads(html: str) -> str:
    """Remove every ``<script src=...>`` and ``<link href=...>`` that points at the network.

    nbconvert's lab template loads require.js and MathJax 2 from a CDN, and plotly's ``notebook``
    renderer adds MathJax 3 from a CDN before each figure. The pages need none of them: plotly.js is
    loaded from the file beside the page, and the notebooks write no LaTeX. A page must view offline.
    """
    return _NETWORK_LINK.sub("", _NETWORK_SCRIPT.sub("", html))


def render_html(executed_ipynb: str | os.PathLike, html_path: str | os.PathLike) -> Path:
    """Render an executed notebook to a standalone HTML file (nbconvert ``HTMLExporter``, lab template)
    that loads nothing from the network (:func:`drop_network_loads`)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(executed_ipynb))
    html_path = Path(html_path)
    html_path.write_text(drop_network_loads(body), encoding="utf-8")
    return html_path


def notebook_hash(path: str | os.PathLike) -> str:
    """SHA-256 of a notebook's content: each cell's type, tags and source, in order (hex digest).

    Outputs, execution counts, cell ids and notebook metadata are left out, so the source notebook
    (committed without outputs) and the executed copy of it that papermill writes hash the same,
    once papermill's injected-parameters cell is dropped.
    """
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    cells = []
    for cell in doc.get("cells", []):
        tags = [t for t in cell.get("metadata", {}).get("tags", []) if t != "injected-parameters"]
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            continue
        source = cell.get("source", "")
        cells.append([cell.get("cell_type"), sorted(tags), "".join(source) if isinstance(source, list) else source])
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode("utf-8")).hexdigest()


_PLOTLYJS_SRC = re.compile(r'<script src="(plotly-[0-9A-Za-z.+-]+\.min\.js)" charset="utf-8"></script>')


def externalize_plotlyjs(html_path: str | os.PathLike) -> str | None:
    """Load plotly.js from a file beside the HTML instead of embedding it; return that file's name.

    The page's inline copy of the library (the one ``fp8kv.viz.setup_plotly`` embeds) is replaced
    by ``<script src="plotly-<version>.min.js">`` and the library is written beside the page once,
    so a report folder holds one 4.6 MB copy, not one per notebook, and still views offline.
    Idempotent; returns None when the page holds no plotly.js.
    """
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    path = Path(html_path)
    text = path.read_text(encoding="utf-8")
    found = _PLOTLYJS_SRC.search(text)
    if found:
        return found.group(1)
    library = get_plotlyjs()
    inline = f"<script>{library}</script>"
    if inline not in text:
        return None
    name = f"plotly-{get_plotlyjs_version()}.min.js"
    target = path.with_name(name)
    if not target.is_file():
        target.write_text(library, encoding="utf-8")
    path.write_text(text.replace(inline, f'<script src="{name}" charset="utf-8"></script>', 1), encoding="utf-8")
    return name


_PLOTLYJS_NOTE = ("<!-- plotly.js (embedded here at execution) was removed from this .ipynb to keep it small; "
                  "the .html beside it loads it. JupyterLab draws the figures from their plotly mimetype. -->")


def strip_embedded_plotlyjs(ipynb_path: str | os.PathLike) -> int:
    """Remove the embedded plotly.js library (about 4.6 MB) from an executed notebook; return bytes saved.

    ``fp8kv.viz.setup_plotly`` embeds the library once, in the first figure's cell, as a ``text/html``
    output of its own. The report's ``.html`` loads it from a file beside it; in the
    ``.ipynb`` it would only double the report's size, since JupyterLab and VS Code draw every figure
    from its ``application/vnd.plotly.v1+json`` output. Figure outputs themselves are kept intact.
    """
    import nbformat

    path = Path(ipynb_path)
    nb = nbformat.read(path, as_version=4)
    saved = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            html = output.get("data", {}).get("text/html")
            if html is None:
                continue
            text = "".join(html) if isinstance(html, list) else html
            if "window.PlotlyConfig" in text and "Plotly.newPlot" not in text and len(text) > 100_000:
                output["data"]["text/html"] = _PLOTLYJS_NOTE
                saved += len(text) - len(_PLOTLYJS_NOTE)
    if saved:
        nbformat.write(nb, path)
    return saved


# --------------------------------------------------------------------------- the runner


@contextlib.contextmanager
def _kernel_environment(interpret: bool):
    """Environment the notebook kernels inherit, restored afterwards.

    * ``PYTHONPATH`` gains the package's root, so kernels (which start in notebooks/) import fp8kv
      even when it is not pip-installed;
    * without CUDA, ``TRITON_INTERPRET=1`` (unless already set), so Triton kernels run under the
      interpreter in smoke runs; it must be set before triton is imported, hence here;
    * ``FP8KV_HEADLESS=1`` (:func:`fp8kv.ui.headless`): no widget is ever displayed.
    """
    from .ui import HEADLESS_ENV

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "TRITON_INTERPRET", HEADLESS_ENV)}
    os.environ[HEADLESS_ENV] = "1"  # no person watches these kernels: fp8kv.ui shows no widgets
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([root, saved["PYTHONPATH"]]) if saved["PYTHONPATH"] else root
    if interpret and saved["TRITON_INTERPRET"] is None:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _error_text(exc: BaseException) -> str:
    """Short, useful error for the manifest: papermill's exception name/value, else the last line."""
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    text = f"{ename}: {evalue}" if ename else "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _publish_out_dir(executed: Path, staged_value: str, published_value: str) -> None:
    """Show, in the executed notebook's injected parameters, where its results are published.

    The kernel wrote into the staging folder, which is renamed to the report folder at the end of
    the run; a reader of the page should see the folder that exists, not the temporary one.
    """
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    for cell in nb.cells:
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell.source = cell.source.replace(f"OUT_DIR = {staged_value!r}", f"OUT_DIR = {published_value!r}")
            cell.source = cell.source.replace(f'OUT_DIR = "{staged_value}"', f'OUT_DIR = "{published_value}"')
    nbformat.write(nb, executed)


def _run_one(book: Path, staging: Path, params: dict, timeout_s: int, progress: bool,
             kernel_name: str, published_out_dir: str | None = None) -> dict:
    import papermill as pm

    name = book.stem
    executed = staging / f"{name}.ipynb"
    entry = {"name": name, "source": book.name, "source_sha256": notebook_hash(book), "status": "ok",
             "error": None, "mode": "smoke" if params["SMOKE"] else "full", "started": _now(),
             "duration_s": None, "ipynb": None, "html": None, "results": None}
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(str(book), str(executed), parameters=params, kernel_name=kernel_name,
                            execution_timeout=timeout_s, start_timeout=120, progress_bar=progress,
                            cwd=str(book.parent))
    except Exception as exc:  # a failing cell, a timeout, a dead kernel: recorded, the run goes on
        entry.update(status="failed", error=_error_text(exc))
    entry["duration_s"] = round(time.perf_counter() - t0, 2)
    if executed.is_file():
        entry["ipynb"] = executed.name
        try:
            if published_out_dir is not None:
                _publish_out_dir(executed, params["OUT_DIR"], published_out_dir)
            entry["html"] = render_html(executed, staging / f"{name}.html").name
            externalize_plotlyjs(staging / entry["html"])
            strip_embedded_plotlyjs(executed)  # after the HTML export, which needs it
        except Exception as exc:
            entry.update(status="failed", error=(entry["error"] or "") + f" | HTML export failed: {_error_text(exc)}")
    if (staging / f"{name}.json").is_file():
        entry["results"] = f"{name}.json"
    elif entry["status"] == "ok":
        entry.update(status="failed", error=f"the notebook did not write {name}.json "
                                            f"(call fp8kv.notebooks.save_results(OUT_DIR, {name!r}, ...))")
    return entry


def _carry_over(previous: Path, staging: Path, rerun: set[str]) -> list[dict]:
    """Copy the previous report's files and manifest entries of notebooks not rerun now."""
    try:
        old_manifest = json.loads((previous / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    kept = [e for e in old_manifest.get("notebooks", []) if e.get("name") not in rerun]
    keep_names = {e["name"] for e in kept}
    for f in previous.iterdir():
        owner = next((n for n in keep_names if f.name.startswith((n + ".", n + "_"))), None)
        if owner is not None and f.is_file():
            shutil.copy2(f, staging / f.name)
            library = _PLOTLYJS_SRC.search(f.read_text(encoding="utf-8")) if f.suffix == ".html" else None
            if library and (previous / library.group(1)).is_file() and not (staging / library.group(1)).exists():
                shutil.copy2(previous / library.group(1), staging / library.group(1))
    return kept


def _swap_into_place(staging: Path, final: Path) -> None:
    """Replace ``final`` by ``staging``: rename the old folder aside, rename staging in, delete the old."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.time_ns()}")
        os.replace(final, old)
    try:
        os.replace(staging, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def run_notebooks(notebook_dir: str | os.PathLike | None = None, out: str | os.PathLike = "reports", *,
                  smoke: bool | None = None, only: Sequence[str] | None = None, timeout: int | None = None,
                  device: str = "auto", seed: int = 0, progress: bool = True,
                  kernel_name: str = KERNEL_NAME) -> dict:
    """Execute the notebooks and publish ``<out>/<gpu-slug>/``; return the manifest (also written).

    Parameters
    ----------
    notebook_dir : folder of notebooks (default ``./notebooks``).
    out : reports root (default ``reports`` in the working directory).
    smoke : small sizes; default True unless ``device`` is a CUDA device.
    only : notebook names to run (see :func:`discover_notebooks`); the others' previous results are kept.
    timeout : per-cell execution timeout in seconds (default ``DEFAULT_TIMEOUT_S[mode]``).
    device : the ``DEVICE`` parameter; also decides which GPU's folder is written.
    seed : the ``SEED`` parameter.
    progress : papermill's per-cell progress bar.

    Returns
    -------
    dict, the manifest: ``gpu_slug``, ``device`` (:func:`fp8kv.device.describe_device`), ``mode``,
    ``seed``, ``timeout_s``, ``triton_interpret``, ``only``, ``started``, ``finished``,
    ``duration_s``, ``ok`` (every notebook in the report is ok), ``failed`` (names of those that are
    not), ``ran`` (names executed by this run; the others were carried over), ``report_dir`` (the
    folder's name, relative to ``out``: the manifest holds no absolute path), and ``notebooks``: one
    entry per notebook with ``name``, ``source``, ``source_sha256`` (:func:`notebook_hash` of the
    source notebook), ``status`` ("ok"/"failed"), ``error``, ``mode``, ``started``, ``duration_s``
    and the file names ``ipynb``, ``html``, ``results``.

    SIGTERM or SIGINT stops the run (:class:`RunInterrupted`): the kernel is killed, the staging
    folder removed, the previous report left as it was. After a run, ``<out>/index.html`` is rebuilt
    (:func:`build_index`).
    """
    from .device import describe_device, resolve_device

    dev = resolve_device(device)  # validates before any work
    default_smoke, interpret = machine_defaults(dev)
    if smoke is None:
        smoke = default_smoke
    mode = "smoke" if smoke else "full"
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S[mode]
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (int)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int")
    _check_out(out)
    books = discover_notebooks(notebook_dir, only)
    if not books:
        raise ValueError(f"no notebooks found in {notebook_dir or _default_notebook_dir()}")
    for module in ("papermill", "nbconvert", "nbformat"):
        try:
            __import__(module)
        except ImportError as exc:
            raise ImportError(f"the notebook runner needs {module}: pip install 'fp8kv[notebooks]'") from exc

    info = describe_device(dev)
    slug = info["slug"]
    root = Path(out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    final = root / slug
    staging = Path(tempfile.mkdtemp(prefix=f".{slug}.staging-", dir=root))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the published folder should not be
    # Paths in the manifest are relative to the report folder itself, so a copied folder stays right.
    manifest = {"gpu_slug": slug, "device": info, "mode": mode, "seed": seed, "timeout_s": timeout,
                "triton_interpret": None, "only": [b.stem for b in books] if only else None,
                "started": _now(), "finished": None, "duration_s": None, "ok": None, "failed": [],
                "ran": [b.stem for b in books], "report_dir": slug, "notebooks": []}
    t0 = time.perf_counter()
    children_before = _child_pids()
    try:
        with _stop_on_signals(keep_pids=children_before):
            entries = _carry_over(final, staging, {b.stem for b in books}) if only and final.is_dir() else []
            params_base = {"SMOKE": smoke, "DEVICE": str(device), "SEED": seed, "SHOW_WIDGETS": False}
            with _kernel_environment(interpret=interpret):
                manifest["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
                for i, book in enumerate(books, 1):
                    print(f"[{i}/{len(books)}] {book.stem} ({mode}, {slug})", flush=True)
                    out_dir, published = _relative_or_absolute(staging, book.parent), \
                        _relative_or_absolute(final, book.parent)
                    entry = _run_one(book, staging, {**params_base, "OUT_DIR": out_dir}, timeout, progress,
                                     kernel_name, published_out_dir=published)
                    print(f"    {entry['status']} in {entry['duration_s']:.1f} s"
                          + (f": {entry['error']}" if entry["error"] else ""), flush=True)
                    entries.append(entry)
            entries.sort(key=lambda e: e["name"])
            failed = [e["name"] for e in entries if e["status"] != "ok"]
            manifest.update(notebooks=entries, failed=failed, ok=not failed, finished=_now(),
                            duration_s=round(time.perf_counter() - t0, 2))
            (staging / MANIFEST).write_text(json.dumps(to_jsonable(manifest), indent=1) + "\n")
            _swap_into_place(staging, final)
    except BaseException as exc:
        # A second signal must not cut the clean-up short: ignore them until it is done.
        with _signals_ignored():
            if isinstance(exc, RunInterrupted):
                _stop_processes(_child_pids() - children_before)  # anything the kernel left behind
            shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        build_index(root)
    except Exception as exc:  # the report itself is published; a broken index is reported, not fatal
        print(f"warning: {root / INDEX} not rebuilt: {_error_text(exc)}", file=sys.stderr)
    return manifest


def _check_out(out) -> None:
    """``out`` must be a folder or a path that can become one (not a file, nor below a file)."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise ValueError(f"out={out!r} must be a folder path (the reports root)")
    path = Path(out)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"out={str(out)!r}: {str(p)!r} is a file, not a folder; "
                                 "pass the folder that holds the <gpu-slug>/ report folders")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ValueError(f"out={str(out)!r}: the folder {str(p)!r} is not writable")
            return


def _relative_or_absolute(path: Path, start: Path) -> str:
    """``path`` relative to ``start`` when both are on one drive (always, off Windows), else absolute."""
    return os.path.relpath(path, start) if path.anchor == start.resolve().anchor else str(path)


class RunInterrupted(BaseException):
    """The runner received SIGTERM or SIGINT: the run stops, its staging folder is removed.

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _stop_on_signals(keep_pids: set[int] = frozenset()):
    """Turn SIGTERM and SIGINT into :class:`RunInterrupted` in the main thread, for the duration.

    SIGTERM (what ``timeout``, CI runners and ``kill`` send) would otherwise end the interpreter
    without any clean-up, and SIGINT reaches the running kernel as an ordinary cell interrupt, after
    which the run would go on with the next notebook. The kernel (every process started since,
    except ``keep_pids``) is killed first, so that nothing waits for its cell to finish.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        for sig in _STOP_SIGNALS:  # a second signal must not interrupt the clean-up
            signal.signal(sig, signal.SIG_IGN)
        _stop_processes(_child_pids() - set(keep_pids))
        raise RunInterrupted(signum)

    saved = {sig: signal.signal(sig, stop) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _child_pids() -> set[int]:
    """Process ids of every live descendant of this process (empty without psutil)."""
    try:
        import psutil
    except ImportError:
        return set()
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _stop_processes(pids: set[int], wait_s: float = 5.0) -> None:
    """SIGKILL ``pids`` (the kernel this run started, and what it started) and wait for them.

    Not SIGTERM: the kernel's results go with the staging folder, and a terminated kernel logs the
    interrupted cell's traceback over the runner's last words.
    """
    if not pids:
        return
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.kill()
            procs.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=wait_s)


# --------------------------------------------------------------------------- one page across GPUs


def _report_folders(root: Path) -> list[Path]:
    """The ``<gpu-slug>/`` folders of a reports root that hold a manifest or results, sorted by name."""
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")
                  and ((p / MANIFEST).is_file() or any(p.glob("*.json"))))


def _read(folder: Path, name: str) -> dict | None:
    try:
        return load_results(folder, name)["results"]
    except (FileNotFoundError, ValueError, KeyError):
        return None


def _fmt(value, spec=".3g", unit="") -> str:
    return f"{value:{spec}}{unit}" if isinstance(value, (int, float)) and math.isfinite(value) else "–"


def gpu_summary(folder: str | os.PathLike) -> dict:
    """One GPU's row of the index, from the results JSON in its report folder (missing ones give "–").

    Keys: ``slug``, ``name``, ``arch``, ``versions``, ``mode``, ``capability`` (supported / total
    backend × KV dtype × mode rows here), ``copy_gbps``, ``speedup`` (FP8 over the best 16-bit decode,
    per head layout: median and best over the shapes measured), ``kv_capacity`` (per planner model:
    FP8 e4m3 / bf16 tokens on this GPU, or the ratio where the machine has no GPU memory), ``kl``
    (per model, mean KL of e4m3 amax-scaled KV against bf16), ``timings_meaningful``, ``pages``.
    """
    import statistics

    folder = Path(folder)
    manifest = {}
    if (folder / MANIFEST).is_file():
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    env, cap, lat, acc = (_read(folder, n) for n in ("00_environment", "03_kv_capacity", "04_decode_latency",
                                                     "06_model_accuracy"))
    device = (env or {}).get("device") or manifest.get("device") or {}
    row = {"slug": folder.name, "name": device.get("name", folder.name), "arch": device.get("arch") or "–",
           "versions": ", ".join(f"{k} {device[k]}" for k in ("torch", "triton", "flashinfer") if device.get(k)),
           "mode": manifest.get("mode", "–"), "capability": "–", "copy_gbps": None, "speedup": {},
           "kv_capacity": {}, "kl": {}, "timings_meaningful": None,
           "pages": [(e["name"], f"{folder.name}/{e['html']}") for e in manifest.get("notebooks", []) if e.get("html")]}
    if env:
        here = env.get("capability_here") or []
        row["capability"] = f"{sum(bool(r.get('supported')) for r in here)} of {len(here)} run here"
        row["copy_gbps"] = (env.get("copy_bandwidth") or {}).get("gbps")
    if lat:
        row["timings_meaningful"] = lat.get("timings_meaningful_for_gpu")
        by_heads: dict[str, list[float]] = {}
        for r in lat.get("speedup") or []:
            v = r.get("speedup_vs_bf16")
            if isinstance(v, (int, float)) and math.isfinite(v):
                by_heads.setdefault(f"{r['num_q_heads']}:{r['num_kv_heads']}", []).append(v)
        row["speedup"] = {h: (statistics.median(v), max(v)) for h, v in sorted(by_heads.items())}
    if cap:
        for r in cap.get("rows") or []:
            if r.get("gpu") == "this device" and r.get("fits") and r.get("granularity") in (None, "tensor"):
                row["kv_capacity"].setdefault(r["model"], {})[r["kv_dtype"]] = r["tokens"]
        if not row["kv_capacity"]:
            row["kv_capacity"] = {m: {"ratio": v} for m, v in (cap.get("fp8_over_bf16_tokens_ratio") or {}).items()}
    if acc:
        for r in acc.get("summary") or []:
            if r.get("config") == "e4m3 tensor amax":
                row["kl"][r["model"]] = r.get("kl_mean")
    return row


def _capacity_text(kv: dict) -> str:
    parts = []
    for model, v in kv.items():
        if "ratio" in v:
            parts.append(f"{model}: FP8/bf16 {_fmt(v['ratio'], '.3f', '×')}")
        elif "fp8_e4m3" in v:
            parts.append(f"{model}: {v['fp8_e4m3'] / 1e6:.2f} M FP8 / {v.get('bf16', float('nan')) / 1e6:.2f} M bf16")
    return "<br>".join(parts) or "–"


def _overlay_figures(folders: list[Path]):
    """Latency vs context (each GPU's largest batch) and % of copy bandwidth vs batch (largest context)."""
    import pandas as pd

    from . import viz

    frames = []
    for folder in folders:
        lat = _read(folder, "04_decode_latency")
        if lat and lat.get("rows"):
            df = pd.DataFrame(lat["rows"])
            df = df[df["status"] == "ok"]
            if len(df):
                frames.append(df.assign(gpu=folder.name))
    if not frames:
        return []
    data = pd.concat(frames, ignore_index=True)
    data["series"] = data["gpu"] + " · " + data["label"]
    at_batch = data[data["batch"] == data.groupby("gpu")["batch"].transform("max")]
    at_context = data[data["context"] == data.groupby("gpu")["context"].transform("max")]
    latency = viz.line(at_batch.sort_values(["series", "context"]), x="context", y="time_us", color="series",
                       log_x=True, log_y=True, hover=["batch", "gbps", "pct_copy_bw"],
                       title="Decode latency vs context, every GPU (each at its largest measured batch)",
                       labels={"series": "GPU · backend · KV dtype · mode"})
    share = viz.line(at_context.sort_values(["series", "batch"]), x="batch", y="pct_copy_bw", color="series",
                     log_x=True, hover=["context", "time_us", "gbps"],
                     title="Share of the copy bandwidth vs batch, every GPU (each at its largest measured context)",
                     labels={"series": "GPU · backend · KV dtype · mode"})
    return [latency, share]


def _plotlyjs_for_index(root: Path) -> str:
    """Relative path of a plotly.js of the installed version under ``root`` (written there if none is)."""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    name = f"plotly-{get_plotlyjs_version()}.min.js"
    for folder in _report_folders(root):
        if (folder / name).is_file():
            return f"{folder.name}/{name}"
    (root / name).write_text(get_plotlyjs(), encoding="utf-8")
    return name


def build_index(reports_dir: str | os.PathLike = "reports") -> Path:
    """Write ``<reports_dir>/index.html``: every GPU's report on one page, viewable offline.

    One row per ``<gpu-slug>/`` folder (:func:`gpu_summary`) with links to its pages, and figures that
    overlay the GPUs (latency vs context, share of the copy bandwidth vs batch). Built by every run
    and by ``python -m fp8kv.notebooks index``; a new GPU's folder adds a row, nothing else changes.
    """
    import html as _html

    root = Path(reports_dir)
    folders = _report_folders(root)
    rows = [gpu_summary(f) for f in folders]
    esc = _html.escape
    body = []
    for r in rows:
        speed = "<br>".join(f"Hq:Hkv {h}: median {_fmt(m, '.2f', '×')}, best {_fmt(b, '.2f', '×')}"
                            for h, (m, b) in r["speedup"].items()) or "–"
        if r["timings_meaningful"] is False:
            speed += "<br><i>(CPU timings: not meaningful for any GPU)</i>"
        kl = "<br>".join(f"{esc(m)}: {_fmt(v, '.2e')} nats/token" for m, v in r["kl"].items()) or "–"
        pages = " · ".join(f'<a href="{esc(href)}">{esc(name)}</a>' for name, href in r["pages"]) or "–"
        body.append("<tr>" + "".join(f"<td>{c}</td>" for c in (
            f"<b>{esc(r['name'])}</b><br><code>{esc(r['slug'])}</code>", esc(r["arch"]), esc(r["versions"]),
            esc(r["mode"]), esc(r["capability"]), _fmt(r["copy_gbps"], ".4g", " GB/s"), speed,
            _capacity_text(r["kv_capacity"]), kl, pages)) + "</tr>")
    figures = _overlay_figures(folders)
    plotly_tag = f'<script src="{_plotlyjs_for_index(root)}" charset="utf-8"></script>' if figures else ""
    figure_html = "\n".join(f.to_html(full_html=False, include_plotlyjs=False, include_mathjax=False)
                             for f in figures)
    header = ("GPU", "arch", "versions", "run", "capability", "copy bandwidth",
              "FP8 over best 16-bit decode", "KV tokens (planner models, this GPU)", "KL, e4m3 amax vs bf16", "pages")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>fp8kv: every GPU</title>{plotly_tag}
<style>body{{font-family:system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse;font-size:90%}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}}th{{background:#f4f4f4}}</style>
</head><body>
<h1>fp8kv: FP8 KV caches on every GPU that has run the notebooks</h1>
<p>One row per report folder under this page ({len(rows)}). Each links to its notebook pages.</p>
<table><tr>{''.join(f'<th>{h}</th>' for h in header)}</tr>
{chr(10).join(body)}
</table>
{figure_html}
</body></html>
"""
    path = root / INDEX
    tmp = path.with_name(f".{INDEX}.tmp")
    tmp.write_text(drop_network_loads(page), encoding="utf-8")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- command line


def _positive_seconds(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number of seconds")
    return int(value)


def _device_here(text: str) -> str:
    from .device import resolve_device

    try:
        resolve_device(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _out_folder(text: str) -> str:
    try:
        _check_out(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _one_line_error(parser: argparse.ArgumentParser):
    """``parser.error`` that prints one line, ``PROG: error: MESSAGE`` (the usage is in --help), exit 2."""

    def error(message: str):
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(message).split())}\n")

    return error


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` options, shared by ``python -m fp8kv.notebooks`` and ``fp8kv notebooks run``.

    Values are checked while parsing (a bad one exits with status 2 and one line on stderr).
    """
    parser.error = _one_line_error(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                      help="small sizes (default unless DEVICE is a CUDA device)")
    mode.add_argument("--full", dest="smoke", action="store_false", help="full sizes (default on a CUDA device)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these notebooks (stem, file name or number prefix such as 01)")
    parser.add_argument("--timeout", type=_positive_seconds, default=None, metavar="S",
                        help="per-cell timeout, a positive whole number of seconds (default: "
                        + ", ".join(f"{v} in {k} mode" for k, v in DEFAULT_TIMEOUT_S.items()) + ")")
    parser.add_argument("--out", type=_out_folder, default="reports",
                        help="reports root folder; results go to OUT/<gpu-slug>/ (default: reports)")
    parser.add_argument("--notebooks", default=None, metavar="DIR", help="notebook folder (default: ./notebooks)")
    parser.add_argument("--device", type=_device_here, default="auto",
                        help="DEVICE parameter: auto, cpu, cuda, cuda:N; must exist here (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="SEED parameter (default: 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no per-cell progress bar")


def add_actions(parser: argparse.ArgumentParser) -> None:
    """The ``run`` and ``list`` actions under ``parser`` (``fp8kv notebooks`` / ``python -m fp8kv.notebooks``).

    Parse with them, then call :func:`run_action` on the result.
    """
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="execute notebooks/*.ipynb, render HTML, write reports/<gpu-slug>/")
    add_run_arguments(run)
    run.set_defaults(parser=run)
    ls = actions.add_parser("list", help="list the notebooks a run would execute, in order")
    ls.add_argument("--notebooks", default=None, metavar="DIR", help="notebook folder (default: ./notebooks)")
    ls.set_defaults(parser=ls)


def run_action(args: argparse.Namespace) -> int:
    """Carry out the parsed ``run`` or ``list`` action (see :func:`add_actions`); return the exit status."""
    if args.action == "list":
        try:
            books = discover_notebooks(args.notebooks)
        except ValueError as exc:
            args.parser.error(str(exc))
        for book in books:
            print(book.stem)
        return 0
    try:
        check_run_args(args)
    except (TypeError, ValueError) as exc:
        args.parser.error(str(exc))
    return run_from_args(args)


def check_run_args(args: argparse.Namespace) -> None:
    """What ``notebooks run`` would otherwise find only after starting: the notebooks named by
    --only (the device, the timeout and the reports folder are checked as they are parsed).
    Raises ValueError naming the flag."""
    discover_notebooks(args.notebooks, args.only)


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed ``run`` options; print the summary; return the exit status.

    0: every notebook ran; 1: some failed (the report is published with them); 2: bad arguments
    (one line on stderr); 128 + N: stopped by signal N (SIGINT 130, SIGTERM 143), nothing published.
    """
    prog = "fp8kv notebooks run"
    print(f"{prog}: device {args.device}, notebooks from {args.notebooks or _default_notebook_dir()}, "
          f"out {args.out}", flush=True)
    try:
        manifest = run_notebooks(args.notebooks, args.out, smoke=args.smoke, only=args.only, timeout=args.timeout,
                                 device=args.device, seed=args.seed, progress=args.progress)
    except (TypeError, ValueError) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except RunInterrupted as exc:
        print(f"{prog}: {exc}; nothing was published, the previous report (if any) is unchanged",
              file=sys.stderr)
        return 128 + exc.signum
    folder = Path(args.out) / manifest["report_dir"]
    print(f"\nreport: {folder}  ({manifest['mode']}, {manifest['duration_s']:.0f} s); "
          f"all GPUs: {Path(args.out) / INDEX}")
    for e in manifest["notebooks"]:
        kept = "" if e["name"] in manifest["ran"] else "  (kept from the previous run)"
        print(f"  {e['status']:>6}  {e['name']}  {e['html'] or '(no html)'}{kept}")
    failed_now = [n for n in manifest["failed"] if n in manifest["ran"]]
    if failed_now:
        print(f"FAILED: {', '.join(failed_now)} (see their .html / .ipynb in the report)", file=sys.stderr)
        return 1
    return 0


def index_main(argv: Sequence[str]) -> int:
    """``python -m fp8kv.notebooks index [--out reports]``: rebuild ``<out>/index.html`` from the folders there."""
    parser = argparse.ArgumentParser(prog="fp8kv notebooks index",
                                     description="Build OUT/index.html, one page across every GPU's report.")
    parser.error = _one_line_error(parser)
    parser.add_argument("--out", type=_out_folder, default="reports",
                        help="reports root holding the <gpu-slug>/ folders (default: reports)")
    args = parser.parse_args(list(argv))
    root = Path(args.out)
    if not root.is_dir():
        print(f"{parser.prog}: error: out={args.out!r} is not a folder; run the notebooks first", file=sys.stderr)
        return 2
    path = build_index(root)
    print(f"index: {path} ({len(_report_folders(root))} report folder(s))")
    return 0


HTML_EXPORT_FAILED = " | HTML export failed: "


def render_report(folder: str | os.PathLike) -> list[str]:
    """Render the pages of a report folder whose notebooks ran but whose HTML export failed.

    A GPU machine may run the notebooks without nbconvert's page templates (a package installed
    without its data files): the executed ``.ipynb`` and the results are there, the ``.html`` is not.
    This renders each such page here, as the runner would have, and marks it ok in the manifest.
    Notebooks that failed to *run* stay failed. Returns the names rendered.
    """
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"folder={str(folder)!r} holds no {MANIFEST}: not a report folder")
    manifest = json.loads(manifest_path.read_text())
    done = []
    for entry in manifest["notebooks"]:
        error = entry.get("error") or ""
        if entry.get("html") or not entry.get("ipynb") or not error.startswith(HTML_EXPORT_FAILED):
            continue
        executed = folder / entry["ipynb"]
        entry["html"] = render_html(executed, folder / f"{entry['name']}.html").name
        externalize_plotlyjs(folder / entry["html"])
        strip_embedded_plotlyjs(executed)
        entry.update(status="ok" if entry.get("results") else "failed", error=None)
        done.append(entry["name"])
    failed = [e["name"] for e in manifest["notebooks"] if e["status"] != "ok"]
    manifest.update(failed=failed, ok=not failed)
    manifest_path.write_text(json.dumps(to_jsonable(manifest), indent=1) + "\n")
    return done


def render_main(argv: Sequence[str]) -> int:
    """``python -m fp8kv.notebooks render FOLDER``: the HTML pages of a run whose export failed."""
    parser = argparse.ArgumentParser(prog="fp8kv notebooks render",
                                     description="Render the pages of a report folder whose notebooks ran but "
                                                 "whose HTML export failed (e.g. nbconvert without its templates).")
    parser.error = _one_line_error(parser)
    parser.add_argument("folder", help="a report folder, such as reports/nvidia-h200")
    args = parser.parse_args(list(argv))
    try:
        names = render_report(args.folder)
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"rendered {len(names)} page(s) in {args.folder}: {', '.join(names) or 'none needed'}")
    build_index(Path(args.folder).parent)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fp8kv.notebooks [run|list|index|render] [options]``, the same as ``fp8kv notebooks ...``.

    Without an action, ``run`` is meant: ``python -m fp8kv.notebooks --smoke`` runs the notebooks.
    """
    from .checks import ArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "index":
        return index_main(argv[1:])
    if argv and argv[0] == "render":
        return render_main(argv[1:])
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    parser = ArgumentParser(prog="fp8kv notebooks", description="Run the notebooks headless and publish "
                                                                "reports/<gpu>/.")
    add_actions(parser)
    return run_action(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
