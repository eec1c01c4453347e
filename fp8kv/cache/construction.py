"""Building a :class:`~fp8kv.cache.PagedKVCache`: an empty one with every sequence's pages reserved
(:func:`empty`), one scattered from dense sequences (:func:`from_dense`), and ones derived from another
(:func:`clone`, :func:`select`). Each goes through the class's validating constructor."""

from __future__ import annotations

import math

import torch

from .. import checks
from ..checks import fail as _fail
from ..device import refuse_past_free_memory
from ..formats import kv_dtype_info
from .scales import refuse_unused_scale, static_scale
from .validation import LAYOUTS, check_block_size, check_data_device, is_unit_scale, show_scale
from .writing import append_tokens

__all__ = ["shuffled_block_table", "empty", "clone", "select", "from_dense", "reserved_tokens", "pool_request",
           "pool_blocks", "dense_rows"]


def shuffled_block_table(num_blocks: int, batch: int, blocks_per_seq: int, seed: int, device) -> torch.Tensor:
    """``[batch, blocks_per_seq]`` int32 page ids, the first ``batch * blocks_per_seq`` of a seeded
    shuffle of ``num_blocks`` pages: scattered, as a serving engine's allocator leaves them."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:batch * blocks_per_seq]
    return perm.to(torch.int32).reshape(batch, blocks_per_seq).to(device)


def empty(cls, batch_size, max_seq_len, num_kv_heads, head_dim, *, block_size, kv_dtype, granularity, k_scale,
          v_scale, layout, num_blocks, device, seed):
    """:meth:`PagedKVCache.empty`, building a ``cls``."""
    name, dtype, fmt = kv_dtype_info(kv_dtype)
    batch_size = checks.positive_int(batch_size, "batch_size")
    max_seq_len = checks.positive_int(max_seq_len, "max_seq_len")
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
    head_dim = checks.positive_int(head_dim, "head_dim")
    block_size = check_block_size(block_size)
    checks.one_of(layout, "layout", LAYOUTS)
    seed = checks.generator_seed(seed)
    device = checks.device(device)
    if device.type not in ("cpu", "cuda"):  # checks.device also lets 'meta' through: it holds no data
        _fail(f"device={str(device)!r}; a PagedKVCache holds its data on 'cpu' or a CUDA device")
    if fmt is not None and granularity == "token_head":  # a scale that every write overwrites
        for sname, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not is_unit_scale(value, sname):
                _fail(f"{sname}={show_scale(value)}: granularity='token_head' computes one scale per token "
                      f"and head as it writes, so a given scale would be ignored; pass {sname}=None (or 1.0)")
    bpseq, num_blocks = pool_blocks(batch_size, max_seq_len, block_size, num_blocks)
    shape = ((num_blocks, block_size, num_kv_heads, head_dim) if layout == "NHD"
             else (num_blocks, num_kv_heads, block_size, head_dim))
    # pages, their shuffled order (int64) and the table (int32): named here, not an allocator's RuntimeError
    nbytes = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size() + 12 * num_blocks
    refuse_past_free_memory(nbytes, device, pool_request(num_blocks, batch_size, max_seq_len, block_size))
    block_table = shuffled_block_table(num_blocks, batch_size, bpseq, seed, device)
    k_pages = torch.zeros(shape, dtype=dtype, device=device)
    v_pages = torch.zeros(shape, dtype=dtype, device=device)
    seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
    # The constructor checks the scales (a 16-bit cache takes None or 1.0, as token_head here).
    return cls(k_pages, v_pages, block_table, seq_lens, name, granularity, k_scale, v_scale, layout)


def pool_blocks(batch_size: int, max_seq_len: int, block_size: int, num_blocks: int | None) -> tuple[int, int]:
    """Blocks a sequence's row holds and the pool's size (``num_blocks``, default every row's pages; fewer is
    refused), for sizes already checked."""
    bpseq = max(1, math.ceil(max_seq_len / block_size))
    need = batch_size * bpseq
    num_blocks = need if num_blocks is None else checks.positive_int(num_blocks, "num_blocks")
    if num_blocks < need:
        _fail(f"num_blocks={num_blocks} is too few: {batch_size} sequences x {bpseq} blocks need {need}")
    return bpseq, num_blocks


def dense_rows(k, v, seq_lens) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A quantized cache's ``from_dense`` input checked: ``k``, ``v`` ``[B, max_len, Hkv, D]`` float tensors on one
    device, ``seq_lens`` a list or 1-D int tensor ``[B]``. Returns the lengths and each sequence's first
    ``seq_lens[i]`` tokens concatenated (finite, within fp32's range: padding is never read)."""
    for name, t in (("k", k), ("v", v)):
        checks.readable_tensor(checks.tensor(t, name, ndim=4, dtypes=checks.FLOAT_DTYPES,
                                             shape_hint="[B, max_len, Hkv, D]"), name)
    if v.shape != k.shape or v.device != k.device:
        _fail(f"k {tuple(k.shape)} on {k.device} and v {tuple(v.shape)} on {v.device} must match")
    if isinstance(seq_lens, torch.Tensor):
        checks.int_tensor(seq_lens, "seq_lens", ndim=1, shape_hint="[B]")
        seq_lens = seq_lens.tolist()
    if not isinstance(seq_lens, (list, tuple)):
        _fail(f"seq_lens={checks.show_value(seq_lens)}; expected a list or 1-D int tensor of lengths", TypeError)
    lens = [checks.integer(n, f"seq_lens[{i}]", minimum=0) for i, n in enumerate(seq_lens)]
    if not lens:
        _fail("seq_lens is empty: need at least one sequence")
    if len(lens) != k.shape[0]:
        _fail(f"seq_lens has {len(lens)} entries but k holds {k.shape[0]} sequences")
    for i, n in enumerate(lens):
        if n > k.shape[1]:
            _fail(f"seq_lens[{i}]={n} is more than the {k.shape[1]} tokens k and v hold per sequence")
        for name, x in (("k", k), ("v", v)):
            checks.finite_tensor(x[i, :n], f"{name}[{i}, :{n}]")
            checks.fp32_range_tensor(x[i, :n], f"{name}[{i}, :{n}]")
    return lens, torch.cat([k[i, :n] for i, n in enumerate(lens)]), torch.cat([v[i, :n] for i, n in enumerate(lens)])


