"""Decode benchmark harness: a grid of cases → tidy result rows (one measurement per row).

::

    cases = sweep(batches=[1, 16], contexts=[4096], kv_dtypes=["bf16", "fp8_e4m3"])
    df = run(cases)                 # time_us, bytes, gbps, pct_copy_bw, rel_err, check_passed, ...
    speedup_table(df)               # FP8 over the best BF16 decode of the same shape
    save(df, "results/bench")       # results/bench/<gpu-slug>/<timestamp>.csv + .json

Command line: ``fp8kv bench --preset target`` (or ``python -m fp8kv.bench ...``); see :func:`main`.

How a case is measured
----------------------
* The cache is synthetic (:func:`synthetic_cache` = :func:`fp8kv.synthetic.random_paged_cache`):
  N(0, 1) K/V written straight into shuffled pages, FP8 quantized on the device in chunks with
  amax scales computed from the generated data.
  Cases that share a cache (same shape, KV dtype, granularity) share one build.
* Correctness first: one call of the backend, compared with :func:`fp8kv.reference.decode` on the
  *same dequantized cache* (kernel error, not quantization error) for the first and last sequences.
* Timing on CUDA: ``triton.testing.do_bench_cudagraph(fn, rep, return_mode="median")``. ``fn`` is
  the decode call alone: cache, query and any backend plan are built before. Caches smaller than a
  few L2 sizes are cloned and the calls cycle through the clones, so every call reads K/V from HBM
  (``kv_copies`` says how many). The reference backend syncs with the host, so it is timed with
  ``triton.testing.do_bench`` (CUDA events) instead.
* Timing on CPU: ``time.perf_counter`` median of a few calls (``timing="cpu-wallclock"``), under
  the Triton interpreter or of the reference. These numbers say nothing about any GPU.
* Bandwidth: ``gbps = bytes / time`` with ``bytes`` the useful bytes (:func:`bytes_moved`), and
  ``pct_copy_bw`` against a device-to-device copy measured once in the same run
  (:func:`fp8kv.device.measure_copy_bandwidth`).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from . import checks
from .cache import PagedKVCache
from .capability import BACKENDS, KV_DTYPES, MODES, UnsupportedError, interpreter_on
from .capability import check as capability_check
from .checks import fail as _fail
from .quant import GRANULARITIES, SCALE_BYTES, relative_error
from .reference import output_tolerance
from .synthetic import CHUNK_ELEMS, random_paged_cache

__all__ = ["Case", "sweep", "run", "speedup_table", "save", "main", "synthetic_cache", "bytes_moved",
           "tolerance", "footprint_bytes", "memory_budget", "summary", "PRESETS", "COLUMNS"]

Q_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("NHD", "HND")

COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton", "flashinfer",
    "label", "backend", "variant", "mode", "kv_dtype", "granularity", "layout", "q_dtype",
    "batch", "context", "window", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
    "num_splits", "block_n", "num_warps", "num_stages",
    "timing", "time_us", "bytes", "kv_bytes", "gbps", "pct_copy_bw", "copy_gbps", "kv_copies",
    "rel_err", "tol", "check_passed", "status", "reason",
]


# --------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One benchmark cell: a decode shape, a cache format and a backend configuration.

    ``options`` go to the backend as keyword arguments: Triton launch overrides (``num_splits``,
    ``block_n``, ``num_warps``, ``num_stages``) or FlashInfer's ``use_tensor_cores``. ``status`` is
    ``"ready"``, ``"unsupported"`` or ``"skipped"`` (set by :func:`sweep`, with ``reason``).
    ``window``: a sliding-window layer attending the last ``window`` tokens of each sequence (as
    :func:`fp8kv.decode` defines it; FlashInfer's ``window_left = window - 1``); None: the whole context.
    """

    batch: int
    context: int  # tokens per sequence (every sequence of the batch holds this many)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    kv_dtype: str = "bf16"
    mode: str = "dequant"
    backend: str = "triton"
    granularity: str = "tensor"
    q_dtype: str = "bf16"
    layout: str = "NHD"
    options: dict = field(default_factory=dict)
    label: str = ""
    status: str = "ready"
    reason: str = ""
    seed: int = 0
    window: int | None = None

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            _fail(f"Case.window={self.window!r}; expected None or a positive int")
        for name in ("batch", "context", "num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(f"Case.{name}={v!r}; expected a positive int")
        if self.num_q_heads % self.num_kv_heads:
            _fail(f"Case.num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        choices = {"kv_dtype": KV_DTYPES, "mode": MODES, "backend": BACKENDS,
                   "granularity": GRANULARITIES, "q_dtype": tuple(Q_DTYPES), "layout": LAYOUTS,
                   "status": ("ready", "unsupported", "skipped")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _fail(f"Case.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if not isinstance(self.options, dict):
            _fail(f"Case.options must be a dict of backend keyword arguments, got {type(self.options).__name__}",
                  TypeError)
        if not self.kv_dtype.startswith("fp8"):
            self.granularity = "tensor"  # 16-bit caches carry no scales
        if not self.label:
            self.label = " ".join(x for x in (self.backend + (f"-{self.variant}" if self.variant else ""),
                                              self.kv_dtype, self.mode,
                                              "" if self.granularity == "tensor" else self.granularity,
                                              "" if self.window is None else f"window={self.window}") if x)

    @property
    def variant(self) -> str:
        """Backend configuration in a word: ``tc``/``no-tc`` for FlashInfer, ``k=v,...`` overrides."""
        opts = dict(self.options)
        tc = opts.pop("use_tensor_cores", None)
        parts = [] if tc is None else ["tc" if tc else "no-tc"]
        parts += [f"{k}={v}" for k, v in sorted(opts.items())]
        return ",".join(parts)

    @property
    def cache_key(self) -> tuple:
        """Cases with equal keys read the same cache (built once by :func:`run`)."""
        return (self.batch, self.context, self.num_kv_heads, self.head_dim, self.block_size, self.kv_dtype,
                self.granularity, self.layout, self.seed)

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype.startswith("fp8")


def _elem_size(kv_dtype: str) -> int:
    return 1 if kv_dtype.startswith("fp8") else 2


def _out_elem_size(case: Case) -> int:
    # The reference returns fp32; Triton and FlashInfer return the query's dtype.
    return 4 if case.backend == "reference" else Q_DTYPES[case.q_dtype].itemsize


def bytes_moved(case: Case, seq_lens: Sequence[int] | None = None) -> dict:
    """Useful bytes one decode call moves, by part (ints).

    ``kv`` = Σ_b tokens_b × Hkv × D × 2 (K and V) × element size, with ``tokens_b = seq_len_b``, or
    ``min(seq_len_b, window)`` for a windowed case (the tokens it attends); ``scales`` = scale bytes read
    (fp32: two scalars for tensor, 2 × Hkv for head, 2 × Hkv × D for channel, 2 × Hkv per token for
    token_head; 0 for 16-bit caches); ``q`` = B × Hq × D × q's size; ``out`` = B × Hq × D × the
    output's size. Block tables, seq_lens, the LSE and split-KV partials are not counted (< 0.1 %
    of ``kv`` at Hkv × D = 1024, except the partials, which are an implementation cost, not work).
    ``seq_lens`` defaults to ``[case.context] * case.batch``.
    """
    lens = [case.context] * case.batch if seq_lens is None else [int(n) for n in seq_lens]
    tokens = sum(lens) if case.window is None else sum(min(n, case.window) for n in lens)
    hkv, d = case.num_kv_heads, case.head_dim
    kv = tokens * hkv * d * 2 * _elem_size(case.kv_dtype)
    if not case.is_fp8:
        scales = 0
    else:
        scales = 2 * SCALE_BYTES * {"tensor": 1, "head": hkv, "channel": hkv * d,
                                    "token_head": tokens * hkv}[case.granularity]
    q = case.batch * case.num_q_heads * d * Q_DTYPES[case.q_dtype].itemsize
    out = case.batch * case.num_q_heads * d * _out_elem_size(case)
    return {"kv": kv, "scales": scales, "q": q, "out": out, "total": kv + scales + q + out}


def tolerance(case: Case) -> float:
    """Allowed ``||out - ref|| / ||ref||`` of ``case`` against the fp32 reference on the same dequantized
    cache: :func:`fp8kv.reference.output_tolerance` (where the tolerance model is derived)."""
    return output_tolerance(case.backend, case.mode, case.q_dtype, case.granularity)


# ----------------------------------------------------------------------------------------- memory
def footprint_bytes(case: Case) -> int:
    """Device bytes a case needs at peak: pages + scales + build workspace + check + split partials."""
    bs = case.block_size
    num_blocks = case.batch * math.ceil(case.context / bs)
    page_elems = num_blocks * bs * case.num_kv_heads * case.head_dim
    pages = 2 * page_elems * _elem_size(case.kv_dtype)
    scales = 0
    if case.is_fp8 and case.granularity == "token_head":
        scales = 2 * 2 * num_blocks * bs * case.num_kv_heads * SCALE_BYTES  # built + the cache's own copy
    build = min(page_elems, CHUNK_ELEMS) * 4 * 3 if case.is_fp8 else min(page_elems, CHUNK_ELEMS) * 4
    check = 2 * 2 * case.context * case.num_kv_heads * case.head_dim * 4  # two gathered fp32 sequences
    partials = case.batch * case.num_q_heads * 128 * (case.head_dim + 1) * 4  # ≤ 128 splits in fp32
    return pages + scales + build + check + partials


def memory_budget(device: torch.device | str | None = None, fraction: float = 0.6) -> int:
    """``fraction`` of the free memory of ``device`` (GPU: ``cudaMemGetInfo``; CPU: available RAM)."""
    from .device import resolve_device

    dev = resolve_device(device)
    if not 0 < fraction <= 1:
        _fail(f"fraction={fraction}; expected a number in (0, 1]")
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not Linux: assume 8 GiB
            free = 8 * 2**30
    return int(free * fraction)


# ------------------------------------------------------------------------------------------ sweep
def _as_list(x, name):
    if isinstance(x, (str, int, dict)) or x is None:
        x = [x]
    x = list(x)
    if not x:
        _fail(f"{name} is empty; give at least one value")
    return x


def sweep(batches: Sequence[int], contexts: Sequence[int], heads: Sequence[tuple[int, int]] = ((32, 8),),
          head_dims: Sequence[int] = (128,), block_sizes: Sequence[int] = (16,),
          kv_dtypes: Sequence[str] = ("bf16", "fp8_e4m3"), modes: Sequence[str] = ("dequant", "fp8"),
          backends: Sequence[str] = ("triton", "flashinfer"), granularities: Sequence[str] = ("tensor",),
          q_dtype: str | None = None, flashinfer_tensor_cores: Sequence[bool] = (False, True),
          triton_options: dict | Sequence[dict] | None = None, layout: str = "NHD",
          memory_budget_bytes: int | None = None, device=None, arch: str | None = None,
          windows: Sequence[int | None] = (None,)) -> list[Case]:
    """Expand the grid into :class:`Case` s, marking what cannot run here.

    The product of every argument, minus combinations that are not combinations at all (fp8 mode
    on a 16-bit cache; granularities of a 16-bit cache collapse to one). Each remaining case is
    checked with :func:`fp8kv.capability.check` (``arch=None``: this machine) and kept with
    ``status="unsupported"`` and the reason when it cannot run, and with ``status="skipped"``,
    ``reason="does not fit ..."`` when :func:`footprint_bytes` exceeds ``memory_budget_bytes``
    (default: 60 % of the device's free memory now).

    Parameters
    ----------
    heads : (Hq, Hkv) pairs.
    q_dtype : "bf16", "fp16" or "fp32"; default bf16 on a GPU, fp16 on CPU (the Triton
        interpreter's bf16 arithmetic is wrong).
    flashinfer_tensor_cores : FlashInfer variants (``use_tensor_cores`` values) per FlashInfer cell.
    triton_options : one dict or a list of dicts of Triton launch overrides (one variant each).
    windows : sliding windows (None: the whole context), one case each (:attr:`Case.window`).
    arch : ask the capability table about another arch ("sm90") instead of this machine.
    """
    from .device import resolve_device

    dev = resolve_device(device)
    if q_dtype is None:
        q_dtype = "bf16" if dev.type == "cuda" else "fp16"
    budget = memory_budget(dev) if memory_budget_bytes is None else int(memory_budget_bytes)
    tri_opts = [dict(o) for o in _as_list(triton_options or {}, "triton_options")]
    fi_opts = [{"use_tensor_cores": bool(t)} for t in _as_list(list(flashinfer_tensor_cores), "flashinfer_tensor_cores")]
    heads = [tuple(h) for h in heads]
    for h in heads:
        if len(h) != 2:
            _fail(f"heads entry {h!r}; expected (num_q_heads, num_kv_heads) pairs such as (32, 8)")
    cases, seen = [], set()
    grid = itertools.product(_as_list(batches, "batches"), _as_list(contexts, "contexts"), heads,
                             _as_list(head_dims, "head_dims"), _as_list(block_sizes, "block_sizes"),
                             _as_list(kv_dtypes, "kv_dtypes"), _as_list(backends, "backends"),
                             _as_list(modes, "modes"), _as_list(granularities, "granularities"))
    grid = itertools.product(grid, _as_list(list(windows), "windows"))
    for (b, ctx, (hq, hkv), d, bs, kv, backend, mode, gran), window in grid:
        if mode == "fp8" and not kv.startswith("fp8"):
            continue  # not a combination: fp8 mode is about FP8 KV
        opts_list = {"triton": tri_opts, "flashinfer": fi_opts}.get(backend, [{}])
        for opts in opts_list:
            case = Case(b, ctx, hq, hkv, d, bs, kv, mode, backend, gran, q_dtype, layout, dict(opts), window=window)
            key = (case.cache_key, case.mode, case.backend, case.q_dtype, case.label)
            if key in seen:
                continue
            seen.add(key)
            ok, why = capability_check(backend, kv, mode, arch, case.granularity, d)
            if ok and q_dtype == "fp32" and backend != "reference":
                ok, why = False, f"{backend} takes bf16/fp16 queries; fp32 queries run on the reference only"
            if ok and backend == "flashinfer" and not case.is_fp8 and kv != q_dtype:
                ok, why = False, (f"FlashInfer pairs a {q_dtype} query with a {q_dtype} or FP8 cache, "
                                  f"not {kv}")
            if not ok:
                case.status, case.reason = "unsupported", why
            elif footprint_bytes(case) > budget:
                case.status = "skipped"
                case.reason = (f"does not fit: needs ~{footprint_bytes(case) / 2**30:.1f} GiB, "
                               f"budget {budget / 2**30:.1f} GiB")
            cases.append(case)
    return cases


# ------------------------------------------------------------------------------------ cache build
synthetic_cache = random_paged_cache  # the benchmark's cache: N(0, 1) K/V built on the device


# ------------------------------------------------------------------------------------------ calls
def _triton_launch(case: Case, cache: PagedKVCache, device: torch.device) -> dict:
    """The Triton launch parameters ``fp8kv.ops.paged_decode`` will use (defaults + overrides)."""
    from .ops import launch_config

    o = case.options
    window = case.window if case.window is not None and case.window < cache.max_blocks_per_seq * cache.block_size \
        else None  # as paged_decode: a window covering the page table is no window
    cfg = launch_config(case.batch, cache, case.mode, num_splits=o.get("num_splits"), block_n=o.get("block_n"),
                        num_warps=o.get("num_warps"), num_stages=o.get("num_stages"), device=device, window=window)
    return {k: cfg[k] for k in ("num_splits", "block_n", "num_warps", "num_stages")}


def _make_call(case: Case, q: torch.Tensor, cache: PagedKVCache) -> Callable[[], tuple]:
    """A zero-argument decode call with everything host-side done beforehand."""
    if case.backend == "reference":
        from .reference import decode as ref_decode

        return lambda: ref_decode(q, cache, window=case.window)
    if case.backend == "triton":
        from .ops import paged_decode

        opts = dict(case.options)
        return lambda: paged_decode(q, cache, mode=case.mode, window=case.window, **opts)
    from .backends.flashinfer import FlashInferDecode  # plan here (host work), time run() only

    dec = FlashInferDecode(cache, mode=case.mode, **case.options)
    windowed = {} if case.window is None else {"window": case.window}
    dec.plan(cache, num_qo_heads=q.shape[1], q_dtype=q.dtype, **windowed)
    return lambda: dec.run(q)


def _time_call(fn: Callable, device: torch.device, *, graph: bool, rep: int, warmup: int,
               cpu_reps: int) -> tuple[float, str]:
    """Median seconds per call and the timing method."""
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        with torch.cuda.device(device):
            if graph:
                return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e-3, "cuda-graph"
            return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3, "cuda-events"
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), "cpu-wallclock"


def _check_indices(batch: int, n: int) -> list[int]:
    return list(range(batch)) if batch <= n else sorted({*range(n - 1), batch - 1})


# -------------------------------------------------------------------------------------------- run
def _copy_gbps(copy_bandwidth, device) -> tuple[float, dict | None]:
    if copy_bandwidth is False:
        return float("nan"), None
    if copy_bandwidth is None:
        from .device import measure_copy_bandwidth

        info = measure_copy_bandwidth(device=device)
        return float(info["gbps"]), info
    if isinstance(copy_bandwidth, dict):
        return float(copy_bandwidth["gbps"]), copy_bandwidth
    if isinstance(copy_bandwidth, (int, float)) and not isinstance(copy_bandwidth, bool) and copy_bandwidth > 0:
        return float(copy_bandwidth), {"gbps": float(copy_bandwidth), "method": "given"}
    _fail(f"copy_bandwidth={copy_bandwidth!r}; expected None (measure), False (skip), a positive GB/s "
          "number or the dict of fp8kv.device.measure_copy_bandwidth")


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20)


def run(cases: Sequence[Case], *, check: bool = True, rep: int = 100, warmup: int = 25,
        copy_bandwidth=None, progress: bool = True, device=None, rotate: bool = True,
        check_seqs: int = 2, cpu_reps: int = 3) -> pd.DataFrame:
    """Measure ``cases``; return one tidy row per case (columns :data:`COLUMNS`).

    Parameters
    ----------
    check : compare each backend's output with the fp32 reference first (``rel_err``,
        ``check_passed`` against :func:`tolerance`); rows are timed either way.
    rep, warmup : milliseconds of repetition / warm-up for the CUDA timers.
    copy_bandwidth : None (measure once now), False (skip), GB/s, or a
        :func:`fp8kv.device.measure_copy_bandwidth` dict. Recorded in every row (``copy_gbps``).
    rotate : on CUDA, cycle through clones of caches smaller than 4 × L2 so reads come from HBM.
    check_seqs : sequences compared with the reference (first ones and the last).
    cpu_reps : calls timed per case on CPU.

    Statuses: ``ok``, ``unsupported`` / ``skipped`` (from :func:`sweep`, or found here),
    ``error`` (the exception in ``reason``). ``df.attrs["bench"]`` holds the run's metadata.
    """
    from tqdm.auto import tqdm

    from .device import describe_device, resolve_device

    dev = resolve_device(device)
    cases = list(cases)
    for i, c in enumerate(cases):
        if not isinstance(c, Case):
            _fail(f"cases[{i}] is a {type(c).__name__}; expected fp8kv.bench.Case (see sweep())", TypeError)
    for name, v in (("rep", rep), ("warmup", warmup), ("check_seqs", check_seqs), ("cpu_reps", cpu_reps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(f"{name}={v!r}; expected a positive int")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    info = describe_device(dev)
    runnable = [c for c in cases if c.status == "ready"]
    copy_gbps, copy_info = _copy_gbps(copy_bandwidth, dev) if runnable else (float("nan"), None)
    base = {"timestamp": stamp, "gpu": info["name"], "gpu_slug": info["slug"], "arch": info["arch"],
            "device": info["device"], "torch": info["torch"], "triton": info["triton"],
            "flashinfer": info["flashinfer"], "copy_gbps": copy_gbps}

    rows: dict[int, dict] = {}
    for i, c in enumerate(cases):
        if c.status != "ready":
            rows[i] = _row(base, c, status=c.status, reason=c.reason)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        if c.status == "ready":
            groups.setdefault(c.cache_key, []).append(i)

    bar = tqdm(total=len(runnable), disable=not progress, desc="bench", unit="case")
    for idx in groups.values():
        first = cases[idx[0]]
        caches: list[PagedKVCache] = []
        try:
            caches = [synthetic_cache(first.batch, first.context, first.num_kv_heads, first.head_dim,
                                      block_size=first.block_size, kv_dtype=first.kv_dtype,
                                      granularity=first.granularity, layout=first.layout, device=dev,
                                      seed=first.seed)]
            if rotate and dev.type == "cuda":
                kvb = caches[0].nbytes
                caches += [caches[0].clone() for _ in range(math.ceil(4 * _l2_bytes(dev) / kvb) - 1)]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # OOM or a broken build: the group's rows say so, the sweep goes on
            oom = isinstance(e, torch.OutOfMemoryError)
            for i in idx:
                rows[i] = _row(base, cases[i], status="skipped" if oom else "error",
                               reason=f"building the cache: {type(e).__name__}: {e}")
            bar.update(len(idx))
            caches = []
            _free(dev)
            continue
        for i in idx:
            c = cases[i]
            bar.set_postfix_str(f"{c.label} B={c.batch} ctx={c.context}")
            rows[i] = _measure(c, caches, dev, base, check=check, rep=rep, warmup=warmup,
                               check_seqs=check_seqs, cpu_reps=cpu_reps)
            bar.update(1)
        del caches
        _free(dev)
    bar.close()

    df = pd.DataFrame([rows[i] for i in range(len(cases))], columns=COLUMNS)
    df.attrs["bench"] = {"timestamp": stamp, "device": info, "copy_bandwidth": copy_info,
                         "settings": {"check": check, "rep": rep, "warmup": warmup, "rotate": rotate,
                                      "check_seqs": check_seqs, "cpu_reps": cpu_reps}}
    return df


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _row(base: dict, c: Case, **values) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(base)
    row.update(label=c.label, backend=c.backend, variant=c.variant, mode=c.mode, kv_dtype=c.kv_dtype,
               granularity=c.granularity, layout=c.layout, q_dtype=c.q_dtype, batch=c.batch, context=c.context,
               window=c.window,
               num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
               block_size=c.block_size, time_us=float("nan"), gbps=float("nan"), pct_copy_bw=float("nan"),
               rel_err=float("nan"), reason="")
    by = bytes_moved(c)
    row.update(bytes=by["total"], kv_bytes=by["kv"])
    row.update(values)
    return row


def _measure(c: Case, caches: list[PagedKVCache], dev: torch.device, base: dict, *, check: bool, rep: int,
             warmup: int, check_seqs: int, cpu_reps: int) -> dict:
    ok, why = capability_check(c.backend, c.kv_dtype, c.mode, None, c.granularity, c.head_dim)
    if not ok:  # a hand-made case, or the machine differs from the one the sweep asked about
        return _row(base, c, status="unsupported", reason=why)
    values: dict = {"tol": tolerance(c), "kv_copies": len(caches)}
    try:
        g = torch.Generator(device=dev).manual_seed(c.seed + 7)
        q = torch.randn(c.batch, c.num_q_heads, c.head_dim, generator=g, device=dev).to(Q_DTYPES[c.q_dtype])
        if c.backend == "triton":
            values.update(_triton_launch(c, caches[0], dev))
        calls = [_make_call(c, q, cache) for cache in caches]
        out = calls[0]()[0]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if check:
            from .reference import decode as ref_decode

            idx = _check_indices(c.batch, check_seqs)
            sub = caches[0] if len(idx) == c.batch else caches[0].select(idx)
            ref, _ = ref_decode(q[idx], sub, window=c.window)
            err = relative_error(out[idx], ref)
            values.update(rel_err=err, check_passed=bool(err <= values["tol"]))
            del ref, sub
        del out
        cycle = itertools.cycle(calls)
        seconds, timing = _time_call(lambda: next(cycle)(), dev, graph=c.backend != "reference", rep=rep,
                                     warmup=warmup, cpu_reps=cpu_reps)
    except torch.OutOfMemoryError as e:
        return _row(base, c, status="skipped", reason=f"out of memory: {e}", **values)
    except UnsupportedError as e:  # a limit the capability table does not know (e.g. a GQA group size)
        return _row(base, c, status="unsupported", reason=str(e), **values)
    except Exception as e:  # one broken cell must not end the sweep; the row says what happened
        return _row(base, c, status="error", reason=f"{type(e).__name__}: {e}", **values)
    total = bytes_moved(c)["total"]
    gbps = total / seconds / 1e9
    pct = 100.0 * gbps / base["copy_gbps"] if base["copy_gbps"] == base["copy_gbps"] else float("nan")
    return _row(base, c, status="ok", timing=timing, time_us=seconds * 1e6, gbps=gbps, pct_copy_bw=pct, **values)


# ---------------------------------------------------------------------------------------- analysis
def _failed(v) -> bool:
    """A check_passed cell that says the check ran and failed (None/NaN: not checked)."""
    return v is not None and not pd.isna(v) and not bool(v)


SHAPE_KEYS = ["gpu_slug", "batch", "context", "window", "num_q_heads", "num_kv_heads", "head_dim", "block_size"]


def speedup_table(df: pd.DataFrame, baseline_kv_dtype: str = "bf16") -> pd.DataFrame:
    """FP8 rows against the best 16-bit decode and the best FlashInfer FP8 decode of the same shape.

    Uses rows with ``status == "ok"`` whose check did not fail (repeated measurements of one
    condition are reduced to their median first). For every FP8 row (backend, variant, mode,
    kv_dtype, granularity, shape): ``bf16_us`` = the fastest ``baseline_kv_dtype`` row of the shape
    over all backends (``bf16_best`` names it), ``speedup_vs_bf16 = bf16_us / time_us``;
    ``flashinfer_fp8_us`` = the fastest FlashInfer row of the shape with the same kv_dtype,
    ``speedup_vs_flashinfer_fp8 = flashinfer_fp8_us / time_us`` (NaN where there is none).
    """
    if "window" not in df.columns:  # results saved before windows were benchmarked: whole contexts
        df = df.assign(window=float("nan"))
    need = set(SHAPE_KEYS) | {"backend", "variant", "label", "mode", "kv_dtype", "granularity", "time_us",
                              "status", "check_passed"}
    missing = sorted(need - set(df.columns))
    if missing:
        _fail(f"df lacks columns {missing}; expected the rows of fp8kv.bench.run()")
    good = df[(df["status"] == "ok") & ~df["check_passed"].map(_failed)]
    good = good[good["time_us"].notna()]
    cond = SHAPE_KEYS + ["backend", "variant", "label", "mode", "kv_dtype", "granularity"]
    med = good.groupby(cond, dropna=False, as_index=False)["time_us"].median()

    base = med[med["kv_dtype"] == baseline_kv_dtype].sort_values("time_us")
    base = base.drop_duplicates(SHAPE_KEYS)[SHAPE_KEYS + ["time_us", "label"]]
    base = base.rename(columns={"time_us": "bf16_us", "label": "bf16_best"})
    fi = med[(med["backend"] == "flashinfer") & med["kv_dtype"].str.startswith("fp8")].sort_values("time_us")
    fi = fi.drop_duplicates(SHAPE_KEYS + ["kv_dtype"])[SHAPE_KEYS + ["kv_dtype", "time_us", "label"]]
    fi = fi.rename(columns={"time_us": "flashinfer_fp8_us", "label": "flashinfer_fp8_best"})

    fp8 = med[med["kv_dtype"].str.startswith("fp8")]
    out = fp8.merge(base, on=SHAPE_KEYS, how="left").merge(fi, on=SHAPE_KEYS + ["kv_dtype"], how="left")
    out["speedup_vs_bf16"] = out["bf16_us"] / out["time_us"]
    out["speedup_vs_flashinfer_fp8"] = out["flashinfer_fp8_us"] / out["time_us"]
    return out.sort_values(SHAPE_KEYS + ["backend", "variant", "mode"]).reset_index(drop=True)


# -------------------------------------------------------------------------------------------- save
def save(df: pd.DataFrame, out_dir: str | os.PathLike = "results/bench", meta: dict | None = None) -> Path:
    """Write ``<out_dir>/<gpu-slug>/<timestamp>.csv`` and a ``.json`` of metadata beside it (the run's
    ``df.attrs["bench"]`` updated with ``meta``), never overwriting (:func:`fp8kv.results.save_table`).
    Returns the CSV's path."""
    from .results import save_table

    return save_table(df, out_dir, meta={**df.attrs.get("bench", {}), **(meta or {})})


# --------------------------------------------------------------------------------------------- CLI
PRESETS = {
    "target": dict(batches=[1, 16, 64, 256], contexts=[4096, 16384, 32768], heads=[(32, 8)], head_dims=[128],
                   block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                   backends=["triton", "flashinfer"], granularities=["tensor"],
                   flashinfer_tensor_cores=[False, True]),
    "tune": dict(batches=[16, 64, 256], contexts=[16384], heads=[(32, 8)], head_dims=[128], block_sizes=[16],
                 kv_dtypes=["fp8_e4m3"], modes=["dequant"], backends=["triton"], granularities=["tensor"],
                 triton_options=[{}, *({"num_splits": s} for s in (1, 2, 4, 8, 16)), {"block_n": 64},
                                 {"num_stages": 3}, {"num_warps": 8}, {"convert": "cast"},
                                 {"convert": "cast/ptx"}]),
    "smoke": dict(batches=[2], contexts=[48], heads=[(4, 2)], head_dims=[64], block_sizes=[16],
                  kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                  backends=["triton", "flashinfer", "reference"], granularities=["tensor"],
                  flashinfer_tensor_cores=[True]),
    # Sliding-window layers (Gemma-3-like), B x window >= 64k tokens: time and bytes bounded by the
    # window, not the context; FlashInfer with window_left beside. Two shapes: Hq/Hkv/D 32/16/128 and
    # Gemma-3-270M's 4/1/256.
    "window": dict(batches=[64, 128], contexts=[16384, 32768], heads=[(32, 16)], head_dims=[128], block_sizes=[16],
                   kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"], backends=["triton", "flashinfer"],
                   granularities=["tensor"], flashinfer_tensor_cores=[False, True], windows=[512, 1024]),
    "window-gemma3": dict(batches=[64, 128], contexts=[16384, 32768], heads=[(4, 1)], head_dims=[256],
                          block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                          backends=["triton", "flashinfer"], granularities=["tensor"],
                          flashinfer_tensor_cores=[False, True], windows=[512, 1024]),
}
# What each preset is for (printed by --help).
PRESET_HELP = {
    "target": "the performance target grid: B 1-256 x context 4k-32k, Hq:Hkv 32:8, D 128, bf16 vs fp8_e4m3, "
              "Triton and FlashInfer (GPU)",
    "tune": "launch variants of the Triton FP8 kernel around its defaults (split count, tile, warps, stages, "
            "FP8 conversion), one option at a time, at B 16-256 x context 16k (GPU)",
    "smoke": "a tiny grid that runs anywhere in seconds; on CPU add --interpret for the Triton rows (there the "
             "16-bit cache and query are fp16, since the Triton interpreter's bf16 arithmetic is wrong)",
    "window": "sliding-window layers at Hq:Hkv 32:16, D 128: B 64-128 x context 16k-32k x window 512/1024, "
              "bf16 vs fp8_e4m3, Triton and FlashInfer (window_left); time and bytes bounded by the window (GPU)",
    "window-gemma3": "the same windows at Gemma-3-270M's shape, Hq:Hkv 4:1, D 256 (GPU)",
}
assert set(PRESET_HELP) == set(PRESETS), "every preset is described in --help"
TRITON_OPTIONS = ("num_splits", "block_n", "num_warps", "num_stages")  # integer launch overrides on the CLI


def _heads(s: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+):(\d+)", s)
    if not m:
        raise argparse.ArgumentTypeError(f"{s!r}: expected Hq:Hkv such as 32:8")
    hq, hkv = int(m.group(1)), int(m.group(2))
    if hq < 1 or hkv < 1 or hq % hkv:
        raise argparse.ArgumentTypeError(f"{s!r}: expected positive Hq:Hkv with Hq a multiple of Hkv "
                                         "(grouped-query attention), such as 32:8")
    return hq, hkv


def _kv_opt(s: str) -> tuple[str, int]:
    m = re.fullmatch(rf"({'|'.join(TRITON_OPTIONS)})=(\d+)", s)
    if not m or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected KEY=INT with KEY in {', '.join(TRITON_OPTIONS)} "
                                         "and INT >= 1")
    return m.group(1), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8kv bench`` argument parser (errors: one line on stderr, exit status 2)."""
    width = max(map(len, PRESETS)) + 1
    presets = "\n".join(textwrap.fill(PRESET_HELP[name], 100, initial_indent=f"  {name:<{width}}",
                                       subsequent_indent=" " * (width + 2)) for name in PRESETS)
    p = checks.ArgumentParser(
        prog="fp8kv bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time paged decode over a grid of cases; write results/bench/<gpu-slug>/<timestamp>.csv.",
        epilog=f"presets:\n{presets}\n\nExit status: 0 all ran and passed their checks, 1 a check failed or "
               "a case errored, 2 bad arguments or nothing to run.")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named grid (see below); grid options override it")
    p.add_argument("--batches", type=int, nargs="+", metavar="B", help="sequences per decode call")
    p.add_argument("--contexts", type=int, nargs="+", metavar="N", help="tokens per sequence")
    p.add_argument("--heads", type=_heads, nargs="+", metavar="HQ:HKV", help="query:KV head pairs (default 32:8)")
    p.add_argument("--head-dims", type=int, nargs="+", metavar="D", help="head dimension (default 128)")
    p.add_argument("--block-sizes", type=int, nargs="+", metavar="P", help="tokens per cache page (default 16)")
    p.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, help="cache element types")
    p.add_argument("--modes", nargs="+", choices=MODES,
                   help="dequant: FP8 pages widened to the query's type; fp8: FP8 tensor-core dots")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, help="decode implementations to time")
    p.add_argument("--granularities", nargs="+", choices=GRANULARITIES, help="FP8 scale granularities")
    p.add_argument("--q-dtype", choices=tuple(Q_DTYPES), help="query dtype (default: bf16 on a GPU, fp16 on CPU)")
    p.add_argument("--tensor-cores", choices=("both", "on", "off"), help="FlashInfer variants (default both)")
    p.add_argument("--triton-opt", type=_kv_opt, action="append", metavar="KEY=INT",
                   help="Triton launch override (repeatable), e.g. num_splits=8")
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the reference")
    p.add_argument("--no-rotate", action="store_true", help="time with the cache possibly L2-resident")
    p.add_argument("--rep", type=int, default=100, help="ms of repetitions per case (CUDA; default 100)")
    p.add_argument("--memory-budget-gb", type=float, metavar="GIB",
                   help="skip cases needing more device memory, GiB (default 60%% of the free memory)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run Triton under its interpreter (sets TRITON_INTERPRET=1; must precede importing "
                        "triton; implies --device cpu)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU if there is one, else the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="list the cases and their status; run nothing")
    return p


def _check_args(args) -> torch.device:
    """Validate what argparse cannot (ranges, the device, the output folder); return the device.

    Raises ValueError / TypeError naming the flag and the value."""
    from .device import resolve_device

    for flag in ("batches", "contexts", "head_dims", "block_sizes"):
        for value in getattr(args, flag) or ():
            checks.positive_int(value, "--" + flag.replace("_", "-"))
    checks.positive_int(args.rep, "--rep")
    if args.memory_budget_gb is not None:
        checks.positive_float(args.memory_budget_gb, "--memory-budget-gb")
    if args.interpret and args.device not in (None, "cpu"):
        checks.fail(f"--interpret runs on CPU tensors; drop --device {args.device}")
    try:
        device = resolve_device("cpu" if args.interpret else args.device)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--device {args.device}: {exc}") from None
    if not args.no_save and not args.dry_run:
        checks.output_folder(args.out, "--out")
    return device


def _grid_from_args(args, device: torch.device) -> dict:
    """The :func:`sweep` arguments of parsed CLI options (a preset, overridden by explicit options) for
    the resolved ``device``. Raises ValueError when neither a preset nor batches and contexts are given."""
    grid = dict(PRESETS[args.preset]) if args.preset else dict(PRESETS["target"], batches=None, contexts=None)
    for name in ("batches", "contexts", "heads", "head_dims", "block_sizes", "kv_dtypes", "modes", "backends",
                 "granularities"):
        if getattr(args, name) is not None:
            grid[name] = getattr(args, name)
    if args.preset == "smoke" and args.kv_dtypes is None and device.type == "cpu":
        grid["kv_dtypes"] = ["fp16", "fp8_e4m3"]
    if args.tensor_cores:
        grid["flashinfer_tensor_cores"] = {"both": [False, True], "on": [True], "off": [False]}[args.tensor_cores]
    if grid["batches"] is None or grid["contexts"] is None:
        checks.fail("give --preset, or --batches and --contexts")
    if args.triton_opt:
        grid["triton_options"] = dict(args.triton_opt)
    if args.q_dtype:
        grid["q_dtype"] = args.q_dtype
    if args.memory_budget_gb is not None:
        grid["memory_budget_bytes"] = int(args.memory_budget_gb * 2**30)
    return grid


def _name_the_interpret_flag(cases: list[Case]) -> None:
    """On a machine without a GPU, point the Triton rows' reason at the CLI flag (not the variable)."""
    if torch.cuda.is_available() or interpreter_on():
        return
    for c in cases:
        if c.backend == "triton" and c.status == "unsupported":
            c.reason = "no GPU: add --interpret to run the Triton kernels on CPU under the Triton interpreter"


def summary(df: pd.DataFrame) -> str:
    """A compact text table of a run: µs, GB/s, % of copy bandwidth, check, and what did not run."""
    ok = df[df["status"] == "ok"]
    lines = []
    if len(ok):
        t = ok[["label", "batch", "context", "num_splits", "time_us", "gbps", "pct_copy_bw", "rel_err",
                "check_passed"]].copy()
        t.columns = ["case", "B", "ctx", "splits", "us", "GB/s", "%copy", "rel_err", "check"]
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        copy = ok["copy_gbps"].iloc[0]
        lines.append(f"copy bandwidth: {copy:.0f} GB/s on {ok['gpu'].iloc[0]}")
        if (ok["timing"] == "cpu-wallclock").any():
            lines.append("CPU wall-clock timings (interpreter / reference): they say nothing about any GPU.")
    sp = speedup_table(df)
    if len(sp) and sp["speedup_vs_bf16"].notna().any():
        t = sp[["label", "batch", "context", "time_us", "bf16_us", "speedup_vs_bf16", "speedup_vs_flashinfer_fp8"]]
        t.columns = ["fp8 case", "B", "ctx", "us", "best bf16 us", "x bf16", "x flashinfer fp8"]
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for status in ("unsupported", "skipped", "error"):
        rest = df[df["status"] == status]
        if len(rest):
            lines.append(f"{status} ({len(rest)}):")
            for (label, reason), grp in rest.groupby(["label", "reason"], sort=False):
                lines.append(f"  {label} x{len(grp)}: {reason}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fp8kv bench`` entry point; returns the exit status.

    0: every case that ran passed its check. 1: a check failed or a case errored. 2: bad arguments,
    or nothing in the grid can run here (one line on stderr, as argparse reports errors).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        device = _check_args(args)
        grid = _grid_from_args(args, device)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if args.interpret:
        if "triton" in sys.modules and not interpreter_on():
            print("warning: triton is already imported; --interpret has no effect", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        cases = sweep(**grid, device=device)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    _name_the_interpret_flag(cases)
    ready = sum(c.status == "ready" for c in cases)
    if args.dry_run:
        for c in cases:
            print(f"{c.status:<11} {c.label:<40} B={c.batch:<4} ctx={c.context:<6} Hq:Hkv={c.num_q_heads}:"
                  f"{c.num_kv_heads} D={c.head_dim} page={c.block_size}  {c.reason}")
        print(f"{ready} of {len(cases)} cases would run")
    if not ready:
        reasons = sorted({c.reason for c in cases})
        parser.error(f"none of the {len(cases)} cases can run here: {'; '.join(reasons)}")
    if args.dry_run:
        return 0
    df = run(cases, check=not args.no_check, rep=args.rep, progress=not args.quiet,
             rotate=not args.no_rotate, device=device)
    print(summary(df))
    if not args.no_save:
        path = save(df, args.out, meta={"argv": argv})
        print(f"wrote {path}")
    bad = (df["status"] == "error") | df["check_passed"].map(_failed)
    return 1 if bad.any() else 0


if __name__ == "__main__":
    sys.exit(main())


def results_markdown(df: pd.DataFrame) -> str:
    """The side-by-side decode table (one line per batch × context) as Markdown, for READMEs and notes.

    Columns: median µs of each backend × KV dtype × mode; FP8 GB/s and % of the copy bandwidth for
    the Triton dequant kernel; its speedup over the best BF16 decode and over FlashInfer's best FP8.
    """
    ok = df[(df["status"] == "ok") & df["check_passed"].astype(bool)].copy()
    ok["variant"] = ok["variant"].fillna("")
    ok["column"] = [f"FlashInfer{'' if v == 'tc' else ' (no TC)'} {k}" if b == "flashinfer"
                    else f"Triton {k}{' fp8-mode' if m == 'fp8' else ''}"
                    for b, v, k, m in zip(ok["backend"], ok["variant"], ok["kv_dtype"].str.replace("fp8_e4m3", "fp8"),
                                          ok["mode"], strict=True)]
    t = ok.pivot_table(index=["batch", "context"], columns="column", values="time_us", aggfunc="median")
    fp8 = ok[(ok["backend"] == "triton") & (ok["kv_dtype"] != "bf16") & (ok["mode"] == "dequant")]
    fp8 = fp8.groupby(["batch", "context"])[["gbps", "pct_copy_bw"]].median()
    bf16 = ok[ok["kv_dtype"] == "bf16"].groupby(["batch", "context"])["time_us"].min()
    fi8 = ok[(ok["backend"] == "flashinfer") & (ok["kv_dtype"] != "bf16")].groupby(["batch", "context"])["time_us"].min()
    order = [c for c in ("Triton fp8", "Triton fp8 fp8-mode", "Triton bf16", "FlashInfer fp8", "FlashInfer bf16",
                         "FlashInfer (no TC) fp8", "FlashInfer (no TC) bf16") if c in t.columns]
    head = ["B", "ctx", *[f"{c} µs" for c in order], "Triton fp8 GB/s", "% copy", "× best BF16", "× FlashInfer FP8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (b, ctx), row in t.iterrows():
        tri = row.get("Triton fp8")
        cells = [str(b), str(ctx), *[f"{row[c]:.1f}" for c in order],
                 f"{fp8.loc[(b, ctx), 'gbps']:.0f}", f"{fp8.loc[(b, ctx), 'pct_copy_bw']:.0f}",
                 f"{bf16.loc[(b, ctx)] / tri:.2f}", f"{fi8.loc[(b, ctx)] / tri:.2f}" if (b, ctx) in fi8.index else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
