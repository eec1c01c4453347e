"""The headless runner: every notebook through papermill into a staging folder, swapped into
``reports/<gpu>/`` at the end; a manifest per run; SIGTERM, SIGINT, SIGHUP and every other signal that
would end the process stop it cleanly."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from .. import checks
from ..interrupts import signals_ignored, stop_signals, stop_signals_handled
from ..results import to_jsonable, utc_stamp, write_atomic
from .index import build_index
from .interrupted import keep_partial, summary
from .pages import (
    HTML_EXPORT_FAILED,
    INDEX,
    MANIFEST,
    PACKAGE_PARENT,
    PLOTLYJS_SRC,
    discover_notebooks,
    externalize_plotlyjs,
    notebook_hash,
    own_files,
    owns,
    read_manifest,
    render_html,
    runner_file,
    strip_embedded_plotlyjs,
)
from .parameters import PARAMETER_NAMES, check_parameters
from .setup import machine_defaults

# Per-cell execution timeout, seconds, by mode.
DEFAULT_TIMEOUT_S = {"smoke": 600, "full": 1800}
KERNEL_NAME = "python3"
# tqdm's switch (4.66+) and huggingface_hub's, which transformers' weight loading follows
NO_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
# --------------------------------------------------------------------------- the runner


@contextlib.contextmanager
def _kernel_environment(interpret: bool):
    """Environment the notebook kernels inherit, restored afterwards.

    * ``PYTHONPATH`` gains the package's root, so kernels (which start in notebooks/) import fp8kv
      even when it is not pip-installed;
    * without CUDA, ``TRITON_INTERPRET=1`` (unless already set), so Triton kernels run under the
      interpreter in smoke runs; it must be set before triton is imported, hence here;
    * ``FP8KV_HEADLESS=1`` (:func:`fp8kv.ui.headless`): no widget is ever displayed;
    * no progress bars (:data:`NO_PROGRESS_BARS`): loading a model's weights drew them as widgets, which a page
      cannot show and which made it fetch the widget renderer from a CDN.
    """
    from ..capability import INTERPRETER_ENV, use_interpreter
    from ..ui import HEADLESS_ENV

    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", INTERPRETER_ENV, HEADLESS_ENV, *NO_PROGRESS_BARS)}
    os.environ[HEADLESS_ENV] = "1"  # no person watches these kernels: fp8kv.ui shows no widgets
    os.environ.update(NO_PROGRESS_BARS)
    root = str(PACKAGE_PARENT)  # from there ``import fp8kv`` works
    os.environ["PYTHONPATH"] = os.pathsep.join([root, saved["PYTHONPATH"]]) if saved["PYTHONPATH"] else root
    if interpret and saved[INTERPRETER_ENV] is None:
        use_interpreter(os.environ)  # for the kernels, which import triton afresh
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

    from ..device import source_digest

    name = book.stem
    executed = staging / f"{name}.ipynb"
    # the fp8kv code this page's kernel imports (PYTHONPATH: the package's root), read as it starts: a page's
    # numbers stand for that code, which the index compares with the code of the day
    entry = {"name": name, "source": book.name, "source_sha256": notebook_hash(book),
             "fp8kv_source": source_digest(PACKAGE_PARENT / "fp8kv"), "status": "ok",
             "error": None, "mode": "smoke" if params["SMOKE"] else "full",
             "parameters": {k: v for k, v in params.items() if k not in PARAMETER_NAMES}, "started": utc_stamp(),
             "duration_s": None, "ipynb": None, "html": None, "results": None}
    for stale in [f for f in staging.iterdir() if owns(name, f.name)]:
        # nothing but this execution may stand for its results: a file already here (carried over by
        # mistake, say) would hide "did not write NAME.json"
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
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
            entry.update(status="failed", error=(entry["error"] or "") + HTML_EXPORT_FAILED + _error_text(exc))
    if (staging / f"{name}.json").is_file():
        entry["results"] = f"{name}.json"
    elif entry["status"] == "ok":
        entry.update(status="failed", error=f"the notebook did not write {name}.json "
                                            f"(call fp8kv.notebooks.save_results(OUT_DIR, {name!r}, ...))")
    return entry


def _carry_over(previous: Path, staging: Path, rerun: set[str]) -> list[dict]:
    """Copy the previous report's files and manifest entries of notebooks not rerun now.

    A notebook's files are exactly its own (:func:`owns`): a kept ``04_decode`` does not take
    ``04_decode_latency.json``, which would put an old run's results over this run's.
    """
    try:
        old_manifest = read_manifest(previous)
    except ValueError as exc:  # nothing to carry over from a report that cannot be read: say so
        if (previous / MANIFEST).exists():
            print(f"warning: nothing carried over from the previous report: {exc}", file=sys.stderr)
        return []
    # an entry whose files would be the runner's own (a notebook named manifest, refused since) is not kept
    kept = [e for e in old_manifest["notebooks"] if e["name"] not in rerun
            and not any(runner_file(f) for f in own_files(e["name"]))]
    keep_names = {e["name"] for e in kept}
    for f in previous.iterdir():
        if not any(owns(n, f.name) for n in keep_names):
            continue
        if f.is_dir():  # an HTML page's assets folder (NAME_files)
            shutil.copytree(f, staging / f.name, dirs_exist_ok=True)
            continue
        shutil.copy2(f, staging / f.name)
        library = PLOTLYJS_SRC.search(f.read_text(encoding="utf-8")) if f.suffix == ".html" else None
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
                  kernel_name: str = KERNEL_NAME, parameters: dict | None = None) -> dict:
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
    parameters : overrides of the notebooks' own parameters (name -> value) for a full-size run, each declared
        by every notebook run (:func:`check_parameters`), e.g. a smaller grid that fits a time limit; recorded
        in the manifest and in each page's injected-parameters cell.

    Returns
    -------
    dict, the manifest: ``gpu_slug``, ``device`` (:func:`fp8kv.device.describe_device`), ``mode``,
    ``seed``, ``timeout_s``, ``triton_interpret``, ``only``, ``parameters`` (the overrides), ``started``,
    ``finished``,
    ``duration_s``, ``ok`` (every notebook in the report is ok), ``failed`` (names of those that are
    not), ``ran`` (names executed by this run; the others were carried over), ``report_dir`` (the
    folder's name, relative to ``out``: the manifest holds no absolute path), and ``notebooks``: one
    entry per notebook with ``name``, ``source``, ``source_sha256`` (:func:`notebook_hash` of the
    source notebook), ``fp8kv_source`` (:func:`fp8kv.device.source_digest` of the fp8kv code its kernel
    imported), ``status`` ("ok"/"failed"), ``error``, ``mode``, ``started``, ``duration_s``
    and the file names ``ipynb``, ``html``, ``results``.

    SIGTERM, SIGINT, SIGHUP or another signal that would end the process (:func:`fp8kv.interrupts.stop_signals`)
    stops the run (:class:`RunInterrupted`; KeyboardInterrupt alike): the kernel is
    killed, and the notebooks that ran to the end are published, each other notebook keeping its
    page from the previous report (the manifest says ``interrupted``: what stopped the run and
    which notebook it stopped); when none had finished, the previous report is left as it was.
    After a run, ``<out>/index.html`` is rebuilt (:func:`build_index`).
    """
    from ..device import describe_device, resolve_device

    dev = resolve_device(device)  # validates before any work
    default_smoke, interpret = machine_defaults(dev)
    if smoke is None:
        smoke = default_smoke
    mode = "smoke" if smoke else "full"
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S[mode]
    checks.positive_int(timeout, "timeout")  # seconds per cell
    checks.run_seed(seed)
    check_out_folder(out)
    books = discover_notebooks(notebook_dir, only)
    for module in ("papermill", "nbconvert", "nbformat"):
        try:
            __import__(module)
        except ImportError as exc:
            raise ImportError(f"the notebook runner needs {module}: pip install 'fp8kv[notebooks]'") from exc
    parameters = check_parameters(books, parameters, smoke=smoke)

    info = describe_device(dev)
    slug = info["slug"]
    root = Path(out).resolve()
    final = root / slug
    if final.exists() and not final.is_dir():  # the swap would rename it aside and leave it there
        raise ValueError(f"{final} is a file, not a report folder: the report of {slug} is published there; "
                         "move it away or pass another out")
    root.mkdir(parents=True, exist_ok=True)
    staging = None
    # Paths in the manifest are relative to the report folder itself, so a copied folder stays right.
    manifest = {"gpu_slug": slug, "device": info, "mode": mode, "seed": seed, "timeout_s": timeout,
                "triton_interpret": None, "only": [b.stem for b in books] if only else None,
                "parameters": parameters,
                "started": utc_stamp(), "finished": None, "duration_s": None, "ok": None, "failed": [],
                "ran": [b.stem for b in books], "report_dir": slug, "notebooks": []}
    t0 = time.perf_counter()
    children_before = _child_pids()
    done, current = [], None  # names run to the end by this run; the one running now
    try:
        with _stop_on_signals(keep_pids=children_before):  # from before the staging folder exists: never left behind
            staging = Path(tempfile.mkdtemp(prefix=f".{slug}.staging-", dir=root))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the published folder should not be
            entries = _carry_over(final, staging, {b.stem for b in books}) if only and final.is_dir() else []
            params_base = {**parameters, "SMOKE": smoke, "DEVICE": str(device), "SEED": seed, "SHOW_WIDGETS": False}
            with _kernel_environment(interpret=interpret):
                manifest["triton_interpret"] = os.environ.get("TRITON_INTERPRET")
                for i, book in enumerate(books, 1):
                    print(f"[{i}/{len(books)}] {book.stem} ({mode}, {slug})", flush=True)
                    current = book.stem
                    out_dir, published = _relative_or_absolute(staging, book.parent), \
                        _relative_or_absolute(final, book.parent)
                    entry = _run_one(book, staging, {**params_base, "OUT_DIR": out_dir}, timeout, progress,
                                     kernel_name, published_out_dir=published)
                    print(f"    {entry['status']} in {entry['duration_s']:.1f} s"
                          + (f": {entry['error']}" if entry["error"] else ""), flush=True)
                    entries.append(entry)
                    done.append(book.stem)
                    current = None
            _publish(staging, final, manifest, entries, t0)
    except BaseException as exc:
        # A second signal must not cut the clean-up short: ignore them until it is done.
        with signals_ignored():
            if isinstance(exc, RunInterrupted):
                _stop_processes(_child_pids() - children_before)  # anything the kernel left behind
            try:
                if isinstance(exc, (RunInterrupted, KeyboardInterrupt)) and current and staging and staging.is_dir():
                    _keep_stopped(staging, root, slug, current)
                # staging is gone when the signal came during the swap itself: the report is in place
                if isinstance(exc, (RunInterrupted, KeyboardInterrupt)) and done and staging and staging.is_dir():
                    _publish_interrupted(staging, final, manifest, entries, done, current, exc, t0)
                    if isinstance(exc, RunInterrupted):
                        exc.published = True
            finally:
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
        raise
    _rebuild_index(root)
    return manifest


