"""Notebook files and their pages: discovery, the source hash a page records, HTML export with
plotly.js kept once in the reports root, and rendering a report folder whose export failed."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..results import to_jsonable, write_atomic

MANIFEST = "manifest.json"
INDEX = "index.html"
# --------------------------------------------------------------------------- discovery and rendering


# The folder that holds the fp8kv package: this file is <repo>/fp8kv/notebooks/pages.py. <repo>/notebooks holds
# the .ipynb files (<repo>/fp8kv/notebooks is this Python subpackage), and <repo> is what the notebooks' kernels
# put on PYTHONPATH to import fp8kv (<repo>/fp8kv would let its modules shadow top-level names: checks, ops...).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def default_notebook_dir() -> Path:
    """``./notebooks`` if present (the repository root is the usual working directory), else the
    ``notebooks`` folder beside the installed (editable) package."""
    here = Path.cwd() / "notebooks"
    if here.is_dir():
        return here
    return PACKAGE_PARENT / "notebooks"


# What the runner writes for a notebook NAME: NAME.ipynb, NAME.html, NAME.json; nbconvert would put a
# page's assets in NAME_files/. Nothing else is the notebook's: "04_decode_latency.json" is not 04_decode's,
# nor is plotly-<version>.min.js (the pages' library) a notebook "plotly-<version>.min"'s.
OWN_SUFFIXES = (".ipynb", ".html", ".json", "_files")


def own_files(name: str) -> tuple[str, ...]:
    """The names of notebook ``name``'s files in a report folder (:data:`OWN_SUFFIXES`)."""
    return tuple(name + s for s in OWN_SUFFIXES)


def owns(name: str, filename: str) -> bool:
    """Whether ``filename`` (in a report or staging folder) is one of notebook ``name``'s own files
    (:func:`own_files`). A prefix is not enough: notebooks ``04_decode`` and ``04_decode_latency`` each own
    only their own files."""
    return filename in own_files(name)


def runner_file(filename: str) -> bool:
    """Whether ``filename`` in a report folder is the runner's own: its manifest or the pages' plotly.js."""
    return filename == MANIFEST or re.fullmatch(r"plotly-[0-9A-Za-z.+-]+\.min\.js", filename) is not None


def check_notebook_names(books: Sequence[Path]) -> None:
    """Refuse (ValueError naming the notebook) notebooks whose files would overwrite the runner's own
    (``manifest.ipynb``: its results would be the report's manifest.json, the report still saying ok) or
    each other's where case is ignored (``A.ipynb`` beside ``a.ipynb``, one file on macOS or Windows)."""
    seen: dict[str, Path] = {}
    for book in books:
        for f in own_files(book.stem):
            if runner_file(f) or runner_file(f.lower()):
                raise ValueError(f"notebook {book} cannot be run: its file {f} would be the runner's own {f.lower()} "
                                 "in the report folder; rename the notebook")
        other = seen.setdefault(book.stem.lower(), book)
        if other != book:
            raise ValueError(f"notebooks {other} and {book} differ only in case: their files would be one file "
                             "where case is ignored (macOS, Windows); rename one")


def _plain_file_name(value) -> bool:
    return (isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value
            and "\0" not in value)


