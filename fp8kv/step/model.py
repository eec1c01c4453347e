"""The KV pool (one paged cache per layer over one block table) and the decode step that runs a
whole model for one token per sequence; greedy decoding through it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..cache import PagedKVCache, shuffled_block_table
from ..capability import UnsupportedError, check, check_query, choose_backend, choose_mode
from ..capacity import ModelShape
from ..checks import fail as _fail
from ..checks import resolved_softmax_scale
from ..formats import kv_dtype_info
from ..rope import apply_rope, rope_cos_sin, rope_inv_freq
from .layers import StepWeights, gated_mlp, require_step_shape, rms_norm

STEP_BACKENDS = ("auto", "triton", "reference")

# -------------------------------------------------------------------------------------------- KV pool
class KVPool:
    """The KV memory of an engine, allocated once: K and V pages ``[num_blocks, block_size, Hkv, D]``
    per layer (``kv_dtype``), zero-filled, with per-layer per-tensor scales (FP8; default 1.0, the
    engines' value when a checkpoint carries none). :meth:`caches` hands out per-layer caches over
    a batch that share one block table and one ``seq_lens``, as every layer of an engine does."""

    def __init__(self, shape: ModelShape, num_blocks: int, kv_dtype: str = "fp8_e4m3", *, block_size: int = 16,
                 device=None, k_scales=1.0, v_scales=1.0):
        from ..checks import positive_int
        from ..device import resolve_device

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
        from ..checks import positive_int

        batch, max_context = positive_int(batch, "batch"), positive_int(max_context, "max_context")
        bpseq = self.blocks_per_seq(max_context)
        if batch * bpseq > self.num_blocks:
            _fail(f"batch={batch} sequences of {max_context} tokens need {batch * bpseq} blocks; the pool holds "
                  f"{self.num_blocks} (at most {self.max_batch(max_context)} such sequences)")
        table = shuffled_block_table(self.num_blocks, batch, bpseq, seed, self.device)
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
        self.shape = require_step_shape(shape)
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
        # Refused here, before a token runs, rather than by every layer's decode: on CPU a bf16 cache
        # meets the fp16 queries the Triton kernel takes there, a pairing it refuses.
        ok, why = check_query(backend, self.q_dtype, first.kv_dtype)
        if not ok:
            raise UnsupportedError(f"backend={backend}, kv_dtype={first.kv_dtype}: {why}")
        self.sm_scale = resolved_softmax_scale(None, shape.head_dim)
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
        from ..backends import decode

        # The step builds its own tables and checks positions in set_positions: the content checks
        # (a host sync) would break the CUDA-graph capture.
        return decode(q.to(self.q_dtype), self.caches[layer], backend=self.backend, mode=self.mode,
                      sm_scale=self.sm_scale, check=False)[0]

    def _write(self, cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.backend == "reference":
            cache.write(k, v, self.slot_mapping)
        else:
            from ..ops import write_cache

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


# --------------------------------------------------------------------------------------- greedy decode
@torch.no_grad()
def greedy_decode(step: DecodeStep, prompt_ids, n_new: int) -> list[int]:
    """Feed ``prompt_ids`` (int ``[T]``) through ``step`` one token at a time (batch 1), then generate
    ``n_new`` tokens greedily; returns them. Each step writes its token's K/V and attends over the
    sequence so far, so this is the decode loop of :func:`fp8kv.models.greedy_decode_paged` with the
    prompt fed token by token instead of in one prefill pass."""
    from ..checks import positive_int

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
