"""A measured decode step: one token for each of B sequences through a whole model, at context L.

Does FP8 KV make a server faster? The kernel benchmark (:mod:`fp8kv.bench`) times attention alone;
this module times what a serving engine runs per generated token, built from a model's shapes
(:class:`fp8kv.capacity.ModelShape`):

* per layer: RMSNorm, the fused QKV projection, q/k RMSNorm where the model has it (Qwen3), RoPE,
  the write of the new token's K and V into the paged cache (``fp8kv.ops.write_cache``, the fused
  Triton kernel; ``PagedKVCache.write`` on the reference path), attention through
  :func:`fp8kv.decode`, the output projection and residual, RMSNorm, the gated MLP (SiLU) and residual;
* then the final RMSNorm and the LM head (logits for every sequence).

::

    pool = KVPool(shape, num_blocks, "fp8_e4m3", device="cuda")       # the engine's KV memory
    step = DecodeStep(shape, random_weights(shape, device="cuda"), pool.caches(batch=64, max_context=4096))
    step.set_positions(4095)           # the new token is the 4096th of every sequence
    logits = step.forward()            # [64, vocab]
    df = sweep(["Qwen3-0.6B"], [4096])  # batch 1 .. the ceiling, BF16 and FP8 KV: tidy rows

Command line: ``python -m fp8kv.step --model Qwen3-0.6B --contexts 4096`` (see :func:`main`).

Several new tokens per sequence
-------------------------------
``DecodeStep(..., q_len=k + 1)`` is the target model's verification of k draft tokens (every row through every
layer, RoPE at each token's position, the k + 1 new K/V written, attention through :func:`fp8kv.planned_attend`,
the LM head on every row); :func:`verify_sweep` times it and reads accepted tokens per second under i.i.d.
acceptance (:func:`expected_accepted`; :mod:`fp8kv.step.speculative` documents the model and the draft's cost).
:class:`ChunkedPrefill` runs a prompt in chunks of ``q_len = C``; :func:`prefill_sweep` times the time to first
token (:mod:`fp8kv.step.prefill`). ``python -m fp8kv.step --model Qwen3-8B --contexts 16384 --draft-lens 0 2 4 8
--acceptance 0.7`` and ``python -m fp8kv.step --model Qwen3-8B --prompt-lens 4096 16384 --chunks 512 2048``.

Quantized KV formats
--------------------
Beside bf16 / fp16 / FP8 pages, the KV dtype may be a format a paged cache holds token by token
(:data:`STEP_FORMATS`: ``int8_token_head``, ``int4_token_head``, ``nvfp4``, ``mxfp4``, ``e4m3_b16``, ``e4m3_b32``;
:mod:`fp8kv.step.quantized`): each layer's cache is a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache`, read
by :func:`fp8kv.ops.quant_decode.paged_decode_quantized` (Triton) or its fp32 oracle (reference), and its ceiling
is planned with the planner's bytes per token for the format (codes and scales). ``python -m fp8kv.step --model
Qwen3-8B --contexts 16384 --kv-dtypes bf16 fp8_e4m3 int8_token_head nvfp4 mxfp4``; rows carry ``kv_format`` and
``bytes_per_token``, and :func:`ceiling_table` reads tokens/s to each one's ceiling.

Weights
-------
SmolLM2-135M can run with its real weights (``fp8kv.models``, offline); every other model runs with
random bf16 weights of the right shapes. **The time of a step does not depend on the weights'
values**: every kernel reads every weight and every cached token whatever they hold. Rows say which
(``weights``). Gemma-3-270M runs with the Llama/Qwen layer structure (its GELU, extra norms and
sliding windows are not modelled); Llama 3.1's RoPE frequency scaling is not applied (it changes
values, not time).

Memory: one pool, per-layer pages
---------------------------------
As in vLLM, the KV memory is allocated once (:class:`KVPool`: K and V pages per layer, all layers
the same number of blocks) and every layer's cache shares one block table and one ``seq_lens``.
The budget is the planner's (:func:`fp8kv.capacity.plan_capacity`): GPU memory × utilization
− weights. :func:`step_ceiling` gives the largest batch B whose KV at a context and activations
(:func:`activation_bytes` at B, an upper bound of one step's transient tensors) fit in it together;
the pool is the memory left beside the activations at that ceiling. On a GPU the sweep allocates that
pool for real, so a ceiling that did not fit would fail there; off a GPU the memory is only planned
against, and the pool holds what the largest batch measured needs (:func:`pool_blocks`).

How a step is timed
-------------------
Like the kernel benchmark, with its timing helper (``fp8kv.bench.time_call``): on a GPU the whole
step is captured in a CUDA graph (``triton.testing.do_bench_cudagraph``) and the median replay is
reported; the step's attention calls alone (every layer's :func:`fp8kv.decode` on the same caches,
no other work) are timed the same way, giving ``attention_us`` and ``attention_share``. A prefill
chunk's forward (milliseconds to seconds) is captured once and timed replay by replay instead
(``fp8kv.bench.time_long_call``), a few calls a chunk rather than ~17. The copy
bandwidth is measured once in the same run (:func:`fp8kv.bench.measure_copy_bandwidth`).
``bytes_moved`` counts the weights read (the LM head once; of the embedding only the B rows looked
up), the K/V read by attention and the new token's K/V written; activations are not counted.
On CPU (the Triton interpreter or the reference) timings exercise the code and say nothing about
any GPU.

What a step leaves out
----------------------
Scheduling and batching decisions, prefill (the prompt's forward pass), sampling beyond the logits,
detokenisation, and any communication (tensor parallelism, host transfers): a step is not a
server benchmark. Every sequence of a batch holds the same context.
"""

