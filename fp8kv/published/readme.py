"""The README as generated: every section's values computed from the files it cites, placed into
README.md's markers (:mod:`fp8kv.published.render`)."""

from __future__ import annotations

from pathlib import Path

from .breakeven import breakeven
from .chunks import chunk_modes, chunk_tiles
from .decode import decode_latency
from .earlier import earlier, later
from .formats import formats, formats_h200
from .gluon import gluon
from .gluon_probes import gluon_probes
from .issue import int4_grid, int4_tiles, issue, residency
from .layout_probes import layout_probes
from .layouts import layouts
from .multi_token import multi_token, verify_step
from .render import fill, unified_diff
from .sources import REPO, Sources
from .step import step, window

__all__ = ["SECTIONS", "compute", "generate", "check"]

# One function per README section: Sources -> {name: text}.
SECTIONS = (decode_latency, layouts, layout_probes, gluon, gluon_probes, earlier, later, window, step,
            multi_token, chunk_modes, chunk_tiles, verify_step, formats, formats_h200, issue, residency, int4_tiles, int4_grid, breakeven)


def compute(src: Sources) -> dict[str, str]:
    """Every generated name's text; a name computed by two sections is an error, and so is a cited file of
    another shape (a section's KeyError or TypeError), named."""
    values: dict[str, str] = {}
    for section in SECTIONS:
        try:
            part = section(src)
        except (KeyError, TypeError) as e:  # a cited file of another version or shape: name the file
            raise ValueError(f"{src.last_read or 'a cited results file'} (the last file {section.__name__} read) "
                             f"lacks what the README reads from it ({type(e).__name__}: {e}); regenerate it with "
                             "the script that wrote it") from None
        twice = sorted(set(part) & set(values))
        if twice:
            raise ValueError(f"{section.__name__} computes {twice}, which another section computes too")
        values.update(part)
    return values


def generate(readme: str | Path = REPO / "README.md", root: str | Path = REPO) -> tuple[str, str]:
    """``(committed, generated)``: README.md's text as it is and as the results files make it."""
    path = Path(readme)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ValueError(f"readme={str(readme)!r} {what}; expected the README.md file to regenerate")
    text = path.read_text(encoding="utf-8")
    return text, fill(text, compute(Sources(root)))


def check(readme: str | Path = REPO / "README.md", root: str | Path = REPO) -> str:
    """The unified diff between README.md and its regeneration ("" when it is current)."""
    old, new = generate(readme, root)
    return unified_diff(old, new, Path(readme).name)
