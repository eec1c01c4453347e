"""What a stopped notebook had done: its executed copy, kept out of the report, and where its time went.

papermill saves the executed notebook as each cell starts and ends, so when a run is stopped the staging copy
holds every finished cell's outputs and the start of the one that was running. The runner publishes only
notebooks that ran to the end; this keeps the stopped one's copy under ``<out>/.interrupted/<gpu>/`` (beside
the reports, never a page of them) and reads papermill's per-cell times from it, so that a run cut by a time
limit still says which cell the time went to.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

__all__ = ["PARTIAL_DIR", "keep_partial", "cell_times", "summary"]

PARTIAL_DIR = ".interrupted"


def keep_partial(staging: Path, root: Path, slug: str, name: str) -> Path | None:
    """Move ``staging/<name>.ipynb`` to ``root/.interrupted/<slug>/<name>.ipynb`` (replacing an earlier one)
    when it is a notebook; None when there is none or it cannot be read as one (a file cut mid-write)."""
    import nbformat

    src = Path(staging) / f"{name}.ipynb"
    if not src.is_file():
        return None
    try:
        nbformat.read(src, as_version=4)
    except Exception:  # noqa: BLE001 - half-written JSON or not a notebook: nothing worth keeping
        return None
    dest = Path(root) / PARTIAL_DIR / slug / f"{name}.ipynb"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dest)
    return dest


def _when(stamp) -> dt.datetime | None:
    if not isinstance(stamp, str):
        return None
    try:
        t = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def cell_times(path: Path, now: dt.datetime | None = None) -> list[dict]:
    """One record per code cell of an executed (or partly executed) notebook: ``index`` (1-based among the
    code cells), ``status`` (papermill's "completed", "failed", "running", "pending", or "stopped": the kernel
    took the cell and never answered, whatever papermill wrote after it was killed), ``seconds`` (papermill's
    duration; for a running cell without one, the time from its start to ``now``, default the file's last
    write; None where it never started) and ``first_line`` of its source (comments left out)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    now = now or dt.datetime.fromtimestamp(Path(path).stat().st_mtime, dt.timezone.utc)
    out = []
    for i, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), 1):
        meta = cell.get("metadata", {}).get("papermill", {})
        status = meta.get("status", "pending")
        seconds = meta.get("duration")
        kernel = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in kernel and "shell.execute_reply" not in kernel:
            status = "stopped"  # sent to the kernel, never answered: papermill may still call it completed
        if status in ("running", "stopped") and meta.get("end_time") is None and _when(meta.get("start_time")):
            seconds = max(0.0, (now - _when(meta["start_time"])).total_seconds())
        lines = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        out.append({"index": i, "status": status, "seconds": None if seconds is None else float(seconds),
                    "first_line": lines[0].strip() if lines else ""})
    return out


def summary(path: Path, now: dt.datetime | None = None, slowest: int = 3) -> str:
    """One paragraph: which code cell was running (or that none was) and for how long, and the slowest
    finished cells, each with its first line."""
    cells = cell_times(path, now)
    done = [c for c in cells if c["status"] == "completed" and c["seconds"] is not None]
    running = [c for c in cells if c["status"] in ("running", "stopped")]
    if running:
        r = running[0]
        seconds = "" if r["seconds"] is None else f" after {r['seconds']:.0f} s in it"
        head = f"stopped in code cell {r['index']} of {len(cells)}{seconds} (`{r['first_line'][:70]}`)"
    else:
        head = f"stopped between cells, {len(done)} of {len(cells)} code cells finished"
    top = sorted(done, key=lambda c: -c["seconds"])[:slowest]
    if top:
        head += "; slowest finished: " + ", ".join(f"cell {c['index']} {c['seconds']:.0f} s (`{c['first_line'][:50]}`)"
                                                   for c in top)
    return head + f"; {sum(c['seconds'] for c in done):.0f} s in the {len(done)} finished cells"
