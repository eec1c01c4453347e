"""fp8kv's own kernels and their launchers, one module per job.

:mod:`.decode` is paged decode attention (:func:`plan` a decode once, :func:`run` it many times, or
:func:`paged_decode`); :mod:`.attend` several new tokens per sequence over the cache (:func:`plan_attend` once,
:func:`run_attend` many times, or :func:`attend`: speculative verification, chunked-prefill append); :mod:`.cache_write` the fused quantize-and-scatter of new K/V rows
(:func:`write_cache`), :mod:`.quant_write` the same for INT8 / INT4 rows per token and head (:func:`write_quantized_rows`); :mod:`.copy` the streaming copy of the bandwidth ceiling (:func:`stream_copy`);
:mod:`.pages` a cache as the kernels take it; :mod:`.fp8_codec` the kernels' FP8 conversions. The names
below are the package's public ones, each defined in one of those modules.
"""

from ..launch_options import MAX_BLOCK_N, WARP_COUNTS
from .attend import AttendPlan, attend, attend_launch, plan_attend, run_attend
from .cache_write import cache_write_kernel, write_cache
from .copy import COPY_BLOCK, copy_kernel, stream_copy
from .decode import DecodePlan, paged_decode, plan, run
from .decode.combine import COMBINE_PDL, combine_as_dependent, combine_splits_kernel
from .decode.cuda_core_kernel import paged_decode_cuda_core_kernel
from .decode.gluon_launcher import (
    GLUON_BLOCK_N,
    GLUON_MIN_PACKED_SPLIT_TOKENS,
    GLUON_MIN_ROW_SPLIT_TOKENS,
    GLUON_MIN_SPLIT_TOKENS,
    GLUON_SMEM_EXTRA,
    GLUON_STAGES,
    gluon_arguments,
    gluon_launch,
    gluon_max_heads,
    gluon_smem_bytes,
    gluon_tile,
)
from .decode.planning import OUT_DTYPES, decode_kernel, decode_launch, gluon_refusal, launch_for
from .decode.splits import (
    FILL_WAVES_FEWER,
    LATENCY_WAVES,
    LATENCY_WAVES_PADDED,
    MAX_HEADS_PER_PROGRAM,
    MAX_HEADS_STREAMING,
    MAX_SPLITS_FOR_LATENCY,
    MAX_SPLITS_TO_FILL_SMS,
    MAX_STREAMING_HEAD_DIM,
    DecodeConfig,
    choose_num_splits,
    default_config,
    fill_waves,
    kernel_residency,
    latency_bound,
    latency_waves,
    launch_config,
    padded_rows,
    resident_programs,
    whole_tile_splits,
)
from .decode.triton_helpers import CONVERT_CAST, CONVERT_PTX, CONVERT_SOFTWARE
from .decode.triton_kernel import paged_decode_kernel
from .decode.triton_launcher import DEFAULT_SM89_CONVERT
from .pages import SCALE_CHANNEL, SCALE_PER_HEAD, SCALE_TOKEN_HEAD
from .quant_write import FUSED_WRITE_FORMATS, quant_write_kernel, write_quantized_rows

__all__ = ["paged_decode", "plan", "run", "attend", "attend_launch", "plan_attend", "run_attend", "AttendPlan",
           "DecodePlan", "decode_launch", "decode_kernel", "gluon_refusal",
           "gluon_launch", "write_cache", "choose_num_splits", "launch_config", "DecodeConfig", "default_config",
           "stream_copy", "MAX_HEADS_PER_PROGRAM", "latency_waves", "combine_as_dependent", "launch_for",
           "gluon_arguments", "gluon_tile", "gluon_smem_bytes", "gluon_max_heads", "padded_rows", "resident_programs",
           "kernel_residency", "fill_waves", "whole_tile_splits", "latency_bound", "cache_write_kernel", "copy_kernel",
           "combine_splits_kernel", "paged_decode_kernel", "paged_decode_cuda_core_kernel", "CONVERT_CAST",
           "CONVERT_PTX", "CONVERT_SOFTWARE", "SCALE_CHANNEL", "SCALE_PER_HEAD", "SCALE_TOKEN_HEAD",
           "DEFAULT_SM89_CONVERT", "OUT_DTYPES", "WARP_COUNTS", "MAX_BLOCK_N", "MAX_HEADS_STREAMING",
           "MAX_STREAMING_HEAD_DIM", "MAX_SPLITS_FOR_LATENCY", "MAX_SPLITS_TO_FILL_SMS", "LATENCY_WAVES",
           "LATENCY_WAVES_PADDED", "FILL_WAVES_FEWER", "GLUON_BLOCK_N", "GLUON_MIN_SPLIT_TOKENS", "GLUON_MIN_ROW_SPLIT_TOKENS", "GLUON_MIN_PACKED_SPLIT_TOKENS", "GLUON_STAGES",
           "GLUON_SMEM_EXTRA", "COMBINE_PDL", "COPY_BLOCK", "write_quantized_rows", "quant_write_kernel",
           "FUSED_WRITE_FORMATS"]
