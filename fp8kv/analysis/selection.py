"""What a notebook selects, checked: names from a registry, FP8 format names."""

from __future__ import annotations

from ..formats import format as get_format

__all__ = ["registry_names", "format_names"]


def registry_names(selection, registry, what: str) -> list[str]:
    """``"all"`` → every name of ``registry`` (a dict), in its order; a list of names → checked and kept."""
    if selection == "all":
        return list(registry)
    if isinstance(selection, str) or not isinstance(selection, (list, tuple)):
        raise ValueError(f"{what}={selection!r} must be 'all' or a list of names from {list(registry)}")
    unknown = [n for n in selection if n not in registry]
    if unknown:
        raise ValueError(f"{what}={list(selection)!r}: unknown {unknown}; known: {list(registry)}")
    return list(selection)


def format_names(formats) -> tuple[str, ...]:
    """FP8 format names (one name or several), normalised (``"fp8_e4m3"`` -> ``"e4m3"``); unknown ones raise."""
    formats = (formats,) if isinstance(formats, str) else tuple(formats)
    if not formats:
        raise ValueError("formats is empty; pass at least one FP8 format name such as 'e4m3'")
    return tuple(get_format(f).name for f in formats)  # raises naming the unknown format