from __future__ import annotations

from ..rope import apply_rope, rope_cos_sin, rope_inv_freq
from .cli import build_parser, main
from .layers import (
    REAL_WEIGHTS,
    LayerWeights,
    StepWeights,
    gated_mlp,
    random_weights,
    rms_norm,
    weights_from_hf,
)
from .measure import COLUMNS, check_host_memory, pool_blocks, save, sweep, sweep_runs
from .model import STEP_BACKENDS, STEP_LOGITS, DecodeStep, KVPool, greedy_decode
from .multi_report import (
    accepted_tokens_figure,
    attend_speedup,
    attend_speedup_figure,
    prefill_reading,
    prefill_summary,
    ttft_figure,
    verify_reading,
    verify_summary,
)
from .plan import (
    TOY_QWEN,
    activation_bytes,
    batch_points,
    kv_bytes_per_token,
    param_count,
    plan_sweep,
    plan_table,
    run_dtype,
    smoke_settings,
    step_bytes,
    step_ceiling,
)
from .prefill import PREFILL_COLUMNS, ChunkedPrefill, chunk_spans, prefill_sweep
from .quantized import STEP_FORMATS, STEP_KV_DTYPES
from .report import (
    attention_share_figure,
    ceiling_table,
    reading,
    reading_markdown,
    summary,
    tokens_per_s_figure,
)
from .speculative import VERIFY_COLUMNS, draft_cost_us, expected_accepted, verify_sweep

__all__ = ["LayerWeights", "StepWeights", "random_weights", "weights_from_hf", "KVPool", "DecodeStep",
           "param_count", "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "gated_mlp", "activation_bytes",
           "step_ceiling", "step_bytes", "batch_points", "greedy_decode", "plan_sweep", "plan_table", "run_dtype", "sweep", "sweep_runs",
           "save", "summary", "reading_markdown", "smoke_settings", "TOY_QWEN",
           "build_parser", "main", "reading", "tokens_per_s_figure", "attention_share_figure", "COLUMNS",
           "REAL_WEIGHTS", "STEP_BACKENDS", "pool_blocks", "check_host_memory",
           "STEP_LOGITS", "expected_accepted", "verify_sweep", "draft_cost_us", "VERIFY_COLUMNS", "ChunkedPrefill",
           "chunk_spans", "prefill_sweep", "PREFILL_COLUMNS", "verify_reading", "prefill_reading", "verify_summary",
           "prefill_summary", "accepted_tokens_figure", "ttft_figure", "attend_speedup", "attend_speedup_figure",
           "STEP_FORMATS", "STEP_KV_DTYPES", "kv_bytes_per_token", "ceiling_table"]
