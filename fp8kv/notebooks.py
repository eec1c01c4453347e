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
   notebook its status and duration).

Report folders
--------------
Everything is written into a hidden staging folder beside the target (``<out>/.<slug>.staging-*``)
and moved into place only at the end: the old ``<out>/<slug>`` is renamed aside, the staging folder
renamed to ``<out>/<slug>``, then the old one deleted. A reader never sees a half-written report, and
a run on one GPU never touches another GPU's folder. If the runner itself is interrupted or crashes,
the staging folder is deleted and the previous report stays as it was.

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
import datetime as _dt
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    "strip_embedded_plotlyjs",
    "externalize_plotlyjs",
    "add_run_arguments",
    "run_from_args",
    "main",
]

# Parameters every notebook declares in its cell tagged "parameters" (and the runner injects).
PARAMETER_NAMES = ("SMOKE", "DEVICE", "OUT_DIR", "SEED", "SHOW_WIDGETS")
# Per-cell execution timeout, seconds, by mode.
DEFAULT_TIMEOUT_S = {"smoke": 600, "full": 1800}
KERNEL_NAME = "python3"
MANIFEST = "manifest.json"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- results JSON


def to_jsonable(obj: Any) -> Any:
    """Convert results to plain JSON types.

    dict keys become strings; tuples/sets become lists; numpy / torch scalars become numbers and
    arrays/tensors nested lists; a pandas DataFrame becomes a list of row dicts and a Series a
    dict; dataclasses become dicts; ``torch.dtype``, paths and other objects become ``str``.
    Non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"`` (JSON has no such numbers).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    mod = type(obj).__module__.split(".")[0]
    if mod == "numpy":
        if hasattr(obj, "tolist"):
            return to_jsonable(obj.tolist())
        return str(obj)
    if mod == "torch":
        import torch

        if isinstance(obj, torch.Tensor):
            return to_jsonable(obj.detach().cpu().tolist())
        return str(obj)
    if mod == "pandas":
        import pandas as pd

        if isinstance(obj, pd.DataFrame):
            return to_jsonable(obj.to_dict(orient="records"))
        if isinstance(obj, pd.Series):
            return to_jsonable(obj.to_dict())
        return str(obj)
    return str(obj)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name={name!r} must be a file stem of letters, digits, '_', '-', '.' "
                         "(the notebook's file name without .ipynb, e.g. '01_fp8_formats')")


def save_results(out_dir: str | os.PathLike, name: str, results: dict, device=None) -> Path:
    """Write a notebook's numbers to ``out_dir/<name>.json`` and return the path.

    Parameters
    ----------
    out_dir : folder (created if missing); notebooks pass their ``OUT_DIR`` parameter.
    name : the notebook's file stem, e.g. ``"01_fp8_formats"`` (the runner looks for that file).
    results : dict of numbers, lists, DataFrames, tensors... (converted by :func:`to_jsonable`).
    device : the notebook's ``DEVICE``; its :func:`fp8kv.device.describe_device` is stored beside.

    The file holds ``{"notebook": name, "saved_at": ISO time, "device": {...}, "results": {...}}``.
    """
    from .device import describe_device

    _check_name(name)
    if not isinstance(results, dict):
        raise TypeError(f"results must be a dict, got {type(results).__name__}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"notebook": name, "saved_at": _now(), "device": describe_device(device), "results": to_jsonable(results)}
    path = out / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)  # never leave a truncated JSON behind
    return path


def load_results(out_dir: str | os.PathLike, name: str) -> dict:
    """Read what :func:`save_results` wrote: the whole document (``doc["results"]`` holds the numbers)."""
    _check_name(name)
    path = Path(out_dir) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results {path}; run the notebook {name!r} first")
    return json.loads(path.read_text())


def collect_results(name: str, reports_dir: str | os.PathLike = "reports") -> dict[str, dict]:
    """One notebook's results from every GPU's report folder: ``{gpu_slug: document}``.

    For notebooks that compare machines; folders without that notebook's JSON are skipped.
    """
    _check_name(name)
    found = {}
    root = Path(reports_dir)
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if (folder / f"{name}.json").is_file():
                found[folder.name] = load_results(folder, name)
    return found


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


def render_html(executed_ipynb: str | os.PathLike, html_path: str | os.PathLike) -> Path:
    """Render an executed notebook to a standalone HTML file (nbconvert ``HTMLExporter``, lab template)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(executed_ipynb))
    html_path = Path(html_path)
    html_path.write_text(body, encoding="utf-8")
    return html_path


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
def _kernel_environment(cuda: bool):
    """Environment the notebook kernels inherit, restored afterwards.

    * ``PYTHONPATH`` gains the package's root, so kernels (which start in notebooks/) import fp8kv
      even when it is not pip-installed;
    * without CUDA, ``TRITON_INTERPRET=1`` (unless already set), so Triton kernels run under the
      interpreter in smoke runs; it must be set before triton is imported, hence here.
    """
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "TRITON_INTERPRET")}
    root = str(Path(__file__).resolve().parent.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([root, saved["PYTHONPATH"]]) if saved["PYTHONPATH"] else root
    if not cuda and saved["TRITON_INTERPRET"] is None:
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


def _run_one(book: Path, staging: Path, params: dict, timeout_s: int, progress: bool,
             kernel_name: str) -> dict:
    import papermill as pm

    name = book.stem
    executed = staging / f"{name}.ipynb"
    entry = {"name": name, "source": book.name, "status": "ok", "error": None,
             "mode": "smoke" if params["SMOKE"] else "full", "started": _now(), "duration_s": None,
             "ipynb": None, "html": None, "results": None}
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
    ``seed``, ``timeout_s``, ``triton_interpret``, ``command``, ``started``, ``finished``,
    ``duration_s``, ``ok`` (every notebook in the report is ok), ``failed`` (names of those that are
    not), ``ran`` (names executed by this run; the others were carried over), ``report_dir``, and
    ``notebooks``: one entry per notebook with ``name``, ``source``, ``status`` ("ok"/"failed"),
    ``error``, ``mode``, ``started``, ``duration_s`` and the file names ``ipynb``, ``html``, ``results``.
    """
    from .device import describe_device, resolve_device

    dev = resolve_device(device)  # validates before any work
    if smoke is None:
        smoke = dev.type != "cuda"
    mode = "smoke" if smoke else "full"
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S[mode]
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (int)")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an int")
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
    manifest = {"gpu_slug": slug, "device": info, "mode": mode, "seed": seed, "timeout_s": timeout,
                "triton_interpret": None, "command": " ".join(sys.argv), "started": _now(), "finished": None,
                "duration_s": None, "ok": None, "failed": [], "ran": [b.stem for b in books],
                "report_dir": str(final), "notebooks": []}
    t0 = time.perf_counter()
    try:
        entries = _carry_over(final, staging, {b.stem for b in books}) if only and final.is_dir() else []
        params_base = {"SMOKE": smoke, "DEVICE": str(device), "SEED": seed, "SHOW_WIDGETS": False}
        with _kernel_environment(cuda=dev.type == "cuda"):
            manifest["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
            for i, book in enumerate(books, 1):
                print(f"[{i}/{len(books)}] {book.stem} ({mode}, {slug})", flush=True)
                out_dir = os.path.relpath(staging, book.parent) if staging.anchor == book.resolve().anchor \
                    else str(staging)
                entry = _run_one(book, staging, {**params_base, "OUT_DIR": out_dir}, timeout, progress,
                                 kernel_name)
                print(f"    {entry['status']} in {entry['duration_s']:.1f} s"
                      + (f": {entry['error']}" if entry["error"] else ""), flush=True)
                entries.append(entry)
        entries.sort(key=lambda e: e["name"])
        failed = [e["name"] for e in entries if e["status"] != "ok"]
        manifest.update(notebooks=entries, failed=failed, ok=not failed, finished=_now(),
                        duration_s=round(time.perf_counter() - t0, 2))
        (staging / MANIFEST).write_text(json.dumps(to_jsonable(manifest), indent=1) + "\n")
        _swap_into_place(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- command line


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` options, shared by ``python -m fp8kv.notebooks`` and ``fp8kv notebooks run``."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                      help="small sizes (default unless DEVICE is a CUDA device)")
    mode.add_argument("--full", dest="smoke", action="store_false", help="full sizes (default on a CUDA device)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these notebooks (stem, file name or number prefix such as 01)")
    parser.add_argument("--timeout", type=int, default=None, metavar="S",
                        help="per-cell timeout in seconds (default: "
                        + ", ".join(f"{v} in {k} mode" for k, v in DEFAULT_TIMEOUT_S.items()) + ")")
    parser.add_argument("--out", default="reports", help="reports root; results go to OUT/<gpu-slug>/ (default: reports)")
    parser.add_argument("--notebooks", default=None, metavar="DIR", help="notebook folder (default: ./notebooks)")
    parser.add_argument("--device", default="auto", help="DEVICE parameter: auto, cpu, cuda, cuda:N (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="SEED parameter (default: 0)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no per-cell progress bar")


def run_from_args(args: argparse.Namespace) -> int:
    """Run with parsed ``run`` options; print the summary; return the exit status (0 ok, 1 failures)."""
    try:
        manifest = run_notebooks(args.notebooks, args.out, smoke=args.smoke, only=args.only, timeout=args.timeout,
                                 device=args.device, seed=args.seed, progress=args.progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"\nreport: {manifest['report_dir']}  ({manifest['mode']}, {manifest['duration_s']:.0f} s)")
    for e in manifest["notebooks"]:
        kept = "" if e["name"] in manifest["ran"] else "  (kept from the previous run)"
        print(f"  {e['status']:>6}  {e['name']}  {e['html'] or '(no html)'}{kept}")
    failed_now = [n for n in manifest["failed"] if n in manifest["ran"]]
    if failed_now:
        print(f"FAILED: {', '.join(failed_now)} (see their .html / .ipynb in the report)", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fp8kv.notebooks [run|list] [options]``, the same as ``fp8kv notebooks ...``.

    Without an action, ``run`` is meant: ``python -m fp8kv.notebooks --smoke`` runs the notebooks.
    """
    from .cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    return cli_main(["notebooks", *argv])


if __name__ == "__main__":
    sys.exit(main())