def _keep_stopped(staging: Path, root: Path, slug: str, name: str) -> None:
    """Keep the stopped notebook's executed cells beside the reports and say where its time went (stderr)."""
    try:
        kept = keep_partial(staging, root, slug, name)
        if kept is not None:  # now: papermill saves a quiet cell's notebook only when it starts
            stopped_at = datetime.datetime.now(datetime.timezone.utc)
            print(f"{name}: {summary(kept, now=stopped_at)}; its cells so far: {kept}", file=sys.stderr, flush=True)
    except Exception as err:  # noqa: BLE001 - the clean-up and the previous report come first
        print(f"warning: {name}'s executed cells not kept: {_error_text(err)}", file=sys.stderr)


def _publish(staging: Path, final: Path, manifest: dict, entries: list[dict], t0: float, **extra) -> None:
    """Complete the manifest from ``entries`` (and ``extra`` fields), write it into the staging folder
    and swap that folder in as the report."""
    entries = sorted(entries, key=lambda e: e["name"])
    failed = [e["name"] for e in entries if e["status"] != "ok"]
    manifest.update(notebooks=entries, failed=failed, ok=not failed, finished=utc_stamp(),
                    duration_s=round(time.perf_counter() - t0, 2), **extra)
    write_atomic(staging / MANIFEST, json.dumps(to_jsonable(manifest), indent=1) + "\n")
    _swap_into_place(staging, final)


