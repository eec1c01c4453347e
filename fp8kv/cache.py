"""A paged KV cache, as serving engines lay it out.

Pages hold ``block_size`` tokens each; a sequence's tokens live in the pages its block-table row
names, in order. Token ``t`` of sequence ``b`` is at slot ``block_table[b, t // bs] * bs + t % bs``.

==============  =============================================  ======================================
tensor          shape                                          dtype
==============  =============================================  ======================================
k_pages/v_pages ``[num_blocks, block_size, Hkv, D]`` (NHD) or  bf16 / fp16 / float8_e4m3fn /
                ``[num_blocks, Hkv, block_size, D]`` (HND)     float8_e5m2
block_table     ``[batch, max_blocks_per_seq]``                int32
seq_lens        ``[batch]``                                    int32
k_scale/v_scale tensor ``[]``, head ``[Hkv]``, channel            float32 (FP8 only; 16-bit caches carry
                ``[Hkv, D]``, token_head                       a scale of 1.0)
                ``[num_blocks, block_size, Hkv]``
==============  =============================================  ======================================

Quantization follows ``fp8kv.quant`` (stored = Q(x / scale), dequantized = stored × scale).
Tensor / head / channel scales are static: fixed when the cache is built and applied to every
write, as engines do. Token-head scales are computed per written token and stored beside it.
"""

from __future__ import annotations

import math

import torch

from . import checks
from .checks import fail as _fail
from .formats import UNQUANTIZED_DTYPES, kv_dtype_info, saturation_bounds
from .quant import (
    GRANULARITIES,
    SCALE_BYTES,
    _check_method,
    _compute_scale,
    _explicit_scale,
    broadcast_scale,
    cast_saturating,
    kv_scale_bytes,
)
from .quant import scale_shape as scale_shape_of

__all__ = ["PagedKVCache", "LAYOUTS", "QUERY_DTYPES", "shuffled_block_table", "check_block_size"]

LAYOUTS = ("NHD", "HND")
QUERY_DTYPES = tuple(UNQUANTIZED_DTYPES.values())  # bf16, fp16, fp32 (fp32: the reference only)


