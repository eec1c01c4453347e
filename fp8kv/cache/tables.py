"""What every paged cache of :mod:`fp8kv.cache` shares: its block table and lengths, and the sizes and slots read
from them (:class:`PagedTables`, the base of :class:`~fp8kv.cache.PagedKVCache`; :class:`NHDPagedTables`, of
:class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` and :class:`~fp8kv.cache.KIVIPagedKVCache`). The page axes
differ per cache (NHD or HND pages, packed codes), so ``head_dim`` is each cache's own."""

from __future__ import annotations

import torch

from ..checks import fail, version_counter
from . import validation, writing

__all__ = ["PagedTables", "NHDPagedTables"]


class PagedTables:
    """Sizes of the block table (``[B, max_blocks_per_seq]`` int32) and the page pool, and the checked
    reads of the tables. A subclass sets ``k_pages``, ``block_table``, ``seq_lens`` and ``block_size``."""

    @property
    def num_blocks(self) -> int:
        return self.k_pages.shape[0]

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k_pages.device

    def validate_tables(self, *, nonempty: bool = False) -> None:
        """Check seq_lens against capacity and the used block-table entries against num_blocks; with
        ``nonempty``, also that every sequence holds a token (a decode's query attends at least itself).

        One host sync. The constructor calls it; so does ``fp8kv.decode`` (``nonempty`` with ``check=True``),
        and every method that reads the tables (gather, slots, the writes) checks what it reads.
        """
        validation.check_tables(self, nonempty=nonempty)

    def slots(self, seq: int, positions) -> torch.Tensor:
        """Slot ids (``block * block_size + offset``) of ``positions`` in sequence ``seq``.

        ``seq``: an int in ``[0, batch_size)``. ``positions``: ints in ``[0, max_blocks_per_seq x
        block_size)`` (a list, or a 1-D int32/int64 tensor), whose block-table entries name a page.
        Returns int64 slots ``[N]`` on the cache's device. One host sync.
        """
        return writing.slots(self, seq, positions)

    def stamp(self, written=("block_table", "seq_lens", "k_scale", "v_scale"), replaced=()) -> tuple:
        """What a plan that copied these arrays depends on: each one's identity and shape, and for ``written`` its
        in-place version counter too (metadata, no host sync; None for inference-mode tensors, which have none)."""
        return tuple((n, id(getattr(self, n)), tuple(getattr(self, n).shape),
                      version_counter(getattr(self, n)) if n in written else None) for n in (*written, *replaced))

    def check_stamp(self, stamp: tuple, plan: str) -> None:
        """ValueError naming the first array of ``stamp`` (:meth:`stamp`) replaced or written in place since;
        ``plan`` says what holds the arrays as they were."""
        for name, ident, shape, version in stamp:
            t = getattr(self, name)
            if id(t) != ident or tuple(t.shape) != shape:
                fail(f"cache.{name} was replaced after planning; {plan} holds it as it was: plan again")
            if version is not None and version_counter(t) != version:
                fail(f"cache.{name} was written in place after planning (append, write, an edit); {plan} holds it "
                     "as it was: plan again")


class NHDPagedTables(PagedTables):
    """:class:`PagedTables` of NHD pages (``[num_blocks, block_size, Hkv, ...]``, the quantized caches' only layout):
    ``block_size`` and ``num_kv_heads`` read from ``k_pages``; ``head_dim`` is each cache's own (packed codes)."""

    layout = "NHD"  # the tables' checks (fp8kv.cache.validation) read it

    @property
    def block_size(self) -> int:
        return self.k_pages.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pages.shape[2]
