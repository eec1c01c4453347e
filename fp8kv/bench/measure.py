"""Measuring cases: :func:`run` builds each cache once, checks every backend against the fp32 oracle
on the same dequantized cache, and times the decode call alone (:func:`time_call`: CUDA graphs,
CUDA events or CPU wall clock), returning one tidy row per case (:data:`COLUMNS`)."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from .. import checks
from ..backends import planned
from ..cache import PagedKVCache
from ..capability import UnsupportedError
from ..checks import fail as _fail
from ..interrupts import reclaim_stop_signals
from ..quant import relative_error
from ..results import utc_stamp
from ..sweeps import interruptible, machine_fields, release_memory, run_metadata
from ..synthetic import random_paged_cache
from .cases import Q_DTYPES, Case, bytes_moved, tolerance
from .ceiling import measure_copy_bandwidth
from .formats import check_quantized, clone_quantized, is_quantized, quantized_cache, quantized_call

COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton", "flashinfer", "vllm", "fp8kv_source",
    "label", "backend", "variant", "mode", "kv_dtype", "granularity", "layout", "q_dtype",
    "batch", "context", "window", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
    "tensor_cores", "kernel", "num_splits", "block_n", "num_warps", "num_stages", "heads_per_program",
    "timing", "time_us", "bytes", "kv_bytes", "gbps", "pct_copy_bw", "copy_gbps", "kv_copies",
    "rel_err", "tol", "check_passed", "status", "reason",
]


# ------------------------------------------------------------------------------------ cache build
synthetic_cache = random_paged_cache  # the benchmark's cache: N(0, 1) K/V built on the device


# ------------------------------------------------------------------------------------------ calls
def planned_launch(call: Callable) -> dict:
    """The kernel and launch parameters the Triton backend's planned ``call`` (:func:`fp8kv.backends.planned`)
    runs: its plan's, read, not worked out again."""
    plan = call.args[0]  # functools.partial(fp8kv.ops.run, plan, q, cache)
    return {"tensor_cores": plan.kernel != "triton-cuda-core", "kernel": plan.kernel,
            **{k: plan.config[k] for k in ("num_splits", "block_n", "num_warps", "num_stages", "heads_per_program")}}


def _vllm_launch(case: Case) -> dict:
    """vLLM's launch shape for the case (:func:`fp8kv.backends.vllm.launch_info`): 2D, or 3D split-KV."""
    from ..backends.vllm import launch_info

    return launch_info(case.batch, case.num_kv_heads)


def time_call(fn: Callable, device: torch.device, *, graph: bool, rep: int, warmup: int,
              cpu_reps: int) -> tuple[float, str]:
    """Median seconds per call of the zero-argument ``fn`` and the timing method.

    CUDA: ``triton.testing.do_bench_cudagraph`` (``graph=True``: ``fn`` is captured, so it must not
    sync with the host) or ``do_bench`` (CUDA events); ``rep``/``warmup`` in milliseconds. CPU: the
    median of ``cpu_reps`` wall-clock calls. The method is ``"cuda-graph"``, ``"cuda-events"`` or
    ``"cpu-wallclock"``."""
    device = torch.device(device)  # a name ("cpu", "cuda:0") as well
    checks.positive_int(cpu_reps, "cpu_reps")
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


MIN_GRAPH_REPLAYS, MAX_GRAPH_REPLAYS = 3, 100  # time_long_call's timed replays


def time_long_call(fn: Callable, device: torch.device, *, graph: bool, rep: int, cpu_reps: int) -> tuple[float, str]:
    """Median seconds per call of a long ``fn`` (a prefill chunk's forward: milliseconds to seconds) and the method.

    CUDA: ``fn`` run once (compiles, allocates), captured once in a CUDA graph, replayed once to estimate, then
    timed replay by replay (CUDA events), ``rep`` ms of them but at least :data:`MIN_GRAPH_REPLAYS`: the median.
    :func:`time_call`'s ``do_bench_cudagraph`` runs such a call ~17 times a point (its estimate, and ten replays of
    a graph of at least one call), which made a 32k-token prompt in 512-token chunks take minutes; a replay's
    launch (microseconds) is noise beside a call this long. Method ``"cuda-graph-replays"``. Without ``graph``
    (a call that syncs with the host) or on a CPU: :func:`time_call`'s CUDA events or wall clock."""
    device = torch.device(device)
    checks.positive_int(rep, "rep")
    if device.type != "cuda" or not graph:
        return time_call(fn, device, graph=False, rep=rep, warmup=25, cpu_reps=cpu_reps)
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up off the default stream, as capture requires
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()

        def replay_ms() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            captured.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        estimate = max(replay_ms(), 1e-3)
        n = min(MAX_GRAPH_REPLAYS, max(MIN_GRAPH_REPLAYS, math.ceil(rep / estimate)))
        times = [replay_ms() for _ in range(n)]
    return statistics.median(times) * 1e-3, "cuda-graph-replays"


