"""Quantize a real model's K/V as they enter attention; capture K/V; calibrate scales.

The hook is a custom attention function registered with transformers' ``AttentionInterface``
under the name ``"fp8kv"`` (with sdpa's mask builder), which every modern transformers model
calls with ``(module, query, key, value, attention_mask, scaling, ...)``: ``key`` is after RoPE
(and after Gemma-3's k-norm), ``value`` as projected, both ``[B, Hkv, T, D]`` before GQA
expansion, exactly what a serving engine writes to its KV cache. One hook therefore covers Llama
and Gemma-3 alike (sliding windows arrive in the mask). While a handler is active the model's
attention implementation is switched to ``"fp8kv"``; on exit the previous one is restored.

What a handler does with K/V:

* :class:`KVQuantConfig` handlers store K and V the way an FP8 KV cache does
  (``fp8kv.quant.quantize``: stored = Q(x / scale), dequantized = stored x scale, see
  ``fp8kv/quant.py``) and run attention in the model's dtype on the dequantized values. Every
  query reads every key through the quantized copy, the token's own included, as in decode.
* The baseline is a bf16 KV cache: K/V rounded through bf16 (``kv_dtype="bf16"``). The model itself
  computes in fp32 on CPU because bf16 matmuls are several times slower there.
* A side that is not quantized (``quantize_k=False`` or ``quantize_v=False``) is rounded to bf16
  like the baseline, whatever ``kv_dtype`` the other side is stored in, so K-vs-V attribution
  compares against the baseline only.

The hook's names, gathered here from their modules: :mod:`~fp8kv.models.attention` (the registered
function and its handlers), :mod:`~fp8kv.models.introspect` (a model's layers, vocabulary and token ids),
:mod:`~fp8kv.models.kv_config` (the simulated cache's configuration and its store-and-load),
:mod:`~fp8kv.models.quantized` (quantized runs and their counts) and :mod:`~fp8kv.models.capture` (K/V
capture and scale calibration).
"""

from .attention import ATTN_NAME, attention_handler, attention_variants, model_attention
from .capture import CapturedKV, calibrate_scales, capture_kv
from .introspect import (
    attention_modules,
    check_token_id,
    check_token_ids,
    layer_types,
    num_layers,
    one_sequence,
    token_ids,
    vocab_size,
)
from .kv_config import BASELINE, KV_CONFIG_DTYPES, KVQuantConfig, check_layer_scales, layer_entry, quantize_kv
from .quantized import KVStats, quantized_kv, run_quantized

__all__ = ["KVQuantConfig", "KVStats", "CapturedKV", "quantized_kv", "run_quantized", "capture_kv",
           "calibrate_scales", "attention_handler", "ATTN_NAME", "num_layers", "layer_types",
           "attention_modules", "quantize_kv", "attention_variants", "model_attention", "one_sequence",
           "layer_entry", "check_layer_scales", "vocab_size", "check_token_ids", "check_token_id",
           "token_ids", "BASELINE", "KV_CONFIG_DTYPES"]
