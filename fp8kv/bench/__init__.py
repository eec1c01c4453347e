"""Decode benchmark harness: a grid of cases → tidy result rows (one measurement per row).

Modules: :mod:`~fp8kv.bench.cases` (the grid, bytes, tolerance, memory), :mod:`~fp8kv.bench.ceiling`
(the copy-bandwidth ceiling), :mod:`~fp8kv.bench.measure` (cache builds, checks, timing),
:mod:`~fp8kv.bench.report` (speedups, summaries, saving),
:mod:`~fp8kv.bench.cli` (``fp8kv bench``). Their public names are importable from here.

::

    cases = sweep(batches=[1, 16], contexts=[4096], kv_dtypes=["bf16", "fp8_e4m3"])
    df = run(cases)                 # time_us, bytes, gbps, pct_copy_bw, rel_err, check_passed, ...
    speedup_table(df)               # FP8 over the best BF16 decode of the same shape
    layout_table(df)                # per head layout: peers, own BF16, FP8, rates, % of the limit
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
  (:func:`fp8kv.bench.ceiling.measure_copy_bandwidth`).
"""

from .cases import Q_DTYPES, Case, bytes_moved, footprint_bytes, memory_budget, sweep, tolerance
from .ceiling import measure_copy_bandwidth
from .cli import TRITON_OPTIONS, build_parser, main, preset_grid
from .measure import (
           COLUMNS,
           probe_us,
           resolve_copy_bandwidth,
           run,
           synthetic_cache,
           time_call,
           time_long_call,
)
from .presets import PAGE_SIZES, PRESET_HELP, PRESETS
from .report import (
           LAYOUT_KEYS,
           SHAPE_KEYS,
           all_checks_passed,
           best_per_configuration,
           case_counts,
           layout_markdown,
           layout_table,
           page_size_table,
           results_markdown,
           save,
           save_comparison,
           speedup_table,
           summary,
)

__all__ = ["Case", "sweep", "run", "speedup_table", "save", "main", "synthetic_cache", "bytes_moved",
           "tolerance", "footprint_bytes", "memory_budget", "summary", "results_markdown", "time_call", "time_long_call", "probe_us",
           "build_parser", "PRESETS", "PRESET_HELP", "PAGE_SIZES", "page_size_table", "TRITON_OPTIONS", "COLUMNS", "SHAPE_KEYS", "Q_DTYPES",
           "layout_table", "layout_markdown", "LAYOUT_KEYS", "preset_grid",
           "best_per_configuration", "save_comparison", "case_counts", "all_checks_passed", "measure_copy_bandwidth",
           "resolve_copy_bandwidth"]