def pool_request(num_blocks: int, batch_size: int, max_seq_len: int, block_size: int) -> str:
    """A cache's page pool by the arguments that size it, as a memory refusal names it."""
    return (f"num_blocks={num_blocks} (batch_size={batch_size} x max_seq_len={max_seq_len} tokens in pages of "
            f"{block_size}: K and V pages and tables)")


def clone(cache):
    """:meth:`PagedKVCache.clone`: pages, tables and scales copied."""
    c = type(cache)(cache.k_pages.clone(), cache.v_pages.clone(), cache.block_table.clone(),
                    cache.seq_lens.clone(), cache.kv_dtype, cache.granularity,
                    cache.k_scale if cache.is_fp8 else None, cache.v_scale if cache.is_fp8 else None, cache.layout)
    c.saturated = cache.saturated
    return c


def select(cache, indices):
    """:meth:`PagedKVCache.select`: the sequences ``indices`` (checked), sharing ``cache``'s pages."""
    if isinstance(indices, torch.Tensor):
        if indices.ndim != 1 or indices.is_floating_point() or indices.dtype == torch.bool:
            _fail(f"indices must be a 1-D int tensor or a list of ints; got a {indices.dtype} tensor of "
                  f"shape {tuple(indices.shape)}", TypeError)
        indices = indices.tolist()
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        _fail(f"indices={indices!r}; expected a list of sequence indices", TypeError)
    idx = [checks.integer(i, f"indices[{n}]", minimum=0, maximum=cache.batch_size - 1)
           for n, i in enumerate(indices)]
    if not idx:
        _fail("indices is empty; give at least one sequence index")
    sel = torch.tensor(idx, device=cache.device)
    return type(cache)(cache.k_pages, cache.v_pages, cache.block_table[sel].contiguous(),
                       cache.seq_lens[sel].contiguous(), cache.kv_dtype, cache.granularity,
                       cache.k_scale if cache.is_fp8 else None, cache.v_scale if cache.is_fp8 else None,
                       cache.layout)


def _sequences(k, v) -> tuple[list, list]:
    """``k`` and ``v`` as lists of ``[len, Hkv, D]`` float tensors on one device (checked)."""
    if isinstance(k, torch.Tensor) and k.ndim != 4 or isinstance(v, torch.Tensor) and v.ndim != 4:
        _fail(f"k and v given as tensors must be 4-D [B, max_len, Hkv, D]; got shapes "
              f"{tuple(getattr(k, 'shape', ()))} and {tuple(getattr(v, 'shape', ()))}")
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, (torch.Tensor, list, tuple)):  # None, a number, a string: no sequences
            _fail(f"{name}={checks.show_value(x)} ({type(x).__name__}); expected a [B, max_len, Hkv, D] tensor or a "
                  "list of [len, Hkv, D] tensors", TypeError)
    ks = list(k) if not isinstance(k, torch.Tensor) else [k[i] for i in range(k.shape[0])]
    vs = list(v) if not isinstance(v, torch.Tensor) else [v[i] for i in range(v.shape[0])]
    for name, seqs in (("k", ks), ("v", vs)):
        for i, t in enumerate(seqs):  # FP8 input is refused: its values are codes of an unknown scale
            checks.tensor(t, f"{name}[{i}]", dtypes=checks.FLOAT_DTYPES, shape_hint="[len, Hkv, D]")
            first = (ks or vs)[0]  # checked above: a tensor
            if t.device != first.device:
                _fail(f"{name}[{i}] is on {t.device} but {'k' if ks else 'v'}[0] is on {first.device}; "
                      "k and v must be on one device")
    return ks, vs


