"""Reading a :class:`~fp8kv.cache.PagedKVCache` back: a sequence's K and V dequantized (:func:`gather`), through
the pages as ``[blocks, block_size, Hkv, D]`` whatever their layout (:func:`nhd_view`)."""

from __future__ import annotations

import torch

from .. import checks
from ..checks import fail as _fail
from ..quant import broadcast_scale
from .validation import check_arrays, checked_tables

__all__ = ["nhd_view", "token_slots", "gather"]


def nhd_view(cache, pages: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, Hkv, D] view of ``pages``, whatever the cache's layout."""
    return pages if cache.layout == "NHD" else pages.transpose(1, 2)


def token_slots(cache, seq: int, positions: torch.Tensor) -> torch.Tensor:
    """:meth:`~fp8kv.cache.PagedKVCache.slots` of positions already checked (int64 slots on the tables' device)."""
    positions = positions.to(cache.block_table.device, torch.int64)
    blocks = cache.block_table[seq].to(torch.int64)[positions // cache.block_size]
    return blocks * cache.block_size + positions % cache.block_size


def gather(cache, i, *, check_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`PagedKVCache.gather`: fp32 K, V ``[seq_lens[i], Hkv, D]`` of sequence ``i``, its length,
    block-table entries and (with ``check_scales``) scales checked as they are now (a scale replaced since
    construction: named, not a broadcasting error or NaN rows). ``check_scales=False``: for a loop over the
    sequences whose caller checked the arrays once (a host sync and a pass over the scales each)."""
    i = checks.integer(i, "i")
    if checks.flag(check_scales, "check_scales"):
        check_arrays(cache)
    if not 0 <= i < cache.batch_size:
        _fail(f"sequence index {i} is out of range [0, {cache.batch_size})")
    n = int(checked_tables(cache, row=i)[0])
    pos = torch.arange(n, device=cache.device)
    slot = token_slots(cache, i, pos)  # positions < seq_lens[i]: inside the row, through entries just checked
    blk, off = slot // cache.block_size, slot % cache.block_size
    out = []
    for pages, scale in ((cache.k_pages, cache.k_scale), (cache.v_pages, cache.v_scale)):
        x = nhd_view(cache, pages)[blk, off].to(torch.float32)
        if cache.granularity == "token_head":
            x = x * scale[blk, off].unsqueeze(-1)
        else:
            x = x * broadcast_scale(scale, 3, cache.granularity)
        out.append(x)
    return out[0], out[1]
