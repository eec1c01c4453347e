"""The Gluon decode kernel built for a GPU that need not be here (:mod:`fp8kv.ops.offline_build`): the
registers, spilled bytes, shared memory and SASS of a launch read on a CPU.

:func:`build` compiles the launch :func:`.gluon_launcher.gluon_launch` plans for a head layout at a batch ×
context on a GPU of so many SMs (an H200 by default), with the arguments and constexprs of
:func:`.gluon_launcher.gluon_arguments` for one sequence of that context (the same strides as the batch's but
the query's and the partials' batch stride) and the specialisation Triton gives a launch (pointers and
integers that are multiples of 16 marked so, integers equal to 1 made constants). :func:`block_table_waits`
reads the SASS's scheduling bits: where in the main loop the first instruction waits for each block-table
load. ``scripts/gluon_sass.py`` prints both for a layout; the CPU tests check the H200's launches with them.

It needs a process where the Triton interpreter was off when triton was first imported: the interpreter
replaces Triton's own library functions, which then cannot be compiled.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from triton.experimental.gluon._runtime import GluonASTSource

from ... import checks
from ...cache import PagedKVCache
from ...cache.quantized import QuantizedPagedKVCache
from ...capability import check_query
from ...kv_formats import kv_format
from ..offline_build import (
    TARGET_ARCHS,
    Compiled,
    Instruction,
    compile_kernel,
    instructions,
    loop_issue,
    main_loop,
)
from .combine import split_partials
from .gluon_launcher import gluon_arguments, gluon_launch, kernel_module
from .gluon_scope import GLUON_QUANTIZED_FORMATS, MAX_HEAD_DIM, NUM_WARPS, head_parts
from .planning import gluon_refusal, gluon_window
from .splits import resident_programs

# The archs build() compiles for: fp8kv's targets (capability.ARCHS) that have the FP8 conversions the kernel's
# cvt.rn.f16x2.e4m3x2 needs, sm89+ (the bound .planning.gluon_refusal applies to a GPU). Below it Triton raises
# a CompilationError; an arch Triton does not know can abort the process in LLVM, so only these are tried.
BUILD_ARCHS = tuple(n for n in TARGET_ARCHS if n >= 89)


@dataclass(frozen=True)
class Build(Compiled):
    """One compiled Gluon kernel (:class:`~fp8kv.ops.offline_build.Compiled`), how many of its programs an SM
    holds, and what one KV head's programs read of a token."""
    programs_per_sm: int  # resident on one H100 / H200 SM (.splits.resident_programs)
    programs_per_head: int  # programs that read each token of a KV head: head tiles x parts
    bytes_per_token: float  # a KV head's bytes of a token in memory: K and V codes, their per-token scales


def gluon_loop_mix(kernel: Build, cfg: dict) -> dict:
    """:func:`~fp8kv.ops.offline_build.loop_issue` of a build and its launch ``cfg``: ``issue_per_token`` counts the
    warps of every program that reads a KV head's token, to set beside
    :func:`~fp8kv.ops.offline_build.issue_budget` of ``kernel.bytes_per_token``."""
    return loop_issue(kernel.sass, block_n=cfg["block_n"], num_warps=NUM_WARPS,
                      programs_per_head=kernel.programs_per_head)


def block_table_waits(sass: str) -> list[tuple[Instruction, Instruction | None, bool]]:
    """For each global load in the Gluon kernel's main loop (its only ones there: the block-table entries of
    the tile it copies next), the first instruction that waits for it, by scoreboard (None: none in the
    loop), and whether that instruction is in the next iteration. A wait in the same iteration stalls the
    warp for the load's whole latency once a tile (docs/decode-kernel-notes.md, seventh round)."""
    loop = main_loop(instructions(sass))
    waits = []
    for k, load in enumerate(loop):
        if not re.match(r"(@!?U?P\w+\s+)?LDG\.", load.text):
            continue
        later = next(((loop[(k + d) % len(loop)], k + d >= len(loop)) for d in range(1, len(loop) + 1)
                      if load.write_barrier is not None
                      and loop[(k + d) % len(loop)].wait_mask >> load.write_barrier & 1), (None, False))
        waits.append((load, *later))
    return waits


