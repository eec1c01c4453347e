"""A paged KV cache in a format of :mod:`fp8kv.kv_formats` (INT8, INT4, NVFP4, MXFP4, block-scaled e4m3):
:class:`QuantizedPagedKVCache`.

The tables are :class:`~fp8kv.cache.PagedKVCache`'s (``block_table`` ``[B, max_blocks]`` and ``seq_lens``
``[B]`` int32; token ``t`` of sequence ``b`` at slot ``block_table[b, t // bs] * bs + t % bs``), and the
pages NHD. Per tensor (K, V):

==============  ============================================  ==============================================
array           shape                                         dtype
==============  ============================================  ==============================================
k_pages/v_pages ``[num_blocks, block_size, Hkv, D]``           the codec's codes: int8, uint8 (two 4-bit
                (packed 4-bit: ``D // 2`` bytes)               codes a byte, :mod:`fp8kv.kv_formats.packing`),
                                                              float8_e4m3fn
k_scales/       ``[num_blocks, block_size, Hkv, groups]``      the codec's scale dtype: fp32 (int8 / int4),
v_scales        (groups 1, or ``D // block``)                  e4m3 (NVFP4, e4m3_b16), e8m0 (MX)
k_tensor_scale/ ``[]`` (NVFP4 and e4m3_b16 only, else None)    fp32
v_tensor_scale
==============  ============================================  ==============================================

Every write quantizes with :func:`fp8kv.kv_formats.quantize` itself, so the stored bytes are what it
gives for the same rows (with the cache's tensor scale): bit for bit, however the rows are batched.
The checks of the tables, rows and slots are :mod:`fp8kv.cache.validation`'s, as for a PagedKVCache.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from .. import checks
from ..checks import fail as _fail
from ..device import refuse_past_free_memory
from ..kv_formats import Encoded, Footprint, kv_footprint, quantize
from ..kv_formats.codec import check_tensor_scale
from ..kv_formats.pages import page_shapes, paged_format
from . import validation
from .construction import dense_rows, pool_blocks, pool_request, reserved_tokens, shuffled_block_table
from .reading import token_slots
from .tables import NHDPagedTables
from .writing import append_tokens as _append_tokens

__all__ = ["QuantizedPagedKVCache"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte tensors as uint8 (index writes into fp8 / e8m0 tensors are not implemented on every device)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


class QuantizedPagedKVCache(NHDPagedTables):
    """Paged K/V in a token-local format of :data:`fp8kv.kv_formats.PAGED_FORMATS` (see the module for shapes).

    Build one with :meth:`empty` or :meth:`from_dense`; add tokens with :meth:`write` / :meth:`append_tokens`
    / :meth:`append`; read a sequence back with :meth:`encoded` (the stored pieces) or :meth:`gather`
    (dequantized, fp32). The constructor validates every array and the tables (one host sync).
    As in a PagedKVCache, pages may be shared for reading; a write into a shared page is refused.
    """

    def __init__(self, fmt, k_pages, v_pages, k_scales, v_scales, block_table, seq_lens, *,
                 k_tensor_scale=None, v_tensor_scale=None):
        self.fmt = paged_format(fmt)
        self.kv_dtype = self.fmt.name
        self.k_pages, self.v_pages, self.k_scales, self.v_scales = k_pages, v_pages, k_scales, v_scales
        self.block_table, self.seq_lens = block_table, seq_lens
        self.dtype = self.fmt.key.code_dtype  # what check_pages holds the pages to
        validation.check_pages(self)
        self.k_tensor_scale = self._tensor_scale(self.fmt.key, k_tensor_scale, "k_tensor_scale")
        self.v_tensor_scale = self._tensor_scale(self.fmt.value, v_tensor_scale, "v_tensor_scale")
        self.saturated = 0  # elements clamped to the largest code by writes into this cache
        self.underflow = 0  # non-zero elements written that decode to 0
        self.validate_arrays()
        self.validate_tables()

    def _tensor_scale(self, codec, value, name) -> torch.Tensor | None:
        if not codec.tensor_scale:
            if value is not None:
                _fail(f"{name}={validation.show_scale(value)}, but format {self.fmt.name!r} has no per-tensor "
                      "scale; pass None")
            return None
        if value is None:
            _fail(f"{name} is None, but format {self.fmt.name!r} multiplies its block scales by a per-tensor fp32 "
                  f"scale, fixed for the cache: pass a positive number (e.g. amax / (448 x 6) of calibration "
                  f"data, or what fp8kv.kv_formats.quantize(x, {codec.name!r}).tensor_scale gives)")
        return check_tensor_scale(value, codec, self.device, name).clone()

    # ------------------------------------------------------------------ shapes
    @property
    def head_dim(self) -> int:
        return self.k_pages.shape[3] * (2 if self.fmt.key.packed else 1)

    def page_shapes(self) -> tuple[tuple, tuple]:
        """Shapes of the codes and of the scales (the same for K and V): see the module."""
        return page_shapes(self.fmt.key, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    # -------------------------------------------------------------- validation
    def validate_arrays(self, contents: bool = True) -> None:
        """Check what may have been replaced since construction: the pages and tables
        (:func:`fp8kv.cache.validation.check_pages`), each scale array's dtype, shape and device, and the
        tensor scales; with ``contents`` also that every scale is positive and finite (a host sync)."""
        contents = checks.flag(contents, "contents")  # "no" is truthy: it would check what was to be skipped
        validation.check_pages(self)
        codes_shape, scales_shape = self.page_shapes()
        if tuple(self.k_pages.shape) != codes_shape:  # the pages' head_dim must suit the codec
            _fail(f"k_pages has shape {tuple(self.k_pages.shape)}; format {self.fmt.name!r} stores codes {codes_shape}")
        for name, codec in (("k_scales", self.fmt.key), ("v_scales", self.fmt.value)):
            s = checks.tensor(getattr(self, name), name, dtypes=(codec.scale_dtype,), device=self.device)
            if tuple(s.shape) != scales_shape:
                _fail(f"{name} has shape {tuple(s.shape)}; format {self.fmt.name!r} with pages "
                      f"{tuple(self.k_pages.shape)} holds scales of shape {scales_shape}")
            if not s.is_contiguous():
                _fail(f"{name} must be contiguous; call .contiguous() first")
            if contents and s.numel():
                if s.dtype == torch.float8_e8m0fnu:  # every code is a power of two but 255 (NaN)
                    bad = s.view(torch.uint8) == 255
                else:
                    v = s.to(torch.float32)
                    bad = ~torch.isfinite(v) | (v <= 0)
                if bool(bad.any()):
                    idx = tuple(int(i) for i in bad.nonzero()[0])
                    _fail(f"{name}{list(idx)}={float(s[idx].to(torch.float32))}; scales must be positive and finite")
        validation.check_disjoint("k_scales", self.k_scales, "v_scales", self.v_scales)
        for name, codec in (("k_tensor_scale", self.fmt.key), ("v_tensor_scale", self.fmt.value)):
            t = getattr(self, name)
            if codec.tensor_scale:
                checks.tensor(t, name, dtypes=(torch.float32,), device=self.device, shape_hint="[] (fp32)")
                if t.shape != ():
                    _fail(f"{name} has shape {tuple(t.shape)}; expected one number (shape [])")
                if contents and not (bool(torch.isfinite(t)) and float(t) > 0):
                    _fail(f"{name}={float(t)}; the tensor scale must be positive and finite")
            elif t is not None:
                _fail(f"{name} is set, but format {self.fmt.name!r} has no per-tensor scale; it must be None")

    def check_query(self, q) -> None:
        """Validate a decode query ``[B, Hq, D]`` against this cache (shape, dtype, device, GQA)."""
        validation.check_query(self, q)

    # ------------------------------------------------------------ construction
    @classmethod
    def empty(cls, fmt, batch_size, max_seq_len, num_kv_heads, head_dim, *, block_size=16, num_blocks=None,
              k_tensor_scale=None, v_tensor_scale=None, device="cpu", seed=0):
        """A cache with ``seq_lens = 0`` and every sequence's pages reserved (shuffled by ``seed``) up front.

        ``fmt``: a name of :data:`~fp8kv.kv_formats.PAGED_FORMATS`; ``head_dim`` must suit it (even for the
        4-bit codes, a multiple of the block for block scales). ``k_tensor_scale`` / ``v_tensor_scale``: the
        fixed fp32 second level of NVFP4 and e4m3_b16 (required there, refused elsewhere). Scales are
        initialised to 1 (code 127 for e8m0) so that an unwritten slot decodes to 0.
        """
        f = paged_format(fmt)
        batch_size = checks.positive_int(batch_size, "batch_size")
        max_seq_len = checks.positive_int(max_seq_len, "max_seq_len")
        num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
        head_dim = checks.positive_int(head_dim, "head_dim")
        block_size = validation.check_block_size(block_size)
        seed = checks.generator_seed(seed)
        device = checks.device(device)
        validation.check_data_device(device, "device")
        bpseq, num_blocks = pool_blocks(batch_size, max_seq_len, block_size, num_blocks)
        codes_shape, scales_shape = page_shapes(f.key, num_blocks, block_size, num_kv_heads, head_dim)
        nbytes = sum(math.prod(codes_shape) * torch.empty((), dtype=c.code_dtype).element_size()
                     + math.prod(scales_shape) * 4 for c in f.codecs) + 12 * num_blocks  # scales built in fp32
        refuse_past_free_memory(nbytes, device, pool_request(num_blocks, batch_size, max_seq_len, block_size))
        arrays = []
        for c in f.codecs:
            arrays.append(torch.zeros(codes_shape, dtype=c.code_dtype, device=device))
            ones = torch.ones(scales_shape, dtype=torch.float32, device=device)
            arrays.append(ones.to(c.scale_dtype))  # e8m0: 2^0 is code 127
        (kp, ks), (vp, vs) = arrays[:2], arrays[2:]
        table = shuffled_block_table(num_blocks, batch_size, bpseq, seed, device)
        seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        return cls(f, kp, vp, ks, vs, table, seq_lens, k_tensor_scale=k_tensor_scale, v_tensor_scale=v_tensor_scale)

    @classmethod
    def from_dense(cls, fmt, k, v, seq_lens, *, block_size=16, max_seq_len=None, num_blocks=None,
                   k_tensor_scale=None, v_tensor_scale=None, seed=0):
        """Scatter ragged sequences into shuffled pages, quantizing on the way in.

        ``k``, ``v``: ``[B, max_len, Hkv, D]`` float tensors (finite, within fp32's range), of which the first
        ``seq_lens[i]`` tokens of sequence i are stored; ``seq_lens``: a list or 1-D int tensor ``[B]``.
        Tensor scales (NVFP4, e4m3_b16) default to what :func:`fp8kv.kv_formats.quantize` takes from the
        valid tokens of all sequences (so the stored codes are those of quantizing them together); given,
        they are used as they are. ``max_seq_len``: reserve pages for appends (at least the longest of ``seq_lens``).
        """
        f = paged_format(fmt)
        lens, k_all, v_all = dense_rows(k, v, seq_lens)
        if f.key.tensor_scale and k_tensor_scale is None:
            k_tensor_scale = quantize(k_all, f.key).tensor_scale
        if f.value.tensor_scale and v_tensor_scale is None:
            v_tensor_scale = quantize(v_all, f.value).tensor_scale
        if max_seq_len is not None:
            max_seq_len = checks.positive_int(max_seq_len, "max_seq_len")
        cache = cls.empty(f, len(lens), reserved_tokens(max_seq_len, lens), k.shape[2], k.shape[3], block_size=block_size, num_blocks=num_blocks,
                          k_tensor_scale=k_tensor_scale, v_tensor_scale=v_tensor_scale, device=k.device, seed=seed)
        cache.append_tokens(k_all, v_all, lens)
        return cache

    # ------------------------------------------------------------------ writes
    def write(self, k_new, v_new, slot_mapping, *, shared_checked: bool = False) -> int:
        """Quantize ``k_new`` / ``v_new`` ``[N, Hkv, D]`` (finite floats) with the format's codecs
        (:func:`fp8kv.kv_formats.quantize`, the cache's tensor scales) into the slots of ``slot_mapping``
        ``[N]`` (int; < 0 skipped). Refused, before anything is written: bad rows, slots past the pool, and
        writes into a page that two block-table entries holding tokens reference (unless ``shared_checked``:
        the caller refused those already). Returns the saturated elements (added to ``self.saturated``)."""
        self.validate_arrays(contents=False)  # arrays replaced since construction (metadata only)
        slot_mapping = validation.check_write(self, k_new, v_new, slot_mapping, shared_checked=shared_checked)
        keep = slot_mapping >= 0
        slot_mapping, k_new, v_new = slot_mapping[keep], k_new[keep], v_new[keep]
        if not slot_mapping.numel():
            return 0
        blk, off = slot_mapping // self.block_size, slot_mapping % self.block_size
        n_sat = n_under = 0
        for codec, pages, scales, tensor_scale, new in (
                (self.fmt.key, self.k_pages, self.k_scales, self.k_tensor_scale, k_new),
                (self.fmt.value, self.v_pages, self.v_scales, self.v_tensor_scale, v_new)):
            enc = quantize(new, codec, tensor_scale=tensor_scale)
            _bytes(pages)[blk, off] = _bytes(enc.codes)
            _bytes(scales)[blk, off] = _bytes(enc.scales.reshape(*new.shape[:-1], -1))
            n_sat += enc.saturated
            n_under += enc.underflow
        self.saturated += n_sat
        self.underflow += n_under
        return n_sat

    def append_tokens(self, k_new, v_new, counts) -> int:
        """Append ``counts[i]`` tokens to each sequence i (``k_new`` / ``v_new`` ``[sum(counts), Hkv, D]``:
        their rows, concatenated in order). Refused before anything is written, as for a PagedKVCache
        (:func:`fp8kv.cache.writing.append_tokens`): counts that are not non-negative integers (one per
        sequence), rows that do not match them, appends past a row's capacity or through a block-table entry
        outside the pool, and appends into a shared page."""
        return _append_tokens(self, k_new, v_new, counts, writer=type(self).write)

    def append(self, k_new, v_new) -> int:
        """Append one token per sequence: ``k_new``, ``v_new`` ``[B, Hkv, D]``. Returns the saturations."""
        return self.append_tokens(k_new, v_new, [1] * self.batch_size)

    # ------------------------------------------------------------------- reads
    def encoded(self, i) -> tuple[Encoded, Encoded]:
        """Sequence ``i``'s K and V as stored: :class:`fp8kv.kv_formats.Encoded` of ``[seq_lens[i], Hkv, D]``
        (codes, scales in the codec's shape, tensor scale), exactly the bytes of the pages. Its length and
        block-table entries are checked as they are now."""
        i = checks.integer(i, "i", minimum=0, maximum=self.batch_size - 1)
        n = int(validation.checked_tables(self, row=i)[0])
        slot = token_slots(self, i, torch.arange(n, device=self.device))
        blk, off = slot // self.block_size, slot % self.block_size
        out = []
        for codec, pages, scales, tensor_scale in ((self.fmt.key, self.k_pages, self.k_scales, self.k_tensor_scale),
                                                   (self.fmt.value, self.v_pages, self.v_scales, self.v_tensor_scale)):
            codes = pages[blk, off]
            shape = (n, self.num_kv_heads, self.head_dim)
            out.append(Encoded(codec, codes, scales[blk, off].reshape(codec.scale_shape(shape)).contiguous(),
                               tensor_scale=tensor_scale))
        return out[0], out[1]

    def gather(self, i, *, check_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``i``'s K and V dequantized by :func:`fp8kv.kv_formats.dequantize`: fp32 ``[seq_lens[i], Hkv, D]``;
        the scales checked first unless ``check_scales=False`` (a loop after one :meth:`validate_arrays`)."""
        if checks.flag(check_scales, "check_scales"):
            self.validate_arrays(contents=True)
        k, v = self.encoded(i)
        return k.dequantize(), v.dequantize()

    # ------------------------------------------------------------------- sizes
    def footprint(self) -> Footprint:
        """:func:`fp8kv.kv_formats.kv_footprint` of this format at the cache's Hkv and D (one layer)."""
        return kv_footprint(self.fmt, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def bytes_per_token(self) -> Fraction:
        """Bytes of K and V held per token, counted from the arrays: a token's codes and scales, all heads."""
        per = 0
        for t in (self.k_pages, self.v_pages, self.k_scales, self.v_scales):
            per += t[0, 0].numel() * t.element_size()
        return Fraction(per)

    @property
    def fixed_nbytes(self) -> int:
        """Bytes held once whatever the length: the tensor scales."""
        return sum(t.numel() * t.element_size() for t in (self.k_tensor_scale, self.v_tensor_scale) if t is not None)

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated pages, scales and tensor scales (tables not counted)."""
        pages = sum(t.numel() * t.element_size() for t in (self.k_pages, self.v_pages, self.k_scales, self.v_scales))
        return pages + self.fixed_nbytes

    def __repr__(self) -> str:
        return (f"QuantizedPagedKVCache(fmt={self.fmt.name}, batch={self.batch_size}, "
                f"blocks={self.num_blocks}x{self.block_size}, Hkv={self.num_kv_heads}, D={self.head_dim}, "
                f"seq_lens={self.seq_lens.tolist() if self.batch_size <= 8 else '...'})")
