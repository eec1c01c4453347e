"""The multi-token attend kernel's tile loop, built for sm90 without a GPU: how many instructions a warp issues per
key tile at the chunk launch (prefill chunks and long drafts: 128 query rows x 64 keys, D 128, 8 warps, 2 stages,
as ``fp8kv.ops.attend`` plans 32/8/128), 16-bit pages against FP8 pages in dequant mode and in fp8 mode, the
probabilities rounded to e4m3 by bit arithmetic (the interpreter's way) or by the GPU's conversion:

    python scripts/attend_sass.py [--out results/sass]

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
import triton.language as tl

from fp8kv.cache import PagedKVCache
from fp8kv.ops.attend.kernel import paged_attend_kernel
from fp8kv.ops.decode.triton_launcher import CONVERT_CODES, MODE_FLAGS, converts
from fp8kv.ops.offline_build import compile_kernel, instructions, main_loop
from fp8kv.ops.pages import format_bits, kernel_pages, page_strides, scale_kind
from fp8kv.results import save_table, utc_stamp

ARCH = 90
HQ, HKV, D, PAGE, CONTEXT, ROWS = 32, 8, 128, 16, 4096, 512
LAUNCH = dict(block_m=128, block_n=64, num_warps=8, num_stages=2)
# (KV dtype, mode, probabilities rounded by the GPU's conversion): the 16-bit baseline, dequant, fp8 both ways
BUILDS = [("bf16", "dequant", False), ("fp8_e4m3", "dequant", False), ("fp8_e4m3", "fp8", False),
          ("fp8_e4m3", "fp8", True)]
_COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}  # the dots' type, as the plan names it
KINDS = ("HGMMA", "QGMMA", "F2FP", "PRMT", "SHF", "LOP3", "LDG", "LDGSTS", "STS", "LDS", "LDSM", "BAR", "MUFU", "FMNMX")


def build(kv_dtype: str, mode: str, round_hw: bool) -> dict:
    cache = PagedKVCache.empty(1, CONTEXT, HKV, D, block_size=PAGE, kv_dtype=kv_dtype)
    fp8_qk, fp8_pv = MODE_FLAGS[mode]
    convert_k, convert_v = converts(None, f"sm{ARCH}", cache.kv_dtype, mode)
    q_dtype = torch.bfloat16
    compute = torch.float16 if cache.is_fp8 else q_dtype
    constexprs = dict(
        GROUP=HQ // HKV, BLOCK_M=LAUNCH["block_m"], HEAD_DIM=D, D_PAD=D, BLOCK_SIZE=PAGE, BLOCK_N=LAUNCH["block_n"],
        SPLIT=False, SCALE_KIND=scale_kind(cache), SCALE_HEAD_STRIDE=int(cache.k_scale.numel() > 1),
        KV_FP8=cache.is_fp8, CONVERT_K=CONVERT_CODES[convert_k], CONVERT_V=CONVERT_CODES[convert_v], FP8_QK=fp8_qk,
        FP8_PV=fp8_pv, ROUND_HW=round_hw, COMPUTE=_COMPUTE[compute],
        RESCALE_Q=compute == torch.float16 and not fp8_qk, WINDOWED=False, SOFT_CAP=False, HAS_SINKS=False,
        **format_bits(cache))
    q = torch.empty(ROWS, HQ, D, dtype=q_dtype)
    out, lse = torch.empty(ROWS, HQ, D, dtype=q_dtype), torch.empty(ROWS, HQ)
    qo_indptr = torch.tensor([0, ROWS], dtype=torch.int32)
    args = [q, kernel_pages(cache, cache.k_pages, fp8_qk or convert_k == "cast"),
            kernel_pages(cache, cache.v_pages, fp8_pv or convert_v == "cast"), cache.k_scale, cache.v_scale,
            cache.block_table, cache.seq_lens, qo_indptr, out, lse, 0.1, CONTEXT, HKV, cache.num_blocks, CONTEXT, ROWS,
            1, 0, 0, 0.0, lse, q.stride(0), q.stride(1), *page_strides(cache), cache.block_table.stride(0),
            out.stride(0), out.stride(1), 0, lse.stride(0), lse.stride(1)]
    built = compile_kernel(paged_attend_kernel, args, constexprs, arch=ARCH, num_warps=LAUNCH["num_warps"],
                           num_stages=LAUNCH["num_stages"])
    loop = main_loop(instructions(built.sass))
    kinds = collections.Counter(i.opcode.split(".")[0] for i in loop)
    return dict(kv_dtype=kv_dtype, mode=mode, round_hw=round_hw, registers=built.registers,
                spilled_bytes=built.spilled_bytes, shared_bytes=built.shared_bytes, loop_instructions=len(loop),
                **{kind: kinds.get(kind, 0) for kind in KINDS})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/sass"), help="results folder (results/sass)")
    a = p.parse_args()
    stamp = utc_stamp()
    rows = [dict(timestamp=stamp, gpu_slug=f"sm{ARCH}", layout=f"{HQ}/{HKV}/{D}", **LAUNCH, **build(*b))
            for b in BUILDS]
    df = pd.DataFrame(rows)
    print(df.to_string(index=False))
    meta = dict(arch=f"sm{ARCH}", triton=triton.__version__, torch=torch.__version__, launch=LAUNCH,
                rows_per_sequence=ROWS, context=CONTEXT, what="one warp's instructions per key tile of the "
                "attend kernel's main loop (fp8kv.ops.offline_build.main_loop), by kind")
    print(save_table(df, a.out, meta, tag="attend"))


if __name__ == "__main__":
    main()
