"""The checks of a :class:`~fp8kv.cache.PagedKVCache`: its pages, tables and scales (which are plain
attributes, so checked again where they are read), a decode query against it, and a write into it
(rows, slots, and pages that several block-table entries share)."""

from __future__ import annotations

import torch

from .. import checks
from ..checks import fail as _fail
from ..formats import UNQUANTIZED_DTYPES

__all__ = ["LAYOUTS", "QUERY_DTYPES", "check_block_size", "check_data_device", "show_scale", "is_unit_scale",
           "check_disjoint", "check_pages", "check_arrays", "check_tables", "checked_tables", "check_query",
           "live_entries", "refuse_shared_writes", "check_rows", "check_write"]

LAYOUTS = ("NHD", "HND")
QUERY_DTYPES = tuple(UNQUANTIZED_DTYPES.values())  # bf16, fp16, fp32 (fp32: the reference only)


def check_block_size(block_size, name: str = "block_size") -> int:
    """Tokens per page: any positive int, as engines use them (SGLang 1, vLLM 16, hybrid models' odd sizes;
    FlashInfer takes any); a kernel that needs more states its own limit."""
    return checks.positive_int(block_size, name)


def check_data_device(dev: torch.device, what: str) -> None:
    """The cache's data lives on a CPU or CUDA device: its checks read the tables' contents, which a
    'meta' tensor does not have."""
    if dev.type not in ("cpu", "cuda"):
        _fail(f"{what} is on {dev}; a PagedKVCache holds its data on 'cpu' or a CUDA device")


def show_scale(value) -> str:
    """A scale argument for a message: one line, even for a large tensor."""
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        return f"<{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}>"
    return checks.show_value(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)


def is_unit_scale(value, name) -> bool:
    """Whether a scale argument is None or 1 (a number or tensor of ones; other numbers are checked)."""
    if value is None:
        return True
    if isinstance(value, (str, bool)):
        return False
    return bool((checks.positive_fp32(value, name, expected="None or 1.0") == 1).all())


