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

One module a job: :mod:`~fp8kv.cache.tables` (what every paged cache shares: table sizes, slots),
:mod:`~fp8kv.cache.paged` (the class :class:`PagedKVCache`, its shapes and sizes),
:mod:`~fp8kv.cache.validation` (the checks of its arrays, tables, queries and writes),
:mod:`~fp8kv.cache.scales` (its scales as given or computed), :mod:`~fp8kv.cache.construction`
(``empty``, ``from_dense``, ``clone``, ``select``), :mod:`~fp8kv.cache.writing` (slots, writes, appends)
and :mod:`~fp8kv.cache.reading` (``gather``). Beside it, :mod:`~fp8kv.cache.quantized` (INT8 / INT4 / 4-bit float
pages) and :mod:`~fp8kv.cache.kivi` (KIVI's 4-bit pages, each sequence's unfilled key group in a residual).
"""

from .construction import shuffled_block_table
from .kivi import KIVIPagedKVCache
from .paged import PagedKVCache, check_paged_cache
from .validation import LAYOUTS, QUERY_DTYPES, check_block_size

__all__ = ["PagedKVCache", "KIVIPagedKVCache", "LAYOUTS", "QUERY_DTYPES", "shuffled_block_table", "check_block_size", "check_paged_cache"]