def probe_us(fn: Callable, calls: int, device, *, rep: int = 60) -> float:
    """Microseconds per decode of a probe's ``fn`` that makes ``calls`` decodes (over rotated caches): the
    middle of three medians of :func:`time_call` (CUDA graphs on a GPU, ``rep`` ms each), after one call."""
    device = torch.device(device)
    calls = checks.positive_int(calls, "calls")  # decodes per fn(): 0 divided by zero, -1 gave negative times
    fn()
    return sorted(time_call(fn, device, graph=True, rep=rep, warmup=0, cpu_reps=1)[0] * 1e6 / calls
                  for _ in range(3))[1]


def _check_indices(batch: int, n: int) -> list[int]:
    return list(range(batch)) if batch <= n else sorted({*range(n - 1), batch - 1})


# -------------------------------------------------------------------------------------------- run
def resolve_copy_bandwidth(copy_bandwidth, device) -> tuple[float, dict | None]:
    """``(GB/s, info)`` of a ``copy_bandwidth`` argument: None measures now
    (:func:`fp8kv.bench.ceiling.measure_copy_bandwidth`), False skips (NaN, None), a positive number or a
    measurement dict is taken as given."""
    if copy_bandwidth is False:
        return float("nan"), None
    if copy_bandwidth is None:
        info = measure_copy_bandwidth(device=device)
        return float(info["gbps"]), info
    if isinstance(copy_bandwidth, dict):
        if "gbps" not in copy_bandwidth:
            _fail(f"copy_bandwidth has keys {sorted(copy_bandwidth)}; a measurement dict holds 'gbps' "
                  "(fp8kv.bench.ceiling.measure_copy_bandwidth)")
        return checks.positive_float(copy_bandwidth["gbps"], "copy_bandwidth['gbps']"), copy_bandwidth
    if isinstance(copy_bandwidth, (int, float)) and not isinstance(copy_bandwidth, bool):
        gbps = checks.positive_float(copy_bandwidth, "copy_bandwidth")  # a share of it is every row's % of copy
        return gbps, {"gbps": gbps, "method": "given"}
    _fail(f"copy_bandwidth={copy_bandwidth!r}; expected None (measure), False (skip), a positive GB/s "
          "number or the dict of fp8kv.bench.ceiling.measure_copy_bandwidth")


def _l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20)