def _lengths(seq_lens) -> list[int]:
    """``seq_lens`` (a list, or a 1-D int tensor) as ints (checked)."""
    if not isinstance(seq_lens, (torch.Tensor, list, tuple)):
        _fail(f"seq_lens={seq_lens!r} ({type(seq_lens).__name__}); expected a list or int tensor of lengths, "
              "one per sequence", TypeError)
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
            _fail(f"seq_lens has dtype {seq_lens.dtype}; expected integer lengths", TypeError)
        if seq_lens.ndim != 1:  # a 0-d tensor is a length, not a batch of them
            _fail(f"seq_lens has shape {tuple(seq_lens.shape)}; expected a 1-D tensor [B] (or a list) of "
                  "lengths, one per sequence (a batch of one is [n])")
        seq_lens = checks.readable_tensor(seq_lens, "seq_lens").tolist()
    return [checks.integer(x, f"seq_lens[{i}]") for i, x in enumerate(seq_lens)]


def from_dense(cls, k, v, seq_lens, *, block_size, kv_dtype, granularity, scale, seed, k_scale, v_scale, layout,
               max_seq_len, num_blocks, percentile):
    """:meth:`PagedKVCache.from_dense`, building a ``cls``."""
    ks, vs = _sequences(k, v)
    lens = _lengths(seq_lens)
    if max_seq_len is not None:
        checks.positive_int(max_seq_len, "max_seq_len")
    for name, value in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool):
            _fail(f"{name}={value!r} (bool); expected a scale method such as 'amax', a positive float "
                  "or a float tensor", TypeError)
    if scale is not None and k_scale is not None and v_scale is not None:
        _fail(f"scale={show_scale(scale)} would be ignored: k_scale and v_scale override it for K and V; "
              "pass scale or k_scale/v_scale")
    if not (len(ks) == len(vs) == len(lens)):
        _fail(f"k ({len(ks)}), v ({len(vs)}) and seq_lens ({len(lens)}) must have the same batch size")
    if not lens:
        _fail("seq_lens is empty: need at least one sequence")
    for i, (ki, vi, n) in enumerate(zip(ks, vs, lens, strict=True)):
        if ki.ndim != 3 or vi.shape != ki.shape or ki.shape[1:] != ks[0].shape[1:]:
            _fail(f"sequence {i}: k and v must be [len, Hkv, D] with equal shapes (and the Hkv, D of "
                  f"sequence 0, {tuple(ks[0].shape[1:])}); got {tuple(ki.shape)} and {tuple(vi.shape)}")
        if n < 0 or n > ki.shape[0]:
            _fail(f"seq_lens[{i}]={n} is outside [0, {ki.shape[0]}] (the tokens given)")
    hkv, d = ks[0].shape[1:]
    device = ks[0].device
    check_data_device(device, "k")
    cache = cls.empty(len(lens), reserved_tokens(max_seq_len, lens), hkv, d, block_size=block_size, kv_dtype=kv_dtype,
                      granularity=granularity, layout=layout, num_blocks=num_blocks, device=device,
                      seed=seed)
    k_all = torch.cat([ki[:n] for ki, n in zip(ks, lens, strict=True)])
    v_all = torch.cat([vi[:n] for vi, n in zip(vs, lens, strict=True)])
    for name, x in (("k", k_all), ("v", v_all)):  # the valid tokens only: padding is never read
        checks.finite_tensor(x, name)
        checks.fp32_range_tensor(x, name)
    specs = ((scale, "scale") if k_scale is None else (k_scale, "k_scale"),
             (scale, "scale") if v_scale is None else (v_scale, "v_scale"))
    if cache.is_fp8 and cache.granularity != "token_head":  # static: from the valid tokens, or as given
        cache.k_scale = static_scale(cache, *specs[0], k_all, percentile)
        cache.v_scale = static_scale(cache, *specs[1], v_all, percentile)
    else:
        for value, name in specs:
            refuse_unused_scale(cache, value, name)
    append_tokens(cache, k_all, v_all, torch.tensor(lens, dtype=torch.int32))
    return cache


def reserved_tokens(max_seq_len: int | None, lens: list[int]) -> int:
    """Tokens per sequence a ``from_dense`` cache reserves pages for: ``max_seq_len`` (an int >= 1 already checked),
    None for the longest of ``lens``, at least 1. One below the longest of ``lens`` is refused (ValueError naming
    both): it was raised to it, silently."""
    longest = max(lens, default=0)
    if max_seq_len is not None and max_seq_len < longest:
        _fail(f"max_seq_len={max_seq_len} is below seq_lens[{lens.index(longest)}]={longest}; expected max_seq_len >= "
              f"the longest seq_len ({longest}), or None to reserve just that")
    return max(longest, max_seq_len or 0, 1)
