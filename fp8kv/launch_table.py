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

A table is checked as it is read: JSON holding ``{"gpu": <the slug it is looked up for>, "entries": {key:
{block_n, num_warps, num_stages, ...}}}`` with keys as :func:`entry_key` writes them and positive int launch values
that the tensor-core kernel takes, else a ValueError naming the file and what is wrong. It is re-read when the file changes (its inode, mtime or size), not once per process.
The options an entry sets, and the warp counts and tile sizes a launch may take (``WARP_COUNTS``,
``MAX_BLOCK_N``), come from the option table, :mod:`fp8kv.launch_options`.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path

from .launch_options import check_block_n, check_range, least_block_n, tuned_options

TABLE_DIR = Path(__file__).resolve().parent / "data"
LAUNCH_KEYS = tuned_options()  # what an entry sets: block_n, num_warps, num_stages


def table_path(gpu: str, table_dir: str | Path | None = None) -> Path:
    """Where the table of ``gpu`` (a slug, :func:`fp8kv.device.gpu_slug`: "nvidia-h200") lives."""
    return Path(TABLE_DIR if table_dir is None else table_dir) / f"launch_{gpu}.json"


def entry_key(kv_fp8: bool, mode: str, head_dim: int, group_pad: int) -> str:
    """``"fp8/dequant/d128/m16"``: the compiled shape an entry is for."""
    return f"{'fp8' if kv_fp8 else '16bit'}/{mode}/d{head_dim}/m{group_pad}"


# What entry_key writes: the kv kind, the mode, the head dim and GROUP_PAD (a power of two, 16 or more)
_KEY = re.compile(r"(fp8|16bit)/(dequant|fp8)/d([1-9][0-9]*)/m(16|32|64|128|256|512|1024)")


def _entry_problem(e, key: str) -> str | None:
    """What is wrong with one entry (at ``key``), or None."""
    shape = _KEY.fullmatch(key) if isinstance(key, str) else None
    if shape is None:  # a key no lookup asks for: the launch it holds would silently never be used
        return f"is no shape key; expected one such as {entry_key(True, 'dequant', 128, 16)!r} (fp8 or 16bit, " \
               "dequant or fp8, d<head dim>, m<padded query rows: a power of two from 16>)"
    if not isinstance(e, dict):
        return f"is {e!r} ({type(e).__name__}); expected an object with {LAUNCH_KEYS}"
    # bool is an int subclass: true/false in the JSON is no launch value
    bad = [k for k in LAUNCH_KEYS if isinstance(e.get(k), bool) or not isinstance(e.get(k), int) or e[k] <= 0]
    if bad:
        return f"needs positive ints {LAUNCH_KEYS}; {', '.join(f'{k}={e.get(k)!r}' for k in bad)}"
    try:  # the ranges every kernel's launch checks (launch_options), named per entry here
        for name, value in e.items():
            if name in LAUNCH_KEYS:
                check_range(name, value)
        # the tensor-core kernel's tiles: tl.dot's 16 rows, and fp8 mode's FP8 dot a K of 32
        check_block_n(e["block_n"], least=least_block_n(shape.group(2)))
    except ValueError as exc:
        return f"has {exc}"
    return None


def _entries(path: Path, gpu: str) -> dict:
    """The raw entries of the table at ``path``, its structure checked (each entry is not)."""
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not a launch table (not valid JSON: {exc}); rerun python -m "
                         "fp8kv.bench.tune or delete it") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: holds a JSON {type(doc).__name__}; expected an object with 'gpu' and 'entries'")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: 'entries' is {entries!r}; expected an object mapping shape keys such as "
                         f"{entry_key(True, 'dequant', 128, 16)!r} to launches")
    if doc.get("gpu") != gpu:  # a table copied from another GPU's file would set launches measured elsewhere
        raise ValueError(f"{path}: its gpu is {doc.get('gpu')!r}, but it was looked up for gpu {gpu!r}; "
                         f"a table holds the launches of the GPU it names")
    return entries


@functools.lru_cache(maxsize=32)
def _load(path: Path, gpu: str, stamp: tuple[int, int, int]) -> dict:
    """The checked entries of ``path``; ``stamp`` (inode, mtime, size) keys the cache to the file's version."""
    entries = _entries(path, gpu)
    for key, e in entries.items():  # a hand-edited file fails here, by name, not inside a launch
        problem = _entry_problem(e, key)
        if problem:
            raise ValueError(f"{path}: entry {key!r} {problem}")
    return entries


def _table(path: Path, gpu: str) -> dict:
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    return _load(path, gpu, (st.st_ino, st.st_mtime_ns, st.st_size))


def lookup(gpu: str | None, kv_fp8: bool, mode: str, head_dim: int, group_pad: int,
           table_dir: str | Path | None = None) -> dict | None:
    """The measured ``{block_n, num_warps, num_stages}`` for this shape on ``gpu``, or None.

    ValueError naming the file when ``gpu``'s table is not a valid table of that GPU."""
    if gpu is None:
        return None
    e = _table(table_path(gpu, table_dir), gpu).get(entry_key(kv_fp8, mode, head_dim, group_pad))
    return None if e is None else {k: e[k] for k in LAUNCH_KEYS}


def write(gpu: str, entries: dict[str, dict], meta: dict, table_dir: str | Path | None = None) -> Path:
    """Merge ``entries`` into the table of ``gpu`` (valid entries of other shapes stay) and write it.

    A new entry without positive int launch values is a ValueError naming it. An old file that is no
    valid table of ``gpu`` (not JSON, another GPU's, no entries), and old entries that are invalid, are
    dropped with a warning naming them. The file is replaced whole (written beside it, then renamed),
    so an interrupted write leaves the previous table.
    """
    for key, e in entries.items():
        problem = _entry_problem(e, key)
        if problem:
            raise ValueError(f"entries[{key!r}] {problem}")
    path = table_path(gpu, table_dir)
    old = {}
    if path.is_file():
        try:
            old = _entries(path, gpu)
        except ValueError as exc:
            warnings.warn(f"{exc}; replacing it with the new entries", stacklevel=2)
        dropped = {k: p for k, e in old.items() if k not in entries and (p := _entry_problem(e, k))}
        for key, problem in dropped.items():
            warnings.warn(f"{path}: dropping invalid entry {key!r}: it {problem}", stacklevel=2)
        old = {k: e for k, e in old.items() if k not in dropped}
    merged = {**old, **entries}
    doc = {**meta, "gpu": gpu, "entries": dict(sorted(merged.items()))}  # meta cannot rename the GPU
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    _load.cache_clear()  # a rewrite within one mtime tick could keep the stamp
    return path
