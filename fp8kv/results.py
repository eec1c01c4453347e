"""Results IO: the JSON a notebook saves (one document per notebook per machine) and the tidy CSV
tables the benchmarks write, both never left half-written or overwritten.

::

    save_results(OUT_DIR, "04_decode_latency", {"rows": df, ...})  # OUT_DIR/04_decode_latency.json
    load_results(OUT_DIR, "04_decode_latency")["results"]
    collect_results("04_decode_latency", "reports")                 # {gpu_slug: document}
    save_table(df, "results/bench")                                 # results/bench/<gpu-slug>/<timestamp>.csv + .json

Used by the notebooks (through :mod:`fp8kv.notebooks`, which re-exports these names), the
benchmark (:mod:`fp8kv.bench`) and the decode-step sweep (:mod:`fp8kv.step`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import json
import math
import numbers
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from . import checks
from .checks import fail

__all__ = ["to_jsonable", "save_results", "load_results", "collect_results", "save_table", "write_atomic", "load_table",
           "load_tables", "read_table", "check_rows", "source_of", "PartialResultWarning"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]*$")


def utc_stamp() -> str:
    """Now, in UTC to the second (``2026-12-03T18:10:41Z``): every timestamp fp8kv writes."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def to_jsonable(obj: Any) -> Any:
    """Convert results to plain JSON types.

    dict keys become strings (two keys that become the same string are a ValueError naming both); tuples/sets become lists; numpy / torch scalars become numbers and
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
        out = {}
        for k, v in obj.items():
            key = str(k)
            if key in out:  # e.g. 1 and "1": one result would silently replace the other
                other = next(o for o in obj if o is not k and str(o) == key)
                fail(f"keys {other!r} and {k!r} both become the JSON key {key!r}; use keys that stay distinct "
                     "as strings")
            out[key] = to_jsonable(v)
        return out
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


def _umask() -> int:
    """The process's umask, unchanged where /proc tells it (os.umask can only read it by setting it)."""
    try:  # Linux: readable without changing it, so no other thread ever sees umask 0
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` through a temporary file of its own in the same folder, renamed into place.

    A reader sees the old file or the new one, never a half-written one; and since every call has its
    own temporary (``mkstemp``), concurrent writers of one path never rename one another's unfinished
    file into place or away (a shared ``.<name>.tmp`` did both). On failure the temporary is removed
    and the previous file is left as it was. The file gets the usual permissions (mkstemp's are 0600).
    A ``path`` that is a folder (or anything but a file), or whose folder is missing or not a folder, is a
    ValueError naming it: the rename would fail there with an OSError that names the temporary, or replace
    what is not a file.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise ValueError(f"{path} is {kind}; a file is written there: move it away")
    if not path.parent.is_dir():
        what = "does not exist" if not path.parent.exists() else "is not a folder"
        raise ValueError(f"cannot write {path}: its folder {path.parent} {what}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding=encoding) as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name={name!r} must be a file stem of letters, digits, '_', '-', '.' "
                         "(the notebook's file name without .ipynb, e.g. '01_fp8_formats')")


def _device_slug(doc) -> str | None:
    """The GPU slug a results document records (``doc["device"]["slug"]``), None where it records none."""
    device = doc.get("device") if isinstance(doc, dict) else None
    return device.get("slug") if isinstance(device, dict) else None


def _check_same_device(path: Path, info: dict) -> None:
    """Refuse to replace ``path`` where it holds another GPU's results: report folders are per GPU slug
    (the runner's folder name), so the slug is the fact compared."""
    try:
        prior = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or not a results document: nothing of another GPU to keep
        return
    theirs = _device_slug(prior)
    if theirs is not None and theirs != info["slug"]:
        raise ValueError(f"{path} holds the results of device {theirs!r}; this run is on {info['slug']!r}, and a "
                         "run never overwrites another GPU's results: save under that GPU's own folder")


def save_results(out_dir: str | os.PathLike, name: str, results: dict, device=None) -> Path:
    """Write a notebook's numbers to ``out_dir/<name>.json`` and return the path.

    Parameters
    ----------
    out_dir : folder (created if missing); notebooks pass their ``OUT_DIR`` parameter.
    name : the notebook's file stem, e.g. ``"01_fp8_formats"`` (the runner looks for that file).
    results : dict of numbers, lists, DataFrames, tensors... (converted by :func:`to_jsonable`).
    device : the notebook's ``DEVICE``; its :func:`fp8kv.device.describe_device` is stored beside.

    The file holds ``{"notebook": name, "saved_at": ISO time, "device": {...}, "results": {...}}``.
    An existing file of another device (its ``device["slug"]``) is a ValueError naming both, never replaced.
    """
    from .device import describe_device

    _check_name(name)
    if not isinstance(results, dict):
        raise TypeError(f"results must be a dict, got {type(results).__name__}")
    out = Path(out_dir)
    blocking = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ValueError(f"out_dir={str(out_dir)!r}: {blocking} is a file, not a folder; pass the folder the "
                         "results go to")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. under /proc: name the argument, not a bare FileNotFoundError
        fail(f"out_dir={str(out_dir)!r}: the folder cannot be made ({exc.strerror or exc}); pass a folder the "
             "results can be written to")
    info = describe_device(device)
    _check_same_device(out / f"{name}.json", info)
    doc = {"notebook": name, "saved_at": utc_stamp(), "device": info, "results": to_jsonable(results)}
    # never a truncated JSON, nor one writer's file renamed away by another (a temporary per write)
    return write_atomic(out / f"{name}.json", json.dumps(doc, indent=1, allow_nan=False) + "\n")


def load_results(out_dir: str | os.PathLike, name: str) -> dict:
    """Read what :func:`save_results` wrote: the whole document (``doc["results"]`` holds the numbers)."""
    _check_name(name)
    path = Path(out_dir) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results {path}; run the notebook {name!r} first")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # a truncated or foreign file: say which, not a bare JSONDecodeError
        raise ValueError(f"{path} is not valid JSON ({exc}); expected what save_results writes") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict):
        what = type(doc).__name__ if not isinstance(doc, dict) else f"'results' {type(doc.get('results')).__name__}"
        raise ValueError(f"{path} holds a JSON {what}; expected an object with a 'results' object, "
                         "as save_results writes")
    return doc


def collect_results(name: str, reports_dir: str | os.PathLike = "reports") -> dict[str, dict]:
    """One notebook's results from every GPU's report folder: ``{gpu_slug: document}``.

    For notebooks that compare machines; folders without that notebook's JSON are skipped. A document whose
    device slug is not its folder's name (a file copied from another GPU's folder) is a ValueError naming it:
    it would be shown as the folder's GPU.
    """
    _check_name(name)
    found = {}
    root = Path(reports_dir)
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if (folder / f"{name}.json").is_file():
                doc = load_results(folder, name)
                theirs = _device_slug(doc)
                if theirs is not None and theirs != folder.name:
                    fail(f"{folder / f'{name}.json'} holds the results of device {theirs!r} but sits in the folder "
                         f"{folder.name!r}; each GPU's results belong in its own folder ({root / str(theirs)})")
                found[folder.name] = doc
    return found


# --------------------------------------------------------------------------- tidy tables (CSV)
def save_table(df, out_dir: str | os.PathLike, meta: dict | None = None, tag: str = "") -> Path:
    """Write ``<out_dir>/<gpu-slug>/<timestamp>.csv`` (``<timestamp>-<tag>.csv`` with a ``tag``) and a
    ``.json`` of metadata beside it.

    ``df``: a pandas DataFrame of tidy rows with ``gpu_slug`` (one device per file) and
    ``timestamp`` columns; ``meta``: a dict stored in the JSON beside ``rows``, ``csv`` and
    ``columns``. An existing file is never overwritten (``-2``, ``-3``, ... is appended), and
    nothing outside the slug's folder is touched. Returns the CSV's path.
    """
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        fail(f"df is a {type(df).__name__}; expected a pandas DataFrame of tidy rows", TypeError)
    if meta is not None and not isinstance(meta, dict):
        fail(f"meta is a {type(meta).__name__}; expected None or a dict", TypeError)
    if not isinstance(tag, str):
        fail(f"tag={tag!r} ({type(tag).__name__}); expected a str, a folder-safe name such as 'pdl'", TypeError)
    checks.output_folder(out_dir, "out_dir")  # a file there (or above) is named, not a NotADirectoryError
    if tag and not _SLUG.match(tag):
        fail(f"tag={tag!r}; expected a folder-safe name such as 'pdl'")
    for col in ("gpu_slug", "timestamp"):
        if col not in df.columns:
            fail(f"df has no {col!r} column; expected tidy rows with gpu_slug and timestamp columns "
                 "(fp8kv.bench.run(), fp8kv.step.sweep())")
    if df.empty:
        fail("df is empty: nothing to save")
    slugs = df["gpu_slug"].dropna().unique().tolist()
    if len(slugs) != 1 or not _SLUG.match(str(slugs[0])):
        fail(f"df must hold the rows of one device with a folder-safe gpu_slug; got gpu_slug values {slugs}")
    stamp = str(df["timestamp"].dropna().iloc[0]) if df["timestamp"].notna().any() else ""
    stamp = re.sub(r"[^0-9TZ]", "", stamp) or re.sub(r"[^0-9TZ]", "", utc_stamp())  # the rows' time, or now
    stamp += f"-{tag}" if tag else ""
    folder = Path(out_dir) / slugs[0]
    folder.mkdir(parents=True, exist_ok=True)
    text = df.to_csv(index=False)  # in memory first: a failure here leaves no file
    # The CSV is written whole under a temporary name, then linked to its own (a link fails, never overwrites,
    # where the name is taken): a reader never sees a half-written table, even after a crash mid-write.
    fd, tmp = tempfile.mkstemp(prefix=f".{stamp}.", suffix=".csv.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", newline="") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        for n in itertools.count(1):
            stem = stamp if n == 1 else f"{stamp}-{n}"
            csv = folder / f"{stem}.csv"
            try:
                os.link(tmp, csv)
                break
            except FileExistsError:
                continue
    finally:
        Path(tmp).unlink(missing_ok=True)
    metadata = {**(meta or {}), "rows": len(df), "csv": csv.name, "columns": list(df.columns)}
    made = []  # no table without its metadata (the readers check a table against it): on failure neither stays
    try:
        with open(csv.with_suffix(".json"), "x") as fh:  # "x": another run's metadata is never replaced
            made.append(csv.with_suffix(".json"))
            fh.write(json.dumps(metadata, indent=2, default=str))
    except BaseException:
        for path in (csv, *made):
            path.unlink(missing_ok=True)
        raise
    return csv


def save_or_fallback(save, df, out_dir, meta: dict, *, flag: str = "--out"):
    """``save(df, out_dir, meta=meta)`` (a command's table save), or, where writing under ``out_dir`` fails
    (a full disk, a folder that passed the checks but cannot be written), the same under a new temporary
    folder, said on stderr naming ``flag``: a run's measured rows are never lost to its save.
    Returns ``(path, saved_where_asked)``."""
    try:
        return save(df, out_dir, meta=meta), True
    except OSError as exc:
        fallback = tempfile.mkdtemp(prefix="fp8kv-results-")
        print(f"error: could not write under {flag} {out_dir} ({exc}); saving to {fallback} instead", file=sys.stderr)
        return save(df, fallback, meta=meta), False


def _read_meta(csv: Path) -> dict:
    """The metadata :func:`save_table` wrote beside ``csv`` ({} where there is none), checked as JSON object."""
    meta_path = csv.with_suffix(".json")
    if not meta_path.is_file():
        return {}
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as exc:  # truncated or foreign: name the file, not a bare JSONDecodeError
        raise ValueError(f"{meta_path} (the metadata of {csv.name}) is not valid JSON ({exc}); expected what "
                         "save_table writes: repair or delete it") from None
    except OSError as exc:
        raise ValueError(f"{meta_path} (the metadata of {csv.name}) cannot be read ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} (the metadata of {csv.name}) holds a JSON {type(meta).__name__}; expected an "
                         "object, as save_table writes")
    return meta


def _saved_runs(out_dir, slug: str, preset: str | None):
    """``(csv, meta)`` of the tables under ``<out_dir>/<slug>/``, newest first; with ``preset`` only
    those whose metadata names it (``"preset"``, or ``--preset NAME`` in the recorded ``argv``).
    Runs saved after an interruption (``"interrupted": true``, partial grids) are left out.
    A metadata file that is not a JSON object is a ValueError naming it."""
    if not _SLUG.match(str(slug)):
        fail(f"slug={slug!r}; expected a folder-safe GPU slug such as 'nvidia-h200'")
    folder = Path(out_dir) / slug

    def order(csv: Path):  # <stamp>.csv, then <stamp>-2.csv, -3, ... (save_table's names)
        stamp, _, n = csv.stem.partition("-")
        return stamp, int(n) if n.isdigit() else 1

    for csv in sorted(folder.glob("*.csv"), key=order, reverse=True) if folder.is_dir() else []:
        meta = _read_meta(csv)
        argv = [str(a) for a in meta.get("argv") or []]
        named = meta.get("preset") or next((b for a, b in zip(argv, argv[1:], strict=False) if a == "--preset"), None) \
            or next((a.split("=", 1)[1] for a in argv if a.startswith("--preset=")), None)
        if (preset is None or named == preset) and not meta.get("interrupted"):
            yield csv, meta


def read_table(csv: str | os.PathLike, meta: dict | None = None):
    """One table :func:`save_table` wrote, read and checked: a DataFrame with ``attrs["path"]`` (the file, for
    the readers' messages). ``meta``: its metadata (default: read from the ``.json`` beside it).

    A ValueError naming the file where it is empty, has a header but no rows, is not a CSV pandas reads,
    holds fewer rows than its metadata records (cut short) or other columns than it records."""
    import pandas as pd

    csv = Path(csv)
    if meta is not None and not isinstance(meta, dict):
        fail(f"meta is a {type(meta).__name__}; expected None (read the .json beside the csv) or its dict", TypeError)
    meta = _read_meta(csv) if meta is None else meta
    try:
        df = pd.read_csv(csv)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{csv} is empty (no header, no rows); a table save_table wrote has both: delete it or "
                         "save the run again") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise ValueError(f"{csv} is not a CSV table pandas can read ({exc})") from None
    except OSError as exc:
        raise ValueError(f"{csv} cannot be read ({exc})") from None
    if df.empty:
        raise ValueError(f"{csv} has a header but no rows; save_table never writes one: the file was cut short")
    rows, columns = meta.get("rows"), meta.get("columns")
    if isinstance(rows, int) and not _ends_a_line(csv):  # pandas reads a row cut short as NaN to its end
        raise ValueError(f"{csv} ends inside a row: the file was cut short (save_table ends every row with a newline)")
    if isinstance(rows, int) and len(df) != rows:
        raise ValueError(f"{csv} holds {len(df)} rows but its metadata ({csv.with_suffix('.json').name}) records "
                         f"{rows}: the file was cut short or edited")
    if isinstance(columns, list) and list(df.columns) != [str(c) for c in columns]:
        missing = [c for c in columns if c not in df.columns]
        raise ValueError(f"{csv} has columns other than its metadata records"
                         + (f" (missing {missing})" if missing else "") + ": the file was cut short or edited")
    df.attrs.update(meta=meta, csv=csv.name, path=str(csv))
    return df


def _ends_a_line(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def load_table(out_dir: str | os.PathLike, slug: str, *, preset: str | None = None):
    """The newest table :func:`save_table` wrote under ``<out_dir>/<slug>/`` (with ``preset``: the
    newest of that ``fp8kv bench --preset``), as a DataFrame with its metadata in ``df.attrs["meta"]``,
    its file name in ``df.attrs["csv"]`` and its path in ``df.attrs["path"]``; None when there is none.
    A damaged file is a ValueError naming it (:func:`read_table`)."""
    for csv, meta in _saved_runs(out_dir, slug, preset):
        return read_table(csv, meta)
    return None


def load_tables(out_dir: str | os.PathLike, slug: str, *, preset: str | None = None):
    """Every such table (with ``preset``: every run of it), concatenated oldest first, their file
    names in ``df.attrs["csv"]`` and paths in ``df.attrs["path"]`` (lists); None when there is none.
    A damaged file is a ValueError naming it (:func:`read_table`)."""
    import pandas as pd

    runs = list(_saved_runs(out_dir, slug, preset))[::-1]
    if not runs:
        return None
    df = pd.concat([read_table(csv, meta) for csv, meta in runs], ignore_index=True)
    df.attrs = {"csv": [csv.name for csv, _ in runs], "path": [str(csv) for csv, _ in runs]}
    return df


# ------------------------------------------------------------------------------ reading the rows
class PartialResultWarning(UserWarning):
    """A reader's answer covers part of its question only (an FP8-only run has no speed-up over BF16)."""


def source_of(df) -> str:
    """Where ``df``'s rows came from, for a reader's message: the file(s) :func:`load_table` /
    :func:`load_tables` read (``attrs["path"]``, kept by pandas through selections), else "df"."""
    path = getattr(df, "attrs", {}).get("path")
    if isinstance(path, list):
        return path[0] if len(path) == 1 else f"the {len(path)} runs {', '.join(map(str, path))}"
    return str(path) if path else "df"


# Columns of the bench's and the step's rows that hold numbers: every reader that asks for one gets it
# checked as such (a column of strings read back from a hand-edited CSV is named, not a pandas TypeError).
NUMERIC_COLUMNS = frozenset({"time_us", "gbps", "pct_copy_bw", "kv_bytes", "copy_gbps", "rel_err", "tol", "batch",
                             "context", "num_splits", "step_us", "tokens_per_s", "q_len", "tflops", "flops",
                             "math_peak_tflops", "pct_math_peak"})


def check_rows(df, reader: str, columns, *, values=(), numeric=(), whole=(), expected: str) -> None:
    """Refuse rows ``reader`` cannot read, with a ValueError naming the reader, where the rows came from
    (:func:`source_of`) and what is wrong: ``df`` not a DataFrame, ``columns`` missing, a ``status`` column
    with no value, or one of ``values`` with no value (all NaN) in the rows that ran (``status == "ok"``;
    every row where there is no status column). ``expected``: what the reader takes, e.g. "the rows of
    fp8kv.bench.run()"; ``numeric``: columns that must hold numbers (a column of strings is named); ``whole``:
    columns (where present) that must hold finite whole numbers in the rows that ran (NaN only in the others)."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        fail(f"{reader}: df is a {type(df).__name__}; expected a pandas DataFrame of {expected}", TypeError)
    missing = sorted(set(columns) - set(df.columns))
    if missing:
        fail(f"{reader}: {source_of(df)} lacks columns {missing}; expected {expected}")
    if "status" in df.columns and len(df) and df["status"].isna().all():
        fail(f"{reader}: column 'status' of {source_of(df)} holds no value in its {len(df)} rows (all NaN); "
             f"expected {expected}")
    for col in sorted(set(numeric) | set(whole) | (NUMERIC_COLUMNS & (set(columns) | set(values)))):
        if col not in df.columns:
            continue
        given = df[col].dropna()  # object columns of numbers and None (rows that did not run) are numbers
        if len(given) and not given.map(lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)).all():
            fail(f"{reader}: column {col!r} of {source_of(df)} holds {df[col].dtype} values, not numbers; "
                 f"expected {expected}")
    ran = df[df["status"] == "ok"] if "status" in df.columns else df
    absent = sorted(set(values) - set(df.columns))
    if absent:
        fail(f"{reader}: {source_of(df)} lacks columns {absent} (the values it reads); expected {expected}")
    for col in values:
        if len(ran) and ran[col].isna().all():
            fail(f"{reader}: column {col!r} of {source_of(df)} holds no value in its {len(ran)} rows that ran "
                 f"(all NaN); expected {expected}")
    for col in (c for c in whole if c in df.columns):  # what int() would refuse (inf, NaN) or round (2.5)
        bad = ~ran[col].map(lambda v: isinstance(v, numbers.Integral) or math.isfinite(v) and v == math.floor(v))
        if bad.any():
            i, v = ran.index[bad.to_numpy().nonzero()[0][0]], ran[col][bad].iloc[0]
            v = v.item() if hasattr(v, "item") else v  # inf, not np.float64(inf)
            fail(f"{reader}: column {col!r} of {source_of(df)} holds {checks.show_value(v)} in row {i}"
                 f"{' (a row that ran)' if 'status' in df.columns else ''}; expected a finite whole number there; "
                 f"expected {expected}")


def warn_partial(reader: str, df, what: str) -> str:
    """Say (a :class:`PartialResultWarning` naming ``reader`` and where the rows came from) that its answer
    covers part of its question, ``what`` saying which; returns the message."""
    msg = f"{reader}: {source_of(df)} {what}"
    warnings.warn(msg, PartialResultWarning, stacklevel=3)
    return msg