def check_disjoint(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Two contiguous arrays on one device that writes fill separately (K's and V's) hold memory of their own:
    one tensor passed twice (``k = v = torch.zeros(...)``), or overlapping views, has V's writes overwrite K's."""
    a_end, b_end = a.data_ptr() + a.numel() * a.element_size(), b.data_ptr() + b.numel() * b.element_size()
    if a.numel() and b.numel() and a.data_ptr() < b_end and b.data_ptr() < a_end:
        _fail(f"{a_name} and {b_name} share memory (the same tensor, or overlapping views of one); expected "
              f"separate tensors, e.g. {b_name}={a_name}.clone()")


def check_pages(cache) -> None:
    """The pages' and tables' types, dtypes, ranks, shapes, devices and contiguity (no host sync)."""
    k, v = cache.k_pages, cache.v_pages
    for name, t in (("k_pages", k), ("v_pages", v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dtype != cache.dtype:
            _fail(f"{name} has dtype {t.dtype}, but kv_dtype={cache.kv_dtype!r} stores {cache.dtype}",
                  TypeError)
        if t.ndim != 4:
            _fail(f"{name} must be 4-D ({'[blocks, block_size, Hkv, D]' if cache.layout == 'NHD' else '[blocks, Hkv, block_size, D]'}"
                  f" for layout {cache.layout}); got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous; call .contiguous() first")
    if k.shape != v.shape:
        _fail(f"k_pages {tuple(k.shape)} and v_pages {tuple(v.shape)} must have the same shape")
    if v.device != k.device:
        _fail(f"v_pages is on {v.device} but k_pages is on {k.device}")
    check_data_device(k.device, "k_pages")
    check_disjoint("k_pages", k, "v_pages", v)
    check_block_size(cache.block_size)
    for name, n in (("num_blocks", cache.num_blocks), ("num_kv_heads", cache.num_kv_heads),
                    ("head_dim", cache.head_dim)):
        if n < 1:
            _fail(f"the pages have {name}={n} (shape {tuple(k.shape)}); every dimension must be >= 1")
    bt, sl = cache.block_table, cache.seq_lens
    for name, t, nd in (("block_table", bt, 2), ("seq_lens", sl, 1)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.dtype != torch.int32:
            _fail(f"{name} must be int32, got {t.dtype}; use .to(torch.int32)", TypeError)
        if t.ndim != nd:
            _fail(f"{name} must be {nd}-D, got shape {tuple(t.shape)}")
        if t.device != k.device:
            _fail(f"{name} is on {t.device} but the pages are on {k.device}; move it with .to()")
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous; call .contiguous() first")
    if sl.shape[0] != bt.shape[0]:
        _fail(f"seq_lens has {sl.shape[0]} entries but block_table has {bt.shape[0]} rows")
    if bt.shape[0] < 1 or bt.shape[1] < 1:
        _fail(f"block_table has shape {tuple(bt.shape)}; a cache needs at least one sequence and one "
              "block per sequence")


def check_arrays(cache, contents: bool = True) -> None:
    """:meth:`PagedKVCache.validate_arrays`: the pages and tables (:func:`check_pages`), and each scale's dtype,
    shape and device; with ``contents`` also its values, positive and finite (a host sync)."""
    contents = checks.flag(contents, "contents")
    check_pages(cache)
    shape = cache.scale_shape() if cache.is_fp8 else ()
    for name in ("k_scale", "v_scale"):
        s = getattr(cache, name)
        checks.tensor(s, name, dtypes=(torch.float32,), device=cache.device,
                      shape_hint=f"{shape} (fp32, granularity {cache.granularity!r})")
        if tuple(s.shape) != tuple(shape):
            _fail(f"{name} has shape {tuple(s.shape)}; a {cache.kv_dtype} cache of granularity {cache.granularity!r} "
                  f"holds scales of shape {tuple(shape)}")
        if contents and s.numel():
            bad = ~torch.isfinite(s) | (s <= 0)
            if bool(bad.any()):
                idx = tuple(int(i) for i in bad.nonzero()[0])
                _fail(f"{name}{list(idx) if idx else ''}={float(s[idx])}; scales must be positive and finite")


def check_tables(cache, *, nonempty: bool = False) -> None:
    """:meth:`PagedKVCache.validate_tables`: :func:`checked_tables`, and with ``nonempty`` a token in every
    sequence."""
    nonempty = checks.flag(nonempty, "nonempty")
    lens = checked_tables(cache)
    if nonempty and (lens < 1).any():
        i = int((lens < 1).nonzero()[0])
        _fail(f"seq_lens[{i}]={int(lens[i])}: decode needs at least one cached token per sequence "
              "(empty sequences have no attention output)")


def checked_tables(cache, row: int | None = None) -> torch.Tensor:
    """The tables as they are now (the attributes are plain: ``seq_lens`` may have been edited since
    construction), checked: every ``seq_lens`` (or ``row``'s alone) in ``[0, capacity]`` and the
    block-table entries holding their tokens inside the page pool. A ValueError names the first bad
    value, never an IndexError from reading through it. Returns those lengths as host int64 ``[B]``
    (``[1]`` for a row). One host sync."""
    check_pages(cache)  # a table swapped for one of another dtype, rank or device: named first
    rows = slice(None) if row is None else slice(row, row + 1)
    first = 0 if row is None else row
    sl = cache.seq_lens[rows].cpu().to(torch.int64)
    cap = cache.max_blocks_per_seq * cache.block_size
    if (sl < 0).any():
        i = int((sl < 0).nonzero()[0])
        _fail(f"seq_lens[{first + i}]={int(sl[i])} is negative")
    if (sl > cap).any():
        i = int((sl > cap).nonzero()[0])
        _fail(f"seq_lens[{first + i}]={int(sl[i])} exceeds the capacity of its block-table row "
              f"({cache.max_blocks_per_seq} blocks x {cache.block_size} = {cap} tokens)")
    used = torch.arange(cache.max_blocks_per_seq)[None, :] < ((sl + cache.block_size - 1)
                                                               // cache.block_size)[:, None]
    bt = cache.block_table[rows].cpu().to(torch.int64)
    bad = used & ((bt < 0) | (bt >= cache.num_blocks))
    if bad.any():
        b, j = (int(i) for i in bad.nonzero()[0])
        _fail(f"block_table[{first + b}, {j}]={int(bt[b, j])} is out of range [0, {cache.num_blocks})")
    return sl


def check_query(cache, q, *, one_per_sequence: bool = True) -> None:
    """A query against ``cache``: a tensor ``[B, Hq, D]`` (a decode: one token per sequence) or, with
    ``one_per_sequence=False``, ``[total_q, Hq, D]`` (an attend: the new tokens of every sequence, back to
    back); float16 / bfloat16 / float32, the cache's head dim, a multiple of its KV heads (GQA: query head h
    reads KV head ``h // (Hq // Hkv)``), on the cache's device."""
    one_per_sequence = checks.flag(one_per_sequence, "one_per_sequence")
    hint = ("[B, Hq, D] (one query token per sequence)" if one_per_sequence
            else "[total_q, Hq, D] (the new tokens of every sequence, back to back)")
    checks.tensor(q, "q", ndim=3, dtypes=QUERY_DTYPES, shape_hint=hint)
    rows, hq, d = q.shape
    shape = f"(q's shape {tuple(q.shape)})"
    if one_per_sequence and rows != cache.batch_size:
        _fail(f"q has batch {rows} but the cache holds {cache.batch_size} sequences {shape}")
    if d != cache.head_dim:
        _fail(f"q has head_dim {d} but the cache has head_dim {cache.head_dim} {shape}")
    if hq < 1 or hq % cache.num_kv_heads:
        _fail(f"q has {hq} heads, not a multiple of the cache's {cache.num_kv_heads} KV heads (GQA needs "
              f"Hq = group x Hkv) {shape}")
    if q.device != cache.device:
        _fail(f"q is on {q.device} but the cache is on {cache.device}; move it with .to()")


def live_entries(cache) -> torch.Tensor:
    """[B, max_blocks] bool: the block-table entries that hold some of a sequence's tokens."""
    sl = checked_tables(cache)
    nblk = (sl + cache.block_size - 1) // cache.block_size
    return torch.arange(cache.max_blocks_per_seq)[None, :] < nblk[:, None]


def refuse_shared_writes(cache, pages: torch.Tensor, writers: torch.Tensor | None = None) -> None:
    """Refuse writes into pages that two or more block-table entries reference.

    ``pages``: the pages written. The references counted are the entries that hold tokens now,
    plus ``writers`` (``[B, max_blocks]`` bool: the entries an append writes through). A raw
    slot write names no entry, so only the entries holding tokens count there.
    """
    if not pages.numel():
        return
    bt = cache.block_table.cpu().to(torch.int64)
    live = live_entries(cache)
    refs = live | writers if writers is not None else live
    referenced = bt[refs]
    referenced = referenced[(referenced >= 0) & (referenced < cache.num_blocks)]  # the rest is refused elsewhere
    counts = torch.bincount(referenced, minlength=cache.num_blocks)
    targets = torch.unique(pages.cpu().to(torch.int64))
    shared = targets[counts[targets] >= 2]
    if shared.numel():
        page = int(shared[0])
        rows = ", ".join(f"block_table[{r}, {j}]" for r, j in ((bt == page) & refs).nonzero().tolist())
        _fail(f"a write into page {page} would change tokens that several block-table entries read "
              f"({rows}); pages may be shared for reading only (no copy-on-write): give the "
              "writing sequence a page of its own")


def check_rows(cache, name, t, finite: bool = True) -> None:
    """Rows to write, ``[N, Hkv, D]`` float on the cache's device; with ``finite`` also finite and within fp32."""
    exp = (cache.num_kv_heads, cache.head_dim)
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.ndim != 3 or tuple(t.shape[1:]) != exp:
        _fail(f"{name} must be [N, {exp[0]}, {exp[1]}] (tokens, Hkv, D); got {tuple(t.shape)}")
    if t.dtype not in checks.FLOAT_DTYPES:  # FP8 rows refused too: the cache quantizes float rows itself
        _fail(f"{name} has dtype {t.dtype}; expected one of {checks.FLOAT_DTYPES}", TypeError)
    if t.device != cache.device:
        _fail(f"{name} is on {t.device} but the cache is on {cache.device}")
    if finite and not torch.isfinite(t).all():
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        _fail(f"{name} has non-finite values (first at index {tuple(bad)}); the cache stores finite values only")
    if finite:  # float64 past fp32's range would be inf in the fp32 arithmetic below (an inf scale, NaN reads)
        checks.fp32_range_tensor(t, name)


def check_write(cache, k_new, v_new, slot_mapping, *, contents: bool = True,
                shared_checked: bool = False) -> torch.Tensor:
    """:meth:`PagedKVCache.check_write`: the rows, the slots (int64 on the cache's device, returned) and, with
    ``contents``, the slots' range and the pages they write (unless ``shared_checked``)."""
    contents = checks.flag(contents, "contents")  # a truthy stand-in such as "no" would skip checks
    shared_checked = checks.flag(shared_checked, "shared_checked")
    check_rows(cache, "k_new", k_new, contents)
    check_rows(cache, "v_new", v_new, contents)
    if isinstance(slot_mapping, (list, tuple)):
        slot_mapping = torch.as_tensor([checks.integer(x, f"slot_mapping[{i}]")
                                        for i, x in enumerate(slot_mapping)], dtype=torch.int64,
                                       device=cache.device)
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        what = slot_mapping.dtype if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__
        _fail(f"slot_mapping must be an int32 or int64 tensor [N] (or a list of ints), got {what}", TypeError)
    if tuple(slot_mapping.shape) != (k_new.shape[0],) or v_new.shape != k_new.shape:
        _fail(f"slot_mapping {tuple(slot_mapping.shape)}, k_new {tuple(k_new.shape)} and v_new "
              f"{tuple(v_new.shape)} must agree on N")
    if slot_mapping.device != cache.device:
        _fail(f"slot_mapping is on {slot_mapping.device} but the cache is on {cache.device}")
    slots = slot_mapping.to(torch.int64)
    if contents:
        total = cache.num_blocks * cache.block_size
        if slots.numel() and int(slots.max()) >= total:
            _fail(f"slot_mapping has slot {int(slots.max())} >= num_blocks x block_size = {total}")
        live = slots[slots >= 0]
        values, counts = torch.unique(live, return_counts=True)
        if live.numel() and int(counts.max()) > 1:  # which row a GPU keeps is undefined, and codes and scales could differ
            first = int(values[counts > 1][0])
            rows = (slots == first).nonzero().flatten().tolist()
            _fail(f"slot_mapping writes slot {first} {len(rows)} times (rows {rows}); expected each slot at most once "
                  "in a write")
        if not shared_checked:
            refuse_shared_writes(cache, slots[slots >= 0] // cache.block_size)
    return slots
