"""Real models with an FP8 KV cache: offline loading, K/V capture, quantized runs, accuracy, paged decode.

``loading``: offline models and the evaluation text; ``hook``: the attention hook that stores K/V
through fp8kv's quantizer (its modules: ``attention``, the registered attention function; ``introspect``, a
model's layers and vocabulary; ``kv_config``, the simulated cache; ``quantized``, runs through it;
``capture``, K/V capture and scale calibration); ``evaluate``: accuracy vs the bf16
KV baseline; ``decode``: a greedy decode loop whose every step reads a paged FP8 cache.
Needs the ``models`` extra (transformers, gguf, accelerate) and a weights package.
"""

from .decode import DecodeResult, decode_backends, greedy_decode_paged, long_prompt_decode, resolve_decode_fn
from .evaluate import BASELINE, accuracy_markdown, evaluate, next_token_kl, standard_configs
from .hook import (
    ATTN_NAME,
    CapturedKV,
    KVQuantConfig,
    KVStats,
    attention_handler,
    attention_variants,
    calibrate_scales,
    capture_kv,
    layer_types,
    num_layers,
    quantized_kv,
    run_quantized,
)
from .loading import (
    WEIGHTS,
    bos_token_id,
    load_model,
    model_cache_dir,
    text_source_info,
    text_tokens,
    windows,
)

__all__ = ["WEIGHTS", "load_model", "model_cache_dir", "text_tokens", "text_source_info", "bos_token_id",
           "KVQuantConfig", "KVStats", "CapturedKV", "quantized_kv", "run_quantized", "capture_kv",
           "calibrate_scales", "evaluate", "BASELINE", "standard_configs", "accuracy_markdown", "next_token_kl",
           "greedy_decode_paged", "long_prompt_decode", "attention_variants",
           "DecodeResult", "resolve_decode_fn", "decode_backends", "attention_handler", "ATTN_NAME", "num_layers",
           "layer_types", "windows"]
