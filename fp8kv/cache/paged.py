"""The class :class:`PagedKVCache`: its arrays and their shapes, sizes in bytes, and its methods, each the
public face of a module of :mod:`fp8kv.cache` (checks, construction, writing, reading)."""

from __future__ import annotations

import torch

from ..checks import fail as _fail
from ..formats import kv_dtype_info
from ..quant import GRANULARITIES, SCALE_BYTES, kv_scale_bytes
from ..quant import scale_shape as scale_shape_of
from . import construction, reading, validation, writing
from .scales import init_scale
from .tables import PagedTables

__all__ = ["PagedKVCache", "check_paged_cache"]


class PagedKVCache(PagedTables):
    """Paged K/V storage with block tables (see :mod:`fp8kv.cache` for shapes).

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
        if layout not in validation.LAYOUTS:
            _fail(f"layout={layout!r}; expected one of {validation.LAYOUTS}")
        if granularity not in GRANULARITIES:
            _fail(f"granularity={granularity!r}; expected one of {GRANULARITIES}")
        self.layout = layout
        self.granularity = granularity if self.fmt is not None else "tensor"
        self.k_pages, self.v_pages = k_pages, v_pages
        self.block_table, self.seq_lens = block_table, seq_lens
        validation.check_pages(self)
        dev = k_pages.device
        self.k_scale = init_scale(self, k_scale, "k_scale", dev)
        self.v_scale = init_scale(self, v_scale, "v_scale", dev)
        self.saturated = 0  # elements clamped to ±max by writes into this cache
        self.validate_tables()

    # ------------------------------------------------------------------ shapes
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
    def is_fp8(self) -> bool:
        return self.fmt is not None

    def scale_shape(self) -> tuple:
        """Shape of k_scale / v_scale: ``fp8kv.quant.scale_shape`` of the pages as [blocks, block_size, Hkv, D]."""
        return scale_shape_of((self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim), self.granularity)

    # -------------------------------------------------------------- validation
    def validate_arrays(self, contents: bool = True):
        """Check what may have been replaced since construction (the attributes are plain): the pages'
        dtypes, shapes and devices, the tables' dtypes and shapes, and each scale's dtype (fp32), shape
        (:meth:`scale_shape`) and device; with ``contents`` also that every scale is positive and finite
        (a host sync). A wrong-shaped scale would be read out of bounds by the kernels, a NaN or negative
        one would decode to NaN or to a sign-flipped answer. ``fp8kv.decode`` calls it on every call,
        with ``contents=check``."""
        validation.check_arrays(self, contents)

    def check_query(self, q, *, one_per_sequence: bool = True) -> None:
        """Validate a query against this cache (shape, dtype, device, GQA): a decode's ``[B, Hq, D]``, or with
        ``one_per_sequence=False`` an attend's ``[total_q, Hq, D]``."""
        validation.check_query(self, q, one_per_sequence=one_per_sequence)

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
        return construction.empty(cls, batch_size, max_seq_len, num_kv_heads, head_dim, block_size=block_size,
                                  kv_dtype=kv_dtype, granularity=granularity, k_scale=k_scale, v_scale=v_scale,
                                  layout=layout, num_blocks=num_blocks, device=device, seed=seed)

    def clone(self) -> PagedKVCache:
        """An independent copy: pages, tables and scales copied (through the validating constructor).

        The benchmark times a small cache through several clones so every call reads K/V from HBM.
        """
        return construction.clone(self)

    def select(self, indices) -> PagedKVCache:
        """A cache over the sequences ``indices`` (ints in ``[0, batch_size)``, a list or a 1-D int
        tensor), in that order, that *shares* this cache's pages (no K/V copy; tables and scales are
        the constructor's own). For checking a few sequences of a large batch against the oracle."""
        return construction.select(self, indices)

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
        max_seq_len : reserve pages for this many tokens per sequence (room for appends), at least the longest
            of ``seq_lens`` (None: that many).
        """
        return construction.from_dense(cls, k, v, seq_lens, block_size=block_size, kv_dtype=kv_dtype,
                                       granularity=granularity, scale=scale, seed=seed, k_scale=k_scale,
                                       v_scale=v_scale, layout=layout, max_seq_len=max_seq_len,
                                       num_blocks=num_blocks, percentile=percentile)

    # ------------------------------------------------------------------ writes
    def append_tokens(self, k_new, v_new, counts):
        """Append ``counts[i]`` tokens to each sequence i (``k_new``: their rows, concatenated in order).

        Refuses (before writing anything) counts that are negative or not integers, appends past a
        row's capacity, and appends into a page that another block-table entry also references.
        """
        return writing.append_tokens(self, k_new, v_new, counts)

    def append(self, k_new, v_new):
        """Append one token per sequence: ``k_new``, ``v_new`` ``[B, Hkv, D]``. Returns saturations."""
        return self.append_tokens(k_new, v_new, torch.ones(self.batch_size, dtype=torch.int64))

    def check_write(self, k_new, v_new, slot_mapping, *, contents: bool = True,
                    shared_checked: bool = False) -> torch.Tensor:
        """Validate a write of ``k_new``/``v_new`` ``[N, Hkv, D]`` into ``slot_mapping`` ``[N]``.

        Returns the slots as int64 on the cache's device. Shapes, dtypes and devices are checked
        always; with ``contents`` (one host sync) also: finite rows, every slot < num_blocks x
        block_size (< 0: skipped), and no written page referenced by two block-table entries
        holding tokens (unless the caller already checked that: ``shared_checked``).
        """
        return validation.check_write(self, k_new, v_new, slot_mapping, contents=contents,
                                      shared_checked=shared_checked)

    def write(self, k_new, v_new, slot_mapping) -> int:
        """Quantize ``k_new``/``v_new`` (``[N, Hkv, D]``) into the slots named by ``slot_mapping``.

        Slots < 0 are skipped (the engines' padding convention). Static scales are used for
        tensor / head / channel granularity; token_head computes one scale per token and head
        (amax / fmt.max) and stores it beside the token. Returns the number of saturated elements
        (also accumulated in ``self.saturated``). The torch path; ``fp8kv.ops.write_cache`` fuses it.
        Refused: non-finite rows, slots that are not integers or lie past the pool, and writes into
        a page that two block-table entries holding tokens reference (see the class docstring).
        """
        return writing.write(self, k_new, v_new, slot_mapping)

    # ------------------------------------------------------------------- reads
    def gather(self, i: int, *, check_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of sequence ``i``: fp32 ``[seq_lens[i], Hkv, D]``.

        ``seq_lens[i]``, the block-table entries holding its tokens and (with ``check_scales``) the scales are
        checked as they are now (they may have been edited since construction): a ValueError names a bad one.
        ``check_scales=False`` is for a loop over sequences after one :meth:`validate_arrays`."""
        return reading.gather(self, i, check_scales=check_scales)

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


def check_paged_cache(cache, name: str = "cache") -> None:
    """``cache`` is a :class:`~fp8kv.cache.PagedKVCache` (FP8 or 16-bit pages: what fp8kv.decode, fp8kv.attend and
    the reference read). A :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` is named with the decode that
    reads it."""
    if isinstance(cache, PagedKVCache):
        return
    hint = ""
    if type(cache).__name__ == "QuantizedPagedKVCache":
        hint = ("; a QuantizedPagedKVCache (INT8 / INT4 / FP4 pages) is read by "
                "fp8kv.ops.quant_decode.paged_decode_quantized and its oracle quantized_reference")
    _fail(f"{name} must be a fp8kv.PagedKVCache, got {type(cache).__name__}{hint}", TypeError)
