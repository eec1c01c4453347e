"""A paged KV cache in KIVI's 4-bit format (``kivi4_g{G}``: :mod:`fp8kv.kv_formats`): :class:`KIVIPagedKVCache`.

KIVI (Liu et al. 2024) quantizes keys per channel over a group of ``G`` tokens and values per token over groups
of ``G`` channels, both asymmetric (an fp16 scale and zero point per group). A key's scale spans tokens, so a
key is stored only when its group is full: until then it waits, in the model's 16-bit type, in its sequence's
residual (KIVI's full-precision window, here exactly the unfilled group). Pages hold whole key groups
(``block_size`` a multiple of ``G``), so a group's codes and its scale lie in one page. Per cache:

==============  ============================================  ======================================
array           shape                                         dtype
==============  ============================================  ======================================
k_pages/v_pages ``[num_blocks, block_size, Hkv, D // 2]``      uint8, two 4-bit codes a byte
k_scales/       ``[num_blocks, block_size // G, Hkv, D]``      fp16: a channel's over one key group
k_zeros
v_scales/       ``[num_blocks, block_size, Hkv, D // G]``      fp16: a token's per group of channels
v_zeros
k_residual      ``[B, G, Hkv, D]``                            ``residual_dtype`` (fp16 by default)
==============  ============================================  ======================================

Every key passes through the residual (rounded to its dtype) and is quantized from there when its group fills,
however the tokens were batched; every write quantizes with :func:`fp8kv.kv_formats.quantize` itself, so the
bytes are bit for bit what it gives for the same group (keys) or token (values). :meth:`KIVIPagedKVCache.gather`
is the fp32 oracle's read: the full groups dequantized, the residual as it is.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from .. import checks
from ..checks import fail as _fail
from ..device import refuse_past_free_memory
from ..kv_formats import KIVI_GROUPS, dequantize, kivi, kv_footprint, quantize
from . import validation
from .construction import dense_rows, pool_blocks, pool_request, reserved_tokens, shuffled_block_table
from .reading import token_slots
from .tables import NHDPagedTables
from .writing import append_tokens as _append_tokens
from .writing import checked_counts

__all__ = ["KIVIPagedKVCache", "RESIDUAL_DTYPES"]

RESIDUAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the unfilled key group's type


class KIVIPagedKVCache(NHDPagedTables):
    """Paged K/V in KIVI's 4-bit format with groups of ``group`` (see the module for shapes).

    Build one with :meth:`empty` or :meth:`from_dense`; add tokens with :meth:`append_tokens` / :meth:`append`;
    read a sequence back with :meth:`gather` (fp32). The constructor validates every array and the tables.
    """

    dtype = torch.uint8  # the pages' codes, as check_pages holds them

    def __init__(self, group, k_pages, v_pages, k_scales, k_zeros, v_scales, v_zeros, k_residual, block_table,
                 seq_lens):
        self.group = checks.one_of(checks.integer(group, "group"), "group", KIVI_GROUPS)
        self.fmt = kivi(self.group)
        self.kv_dtype = self.fmt.name
        self.k_pages, self.v_pages, self.block_table, self.seq_lens = k_pages, v_pages, block_table, seq_lens
        self.k_scales, self.k_zeros, self.v_scales, self.v_zeros = k_scales, k_zeros, v_scales, v_zeros
        self.k_residual = k_residual
        self.saturated = 0  # elements clamped to the largest code by writes into this cache
        self.underflow = 0  # non-zero elements written that decode to 0
        self.validate_arrays()
        self.validate_tables()

    # ------------------------------------------------------------------ shapes
    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3] * 2

    def shapes(self) -> dict[str, tuple]:
        """Each array's shape for these pages (see the module)."""
        return _shapes(self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim, self.group,
                       self.batch_size)

    def validate_arrays(self, contents: bool = True) -> None:
        """The pages and tables (:func:`fp8kv.cache.validation.check_pages`), ``block_size`` and ``head_dim`` against
        the group, every other array's dtype, shape and device; with ``contents`` every scale positive and finite and
        every zero point finite (a host sync)."""
        contents = checks.flag(contents, "contents")
        validation.check_pages(self)
        _check_geometry(self.block_size, self.head_dim, self.group)
        want = self.shapes()
        for name in ("k_pages", "k_scales", "k_zeros", "v_scales", "v_zeros", "k_residual"):
            t = getattr(self, name)
            dtypes = (torch.uint8,) if name == "k_pages" else RESIDUAL_DTYPES if name == "k_residual" \
                else (torch.float16,)
            checks.tensor(t, name, dtypes=dtypes, device=self.device)
            if tuple(t.shape) != want[name]:
                _fail(f"{name} has shape {tuple(t.shape)}; pages {tuple(self.k_pages.shape)} with group {self.group} "
                      f"and {self.batch_size} sequences hold {want[name]}")
            if not t.is_contiguous():
                _fail(f"{name} must be contiguous; call .contiguous() first")
        if contents:
            for name in ("k_scales", "v_scales", "k_zeros", "v_zeros"):
                v = getattr(self, name).to(torch.float32)
                bad = ~torch.isfinite(v) | (v <= 0) if "scales" in name else ~torch.isfinite(v)
                if bool(bad.any()):
                    idx = [int(i) for i in bad.nonzero()[0]]
                    _fail(f"{name}{idx}={float(v[tuple(idx)])}; "
                          + ("scales must be positive and finite" if "scales" in name else "zero points must be finite"))
            if not bool(torch.isfinite(self.k_residual).all()):
                idx = [int(i) for i in (~torch.isfinite(self.k_residual)).nonzero()[0]]
                _fail(f"k_residual{idx}={float(self.k_residual[tuple(idx)])}; the residual's keys must be finite")

    # ------------------------------------------------------------ construction
    @classmethod
    def empty(cls, group, batch_size, max_seq_len, num_kv_heads, head_dim, *, block_size=None, num_blocks=None,
              residual_dtype=torch.float16, device="cpu", seed=0):
        """A cache with ``seq_lens = 0`` and every sequence's pages reserved (shuffled by ``seed``) up front.
        ``block_size``: a multiple of ``group`` (default ``group``); ``head_dim``: a multiple of ``group``."""
        group = checks.one_of(checks.integer(group, "group"), "group", KIVI_GROUPS)
        batch_size = checks.positive_int(batch_size, "batch_size")
        max_seq_len = checks.positive_int(max_seq_len, "max_seq_len")
        num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
        head_dim = checks.positive_int(head_dim, "head_dim")
        block_size = group if block_size is None else validation.check_block_size(block_size)
        _check_geometry(block_size, head_dim, group)
        residual_dtype = checks.float_dtype(residual_dtype, "residual_dtype", RESIDUAL_DTYPES)
        seed = checks.generator_seed(seed)
        device = checks.device(device)
        validation.check_data_device(device, "device")
        bpseq, num_blocks = pool_blocks(batch_size, max_seq_len, block_size, num_blocks)
        shapes = _shapes(num_blocks, block_size, num_kv_heads, head_dim, group, batch_size)
        size = {"k_pages": 1, "v_pages": 1, "k_residual": torch.empty((), dtype=residual_dtype).element_size()}
        nbytes = sum(math.prod(s) * size.get(name, 2) for name, s in shapes.items())
        refuse_past_free_memory(nbytes, device, pool_request(num_blocks, batch_size, max_seq_len, block_size))
        arrays = {name: torch.zeros(s, dtype=torch.uint8 if name.endswith("pages") else residual_dtype
                                    if name == "k_residual" else torch.float16, device=device)
                  for name, s in shapes.items()}
        for name in ("k_scales", "v_scales"):
            arrays[name].fill_(1.0)  # an unwritten slot decodes to 0
        table = shuffled_block_table(num_blocks, batch_size, bpseq, seed, device)
        seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        return cls(group, arrays["k_pages"], arrays["v_pages"], arrays["k_scales"], arrays["k_zeros"],
                   arrays["v_scales"], arrays["v_zeros"], arrays["k_residual"], table, seq_lens)

    @classmethod
    def from_dense(cls, group, k, v, seq_lens, *, block_size=None, max_seq_len=None, num_blocks=None,
                   residual_dtype=torch.float16, seed=0):
        """Scatter ragged sequences into shuffled pages, quantizing on the way in: ``k``, ``v`` ``[B, max_len, Hkv,
        D]`` float tensors of which the first ``seq_lens[i]`` tokens of sequence i are stored (finite, within fp32's
        range); ``max_seq_len``: reserve pages for appends."""
        lens, k_all, v_all = dense_rows(k, v, seq_lens)
        if max_seq_len is not None:
            max_seq_len = checks.positive_int(max_seq_len, "max_seq_len")
        cache = cls.empty(group, len(lens), reserved_tokens(max_seq_len, lens), k.shape[2], k.shape[3],
                          block_size=block_size, num_blocks=num_blocks, residual_dtype=residual_dtype,
                          device=k.device, seed=seed)
        cache.append_tokens(k_all, v_all, lens)
        return cache

    # ------------------------------------------------------------------ writes
    def append_tokens(self, k_new, v_new, counts) -> int:
        """Append ``counts[i]`` tokens to each sequence i (``k_new`` / ``v_new`` ``[sum(counts), Hkv, D]``, finite:
        their rows, concatenated in order): values quantized as they come, keys through the residual, a group
        quantized as it fills. Refused before anything is written as a PagedKVCache's appends are
        (:func:`fp8kv.cache.writing.append_tokens`). Returns the saturated elements."""
        self.validate_arrays(contents=False)
        counts = checked_counts(self, counts).tolist()
        start = validation.checked_tables(self).tolist()

        def writer(cache, k_rows, v_rows, slot_mapping, shared_checked):
            validation.check_write(cache, k_rows, v_rows, slot_mapping, shared_checked=shared_checked)
            return cache._store(k_rows, v_rows, slot_mapping, start, counts)

        return _append_tokens(self, k_new, v_new, counts, writer=writer)

    def append(self, k_new, v_new) -> int:
        """Append one token per sequence: ``k_new``, ``v_new`` ``[B, Hkv, D]``. Returns the saturations."""
        return self.append_tokens(k_new, v_new, [1] * self.batch_size)

    def _store(self, k_rows, v_rows, slot_mapping, start, counts) -> int:
        """Values into their slots; keys into each sequence's residual, its full groups quantized into pages."""
        bs, g = self.block_size, self.group
        enc = quantize(v_rows, self.fmt.value)
        blk, off = slot_mapping // bs, slot_mapping % bs
        self.v_pages[blk, off] = enc.codes
        self.v_scales[blk, off], self.v_zeros[blk, off] = enc.scales, enc.zero_points
        n_sat, n_under = enc.saturated, enc.underflow
        row = 0
        for i, (n0, c) in enumerate(zip(start, counts, strict=True)):
            held = n0 % g  # keys waiting in the residual
            keys = torch.cat([self.k_residual[i, :held], k_rows[row:row + c].to(self.k_residual.dtype)])
            row += c
            full = len(keys) // g * g
            if full:
                first = n0 - held  # a group's first position: a multiple of g, so the group lies in one page
                pos = torch.arange(first, first + full, device=self.device)
                slots = token_slots(self, i, pos)
                kb, ko = slots // bs, slots % bs
                enc = quantize(keys[:full], self.fmt.key)
                self.k_pages[kb, ko] = enc.codes
                self.k_scales[kb[::g], ko[::g] // g] = enc.scales
                self.k_zeros[kb[::g], ko[::g] // g] = enc.zero_points
                n_sat, n_under = n_sat + enc.saturated, n_under + enc.underflow
            self.k_residual[i, :len(keys) - full] = keys[full:]
            self.k_residual[i, len(keys) - full:] = 0  # nothing stale: the same bytes however tokens came
        self.saturated += n_sat
        self.underflow += n_under
        return n_sat

    # ------------------------------------------------------------------- reads
    def gather(self, i, *, check_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``i``'s K and V as fp32 ``[seq_lens[i], Hkv, D]``: its full key groups and its values dequantized
        (:func:`fp8kv.kv_formats.dequantize`), then the residual's keys as they are; the scales checked first
        unless ``check_scales=False``."""
        if checks.flag(check_scales, "check_scales"):
            self.validate_arrays(contents=True)
        i = checks.integer(i, "i", minimum=0, maximum=self.batch_size - 1)
        n = int(validation.checked_tables(self, row=i)[0])
        g, bs = self.group, self.block_size
        full = n // g * g
        slots = token_slots(self, i, torch.arange(n, device=self.device))
        blk, off = slots // bs, slots % bs
        v = dequantize(self.fmt.value, self.v_pages[blk, off], self.v_scales[blk, off], zero_points=self.v_zeros[blk, off])
        kb, ko = blk[:full], off[:full]
        k = dequantize(self.fmt.key, self.k_pages[kb, ko], self.k_scales[kb[::g], ko[::g] // g],
                       zero_points=self.k_zeros[kb[::g], ko[::g] // g])
        return torch.cat([k, self.k_residual[i, :n - full].to(torch.float32)]), v

    # ------------------------------------------------------------------- sizes
    def bytes_per_token(self) -> Fraction:
        """Bytes of K and V held per token in the pages, all heads: codes, and scales and zero points (a key
        group's over its ``group`` tokens); the residual is :attr:`fixed_nbytes`."""
        per_page = sum(t[0].numel() * t.element_size() for t in (self.k_pages, self.v_pages, self.k_scales,
                                                                  self.k_zeros, self.v_scales, self.v_zeros))
        return Fraction(per_page, self.block_size)

    @property
    def fixed_nbytes(self) -> int:
        """Bytes held whatever the lengths: the residuals (one key group a sequence)."""
        return self.k_residual.numel() * self.k_residual.element_size()

    def footprint(self):
        """:func:`fp8kv.kv_formats.kv_footprint` of this format at the cache's Hkv and D (one layer)."""
        return kv_footprint(self.fmt, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def __repr__(self) -> str:
        return (f"KIVIPagedKVCache(group={self.group}, batch={self.batch_size}, "
                f"blocks={self.num_blocks}x{self.block_size}, Hkv={self.num_kv_heads}, D={self.head_dim}, "
                f"seq_lens={self.seq_lens.tolist() if self.batch_size <= 8 else '...'})")


def _check_geometry(block_size: int, head_dim: int, group: int) -> None:
    if block_size % group:
        _fail(f"block_size={block_size}; KIVI's key groups of {group} tokens lie in one page: expected a multiple "
              f"of {group}")
    if head_dim % group:
        _fail(f"head_dim={head_dim}; KIVI's values are grouped by {group} channels: expected a multiple of {group}")


def _shapes(num_blocks: int, block_size: int, hkv: int, d: int, group: int, batch: int) -> dict[str, tuple]:
    return {"k_pages": (num_blocks, block_size, hkv, d // 2), "v_pages": (num_blocks, block_size, hkv, d // 2),
            "k_scales": (num_blocks, block_size // group, hkv, d), "k_zeros": (num_blocks, block_size // group, hkv, d),
            "v_scales": (num_blocks, block_size, hkv, d // group), "v_zeros": (num_blocks, block_size, hkv, d // group),
            "k_residual": (batch, group, hkv, d)}
