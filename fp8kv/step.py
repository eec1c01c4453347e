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
The pool's size is the planner's (:func:`fp8kv.capacity.plan_capacity`): GPU memory × utilization
− weights − activations (:func:`activation_bytes`, an upper bound of one step's transient tensors).
:func:`step_ceiling` gives the largest batch whose KV fits at a context; the sweep allocates that pool
for real, so a ceiling that did not fit would fail there.

How a step is timed
-------------------
Like the kernel benchmark, with its timing helper (``fp8kv.bench.time_call``): on a GPU the whole
step is captured in a CUDA graph (``triton.testing.do_bench_cudagraph``) and the median replay is
reported; the step's attention calls alone (every layer's :func:`fp8kv.decode` on the same caches,
no other work) are timed the same way, giving ``attention_us`` and ``attention_share``. The copy
bandwidth is measured once in the same run (:func:`fp8kv.device.measure_copy_bandwidth`).
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

import argparse
import gc
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from .cache import PagedKVCache
from .capability import UnsupportedError, check, choose_backend, choose_mode, interpreter_on
from .capacity import GIB, CapacityError, ModelShape, get_model, plan_capacity
from .formats import kv_dtype_info

__all__ = ["LayerWeights", "StepWeights", "random_weights", "weights_from_hf", "KVPool", "DecodeStep",
           "param_count", "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "gated_mlp", "activation_bytes",
           "step_ceiling", "step_bytes", "batch_points", "greedy_decode", "sweep", "save", "build_parser",
           "main", "reading", "tokens_per_s_figure", "attention_share_figure", "COLUMNS", "SERIES_COLORS",
           "REAL_WEIGHTS"]

# Registry models whose real weights fp8kv loads offline (fp8kv.models) -> their fp8kv.models name.
REAL_WEIGHTS = {"SmolLM2-135M": "smollm2-135m"}
STEP_BACKENDS = ("auto", "triton", "reference")

COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton",
    "model", "weights", "kv_dtype", "backend", "mode", "batch", "context", "ceiling",
    "step_us", "tokens_per_s", "attention_us", "attention_share",
    "bytes_moved", "kv_bytes", "weight_bytes", "gbps", "copy_gbps", "pct_copy_bw",
    "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "vocab_size",
    "block_size", "gpu_memory_gib", "utilization", "kv_pool_bytes", "activation_bytes",
    "timing", "logits_finite", "status", "reason",
]


def _fail(msg: str, exc=ValueError):
    raise exc(msg)


