"""The bench's named grids (``fp8kv bench --preset NAME``): :data:`PRESETS`, each the arguments of
:func:`fp8kv.bench.sweep` (or of :func:`fp8kv.bench.attend.attend_sweep` where it holds ``q_lens``), and
:data:`PRESET_HELP`, the line ``--help`` prints for each."""

from __future__ import annotations

from ..analysis.breakeven import BREAKEVEN_GRID
from .attend import ATTEND_PRESET_HELP, ATTEND_PRESETS
from .formats import QUANT_KV_DTYPES

__all__ = ["PRESETS", "PRESET_HELP", "PAGE_SIZES"]

PAGE_SIZES = (1, 2, 4, 8, 12, 16, 32, 64, 100, 128)  # tokens a page: SGLang's 1 to 128, two not powers of two
PRESETS = {
    "target": dict(batches=[1, 16, 64, 256], contexts=[4096, 16384, 32768], heads=[(32, 8)], head_dims=[128],
                   block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                   backends=["triton", "flashinfer"], granularities=["tensor"],
                   flashinfer_tensor_cores=[False, True]),
    "tune": dict(batches=[16, 64, 256], contexts=[16384], heads=[(32, 8)], head_dims=[128], block_sizes=[16],
                 kv_dtypes=["fp8_e4m3"], modes=["dequant"], backends=["triton"], granularities=["tensor"],
                 triton_options=[{}, *({"num_splits": s} for s in (1, 2, 4, 8, 16)), {"block_n": 64},
                                 {"num_stages": 3}, {"num_warps": 8}, {"convert": "cast"},
                                 {"convert": "cast/ptx"}]),
    "smoke": dict(batches=[2], contexts=[48], heads=[(4, 2)], head_dims=[64], block_sizes=[16],
                  kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                  backends=["triton", "flashinfer", "reference"], granularities=["tensor"],
                  flashinfer_tensor_cores=[True]),
    # Page sizes from SGLang's 1 to 128 (powers of two and two that are not), latency- and bandwidth-bound, at
    # Llama-3-8B's layout: each backend's FP8 rate at a page size against its own at 16 (fp8kv.bench.page_size_table)
    "page-sizes": dict(batches=[1, 64], contexts=[16384], heads=[(32, 8)], head_dims=[128],
                       block_sizes=list(PAGE_SIZES), kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"],
                       backends=["triton", "flashinfer", "vllm"], granularities=["tensor"],
                       flashinfer_tensor_cores=[False, True]),
    # Sliding-window layers (Gemma-3-like), B x window >= 64k tokens: time and bytes bounded by the
    # window, not the context; FlashInfer with window_left beside; fp8kv's default kernel beside its Gluon kernel
    # (gluon=True: FP8 pages in dequant mode; marked unsupported elsewhere). Two shapes: Hq/Hkv/D 32/16/128 and
    # Gemma-3-270M's 4/1/256.
    "window": dict(batches=[64, 128], contexts=[16384, 32768], heads=[(32, 16)], head_dims=[128], block_sizes=[16],
                   kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"], backends=["triton", "flashinfer"],
                   granularities=["tensor"], flashinfer_tensor_cores=[False, True], windows=[512, 1024],
                   triton_options=[{}, {"gluon": True}]),
    "window-gemma3": dict(batches=[64, 128], contexts=[16384, 32768], heads=[(4, 1)], head_dims=[256],
                          block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                          backends=["triton", "flashinfer"], granularities=["tensor"],
                          flashinfer_tensor_cores=[False, True], windows=[512, 1024],
                          triton_options=[{}, {"gluon": True}]),
    # Head layouts of real model families, side by side with FlashInfer and vLLM's Triton kernel (where
    # vllm imports; every row checked first):
    # MHA (Llama-2-7B 32/32/128, Phi-2 32/32/80, Phi-3-mini 32/32/96), GQA with power-of-two and odd
    # groups (Llama-3-8B 32/8/128, Qwen2.5-14B 40/8/128: 5, Qwen2-7B 28/4/128: 7, Qwen2-0.5B 14/2/64: 7),
    # MQA (Gemma-2B 8/1/256, Falcon-7B 71/1/64) and head dim 112 (32/8/112); latency (B=1) and
    # bandwidth points (B x ctx >= 64k tokens).
    "layouts": dict(batches=[1, 64], contexts=[4096, 16384],
                    shapes=[(32, 32, 128), (32, 32, 80), (32, 32, 96), (32, 8, 128), (40, 8, 128), (28, 4, 128),
                            (14, 2, 64), (8, 1, 256), (71, 1, 64), (32, 8, 112)],
                    block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"],
                    backends=["triton", "flashinfer", "vllm"], granularities=["tensor"],
                    flashinfer_tensor_cores=[False, True]),
    # The opt-in CUDA-core kernel against the tensor-core one where the group is 1 or 2 (MHA: Llama-2-7B,
    # Phi-2, Phi-3-mini, Gemma-7B's 16/16/256; group 2: Qwen3-1.7B's 16/8/128), a few tile sizes,
    # FlashInfer beside: the measurement that decides whether it becomes the default.
    "layouts-cuda-core": dict(batches=[1, 64], contexts=[4096, 16384],
                              shapes=[(32, 32, 128), (32, 32, 80), (32, 32, 96), (16, 16, 256), (16, 8, 128)],
                              block_sizes=[16],
                              kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"], backends=["triton", "flashinfer"],
                              granularities=["tensor"], flashinfer_tensor_cores=[False, True],
                              triton_options=[{}, {"use_tensor_cores": False},
                                              {"use_tensor_cores": False, "block_n": 64}]),
    # Large MQA groups (Falcon-7B 71/1/64, StarCoder 48/1/128) with the group cut into programs of at
    # most 16 / 24 / 36 query heads, against the default and against one program for the whole group.
    "layouts-mqa": dict(batches=[1, 64], contexts=[4096, 16384], shapes=[(71, 1, 64), (48, 1, 128)], block_sizes=[16],
                        kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"], backends=["triton", "flashinfer"],
                        granularities=["tensor"], flashinfer_tensor_cores=[True],
                        triton_options=[{}, {"heads_per_program": 16}, {"heads_per_program": 24},
                                        {"heads_per_program": 36}, {"heads_per_program": 128}]),
    # Latency-bound decode (B <= 4), FlashInfer and vLLM beside, on the layouts where the split count weighs most.
    "latency": dict(batches=[1, 2, 4], contexts=[1000, 4096, 16384],
                    shapes=[(32, 8, 128), (8, 1, 256), (32, 32, 128), (14, 2, 64)], block_sizes=[16],
                    kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"], backends=["triton", "flashinfer", "vllm"],
                    granularities=["tensor"], flashinfer_tensor_cores=[False, True]),
    # The Triton kernel with two stages (the rule) and three: with two its loop waits on block-table loads every
    # tile (SASS: 24 loads a tile at 8/1/256, waited on 2-44 instructions later), with three Triton pipelines
    # them (docs/decode-kernel-notes.md); latency- and bandwidth-bound, FlashInfer beside.
    "stages": dict(batches=[1, 4, 64], contexts=[4096, 16384],
                   shapes=[(16, 8, 256), (8, 1, 256), (14, 2, 64), (12, 4, 64), (32, 32, 80), (32, 8, 128)],
                   block_sizes=[16], kv_dtypes=["fp8_e4m3"], modes=["dequant"], backends=["triton", "flashinfer"],
                   granularities=["tensor"], flashinfer_tensor_cores=[False, True],
                   triton_options=[{}, {"gluon": False}, {"gluon": False, "num_stages": 3}]),
    # The Gluon kernel (gluon=True) beside the Triton kernel (gluon=False), FlashInfer and vLLM, on the layouts
    # it covers (head dims 64-256, groups up to 16), bandwidth- and latency-bound.
    "gluon": dict(batches=[1, 64], contexts=[4096, 16384],
                  shapes=[(32, 8, 128), (28, 4, 128), (32, 32, 128), (14, 2, 64), (12, 4, 64), (16, 2, 96),
                          (32, 32, 80), (32, 32, 96), (32, 8, 112), (8, 1, 256), (16, 8, 256)],
                  block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"],
                  backends=["triton", "flashinfer", "vllm"], granularities=["tensor"], flashinfer_tensor_cores=[False, True],
                  triton_options=[{"gluon": True}, {"gluon": False}]),
    "layouts-smoke": dict(batches=[2], contexts=[48], shapes=[(4, 4, 32), (4, 1, 64), (6, 2, 48)], block_sizes=[16],
                          kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"], backends=["triton", "flashinfer"],
                          granularities=["tensor"], flashinfer_tensor_cores=[True]),
    # The quantized formats through fp8kv's kernels beside FP8 (one scale per tensor, and per token and head, as
    # INT8's) and BF16, same shapes (Llama-3-8B's GQA and an MQA-like 8:1), every row checked against its oracle
    # first; INT8, INT4 and FP8 by the default kernel and by the Triton kernel (gluon=False).
    "formats": dict(batches=[1, 16, 64], contexts=[4096, 16384, 32768], shapes=[(32, 8, 128), (8, 1, 128)],
                    block_sizes=[16], kv_dtypes=[*QUANT_KV_DTYPES, "fp8_e4m3", "bf16"], modes=["dequant"],
                    backends=["triton"], granularities=["tensor", "token_head"], triton_options=[{}, {"gluon": False}]),
    # Launch variants of the quantized-page kernel around its defaults, one option at a time: the code conversion
    # (fp8kv.ops.quant_decode.codes) and the tile, where the formats row's time is decided.
    "formats-tune": dict(batches=[16, 64], contexts=[32768], shapes=[(32, 8, 128), (8, 1, 128)],
                         block_sizes=[16], kv_dtypes=list(QUANT_KV_DTYPES), modes=["dequant"], backends=["triton"],
                         granularities=["tensor"],
                         triton_options=[{}, {"convert": "software"}, {"convert": "ptx"}, {"convert": "cast"},
                                         {"block_n": 64}, {"block_n": 128}, {"num_stages": 1}, {"num_stages": 2},
                                         {"num_stages": 3}, {"num_warps": 8}]),
    "formats-smoke": dict(batches=[2], contexts=[48], shapes=[(4, 2, 64), (2, 1, 32)], block_sizes=[16],
                          kv_dtypes=[*QUANT_KV_DTYPES, "fp8_e4m3", "bf16"], modes=["dequant"],
                          backends=["triton", "reference"], granularities=["tensor"]),
    **ATTEND_PRESETS,  # several new tokens per sequence (fp8kv.bench.attend): their grids hold q_lens
    "breakeven": dict(BREAKEVEN_GRID),  # the latency lines fp8kv.analysis.breakeven fits (its one home)
}
# What each preset is for (printed by --help).
PRESET_HELP = {
    "target": "the performance target grid: B 1-256 x context 4k-32k, Hq:Hkv 32:8, D 128, bf16 vs fp8_e4m3, "
              "Triton and FlashInfer (GPU)",
    "tune": "launch variants of the Triton FP8 kernel around its defaults (split count, tile, warps, stages, "
            "FP8 conversion), one option at a time, at B 16-256 x context 16k (GPU)",
    "smoke": "a tiny grid that runs anywhere in seconds; on CPU add --interpret for the Triton rows (there the "
             "16-bit cache and query are fp16, since the Triton interpreter's bf16 arithmetic is wrong)",
    "page-sizes": "pages of 1, 2, 4, 8, 12, 16, 32, 64, 100 and 128 tokens at 32/8/128, B 1 and 64 x context 16k, "
                  "bf16 vs fp8_e4m3, Triton, FlashInfer and vLLM's Triton kernel side by side; "
                  "fp8kv.bench.page_size_table reads it (GPU)",
    "window": "sliding-window layers at Hq:Hkv 32:16, D 128: B 64-128 x context 16k-32k x window 512/1024, "
              "bf16 vs fp8_e4m3, Triton and FlashInfer (window_left); time and bytes bounded by the window (GPU)",
    "window-gemma3": "the same windows at Gemma-3-270M's shape, Hq:Hkv 4:1, D 256 (GPU)",
    "layouts": "head layouts of real model families (MHA, GQA groups 4/5/7, MQA; D 64-256) at B 1-64 x context "
               "4k-16k, bf16 vs fp8_e4m3, Triton, FlashInfer and vLLM's Triton kernel (where vllm imports) "
               "side by side; fp8kv.bench.layout_table reads it (GPU)",
    "layouts-cuda-core": "the opt-in CUDA-core Triton kernel (use_tensor_cores=False, tiles of 32/64 tokens) "
                         "against the tensor-core one and FlashInfer on MHA and group-2 layouts, B 1-64 x context "
                         "4k-16k (GPU)",
    "layouts-mqa": "large MQA groups (71/1/64, 48/1/128) with the group cut into programs of at most 16, 24, 36 "
                   "or all query heads (heads_per_program), FlashInfer beside, B 1-64 x context 4k-16k (GPU)",
    "latency": "latency-bound decode, B 1-4 x context 1000-16k on four layouts (GQA, MQA with D 256, MHA, "
               "group 7 with D 64), bf16 vs fp8_e4m3, Triton, FlashInfer and vLLM's Triton kernel (where vllm "
               "imports) side by side (GPU)",
    "stages": "the Triton FP8 kernel with 2 pipeline stages (its rule) and 3 (its block-table loads pipelined), "
              "the default launch beside, B 1/4/64 x context 4k/16k on six layouts (D 64-256), FlashInfer "
              "beside (GPU)",
    "gluon": "the Gluon FP8 kernel (gluon=1; the default on long splits) beside the Triton kernel (gluon=0), "
             "FlashInfer and vLLM's Triton kernel (where vllm imports) on the layouts it covers (MHA, GQA 2-8; "
             "D 64-128), B 1-64 x context 4k-16k (GPU)",
    "layouts-smoke": "three tiny head layouts (MHA, MQA, an odd group) that run anywhere; on CPU add --interpret",
    "formats": "the quantized KV formats (INT8 / INT4 per token and head, NVFP4, MXFP4) through fp8kv's "
               "kernels (INT8 and INT4 by the Gluon kernel and by the Triton kernel, gluon=False) beside fp8_e4m3 and bf16: B 1/16/64 x context 4k/16k/32k, Hq:Hkv:D 32:8:128 "
               "and 8:1:128, every row checked against its oracle (GPU)",
    "formats-tune": "launch variants of the quantized-page kernel around each format's default "
                    "(fp8kv.ops.quant_decode.launcher.QUANT_LAUNCH_DEFAULTS), one option at a time: code "
                    "conversion software / ptx / cast, tiles of 64 / 128 tokens, 1-3 stages, 8 warps (an option "
                    "equal to a format's default repeats its default row), B 16/64 x context 32k, "
                    "Hq:Hkv:D 32:8:128 and 8:1:128 (GPU)",
    "formats-smoke": "the same formats at a tiny size that runs anywhere, the oracle beside; on CPU add --interpret",
    **ATTEND_PRESET_HELP,
    "breakeven": "9 log-spaced contexts 512-32k x B 1/16/64, Hq:Hkv 32:8, D 128, bf16 vs fp8_e4m3, Triton and "
                 "FlashInfer: the latency lines fp8kv.analysis.breakeven_context fits and crosses (GPU)",
}
assert set(PRESET_HELP) == set(PRESETS), "every preset is described in --help"
