"""fp8kv: a workbench for FP8 KV caches in LLM attention.

Public names (see README.md for a tour)::

    fp8kv.FORMATS, fp8kv.format("e4m3")          FP8 format facts and code tables
    fp8kv.quantize(x, ...) -> Quantized          saturating FP8 quantizer
    fp8kv.PagedKVCache                           paged KV cache (FP8 or 16-bit)
    fp8kv.reference.decode(q, cache)             fp32 oracle
    fp8kv.decode(q, cache, backend, mode)        reference / Triton / FlashInfer / vLLM decode
    fp8kv.attend(q, cache, qo_indptr, ...)       several new tokens per sequence (spec-verify, chunked prefill)
    fp8kv.capability(arch)                       what runs where, and why
    fp8kv.plan_capacity(model, kv_dtype, ...)    KV-capacity planner
    fp8kv.MODEL_SHAPES, fp8kv.GPUS               the planner's model shapes and GPUs (MODELS: the same
                                                 registry; fp8kv.models.WEIGHTS are the offline weights)
"""

from . import reference
from .backends import attend, decode
from .cache import PagedKVCache
from .capability import UnsupportedError, capability
from .capacity import GPUS, MODEL_SHAPES, MODELS, CapacityError, ModelShape, capacity_table, plan_capacity
from .formats import FORMATS, FP8Format, format
from .quant import Quantized, quantize

__version__ = "0.1.0"

__all__ = ["FORMATS", "FP8Format", "format", "quantize", "Quantized", "PagedKVCache", "reference", "decode",
           "attend", "capability", "UnsupportedError", "plan_capacity", "capacity_table", "ModelShape", "MODEL_SHAPES",
           "MODELS", "GPUS", "CapacityError", "__version__"]
