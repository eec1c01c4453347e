"""The multi-token attend kernel's tile loop, built for sm90 without a GPU: how many instructions a warp issues per
key tile at the chunk launch (prefill chunks and long drafts: 128 query rows, D 128, 8 warps; keys per tile and
stages as ``fp8kv.ops.attend`` plans 32/8/128 on sm90, or as asked), 16-bit pages against FP8 pages in dequant
mode and in fp8 mode, the probabilities rounded to e4m3 by bit arithmetic (the interpreter's way) or by the GPU's
conversion:

    python scripts/attend_sass.py [--block-n 64 --stages 2] [--out results/sass]

Writes ``<out>/sm90/<timestamp>-attend.csv`` and its metadata (never over another file): per build the registers,
shared memory, the loop's length and its instructions by kind (tensor-core ``*GMMA``, conversions ``F2FP``, the
byte moves ``PRMT`` / ``SHF`` / ``LOP3``, global loads to registers ``LDG`` or straight to shared memory ``LDGSTS``,
shared-memory stores ``STS``, barriers ``BAR``, ``MUFU`` exponentials). Static counts of
one build with this machine's Triton: only a benchmark says what runs faster. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import pandas as pd
import torch
import triton

from fp8kv.cache import PagedKVCache
from fp8kv.ops.attend.kernel import paged_attend_kernel
from fp8kv.ops.attend.planning import CHUNK_TILES, attend_constexprs
from fp8kv.ops.decode.triton_launcher import CONVERT_CODES
from fp8kv.ops.offline_build import compile_kernel, instructions, main_loop
from fp8kv.ops.pages import kernel_pages, page_strides
from fp8kv.results import save_table, utc_stamp

ARCH = 90
HQ, HKV, D, PAGE, CONTEXT, ROWS = 32, 8, 128, 16, 4096, 512
BLOCK_M, NUM_WARPS = 128, 8  # a chunk's tiles at 32/8/128; keys per tile and stages: the command line's
# (KV dtype, mode, probabilities rounded by the GPU's conversion): the 16-bit baseline, dequant, fp8 both ways
BUILDS = [("bf16", "dequant", False), ("fp8_e4m3", "dequant", False), ("fp8_e4m3", "fp8", False),
          ("fp8_e4m3", "fp8", True)]
KINDS = ("HGMMA", "QGMMA", "F2FP", "PRMT", "SHF", "LOP3", "LDG", "LDGSTS", "STS", "LDS", "LDSM", "BAR", "MUFU", "FMNMX")


def build(launch: dict, kv_dtype: str, mode: str, round_hw: bool) -> dict:
    cache = PagedKVCache.empty(1, CONTEXT, HKV, D, block_size=PAGE, kv_dtype=kv_dtype)
    q_dtype = torch.bfloat16
    cfg = dict(launch, num_splits=1)
    constexprs = attend_constexprs(cache, q_dtype, HQ, cfg, mode, arch=f"sm{ARCH}")  # what plan_attend passes
    constexprs["ROUND_HW"] = round_hw  # the build without the GPU's conversion, beside the one a GPU runs
    fp8_qk, fp8_pv = constexprs["FP8_QK"], constexprs["FP8_PV"]
    cast_k, cast_v = (constexprs[f"CONVERT_{kv}"] == CONVERT_CODES["cast"] for kv in "KV")
    q = torch.empty(ROWS, HQ, D, dtype=q_dtype)
    out, lse = torch.empty(ROWS, HQ, D, dtype=q_dtype), torch.empty(ROWS, HQ)
    qo_indptr = torch.tensor([0, ROWS], dtype=torch.int32)
    args = [q, kernel_pages(cache, cache.k_pages, fp8_qk or cast_k), kernel_pages(cache, cache.v_pages, fp8_pv or cast_v),
            cache.k_scale, cache.v_scale,
            cache.block_table, cache.seq_lens, qo_indptr, out, lse, 0.1, CONTEXT, HKV, cache.num_blocks, CONTEXT, ROWS,
            1, 0, 0, 0.0, lse, q.stride(0), q.stride(1), *page_strides(cache), cache.block_table.stride(0),
            out.stride(0), out.stride(1), 0, lse.stride(0), lse.stride(1)]
    warps_stages = {k: constexprs.pop(k) for k in ("num_warps", "num_stages")}
    built = compile_kernel(paged_attend_kernel, args, constexprs, arch=ARCH, **warps_stages)
    loop = main_loop(instructions(built.sass))
    kinds = collections.Counter(i.opcode.split(".")[0] for i in loop)
    return dict(kv_dtype=kv_dtype, mode=mode, round_hw=round_hw, registers=built.registers,
                spilled_bytes=built.spilled_bytes, shared_bytes=built.shared_bytes, loop_instructions=len(loop),
                **{kind: kinds.get(kind, 0) for kind in KINDS})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/sass"), help="results folder (results/sass)")
    p.add_argument("--block-n", type=int, default=CHUNK_TILES[0][0], help="keys per tile (default: a chunk's on sm90)")
    p.add_argument("--stages", type=int, default=CHUNK_TILES[0][1], help="pipeline stages (default: a chunk's on sm90)")
    a = p.parse_args()
    stamp = utc_stamp()
    launch = dict(block_m=BLOCK_M, block_n=a.block_n, num_warps=NUM_WARPS, num_stages=a.stages)
    rows = [dict(timestamp=stamp, gpu_slug=f"sm{ARCH}", layout=f"{HQ}/{HKV}/{D}", **launch, **build(launch, *b))
            for b in BUILDS]
    df = pd.DataFrame(rows)
    print(df.to_string(index=False))
    meta = dict(arch=f"sm{ARCH}", triton=triton.__version__, torch=torch.__version__, launch=launch,
                rows_per_sequence=ROWS, context=CONTEXT, what="one warp's instructions per key tile of the "
                "attend kernel's main loop (fp8kv.ops.offline_build.main_loop), by kind")
    print(save_table(df, a.out, meta, tag="attend"))


if __name__ == "__main__":
    main()
