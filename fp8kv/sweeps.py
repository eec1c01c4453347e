"""What a measured sweep's rows share, the benchmark's (:func:`fp8kv.bench.run`) and the decode step's
(:func:`fp8kv.step.sweep`) alike: the fields naming the machine each row ran on, the run's metadata in
``df.attrs``, memory handed back between groups, the save (CSV + JSON through :func:`fp8kv.results.save_table`)
and the summary's closing lines."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch

from .interrupts import signals_ignored
from .results import save_table

__all__ = ["CPU_TIMING_NOTE", "machine_fields", "run_metadata", "release_memory", "save_run", "timing_notes"]

CPU_TIMING_NOTE = "CPU wall-clock timings (interpreter / reference): they say nothing about any GPU."


def machine_fields(stamp: str, info: dict, copy_gbps: float, *, libraries=()) -> dict:
    """The columns every row of a run repeats: its ``stamp`` (:func:`fp8kv.results.utc_stamp`), the machine and
    software of ``info`` (:func:`fp8kv.device.describe_device`; ``libraries``: the further versions of it a row
    names, e.g. ``("flashinfer", "vllm")``) and the copy bandwidth its rates are read against."""
    return {"timestamp": stamp, "gpu": info["name"], "gpu_slug": info["slug"], "arch": info["arch"],
            "device": info["device"], "torch": info["torch"], "triton": info["triton"],
            **{name: info[name] for name in libraries}, "fp8kv_source": info["fp8kv_source"], "copy_gbps": copy_gbps}


def run_metadata(stamp: str, info: dict, copy_info: dict | None, settings: dict, **more) -> dict:
    """A run's ``df.attrs`` entry, saved beside its rows: when, where, the copy-bandwidth measurement, ``more``
    (e.g. ``interrupted``) and the settings it ran with."""
    return {"timestamp": stamp, "device": info, "copy_bandwidth": copy_info, **more, "settings": settings}


def release_memory(device: torch.device) -> None:
    """Hand back what the last group of points allocated (caches, pools, weights) before the next one builds
    its own: collected, and on CUDA returned to the device rather than held by torch's caching allocator."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def interruptible(work, *, keep_partial: bool, dev: torch.device) -> bool:
    """Run ``work()``, which appends its rows as it measures them. True when a KeyboardInterrupt (Ctrl-C, or a
    stop signal a CLI turned into one) stopped it and ``keep_partial``: the rows appended so far stand, the
    device's memory is handed back. False when it finished. Without ``keep_partial`` the interrupt goes on to
    the caller (a notebook cell stops, as it would anyway)."""
    try:
        work()
    except KeyboardInterrupt:
        if not keep_partial:
            raise
    else:
        return False
    # here, not in the except: its traceback holds the run's frames (pools, weights); a second stop signal while the
    # memory is handed back would lose the rows measured, so it is ignored until then (the CLIs save under the same)
    with signals_ignored():
        release_memory(dev)
    return True


def save_run(df, out_dir: str | os.PathLike, kind: str, meta: dict | None = None) -> Path:
    """Write ``<out_dir>/<gpu-slug>/<timestamp>.csv`` and its ``.json`` (never overwriting;
    :func:`fp8kv.results.save_table`): the metadata is the run's ``df.attrs[kind]`` updated with ``meta``.
    Returns the CSV's path."""
    return save_table(df, out_dir, meta={**df.attrs.get(kind, {}), **(meta or {})})


def timing_notes(rows) -> list[str]:
    """The summary's warning where any of ``rows`` was timed by the CPU's wall clock (no GPU ran it)."""
    return [CPU_TIMING_NOTE] if (rows["timing"] == "cpu-wallclock").any() else []