def read_manifest(folder: str | os.PathLike) -> dict:
    """``<folder>/manifest.json`` as the runner writes it, checked; ValueError naming the file and what is wrong.

    A JSON object whose ``notebooks`` is a list of objects, each with a ``name`` (a file stem); the
    file fields ``ipynb``, ``html``, ``results`` are plain file names in the folder (or null), and
    ``status`` / ``error`` / ``device`` have the runner's types where present. A folder without such a
    manifest is not a report (a truncated file, a foreign folder, one written by hand).
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ValueError(f"{path} does not exist: not a report folder (the runner writes one per report)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {exc}); expected the runner's JSON "
                         "manifest") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} holds a JSON {type(manifest).__name__}; expected an object with a "
                         "'notebooks' list, as the runner writes")
    entries = manifest.get("notebooks")
    if not isinstance(entries, list):
        got = "missing" if "notebooks" not in manifest else f"{entries!r:.60}"
        raise ValueError(f"{path}: 'notebooks' is {got}; expected a list of notebook entries")
    if not isinstance(manifest.get("device", {}) or {}, dict):
        raise ValueError(f"{path}: 'device' is {manifest['device']!r:.60}; expected an object")
    for i, entry in enumerate(entries):
        where = f"{path}: notebooks[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is {entry!r:.60}; expected an object with a 'name'")
        name = entry.get("name")
        if not isinstance(name, str) or not _plain_file_name(name):
            raise ValueError(f"{where} has name {name!r:.60}; expected the notebook's file stem")
        for key in ("ipynb", "html", "results"):
            if entry.get(key) is not None and not _plain_file_name(entry[key]):
                raise ValueError(f"{where} ({name}) has {key}={entry[key]!r:.60}; expected a file name in the "
                                 "folder, or null")
        for key in ("status", "error"):
            if entry.get(key) is not None and not isinstance(entry[key], str):
                raise ValueError(f"{where} ({name}) has {key}={entry[key]!r:.60}; expected a string")
    return manifest


def discover_notebooks(notebook_dir: str | os.PathLike | None = None,
                       only: Sequence[str] | None = None) -> list[Path]:
    """Notebooks to run, sorted by file name.

    Parameters
    ----------
    notebook_dir : folder of ``*.ipynb`` (default ``./notebooks``).
    only : names to keep; each matches a notebook by stem (``"01_fp8_formats"``), file name
        (``"01_fp8_formats.ipynb"``) or number prefix (``"01"``). An unknown name is a ValueError.

    A notebook whose files would be the runner's own or another's (:func:`check_notebook_names`) is a
    ValueError naming it; so is a folder without notebooks.
    """
    folder = Path(notebook_dir) if notebook_dir is not None else default_notebook_dir()
    if not folder.is_dir():
        raise ValueError(f"notebook_dir={str(folder)!r} is not a folder; pass the folder holding the .ipynb files")
    books = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    if not books:  # for list as for run: an empty folder is no list of notebooks
        raise ValueError(f"no notebooks found in {folder}; expected the folder holding the .ipynb files")
    if only is None:
        check_notebook_names(books)
        return books
    if isinstance(only, str):
        only = [only]
    chosen = []
    for want in only:
        hits = [p for p in books if want in (p.stem, p.name) or p.stem.split("_")[0] == want]
        if not hits:
            raise ValueError(f"only={want!r} matches no notebook; available: {[p.stem for p in books]}")
        chosen.extend(h for h in hits if h not in chosen)
    check_notebook_names(chosen)
    return sorted(chosen)


# <script src="http(s)://..."></script> and <link href="http(s)://..."> : what a page would fetch from the network.
_NETWORK_SCRIPT = re.compile(r'<script\b[^>]*\bsrc\s*=\s*["\']?(?:https?:)?//[^>]*>\s*</script>', re.IGNORECASE)
_NETWORK_LINK = re.compile(r'<link\b[^>]*\bhref\s*=\s*["\']?(?:https?:)?//[^>]*>', re.IGNORECASE)
# An inline script of nbconvert's template that fetches the widget renderer from a CDN where a page holds widget
# outputs (a progress bar's, say): they show nothing without a kernel, so the page goes without it.
_WIDGET_LOADER = re.compile(r"<script\b[^>]*>(?:(?!</script>).)*?https?://[^'\"]*@jupyter-widgets(?:(?!</script>).)*?</script>",
                            re.IGNORECASE | re.DOTALL)


def drop_network_loads(html: str) -> str:
    """Remove every ``<script src=...>`` and ``<link href=...>`` that points at the network.

    nbconvert's lab template loads require.js and MathJax 2 from a CDN, and plotly's ``notebook``
    renderer adds MathJax 3 from a CDN before each figure. The pages need none of them: plotly.js is
    loaded from the file in the reports root, and the notebooks write no LaTeX. A page must view offline.
    The template's inline loader of the widget renderer (from a CDN, where a page holds widget outputs) goes too.
    """
    return _WIDGET_LOADER.sub("", _NETWORK_LINK.sub("", _NETWORK_SCRIPT.sub("", html)))


def template_dirs() -> list[str]:
    """nbconvert's page templates where ``pip install --target DIR`` puts them (``DIR/share/jupyter/
    nbconvert/templates``, beside the package): nbconvert itself searches only the environment's
    prefix and the user's and system's Jupyter paths, so without this the export fails there."""
    import nbconvert

    root = Path(nbconvert.__file__).resolve().parents[1] / "share" / "jupyter" / "nbconvert" / "templates"
    return [str(root)] if root.is_dir() else []


HEADLINE_TAG = "headline"


def headline_first(nb):
    """The notebook ``nb`` (nbformat) with its cells tagged :data:`HEADLINE_TAG` moved right after its first
    Markdown cell (the title), so that a page's first screen gives the answer its last cells computed.
    Returns ``nb``, changed in place."""
    tagged = [c for c in nb.cells if HEADLINE_TAG in c.get("metadata", {}).get("tags", [])]
    if tagged:
        rest = [c for c in nb.cells if c not in tagged]
        at = next((i + 1 for i, c in enumerate(rest) if c.cell_type == "markdown"), 0)
        nb.cells = rest[:at] + tagged + rest[at:]
    return nb


def render_html(executed_ipynb: str | os.PathLike, html_path: str | os.PathLike) -> Path:
    """Render an executed notebook to a standalone HTML file (nbconvert ``HTMLExporter``, lab template)
    that loads nothing from the network (:func:`drop_network_loads`), its headline cells on the first
    screen (:func:`headline_first`)."""
    import nbformat
    from nbconvert import HTMLExporter

    # Both: the base dirs find the lab template, the plain paths its ``{% extends 'base/...' %}``.
    dirs = template_dirs()
    exporter = HTMLExporter(extra_template_basedirs=dirs, extra_template_paths=dirs)
    path = Path(executed_ipynb)
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if f'"{HEADLINE_TAG}"' in text:
        nb = headline_first(nbformat.reads(text, as_version=4))
        # the resources from_filename would give: the page's <title> is the notebook's name
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem, "path": str(path.parent)}})
    else:  # nothing to move (or nothing readable here: the exporter names the file)
        body, _ = exporter.from_filename(str(path))
    html_path = Path(html_path)
    write_atomic(html_path, drop_network_loads(body))  # render_report rewrites pages in a published folder
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


# The pages' plotly.js: in the reports root, above every report folder (``../``), or, in pages written before it moved
# there, beside the page
PLOTLYJS_SRC = re.compile(r'<script src="((?:\.\./)?plotly-[0-9A-Za-z.+-]+\.min\.js)" charset="utf-8"></script>')


def externalize_plotlyjs(html_path: str | os.PathLike) -> str | None:
    """Load plotly.js from a file in the reports root instead of embedding it; return the page's ``src`` for it.

    The page's inline copy of the library (the one ``fp8kv.viz.setup_plotly`` embeds) is replaced
    by ``<script src="../plotly-<version>.min.js">`` and the library is written once into the folder above the
    page's (the reports root, which holds every GPU's folder, a run's staging folder and the index), so the reports
    hold one 4.6 MB copy, not one per notebook or per GPU, and still view offline.
    Idempotent; returns None when the page holds no plotly.js.
    """
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    path = Path(html_path)
    text = path.read_text(encoding="utf-8")
    found = PLOTLYJS_SRC.search(text)
    if found:
        return found.group(1)
    library = get_plotlyjs()
    inline = f"<script>{library}</script>"
    if inline not in text:
        return None
    name = f"plotly-{get_plotlyjs_version()}.min.js"
    target = path.resolve().parent.parent / name
    if not target.is_file():  # other pages may load it already: never seen half-written
        write_atomic(target, library)
    src = f"../{name}"
    write_atomic(path, text.replace(inline, f'<script src="{src}" charset="utf-8"></script>', 1))
    return src


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
    manifest = read_manifest(folder)  # a truncated or foreign manifest: ValueError naming it
    todo = [e for e in manifest["notebooks"] if not e.get("html") and e.get("ipynb")
            and (e.get("error") or "").startswith(HTML_EXPORT_FAILED)]
    for entry in todo:  # every page's notebook is checked before anything is written
        if not (folder / entry["ipynb"]).is_file():
            raise ValueError(f"{folder / entry['ipynb']} is missing: {manifest_path} names it as "
                             f"{entry['name']}'s executed notebook, so its page cannot be rendered")
    done = []
    try:
        for entry in todo:
            executed = folder / entry["ipynb"]
            try:
                entry["html"] = render_html(executed, folder / f"{entry['name']}.html").name
                externalize_plotlyjs(folder / entry["html"])
                strip_embedded_plotlyjs(executed)
            except Exception as exc:  # an unreadable notebook, a missing template: one line naming the file
                entry["html"] = None
                raise ValueError(f"{executed} could not be rendered: {type(exc).__name__}: {exc}") from exc
            entry.update(status="ok" if entry.get("results") else "failed", error=None)
            done.append(entry["name"])
    finally:  # the pages rendered before a failure are recorded, not lost
        if done or not todo:
            failed = [e["name"] for e in manifest["notebooks"] if e.get("status") != "ok"]
            manifest.update(failed=failed, ok=not failed)
            write_atomic(manifest_path, json.dumps(to_jsonable(manifest), indent=1) + "\n")
    return done
