"""Which KV formats a paged cache can hold token by token, and how their pieces lie in a page.

A page holds ``block_size`` tokens. A format whose scales belong to one token (one per token and head,
or one per block of channels of a token's head) can be written a token at a time: the scales a write
computes are the ones :func:`.codec.quantize` computes over the whole tensor. Those are
:data:`PAGED_FORMATS`. KIVI's keys share a scale over a group of tokens (:class:`fp8kv.cache.KIVIPagedKVCache`
pages them by whole groups) and tensor-wide scales come from all the data, so neither is among them; NVFP4's second, per-tensor level is a fixed number of the
cache (calibrated, or taken from the data a cache is built from).

Per page, the codes and the scales of each token and KV head lie next to each other, so a kernel reads
a token's codes and its scales in one pass::

    codes   [num_blocks, block_size, Hkv, D]       codec.code_dtype (packed 4-bit: D // 2 uint8)
    scales  [num_blocks, block_size, Hkv, groups]  codec.scale_dtype (groups: 1, or D // block)
"""

from __future__ import annotations

from .. import checks
from .registry import KV_FORMATS, Codec, KVFormat, codec, kv_format

__all__ = ["PAGED_FORMATS", "paged_format", "scale_groups", "page_shapes"]


def _token_local(c: Codec) -> bool:
    return c.rule != "fp8" and c.scaling in ("token_head", "block") and not c.zero_point


# The fp8_* formats are fp8kv.cache.PagedKVCache's own; KIVI's values carry zero points and its keys a
# scale over tokens, so KIVI is not paged token by token: fp8kv.cache.KIVIPagedKVCache holds it, each
# sequence's unfilled key group in a residual.
PAGED_FORMATS: tuple[str, ...] = tuple(name for name, f in KV_FORMATS.items()
                                       if _token_local(f.key) and _token_local(f.value))


def paged_format(fmt: KVFormat | str) -> KVFormat:
    """The :class:`~.registry.KVFormat` named ``fmt``, refused unless it is among :data:`PAGED_FORMATS`."""
    f = kv_format(fmt)
    if f.name not in PAGED_FORMATS:
        checks.fail(f"fmt={f.name!r} cannot be paged token by token (its scales span tokens or the whole "
                    f"tensor); expected one of {PAGED_FORMATS}")
    return f


def scale_groups(c: Codec | str, head_dim: int) -> int:
    """Scales per token and head of codec ``c`` at ``head_dim``: 1 (token_head) or ``head_dim // block`` (a head_dim
    the codec cannot store is refused, naming what it needs)."""
    c = codec(c)
    head_dim = checks.positive_int(head_dim, "head_dim")
    if c.scaling not in ("token_head", "block"):  # scales from all the tokens or none per token: no page holds them
        checks.fail(f"codec {c.name!r} ({c.scaling} scales) has no scales per token and head to page; expected a "
                    "codec of a paged format (fp8kv.kv_formats.PAGED_FORMATS)")
    c.check_shape((1, head_dim), "head_dim")
    return 1 if c.scaling == "token_head" else head_dim // c.block


def page_shapes(c: Codec | str, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[tuple, tuple]:
    """The shapes of one tensor's (K's or V's) codes and scales in a pool of ``num_blocks`` pages."""
    c = codec(c)
    num_blocks = checks.nonnegative_int(num_blocks, "num_blocks")
    block_size = checks.positive_int(block_size, "block_size")
    num_kv_heads = checks.positive_int(num_kv_heads, "num_kv_heads")
    head_dim = checks.positive_int(head_dim, "head_dim")
    c.check_shape((block_size, num_kv_heads, head_dim), "pages (as data)")
    lead = (num_blocks, block_size, num_kv_heads)
    return c.code_shape((*lead, head_dim)), (*lead, scale_groups(c, head_dim))
