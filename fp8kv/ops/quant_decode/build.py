"""The quantized-page decode kernel built for a GPU that need not be here (:mod:`fp8kv.ops.offline_build`): the
launch fp8kv plans for one format, head layout and code conversion (its tile, warps and stages as on a GPU),
what ptxas allocated for it and its tile loop's instructions by kind — where the conversions' cost shows
before any GPU times it. ``scripts/quant_decode_sass.py`` prints the table. Build in a process where the
Triton interpreter is off."""

from __future__ import annotations

import torch

from ... import checks
from ...cache.quantized import QuantizedPagedKVCache
from ..decode.combine import split_partials
from ..offline_build import TARGET_ARCHS, Compiled, compile_kernel, loop_issue
from . import check_launch_options
from .kernel import quant_decode_kernel
from .launcher import QUANT_DECODE_FORMATS, QuantDecodeLaunch, quant_decode_arguments, quant_decode_launch

__all__ = ["build_quant_decode", "loop_mix"]


def build_quant_decode(fmt: str, num_q_heads: int, num_kv_heads: int, head_dim: int, *, convert: str,
                       num_splits: int = 8, block_n: int | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, q_dtype: torch.dtype = torch.bfloat16, arch: int = 90,
                       context: int = 16384) -> tuple[Compiled, QuantDecodeLaunch]:
    """Compile the decode of one sequence of ``context`` tokens in ``fmt`` (a name of :data:`QUANT_DECODE_FORMATS`)
    for ``sm{arch}``: ``num_splits`` splits (more than one: the split kernel a batch × long context runs),
    ``block_n`` / ``num_warps`` / ``num_stages`` None for the GPU's defaults; every argument checked by name as
    :func:`~fp8kv.ops.quant_decode.paged_decode_quantized` checks it. Returns the build and its launch."""
    checks.one_of(fmt, "fmt", tuple(QUANT_DECODE_FORMATS))
    num_splits, block_n, num_warps, num_stages = check_launch_options(num_splits, block_n, convert, num_warps,
                                                                      num_stages)
    hq, hkv = checks.positive_int(num_q_heads, "num_q_heads"), checks.positive_int(num_kv_heads, "num_kv_heads")
    if hq % hkv:
        checks.fail(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}")
    context = checks.positive_int(context, "context")
    checks.one_of(checks.integer(arch, "arch"), "arch", TARGET_ARCHS)
    if not isinstance(q_dtype, torch.dtype):
        checks.fail(f"q_dtype={q_dtype!r}; expected a torch dtype (float16, bfloat16 or float32)", TypeError)
    scale = {"k_tensor_scale": 1.0, "v_tensor_scale": 1.0} if fmt == "nvfp4" else {}
    cache = QuantizedPagedKVCache.empty(fmt, 1, context, hkv, head_dim, **scale)
    launch = quant_decode_launch(cache, batch=1, num_q_heads=hq, q_dtype=q_dtype, device=torch.device("cpu"),
                                 sm_scale=checks.resolved_softmax_scale(None, head_dim), out_dtype=q_dtype,
                                 num_splits=num_splits, block_n=block_n, convert=convert, num_warps=num_warps,
                                 num_stages=num_stages)
    q = torch.zeros(1, hq, head_dim, dtype=q_dtype)
    cache.check_query(q)  # the entry's check of the query (dtype, heads, head_dim)
    out, lse = split_partials(1, hq, launch.num_splits, head_dim, q.device) if launch.num_splits > 1 else \
        (torch.zeros_like(q), torch.zeros(1, hq))
    constants = {k: v for k, v in launch.constexprs.items() if k not in ("num_warps", "num_stages")}
    kernel = compile_kernel(quant_decode_kernel, quant_decode_arguments(q, cache, launch, out, lse), constants,
                            arch=arch, num_warps=launch.constexprs["num_warps"],
                            num_stages=launch.constexprs["num_stages"])
    return kernel, launch


def loop_mix(kernel: Compiled, launch: QuantDecodeLaunch) -> dict:
    """The tile loop's instructions by kind (:func:`fp8kv.ops.offline_build.loop_issue`, one warp's), the
    tile's tokens (``block_n``), ``num_warps``, and ``issue_per_token``: the warp instructions the program's
    warps issue per token of K and V (an SM issues four a clock, one per scheduler)."""
    return loop_issue(kernel.sass, block_n=launch.block_n, num_warps=launch.constexprs["num_warps"])
