"""Where a decode kernel's warps wait, instruction by instruction (Nsight Compute's warp-state samples):

    ncu --clock-control none --profile-from-start off --set full -k regex:decode -o /tmp/p \\
        python scripts/decode_profile.py run 32/8/128 --batch 64 --context 16384
    ncu -i /tmp/p.ncu-rep --page source --csv --print-source sass > /tmp/p.sass.csv
    python scripts/decode_profile.py hotspots /tmp/p.sass.csv

``run`` (GPU) builds a synthetic cache, warms fp8kv's decode up (compiles), then runs one decode between
cudaProfilerStart and cudaProfilerStop, so that ncu profiles that one call. ``hotspots`` reads ncu's SASS
page and prints the instructions holding the most stall samples, each with its top reasons, and the share
of samples per opcode. A long-scoreboard stall on an instruction that consumes a global load issued in the
same loop iteration is the pattern that made the Gluon kernel clamp block-table entries where it uses
them (docs/decode-kernel-notes.md, seventh round).
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def hotspots(sass_csv: Path, top: int = 20) -> tuple[list[tuple], dict[str, float]]:
    """The ``top`` instructions by stall samples, as (address, share, SASS, [(reason, samples), ...]) with the
    three largest reasons, and each opcode's share of all samples; from ncu's ``--page source --csv
    --print-source sass`` output (a kernel-name line, a header, one row per instruction), its first kernel
    (profile one kernel, ``-k``, to choose it)."""
    rows = list(csv.reader(sass_csv.open()))
    header = next(r for r in rows if ALL_SAMPLES in r)
    body = []
    for r in rows[rows.index(header) + 1:]:  # the first kernel's rows: up to the next kernel's name line
        if r and r[0] == "Kernel Name":
            break
        if len(r) == len(header):
            body.append(r)
    col = {name: i for i, name in enumerate(header)}
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    total = sum(_number(r[col[ALL_SAMPLES]]) for r in body) or 1.0
    ranked = sorted(body, key=lambda r: -_number(r[col[ALL_SAMPLES]]))[:top]
    hot = [(r[col["Address"]], _number(r[col[ALL_SAMPLES]]) / total, r[col["Source"]].strip(),
            sorted(((n[len("stall_"):], _number(r[col[n]])) for n in reasons), key=lambda x: -x[1])[:3])
           for r in ranked]
    by_opcode = Counter()
    for r in body:
        words = [w for w in r[col["Source"]].split() if not w.startswith("@")]
        if words:
            by_opcode[words[0].split(".")[0]] += _number(r[col[ALL_SAMPLES]]) / total
    return hot, dict(by_opcode.most_common())


def run(layout: str, batch: int, context: int, kv_dtype: str, gluon: bool | None) -> None:
    import torch

    from fp8kv import ops
    from fp8kv.bench import synthetic_cache

    hq, hkv, d = (int(x) for x in layout.split("/"))
    cache = synthetic_cache(batch, context, hkv, d, kv_dtype=kv_dtype, device="cuda")
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    kernel, cfg = ops.decode_launch(batch, cache, "dequant", d, hq // hkv, q.device, gluon=gluon)
    print(f"{layout} B={batch} x {context} {kv_dtype}: {kernel} {cfg}", flush=True)
    for _ in range(3):
        ops.paged_decode(q, cache, gluon=gluon)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    ops.paged_decode(q, cache, gluon=gluon)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="one decode between cudaProfilerStart/Stop (run it under ncu)")
    r.add_argument("layout", help="Hq/Hkv/D, e.g. 32/8/128")
    r.add_argument("--batch", type=int, default=64)
    r.add_argument("--context", type=int, default=16384)
    r.add_argument("--kv-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "fp8_e5m2", "bf16", "fp16"])
    r.add_argument("--kernel", choices=["default", "gluon", "triton"], default="default")
    h = sub.add_parser("hotspots", help="the instructions where warps wait most, from ncu's SASS page")
    h.add_argument("sass_csv", type=Path)
    h.add_argument("--top", type=int, default=20)
    a = p.parse_args()
    if a.what == "run":
        run(a.layout, a.batch, a.context, a.kv_dtype, {"default": None, "gluon": True, "triton": False}[a.kernel])
        return
    hot, by_opcode = hotspots(a.sass_csv, a.top)
    for address, share, sass, why in hot:
        print(f"{address:>18} {100 * share:5.1f}%  {sass[:64]:64}  " + " ".join(f"{n} {v:.0f}" for n, v in why if v))
    print("by opcode: " + ", ".join(f"{op} {100 * s:.1f}%" for op, s in list(by_opcode.items())[:12]))


if __name__ == "__main__":
    main()