def _require_step_shape(shape: ModelShape) -> ModelShape:
    """The ModelShape fields a decode step needs, present (a registry entry has them all)."""
    if not isinstance(shape, ModelShape):
        _fail(f"shape must be a fp8kv.capacity.ModelShape, got {type(shape).__name__}", TypeError)
    missing = [f for f in ("hidden_size", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps")
               if getattr(shape, f) is None]
    if missing:
        _fail(f"ModelShape {shape.name!r} lacks {missing}; a decode step needs them (fill them from the "
              "model's config.json)")
    if shape.head_dim % 2:
        _fail(f"ModelShape {shape.name!r}: head_dim={shape.head_dim} is odd; RoPE rotates pairs of channels")
    return shape


# ------------------------------------------------------------------------------------------ pieces
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as Llama/Qwen compute it: in fp32, cast back, then × weight.

    x: ``[..., N]`` any float dtype; weight: ``[N]``. Returns x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` inverse frequencies ``theta ** (-2i / head_dim)`` (the Hugging Face formula)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return (1.0 / (theta ** exps)).to(device)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos, sin ``[B, D]`` (``dtype``) of int positions ``[B]``; the two halves repeat (rotate-half RoPE)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, D]`` by position: channel i pairs with i + D/2 (Llama / Qwen layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the gate and up projections fused: gate_up ``[2I, H]``, down ``[H, I]``."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


# ----------------------------------------------------------------------------------------- weights
@dataclass
class LayerWeights:
    """One decoder layer (H hidden, I intermediate, Hq/Hkv heads of D), all in the model's dtype.

    input_norm ``[H]``; qkv ``[(Hq + 2 Hkv) D, H]`` (q, k, v rows in that order); q_norm, k_norm
    ``[D]`` or None; o ``[H, Hq D]``; post_norm ``[H]``; gate_up ``[2I, H]`` (gate rows first); down ``[H, I]``.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o, self.post_norm,
                            self.gate_up, self.down) if t is not None]


@dataclass
class StepWeights:
    """A model's weights in the step's layout: embed ``[V, H]``, layers, final_norm ``[H]``, lm_head
    ``[V, H]`` (the embed tensor itself when tied). ``source``: ``"random"`` or where they came from."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    source: str

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.final_norm] + [t for layer in self.layers for t in layer.tensors()]
        return out if self.lm_head is self.embed else out + [self.lm_head]

    @property
    def nbytes(self) -> int:
        """Bytes of every stored weight, tied embeddings once."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def random_weights(shape: ModelShape, dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0) -> StepWeights:
    """Random weights of ``shape`` (N(0, 1/fan_in) projections, N(0, 1) embeddings, unit norms).

    The scale keeps activations O(1) through the layers, so K and V fit an FP8 cache with a scale of
    1.0 (the engines' default) and the logits stay finite. Time does not depend on the values.
    """
    from .device import resolve_device

    shape = _require_step_shape(shape)
    dev = resolve_device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    h, d, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    hq, hkv = shape.num_q_heads, shape.num_kv_heads

    def proj(out_f, in_f):
        return (torch.randn(out_f, in_f, generator=g, device=dev, dtype=dtype) / math.sqrt(in_f))

    def ones(n):
        return torch.ones(n, device=dev, dtype=dtype)

    layers = [LayerWeights(ones(h), proj((hq + 2 * hkv) * d, h), ones(d) if shape.qk_norm else None,
                           ones(d) if shape.qk_norm else None, proj(h, hq * d), ones(h), proj(2 * inter, h),
                           proj(h, inter))
              for _ in range(shape.num_layers)]
    embed = torch.randn(shape.vocab_size, h, generator=g, device=dev, dtype=dtype)
    lm_head = embed if shape.tie_word_embeddings else proj(shape.vocab_size, h)
    return StepWeights(embed, layers, ones(h), lm_head, "random")


def _config_value(config, key):
    value = getattr(config, key, None)
    if value is None and key == "rope_theta":  # transformers 5 keeps it under rope_parameters
        value = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return value


def weights_from_hf(model, shape: ModelShape | None = None, dtype: torch.dtype | None = None,
                    device=None) -> StepWeights:
    """The weights of a Llama / Qwen3 causal LM from transformers (``fp8kv.models.load_model``),
    copied into the step's fused layout (QKV and gate/up concatenated, as engines store them).

    ``shape`` (default: the registry entry of ``model.fp8kv_name``'s model) is checked against the
    model's config, so the step cannot silently run a different architecture.
    """
    from .device import resolve_device

    cfg = model.config
    if shape is None:
        names = {v: k for k, v in REAL_WEIGHTS.items()}
        name = getattr(model, "fp8kv_name", None)
        if name not in names:
            _fail(f"model {name!r} has no registry shape; pass shape= (known: {sorted(names)})")
        shape = get_model(names[name])
    shape = _require_step_shape(shape)
    facts = {"num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_q_heads,
             "num_key_value_heads": shape.num_kv_heads, "hidden_size": shape.hidden_size,
             "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
             "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps}
    # GGUF files store rope_theta and the eps as fp32: compare floats to fp32 precision.
    wrong = {k: (_config_value(cfg, k), v) for k, v in facts.items()
             if not (_config_value(cfg, k) == v or isinstance(v, float) and isinstance(_config_value(cfg, k), float)
                     and math.isclose(_config_value(cfg, k), v, rel_tol=2**-23))}
    if wrong:
        _fail(f"model config disagrees with ModelShape {shape.name!r} on {{key: (config, shape)}} {wrong}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _fail(f"hidden_act={cfg.hidden_act!r}; the step's MLP is SiLU-gated")
    scaling = getattr(cfg, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        _fail(f"rope_scaling={scaling!r}; the step applies unscaled RoPE frequencies")
    dtype = dtype or next(model.parameters()).dtype
    dev = resolve_device(device) if device is not None else next(model.parameters()).device

    def w(t):
        return t.detach().to(device=dev, dtype=dtype).contiguous()

    layers = []
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        if any(getattr(m, "bias", None) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            _fail("the attention projections carry biases; the step's projections have none")
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (qn is not None) != shape.qk_norm:
            _fail(f"model {'has' if qn is not None else 'lacks'} q/k norms but ModelShape.qk_norm={shape.qk_norm}")
        layers.append(LayerWeights(
            w(block.input_layernorm.weight),
            w(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
            w(qn.weight) if qn is not None else None, w(kn.weight) if kn is not None else None,
            w(attn.o_proj.weight), w(block.post_attention_layernorm.weight),
            w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])), w(mlp.down_proj.weight)))
    embed = w(model.model.embed_tokens.weight)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    lm_head = embed if tied else w(model.lm_head.weight)
    return StepWeights(embed, layers, w(model.model.norm.weight), lm_head,
                       f"real ({getattr(model, 'fp8kv_name', type(model).__name__)})")


# -------------------------------------------------------------------------------------------- KV pool
class KVPool:
    """The KV memory of an engine, allocated once: K and V pages ``[num_blocks, block_size, Hkv, D]``
    per layer (``kv_dtype``), zero-filled, with per-layer per-tensor scales (FP8; default 1.0, the
    engines' value when a checkpoint carries none). :meth:`caches` hands out per-layer caches over
    a batch that share one block table and one ``seq_lens``, as every layer of an engine does."""

    def __init__(self, shape: ModelShape, num_blocks: int, kv_dtype: str = "fp8_e4m3", *, block_size: int = 16,
                 device=None, k_scales=1.0, v_scales=1.0):
        from .checks import positive_int
        from .device import resolve_device

        self.shape = shape
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.kv_dtype, self.dtype, fmt = kv_dtype_info(kv_dtype)
        self.block_size = positive_int(block_size, "block_size")
        self.device = resolve_device(device)
        n = shape.num_layers
        ks = list(k_scales) if isinstance(k_scales, (list, tuple)) else [k_scales] * n
        vs = list(v_scales) if isinstance(v_scales, (list, tuple)) else [v_scales] * n
        if len(ks) != n or len(vs) != n:
            _fail(f"k_scales/v_scales have {len(ks)}/{len(vs)} entries; expected one per layer ({n})")
        self.k_scales, self.v_scales = (ks, vs) if fmt is not None else ([None] * n, [None] * n)
        page = (self.num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim)
        self.pages = [(torch.zeros(page, dtype=self.dtype, device=self.device),
                       torch.zeros(page, dtype=self.dtype, device=self.device)) for _ in range(n)]

    @property
    def nbytes(self) -> int:
        k, _ = self.pages[0]
        return 2 * len(self.pages) * k.numel() * k.element_size()

    def blocks_per_seq(self, max_context: int) -> int:
        return math.ceil(max_context / self.block_size)

    def max_batch(self, max_context: int) -> int:
        """Sequences of ``max_context`` tokens the pool holds."""
        return self.num_blocks // self.blocks_per_seq(max_context)

    def caches(self, batch: int, max_context: int, seed: int = 0) -> list[PagedKVCache]:
        """Per-layer caches of ``batch`` empty sequences with room for ``max_context`` tokens each,
        their blocks drawn at random from the pool (as an allocator leaves them)."""
        from .checks import positive_int

        batch, max_context = positive_int(batch, "batch"), positive_int(max_context, "max_context")
        bpseq = self.blocks_per_seq(max_context)
        if batch * bpseq > self.num_blocks:
            _fail(f"batch={batch} sequences of {max_context} tokens need {batch * bpseq} blocks; the pool holds "
                  f"{self.num_blocks} (at most {self.max_batch(max_context)} such sequences)")
        perm = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(seed))[:batch * bpseq]
        table = perm.to(torch.int32).reshape(batch, bpseq).to(self.device)
        seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        return [PagedKVCache(k, v, table, seq_lens, self.kv_dtype, "tensor", ks, vs)
                for (k, v), ks, vs in zip(self.pages, self.k_scales, self.v_scales, strict=True)]


# ------------------------------------------------------------------------------------------- the step
class DecodeStep:
    """One decode step of a dense decoder over per-layer paged caches (see the module docstring).

    Parameters
    ----------
    shape : the model's :class:`~fp8kv.capacity.ModelShape` (hidden, intermediate and vocabulary sizes set).
    weights : :class:`StepWeights` of that shape.
    caches : one :class:`~fp8kv.cache.PagedKVCache` per layer, sharing one block table and ``seq_lens``
        (:meth:`KVPool.caches`).
    backend : ``"auto"`` (Triton on a GPU, else the reference), ``"triton"`` or ``"reference"``.
        FlashInfer plans on the host at every :func:`fp8kv.decode` call, which a CUDA graph cannot hold.
    mode : ``"auto"``, ``"dequant"`` or ``"fp8"`` (:func:`fp8kv.decode`'s).

    Inputs live in fixed buffers (graph replays read them): ``input_ids`` ``[B]`` int64 and, set by
    :meth:`set_positions`, ``positions`` / ``slot_mapping`` ``[B]`` int64 and the caches' ``seq_lens``.
    :meth:`forward` returns logits ``[B, vocab]`` in the weights' dtype.
    """

    def __init__(self, shape: ModelShape, weights: StepWeights, caches: Sequence[PagedKVCache], *,
                 backend: str = "auto", mode: str = "auto"):
        self.shape = _require_step_shape(shape)
        if not isinstance(weights, StepWeights):
            _fail(f"weights must be StepWeights (random_weights / weights_from_hf), got {type(weights).__name__}",
                  TypeError)
        caches = list(caches)
        if len(caches) != shape.num_layers or len(weights.layers) != shape.num_layers:
            _fail(f"{shape.name} has {shape.num_layers} layers; got {len(caches)} caches and "
                  f"{len(weights.layers)} layers of weights")
        first = caches[0]
        for i, c in enumerate(caches):
            if not isinstance(c, PagedKVCache):
                _fail(f"caches[{i}] is a {type(c).__name__}; expected PagedKVCache", TypeError)
            if (c.num_kv_heads, c.head_dim) != (shape.num_kv_heads, shape.head_dim):
                _fail(f"caches[{i}] holds Hkv={c.num_kv_heads}, D={c.head_dim}; {shape.name} has "
                      f"Hkv={shape.num_kv_heads}, D={shape.head_dim}")
            if c.block_table is not first.block_table or c.seq_lens is not first.seq_lens:
                _fail(f"caches[{i}] has its own block table / seq_lens; every layer must share the first's "
                      "(build them with KVPool.caches)")
            if c.device != weights.device:
                _fail(f"caches[{i}] is on {c.device} but the weights are on {weights.device}")
        if backend not in STEP_BACKENDS:
            _fail(f"backend={backend!r}; expected one of {STEP_BACKENDS} (FlashInfer plans on the host at every "
                  "call, which the step's CUDA graph cannot hold)")
        if mode not in ("auto", "dequant", "fp8"):
            _fail(f"mode={mode!r}; expected 'auto', 'dequant' or 'fp8'")
        if backend == "auto":
            backend = choose_backend(first.kv_dtype, "dequant" if mode == "auto" else mode, None, "tensor",
                                     shape.head_dim)
            if backend not in STEP_BACKENDS:
                backend = "reference"
        if mode == "auto":
            mode = choose_mode(backend, first.kv_dtype, None, first.granularity)
        ok, why = check(backend, first.kv_dtype, mode, None, first.granularity, shape.head_dim)
        if not ok:
            raise UnsupportedError(f"backend={backend}, mode={mode}, kv_dtype={first.kv_dtype}: {why}")
        self.weights, self.caches, self.backend, self.mode = weights, caches, backend, mode
        self.kv_dtype = first.kv_dtype
        dev, dtype = weights.device, weights.dtype
        # The kernels take 16-bit queries: an fp32 model (CPU) hands them fp16 (bf16 arithmetic is
        # wrong in Triton's interpreter) and bf16 on a GPU; the reference takes the model's dtype.
        if dtype in (torch.float16, torch.bfloat16) or backend == "reference":
            self.q_dtype = dtype
        else:
            self.q_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
        self.sm_scale = 1.0 / math.sqrt(shape.head_dim)
        self.inv_freq = rope_inv_freq(shape.head_dim, shape.rope_theta, dev)
        b = first.batch_size
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(b, dtype=torch.int64, device=dev)
        # A fixed query for timing attention alone (values do not change its time).
        g = torch.Generator(device=dev).manual_seed(0)
        self.probe_q = torch.randn(b, shape.num_q_heads, shape.head_dim, generator=g, device=dev).to(self.q_dtype)

    @property
    def batch(self) -> int:
        return self.caches[0].batch_size

    @property
    def block_table(self) -> torch.Tensor:
        return self.caches[0].block_table

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.caches[0].seq_lens

    def set_positions(self, positions) -> None:
        """Place the next token of every sequence at ``positions`` (an int for all, or ``[B]`` ints):
        ``seq_lens = positions + 1`` and the slots it is written to. Host-side, between steps."""
        cap = self.caches[0].max_blocks_per_seq * self.caches[0].block_size
        pos = torch.as_tensor(positions, dtype=torch.int64).cpu()
        if pos.ndim == 0:
            pos = pos.expand(self.batch)
        if pos.shape != (self.batch,):
            _fail(f"positions has shape {tuple(pos.shape)}; expected an int or [{self.batch}] ints")
        if (pos < 0).any() or (pos >= cap).any():
            _fail(f"positions {pos.tolist()[:8]} outside [0, {cap}): the caches hold {cap} tokens per sequence")
        pos = pos.to(self.positions.device)
        bs = self.caches[0].block_size
        blocks = self.block_table.to(torch.int64).gather(1, (pos // bs)[:, None])[:, 0]
        self.positions.copy_(pos)
        self.slot_mapping.copy_(blocks * bs + pos % bs)
        self.seq_lens.copy_((pos + 1).to(torch.int32))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[B, Hq, D]`` over layer ``layer``'s cache through :func:`fp8kv.decode`:
        out ``[B, Hq, D]`` (the backend's dtype)."""
        from .backends import decode

        # The step builds its own tables and checks positions in set_positions: the content checks
        # (a host sync) would break the CUDA-graph capture.
        return decode(q.to(self.q_dtype), self.caches[layer], backend=self.backend, mode=self.mode,
                      sm_scale=self.sm_scale, check=False)[0]

    def _write(self, cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.backend == "reference":
            cache.write(k, v, self.slot_mapping)
        else:
            from .ops import write_cache

            write_cache(cache, k, v, self.slot_mapping, count_saturated=False, check=False)  # no host sync

    def forward(self) -> torch.Tensor:
        """The step: logits ``[B, vocab]`` of the tokens in ``input_ids`` at ``positions``."""
        s, w = self.shape, self.weights
        b, hq, hkv, d, eps = self.batch, s.num_q_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        lin = torch.nn.functional.linear
        cos, sin = rope_cos_sin(self.positions, self.inv_freq, w.dtype)
        x = w.embed[self.input_ids]
        for layer, (lw, cache) in enumerate(zip(w.layers, self.caches, strict=True)):
            qkv = lin(rms_norm(x, lw.input_norm, eps), lw.qkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.reshape(b, hkv, d)
            if lw.q_norm is not None:
                q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self._write(cache, k, v)
            attn = self.attend(layer, q).to(w.dtype)
            x = x + lin(attn.reshape(b, hq * d), lw.o)
            x = x + gated_mlp(rms_norm(x, lw.post_norm, eps), lw.gate_up, lw.down)
        return lin(rms_norm(x, w.final_norm, eps), w.lm_head)

    def attention_only(self) -> None:
        """Every layer's attention call of :meth:`forward`, on the same caches, and nothing else (for timing)."""
        for layer in range(len(self.caches)):
            self.attend(layer, self.probe_q)


# ---------------------------------------------------------------------------------- memory and bytes
def _elem(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def param_count(shape: ModelShape) -> int:
    """Parameters of the step's weights for ``shape`` (tied embeddings once): what
    :func:`random_weights` allocates, and the planner's weight count where the shape has no ``num_params``."""
    s = _require_step_shape(shape)
    h, d = s.hidden_size, s.head_dim
    per_layer = (2 * h + (s.num_q_heads + 2 * s.num_kv_heads) * d * h + (2 * d if s.qk_norm else 0)
                 + h * s.num_q_heads * d + 3 * h * s.intermediate_size)
    return s.vocab_size * h * (1 if s.tie_word_embeddings else 2) + s.num_layers * per_layer + h


def activation_bytes(shape: ModelShape, batch: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132) -> int:
    """Upper bound of one step's transient device bytes at ``batch`` (what an engine's profiling run
    reserves beside the KV cache): the residual stream and its norm (×3), the QKV output, the attention
    output (×2), the MLP's gate/up output and product (3 × I), the logits, and the split-KV partials
    of the Triton kernel (fp32, at most ``8 × num_sms`` split programs beyond one per sequence-head)."""
    s = _require_step_shape(shape)
    per_seq = (3 * s.hidden_size + (s.num_q_heads + 2 * s.num_kv_heads) * s.head_dim
               + 2 * s.num_q_heads * s.head_dim + 3 * s.intermediate_size + s.vocab_size)
    group = s.num_q_heads // s.num_kv_heads
    partials = (8 * num_sms + batch * s.num_kv_heads) * group * (s.head_dim + 1) * 4
    return batch * per_seq * _elem(dtype) + partials


def step_ceiling(shape: ModelShape, kv_dtype: str, context: int, *, gpu_memory_gib, utilization: float = 0.9,
                 block_size: int = 16, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132) -> dict:
    """The largest batch of ``context``-token sequences whose KV fits, with the planner's accounting.

    KV budget = ``gpu_memory_gib × utilization − weights`` (:func:`fp8kv.capacity.plan_capacity`) minus
    :func:`activation_bytes` at the batch that budget would allow (an upper bound, since the ceiling is
    lower). Returns the plan of that KV memory (``plan_capacity(kv_memory_gib=...)``) plus ``ceiling``
    (= blocks // blocks per sequence), ``activation_bytes``, ``weights_bytes``, ``gpu_memory_gib``,
    ``utilization`` and ``context``. Raises :class:`~fp8kv.capacity.CapacityError` when nothing fits.
    """
    from .checks import positive_int

    shape = _require_step_shape(shape)
    context = positive_int(context, "context")
    weights_gib = None if shape.num_params is not None else param_count(shape) * _elem(dtype) / GIB
    base = plan_capacity(shape, kv_dtype, gpu_memory_gib=gpu_memory_gib, utilization=utilization,
                         block_size=block_size, max_model_len=context, weights_gib=weights_gib)
    bpseq = math.ceil(context / block_size)
    act = activation_bytes(shape, max(1, base["blocks"] // bpseq), dtype, num_sms)
    if act >= base["kv_budget_bytes"]:
        raise CapacityError(f"{shape.name}: activations ({act / GIB:.3f} GiB) leave no KV memory of the "
                            f"{base['kv_budget_bytes'] / GIB:.3f} GiB after the weights")
    plan = plan_capacity(shape, kv_dtype, kv_memory_gib=(base["kv_budget_bytes"] - act) / GIB,
                         block_size=block_size, max_model_len=context)
    ceiling = plan["blocks"] // bpseq
    if ceiling < 1:
        raise CapacityError(f"{shape.name} with {plan['kv_dtype']} KV: {plan['blocks']} blocks hold no sequence of "
                            f"{context} tokens ({bpseq} blocks)")
    return dict(plan, ceiling=ceiling, activation_bytes=act, weights_bytes=base["weights_bytes"],
                gpu=base["gpu"], gpu_memory_gib=base["gpu_memory_gib"], utilization=utilization, context=context)


def step_bytes(shape: ModelShape, weights: StepWeights, kv_dtype: str, batch: int, context: int) -> dict:
    """Useful bytes of one step (ints): ``weights`` read (all layers, final norm, LM head; of the
    embedding only the B rows looked up unless it is the LM head), ``kv`` read by attention (B ×
    context tokens per layer, K and V) plus the new token's K/V written; ``total``."""
    elem = _elem(weights.dtype)
    layer_bytes = sum(t.numel() * t.element_size() for lw in weights.layers for t in lw.tensors())
    head = weights.lm_head.numel() * weights.lm_head.element_size()
    embed = 0 if weights.lm_head is weights.embed else batch * shape.hidden_size * elem
    w = layer_bytes + weights.final_norm.numel() * elem + head + embed
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * _elem(kv_dtype_info(kv_dtype)[1])
    kv = batch * (context + 1) * per_token
    return {"weights": w, "kv": kv, "total": w + kv}


def batch_points(ceilings: Sequence[int], ceiling: int, base: int = 4) -> list[int]:
    """Batches to measure for a KV dtype whose ceiling is ``ceiling``: powers of ``base`` below it, every
    ceiling of ``ceilings`` it reaches (so each dtype is also measured at the others' ceilings), and its own."""
    pts = {1, ceiling}
    p = base
    while p < ceiling:
        pts.add(p)
        p *= base
    pts.update(c for c in ceilings if 1 <= c <= ceiling)
    return sorted(pts)


# --------------------------------------------------------------------------------------- greedy decode
@torch.no_grad()
def greedy_decode(step: DecodeStep, prompt_ids, n_new: int) -> list[int]:
    """Feed ``prompt_ids`` (int ``[T]``) through ``step`` one token at a time (batch 1), then generate
    ``n_new`` tokens greedily; returns them. Each step writes its token's K/V and attends over the
    sequence so far, so this is the decode loop of :func:`fp8kv.models.greedy_decode_paged` with the
    prompt fed token by token instead of in one prefill pass."""
    from .checks import positive_int

    n_new = positive_int(n_new, "n_new")
    if step.batch != 1:
        _fail(f"greedy_decode runs one sequence; the step has batch {step.batch}")
    prompt = torch.as_tensor(prompt_ids).reshape(-1).tolist()
    if not prompt:
        _fail("prompt_ids is empty; give at least one token")
    tokens: list[int] = []
    feed = list(prompt)
    pos = 0
    while len(tokens) < n_new:
        step.input_ids.fill_(feed.pop(0))
        step.set_positions(pos)
        logits = step.forward()
        pos += 1
        if not feed:  # the prompt is in: the step's output is the next token
            tokens.append(int(logits[0].float().argmax()))
            feed.append(tokens[-1])
    return tokens


# ------------------------------------------------------------------------------------------------ sweep
def _load_weights(shape: ModelShape, weights: str, dtype, dev, seed: int) -> StepWeights:
    if weights not in ("auto", "real", "random"):
        _fail(f"weights={weights!r}; expected 'auto', 'real' or 'random'")
    if weights != "random" and shape.name in REAL_WEIGHTS:
        try:
            from .models import load_model

            model, _ = load_model(REAL_WEIGHTS[shape.name], dtype=dtype, device=dev)
            out = weights_from_hf(model, shape)
            del model
            return out
        except ImportError as e:
            if weights == "real":
                raise
            print(f"{shape.name}: real weights unavailable ({e}); random weights of the same shapes",
                  file=sys.stderr)
    elif weights == "real":
        _fail(f"weights='real': fp8kv loads real weights only for {sorted(REAL_WEIGHTS)}, not {shape.name}")
    return random_weights(shape, dtype, dev, seed)


def _num_sms(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def _gpu_memory(gpu_memory_gib, dev):
    if gpu_memory_gib is not None:
        return gpu_memory_gib
    if dev.type != "cuda":
        _fail("gpu_memory_gib is required on CPU: the GiB (or a GPU name such as 'H200') to plan against")
    return torch.cuda.mem_get_info(dev)[1] / GIB


def plan_sweep(models, contexts, kv_dtypes=("bf16", "fp8_e4m3"), *, batches=None, gpu_memory_gib=None,
               utilization: float = 0.9, block_size: int = 16, device=None, dtype=None) -> list[dict]:
    """What :func:`sweep` will measure, without building anything: one dict per (model, context, kv_dtype)
    with ``shape``, ``ceiling`` (the :func:`step_ceiling` plan) and ``batches``. Explicit ``batches`` over a
    ceiling are refused (ValueError naming the ceiling); by default :func:`batch_points`. ``dtype``
    (of the activations, default bf16) and ``device`` (its SM count) enter the activation estimate."""
    from .capability import KV_DTYPES
    from .checks import many_of, positive_int
    from .device import resolve_device

    dev = resolve_device(device)
    dtype = dtype or torch.bfloat16  # the activations of a GPU run
    shapes = [m if isinstance(m, ModelShape) else get_model(m) for m in ([models] if isinstance(models, (str, ModelShape))
                                                                           else list(models))]
    contexts = [positive_int(c, "contexts") for c in ([contexts] if isinstance(contexts, int) else contexts)]
    kv_dtypes = many_of(kv_dtypes, "kv_dtypes", KV_DTYPES)
    if batches is not None:
        batches = [positive_int(b, "batches") for b in ([batches] if isinstance(batches, int) else batches)]
    mem = _gpu_memory(gpu_memory_gib, dev)
    plans = []
    for shape in shapes:
        for ctx in contexts:
            ceil = {kv: step_ceiling(shape, kv, ctx, gpu_memory_gib=mem, utilization=utilization,
                                     block_size=block_size, dtype=dtype, num_sms=_num_sms(dev)) for kv in kv_dtypes}
            for kv in kv_dtypes:
                c = ceil[kv]["ceiling"]
                if batches is not None:
                    over = [b for b in batches if b > c]
                    if over:
                        _fail(f"batches {over} exceed the ceiling of {c} sequences for {shape.name} with {kv} KV at "
                              f"context {ctx} ({ceil[kv]['kv_memory_bytes'] / GIB:.2f} GiB of KV memory after "
                              f"weights and activations, of {float(ceil[kv]['gpu_memory_gib']):.1f} GiB × "
                              f"{utilization})")
                    pts = sorted(set(batches))
                else:
                    pts = batch_points([x["ceiling"] for x in ceil.values()], c)
                plans.append(dict(shape=shape, context=ctx, kv_dtype=kv, plan=ceil[kv], batches=pts))
    return plans


def sweep(models, contexts, kv_dtypes=("bf16", "fp8_e4m3"), *, batches=None, backend: str = "auto",
          mode: str = "auto", gpu_memory_gib=None, utilization: float = 0.9, block_size: int = 16,
          weights: str = "auto", device=None, dtype=None, rep: int = 50, copy_bandwidth=None,
          progress: bool = True, seed: int = 0, cpu_reps: int = 3):
    """Time the decode step from batch 1 to each KV dtype's ceiling; one tidy row per (model, context,
    kv_dtype, batch) (columns :data:`COLUMNS`).

    Parameters
    ----------
    models : registry names (``fp8kv.capacity.MODELS``) or ModelShapes with the step's fields.
    contexts : tokens per sequence, the new one included.
    batches : explicit batch sizes (each must fit every KV dtype's ceiling), else :func:`batch_points`.
    gpu_memory_gib : GiB or a GPU name to plan against; default this GPU's total (required on CPU).
    weights : ``"auto"`` (real where fp8kv loads them, else random), ``"real"`` or ``"random"``.
    dtype : weights and activations; default bf16 on a GPU, fp32 on CPU.
    rep : CUDA: milliseconds of graph replays per timing (``triton.testing.do_bench_cudagraph``).
    copy_bandwidth : None (measure now), False (skip), GB/s, or a ``measure_copy_bandwidth`` dict.

    Per (model, KV dtype) one :class:`KVPool` as large as the planner allows is allocated, and every
    batch draws its sequences from it.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    from .bench.measure import resolve_copy_bandwidth, time_call
    from .device import describe_device, resolve_device

    dev = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    plans = plan_sweep(models, contexts, kv_dtypes, batches=batches, gpu_memory_gib=gpu_memory_gib,
                       utilization=utilization, block_size=block_size, device=dev, dtype=dtype)
    copy_gbps, copy_info = resolve_copy_bandwidth(copy_bandwidth, dev)
    info = describe_device(dev)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    base = {"timestamp": stamp, "gpu": info["name"], "gpu_slug": info["slug"], "arch": info["arch"],
            "device": info["device"], "torch": info["torch"], "triton": info["triton"], "copy_gbps": copy_gbps}
    rows = []
    bar = tqdm(total=sum(len(p["batches"]) for p in plans), disable=not progress, desc="step", unit="point")
    for shape in dict.fromkeys(p["shape"] for p in plans):
        w = _load_weights(shape, weights, dtype, dev, seed)
        mine = [p for p in plans if p["shape"] is shape]
        for kv in dict.fromkeys(p["kv_dtype"] for p in mine):
            group = [p for p in mine if p["kv_dtype"] == kv]
            pool = KVPool(shape, max(p["plan"]["blocks"] for p in group), kv, block_size=block_size, device=dev)
            for p in group:
                for b in p["batches"]:
                    bar.set_postfix_str(f"{shape.name} {kv} ctx={p['context']} B={b}")
                    rows.append(_measure_point(shape, w, pool, p, b, backend, mode, dev, base, rep, cpu_reps,
                                               seed, time_call))
                    bar.update(1)
            del pool
            _free(dev)
        del w
        _free(dev)
    bar.close()
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["step"] = {"timestamp": stamp, "device": info, "copy_bandwidth": copy_info,
                        "settings": {"rep": rep, "backend": backend, "mode": mode, "utilization": utilization,
                                     "block_size": block_size, "weights": weights, "dtype": str(dtype)}}
    return df


def _free(dev):
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _measure_point(shape, w, pool, p, batch, backend, mode, dev, base, rep, cpu_reps, seed, time_call) -> dict:
    ctx, kv, plan = p["context"], p["kv_dtype"], p["plan"]
    by = step_bytes(shape, w, kv, batch, ctx)
    row = dict.fromkeys(COLUMNS)
    row.update(base, model=shape.name, weights=w.source, kv_dtype=kv, backend=backend, mode=mode, batch=batch,
               context=ctx, ceiling=plan["ceiling"], bytes_moved=by["total"], kv_bytes=by["kv"],
               weight_bytes=by["weights"], num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
               num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, hidden_size=shape.hidden_size,
               intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size, block_size=pool.block_size,
               gpu_memory_gib=float(plan["gpu_memory_gib"]), utilization=plan["utilization"],
               kv_pool_bytes=pool.nbytes, activation_bytes=plan["activation_bytes"], status="ok", reason="")
    step = None
    try:
        step = DecodeStep(shape, w, pool.caches(batch, ctx, seed), backend=backend, mode=mode)
        row.update(backend=step.backend, mode=step.mode)
        step.input_ids.copy_(torch.arange(batch, device=dev) % shape.vocab_size)
        step.set_positions(ctx - 1)  # the new token is the context-th: attention reads ctx tokens
        logits = step.forward()
        row["logits_finite"] = bool(torch.isfinite(logits).all())
        del logits
        graph = step.backend != "reference"
        step_s, timing = time_call(step.forward, dev, graph=graph, rep=rep, warmup=25, cpu_reps=cpu_reps)
        attn_s, _ = time_call(step.attention_only, dev, graph=graph, rep=rep, warmup=25, cpu_reps=cpu_reps)
    except torch.OutOfMemoryError as e:
        row.update(status="error", reason=f"out of memory below the planned ceiling: {e}")
        return row
    except UnsupportedError as e:
        row.update(status="unsupported", reason=str(e))
        return row
    finally:
        del step
    gbps = by["total"] / step_s / 1e9
    copy = base["copy_gbps"]
    row.update(step_us=step_s * 1e6, tokens_per_s=batch / step_s, attention_us=attn_s * 1e6,
               attention_share=attn_s / step_s, gbps=gbps, timing=timing,
               pct_copy_bw=100.0 * gbps / copy if copy == copy else float("nan"))
    return row


def save(df, out_dir="results/step", meta: dict | None = None):
    """Write ``<out_dir>/<gpu-slug>/<timestamp>.csv`` and its ``.json`` (never overwriting; see
    :func:`fp8kv.results.save_table`). Returns the CSV's path."""
    from .results import save_table

    return save_table(df, out_dir, meta={**df.attrs.get("step", {}), **(meta or {})})


# ----------------------------------------------------------------------------------------- reading
def _best(sub):
    ok = sub[sub["status"] == "ok"]
    return ok.loc[ok["tokens_per_s"].idxmax()] if len(ok) else None


def _pair_at(a, b, batch: int, baseline: str, fp8: str) -> dict | None:
    """The two dtypes' rows at ``batch``: FP8's speedup and each step's attention share (None if one is missing)."""
    ra, rb = a[a["batch"] == batch], b[b["batch"] == batch]
    if ra.empty or rb.empty:
        return None
    ra, rb = ra.iloc[0], rb.iloc[0]
    return {"batch": int(batch), "speedup": float(ra["step_us"] / rb["step_us"]),
            "attention_share": {baseline: float(ra["attention_share"]), fp8: float(rb["attention_share"])}}


def reading(df, baseline: str = "bf16", fp8: str = "fp8_e4m3") -> dict:
    """Per (model, context): the numbers that say whether FP8 KV pays, and a sentence reading them.

    Keys of each entry: ``best_tokens_per_s`` per dtype and the batch it came at, ``best_ratio``
    (FP8 best ÷ baseline best), ``at_baseline_ceiling`` (batch = the baseline's ceiling:
    ``speedup`` of the FP8 step there and each step's ``attention_share``), ``batch1`` (same at batch 1),
    and ``sentence``.
    """
    out = {}
    ok = df[df["status"] == "ok"]
    for (model, ctx), g in ok.groupby(["model", "context"], sort=False):
        a, b = g[g["kv_dtype"] == baseline], g[g["kv_dtype"] == fp8]
        if a.empty or b.empty:
            continue
        best_a, best_b = _best(a), _best(b)
        ceil_a = int(a["ceiling"].iloc[0])

        hi, one = _pair_at(a, b, ceil_a, baseline, fp8), _pair_at(a, b, 1, baseline, fp8)
        ratio = float(best_b["tokens_per_s"] / best_a["tokens_per_s"])
        text = (f"{model} at {ctx} tokens: FP8 KV's best is {best_b['tokens_per_s']:,.0f} tokens/s (batch "
                f"{int(best_b['batch'])}) against {best_a['tokens_per_s']:,.0f} for {baseline} KV (batch "
                f"{int(best_a['batch'])}), {ratio:.2f}×")
        if hi is not None:
            text += (f"; at batch {hi['batch']}, {baseline}'s ceiling, attention is "
                     f"{100 * hi['attention_share'][baseline]:.0f} % of the {baseline} step and FP8 KV speeds the "
                     f"step up {hi['speedup']:.2f}×")
        if one is not None:
            text += (f"; at batch 1 attention is {100 * one['attention_share'][baseline]:.0f} % of the step, the weights' "
                     f"GEMMs the rest, and FP8 changes the step by {one['speedup']:.2f}×")
        out[f"{model} @ {ctx}"] = {"model": model, "context": int(ctx),
                                   "best_tokens_per_s": {baseline: float(best_a["tokens_per_s"]),
                                                         fp8: float(best_b["tokens_per_s"])},
                                   "best_batch": {baseline: int(best_a["batch"]), fp8: int(best_b["batch"])},
                                   "best_ratio": ratio, "at_baseline_ceiling": hi, "batch1": one,
                                   "sentence": text + "."}
    return out


# ------------------------------------------------------------------------------------------- figures
SERIES_COLORS = {"bf16": "#1f77b4", "fp16": "#1f77b4", "fp8_e4m3": "#d62728", "fp8_e5m2": "#ff7f0e"}


def _color(kv: str) -> str:
    return SERIES_COLORS.get(kv, "#7f7f7f")


def tokens_per_s_figure(df, *, title: str | None = None):
    """Tokens per second against batch (log-log), one panel per model × context, one line per KV dtype,
    each dtype's ceiling a dashed vertical line of its colour (a trace, so log axes place it right)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ok = df[df["status"] == "ok"]
    panels = list(dict.fromkeys(zip(ok["model"], ok["context"], strict=True)))
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=[f"{m}, context {c}" for m, c in panels])
    for i, (model, ctx) in enumerate(panels, start=1):
        g = ok[(ok["model"] == model) & (ok["context"] == ctx)]
        lo, hi = g["tokens_per_s"].min(), g["tokens_per_s"].max()
        for kv, s in g.groupby("kv_dtype", sort=False):
            s = s.sort_values("batch")
            fig.add_trace(go.Scatter(x=s["batch"], y=s["tokens_per_s"], mode="lines+markers", name=f"{kv} KV",
                                     legendgroup=kv, showlegend=i == 1, line=dict(color=_color(kv)),
                                     customdata=s[["step_us", "attention_share"]],
                                     hovertemplate="B=%{x}<br>%{y:,.0f} tokens/s<br>step %{customdata[0]:.1f} µs"
                                                   "<br>attention %{customdata[1]:.0%}<extra></extra>"), row=1, col=i)
            c = int(s["ceiling"].iloc[0])
            fig.add_trace(go.Scatter(x=[c, c], y=[lo * 0.8, hi * 1.25], mode="lines", name=f"{kv} ceiling",
                                     legendgroup=kv, showlegend=i == 1, hovertemplate=f"{kv} ceiling: B={c}<extra></extra>",
                                     line=dict(color=_color(kv), dash="dash", width=1)), row=1, col=i)
    fig.update_xaxes(type="log", title="batch (concurrent sequences)")
    fig.update_yaxes(type="log", title="tokens per second (generated)")
    fig.update_layout(title=title or "Decode-step throughput against concurrency, to each KV dtype's memory ceiling",
                      height=420, legend_title_text="KV dtype")
    return fig


def attention_share_figure(df, *, title: str | None = None):
    """Attention's share of the step (%) against batch (log x), one panel per model × context."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ok = df[df["status"] == "ok"]
    panels = list(dict.fromkeys(zip(ok["model"], ok["context"], strict=True)))
    fig = make_subplots(rows=1, cols=max(1, len(panels)), subplot_titles=[f"{m}, context {c}" for m, c in panels])
    for i, (model, ctx) in enumerate(panels, start=1):
        g = ok[(ok["model"] == model) & (ok["context"] == ctx)]
        for kv, s in g.groupby("kv_dtype", sort=False):
            s = s.sort_values("batch")
            fig.add_trace(go.Scatter(x=s["batch"], y=100 * s["attention_share"], mode="lines+markers",
                                     name=f"{kv} KV", legendgroup=kv, showlegend=i == 1,
                                     line=dict(color=_color(kv)), customdata=s[["attention_us", "step_us"]],
                                     hovertemplate="B=%{x}<br>attention %{y:.0f} %<br>%{customdata[0]:.1f} of "
                                                   "%{customdata[1]:.1f} µs<extra></extra>"), row=1, col=i)
    fig.update_xaxes(type="log", title="batch (concurrent sequences)")
    fig.update_yaxes(title="attention share of the step (%)", range=[0, 100])
    fig.update_layout(title=title or "How much of the step is attention", height=420, legend_title_text="KV dtype")
    return fig


# ---------------------------------------------------------------------------------------------- CLI
def _gpu_memory_arg(s: str):
    try:
        v = float(s)
    except ValueError:
        return s  # a GPU name; plan_capacity checks it
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive number of GiB or a GPU name such as H200")
    return v


def _positive_int_arg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive int") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive int")
    return v


def build_parser() -> argparse.ArgumentParser:
    from .capability import KV_DTYPES

    p = argparse.ArgumentParser(prog="fp8kv step", description="Time a model's whole decode step (CUDA graph) "
                                "from batch 1 to each KV dtype's memory ceiling; write "
                                "results/step/<gpu-slug>/<timestamp>.csv.")
    p.add_argument("--model", nargs="+", required=True, metavar="NAME",
                   help="registry model name(s) (fp8kv.capacity.MODELS), e.g. Qwen3-0.6B Llama-3.1-8B")
    p.add_argument("--contexts", type=_positive_int_arg, nargs="+", required=True, metavar="TOKENS",
                   help="tokens per sequence (the new token included), e.g. 4096 16384")
    p.add_argument("--batches", type=_positive_int_arg, nargs="+", metavar="B",
                   help="batch sizes to time (each must fit every KV dtype's ceiling); default: powers of 4, "
                        "both ceilings")
    p.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=["bf16", "fp8_e4m3"],
                   help="KV-cache dtypes (default: bf16 fp8_e4m3)")
    p.add_argument("--backend", choices=STEP_BACKENDS, default="auto",
                   help="attention backend of fp8kv.decode (auto: Triton on a GPU, else the reference)")
    p.add_argument("--mode", choices=("auto", "dequant", "fp8"), default="auto", help="attention mode (default auto)")
    p.add_argument("--gpu-memory", type=_gpu_memory_arg, metavar="GIB|GPU",
                   help="GPU memory to plan against, in GiB or a GPU name (default: this GPU's total; required "
                        "on CPU)")
    p.add_argument("--utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use, in (0, 1] (vLLM's gpu_memory_utilization)")
    p.add_argument("--block-size", type=_positive_int_arg, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--weights", choices=("auto", "real", "random"), default="auto",
                   help="auto: real weights where fp8kv loads them offline (SmolLM2-135M), random otherwise")
    p.add_argument("--rep", type=_positive_int_arg, default=50, help="ms of CUDA-graph replays per timing")
    p.add_argument("--out", default="results/step", help="results folder (a sub-folder per GPU)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU if there is one, else the CPU)")
    p.add_argument("--interpret", action="store_true",
                   help="CPU: run Triton under its interpreter (sets TRITON_INTERPRET=1; implies --device cpu)")
    p.add_argument("--dry-run", action="store_true", help="print the ceilings and batches; build and time nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def summary(df) -> str:
    """The rows as a compact text table, then one sentence per model × context (:func:`reading`)."""
    cols = ["model", "kv_dtype", "context", "batch", "ceiling", "step_us", "tokens_per_s", "attention_us",
            "attention_share", "pct_copy_bw", "status"]
    lines = [df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}")]
    lines += [r["sentence"] for r in reading(df).values()]
    bad = df[df["status"] != "ok"]
    lines += [f"{r.model} {r.kv_dtype} B={r.batch}: {r.status}: {r.reason}" for r in bad.itertuples()]
    if (df["timing"] == "cpu-wallclock").any():
        lines.append("CPU wall-clock timings (interpreter / reference): they say nothing about any GPU.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``fp8kv step`` / ``python -m fp8kv.step``; returns the exit status (2: bad input, 1: a point failed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)

    def refuse(msg: str):
        parser.exit(2, f"{parser.prog}: error: {msg}\n")

    if args.interpret:
        if "triton" in sys.modules and not interpreter_on():
            print("warning: triton is already imported; --interpret has no effect", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"
        if args.device not in (None, "cpu"):
            refuse(f"--interpret runs on CPU tensors; drop --device {args.device}")
        args.device = "cpu"
    if not 0 < args.utilization <= 1:
        refuse(f"--utilization {args.utilization}: expected a number in (0, 1]")
    try:
        plans = plan_sweep(args.model, args.contexts, args.kv_dtypes, batches=args.batches,
                           gpu_memory_gib=args.gpu_memory, utilization=args.utilization,
                           block_size=args.block_size, device=args.device)
    except ValueError as e:  # unknown model, batch over the ceiling, nothing fits, no memory given
        refuse(str(e).replace("\n", " "))
    if args.dry_run:
        for p in plans:
            plan = p["plan"]
            print(f"{p['shape'].name:<16} {p['kv_dtype']:<9} ctx={p['context']:<6} ceiling={plan['ceiling']:<5} "
                  f"KV {plan['kv_memory_bytes'] / GIB:.2f} GiB  batches={p['batches']}")
        print(f"{sum(len(p['batches']) for p in plans)} points")
        return 0
    t0 = time.perf_counter()
    df = sweep(args.model, args.contexts, args.kv_dtypes, batches=args.batches, backend=args.backend, mode=args.mode,
               gpu_memory_gib=args.gpu_memory, utilization=args.utilization, block_size=args.block_size,
               weights=args.weights, device=args.device, rep=args.rep, progress=not args.quiet)
    print(summary(df))
    print(f"{len(df)} points in {time.perf_counter() - t0:.0f} s")
    if not args.no_save:
        print(f"wrote {save(df, args.out, meta={'argv': argv})}")
    return 1 if (df["status"] == "error").any() else 0


if __name__ == "__main__":
    sys.exit(main())
