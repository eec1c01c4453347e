"""Chunked prefill: a prompt of N tokens through the model in chunks of C, each chunk one forward of ``q_len = C``
new tokens per sequence over the cache that holds the chunks before it (:class:`~fp8kv.step.DecodeStep`), and
the time to first token, BF16 against FP8 KV.

Time to first token (``ttft_us``) here is the sum of the chunks' forward times, the last chunk's LM head giving the
first token's logits (``logits="last"``: only each sequence's last row goes through the LM head, as engines
compute a prefill's). It leaves out what a server adds: scheduling (chunks share steps with other sequences'
decodes in an engine), tokenisation, sampling and queueing. A chunk as long as the prompt is the single full
prefill.
"""

from __future__ import annotations

import math

import torch

from ..capacity import ModelShape
from ..checks import fail as _fail
from ..checks import flag, positive_int
from ..interrupts import reclaim_stop_signals
from ..results import utc_stamp
from ..sweeps import interruptible, machine_fields, release_memory, run_metadata
from .layers import StepWeights
from .measure import (
    check_host_memory,
    check_run_options,
    check_weights,
    load_weights,
    point_failure,
    why_failed,
)
from .model import DecodeStep, KVPool, token_ids
from .plan import kv_dtype_names, plan_sweep, run_dtype
from .quantized import check_one_token
from .speculative import many_values

PREFILL_COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton", "fp8kv_source",
    "model", "weights", "kv_dtype", "backend", "mode", "batch", "prompt", "chunk", "n_chunks",
    "ttft_us", "prefill_tokens_per_s", "attention_us", "attention_share",
    "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "gpu_memory_gib", "utilization",
    "timing", "logits_finite", "status", "reason",
]


