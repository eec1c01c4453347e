"""How many instructions the Gluon decode issues per token, against what an SM can issue while it streams the
copy rate — built for a GPU that need not be here (``fp8kv.ops.decode.gluon_build``), no GPU needed:

    python scripts/issue_budget.py --copy-from results/bench/nvidia-h200/20261206T100317Z.csv

For each launch below (the formats at 32/8/128, B 64 x 32k, and FP8's other head layouts at B 64 x 16k, as
``fp8kv.ops.gluon_launch`` plans them on an H200) it compiles the kernel for sm90 and counts its tile loop's SASS
by kind; ``issue_per_token`` is what one KV head's warps issue per token, ``budget`` what an SM issues a token
(four warp instructions a clock) while it reads that token's bytes at the copy rate of ``--copy-from`` (the
median ``copy_gbps`` of a bench file: measured on that GPU) at ``--clock-ghz``. ``budget_share`` near 1 means
the kernel can only stream its bytes with every scheduler issuing every clock. Writes
``<out>/sm<arch>/<timestamp>.csv`` and its metadata (never over another file). Static counts of one build with
this machine's Triton: the GPU's Triton may schedule differently, and only a benchmark says what runs faster.
Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pandas as pd
import torch
import triton

from fp8kv.ops.decode.gluon_build import build, gluon_loop_mix
from fp8kv.ops.offline_build import INSTRUCTION_KINDS, issue_budget
from fp8kv.results import read_table, save_table, utc_stamp

KINDS = (*(kind for kind, _ in INSTRUCTION_KINDS), "other", "total")
# Each launch: head layout (Hq, Hkv, D), B x context, and build() options (kv_dtype, granularity, window, block_n,
# num_stages, max_registers; absent: the default). The formats beside FP8; INT4 also with 128-token tiles, and with
# those three deep and its registers capped so that an SM holds three programs (a what-if of the build, not a launch
# fp8kv makes); then FP8's head layouts.
FORMATS = dict(batch=64, context=32768)
LAYOUTS = dict(batch=64, context=16384)
LAUNCHES = [((32, 8, 128), dict(FORMATS)),
            ((32, 8, 128), dict(FORMATS, granularity="token_head")),
            ((32, 8, 128), dict(FORMATS, kv_dtype="int8_token_head")),
            ((32, 8, 128), dict(FORMATS, kv_dtype="int4_token_head")),
            ((32, 8, 128), dict(FORMATS, kv_dtype="int4_token_head", block_n=128)),
            ((32, 8, 128), dict(FORMATS, kv_dtype="int4_token_head", block_n=128, num_stages=3, max_registers=168)),
            *(((hq, hkv, d), dict(LAYOUTS)) for hq, hkv, d in
              ((32, 32, 128), (14, 2, 64), (32, 32, 64), (71, 1, 64), (32, 32, 80), (32, 32, 96), (8, 1, 256))),
            ((32, 16, 128), dict(LAYOUTS, window=512))]


def copy_rate(csv: Path) -> float:
    """The median measured copy rate (GB/s) of a bench file's rows."""
    rates = read_table(csv)["copy_gbps"].dropna()
    if rates.empty:
        raise ValueError(f"--copy-from {csv}: no copy_gbps in its rows; expected a bench file of fp8kv.bench")
    return float(rates.median())


def ptxas_version() -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def rows(arch: int, num_sms: int, copy_gbps: float, clock_ghz: float) -> list[dict]:
    stamp = utc_stamp()
    out = []
    for (hq, hkv, d), options in LAUNCHES:
        o = {"kv_dtype": "fp8_e4m3", "granularity": "tensor", "window": None, "max_registers": None, **options}
        kernel, cfg = build(hq, hkv, d, num_sms=num_sms, arch=arch, **o)
        mix = gluon_loop_mix(kernel, cfg)
        budget = issue_budget(kernel.bytes_per_token, copy_gbps, num_sms, clock_ghz)
        out.append(dict(timestamp=stamp, gpu_slug=f"sm{arch}", layout=f"{hq}/{hkv}/{d}", num_q_heads=hq,
                        num_kv_heads=hkv, head_dim=d, batch=o["batch"], context=o["context"], window=o["window"],
                        kv_dtype=o["kv_dtype"], granularity=o["granularity"], block_n=cfg["block_n"],
                        num_stages=cfg["num_stages"], max_registers=o["max_registers"],
                        num_splits=cfg["num_splits"], head_tiles=cfg["head_tiles"],
                        programs_per_head=kernel.programs_per_head, registers=kernel.registers,
                        spilled_bytes=kernel.spilled_bytes, shared_bytes=kernel.shared_bytes,
                        programs_per_sm=kernel.programs_per_sm, **{k: mix[k] for k in KINDS},
                        issue_per_token=mix["issue_per_token"], bytes_per_token=kernel.bytes_per_token,
                        budget=budget, budget_share=mix["issue_per_token"] / budget))
        print(f"{hq}/{hkv}/{d} {o['kv_dtype']} {o['granularity']} window={o['window']} tile {cfg['block_n']}: "
              f"{mix['issue_per_token']:.1f} warp instructions a token, budget {budget:.1f} "
              f"({mix['issue_per_token'] / budget:.0%})", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--copy-from", type=Path, required=True, help="a bench CSV whose copy_gbps is the GPU's copy rate")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (132: an H200, an H100 SXM)")
    p.add_argument("--clock-ghz", type=float, default=1.98, help="the SM clock, GHz (1.98: H100 / H200 SXM boost; "
                   "a lower clock under load lowers the budget)")
    p.add_argument("--arch", type=int, default=90, help="the sm version to build for (90: Hopper)")
    p.add_argument("--out", type=Path, default=Path("results/sass"), help="results folder (results/sass)")
    a = p.parse_args()
    copy_gbps = copy_rate(a.copy_from)
    df = pd.DataFrame(rows(a.arch, a.sms, copy_gbps, a.clock_ghz))
    meta = dict(what="the Gluon decode's tile loop, instructions by kind, built offline; issue per token against "
                "the budget at the copy rate", command="python scripts/issue_budget.py --copy-from "
                f"{a.copy_from} --sms {a.sms} --clock-ghz {a.clock_ghz} --arch {a.arch}",
                copy_from=str(a.copy_from), copy_gbps=copy_gbps, num_sms=a.sms, clock_ghz=a.clock_ghz,
                arch=f"sm{a.arch}", triton=triton.__version__, torch=torch.__version__, ptxas=ptxas_version())
    print(save_table(df, a.out, meta))


if __name__ == "__main__":
    main()