def _rebuild_index(root: Path) -> None:
    try:
        build_index(root)
    except Exception as exc:  # the report itself is published; a broken index is reported, not fatal
        print(f"warning: {root / INDEX} not rebuilt: {_error_text(exc)}", file=sys.stderr)


def _publish_interrupted(staging: Path, final: Path, manifest: dict, entries: list[dict], done: list[str],
                         current: str | None, exc: BaseException, t0: float) -> None:
    """An interrupted run loses nothing: publish the notebooks it ran to the end, and carry every
    other notebook's page over from the previous report (the one that was stopped included)."""
    finished = {e["name"] for e in entries}  # run to the end now, or carried over at the start
    if current is not None and current not in finished:  # its half-written files go; its previous page,
        for f in list(staging.iterdir()):                  # if any, is carried over below
            # its own files, and what else it began (NAME_fig.png...), but never a file that is exactly
            # another notebook's: with current "04_decode", 04_decode_latency.json stays
            mine = f.name.startswith((current + ".", current + "_"))
            if mine and not any(owns(n, f.name) for n in finished):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    kept = _carry_over(final, staging, finished) if final.is_dir() else []
    what = "KeyboardInterrupt" if isinstance(exc, KeyboardInterrupt) else str(exc)
    _publish(staging, final, manifest, entries + kept, t0, ran=list(done),
             interrupted=what + (f" during {current}" if current else ""))
    _rebuild_index(final.parent)


