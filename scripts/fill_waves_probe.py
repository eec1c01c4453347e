"""The measurement behind ``fp8kv.ops.fill_waves`` and ``MAX_HEADS_STREAMING`` (GPU only):

    python scripts/fill_waves_probe.py                          # the layouts and points of the docstrings
    python scripts/fill_waves_probe.py --shapes 8/1/256 --points 64x16384 64x16384r

Times fp8kv's default FP8 decode (e4m3, tensor scale, page 16, bf16 queries) under the split rule before
(the eight-wave count; groups above MAX_HEADS_PER_PROGRAM heads cut) and after (splits filling the resident
program slots; a group of up to MAX_HEADS_STREAMING heads in one program where the launch streams), the
"before" timed twice (first and last), in one process: CUDA graphs, caches rotated so every call reads HBM,
medians. A point ``BxN`` has every sequence N tokens long; ``BxNr`` draws each length from 1..N (seed 1).
Each launch's output is compared with the first's (relative L2 difference). Writes
``results/bench/<gpu-slug>/<stamp>-fill-waves.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from fp8kv import ops
from fp8kv.bench import probe_us, synthetic_cache
from fp8kv.device import gpu_slug
from fp8kv.ops.decode import splits
from fp8kv.results import utc_stamp

SHAPES = ["8/1/256", "14/2/64", "71/1/64", "28/4/128", "32/8/128", "12/4/64", "32/32/128", "16/16/256", "32/8/112",
          "48/1/128"]
POINTS = ["64x16384", "64x16384r", "16x16384", "4x16384", "8x8192"]


def use_rule(name: str, fill=splits.fill_waves, streaming=splits.MAX_HEADS_STREAMING) -> None:
    """Switch fp8kv's split rule to ``"before"`` or ``"after"`` (this process only)."""
    splits.clear_residency()
    splits.fill_waves = fill if name == "after" else (lambda programs, count, *rest: count)
    splits.MAX_HEADS_STREAMING = streaming if name == "after" else splits.MAX_HEADS_PER_PROGRAM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES, metavar="HQ/HKV/D")
    p.add_argument("--points", nargs="+", default=POINTS, metavar="BxN[r]")
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    a = p.parse_args()
    device = torch.device("cuda")
    path = Path(a.out) / gpu_slug(device) / f"{re.sub(r'[^0-9TZ]', '', utc_stamp())}-fill-waves.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in a.shapes:
        hq, hkv, d = (int(x) for x in shape.split("/"))
        for point in a.points:
            ragged = point.endswith("r")
            b, ctx = (int(x) for x in point.rstrip("r").split("x"))
            copies = max(1, min(8, int(2e9 // (b * ctx * hkv * d * 2))))  # rotated: more than L2 holds
            caches = [synthetic_cache(b, ctx, hkv, d, kv_dtype="fp8_e4m3", device=device) for _ in range(copies)]
            if ragged:
                lens = torch.randint(1, ctx + 1, (b,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
                for c in caches:
                    c.seq_lens.copy_(lens)
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=device)
            first = None
            for rule in ("before", "after", "before"):
                use_rule(rule)
                kernel, cfg = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, device)
                o = ops.paged_decode(q, caches[0])[0].float()
                first = o if first is None else first
                t = probe_us(lambda q=q, caches=caches: [ops.paged_decode(q, c) for c in caches], copies, device)
                rows.append(dict(shape=shape, batch=b, context=ctx, ragged=ragged, rule=rule, kernel=kernel,
                                 splits=cfg["num_splits"], block_n=cfg["block_n"], heads=cfg["heads_per_program"],
                                 time_us=round(t, 2), rel_diff=((o - first).norm() / first.norm()).item()))
                print(rows[-1], flush=True)
            use_rule("after")
            path.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__,
                                            triton=__import__("triton").__version__, rows=rows), indent=1) + "\n")
            caches.clear()
            torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