def run(cases: Sequence[Case], *, check: bool = True, rep: int = 100, warmup: int = 25,
        copy_bandwidth=None, progress: bool = True, device=None, rotate: bool = True,
        check_seqs: int = 2, cpu_reps: int = 3, keep_partial: bool = False) -> pd.DataFrame:
    """Measure ``cases``; return one tidy row per case (columns :data:`COLUMNS`).

    Parameters
    ----------
    check : compare each backend's output with the fp32 reference first (``rel_err``,
        ``check_passed`` against :func:`tolerance`); rows are timed either way.
    rep, warmup : milliseconds of repetition / warm-up for the CUDA timers, each at most
        :data:`fp8kv.checks.MAX_REP_MS`.
    copy_bandwidth : None (measure once now), False (skip), GB/s, or a
        :func:`fp8kv.bench.ceiling.measure_copy_bandwidth` dict. Recorded in every row (``copy_gbps``).
    rotate : on CUDA, cycle through clones of caches smaller than 4 × L2 so reads come from HBM.
    check_seqs : sequences compared with the reference (first ones and the last).
    cpu_reps : calls timed per case on CPU.

    Statuses: ``ok``, ``unsupported`` / ``skipped`` (from :func:`sweep`, or found here),
    ``error`` (the exception in ``reason``). ``df.attrs["bench"]`` holds the run's metadata.
    keep_partial : on KeyboardInterrupt, return the rows measured so far (the rest ``skipped``, and
        ``df.attrs["bench"]["interrupted"]`` True) instead of stopping: what the CLI does, so that a
        run stopped by ``timeout`` or Ctrl-C saves what it measured. Off, the interrupt propagates.
    """
    from tqdm.auto import tqdm

    from ..device import describe_device, resolve_device

    dev = resolve_device(device)
    cases = list(cases)
    for i, c in enumerate(cases):
        if not isinstance(c, Case):
            _fail(f"cases[{i}] is a {type(c).__name__}; expected fp8kv.bench.Case (see sweep())", TypeError)
    checks.rep_ms(rep, "rep")
    checks.rep_ms(warmup, "warmup")
    checks.positive_int(check_seqs, "check_seqs")
    checks.positive_int(cpu_reps, "cpu_reps")
    checks.flag(keep_partial, "keep_partial")
    checks.flag(check, "check")  # "no" would read as True
    stamp = utc_stamp()
    info = describe_device(dev)
    runnable = [c for c in cases if c.status == "ready"]
    copy_gbps, copy_info = resolve_copy_bandwidth(copy_bandwidth, dev) if runnable else (float("nan"), None)
    base = machine_fields(stamp, info, copy_gbps, libraries=("flashinfer", "vllm"))

    rows: dict[int, dict] = {}
    for i, c in enumerate(cases):
        if c.status != "ready":
            rows[i] = _row(base, c, status=c.status, reason=c.reason)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(cases):
        if c.status == "ready":
            groups.setdefault(c.cache_key, []).append(i)

    bar = tqdm(total=len(runnable), disable=not progress, desc="bench", unit="case")
    # Ctrl-C, or SIGTERM turned into it by the CLI: keep what was measured
    interrupted = interruptible(lambda: _measure_groups(cases, groups, rows, base, dev, bar, check=check, rep=rep,
                                                        warmup=warmup, rotate=rotate, check_seqs=check_seqs,
                                                        cpu_reps=cpu_reps), keep_partial=keep_partial, dev=dev)
    if interrupted:
        for i, c in enumerate(cases):
            rows.setdefault(i, _row(base, c, status="skipped", reason="the run was interrupted before this case"))
    bar.close()

    df = pd.DataFrame([rows[i] for i in range(len(cases))], columns=COLUMNS)
    df.attrs["bench"] = run_metadata(stamp, info, copy_info, {"check": check, "rep": rep, "warmup": warmup,
                                                              "rotate": rotate, "check_seqs": check_seqs,
                                                              "cpu_reps": cpu_reps}, interrupted=interrupted)
    return df


def _measure_groups(cases, groups, rows, base, dev, bar, *, check, rep, warmup, rotate, check_seqs, cpu_reps):
    """Measure every group of cases sharing one cache into ``rows`` (by case index), a group at a time."""
    for idx in groups.values():
        first = cases[idx[0]]
        caches: list[PagedKVCache] = []
        try:
            quantized = is_quantized(first.kv_dtype)
            if quantized:
                caches = [quantized_cache(first, dev)]
            else:
                caches = [synthetic_cache(first.batch, first.context, first.num_kv_heads, first.head_dim,
                                          block_size=first.block_size, kv_dtype=first.kv_dtype,
                                          granularity=first.granularity, layout=first.layout, device=dev,
                                          seed=first.seed)]
            if rotate and dev.type == "cuda":
                kvb = caches[0].nbytes
                copy = clone_quantized if quantized else type(caches[0]).clone
                caches += [copy(caches[0]) for _ in range(math.ceil(4 * _l2_bytes(dev) / kvb) - 1)]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # OOM or a broken build: the group's rows say so, the sweep goes on
            oom = isinstance(e, torch.OutOfMemoryError)
            for i in idx:
                rows[i] = _row(base, cases[i], status="skipped" if oom else "error",
                               reason=f"building the cache: {type(e).__name__}: {e}")
            bar.update(len(idx))
            caches = []
            release_memory(dev)
            continue
        for i in idx:
            c = cases[i]
            bar.set_postfix_str(f"{c.label} B={c.batch} ctx={c.context}")
            rows[i] = _measure(c, caches, dev, base, check=check, rep=rep, warmup=warmup,
                               check_seqs=check_seqs, cpu_reps=cpu_reps)
            reclaim_stop_signals()  # a compile in the case may have let LLVM take them (a stop would lose the rows)
            bar.update(1)
        del caches
        release_memory(dev)