def check_out_folder(out) -> None:
    """``out`` must be a folder or a path that can become one (not a file, nor below a file), and no report
    folder nor inside one."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise ValueError(f"out={out!r} must be a folder path (the reports root)")
    path = Path(out)
    for p in (path, *path.resolve().parents):  # a root inside a report would write into another GPU's folder
        if (p / MANIFEST).is_file():
            raise ValueError(f"out={str(out)!r}: {str(p)!r} is a report folder (it holds {MANIFEST}); pass the "
                             "reports root that holds the <gpu-slug>/ report folders")
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
    """The runner received a signal that would end it (SIGTERM, SIGINT, SIGHUP, ...): the run stops (what
    finished is published, see :func:`run_notebooks`).

    A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.published = False  # set when the notebooks that finished were published
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")




@contextlib.contextmanager
def _stop_on_signals(keep_pids: set[int] = frozenset()):
    """Turn every signal that would end the process (:func:`fp8kv.interrupts.stop_signals`: SIGTERM, SIGINT,
    SIGHUP, SIGQUIT, ...) into :class:`RunInterrupted` in the main thread, for the duration.

    SIGTERM or SIGHUP (what ``timeout``, CI runners, ``kill`` and a closed terminal send) would otherwise end
    the interpreter without any clean-up, leaving the staging folder behind, and SIGINT reaches the running
    kernel as an ordinary cell interrupt, after which the run would go on with the next notebook. The kernel
    (every process started since, except ``keep_pids``) is killed first, so that nothing waits for its cell
    to finish.
    """

    def stop(signum, _frame):
        for sig in stop_signals():  # a second signal must not interrupt the clean-up
            signal.signal(sig, signal.SIG_IGN)
        _stop_processes(_child_pids() - set(keep_pids))
        raise RunInterrupted(signum)

    with stop_signals_handled(stop):
        yield


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
