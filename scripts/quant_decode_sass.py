"""The quantized-page decode kernel as a GPU would run it, built on any machine
(``fp8kv.ops.quant_decode.build``): per format and code conversion, the tile loop's instructions by kind.

    python scripts/quant_decode_sass.py                       # 32/8/128, every format and conversion, sm90
    python scripts/quant_decode_sass.py 8/1/128 --formats nvfp4 --num-warps 8 --num-stages 1 --sass /tmp/k

``issue/token`` is what the program's warps issue per token of K and V (one KV head); an SM issues four warp
instructions a clock, so a kernel can stream its bytes only while that count stays under ``budget`` = 4 x
(bytes per token) / (bytes an SM reads a clock = copy rate / (SMs x clock)). The defaults are an H100 SXM's
132 SMs at its 1.98 GHz boost clock and the copy rate fp8kv's bench measured on one, 3.0 TB/s
(results/bench/nvidia-h100-80gb-hbm3/20261205T130030Z.csv); a lower clock under load lowers the budget (an SM then reads more
bytes a clock).
Static counts of one build with this machine's Triton, not times: the GPU's Triton may schedule differently,
and only a benchmark says what runs faster. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8kv.kv_formats import kv_footprint
from fp8kv.ops.offline_build import INSTRUCTION_KINDS, issue_budget
from fp8kv.ops.quant_decode import QUANT_CONVERTS, QUANT_DECODE_FORMATS
from fp8kv.ops.quant_decode.build import build_quant_decode, loop_mix

KINDS = (*(kind for kind, _ in INSTRUCTION_KINDS), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout", nargs="?", default="32/8/128", help="Hq/Hkv/D (32/8/128)")
    p.add_argument("--formats", nargs="+", default=list(QUANT_DECODE_FORMATS), choices=list(QUANT_DECODE_FORMATS))
    p.add_argument("--converts", nargs="+", default=list(QUANT_CONVERTS), choices=list(QUANT_CONVERTS))
    p.add_argument("--block-n", type=int, help="tokens per tile (default: the launch's)")
    p.add_argument("--num-warps", type=int, help="warps per program (default: the launch's)")
    p.add_argument("--num-stages", type=int, help="pipeline stages (default: the launch's on a GPU)")
    p.add_argument("--arch", type=int, default=90, help="the sm version to build for (90: Hopper)")
    p.add_argument("--sass", type=Path, help="write each build's SASS into this folder")
    p.add_argument("--copy-tbps", type=float, default=3.0, help="the GPU's copy rate, TB/s (3.0: measured, H100 SXM)")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (132)")
    p.add_argument("--clock-ghz", type=float, default=1.98, help="the SM clock, GHz (1.98: H100 SXM boost)")
    a = p.parse_args()
    hq, hkv, d = (int(x) for x in a.layout.split("/"))
    bytes_a_clock = a.copy_tbps * 1e12 / (a.sms * a.clock_ghz * 1e9)
    print(f"{a.layout}, sm{a.arch}: the tile loop of one warp, instructions by kind; budget at {bytes_a_clock:.1f} "
          "bytes an SM reads a clock")
    print(f"{'format':16} {'convert':9} {'tile':>4} {'warps':>5} {'regs':>4} {'spill':>5} "
          + " ".join(f"{k[:7]:>7}" for k in KINDS) + f" {'total':>6} {'issue/token':>11} {'budget':>6}")
    for fmt in a.formats:
        fp = kv_footprint(fmt, num_kv_heads=1, head_dim=d)
        budget = issue_budget(float(fp.codes + fp.per_token_scales), a.copy_tbps * 1e3, a.sms, a.clock_ghz)
        for conv in a.converts:
            kernel, launch = build_quant_decode(fmt, hq, hkv, d, convert=conv, block_n=a.block_n,
                                                num_warps=a.num_warps, num_stages=a.num_stages, arch=a.arch)
            m = loop_mix(kernel, launch)
            print(f"{fmt:16} {conv:9} {m['block_n']:>4} {m['num_warps']:>5} {kernel.registers:>4} "
                  f"{kernel.spilled_bytes:>5} " + " ".join(f"{m[k]:>7}" for k in KINDS)
                  + f" {m['total']:>6} {m['issue_per_token']:>11.1f} {budget:>6.0f}")
            if a.sass:
                a.sass.mkdir(parents=True, exist_ok=True)
                (a.sass / f"{fmt}-{conv}.sass").write_text(kernel.sass)


if __name__ == "__main__":
    main()