def block_table_summary(sass: str) -> dict:
    """:func:`block_table_waits` in brief: how many block-table loads the tile loop has, how many of them no
    instruction in the loop waits for, and the instructions that wait for one in the tile that loads it
    (address and text; none in a kernel that hides the load behind a tile)."""
    waits = block_table_waits(sass)
    return dict(loads=len(waits), never_waited_for=sum(w is None for _, w, _ in waits),
                waited_in_the_loading_tile=[f"{w.address:#x} {w.text}" for _, w, next_tile in waits
                                            if w is not None and not next_tile])


@functools.cache
def _refusal_of_a_cpu() -> str | None:
    """What :func:`.planning.gluon_refusal` says of a launch inside the kernel's scope when asked on the CPU (an
    offline build is): its refusal of the device, found by asking it of such a launch (one KV head at the largest
    head_dim), so that any other refusal is a shape the kernel does not take, whatever its wording."""
    cache = PagedKVCache.empty(1, 16, 1, MAX_HEAD_DIM, kv_dtype="fp8_e4m3")
    return gluon_refusal(cache, "dequant", MAX_HEAD_DIM, 1, torch.device("cpu"))


def _check_build(num_q_heads, num_kv_heads, head_dim, batch, context, block_n, num_stages, heads_per_program,
                 q_dtype, kv_dtype, block_size, arch, granularity="tensor") -> tuple[PagedKVCache, int, int]:
    """build()'s arguments against the kernel's scope, each refusal naming its argument (Triton would otherwise
    compile some of them silently, e.g. a head_dim of 512 or an fp32 query, or fail deep inside: a head_dim of 40
    in an MLIR pass, sm80 in a CompilationError, no KV heads in a ZeroDivisionError). Returns the one-sequence
    cache of the build, the group and the arch."""
    hq = checks.positive_int(num_q_heads, "num_q_heads")
    hkv = checks.positive_int(num_kv_heads, "num_kv_heads")
    d = checks.positive_int(head_dim, "head_dim")
    checks.positive_int(batch, "batch")
    context = checks.positive_int(context, "context")
    if hq % hkv:  # the kernel's group (query heads per KV head) is Hq / Hkv: 5 / 2 would build a group of 2
        checks.fail(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}: each KV head serves "
                    "num_q_heads / num_kv_heads query heads")
    arch = checks.integer(arch, "arch")  # 90 for sm90
    if arch not in BUILD_ARCHS:
        checks.fail(f"arch={arch}; expected one of {BUILD_ARCHS} (fp8kv's targets with the FP8 conversions the Gluon "
                    "kernel uses, sm89+)")
    if kv_dtype in GLUON_QUANTIZED_FORMATS:
        cache = QuantizedPagedKVCache.empty(kv_format(kv_dtype), 1, context, hkv, d, block_size=block_size)
    else:
        cache = PagedKVCache.empty(1, context, hkv, d, block_size=block_size, kv_dtype=kv_dtype,
                                   granularity=granularity)
    why = gluon_refusal(cache, "dequant", d, hq // hkv, torch.device("cpu"), block_n=block_n,
                            num_stages=num_stages, heads_per_program=heads_per_program)
    if why != _refusal_of_a_cpu():  # the kernel's own scope (FP8, head dims, heads per program), by name
        checks.fail(f"{why} (num_q_heads={hq}, num_kv_heads={hkv}, head_dim={d}, kv_dtype={kv_dtype!r})")
    # fp8kv.decode's check of a triton decode's query, whichever kernel runs: 16-bit queries (and no fp16 one over bf16 pages)
    pages = cache.kv_dtype if isinstance(cache, PagedKVCache) else "fp8_e4m3"  # INT8 / INT4 codes take a query as FP8 pages do
    ok, why = check_query("triton", q_dtype, pages) if isinstance(q_dtype, torch.dtype) else \
        (False, f"q_dtype is a {type(q_dtype).__name__}, not a torch dtype")
    if not ok:
        checks.fail(f"q_dtype={q_dtype!r}: the Gluon kernel takes a torch.bfloat16 or torch.float16 query; {why}",
                    TypeError)
    return cache, hq // hkv, arch


