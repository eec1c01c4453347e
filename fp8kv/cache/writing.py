"""Writing into a :class:`~fp8kv.cache.PagedKVCache`: the slots of a sequence's positions, a write of rows into
slots (quantized on the way in, saturating), and appends to each sequence's end."""

from __future__ import annotations

import torch

from .. import checks
from ..checks import fail as _fail
from ..formats import saturation_bounds
from ..quant import broadcast_scale, cast_saturating, compute_scale_unchecked
from .reading import nhd_view, token_slots
from .validation import check_pages, check_write, checked_tables, refuse_shared_writes

__all__ = ["slots", "append_tokens", "write"]


def slots(cache, seq, positions) -> torch.Tensor:
    """:meth:`PagedKVCache.slots`: ``seq`` and ``positions`` checked against its row, int64 slots returned."""
    seq = checks.integer(seq, "seq", minimum=0, maximum=cache.batch_size - 1)
    check_pages(cache)  # the tables read below: named if swapped for another dtype or shape
    cap = cache.max_blocks_per_seq * cache.block_size
    if isinstance(positions, (list, tuple)):
        positions = torch.tensor([checks.integer(p, f"positions[{i}]") for i, p in enumerate(positions)],
                                 dtype=torch.int64)
    checks.int_tensor(positions, "positions", ndim=1, shape_hint="[N] (token positions)")
    pos = positions.cpu().to(torch.int64)
    bad = (pos < 0) | (pos >= cap)  # else -1 silently indexes the row's last entry
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        _fail(f"positions[{i}]={int(pos[i])} is outside [0, {cap}): sequence {seq}'s block-table row holds "
              f"{cache.max_blocks_per_seq} blocks x {cache.block_size} tokens")
    pages = cache.block_table[seq].cpu().to(torch.int64)[pos // cache.block_size]
    bad = (pages < 0) | (pages >= cache.num_blocks)  # padding (-1): a negative slot, which writes skip
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        _fail(f"positions[{i}]={int(pos[i])} lies in block_table[{seq}, {int(pos[i]) // cache.block_size}]="
              f"{int(pages[i])}, which is not a page in [0, {cache.num_blocks})")
    return token_slots(cache, seq, positions.to(cache.device))


def append_tokens(cache, k_new, v_new, counts, *, writer=None) -> int:
    """:meth:`PagedKVCache.append_tokens` (and a QuantizedPagedKVCache's): everything checked before anything
    is written, then ``writer(cache, k_new, v_new, slots, shared_checked=True)`` (default :func:`write`)
    stores the rows and the lengths grow. Returns the saturations."""
    counts = checked_counts(cache, counts)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] != int(counts.sum()):
            _fail(f"{name} has {t.shape[0]} rows but counts sum to {int(counts.sum())}; give one row per new token")
    start = checked_tables(cache)  # a negative length edited in would append at the row's end
    cap = cache.max_blocks_per_seq * cache.block_size
    if (start + counts > cap).any():
        i = int((start + counts > cap).nonzero()[0])
        _fail(f"sequence {i}: seq_len {int(start[i])} + {int(counts[i])} new tokens exceeds its "
              f"capacity of {cap} tokens; build the cache with a larger max_seq_len")
    first, last = start // cache.block_size, (start + counts + cache.block_size - 1) // cache.block_size
    j = torch.arange(cache.max_blocks_per_seq)[None, :]
    writers = (j >= first[:, None]) & (j < last[:, None]) & (counts > 0)[:, None]
    bt = cache.block_table.cpu().to(torch.int64)
    bad = writers & ((bt < 0) | (bt >= cache.num_blocks))
    if bad.any():  # padding entries (often -1) are fine until a sequence grows into them
        b, jj = (int(i) for i in bad.nonzero()[0])
        _fail(f"block_table[{b}, {jj}]={int(bt[b, jj])} is out of range [0, {cache.num_blocks}): sequence {b} "
              "would append through it")
    refuse_shared_writes(cache, bt[writers], writers)
    slot_mapping = torch.cat([token_slots(cache, i, torch.arange(int(start[i]), int(start[i] + counts[i])))
                              for i in range(len(counts))])
    n = (writer or write)(cache, k_new, v_new, slot_mapping, shared_checked=True)
    cache.seq_lens += counts.to(cache.seq_lens.device, torch.int32)
    return n


def checked_counts(cache, counts) -> torch.Tensor:
    """``counts``: one non-negative integer per sequence (a list, tuple or 1-D int tensor), as host int64 ``[B]``."""
    if isinstance(counts, torch.Tensor):
        checks.int_tensor(counts, "counts", ndim=1, shape_hint="[B] (tokens per sequence)")
        counts = checks.readable_tensor(counts, "counts").tolist()
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        _fail(f"counts={checks.show_value(counts)}; expected one token count per sequence", TypeError)
    counts = torch.tensor([checks.integer(c, f"counts[{i}]", minimum=0) for i, c in enumerate(counts)],
                          dtype=torch.int64)
    if counts.shape != (cache.batch_size,):
        _fail(f"counts must have one entry per sequence ({cache.batch_size}); got {counts.numel()}")
    return counts


def write(cache, k_new, v_new, slot_mapping, *, shared_checked: bool = False) -> int:
    """:meth:`PagedKVCache.write`: quantize ``k_new``/``v_new`` ``[N, Hkv, D]`` into the slots of
    ``slot_mapping`` (< 0: skipped); ``shared_checked``: the caller refused shared pages already. Returns the
    saturated elements, also added to ``cache.saturated``."""
    slot_mapping = check_write(cache, k_new, v_new, slot_mapping, shared_checked=shared_checked)
    keep = slot_mapping >= 0
    slot_mapping, k_new, v_new = slot_mapping[keep], k_new[keep], v_new[keep]
    blk, off = slot_mapping // cache.block_size, slot_mapping % cache.block_size
    n_sat = 0
    for pages, scale_name, new in ((cache.k_pages, "k_scale", k_new), (cache.v_pages, "v_scale", v_new)):
        if not cache.is_fp8:
            # Clamp like the FP8 path: a bare cast turns fp16 overflow (|x| >= 65520) into inf. The
            # clamp is in fp32, which holds ±max exactly (in bf16, fp16's 65504 is 65536: inf in
            # fp16), and which the fused kernel computes in too.
            y = new.to(torch.float32)
            fmax, overflow = saturation_bounds(cache.dtype)
            n_sat += int((y.abs() >= overflow).sum())
            nhd_view(cache, pages)[blk, off] = y.clamp(-fmax, fmax).to(cache.dtype)
            continue
        scale = getattr(cache, scale_name)
        if cache.granularity == "token_head":
            s = compute_scale_unchecked(new, cache.fmt, "token_head", "amax", 100.0)  # rows checked; amax ignores the 100
            scale[blk, off] = s
            y = new.to(torch.float32) / s.unsqueeze(-1)
        else:
            y = new.to(torch.float32) / broadcast_scale(scale, 3, cache.granularity)
        data, sat = cast_saturating(y, cache.fmt)
        nhd_view(cache, pages)[blk, off] = data
        n_sat += sat
    cache.saturated += n_sat
    return n_sat
