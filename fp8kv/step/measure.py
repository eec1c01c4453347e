"""The sweep: build the pool and the weights, capture each step (and its attention alone) in a CUDA
graph, time it; tidy rows (:data:`COLUMNS`) saved under results/step/<gpu>/."""

from __future__ import annotations

import math
import sys

import torch

from ..capability import UnsupportedError
from ..capacity import ModelShape, gib_text
from ..checks import fail as _fail
from ..checks import flag, positive_int, rep_ms, run_seed
from ..device import free_memory_bytes
from ..interrupts import reclaim_stop_signals
from ..results import utc_stamp
from ..sweeps import interruptible, machine_fields, release_memory, run_metadata, save_run
from .layers import REAL_WEIGHTS, StepWeights, random_weights, weights_from_hf
from .model import STEP_BACKENDS, STEP_MODES, DecodeStep, KVPool
from .plan import checked_runs, param_count, plan_sweep, run_dtype, run_dtype_arg, step_bytes
from .quantized import format_name

COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton", "fp8kv_source",
    "model", "weights", "kv_dtype", "kv_format", "bytes_per_token", "backend", "mode", "batch", "context", "ceiling",
    "step_us", "tokens_per_s", "attention_us", "attention_share",
    "bytes_moved", "kv_bytes", "weight_bytes", "gbps", "copy_gbps", "pct_copy_bw",
    "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size",
    "block_size", "gpu_memory_gib", "utilization", "kv_pool_bytes", "activation_bytes",
    "timing", "logits_finite", "status", "reason",
]


# ------------------------------------------------------------------------------------------------ sweep
def check_weights(shapes, weights: str) -> None:
    """``weights`` checked against every model before anything is built (a refusal is bad input, not a point's
    failure)."""
    if weights not in ("auto", "real", "random"):
        _fail(f"weights={weights!r}; expected 'auto', 'real' or 'random'")
    for shape in shapes:
        if weights == "real" and shape.name not in REAL_WEIGHTS:
            _fail(f"weights='real': fp8kv loads real weights only for {sorted(REAL_WEIGHTS)}, not {shape.name}")


def load_weights(shape: ModelShape, weights: str, dtype, dev, seed: int) -> StepWeights:
    """The step's weights of ``shape``: real where asked and fp8kv loads them (``weights`` "auto" / "real"),
    else random of the same shapes (:func:`random_weights`)."""
    if weights != "random" and shape.name in REAL_WEIGHTS:
        try:
            from ..models import load_model

            model, _ = load_model(REAL_WEIGHTS[shape.name], dtype=dtype, device=dev)
            out = weights_from_hf(model, shape)
            del model
            return out
        except ImportError as e:
            if weights == "real":
                raise
            print(f"{shape.name}: real weights unavailable ({e}); random weights of the same shapes",
                  file=sys.stderr)
    return random_weights(shape, dtype, dev, seed)


def check_run_options(*, backend, mode, rep, cpu_reps, seed, progress, dtype) -> None:
    """A sweep's run options, checked before anything is built (every point would otherwise fail alike, as a row)."""
    if not isinstance(backend, str) or backend not in STEP_BACKENDS:
        _fail(f"backend={backend!r}; expected one of {STEP_BACKENDS}")
    if not isinstance(mode, str) or mode not in STEP_MODES:
        _fail(f"mode={mode!r}; expected one of {STEP_MODES}")
    rep_ms(rep)
    positive_int(cpu_reps, "cpu_reps")
    run_seed(seed)
    flag(progress, "progress")
    if dtype is not None:  # None: bf16 on a GPU, fp32 on CPU
        run_dtype_arg(dtype)


