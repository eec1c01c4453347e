"""Measurements behind the notebooks, one module per question; every public name is re-exported here.

Every function returns tidy pandas DataFrames (one measurement per row, every condition a column),
so notebooks only choose inputs, call, draw and save, and results of several GPUs concatenate.

* :mod:`~fp8kv.analysis.roundtrip` (notebook 01): what one FP8 cast does to values.
* :mod:`~fp8kv.analysis.errors` (notebook 02): the error of FP8 K, V and of the attention output by
  format × granularity × scale method, K-vs-V attribution, saturation, context length, real activations.
* :mod:`~fp8kv.analysis.kv_stats` (notebook 02): what K and V look like (outlier channels, tails).
* :mod:`~fp8kv.analysis.capacity` (notebook 03): tokens per GPU, FP8 over 16-bit, the accounting
  step by step, real caches' bytes beside the formula.
* :mod:`~fp8kv.analysis.decode_grids` (notebook 04): the decode-latency grid presets.
* :mod:`~fp8kv.analysis.accuracy` (notebook 06): real models with an FP8 KV cache.
* :mod:`~fp8kv.analysis.breakeven`: the context beyond which an FP8 KV cache decodes faster than a 16-bit
  one (latency lines fitted to bench rows, their crossing and its uncertainty).
* :mod:`~fp8kv.analysis.scale_health`: per layer and KV head, what each scale method saturates or flushes
  to zero and what it costs; the layers to keep 16-bit, and their price in tokens.
* :mod:`~fp8kv.analysis.long_context`: error against context to 128k tokens for fp8kv's decode and attend
  (the kernel's error apart from FP8's) and a planted needle that must stay the top-scored position and get
  the oracle's weight in the kernel's output.
* :mod:`~fp8kv.analysis.deciding` (notebook 09): the answer in two sentences from the three above it, and
  whether the keep-16-bit advice holds on text it was not chosen on; :mod:`~fp8kv.analysis.breakeven_text`: the
  break-even section's answer in full (intervals, measured pairs, each kernel's line).
* :mod:`~fp8kv.analysis.selection`: names a notebook selects from a registry, checked.
"""

from .accuracy import (
    LAYER_METRICS,
    SUMMARY_COLUMNS,
    AccuracyRun,
    greedy_decode_table,
    model_accuracy,
    model_descriptions,
    printable_decodes,
    printable_text,
)
from .advice_kl import advice_kl, advice_kl_text, stress_sentence
from .breakeven import (
    BREAKEVEN_GRID,
    LineFit,
    LineFitError,
    answer_text,
    breakeven_answers,
    breakeven_context,
    crossings,
    fit_line,
    fit_lines,
    line_points,
)
from .breakeven_text import speed_details
from .capacity import (
    capacity_grid,
    capacity_walkthrough,
    capacity_walkthroughs,
    measured_cache_bytes,
    measured_vs_formula,
    ratio_per_model,
    tokens_ratio,
    walkthrough_text,
)
from .deciding import headline, heldout_advice, heldout_scale_health
from .decode_grids import DECODE_GRIDS, DecodeGrid, decode_grid
from .errors import (
    QUANTIZE,
    SCALE_LABELS,
    attend,
    attribution,
    error_vs_context,
    key_numbers,
    quantization_error,
    quantization_results,
    real_kv_error,
    real_kv_error_or_reason,
    saturation_long,
    scale_argument,
    synthetic_vs_real,
)
from .format_errors import (
    COMPARED_FORMATS,
    format_accuracy,
    kv_format_errors,
    model_format_errors,
    synthetic_format_errors,
    through_format,
)
from .kv_stats import channel_amax, describe_kv
from .long_context import (
    LONG_CONTEXTS,
    SMOKE_CONTEXTS,
    long_context_error,
    long_context_text,
    long_context_verdict,
)
from .measured import measured_comparison
from .roundtrip import cast_comparison, roundtrip_sweep, scale_sweep
from .scale_health import (
    SCALE_HEALTH_METHODS,
    ScaleHealth,
    advice_capacity,
    calibration_scales,
    keep_bf16_advice,
    measure_scale_health,
    model_scale_health,
)
from .selection import format_names, registry_names

__all__ = ["COMPARED_FORMATS", "format_accuracy", "kv_format_errors", "model_format_errors", "synthetic_format_errors",
           "through_format", "SCALE_LABELS", "QUANTIZE", "scale_argument", "attend", "quantization_error",
           "error_vs_context", "attribution", "key_numbers", "saturation_long", "describe_kv", "channel_amax",
           "real_kv_error", "real_kv_error_or_reason", "synthetic_vs_real", "quantization_results",
           "capacity_grid", "tokens_ratio", "ratio_per_model", "capacity_walkthrough", "capacity_walkthroughs",
           "walkthrough_text", "measured_cache_bytes", "measured_vs_formula", "roundtrip_sweep", "scale_sweep",
           "cast_comparison", "DecodeGrid", "DECODE_GRIDS", "decode_grid", "registry_names", "format_names",
           "SUMMARY_COLUMNS", "LAYER_METRICS", "AccuracyRun", "model_accuracy", "model_descriptions",
           "printable_text", "printable_decodes", "greedy_decode_table", "BREAKEVEN_GRID", "LineFit", "LineFitError",
           "fit_line", "fit_lines", "line_points", "crossings", "answer_text", "measured_comparison", "breakeven_context",
           "breakeven_answers", "SCALE_HEALTH_METHODS", "ScaleHealth", "measure_scale_health", "calibration_scales",
           "keep_bf16_advice", "advice_capacity", "model_scale_health", "LONG_CONTEXTS", "SMOKE_CONTEXTS",
           "long_context_error", "long_context_verdict", "long_context_text", "headline", "heldout_advice",
           "heldout_scale_health", "advice_kl", "advice_kl_text", "stress_sentence", "speed_details"]
