"""The measurement behind the README's page-layout table (GPU only):

    python scripts/page_layout_probe.py                                  # its layouts at B = 64 x 16k
    python scripts/page_layout_probe.py --shapes 32/32/80 --batch 16 --context 16384

Times fp8kv's default decode (``fp8kv.ops.decode_launch`` picks the kernel; FP8 is e4m3 with a tensor
scale, page 16, bf16 queries) over NHD pages ``[blocks, block_size, Hkv, D]`` and HND pages
``[blocks, Hkv, block_size, D]``: FP8 on NHD, HND, then NHD again (the first and last NHD times bound the
machine's drift), BF16 on NHD and HND. One process, CUDA graphs, caches rotated so every call reads HBM,
medians. Writes ``results/bench/<gpu-slug>/<stamp>-page-layout.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
import triton

from fp8kv import ops
from fp8kv.bench import probe_us, synthetic_cache
from fp8kv.device import gpu_slug
from fp8kv.results import utc_stamp

SHAPES = ["32/32/80", "32/8/80", "32/32/96", "32/8/112", "32/8/128", "14/2/64"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, metavar="HQ/HKV/D")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    a = p.parse_args()
    device = torch.device("cuda")
    path = Path(a.out) / gpu_slug(device) / f"{re.sub(r'[^0-9TZ]', '', utc_stamp())}-page-layout.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, triton=triton.__version__,
                batch=a.batch, context=a.context, block_size=16, fp8="fp8_e4m3, one tensor-wide scale",
                q_dtype="bf16", timing="CUDA graphs, caches rotated, middle of three medians")
    rows, b, ctx = [], a.batch, a.context
    for shape in a.shapes:
        hq, hkv, d = (int(x) for x in shape.split("/"))
        for kv, layouts in (("fp8_e4m3", ("NHD", "HND", "NHD")), ("bf16", ("NHD", "HND"))):
            for layout in layouts:
                copies = max(1, min(8, int(2e9 // (b * ctx * hkv * d * (2 if kv == "bf16" else 1) * 2))))
                caches = [synthetic_cache(b, ctx, hkv, d, kv_dtype=kv, device=device, layout=layout)
                          for _ in range(copies)]
                q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=device)
                kernel, cfg = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, device)
                t = probe_us(lambda q=q, caches=caches: [ops.paged_decode(q, c) for c in caches], copies, device, rep=40)
                rows.append(dict(shape=shape, kv_dtype=kv, layout=layout, kernel=kernel, splits=cfg["num_splits"],
                                 time_us=round(t, 2)))
                print(rows[-1], flush=True)
                caches.clear()
                torch.cuda.empty_cache()
            path.write_text(json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