def sweep(models, contexts, kv_dtypes=("bf16", "fp8_e4m3"), *, batches=None, backend: str = "auto",
          mode: str = "auto", gpu_memory_gib=None, utilization: float = 0.9, block_size: int = 16,
          weights: str = "auto", device=None, dtype=None, rep: int = 50, copy_bandwidth=None,
          progress: bool = True, seed: int = 0, cpu_reps: int = 3, keep_partial: bool = False):
    """Time the decode step from batch 1 to each KV dtype's ceiling; one tidy row per (model, context,
    kv_dtype, batch) (columns :data:`COLUMNS`).

    Parameters
    ----------
    models : registry names (``fp8kv.capacity.MODELS``) or ModelShapes with the step's fields.
    contexts : tokens per sequence, the new one included.
    kv_dtypes : element types (``bf16``, ``fp16``, ``fp8_e4m3``, ``fp8_e5m2``) or quantized formats
        (:data:`fp8kv.step.quantized.STEP_FORMATS`: ``int8_token_head``, ``nvfp4``, ...); each one's ceiling from
        the planner's bytes per token (scales counted), its rows with ``kv_format`` and ``bytes_per_token``.
        A format the backend does not read, or whose block does not fit a model's head_dim, is refused
        before anything runs (ValueError).
    batches : explicit batch sizes (each must fit every KV dtype's ceiling), else :func:`batch_points`.
    gpu_memory_gib : GiB or a GPU name to plan against; default this GPU's total (required on CPU).
    weights : ``"auto"`` (real where fp8kv loads them, else random), ``"real"`` or ``"random"``.
    dtype : weights and activations; default bf16 on a GPU, fp32 on CPU.
    rep : CUDA: milliseconds of graph replays per timing (``triton.testing.do_bench_cudagraph``), at most
        :data:`fp8kv.checks.MAX_REP_MS`.
    copy_bandwidth : None (measure now), False (skip), GB/s, or a ``measure_copy_bandwidth`` dict.
    keep_partial : on KeyboardInterrupt (Ctrl-C, or a stop signal the CLI turns into one), return the points
        measured so far (``df.attrs["step"]["interrupted"]`` True) instead of stopping: what the CLI does.

    Per (model, KV dtype) one :class:`KVPool` is allocated (:func:`pool_blocks`: on a GPU as large as the
    planner allows, elsewhere as large as the largest batch measured needs), and every batch draws its
    sequences from it. Off a GPU, a run whose pool and weights exceed the host's available memory is
    refused before anything is allocated (ValueError), rather than killed by the kernel.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from ..bench import resolve_copy_bandwidth, time_call
    from ..device import describe_device, resolve_device

    flag(keep_partial, "keep_partial")
    check_run_options(backend=backend, mode=mode, rep=rep, cpu_reps=cpu_reps, seed=seed, progress=progress, dtype=dtype)
    dev = resolve_device(device)
    dtype = run_dtype(dev, dtype)
    plans = plan_sweep(models, contexts, kv_dtypes, batches=batches, gpu_memory_gib=gpu_memory_gib,
                       utilization=utilization, block_size=block_size, device=dev, dtype=dtype, backend=backend,
                       mode=mode)
    check_weights(dict.fromkeys(p["shape"] for p in plans), weights)
    check_host_memory(plans, dev, dtype)
    copy_gbps, copy_info = resolve_copy_bandwidth(copy_bandwidth, dev)
    info = describe_device(dev)
    stamp = utc_stamp()
    base = machine_fields(stamp, info, copy_gbps)
    bar = tqdm(total=sum(len(p["batches"]) for p in plans), disable=not progress, desc="step", unit="point")

    def mine(shape, kv=None):
        return [p for p in plans if p["shape"] is shape and kv in (None, p["kv_dtype"])]

    rows = []

    def measure(shape, kv, w, pool):
        for p in mine(shape, kv):
            for b in p["batches"]:
                bar.set_postfix_str(f"{shape.name} {kv} ctx={p['context']} B={b}")
                rows.append(_measure_point(shape, w, pool, p, b, backend, mode, dev, base, rep, cpu_reps, seed,
                                           time_call))
                bar.update(1)

    def failed(shape, kv, w, reason):
        return _failed_points(shape, mine(shape, kv), backend, mode, base, block_size, reason, bar, weights=w)

    interrupted = interruptible(lambda: run_pools(
        dict.fromkeys(p["shape"] for p in plans), lambda shape: dict.fromkeys(p["kv_dtype"] for p in mine(shape)),
        lambda shape, kv: pool_blocks(mine(shape, kv), dev), measure, failed, rows=rows, weights=weights,
        dtype=dtype, dev=dev, seed=seed, block_size=block_size), keep_partial=keep_partial, dev=dev)
    bar.close()
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["step"] = run_metadata(stamp, info, copy_info, {"rep": rep, "backend": backend, "mode": mode,
                                                             "utilization": utilization, "block_size": block_size,
                                                             "weights": weights, "dtype": str(dtype)},
                                    interrupted=interrupted)
    return df


def pool_blocks(plans, dev) -> int:
    """Blocks of the :class:`KVPool` that serves ``plans`` (:func:`plan_sweep` dicts of one model and KV dtype).

    On a GPU: the planner's blocks (the KV memory an engine would hold; allocating it checks that the
    plan fits). Elsewhere the "GPU memory" is only planned against, and a pool of that size would be
    host memory spent for nothing: the blocks the largest batch measured needs at its context.
    """
    if torch.device(dev).type == "cuda":
        return max(p["plan"]["blocks"] for p in plans)
    return max(max(p["batches"]) * math.ceil(p["context"] / p["plan"]["block_size"]) for p in plans)


def check_host_memory(plans, dev, dtype=None) -> None:
    """Off a GPU, refuse (ValueError) a sweep whose largest model's weights plus its KV pools
    (:func:`pool_blocks`) exceed the host's available memory: the kernel would kill the process
    without a word. A no-op on a GPU, or where the available memory is unknown."""
    dev = torch.device(dev)
    if dev.type == "cuda":
        return
    avail = free_memory_bytes(dev)
    if avail is None:
        return
    dtype = run_dtype(dev, dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    for shape in dict.fromkeys(p["shape"] for p in plans):
        mine = [p for p in plans if p["shape"] is shape]
        pools = {}  # one pool at a time: the largest counts
        for kv in dict.fromkeys(p["kv_dtype"] for p in mine):
            group = [p for p in mine if p["kv_dtype"] == kv]
            pools[kv] = pool_blocks(group, dev) * group[0]["plan"]["block_bytes"]
        kv = max(pools, key=pools.get)
        weights = param_count(shape) * elem
        if weights + pools[kv] > avail:
            worst = max((p for p in mine if p["kv_dtype"] == kv),
                        key=lambda p: max(p["batches"]) * math.ceil(p["context"] / p["plan"]["block_size"]))
            _fail(f"{shape.name} on {dev.type}: the weights ({gib_text(weights)}) and the {kv} KV pool of the largest "
                  f"batch measured ({gib_text(pools[kv])}: batch {max(worst['batches'])} at context "
                  f"{worst['context']}) need {gib_text(weights + pools[kv])}, more than the {gib_text(avail)} of "
                  "host memory available; pass smaller batches (--batches) or contexts (--contexts)")


def sweep_runs(runs, kv_dtypes=("bf16", "fp8_e4m3"), **kwargs):
    """:func:`sweep` of each ``(model, context)`` pair of ``runs`` (rather than every model at every
    context), as one table; ``kwargs`` as :func:`sweep` takes them."""
    import pandas as pd

    frames = []
    for model, context in checked_runs(runs):
        frames.append(sweep([model], [context], kv_dtypes, **kwargs))
        if frames[-1].attrs["step"]["interrupted"]:  # keep_partial: the pairs after it do not run
            break
    df = pd.concat(frames, ignore_index=True)  # the runs' metadata kept only where they all agree (pandas)
    df.attrs.setdefault("step", {})["interrupted"] = frames[-1].attrs["step"]["interrupted"]
    return df


def why_failed(e: BaseException) -> str:
    """An exception as a row's reason: its type and message."""
    return f"{type(e).__name__}: {e}"