def build(num_q_heads: int, num_kv_heads: int, head_dim: int, *, batch: int = 64, context: int = 16384,
          num_sms: int = 132, block_n: int | None = None, num_stages: int | None = None,
          heads_per_program: int | None = None, q_dtype: torch.dtype = torch.bfloat16, kv_dtype: str = "fp8_e4m3",
          block_size: int = 16, arch: int = 90, qo_len: int = 1, window: int | None = None,
          granularity: str = "tensor", max_registers: int | None = None) -> tuple[Build, dict]:
    """Compile the Gluon decode of ``num_q_heads`` / ``num_kv_heads`` / ``head_dim`` for ``sm{arch}``: the launch
    :func:`.gluon_launcher.gluon_launch` plans for ``batch`` sequences of ``context`` tokens on ``num_sms`` SMs with
    these options (None: its defaults, the ring depths of a GPU with room for them). Returns the build and
    the launch, its splits filling the waves of the programs an SM holds of this build (as on the GPU).
    ``qo_len``: new tokens per sequence (speculative verification: ``group x qo_len`` rows per KV head); ``window``:
    a sliding window (tokens, shorter than ``context``), or None; ``granularity``: the FP8 pages' scales ("tensor" or
    "token_head"); ``kv_dtype`` "int8_token_head" / "int4_token_head": a quantized cache of INT8 / INT4 codes per token and head;
    ``max_registers``: a cap on the registers a thread (ptxas's ``maxnreg``: a what-if the launcher does not take), or None.

    The arguments must be within the kernel's scope (:func:`.planning.gluon_refusal`): ``num_q_heads`` a
    multiple of ``num_kv_heads``, head_dim a multiple of 16 from 48 to 256, an FP8 ``kv_dtype`` (or a quantized format of GLUON_QUANTIZED_FORMATS), a bf16 / fp16
    ``q_dtype``, ``arch`` in :data:`BUILD_ARCHS`; else a ValueError / TypeError naming the argument, before
    anything is compiled."""
    # the arguments first (the launch plan checks block_n, num_stages and num_sms): a bad one is named in any
    # process, whatever its Triton
    cache, group, arch = _check_build(num_q_heads, num_kv_heads, head_dim, batch, context, block_n, num_stages,
                                      heads_per_program, q_dtype, kv_dtype, block_size, arch, granularity)
    qo_len = checks.positive_int(qo_len, "qo_len")
    window = None if window is None else checks.positive_int(window, "window")
    window = gluon_window(cache, window)
    max_registers = None if max_registers is None else checks.positive_int(max_registers, "max_registers")
    cfg = gluon_launch(batch, cache, group, block_n=block_n, num_stages=num_stages,
                           heads_per_program=heads_per_program, device=torch.device("cpu"), num_sms=num_sms,
                           qo_len=qo_len, window=window)
    q = torch.zeros(qo_len, num_q_heads, head_dim, dtype=q_dtype)
    part_out, part_lse = split_partials(qo_len, num_q_heads, cfg["num_splits"], head_dim, q.device)
    _, args, constants = gluon_arguments(q, cache, cfg, 1.0, part_out, part_lse, qo_len, window)
    kernel = compile_kernel(kernel_module().gluon_decode_kernel, args, constants, arch=arch, num_warps=NUM_WARPS,
                            source_cls=GluonASTSource, max_registers=max_registers)
    programs = resident_programs(kernel.registers, kernel.shared_bytes, NUM_WARPS)
    # the splits as the GPU plans them: filling the waves of the programs this build leaves an SM room for (the
    # split count is a runtime argument: the build is the same)
    cfg = gluon_launch(batch, cache, group, block_n=block_n, num_stages=num_stages,
                           heads_per_program=heads_per_program, device=torch.device("cpu"), num_sms=num_sms,
                           programs_per_sm=programs, qo_len=qo_len, window=window)
    return Build(registers=kernel.registers, spilled_bytes=kernel.spilled_bytes, shared_bytes=kernel.shared_bytes,
                 sass=kernel.sass, programs_per_sm=programs, programs_per_head=cfg["head_tiles"] * head_parts(head_dim),
                 bytes_per_token=float(cache.bytes_per_token()) / num_kv_heads), cfg