def chunk_spans(prompt: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each chunk of a ``prompt``-token prompt in chunks of ``chunk`` (the last one
    shorter where ``chunk`` does not divide it; one chunk where ``chunk >= prompt``)."""
    prompt, chunk = positive_int(prompt, "prompt"), positive_int(chunk, "chunk")
    return [(s, min(chunk, prompt - s)) for s in range(0, prompt, chunk)]


class ChunkedPrefill:
    """The steps that prefill ``prompt`` tokens per sequence in chunks of ``chunk``: one :class:`DecodeStep`
    per distinct chunk length (``logits="last"``), all over ``caches`` (:meth:`KVPool.caches`, room for the
    prompt). :meth:`run` feeds prompt ids ``[B, prompt]`` through them and returns the last token's logits
    ``[B, vocab]``; :meth:`chunk_steps` yields each chunk's step with its positions set (for timing)."""

    def __init__(self, shape: ModelShape, weights: StepWeights, caches, prompt: int, chunk: int, *,
                 backend: str = "auto", mode: str = "auto"):
        self.spans = chunk_spans(prompt, chunk)
        self.prompt, self.chunk = prompt, chunk
        caches = list(caches)
        room = caches[0].max_blocks_per_seq * caches[0].block_size if caches else 0
        if room < prompt:
            _fail(f"prompt={prompt} tokens do not fit the caches' {room} tokens per sequence")
        self.steps = {n: DecodeStep(shape, weights, caches, backend=backend, mode=mode, q_len=n, logits="last")
                      for n in dict.fromkeys(n for _, n in self.spans)}
        first = next(iter(self.steps.values()))
        self.backend, self.mode, self.batch = first.backend, first.mode, first.batch

    def chunk_steps(self, prompt_ids: torch.Tensor):
        """For each chunk, its step with the chunk's ids and positions set: run ``forward`` (once, in order)
        to prefill; its logits after the last chunk are the first token's."""
        for start, n in self.spans:
            step = self.steps[n]
            step.input_ids.copy_(prompt_ids[:, start:start + n].reshape(-1))
            step.set_positions(start)
            yield step

    def run(self, prompt_ids) -> torch.Tensor:
        """Prefill ``prompt_ids`` (ints ``[B, prompt]``, or ``[prompt]`` for one sequence) chunk by chunk: the
        logits ``[B, vocab]`` of each sequence's last prompt token."""
        ids = self.prompt_ids(prompt_ids)
        logits = None
        for step in self.chunk_steps(ids):
            logits = step.forward()
        return logits

    def prompt_ids(self, prompt_ids) -> torch.Tensor:
        """``prompt_ids`` checked: int ``[B, prompt]`` (a ``[prompt]`` row for batch 1) on the steps' device."""
        ids = token_ids(prompt_ids, "prompt_ids", next(iter(self.steps.values())).shape.vocab_size)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.shape != (self.batch, self.prompt):
            _fail(f"prompt_ids has shape {tuple(ids.shape)} and dtype {ids.dtype}; expected ints of shape "
                  f"[{self.batch}, {self.prompt}]")
        return ids.to(next(iter(self.steps.values())).input_ids.device, torch.int64)


def prefill_sweep(models, prompt_lens, chunks, kv_dtypes=("bf16", "fp8_e4m3"), *, backend: str = "auto",
                  mode: str = "auto", gpu_memory_gib=None, utilization: float = 0.9, block_size: int = 16,
                  weights: str = "auto", device=None, dtype=None, rep: int = 50, progress: bool = True,
                  seed: int = 0, cpu_reps: int = 3, keep_partial: bool = False):
    """Time to first token of one prompt of each length in ``prompt_lens`` for each chunk size of ``chunks``
    (ints >= 1; a chunk at least the prompt is the full prefill), per KV dtype; one tidy row per (model,
    kv_dtype, prompt, chunk) (columns :data:`PREFILL_COLUMNS`). Each chunk's forward is timed where it stands (CUDA
    graph replays on a GPU: :func:`fp8kv.bench.time_long_call`) and the times summed. A prompt whose KV and chunk activations do not fit the memory planned
    against is refused before anything is built (:class:`~fp8kv.capacity.CapacityError`). Other arguments as
    :func:`fp8kv.step.sweep` (``keep_partial`` too)."""
    import pandas as pd
    from tqdm.auto import tqdm

    from ..bench import time_long_call
    from ..device import describe_device, resolve_device

    prompt_lens = many_values(prompt_lens, "prompt_lens", positive_int)
    chunks = many_values(chunks, "chunks", positive_int)
    flag(keep_partial, "keep_partial")
    check_run_options(backend=backend, mode=mode, rep=rep, cpu_reps=cpu_reps, seed=seed, progress=progress, dtype=dtype)
    dev = resolve_device(device)
    dtype = run_dtype(dev, dtype)
    # a format refused by the chunk that asked for several new tokens (the planner sees only their count)
    check_one_token(kv_dtype_names(kv_dtypes), [(f"chunks[{i}]={c}", min(c, n)) for i, c in enumerate(chunks)
                                                for n in prompt_lens], "chunks of 1")
    # One sequence per prompt: the plan of the largest chunk (the most activations) at each prompt length.
    plans = {(n, c): plan_sweep(models, [n], kv_dtypes, batches=[1], gpu_memory_gib=gpu_memory_gib,
                                utilization=utilization, block_size=block_size, device=dev, dtype=dtype,
                                q_len=min(c, n))
             for n in prompt_lens for c in chunks}
    shapes = list(dict.fromkeys(p["shape"] for group in plans.values() for p in group))
    check_weights(shapes, weights)
    check_host_memory([p for group in plans.values() for p in group], dev, dtype)
    info = describe_device(dev)
    stamp = utc_stamp()
    base = {k: v for k, v in machine_fields(stamp, info, float("nan")).items() if k in PREFILL_COLUMNS}
    rows = []
    bar = tqdm(total=sum(len(g) for g in plans.values()), disable=not progress, desc="prefill", unit="point")

    def measure():
        for shape in shapes:
            try:
                w = load_weights(shape, weights, dtype, dev, seed)
            except Exception as e:  # one model's weights must not end the sweep: its rows say why
                w, reason = None, f"loading the weights: {why_failed(e)}"
            for (n, c), group in plans.items():
                for p in (p for p in group if p["shape"] is shape):
                    row = dict.fromkeys(PREFILL_COLUMNS)
                    row.update(base, model=shape.name, kv_dtype=p["kv_dtype"], backend=backend, mode=mode, batch=1,
                               prompt=n, chunk=c, n_chunks=math.ceil(n / c), num_layers=shape.num_layers,
                               num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                               block_size=block_size, gpu_memory_gib=float(p["plan"]["gpu_memory_gib"]),
                               utilization=utilization, status="ok", reason="")
                    bar.set_postfix_str(f"{shape.name} {p['kv_dtype']} prompt={n} chunk={c}")
                    if w is None:
                        row.update(status="error", reason=reason)
                    else:
                        row.update(weights=w.source, **_time_prefill(shape, w, p["kv_dtype"], n, c, backend, mode,
                                                                      block_size, dev, rep, cpu_reps, seed, time_long_call))
                    rows.append(row)
                    reclaim_stop_signals()  # the chunks' compiles may have let LLVM take them
                    bar.update(1)
                    release_memory(dev)
            del w
            release_memory(dev)

    interrupted = interruptible(measure, keep_partial=keep_partial, dev=dev)
    bar.close()
    df = pd.DataFrame(rows, columns=PREFILL_COLUMNS)
    df.attrs["step"] = run_metadata(stamp, info, None, {"rep": rep, "backend": backend, "mode": mode,
                                                        "utilization": utilization, "block_size": block_size,
                                                        "weights": weights, "dtype": str(dtype), "kind": "prefill"},
                                    interrupted=interrupted)
    return df


def _time_prefill(shape, w, kv, prompt, chunk, backend, mode, block_size, dev, rep, cpu_reps, seed,
                  time_long_call) -> dict:
    """One (prompt, chunk) point: every chunk's forward run in order, each timed where it stands; the sums."""

    pre = pool = None
    try:
        pool = KVPool(shape, math.ceil(prompt / block_size), kv, block_size=block_size, device=dev)
        pre = ChunkedPrefill(shape, w, pool.caches(1, prompt, seed), prompt, chunk, backend=backend, mode=mode)
        out = {"backend": pre.backend, "mode": pre.mode}
        ids = (torch.arange(prompt, device=dev) % shape.vocab_size)[None]
        graph = pre.backend != "reference"
        total = attn = 0.0
        timing = None
        for step in pre.chunk_steps(ids):
            logits = step.forward()  # writes the chunk: the next chunk attends over it
            s, timing = time_long_call(step.forward, dev, graph=graph, rep=rep, cpu_reps=cpu_reps)
            a, _ = time_long_call(step.attention_only, dev, graph=graph, rep=rep, cpu_reps=cpu_reps)
            total, attn = total + s, attn + a
        out["logits_finite"] = bool(torch.isfinite(logits).all())
    except Exception as e:  # one broken point must not end the sweep; its row says what happened
        return point_failure(e)
    finally:
        del pre, pool
    return dict(out, ttft_us=total * 1e6, prefill_tokens_per_s=prompt / total, attention_us=attn * 1e6,
                attention_share=attn / total, timing=timing)