def point_failure(e: Exception) -> dict:
    """A point that raised, as its row's ``status`` and ``reason``: ``unsupported`` where the backend refuses it,
    ``error`` otherwise (out of memory below the planned ceiling said so)."""
    if isinstance(e, torch.OutOfMemoryError):
        return {"status": "error", "reason": f"out of memory below the planned ceiling: {e}"}
    if isinstance(e, UnsupportedError):
        return {"status": "unsupported", "reason": str(e)}
    return {"status": "error", "reason": why_failed(e)}


def run_pools(shapes, kv_dtypes_of, blocks_of, measure, failed, *, rows: list, weights, dtype, dev, seed,
              block_size) -> None:
    """The loop every step sweep runs: per model its weights, then per KV dtype (``kv_dtypes_of(shape)``) one
    :class:`KVPool` of ``blocks_of(shape, kv)`` blocks handed to ``measure(shape, kv, w, pool)``, which appends
    each point's row to ``rows`` as it is measured (an interrupted sweep keeps them), each pool freed before the
    next is allocated (a GPU holds one at a time). What cannot be built does not end the sweep:
    ``failed(shape, kv, w, reason)`` gives its rows (``kv`` None and ``w`` None: the model's weights did not
    load, for all its points; else that pool, e.g. out of memory), appended to ``rows`` too."""
    for shape in shapes:
        try:
            w = load_weights(shape, weights, dtype, dev, seed)
        except Exception as e:  # one model's weights must not end the sweep: its rows say why
            rows += failed(shape, None, None, f"loading the weights: {why_failed(e)}")
            continue
        for kv in kv_dtypes_of(shape):
            try:
                pool = KVPool(shape, blocks_of(shape, kv), kv, block_size=block_size, device=dev)
            except Exception as e:  # e.g. out of memory on a GPU: the pool's points say so, the others run
                rows += failed(shape, kv, w, f"allocating the {kv} KV pool: {why_failed(e)}")
                release_memory(dev)
                continue
            measure(shape, kv, w, pool)
            del pool
            release_memory(dev)
        del w
        release_memory(dev)


