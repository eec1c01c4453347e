"""A :class:`~fp8kv.cache.PagedKVCache` as the kernels take it: page views, strides, scale kind, format bits.

The constexpr codes here (``SCALE_*``) are read inside the decode and cache-write kernels, the functions
by their launchers; nothing here launches anything.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..cache import PagedKVCache

__all__ = ["SCALE_PER_HEAD", "SCALE_CHANNEL", "SCALE_TOKEN_HEAD", "scale_kind", "kernel_pages", "format_bits",
           "page_strides"]

# SCALE_KIND values (constexpr globals: the only globals a Triton kernel may read)
SCALE_PER_HEAD = tl.constexpr(0)  # tensor and head granularity: one scalar per KV head ([Hkv] fp32)
SCALE_CHANNEL = tl.constexpr(1)  # [Hkv, D]: K folded into q (fp32), V applied in the epilogue
SCALE_TOKEN_HEAD = tl.constexpr(2)  # [num_blocks, block_size, Hkv]: per token, inside the loop

_SCALE_KIND = {"tensor": SCALE_PER_HEAD.value, "head": SCALE_PER_HEAD.value, "channel": SCALE_CHANNEL.value,
               "token_head": SCALE_TOKEN_HEAD.value}


def scale_kind(cache: PagedKVCache) -> int:
    """The kernels' SCALE_KIND of the cache's scales (16-bit caches: per head, all ones)."""
    return _SCALE_KIND[cache.granularity] if cache.is_fp8 else SCALE_PER_HEAD.value


def kernel_pages(cache: PagedKVCache, pages: torch.Tensor, fp8_values: bool = False) -> torch.Tensor:
    """Pages as the kernels read them: FP8 as uint8 codes (Triton has no e4m3 before sm89), or as
    FP8 values where the kernel feeds them to Triton's own conversion or FP8 dot."""
    return pages.view(torch.uint8) if cache.is_fp8 and not fp8_values else pages


def format_bits(cache: PagedKVCache) -> dict:
    """MANT / BIAS constexprs of the cache's FP8 format (unused, 0, for 16-bit caches)."""
    fmt = cache.fmt
    return dict(MANT=fmt.mantissa_bits if fmt else 0, BIAS=fmt.bias if fmt else 0)


def page_strides(cache: PagedKVCache) -> tuple[int, int, int]:
    """The pages' (page, token, head) strides, whichever layout (NHD or HND) the cache has."""
    s = cache.k_pages.stride()
    return (s[0], s[1], s[2]) if cache.layout == "NHD" else (s[0], s[2], s[1])