def shuffled_block_table(num_blocks: int, batch: int, blocks_per_seq: int, seed: int, device) -> torch.Tensor:
    """``[batch, blocks_per_seq]`` int32 page ids, the first ``batch * blocks_per_seq`` of a seeded
    shuffle of ``num_blocks`` pages: scattered, as a serving engine's allocator leaves them."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:batch * blocks_per_seq]
    return perm.to(torch.int32).reshape(batch, blocks_per_seq).to(device)


def _check_data_device(dev: torch.device, what: str) -> None:
    """The cache's data lives on a CPU or CUDA device: its checks read the tables' contents, which a
    'meta' tensor does not have."""
    if dev.type not in ("cpu", "cuda"):
        _fail(f"{what} is on {dev}; a PagedKVCache holds its data on 'cpu' or a CUDA device")


def _show_scale(value) -> str:
    """A scale argument for a message: one line, even for a large tensor."""
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        return f"<{str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}>"
    return checks._show(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)


def _is_unit_scale(value, name) -> bool:
    """Whether a scale argument is None or 1 (a number or tensor of ones; other numbers are checked)."""
    if value is None:
        return True
    if isinstance(value, (str, bool)):
        return False
    return bool((checks.positive_fp32(value, name, expected="None or 1.0") == 1).all())


def check_block_size(block_size, name: str = "block_size") -> int:
    """Tokens per page: a power of two >= 8 (what every cache takes; kernels state their own limits)."""
    bs = checks.positive_int(block_size, name)
    if bs < 8 or bs & (bs - 1):
        _fail(f"{name}={bs} must be a power of two >= 8 (kernels state their own limits)")
    return bs


class PagedKVCache:
    """Paged K/V storage with block tables (see the module docstring for shapes).

    Build one with :meth:`from_dense` (ragged sequences scattered into shuffled pages),
    :meth:`empty`, or :func:`fp8kv.synthetic.random_paged_cache` (N(0, 1) pages built on the device);
    derive one with :meth:`clone` or :meth:`select`; add tokens with :meth:`write` / :meth:`append`;
    read back with :meth:`gather`.
    The constructor validates everything (one host sync). ``fp8kv.decode`` re-checks the tables
    (``check=True``, its default), so tables edited in place are caught before a kernel reads them.

    Pages may be shared *for reading* (prefix caching: several rows name the pages of one prompt).
    A write into a page that another block-table entry also references is refused with the page
    and the rows that share it: the cache does no copy-on-write, so give the writer its own page.
    """

    def __init__(self, k_pages, v_pages, block_table, seq_lens, kv_dtype="fp8_e4m3",
                 granularity="tensor", k_scale=None, v_scale=None, layout="NHD"):
        self.kv_dtype, self.dtype, self.fmt = kv_dtype_info(kv_dtype)
        if layout not in LAYOUTS:
            _fail(f"layout={layout!r}; expected one of {LAYOUTS}")
        if granularity not in GRANULARITIES:
            _fail(f"granularity={granularity!r}; expected one of {GRANULARITIES}")
        self.layout = layout
        self.granularity = granularity if self.fmt is not None else "tensor"
        self.k_pages, self.v_pages = k_pages, v_pages
        self.block_table, self.seq_lens = block_table, seq_lens
        self._validate_pages()
        dev = k_pages.device
        self.k_scale = self._init_scale(k_scale, "k_scale", dev)
        self.v_scale = self._init_scale(v_scale, "v_scale", dev)
        self.saturated = 0  # elements clamped to ±max by writes into this cache
        self.validate_tables()

    # ------------------------------------------------------------------ shapes
    @property
    def num_blocks(self) -> int:
        return self.k_pages.shape[0]

    @property
    def block_size(self) -> int:
        return self.k_pages.shape[1 if self.layout == "NHD" else 2]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2 if self.layout == "NHD" else 1]

    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    @property
    def is_fp8(self) -> bool:
        return self.fmt is not None

    def scale_shape(self) -> tuple:
        """Shape of k_scale / v_scale: ``fp8kv.quant.scale_shape`` of the pages as [blocks, block_size, Hkv, D]."""
        return scale_shape_of((self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim), self.granularity)

    # -------------------------------------------------------------- validation
    def _validate_pages(self):
        k, v = self.k_pages, self.v_pages
        for name, t in (("k_pages", k), ("v_pages", v)):
            if not isinstance(t, torch.Tensor):
                _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
            if t.dtype != self.dtype:
                _fail(f"{name} has dtype {t.dtype}, but kv_dtype={self.kv_dtype!r} stores {self.dtype}",
                      TypeError)
            if t.ndim != 4:
                _fail(f"{name} must be 4-D ({'[blocks, block_size, Hkv, D]' if self.layout == 'NHD' else '[blocks, Hkv, block_size, D]'}"
                      f" for layout {self.layout}); got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                _fail(f"{name} must be contiguous; call .contiguous() first")
        if k.shape != v.shape:
            _fail(f"k_pages {tuple(k.shape)} and v_pages {tuple(v.shape)} must have the same shape")
        if v.device != k.device:
            _fail(f"v_pages is on {v.device} but k_pages is on {k.device}")
        _check_data_device(k.device, "k_pages")
        check_block_size(self.block_size)
        for name, n in (("num_blocks", self.num_blocks), ("num_kv_heads", self.num_kv_heads),
                        ("head_dim", self.head_dim)):
            if n < 1:
                _fail(f"the pages have {name}={n} (shape {tuple(k.shape)}); every dimension must be >= 1")
        bt, sl = self.block_table, self.seq_lens
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

    def validate_arrays(self, contents: bool = True):
        """Check what may have been replaced since construction (the attributes are plain): the pages'
        dtypes, shapes and devices, the tables' dtypes and shapes, and each scale's dtype (fp32), shape
        (:meth:`scale_shape`) and device; with ``contents`` also that every scale is positive and finite
        (a host sync). A wrong-shaped scale would be read out of bounds by the kernels, a NaN or negative
        one would decode to NaN or to a sign-flipped answer. ``fp8kv.decode`` calls it on every call,
        with ``contents=check``."""
        self._validate_pages()
        shape = self.scale_shape() if self.is_fp8 else ()
        for name in ("k_scale", "v_scale"):
            s = getattr(self, name)
            checks.tensor(s, name, dtypes=(torch.float32,), device=self.device,
                          shape_hint=f"{shape} (fp32, granularity {self.granularity!r})")
            if tuple(s.shape) != tuple(shape):
                _fail(f"{name} has shape {tuple(s.shape)}; a {self.kv_dtype} cache of granularity {self.granularity!r} "
                      f"holds scales of shape {tuple(shape)}")
            if contents and s.numel():
                bad = ~torch.isfinite(s) | (s <= 0)
                if bool(bad.any()):
                    idx = tuple(int(i) for i in bad.nonzero()[0])
                    _fail(f"{name}{list(idx) if idx else ''}={float(s[idx])}; scales must be positive and finite")

    def validate_tables(self, *, nonempty: bool = False):
        """Check seq_lens against capacity and the used block-table entries against num_blocks; with
        ``nonempty``, also that every sequence holds a token (a decode's query attends at least itself).

        One host sync. The constructor calls it; so does ``fp8kv.decode`` (``nonempty`` with ``check=True``),
        and every method that reads the tables (:meth:`gather`, :meth:`slots`, the writes) checks what it reads.
        """
        lens = self._checked_tables()
        if nonempty and (lens < 1).any():
            i = int((lens < 1).nonzero()[0])
            _fail(f"seq_lens[{i}]={int(lens[i])}: decode needs at least one cached token per sequence "
                  "(empty sequences have no attention output)")

    def _checked_tables(self, row: int | None = None) -> torch.Tensor:
        """The tables as they are now (the attributes are plain: ``seq_lens`` may have been edited since
        construction), checked: every ``seq_lens`` (or ``row``'s alone) in ``[0, capacity]`` and the
        block-table entries holding their tokens inside the page pool. A ValueError names the first bad
        value, never an IndexError from reading through it. Returns those lengths as host int64 ``[B]``
        (``[1]`` for a row). One host sync."""
        self._validate_pages()  # a table swapped for one of another dtype, rank or device: named first
        rows = slice(None) if row is None else slice(row, row + 1)
        first = 0 if row is None else row
        sl = self.seq_lens[rows].cpu().to(torch.int64)
        cap = self.max_blocks_per_seq * self.block_size
        if (sl < 0).any():
            i = int((sl < 0).nonzero()[0])
            _fail(f"seq_lens[{first + i}]={int(sl[i])} is negative")
        if (sl > cap).any():
            i = int((sl > cap).nonzero()[0])
            _fail(f"seq_lens[{first + i}]={int(sl[i])} exceeds the capacity of its block-table row "
                  f"({self.max_blocks_per_seq} blocks x {self.block_size} = {cap} tokens)")
        used = torch.arange(self.max_blocks_per_seq)[None, :] < ((sl + self.block_size - 1)
                                                                  // self.block_size)[:, None]
        bt = self.block_table[rows].cpu().to(torch.int64)
        bad = used & ((bt < 0) | (bt >= self.num_blocks))
        if bad.any():
            b, j = (int(i) for i in bad.nonzero()[0])
            _fail(f"block_table[{first + b}, {j}]={int(bt[b, j])} is out of range [0, {self.num_blocks})")
        return sl

    def check_query(self, q) -> None:
        """Validate a decode query ``[B, Hq, D]`` against this cache (shape, dtype, device, GQA)."""
        if not isinstance(q, torch.Tensor):
            _fail(f"q must be a torch.Tensor [B, Hq, D], got {type(q).__name__}", TypeError)
        if q.ndim != 3:
            _fail(f"q must be [B, Hq, D] (one query token per sequence); got shape {tuple(q.shape)}")
        if q.dtype not in QUERY_DTYPES:
            _fail(f"q must be float16/bfloat16/float32, got {q.dtype}", TypeError)
        b, hq, d = q.shape
        if b != self.batch_size:
            _fail(f"q has batch {b} but the cache holds {self.batch_size} sequences")
        if d != self.head_dim:
            _fail(f"q has head_dim {d} but the cache has head_dim {self.head_dim}")
        if hq < 1 or hq % self.num_kv_heads:
            _fail(f"q has {hq} heads, not a multiple of the cache's {self.num_kv_heads} KV heads "
                  "(GQA needs Hq = group x Hkv)")
        if q.device != self.device:
            _fail(f"q is on {q.device} but the cache is on {self.device}")

    def _live_entries(self) -> torch.Tensor:
        """[B, max_blocks] bool: the block-table entries that hold some of a sequence's tokens."""
        sl = self._checked_tables()
        nblk = (sl + self.block_size - 1) // self.block_size
        return torch.arange(self.max_blocks_per_seq)[None, :] < nblk[:, None]

    def _refuse_shared_writes(self, pages: torch.Tensor, writers: torch.Tensor | None = None) -> None:
        """Refuse writes into pages that two or more block-table entries reference.

        ``pages``: the pages written. The references counted are the entries that hold tokens now,
        plus ``writers`` (``[B, max_blocks]`` bool: the entries an append writes through). A raw
        slot write names no entry, so only the entries holding tokens count there.
        """
        if not pages.numel():
            return
        bt = self.block_table.cpu().to(torch.int64)
        live = self._live_entries()
        refs = live | writers if writers is not None else live
        referenced = bt[refs]
        referenced = referenced[(referenced >= 0) & (referenced < self.num_blocks)]  # the rest is refused elsewhere
        counts = torch.bincount(referenced, minlength=self.num_blocks)
        targets = torch.unique(pages.cpu().to(torch.int64))
        shared = targets[counts[targets] >= 2]
        if shared.numel():
            page = int(shared[0])
            rows = ", ".join(f"block_table[{r}, {j}]" for r, j in ((bt == page) & refs).nonzero().tolist())
            _fail(f"a write into page {page} would change tokens that several block-table entries read "
                  f"({rows}); pages may be shared for reading only (no copy-on-write): give the "
                  "writing sequence a page of its own")

    def _init_scale(self, scale, name, device):
        shape = self.scale_shape()
        if not self.is_fp8:
            if scale is not None:
                s = checks.positive_fp32(scale, name, device=device, expected=f"None or 1.0 (kv_dtype="
                                         f"{self.kv_dtype!r} is a 16-bit cache: it stores values unscaled)")
                if not bool((s == 1).all()):
                    _fail(f"{name} must be 1.0 (or None) for 16-bit kv_dtype={self.kv_dtype!r} (it stores values "
                          f"unscaled); got {_show_scale(scale)}")
            return torch.ones((), dtype=torch.float32, device=device)
        if scale is None:
            scale = 1.0
        s = checks.positive_fp32(scale, name, device=device,
                                 expected=f"a positive float or a float tensor of shape {shape}")
        try:
            return torch.broadcast_to(s, shape).clone()  # owned: token_head writes update it in place
        except RuntimeError:
            _fail(f"{name} of shape {tuple(s.shape)} does not fit granularity {self.granularity!r}: "
                  f"expected shape {shape}")

    def _unused_scale(self, value, name) -> None:
        """Refuse a ``from_dense`` / ``empty`` scale this cache has no use for, rather than ignore it:
        a 16-bit cache stores values unscaled; token_head computes its scales as it writes."""
        if self.is_fp8:  # token_head
            if value is None or (isinstance(value, str) and value == "amax"):
                return  # what token_head does anyway
            why = "granularity='token_head' computes one scale per token and head as it writes (amax / fmt.max)"
            ok = "None (or 'amax')"
        else:
            if _is_unit_scale(value, name):
                return  # the scale a 16-bit cache carries
            why = f"kv_dtype={self.kv_dtype!r} is a 16-bit cache: it stores values unscaled"
            ok = "None (or 1.0)"
        _fail(f"{name}={_show_scale(value)}: {why}, so a given scale would be ignored; pass {name}={ok}")

    def _static_scale(self, value, name, x: torch.Tensor, percentile) -> torch.Tensor:
        """A tensor / head / channel scale from a ``from_dense`` argument: a method applied to the
        valid tokens ``x`` (None is ``"amax"``), or a given number / tensor (checked)."""
        if value is None:
            value = "amax"
        if isinstance(value, str):
            pct = _check_method(value, percentile, name)
            s = _compute_scale(x, self.fmt, self.granularity, value, pct)
        else:
            s = _explicit_scale(value, self.scale_shape(), self.granularity, self.device, name)
        return self._init_scale(s, name, self.device)

    # ------------------------------------------------------------ construction
    @classmethod
    def empty(cls, batch_size, max_seq_len, num_kv_heads, head_dim, *, block_size=16,
              kv_dtype="fp8_e4m3", granularity="tensor", k_scale=1.0, v_scale=1.0, layout="NHD",
              num_blocks=None, device="cpu", seed=0):
        """A cache with ``seq_lens = 0`` and every sequence's pages reserved (shuffled) up front.

        ``device``: ``"cpu"`` or a CUDA device. ``k_scale`` / ``v_scale``: the static scales of an FP8
        tensor / head / channel cache (a positive float or a tensor of the granularity's shape); for a
        16-bit cache and for token_head (scales computed as tokens are written) only None or 1.0.
        """
        name, dtype, fmt = kv_dtype_info(kv_dtype)
        batch_size = checks.positive_int(batch_size, "batch_size")
        max_seq_len = checks.positive_int(max_seq_len, "max_seq_len")
        num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
        head_dim = checks.positive_int(head_dim, "head_dim")
        block_size = check_block_size(block_size)
        checks.one_of(layout, "layout", LAYOUTS)
        seed = checks.integer(seed, "seed", minimum=-(2**63), maximum=2**64 - 1)  # torch.Generator.manual_seed's range
        device = checks.device(device)
        if device.type not in ("cpu", "cuda"):  # checks.device also lets 'meta' through: it holds no data
            _fail(f"device={str(device)!r}; a PagedKVCache holds its data on 'cpu' or a CUDA device")
        if fmt is not None and granularity == "token_head":  # a scale that every write overwrites
            for sname, value in (("k_scale", k_scale), ("v_scale", v_scale)):
                if not _is_unit_scale(value, sname):
                    _fail(f"{sname}={_show_scale(value)}: granularity='token_head' computes one scale per token "
                          f"and head as it writes, so a given scale would be ignored; pass {sname}=None (or 1.0)")
        bpseq = max(1, math.ceil(max_seq_len / block_size))
        need = batch_size * bpseq
        num_blocks = need if num_blocks is None else checks.positive_int(num_blocks, "num_blocks")
        if num_blocks < need:
            _fail(f"num_blocks={num_blocks} is too few: {batch_size} sequences x {bpseq} blocks need {need}")
        block_table = shuffled_block_table(num_blocks, batch_size, bpseq, seed, device)
        shape = ((num_blocks, block_size, num_kv_heads, head_dim) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_dim))
        k_pages = torch.zeros(shape, dtype=dtype, device=device)
        v_pages = torch.zeros(shape, dtype=dtype, device=device)
        seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        # The constructor checks the scales (a 16-bit cache takes None or 1.0, as token_head here).
        return cls(k_pages, v_pages, block_table, seq_lens, name, granularity, k_scale, v_scale, layout)

    def clone(self) -> PagedKVCache:
        """An independent copy: pages, tables and scales copied (through the validating constructor).

        The benchmark times a small cache through several clones so every call reads K/V from HBM.
        """
        c = PagedKVCache(self.k_pages.clone(), self.v_pages.clone(), self.block_table.clone(),
                         self.seq_lens.clone(), self.kv_dtype, self.granularity,
                         self.k_scale if self.is_fp8 else None, self.v_scale if self.is_fp8 else None, self.layout)
        c.saturated = self.saturated
        return c

    def select(self, indices) -> PagedKVCache:
        """A cache over the sequences ``indices`` (ints in ``[0, batch_size)``, a list or a 1-D int
        tensor), in that order, that *shares* this cache's pages (no K/V copy; tables and scales are
        the constructor's own). For checking a few sequences of a large batch against the oracle."""
        if isinstance(indices, torch.Tensor):
            if indices.ndim != 1 or indices.is_floating_point() or indices.dtype == torch.bool:
                _fail(f"indices must be a 1-D int tensor or a list of ints; got a {indices.dtype} tensor of "
                      f"shape {tuple(indices.shape)}", TypeError)
            indices = indices.tolist()
        if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
            _fail(f"indices={indices!r}; expected a list of sequence indices", TypeError)
        idx = [checks.integer(i, f"indices[{n}]", minimum=0, maximum=self.batch_size - 1)
               for n, i in enumerate(indices)]
        if not idx:
            _fail("indices is empty; give at least one sequence index")
        sel = torch.tensor(idx, device=self.device)
        return PagedKVCache(self.k_pages, self.v_pages, self.block_table[sel].contiguous(),
                            self.seq_lens[sel].contiguous(), self.kv_dtype, self.granularity,
                            self.k_scale if self.is_fp8 else None, self.v_scale if self.is_fp8 else None,
                            self.layout)

    @classmethod
    def from_dense(cls, k, v, seq_lens, block_size=16, kv_dtype="fp8_e4m3", granularity="tensor",
                   scale=None, seed=0, *, k_scale=None, v_scale=None, layout="NHD", max_seq_len=None,
                   num_blocks=None, percentile=99.9):
        """Scatter ragged sequences into shuffled pages, quantizing on the way in.

        Parameters
        ----------
        k, v : ``[B, max_len, Hkv, D]`` padded tensors, or sequences of ``[L_i, Hkv, D]`` tensors, all
            on one device (``"cpu"`` or CUDA), of finite values within float32's range (a float64
            value beyond it is refused: the quantizer computes in fp32).
        seq_lens : ints ``[B]`` (a list, or a 1-D int tensor: a batch of one is ``[n]``); only the
            first ``seq_lens[i]`` tokens of sequence i are stored.
        scale : how both scales are found (see ``fp8kv.quant.quantize``): None/"amax", "percentile",
            a float, or a tensor. ``k_scale`` / ``v_scale`` override it for K or V alone
            (e.g. ``k_scale="vllm_k", v_scale="vllm_v"``). Static scales are computed over the
            valid tokens only. Scales this cache would not use are refused, not ignored: token_head
            computes its own per token (only None or "amax" is accepted), a 16-bit cache has none
            (only None or 1.0).
        max_seq_len : reserve pages for this many tokens per sequence (room for appends).
        """
        if isinstance(k, torch.Tensor) and k.ndim != 4 or isinstance(v, torch.Tensor) and v.ndim != 4:
            _fail(f"k and v given as tensors must be 4-D [B, max_len, Hkv, D]; got shapes "
                  f"{tuple(getattr(k, 'shape', ()))} and {tuple(getattr(v, 'shape', ()))}")
        ks = list(k) if not isinstance(k, torch.Tensor) else [k[i] for i in range(k.shape[0])]
        vs = list(v) if not isinstance(v, torch.Tensor) else [v[i] for i in range(v.shape[0])]
        for name, seqs in (("k", ks), ("v", vs)):
            for i, t in enumerate(seqs):
                checks.tensor(t, f"{name}[{i}]", shape_hint="[len, Hkv, D]")
                if not t.is_floating_point():
                    _fail(f"{name}[{i}] must be a float tensor, got {t.dtype}", TypeError)
                first = (ks or vs)[0]  # checked above: a tensor
                if t.device != first.device:
                    _fail(f"{name}[{i}] is on {t.device} but {'k' if ks else 'v'}[0] is on {first.device}; "
                          "k and v must be on one device")
        if not isinstance(seq_lens, (torch.Tensor, list, tuple)):
            _fail(f"seq_lens={seq_lens!r} ({type(seq_lens).__name__}); expected a list or int tensor of lengths, "
                  "one per sequence", TypeError)
        if isinstance(seq_lens, torch.Tensor):
            if seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
                _fail(f"seq_lens has dtype {seq_lens.dtype}; expected integer lengths", TypeError)
            if seq_lens.ndim != 1:  # a 0-d tensor is a length, not a batch of them
                _fail(f"seq_lens has shape {tuple(seq_lens.shape)}; expected a 1-D tensor [B] (or a list) of "
                      "lengths, one per sequence (a batch of one is [n])")
            seq_lens = seq_lens.tolist()
        lens = [checks.integer(x, f"seq_lens[{i}]") for i, x in enumerate(seq_lens)]
        if max_seq_len is not None:
            checks.positive_int(max_seq_len, "max_seq_len")
        for name, value in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
            if isinstance(value, bool):
                _fail(f"{name}={value!r} (bool); expected a scale method such as 'amax', a positive float "
                      "or a float tensor", TypeError)
        if scale is not None and k_scale is not None and v_scale is not None:
            _fail(f"scale={_show_scale(scale)} would be ignored: k_scale and v_scale override it for K and V; "
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
        _check_data_device(device, "k")
        cap = max(max(lens), max_seq_len or 0, 1)
        cache = cls.empty(len(lens), cap, hkv, d, block_size=block_size, kv_dtype=kv_dtype,
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
            cache.k_scale = cache._static_scale(*specs[0], k_all, percentile)
            cache.v_scale = cache._static_scale(*specs[1], v_all, percentile)
        else:
            for value, name in specs:
                cache._unused_scale(value, name)
        cache.append_tokens(k_all, v_all, torch.tensor(lens, dtype=torch.int32))
        return cache

    # ------------------------------------------------------------------ writes
    def slots(self, seq: int, positions) -> torch.Tensor:
        """Slot ids (``block * block_size + offset``) of ``positions`` in sequence ``seq``.

        ``seq``: an int in ``[0, batch_size)``. ``positions``: ints in ``[0, max_blocks_per_seq x
        block_size)`` (a list, or a 1-D int32/int64 tensor), whose block-table entries name a page.
        Returns int64 slots ``[N]`` on the cache's device. One host sync.
        """
        seq = checks.integer(seq, "seq", minimum=0, maximum=self.batch_size - 1)
        self._validate_pages()  # the tables read below: named if swapped for another dtype or shape
        cap = self.max_blocks_per_seq * self.block_size
        if isinstance(positions, (list, tuple)):
            positions = torch.tensor([checks.integer(p, f"positions[{i}]") for i, p in enumerate(positions)],
                                     dtype=torch.int64)
        checks.int_tensor(positions, "positions", ndim=1, shape_hint="[N] (token positions)")
        pos = positions.cpu().to(torch.int64)
        bad = (pos < 0) | (pos >= cap)  # else -1 silently indexes the row's last entry
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            _fail(f"positions[{i}]={int(pos[i])} is outside [0, {cap}): sequence {seq}'s block-table row holds "
                  f"{self.max_blocks_per_seq} blocks x {self.block_size} tokens")
        pages = self.block_table[seq].cpu().to(torch.int64)[pos // self.block_size]
        bad = (pages < 0) | (pages >= self.num_blocks)  # padding (-1): a negative slot, which writes skip
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            _fail(f"positions[{i}]={int(pos[i])} lies in block_table[{seq}, {int(pos[i]) // self.block_size}]="
                  f"{int(pages[i])}, which is not a page in [0, {self.num_blocks})")
        return self._slots(seq, positions.to(self.device))

    def _slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`slots` of positions already checked."""
        positions = positions.to(self.block_table.device, torch.int64)
        blocks = self.block_table[seq].to(torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def append_tokens(self, k_new, v_new, counts):
        """Append ``counts[i]`` tokens to each sequence i (``k_new``: their rows, concatenated in order).

        Refuses (before writing anything) counts that are negative or not integers, appends past a
        row's capacity, and appends into a page that another block-table entry also references.
        """
        if not isinstance(counts, torch.Tensor):
            counts = [checks.integer(c, f"counts[{i}]") for i, c in enumerate(counts)]
        elif counts.is_floating_point() or counts.dtype == torch.bool:
            _fail(f"counts has dtype {counts.dtype}; expected integer token counts", TypeError)
        counts = torch.as_tensor(counts, dtype=torch.int64).cpu()
        if counts.shape != (self.batch_size,):
            _fail(f"counts must have one entry per sequence ({self.batch_size}); got shape {tuple(counts.shape)}")
        if (counts < 0).any():
            i = int((counts < 0).nonzero()[0])
            _fail(f"counts[{i}]={int(counts[i])}; expected token counts >= 0")
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[0] != int(counts.sum()):
                _fail(f"{name} has {t.shape[0]} rows but counts sum to {int(counts.sum())}; give one row per new token")
        start = self._checked_tables()  # a negative length edited in would append at the row's end
        cap = self.max_blocks_per_seq * self.block_size
        if (start + counts > cap).any():
            i = int((start + counts > cap).nonzero()[0])
            _fail(f"sequence {i}: seq_len {int(start[i])} + {int(counts[i])} new tokens exceeds its "
                  f"capacity of {cap} tokens; build the cache with a larger max_seq_len")
        slot_mapping = torch.cat([self._slots(i, torch.arange(int(start[i]), int(start[i] + counts[i])))
                                  for i in range(len(counts))])
        first, last = start // self.block_size, (start + counts + self.block_size - 1) // self.block_size
        j = torch.arange(self.max_blocks_per_seq)[None, :]
        writers = (j >= first[:, None]) & (j < last[:, None]) & (counts > 0)[:, None]
        bt = self.block_table.cpu().to(torch.int64)
        bad = writers & ((bt < 0) | (bt >= self.num_blocks))
        if bad.any():  # padding entries (often -1) are fine until a sequence grows into them
            b, jj = (int(i) for i in bad.nonzero()[0])
            _fail(f"block_table[{b}, {jj}]={int(bt[b, jj])} is out of range [0, {self.num_blocks}): sequence {b} "
                  "would append through it")
        self._refuse_shared_writes(bt[writers], writers)
        n = self._write(k_new, v_new, slot_mapping, shared_checked=True)
        self.seq_lens += counts.to(self.seq_lens.device, torch.int32)
        return n

    def append(self, k_new, v_new):
        """Append one token per sequence: ``k_new``, ``v_new`` ``[B, Hkv, D]``. Returns saturations."""
        return self.append_tokens(k_new, v_new, torch.ones(self.batch_size, dtype=torch.int64))

    def _check_rows(self, name, t, finite: bool = True):
        exp = (self.num_kv_heads, self.head_dim)
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if t.ndim != 3 or tuple(t.shape[1:]) != exp:
            _fail(f"{name} must be [N, {exp[0]}, {exp[1]}] (tokens, Hkv, D); got {tuple(t.shape)}")
        if not t.is_floating_point():
            _fail(f"{name} must be a float tensor, got {t.dtype}", TypeError)
        if t.device != self.device:
            _fail(f"{name} is on {t.device} but the cache is on {self.device}")
        if finite and not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            _fail(f"{name} has non-finite values (first at index {tuple(bad)}); the cache stores finite values only")
        if finite:  # float64 past fp32's range would be inf in the fp32 arithmetic below (an inf scale, NaN reads)
            checks.fp32_range_tensor(t, name)

    def check_write(self, k_new, v_new, slot_mapping, *, contents: bool = True,
                    shared_checked: bool = False) -> torch.Tensor:
        """Validate a write of ``k_new``/``v_new`` ``[N, Hkv, D]`` into ``slot_mapping`` ``[N]``.

        Returns the slots as int64 on the cache's device. Shapes, dtypes and devices are checked
        always; with ``contents`` (one host sync) also: finite rows, every slot < num_blocks x
        block_size (< 0: skipped), and no written page referenced by two block-table entries
        holding tokens (unless the caller already checked that: ``shared_checked``).
        """
        self._check_rows("k_new", k_new, contents)
        self._check_rows("v_new", v_new, contents)
        if isinstance(slot_mapping, (list, tuple)):
            slot_mapping = torch.as_tensor([checks.integer(x, f"slot_mapping[{i}]")
                                            for i, x in enumerate(slot_mapping)], dtype=torch.int64,
                                           device=self.device)
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
            what = slot_mapping.dtype if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__
            _fail(f"slot_mapping must be an int32 or int64 tensor [N] (or a list of ints), got {what}", TypeError)
        if tuple(slot_mapping.shape) != (k_new.shape[0],) or v_new.shape != k_new.shape:
            _fail(f"slot_mapping {tuple(slot_mapping.shape)}, k_new {tuple(k_new.shape)} and v_new "
                  f"{tuple(v_new.shape)} must agree on N")
        if slot_mapping.device != self.device:
            _fail(f"slot_mapping is on {slot_mapping.device} but the cache is on {self.device}")
        slots = slot_mapping.to(torch.int64)
        if contents:
            total = self.num_blocks * self.block_size
            if slots.numel() and int(slots.max()) >= total:
                _fail(f"slot_mapping has slot {int(slots.max())} >= num_blocks x block_size = {total}")
            if not shared_checked:
                self._refuse_shared_writes(slots[slots >= 0] // self.block_size)
        return slots

    def _nhd(self, pages):
        """[blocks, block_size, Hkv, D] view of pages, whatever the layout."""
        return pages if self.layout == "NHD" else pages.transpose(1, 2)

    def write(self, k_new, v_new, slot_mapping) -> int:
        return self._write(k_new, v_new, slot_mapping)

    def _write(self, k_new, v_new, slot_mapping, shared_checked: bool = False) -> int:
        """Quantize ``k_new``/``v_new`` (``[N, Hkv, D]``) into the slots named by ``slot_mapping``.

        Slots < 0 are skipped (the engines' padding convention). Static scales are used for
        tensor / head / channel granularity; token_head computes one scale per token and head
        (amax / fmt.max) and stores it beside the token. Returns the number of saturated elements
        (also accumulated in ``self.saturated``). The torch path; ``fp8kv.ops.write_cache`` fuses it.
        Refused: non-finite rows, slots that are not integers or lie past the pool, and writes into
        a page that two block-table entries holding tokens reference (see the class docstring).
        """
        slot_mapping = self.check_write(k_new, v_new, slot_mapping, shared_checked=shared_checked)
        keep = slot_mapping >= 0
        slot_mapping, k_new, v_new = slot_mapping[keep], k_new[keep], v_new[keep]
        blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
        n_sat = 0
        for pages, scale_name, new in ((self.k_pages, "k_scale", k_new), (self.v_pages, "v_scale", v_new)):
            if not self.is_fp8:
                # Clamp like the FP8 path: a bare cast turns fp16 overflow (|x| >= 65520) into inf. The
                # clamp is in fp32, which holds ±max exactly (in bf16, fp16's 65504 is 65536: inf in
                # fp16), and which the fused kernel computes in too.
                y = new.to(torch.float32)
                fmax, overflow = saturation_bounds(self.dtype)
                n_sat += int((y.abs() >= overflow).sum())
                self._nhd(pages)[blk, off] = y.clamp(-fmax, fmax).to(self.dtype)
                continue
            scale = getattr(self, scale_name)
            if self.granularity == "token_head":
                s = _compute_scale(new, self.fmt, "token_head", "amax", 100.0)  # rows checked; amax ignores the 100
                scale[blk, off] = s
                y = new.to(torch.float32) / s.unsqueeze(-1)
            else:
                y = new.to(torch.float32) / broadcast_scale(scale, 3, self.granularity)
            data, sat = cast_saturating(y, self.fmt)
            self._nhd(pages)[blk, off] = data
            n_sat += sat
        self.saturated += n_sat
        return n_sat

    # ------------------------------------------------------------------- reads
    def gather(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of sequence ``i``: fp32 ``[seq_lens[i], Hkv, D]``.

        ``seq_lens[i]`` and the block-table entries holding its tokens are checked as they are now
        (they may have been edited since construction): a ValueError names a bad one."""
        i = checks.integer(i, "i")
        if not 0 <= i < self.batch_size:
            _fail(f"sequence index {i} is out of range [0, {self.batch_size})")
        n = int(self._checked_tables(row=i)[0])
        pos = torch.arange(n, device=self.device)
        slot = self._slots(i, pos)  # positions < seq_lens[i]: inside the row, through entries just checked
        blk, off = slot // self.block_size, slot % self.block_size
        out = []
        for pages, scale in ((self.k_pages, self.k_scale), (self.v_pages, self.v_scale)):
            x = self._nhd(pages)[blk, off].to(torch.float32)
            if self.granularity == "token_head":
                x = x * scale[blk, off].unsqueeze(-1)
            else:
                x = x * broadcast_scale(scale, 3, self.granularity)
            out.append(x)
        return out[0], out[1]

    # ------------------------------------------------------------------- sizes
    @property
    def scale_nbytes(self) -> int:
        if not self.is_fp8:
            return 0
        return (self.k_scale.numel() + self.v_scale.numel()) * SCALE_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated pages plus scales (block tables and seq_lens not counted)."""
        return (self.k_pages.numel() * self.k_pages.element_size() * 2) + self.scale_nbytes

    def bytes_per_token(self) -> float:
        """Bytes of K+V (+ per-token scales) per cached token in one layer."""
        per = 2 * self.num_kv_heads * self.head_dim * self.k_pages.element_size()
        _, scales = kv_scale_bytes(self.granularity if self.is_fp8 else None, num_layers=1,
                                   num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        return per + scales

    def __repr__(self) -> str:
        return (f"PagedKVCache(kv_dtype={self.kv_dtype}, granularity={self.granularity}, layout={self.layout}, "
                f"batch={self.batch_size}, blocks={self.num_blocks}x{self.block_size}, Hkv={self.num_kv_heads}, "
                f"D={self.head_dim}, seq_lens={self.seq_lens.tolist() if self.batch_size <= 8 else '...'})")