def time_step(shape, w, pool, batch: int, context: int, q_len: int, backend, mode, dev, rep, cpu_reps, seed,
              time_call, *, logits: str = "all") -> dict:
    """One step of ``batch`` sequences whose last ``q_len`` of ``context`` tokens are new, built over ``pool`` and
    timed: ``step_us``, ``attention_us``, ``timing``, ``logits_finite``, ``backend``, ``mode``, ``status`` ``ok``;
    or ``status`` ``unsupported`` / ``error`` and the ``reason`` (the sweep goes on either way)."""
    step = None
    try:
        step = DecodeStep(shape, w, pool.caches(batch, context, seed), backend=backend, mode=mode, q_len=q_len,
                          logits=logits)
        out = {"backend": step.backend, "mode": step.mode}
        step.input_ids.copy_(torch.arange(batch * q_len, device=dev) % shape.vocab_size)
        step.set_positions(context - q_len)  # the new tokens are the last q_len: attention reads context tokens
        logits_out = step.forward()
        out["logits_finite"] = bool(torch.isfinite(logits_out).all())
        del logits_out
        graph = step.backend != "reference"
        step_s, timing = time_call(step.forward, dev, graph=graph, rep=rep, warmup=25, cpu_reps=cpu_reps)
        attn_s, _ = time_call(step.attention_only, dev, graph=graph, rep=rep, warmup=25, cpu_reps=cpu_reps)
    except Exception as e:  # one broken point must not end the sweep; its row says what happened
        return point_failure(e)
    finally:
        del step
        reclaim_stop_signals()  # a compile in the step may have let LLVM take them (a stop would lose the rows)
    return dict(out, step_us=step_s * 1e6, attention_us=attn_s * 1e6, timing=timing, status="ok", reason="")


def _point_row(shape, p, batch, backend, mode, base, block_size, weights=None, pool=None) -> dict:
    """A point's row before it is timed: what was asked and planned (bytes where the weights are known)."""
    ctx, kv, plan = p["context"], p["kv_dtype"], p["plan"]
    row = dict.fromkeys(COLUMNS)
    row.update(base, model=shape.name, kv_dtype=kv, kv_format=format_name(kv),
               bytes_per_token=plan["bytes_per_token"], backend=backend, mode=mode, batch=batch, context=ctx,
               ceiling=plan["ceiling"], num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
               num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
               intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size, block_size=block_size,
               gpu_memory_gib=float(plan["gpu_memory_gib"]), utilization=plan["utilization"],
               activation_bytes=plan["activation_bytes"], status="ok", reason="")
    if weights is not None:
        by = step_bytes(shape, weights, kv, batch, ctx)
        row.update(weights=weights.source, bytes_moved=by["total"], kv_bytes=by["kv"], weight_bytes=by["weights"])
    if pool is not None:
        row.update(kv_pool_bytes=pool.nbytes)
    return row


def _failed_points(shape, plans, backend, mode, base, block_size, reason, bar, weights=None) -> list[dict]:
    """Rows of every point of ``plans``, none run: status ``error`` and ``reason``."""
    rows = []
    for p in plans:
        for b in p["batches"]:
            rows.append(dict(_point_row(shape, p, b, backend, mode, base, block_size, weights), status="error",
                             reason=reason))
            bar.update(1)
    return rows


def _measure_point(shape, w, pool, p, batch, backend, mode, dev, base, rep, cpu_reps, seed, time_call) -> dict:
    """One point's row: timed (status ``ok``), or the reason it did not run (``unsupported``: the backend refuses
    the point; ``error``: out of memory or anything else it raised; the sweep goes on either way)."""
    row = _point_row(shape, p, batch, backend, mode, base, pool.block_size, w, pool)
    got = time_step(shape, w, pool, batch, p["context"], 1, backend, mode, dev, rep, cpu_reps, seed, time_call)
    row.update({k: got[k] for k in ("backend", "mode", "logits_finite") if k in got})
    if got["status"] != "ok":
        row.update(status=got["status"], reason=got["reason"])
        return row
    step_s = got["step_us"] * 1e-6
    gbps = row["bytes_moved"] / step_s / 1e9
    copy = base["copy_gbps"]
    row.update(step_us=got["step_us"], tokens_per_s=batch / step_s, attention_us=got["attention_us"],
               attention_share=got["attention_us"] / got["step_us"], gbps=gbps, timing=got["timing"],
               pct_copy_bw=100.0 * gbps / copy if copy == copy else float("nan"))
    return row


def save(df, out_dir="results/step", meta: dict | None = None):
    """Write ``<out_dir>/<gpu-slug>/<timestamp>.csv`` and its ``.json`` (never overwriting; see
    :func:`fp8kv.results.save_table`). Returns the CSV's path."""
    return save_run(df, out_dir, "step", meta)
