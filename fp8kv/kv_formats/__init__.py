"""KV storage formats beside FP8: INT8, INT4, KIVI 4-bit, NVFP4, MXFP4 and block-scaled e4m3, with
fp8kv.quant's FP8 formats in the same listing, so that every format is quantized, decoded and
counted (bytes per token, saturation, underflow) on one footing.

* :mod:`.elements` -- the element codes and round-to-nearest-even onto them (int, e2m1, e4m3, e8m0);
* :mod:`.packing` -- two 4-bit codes per byte (element ``2i`` in the low nibble);
* :mod:`.registry` -- the codecs and KV formats as data, and :func:`footprint` (bytes, exactly);
* :mod:`.scaling` -- which values share a scale, and how each rule chooses it;
* :mod:`.codec` -- :func:`quantize` / :func:`dequantize` (and :func:`encode_rows`, its sync-free write path);
* :mod:`.pages` -- the formats a paged cache holds token by token (:data:`PAGED_FORMATS`) and their page
  shapes (``fp8kv.cache.quantized.QuantizedPagedKVCache`` is that cache).

Typical use::

    from fp8kv import kv_formats as kvf
    for name in kvf.KV_FORMAT_NAMES:
        f = kvf.kv_format(name)
        k = kvf.quantize(keys, f.key)          # Encoded: codes, scales, zero_points, tensor_scale, counts
        k_hat = k.dequantize()                 # fp32
        per_token = kvf.kv_footprint(f, num_kv_heads=8, head_dim=128).per_token
"""

from .codec import INPUT_DTYPES, NONFINITE_MODES, Encoded, decode_codes, dequantize, encode_rows, quantize
from .elements import ELEMENTS, Element
from .pages import PAGED_FORMATS, page_shapes, paged_format, scale_groups
from .registry import (
                       CODEC_NAMES,
                       CODECS,
                       KIVI_GROUPS,
                       KV_FORMAT_NAMES,
                       KV_FORMATS,
                       Codec,
                       Footprint,
                       KVFormat,
                       codec,
                       footprint,
                       holding_formats,
                       kivi,
                       kv_footprint,
                       kv_format,
                       summary_table,
)

__all__ = ["Codec", "KVFormat", "Footprint", "Encoded", "Element", "ELEMENTS", "CODECS", "CODEC_NAMES",
           "KV_FORMATS", "KV_FORMAT_NAMES", "KIVI_GROUPS", "INPUT_DTYPES", "NONFINITE_MODES", "codec", "kv_format",
           "kivi", "footprint", "kv_footprint", "holding_formats", "summary_table", "quantize", "encode_rows", "dequantize", "decode_codes",
           "PAGED_FORMATS", "paged_format", "scale_groups", "page_shapes"]