def _row(base: dict, c: Case, **values) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(base)
    row.update(label=c.label, backend=c.backend, variant=c.variant, mode=c.mode, kv_dtype=c.kv_dtype,
               granularity=c.granularity, layout=c.layout, q_dtype=c.q_dtype, batch=c.batch, context=c.context,
               window=c.window,
               num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
               block_size=c.block_size, tensor_cores=c.options.get("use_tensor_cores"),
               time_us=float("nan"), gbps=float("nan"), pct_copy_bw=float("nan"),
               rel_err=float("nan"), reason="")
    by = bytes_moved(c)
    row.update(bytes=by["total"], kv_bytes=by["kv"])
    row.update(values)
    return row


def _measure(c: Case, caches: list[PagedKVCache], dev: torch.device, base: dict, *, check: bool, rep: int,
             warmup: int, check_seqs: int, cpu_reps: int) -> dict:
    values: dict = {"tol": tolerance(c), "kv_copies": len(caches)}
    try:
        g = torch.Generator(device=dev).manual_seed(c.seed + 7)
        q = torch.randn(c.batch, c.num_q_heads, c.head_dim, generator=g, device=dev).to(Q_DTYPES[c.q_dtype])
        if c.backend == "vllm":
            values.update(_vllm_launch(c))
        elif c.backend == "flashinfer":  # its tensor-core or CUDA-core decode
            values["kernel"] = f"flashinfer-{c.variant}" if c.variant else "flashinfer"
        # validated and planned once per cache (fp8kv.backends.planned): no host work left in the timed call
        window = {} if c.window is None else {"window": c.window}
        quantized = is_quantized(c.kv_dtype)
        if quantized:  # fp8kv.ops.quant_decode: the kernel or its oracle, checked once per cache
            calls, columns = zip(*(quantized_call(q, cache, c.backend, c.options) for cache in caches), strict=True)
            values.update(columns[0])  # the same plan for every copy of the cache
        else:
            calls = [planned(q, cache, c.backend, c.mode, **window, **c.options) for cache in caches]
        if c.backend == "triton" and not quantized:
            values.update(planned_launch(calls[0]))
        out = calls[0]()[0]
        reclaim_stop_signals()  # the first call compiled: take the handlers back before the timing's minutes
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if check and quantized:  # against quantized_reference on the same pages, the tolerance from its scores
            values.update(check_quantized(out, q, caches[0], _check_indices(c.batch, check_seqs), c.backend))
        elif check:
            from ..reference import decode as ref_decode

            idx = _check_indices(c.batch, check_seqs)
            sub = caches[0] if len(idx) == c.batch else caches[0].select(idx)
            ref, _ = ref_decode(q[idx], sub, window=c.window)
            err = relative_error(out[idx], ref)
            values.update(rel_err=err, check_passed=bool(err <= values["tol"]))
            del ref, sub
        del out
        cycle = itertools.cycle(calls)
        seconds, timing = time_call(lambda: next(cycle)(), dev, graph=c.backend != "reference", rep=rep,
                                    warmup=warmup, cpu_reps=cpu_reps)
    except torch.OutOfMemoryError as e:
        return _row(base, c, status="skipped", reason=f"out of memory: {e}", **values)
    except UnsupportedError as e:  # a hand-made case, another machine than the sweep's, or a backend's own limit
        return _row(base, c, status="unsupported", reason=str(e), **values)
    except Exception as e:  # one broken cell must not end the sweep; the row says what happened
        return _row(base, c, status="error", reason=f"{type(e).__name__}: {e}", **values)
    total = bytes_moved(c)["total"]
    gbps = total / seconds / 1e9
    pct = 100.0 * gbps / base["copy_gbps"] if base["copy_gbps"] == base["copy_gbps"] else float("nan")
    return _row(base, c, status="ok", timing=timing, time_us=seconds * 1e6, gbps=gbps, pct_copy_bw=pct, **values)

