"""The README's generated parts: find their markers, fill them from computed values, diff the result.

Two kinds of marker, each closed by its own end marker:

* a block, on lines of its own, for a table::

      <!-- generated: decode-latency -->
      | B | ctx | ... |
      <!-- /generated -->

* an inline value, inside a sentence: ``<!--v decode.b64_16k.fp8_us-->684<!--/v-->``.

Everything between a marker and its end is replaced by the value of that name; everything outside
the markers is left as it is. A name in the README that no table function computes, a computed name
the README does not place, and an unclosed or nested marker are errors that name the line.
"""

from __future__ import annotations

import difflib
import re

__all__ = ["fill", "names_in", "unified_diff", "BLOCK_START", "BLOCK_END", "INLINE"]

BLOCK_START = re.compile(r"^<!-- generated: (?P<name>[A-Za-z0-9_.-]+) -->$")
BLOCK_END = "<!-- /generated -->"
INLINE = re.compile(r"<!--v (?P<name>[A-Za-z0-9_.-]+)-->(?P<text>.*?)<!--/v-->")
_INLINE_OPEN = re.compile(r"<!--v ")


def _blocks(lines: list[str]):
    """``(name, start, end)`` line indices of each block (start: its opening marker, end: its closing one)."""
    found, open_at, name = [], None, None
    for i, line in enumerate(lines):
        m = BLOCK_START.match(line.strip())
        if m:
            if open_at is not None:
                raise ValueError(f"README line {i + 1}: block '{m['name']}' opens inside block '{name}' "
                                 f"(opened on line {open_at + 1}); close it with {BLOCK_END} first")
            open_at, name = i, m["name"]
        elif line.strip() == BLOCK_END:
            if open_at is None:
                raise ValueError(f"README line {i + 1}: {BLOCK_END} closes no block")
            found.append((name, open_at, i))
            open_at = None
    if open_at is not None:
        raise ValueError(f"README line {open_at + 1}: block '{name}' is never closed with {BLOCK_END}")
    return found


def names_in(text: str) -> list[str]:
    """Every generated name the text places, blocks and inline values, in order."""
    lines = text.split("\n")
    names = [name for name, _, _ in _blocks(lines)]
    names += [m["name"] for m in INLINE.finditer(text)]
    return names


def fill(text: str, values: dict[str, str], *, strict: bool = True) -> str:
    """``text`` with every block and inline value replaced by ``values[name]``.

    Raises ``ValueError`` naming the line for a name that ``values`` lacks, an inline marker left open,
    a multi-line value placed inline, or (``strict``) a name of ``values`` that the text never places.
    """
    for k, v in values.items():
        if not isinstance(v, str):
            raise TypeError(f"generated value '{k}' is {type(v).__name__} {v!r}; expected the text to place (str)")
    lines = text.split("\n")
    used = set()
    out, pos = [], 0
    for name, start, end in _blocks(lines):
        if name not in values:
            raise ValueError(f"README line {start + 1}: block '{name}' is computed by no table function "
                             f"of fp8kv.published (known: {', '.join(sorted(values)) or 'none'})")
        used.add(name)
        out += lines[pos:start + 1] + values[name].rstrip("\n").split("\n")
        pos = end
    out += lines[pos:]
    text = "\n".join(out)

    def inline(m: re.Match) -> str:
        name = m["name"]
        line = text.count("\n", 0, m.start()) + 1
        if name not in values:
            raise ValueError(f"README line {line}: value '{name}' is computed by no table function of fp8kv.published")
        if "\n" in values[name]:
            raise ValueError(f"README line {line}: value '{name}' spans lines; an inline value is one line")
        used.add(name)
        return f"<!--v {name}-->{values[name]}<!--/v-->"

    for i, line in enumerate(text.split("\n")):
        if len(_INLINE_OPEN.findall(line)) != len(INLINE.findall(line)):
            raise ValueError(f"README line {i + 1}: an inline value <!--v name--> is not closed by <!--/v--> on its line")
    text = INLINE.sub(inline, text)
    if strict:
        unused = sorted(set(values) - used)
        if unused:
            if not used:  # a file with no markers at all: not the README (listing every value would bury that)
                raise ValueError(f"the file places none of the {len(unused)} computed values (no <!--v name--> marker "
                                 "or generated block): is it fp8kv's README?")
            shown = ", ".join(unused[:12]) + (f" and {len(unused) - 12} more" if len(unused) > 12 else "")
            raise ValueError(f"computed values the README does not place: {shown}; place each "
                             f"(<!--v name-->…<!--/v--> or a generated block) or drop it from fp8kv.published")
    return text


def unified_diff(old: str, new: str, path: str = "README.md") -> str:
    """The change from ``old`` to ``new`` as a unified diff (empty when they are equal)."""
    return "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        fromfile=f"{path} (as committed)", tofile=f"{path} (generated)"))
