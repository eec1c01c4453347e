"""Readers of the plain-text results files the README quotes: Nsight Compute summaries written by
``scripts/decode_profile.py`` and a benchmark's console tables whose CSV was not kept.

Each reader takes the file's text and the path it came from (for messages), returns exactly the
figures the README quotes, and raises ``ValueError`` naming the file and the line or section it
could not read: a profile or console format that changed is an error, never a silently wrong number.
"""

from __future__ import annotations

import re

import pandas as pd

__all__ = ["profile_sections", "profile_section", "console_table"]

_SECTION = re.compile(r"^== (?P<head>.+?)\s*$")
_METRIC = re.compile(r"(?P<name>duration|DRAM|L2 throughput|L2 hit rate|issue slots busy|issue active|tensor pipe|"
                     r"XU pipe|warps an SM|registers)\s+(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>%|us|ms)?")
_BYTES_X = re.compile(r"(?P<x>\d+(?:\.\d+)?)x\b")
_SAMPLE = re.compile(r"^\s+(?P<share>\d+(?:\.\d+)?)%\s+(?P<instr>\S.*?)\s{2,}")


def profile_sections(text: str, rel: str = "profile") -> dict[str, dict]:
    """The ``== <header>`` sections of a profile summary, each as a dict:

    * one key per metric of its first indented line(s) (``duration`` in µs, ``DRAM``, ``L2 throughput``,
      ``issue active`` / ``issue slots busy``, ``tensor pipe`` in %, ``warps an SM``, ``registers``);
    * ``bytes_x``: DRAM bytes moved over the useful K and V bytes, where the line gives it (``1.27x``);
    * ``samples``: ``[(share %, instruction), ...]`` of its hottest instructions, in file order.

    Raises ``ValueError`` naming ``rel`` for text without a section or a section without a duration.
    """
    if not isinstance(text, str):
        raise TypeError(f"{rel}: text is {type(text).__name__}; expected the file's text (str)")
    sections: dict[str, dict] = {}
    head = None
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            head = m["head"]
            if head in sections:
                raise ValueError(f"{rel}: section '== {head}' appears twice; expected one per profiled kernel")
            sections[head] = {"samples": []}
            continue
        if head is None or not line.startswith(" "):
            continue
        s = _SAMPLE.match(line)
        if s:
            sections[head]["samples"].append((float(s["share"]), s["instr"].strip()))
            continue
        if line.lstrip().startswith(("by opcode", "top stalls")):
            continue
        for mm in _METRIC.finditer(line):
            value = float(mm["value"])
            if mm["name"] == "duration" and mm["unit"] == "ms":
                value *= 1e3
            sections[head].setdefault(mm["name"], value)
        b = _BYTES_X.search(line)
        if b and "bytes_x" not in sections[head]:
            sections[head]["bytes_x"] = float(b["x"])
    if not sections:
        raise ValueError(f"{rel}: no '== <kernel>' section; expected an Nsight Compute summary of "
                         "scripts/decode_profile.py")
    for h, sec in sections.items():
        if "duration" not in sec:
            raise ValueError(f"{rel}: section '== {h}' has no 'duration'; expected its metrics line")
    return sections


def profile_section(sections: dict[str, dict], starts: str, rel: str = "profile") -> dict:
    """The one section whose header starts with ``starts`` (``"71/1/64 FP8 e4m3, triton"``)."""
    found = [h for h in sections if h.startswith(starts)]
    if len(found) != 1:
        raise ValueError(f"{rel}: {len(found)} sections start with {starts!r} (it has {list(sections)}); expected one")
    return sections[found[0]]


_CONSOLE_COLS = ["batch", "context", "num_splits", "time_us", "gbps", "pct_copy", "rel_err", "check_passed"]


def console_table(text: str, shapes: list[str], rel: str = "console") -> pd.DataFrame:
    """The first table of a ``python -m fp8kv.bench`` console log (columns ``case B ctx splits us GB/s
    %copy rel_err check``) as rows with a ``shape``.

    The console prints no shape: within each B × ctx its rows come shape by shape in the preset's
    order (``shapes``), and a shape's rows end where a case repeats. Raises ``ValueError`` naming
    ``rel`` for a missing header, a row that does not parse, or a B × ctx whose shapes do not match.
    """
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["case", "B"] and "splits" in line)
    except StopIteration:
        raise ValueError(f"{rel}: no table headed 'case B ctx splits us ...'; expected a bench console log") from None
    rows, group, seen, shape_i = [], None, set(), 0
    for n, line in enumerate(lines[start + 1:], start + 2):
        parts = line.split()
        if not parts or parts[-1] not in ("True", "False"):  # the table ends at a line that is not a row
            break
        if len(parts) < len(_CONSOLE_COLS) + 1:
            raise ValueError(f"{rel} line {n}: {line.strip()!r} has {len(parts)} fields; expected a case and "
                             f"{len(_CONSOLE_COLS)} columns")
        case, cells = " ".join(parts[:-len(_CONSOLE_COLS)]), parts[-len(_CONSOLE_COLS):]
        try:
            b, ctx = int(cells[0]), int(cells[1])
            vals = [float(c) for c in cells[2:7]]
        except ValueError:
            raise ValueError(f"{rel} line {n}: {line.strip()!r} does not parse as B ctx splits us GB/s %copy "
                             "rel_err") from None
        if (b, ctx) != group:
            if group is not None and shape_i != len(shapes) - 1:
                raise ValueError(f"{rel}: B × ctx {group} has {shape_i + 1} shapes; expected {len(shapes)} ({shapes})")
            group, seen, shape_i = (b, ctx), set(), 0
        elif case in seen:
            shape_i += 1
            seen = set()
            if shape_i >= len(shapes):
                raise ValueError(f"{rel} line {n}: B × ctx {group} has more than {len(shapes)} shapes ({shapes})")
        seen.add(case)
        rows.append({"shape": shapes[shape_i], "case": case, "batch": b, "context": ctx,
                     "num_splits": vals[0], "time_us": vals[1], "gbps": vals[2], "pct_copy": vals[3],
                     "rel_err": vals[4], "check_passed": cells[7] == "True"})
    if not rows:
        raise ValueError(f"{rel}: its table has no rows")
    if shape_i != len(shapes) - 1:
        raise ValueError(f"{rel}: B × ctx {group} has {shape_i + 1} shapes; expected {len(shapes)} ({shapes})")
    return pd.DataFrame(rows)
