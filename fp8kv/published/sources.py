"""Readers of the results files the README cites, each named by its path from the repository root.

A missing file raises :class:`MissingSourceError` naming it; a file that is not the kind its reader
expects (a CSV without the columns a table needs, a JSON without its ``rows``) raises ``ValueError``
naming the file and what was expected. Every path read is recorded in :attr:`Sources.cited`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..results import read_table

__all__ = ["Sources", "MissingSourceError", "REPO", "ok_rows"]

REPO = Path(__file__).resolve().parents[2]


# What a row that ran measured: each a finite number > 0 wherever a published number reads it.
MEASURED_COLUMNS = ("time_us", "step_us", "tokens_per_s", "gb_per_s", "attention_us")


class MissingSourceError(FileNotFoundError):
    """A results file the README cites does not exist."""


class Sources:
    """The results files under ``root`` (the repository by default), read once each."""

    def __init__(self, root: str | Path = REPO):
        if isinstance(root, str) and not root.strip():  # Path("") is the working directory
            raise ValueError(f"root={root!r} is no folder path; expected the repository's root")
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"root={str(root)!r} is not a directory; expected the repository's root")
        self.cited: list[str] = []
        self.last_read: str | None = None  # the file a reader's KeyError most likely came from, for its message
        self._cache: dict[tuple[str, str], object] = {}

    def path(self, rel: str) -> Path:
        """``root / rel``, which must exist: else :class:`MissingSourceError` naming ``rel``."""
        if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
            raise ValueError(f"rel={rel!r}: expected a path relative to the repository root")
        full = self.root / rel
        if not full.is_file():
            raise MissingSourceError(f"README.md cites {rel}, which does not exist (under {self.root}); "
                                     "restore the file or change the README's table functions in fp8kv.published")
        if rel not in self.cited:
            self.cited.append(rel)
        self.last_read = rel
        return full

    def _read(self, kind, rel, reader):
        key = (kind, rel)
        if key not in self._cache:
            full = self.path(rel)
            try:
                self._cache[key] = reader(full)
            except (ValueError, KeyError, json.JSONDecodeError, pd.errors.ParserError, UnicodeDecodeError) as e:
                raise ValueError(f"{rel}: cannot be read as {kind} ({type(e).__name__}: {e})") from None
        else:
            self.path(rel)  # recorded as cited again
        return self._cache[key]

    def csv(self, rel: str, columns=()) -> pd.DataFrame:
        """A benchmark CSV as a DataFrame (a copy), checked to hold ``columns``."""
        df = self._read("csv", rel, read_table)  # checked against the metadata beside it
        df.attrs["path"] = rel
        missing = [c for c in columns if c not in df.columns]
        if missing:
            raise ValueError(f"{rel}: lacks columns {missing}; it has {list(df.columns)}")
        check_measured(df[df["status"] == "ok"] if "status" in df.columns else df, rel)  # every reader, ok_rows or not
        return df.copy()

    def json(self, rel: str) -> dict:
        """A JSON document (a dict)."""
        doc = self._read("json", rel, lambda p: json.loads(p.read_text(encoding="utf-8")))
        if not isinstance(doc, dict):
            raise ValueError(f"{rel}: holds a JSON {type(doc).__name__}; expected an object")
        return doc

    def rows(self, rel: str, key: str = "rows", columns=()) -> pd.DataFrame:
        """The list of records under ``key`` of a probe's JSON as a DataFrame, checked to hold ``columns``."""
        doc = self.json(rel)
        rows = doc.get(key)
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{rel}: its '{key}' is {type(rows).__name__}; expected a list of records")
        df = pd.DataFrame(rows)
        missing = [c for c in columns if c not in df.columns]
        if missing:
            raise ValueError(f"{rel}: its '{key}' records lack {missing}; they have {list(df.columns)}")
        check_measured(df[df["status"] == "ok"] if "status" in df.columns else df, f"{rel} ({key})")
        return df

    def text(self, rel: str) -> str:
        """A text file's contents."""
        return self._read("text", rel, lambda p: p.read_text(encoding="utf-8"))


def ok_rows(df: pd.DataFrame, rel: str = "") -> pd.DataFrame:
    """The rows of a benchmark table that ran and passed their check (``status == "ok"`` and
    ``check_passed`` not false): the only rows any published number or claim counts."""
    for col in ("status", "check_passed"):
        if col not in df.columns:
            raise ValueError(f"{rel or 'table'}: lacks column {col!r}; expected a benchmark table")
    passed = df["check_passed"].astype(str).str.lower().isin(["true", "1", "1.0", "nan", "none", ""])  # 1.0: a 0/1 float column
    ok = df[(df["status"] == "ok") & passed]
    check_measured(ok, rel)
    return ok


def check_measured(rows: pd.DataFrame, rel: str = "") -> None:
    """ValueError naming the file and column where a row holds a measured value (:data:`MEASURED_COLUMNS`) that is
    not a finite number > 0: a time of -533.8 us was published as measured."""
    for col in MEASURED_COLUMNS:
        if col in rows.columns:
            values = pd.to_numeric(rows[col], errors="coerce")
            bad = ~(values > 0) | ~np.isfinite(values)
            if bad.any():
                raise ValueError(f"{rel or 'table'}: column {col!r} holds {rows[col][bad].iloc[0]!r} in a row that "
                                 "ran; expected a finite number > 0 (a damaged or foreign results file)")
