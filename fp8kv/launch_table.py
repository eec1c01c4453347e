"""Measured launch parameters of the tensor-core decode kernel, per GPU model.

One JSON file per GPU, ``fp8kv/data/launch_<gpu-slug>.json`` (``launch_nvidia-h200.json``), written by ``python -m fp8kv.bench.tune``
(:mod:`fp8kv.bench.tune`) and read by :func:`fp8kv.ops.default_config`. An entry holds ``block_n``,
``num_warps`` and ``num_stages`` for one compiled shape of the kernel: the KV kind (FP8 or 16-bit),
the mode, the head dim and the program's padded query rows (``GROUP_PAD``: 16 for groups up to 16,
then 32 or 64). A shape the table does not hold, or a GPU without a table, keeps the rule of
:func:`fp8kv.ops.default_config`. Each entry also keeps what it was measured against (the shape,
batch and context, its time and the rule's time), so the file says why it holds what it holds.
Per GPU model, not per arch: tiles that suit an H200's bandwidth need not suit another sm90 part,
and tuning one GPU never rewrites another's table.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

TABLE_DIR = Path(__file__).resolve().parent / "data"
LAUNCH_KEYS = ("block_n", "num_warps", "num_stages")  # what an entry sets


def table_path(gpu: str, table_dir: str | Path | None = None) -> Path:
    """Where the table of ``gpu`` (a slug, :func:`fp8kv.device.gpu_slug`: "nvidia-h200") lives."""
    return Path(TABLE_DIR if table_dir is None else table_dir) / f"launch_{gpu}.json"


def entry_key(kv_fp8: bool, mode: str, head_dim: int, group_pad: int) -> str:
    """``"fp8/dequant/d128/m16"``: the compiled shape an entry is for."""
    return f"{'fp8' if kv_fp8 else '16bit'}/{mode}/d{head_dim}/m{group_pad}"


@functools.cache
def _load(path: Path) -> dict:
    if not path.is_file():
        return {}
    entries = json.loads(path.read_text())["entries"]
    for key, e in entries.items():  # a hand-edited file fails here, by name, not inside a launch
        if not all(isinstance(e.get(k), int) and e[k] > 0 for k in LAUNCH_KEYS):
            raise ValueError(f"{path}: entry {key!r} needs positive ints {LAUNCH_KEYS}, got {e!r}")
    return entries


def lookup(gpu: str | None, kv_fp8: bool, mode: str, head_dim: int, group_pad: int,
           table_dir: str | Path | None = None) -> dict | None:
    """The measured ``{block_n, num_warps, num_stages}`` for this shape on ``gpu``, or None."""
    if gpu is None:
        return None
    e = _load(table_path(gpu, table_dir)).get(entry_key(kv_fp8, mode, head_dim, group_pad))
    return None if e is None else {k: e[k] for k in LAUNCH_KEYS}


def write(gpu: str, entries: dict[str, dict], meta: dict, table_dir: str | Path | None = None) -> Path:
    """Merge ``entries`` into the table of ``gpu`` (entries of other shapes stay) and write it.

    The file is replaced whole (written beside it, then renamed), so an interrupted write leaves the
    previous table.
    """
    path = table_path(gpu, table_dir)
    old = json.loads(path.read_text()) if path.is_file() else {}
    merged = {**old.get("entries", {}), **entries}
    doc = {"gpu": gpu, **meta, "entries": dict(sorted(merged.items()))}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    _load.cache_clear()
    return path
