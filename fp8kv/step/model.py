"""The KV pool (one paged cache per layer over one block table) and the step that runs a whole model
for one new token per sequence (decode) or several (speculative verification, a prefill chunk); greedy
decoding through it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .. import checks
from ..cache import PagedKVCache, shuffled_block_table
from ..cache.quantized import QuantizedPagedKVCache
from ..capability import UnsupportedError, check, check_query, choose_backend, choose_mode
from ..capacity import ModelShape
from ..checks import fail as _fail
from ..checks import resolved_softmax_scale
from ..formats import kv_dtype_info
from ..kv_formats import kv_format, page_shapes
from ..rope import apply_rope, rope_cos_sin, rope_inv_freq
from .layers import StepWeights, check_step_weights, gated_mlp, require_step_shape, rms_norm
from .quantized import check_format_shape, check_format_step, is_format, step_kv_dtype, write_rows

STEP_BACKENDS = ("auto", "triton", "reference")
STEP_MODES = ("auto", "dequant", "fp8")  # FP8 pages: dequantize in the loop, or FP8 arithmetic; auto: the kernel's pick
STEP_LOGITS = ("all", "last")  # LM head on every new token's row, or on each sequence's last one (prefill)

def int_values(value, name: str) -> torch.Tensor:
    """``value`` (an int, a list of ints or an integer tensor) as an int64 tensor; floats, bools and strings are a
    TypeError naming ``name`` (a position of 3.9 would be read as 3)."""
    if isinstance(value, range):
        value = list(value)
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            _fail(f"{name} is a numpy {value.dtype} array; expected ints (an integer array, an int or a list of ints)",
                  TypeError)
        value = torch.from_numpy(value.astype(np.int64))
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            _fail(f"{name} is a {value.dtype} tensor; expected ints (an integer tensor, an int or a list of ints)",
                  TypeError)
        return value.to(torch.int64)
    if isinstance(value, (list, tuple)):
        flat = list(value)
        while flat and all(isinstance(x, (list, tuple)) for x in flat):
            flat = [y for x in flat for y in x]
        for i, x in enumerate(flat):
            checks.integer(x, f"{name}[{i}]")
        try:
            return torch.as_tensor(value, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            _fail(f"{name} is not a rectangular list of ints ({e})", TypeError)
    return torch.tensor(checks.integer(value, name), dtype=torch.int64)


def token_ids(value, name: str, vocab_size: int) -> torch.Tensor:
    """Token ids (as :func:`int_values`) in ``[0, vocab_size)``: an id outside would index another token's
    embedding (a negative one counts from the end) or none."""
    ids = int_values(value, name)
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            _fail(f"{name} holds id {lo if lo < 0 else hi}; expected ids in [0, {vocab_size}) (the model's vocab_size)")
    return ids


# -------------------------------------------------------------------------------------------- KV pool
class KVPool:
    """The KV memory of an engine, allocated once: K and V pages ``[num_blocks, block_size, Hkv, D]``
    per layer (``kv_dtype``), zero-filled, with per-layer per-tensor scales (FP8; default 1.0, the
    engines' value when a checkpoint carries none). :meth:`caches` hands out per-layer caches over
    a batch that share one block table and one ``seq_lens``, as every layer of an engine does.

    ``kv_dtype`` may also be a quantized format (:data:`fp8kv.step.quantized.STEP_FORMATS`): per layer, its
    codes and scales as a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` lays them out (codes zero, scales
    one: an unwritten slot decodes to 0), ``k_scales`` / ``v_scales`` its fixed fp32 tensor scales (NVFP4 and
    e4m3_b16; ignored by the formats without one, as by 16-bit pages). A format that cannot store the model's
    head_dim is refused here (ValueError naming the formats that can)."""

    def __init__(self, shape: ModelShape, num_blocks: int, kv_dtype: str = "fp8_e4m3", *, block_size: int = 16,
                 device=None, k_scales=1.0, v_scales=1.0):
        from ..checks import positive_int
        from ..device import resolve_device

        if not isinstance(shape, ModelShape):
            _fail(f"shape={shape!r} ({type(shape).__name__}); expected a fp8kv.capacity.ModelShape "
                  "(fp8kv.capacity.get_model(name) for a registry model)", TypeError)
        self.shape = shape
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.kv_dtype = step_kv_dtype(kv_dtype)
        self.block_size = positive_int(block_size, "block_size")
        self.device = resolve_device(device)
        n = shape.num_layers
        ks = list(k_scales) if isinstance(k_scales, (list, tuple)) else [k_scales] * n
        vs = list(v_scales) if isinstance(v_scales, (list, tuple)) else [v_scales] * n
        if len(ks) != n or len(vs) != n:
            _fail(f"k_scales/v_scales have {len(ks)}/{len(vs)} entries; expected one per layer ({n})")
        if is_format(self.kv_dtype):
            check_format_shape(self.kv_dtype, shape.num_kv_heads, shape.head_dim, model=shape.name)
            self.format = kv_format(self.kv_dtype)
            self.dtype = self.format.key.code_dtype
            self.k_scales = ks if self.format.key.tensor_scale else [None] * n
            self.v_scales = vs if self.format.value.tensor_scale else [None] * n
            self.pages = [self._format_arrays() for _ in range(n)]
            return
        self.format = None
        _, self.dtype, fmt = kv_dtype_info(self.kv_dtype)
        self.k_scales, self.v_scales = (ks, vs) if fmt is not None else ([None] * n, [None] * n)
        page = (self.num_blocks, self.block_size, shape.num_kv_heads, shape.head_dim)
        self.pages = [(torch.zeros(page, dtype=self.dtype, device=self.device),
                       torch.zeros(page, dtype=self.dtype, device=self.device)) for _ in range(n)]

    def _format_arrays(self) -> tuple[torch.Tensor, ...]:
        """One layer's K codes, V codes, K scales and V scales in the pool's format."""
        s = self.shape
        codes, scales = page_shapes(self.format.key, self.num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        out = [torch.zeros(codes, dtype=c.code_dtype, device=self.device) for c in self.format.codecs]
        out += [torch.ones(scales, dtype=torch.float32, device=self.device).to(c.scale_dtype)  # e8m0: code 127
                for c in self.format.codecs]
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's pages (codes and scales; a format's tensor scales too)."""
        fixed = sum(4 for s in (*self.k_scales, *self.v_scales) if s is not None) if self.format is not None else 0
        return sum(t.numel() * t.element_size() for arrays in self.pages for t in arrays) + fixed

    def blocks_per_seq(self, max_context: int) -> int:
        return math.ceil(checks.positive_int(max_context, "max_context") / self.block_size)

    def max_batch(self, max_context: int) -> int:
        """Sequences of ``max_context`` tokens the pool holds."""
        return self.num_blocks // self.blocks_per_seq(max_context)

    def caches(self, batch: int, max_context: int, seed: int = 0) -> list[PagedKVCache | QuantizedPagedKVCache]:
        """Per-layer caches of ``batch`` empty sequences with room for ``max_context`` tokens each,
        their blocks drawn at random from the pool (as an allocator leaves them): PagedKVCache, or
        QuantizedPagedKVCache for a format."""
        from ..checks import positive_int

        batch, max_context = positive_int(batch, "batch"), positive_int(max_context, "max_context")
        bpseq = self.blocks_per_seq(max_context)
        if batch * bpseq > self.num_blocks:
            _fail(f"batch={batch} sequences of {max_context} tokens need {batch * bpseq} blocks; the pool holds "
                  f"{self.num_blocks} (at most {self.max_batch(max_context)} such sequences)")
        seed = checks.generator_seed(seed)
        table = shuffled_block_table(self.num_blocks, batch, bpseq, seed, self.device)
        seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        if self.format is not None:
            return [QuantizedPagedKVCache(self.format, kp, vp, kss, vss, table, seq_lens, k_tensor_scale=ks,
                                          v_tensor_scale=vs)
                    for (kp, vp, kss, vss), ks, vs in zip(self.pages, self.k_scales, self.v_scales, strict=True)]
        return [PagedKVCache(k, v, table, seq_lens, self.kv_dtype, "tensor", ks, vs)
                for (k, v), ks, vs in zip(self.pages, self.k_scales, self.v_scales, strict=True)]


# ------------------------------------------------------------------------------------------- the step
class DecodeStep:
    """One step of a dense decoder over per-layer paged caches: ``q_len`` new tokens per sequence through
    every layer (see the package docstring). ``q_len = 1`` is the decode step; ``q_len = k + 1`` the target
    model's verification of k draft tokens; ``q_len = C`` a chunk of a prompt (chunked prefill).

    Parameters
    ----------
    shape : the model's :class:`~fp8kv.capacity.ModelShape` (hidden, intermediate and vocabulary sizes set).
    weights : :class:`StepWeights` of that shape.
    caches : one :class:`~fp8kv.cache.PagedKVCache` per layer, sharing one block table and ``seq_lens``
        (:meth:`KVPool.caches`); or one :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` per layer, all of
        one format (a pool of a quantized format): written by :func:`fp8kv.step.quantized.write_rows`, read by
        :func:`fp8kv.ops.quant_decode.paged_decode_quantized` (Triton) or its fp32 oracle (reference).
    backend : ``"auto"`` (Triton on a GPU, else the reference), ``"triton"`` or ``"reference"``.
        FlashInfer plans on the host at every :func:`fp8kv.decode` call, which a CUDA graph cannot hold.
        A quantized format: ``"auto"`` is Triton where the format has a kernel and this machine runs it (a GPU,
        or the Triton interpreter), else the reference; a backend that does not read the format, a mode but
        auto / dequant, or ``q_len`` above 1 is a ValueError naming what is accepted.
    mode : ``"auto"``, ``"dequant"`` or ``"fp8"`` (:func:`fp8kv.decode`'s).
    q_len : new tokens per sequence, a positive int (default 1). One token attends through
        :func:`fp8kv.decode`; several through :func:`fp8kv.planned_attend`, planned once per
        :meth:`set_positions` (the host work an engine does per step, outside the timed forward).
    logits : ``"all"`` (default: the LM head on every new token, as verification needs) or ``"last"``
        (on each sequence's last new token only, as an engine's prefill computes them).

    Inputs live in fixed buffers (graph replays read them): ``input_ids`` ``[B × q_len]`` int64 (sequence
    by sequence, each one's tokens in order) and, set by :meth:`set_positions`, ``positions`` /
    ``slot_mapping`` ``[B × q_len]`` int64 and the caches' ``seq_lens``. :meth:`forward` returns logits
    ``[B × q_len, vocab]`` (``logits="last"``: ``[B, vocab]``) in the weights' dtype. With ``q_len = 1``
    every tensor and call is the decode step's, so its logits are the decode step's bit for bit.
    """

    def __init__(self, shape: ModelShape, weights: StepWeights, caches: Sequence[PagedKVCache], *,
                 backend: str = "auto", mode: str = "auto", q_len: int = 1, logits: str = "all"):
        from ..checks import one_of, positive_int

        self.shape = require_step_shape(shape)
        self.q_len = positive_int(q_len, "q_len")
        self.logits = one_of(logits, "logits", STEP_LOGITS)
        if not isinstance(weights, StepWeights):
            _fail(f"weights must be StepWeights (random_weights / weights_from_hf), got {type(weights).__name__}",
                  TypeError)
        caches = list(caches)
        if len(caches) != shape.num_layers or len(weights.layers) != shape.num_layers:
            _fail(f"{shape.name} has {shape.num_layers} layers; got {len(caches)} caches and "
                  f"{len(weights.layers)} layers of weights")
        check_step_weights(shape, weights)
        first = caches[0]
        quantized = isinstance(first, QuantizedPagedKVCache)
        kind = QuantizedPagedKVCache if quantized else PagedKVCache
        for i, c in enumerate(caches):
            if not isinstance(c, kind):
                _fail(f"caches[{i}] is a {type(c).__name__}; expected {kind.__name__}, as caches[0] (one pool's caches, "
                      "KVPool.caches)", TypeError)
            if c.kv_dtype != first.kv_dtype:
                _fail(f"caches[{i}] holds {c.kv_dtype}, caches[0] {first.kv_dtype}; every layer's cache must hold the "
                      "same KV dtype (KVPool.caches)")
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
        if mode not in STEP_MODES:
            _fail(f"mode={mode!r}; expected one of {STEP_MODES}")
        self.quantized = quantized
        if quantized:
            backend, mode = self._format_backend(first.kv_dtype, backend, mode, weights.device)
        else:
            backend, mode = self._backend(first, backend, mode)
        self.weights, self.caches, self.backend, self.mode = weights, caches, backend, mode
        self.kv_dtype = first.kv_dtype
        dev, dtype = weights.device, weights.dtype
        # The kernels take 16-bit queries: an fp32 model (CPU) hands them fp16 (bf16 arithmetic is
        # wrong in Triton's interpreter) and bf16 on a GPU; the reference takes the model's dtype.
        if dtype in (torch.float16, torch.bfloat16) or backend == "reference":
            self.q_dtype = dtype
        else:
            self.q_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
        if not quantized:
            # Refused here, before a token runs, rather than by every layer's decode: on CPU a bf16 cache
            # meets the fp16 queries the Triton kernel takes there, a pairing it refuses.
            ok, why = check_query(backend, self.q_dtype, first.kv_dtype)
            if not ok:
                raise UnsupportedError(f"backend={backend}, kv_dtype={first.kv_dtype}: {why}")
        self.sm_scale = resolved_softmax_scale(None, shape.head_dim)
        self.inv_freq = rope_inv_freq(shape.head_dim, shape.rope_theta, dev)
        n = first.batch_size * self.q_len
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.qo_indptr = torch.arange(0, n + 1, self.q_len, dtype=torch.int32, device=dev)  # [B + 1]
        self.last_rows = self.qo_indptr[1:].to(torch.int64) - 1  # each sequence's last new token
        # A fixed query for timing attention alone (values do not change its time). Several tokens: it is
        # also the buffer the planned attention reads, each layer's query copied in.
        g = torch.Generator(device=dev).manual_seed(0)
        self.probe_q = torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g, device=dev).to(self.q_dtype)
        self._attend_calls = None  # per layer, planned by set_positions (q_len > 1)

    def _backend(self, first: PagedKVCache, backend: str, mode: str) -> tuple[str, str]:
        """``backend`` and ``mode`` resolved for 16-bit and FP8 pages, refused where this machine cannot run them."""
        shape = self.shape
        if backend == "auto":
            backend = choose_backend(first.kv_dtype, "dequant" if mode == "auto" else mode, None, "tensor",
                                     shape.head_dim)
            if backend not in STEP_BACKENDS:
                backend = "reference"
        if mode == "auto":
            mode = choose_mode(backend, first.kv_dtype, None, first.granularity)
        ok, why = check(backend, first.kv_dtype, mode, None, first.granularity, shape.head_dim,
                        op="decode" if self.q_len == 1 else "attend")
        if not ok:
            raise UnsupportedError(f"backend={backend}, mode={mode}, kv_dtype={first.kv_dtype}: {why}")
        return backend, mode

    def _format_backend(self, kv_dtype: str, backend: str, mode: str, dev: torch.device) -> tuple[str, str]:
        """``backend`` and ``mode`` resolved for quantized pages (:func:`~fp8kv.step.quantized.check_format_step`:
        a backend, mode or q_len that cannot read the format is a ValueError); the Triton kernel refused
        (UnsupportedError) where this machine has neither a CUDA GPU nor the Triton interpreter."""
        from ..capability import interpreter_on

        backend = check_format_step(kv_dtype, backend, mode, self.q_len, on_gpu=dev.type == "cuda")
        if backend == "triton" and dev.type != "cuda" and not interpreter_on():
            raise UnsupportedError(f"backend=triton, kv_dtype={kv_dtype}: the quantized-page decode kernel needs a "
                                   "CUDA GPU, or TRITON_INTERPRET=1 on CPU")
        return backend, "dequant"

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
        """Place the new tokens of every sequence from ``positions`` on (an int for all, or ``[B]`` ints: the
        position of each sequence's first new token; its ``q_len`` tokens take the positions from there):
        ``seq_lens = positions + q_len`` and the slots they are written to. With several new tokens the
        attention is planned here for these lengths. Host-side, between steps."""
        cap = self.caches[0].max_blocks_per_seq * self.caches[0].block_size
        pos = int_values(positions, "positions").cpu()
        if pos.ndim == 0:
            pos = pos.expand(self.batch)
        if pos.shape != (self.batch,):
            _fail(f"positions has shape {tuple(pos.shape)}; expected an int or [{self.batch}] ints")
        last = cap - self.q_len + 1  # the first new token's positions that leave room for all q_len
        if (pos < 0).any() or (pos >= last).any():
            room = "" if self.q_len == 1 else f" and each step writes {self.q_len} new ones"
            _fail(f"positions {pos.tolist()[:8]} outside [0, {last}): the caches hold {cap} tokens per sequence"
                  + room)
        pos = pos.to(self.positions.device)
        bs = self.caches[0].block_size
        every = (pos[:, None] + torch.arange(self.q_len, device=pos.device)).reshape(-1)  # [B * q_len]
        rows = torch.arange(self.batch, device=pos.device).repeat_interleave(self.q_len)
        blocks = self.block_table.to(torch.int64)[rows, every // bs]
        self.positions.copy_(every)
        self.slot_mapping.copy_(blocks * bs + every % bs)
        self.seq_lens.copy_((pos + self.q_len).to(torch.int32))
        if self.q_len > 1:
            self._plan_attention()

    def _plan_attention(self) -> None:
        """One planned attention per layer (:func:`fp8kv.planned_attend`) for the lengths just set: each reads
        :attr:`probe_q`, into which :meth:`attend` copies the layer's query."""
        from ..backends import planned_attend

        self._attend_calls = [planned_attend(self.probe_q, cache, self.qo_indptr, self.backend, self.mode,
                                             sm_scale=self.sm_scale) for cache in self.caches]

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[B × q_len, Hq, D]`` over layer ``layer``'s cache: out ``[B × q_len, Hq, D]``
        (the backend's dtype). One token: :func:`fp8kv.decode`; several: the attention planned by
        :meth:`set_positions` (call it first)."""
        from ..backends import decode

        if self.quantized:
            return self._attend_quantized(layer, q)
        if self.q_len == 1:
            # The step builds its own tables and checks positions in set_positions: the content checks
            # (a host sync) would break the CUDA-graph capture.
            return decode(q.to(self.q_dtype), self.caches[layer], backend=self.backend, mode=self.mode,
                          sm_scale=self.sm_scale, check=False)[0]
        if self._attend_calls is None:
            _fail(f"a step of q_len={self.q_len} attends as planned by set_positions; call it before forward")
        if q is not self.probe_q:
            self.probe_q.copy_(q)
        return self._attend_calls[layer]()[0]

    def _attend_quantized(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Decode attention over layer ``layer``'s quantized pages: fp8kv's kernel (its content checks, a host
        sync, off: the step checks positions in set_positions), or the fp32 oracle on the reference backend."""
        from ..ops.quant_decode import paged_decode_quantized, quantized_reference

        q = q.to(self.q_dtype)
        if self.backend == "reference":
            return quantized_reference(q, self.caches[layer], self.sm_scale)[0]
        return paged_decode_quantized(q, self.caches[layer], sm_scale=self.sm_scale, check=False)[0]

    def _write(self, cache, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.quantized and self.backend != "reference":
            write_rows(cache, k, v, self.slot_mapping)  # the cache's bytes, no host sync (a CUDA graph holds it)
        elif self.backend == "reference":
            cache.write(k, v, self.slot_mapping)
        else:
            from ..ops import write_cache

            write_cache(cache, k, v, self.slot_mapping, count_saturated=False, check=False)  # no host sync

    def forward(self) -> torch.Tensor:
        """The step: logits ``[B × q_len, vocab]`` (``logits="last"``: ``[B, vocab]``) of the tokens in
        ``input_ids`` at ``positions``."""
        if self.q_len > 1 and self._attend_calls is None:  # before any write: its slots are not set yet
            _fail(f"a step of q_len={self.q_len} attends as planned by set_positions; call it before forward")
        s, w = self.shape, self.weights
        b, hq, hkv, d, eps = self.batch * self.q_len, s.num_q_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        lin = torch.nn.functional.linear
        cos, sin = rope_cos_sin(self.positions, self.inv_freq, w.dtype)
        x = torch.nn.functional.embedding(self.input_ids, w.embed)  # an id outside [0, V) fails, not wraps
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
        if self.logits == "last" and self.q_len > 1:
            x = x[self.last_rows]
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
    if step.batch != 1 or step.q_len != 1:
        _fail(f"greedy_decode runs one sequence a token at a time; the step has batch {step.batch}, "
              f"q_len {step.q_len}")
    prompt = token_ids(prompt_ids, "prompt_ids", step.shape.vocab_size).reshape(-1).tolist()
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
