"""The two measurements behind the Gluon kernel's launch defaults (GPU only):

    python scripts/gluon_launch_probe.py tiles       # tile x ring depth at B = 64 x 16k -> fp8kv.ops.gluon_tile
    python scripts/gluon_launch_probe.py crossover   # Gluon against Triton at B 1-16 -> GLUON_MIN_SPLIT_TOKENS
    python scripts/gluon_launch_probe.py groups      # large groups: programs per KV head -> decode_launch
    python scripts/gluon_launch_probe.py mha         # tiles and splits at the latency end -> gluon_tile
    python scripts/gluon_launch_probe.py wide        # head_dim above 128 (two parts): tiles, and Gluon against Triton
    python scripts/gluon_launch_probe.py wide-crossover  # the same heads: Gluon against Triton at B 1-16

Each times ``fp8kv.ops.paged_decode`` on FP8 e4m3 caches (tensor scale, page 16, bf16 queries) with
CUDA graphs, the median of three medians, caches rotated so every call reads HBM, and writes
``results/bench/<gpu-slug>/<stamp>-gluon-<what>.json``, row by row (an interrupted run keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from fp8kv import ops
from fp8kv.bench import synthetic_cache
from fp8kv.device import describe_device
from fp8kv.results import utc_stamp

TILES = [(32, 8, 128), (28, 4, 128), (32, 32, 128), (12, 4, 64), (32, 32, 80), (16, 2, 96)]
CROSSOVER = [(32, 8, 128), (32, 32, 128), (12, 4, 64)]
GROUPS = [(71, 1, 64), (48, 1, 128), (40, 2, 64)]  # Falcon-7B, StarCoder, a group of 20
WIDE = [(8, 1, 256), (16, 8, 256), (16, 16, 256), (32, 8, 256)]  # Gemma-2B, Gemma-2-9B, Gemma-7B
# (batch, context) of wide-crossover: ...20261204T144946Z-gluon-wide-crossover.json ran B 1-4 x 4k/16k,
# ...145432Z the rest
WIDE_CROSSOVER = [(b, c) for b in (1, 2, 4) for c in (4096, 16384)] + [(1, 8192), (2, 8192), (8, 4096), (8, 16384),
                                                                       (16, 16384)]


class RowLog(list):
    """The probe's rows, its results file rewritten as each one comes: an interrupted probe keeps them."""
    doc: dict = {}
    path: Path | None = None

    def append(self, row: dict) -> None:
        super().append(row)
        if RowLog.path is not None:  # a whole file or the previous one, never half of one
            part = RowLog.path.with_suffix(".json.part")
            part.write_text(json.dumps({**RowLog.doc, "rows": list(self)}, indent=1))
            os.replace(part, RowLog.path)


def time_us(q, caches, **launch) -> float:
    """Median of three CUDA-graph medians of one decode per cache, per decode."""
    def fn():
        for c in caches:
            ops.paged_decode(q, c, **launch)
    fn()
    return sorted(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / len(caches) for _ in range(3))[1]


def caches_for(b: int, ctx: int, hkv: int, d: int) -> list:
    """Up to 8 copies of the cache, together ~2 GB or more: far beyond L2, so every call reads HBM."""
    n = max(1, min(8, int(2e9 // (b * ctx * hkv * d * 2))))
    return [synthetic_cache(b, ctx, hkv, d, kv_dtype="fp8_e4m3", device="cuda") for _ in range(n)]


def tiles() -> list[dict]:
    rows = RowLog()
    for hq, hkv, d in TILES:
        caches = caches_for(64, 16384, hkv, d)
        q = torch.randn(64, hq, d, dtype=torch.bfloat16, device="cuda")
        rows.append(dict(shape=f"{hq}/{hkv}/{d}", kernel="triton", block_n=None, num_stages=None,
                         time_us=round(time_us(q, caches, gluon=False), 1)))
        for bn, st in ((64, 3), (64, 4), (128, 3)):
            rows.append(dict(shape=f"{hq}/{hkv}/{d}", kernel="gluon", block_n=bn, num_stages=st,
                             time_us=round(time_us(q, caches, gluon=True, block_n=bn, num_stages=st), 1)))
            print(rows[-1], flush=True)
        del caches
        torch.cuda.empty_cache()
    return rows


def crossover(shapes=CROSSOVER, points=tuple((b, c) for b in (1, 4, 16) for c in (4096, 16384))) -> list[dict]:
    rows = RowLog()
    for hq, hkv, d in shapes:
        for b, ctx in points:
            caches = caches_for(b, ctx, hkv, d)
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            for gluon in (True, False):
                cfg = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, q.device, gluon=gluon)[1]
                rows.append(dict(shape=f"{hq}/{hkv}/{d}", batch=b, context=ctx,
                                 kernel="gluon" if gluon else "triton", num_splits=cfg["num_splits"],
                                 tokens_per_split=cfg["tokens_per_split"],
                                 time_us=round(time_us(q, caches, gluon=gluon), 2)))
                print(rows[-1], flush=True)
            del caches
            torch.cuda.empty_cache()
    return rows


def groups() -> list[dict]:
    """Groups above 16 query heads per KV head: the Triton kernel, Gluon's default (as few programs per KV
    head as its rows allow) and programs of at most 16 heads, at B = 64 x 16k and 4 x 16k."""
    rows = RowLog()
    for hq, hkv, d in GROUPS:
        for b in (64, 4):
            caches = caches_for(b, 16384, hkv, d)
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            for launch in (dict(gluon=False), dict(gluon=True), dict(gluon=True, heads_per_program=16)):
                kernel, cfg = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, q.device, **launch)
                rows.append(dict(shape=f"{hq}/{hkv}/{d}", batch=b, context=16384, kernel=kernel,
                                 heads_per_program=cfg["heads_per_program"], head_tiles=cfg["head_tiles"],
                                 num_splits=cfg["num_splits"], time_us=round(time_us(q, caches, **launch), 2)))
                print(rows[-1], flush=True)
            del caches
            torch.cuda.empty_cache()
    return rows


def mha() -> list[dict]:
    """Tiles, ring depths and twice the split count at small batches (MHA, and 32/8/128 beside it)."""
    rows = RowLog()
    for hq, hkv, d, b, ctx in [(32, 32, 128, 4, 16384), (32, 32, 128, 1, 16384), (32, 32, 128, 1, 4096),
                               (32, 8, 128, 1, 4096), (32, 8, 128, 4, 16384)]:
        caches = caches_for(b, ctx, hkv, d)
        q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
        for launch in (dict(gluon=False), dict(gluon=True), dict(gluon=True, block_n=64, num_stages=3),
                       dict(gluon=True, block_n=64, num_stages=4), dict(gluon=True, block_n=128, num_stages=2),
                       dict(gluon=True, block_n=64, num_stages=2)):
            cfg = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, q.device, **launch)[1]
            for splits in (cfg["num_splits"], 2 * cfg["num_splits"]):
                rows.append(dict(shape=f"{hq}/{hkv}/{d}", batch=b, context=ctx, launch=str(launch), num_splits=splits,
                                 time_us=round(time_us(q, caches, num_splits=splits, **launch), 2)))
                print(rows[-1], flush=True)
        del caches
        torch.cuda.empty_cache()
    return rows


def wide() -> list[dict]:
    """Head dims above 128 (the Gluon kernel's two parts): the Triton kernel and Gluon at five tiles / depths,
    and Gluon's default at 1.5 and 2 times its split count, at B = 64 x 16k; the Triton kernel, Gluon's
    default and 64 / 4 at B = 4 and 1 x 16k."""
    rows = RowLog()
    for hq, hkv, d in WIDE:
        for b in (64, 4, 1):
            caches = caches_for(b, 16384, hkv, d)
            q = torch.randn(b, hq, d, dtype=torch.bfloat16, device="cuda")
            tiles = ((64, 2), (64, 3), (64, 4), (128, 2), (128, 3)) if b == 64 else ((64, 4),)
            launches = [dict(gluon=False), dict(gluon=True)]
            launches += [dict(gluon=True, block_n=bn, num_stages=st) for bn, st in tiles]
            if b == 64:
                splits = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, q.device, gluon=True)[1]["num_splits"]
                launches += [dict(gluon=True, num_splits=n) for n in (math.ceil(1.5 * splits), 2 * splits)]
            for launch in launches:
                kernel, cfg = ops.decode_launch(b, caches[0], "dequant", d, hq // hkv, q.device, **launch)
                rows.append(dict(shape=f"{hq}/{hkv}/{d}", batch=b, context=16384, kernel=kernel, launch=str(launch),
                                 block_n=cfg["block_n"], num_stages=cfg["num_stages"], num_splits=cfg["num_splits"],
                                 time_us=round(time_us(q, caches, **launch), 2)))
                print(rows[-1], flush=True)
            del caches
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["tiles", "crossover", "groups", "mha", "wide", "wide-crossover"])
    p.add_argument("--out", default="results/bench", help="results folder (a sub-folder per GPU)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: the Gluon kernel does not run on CPU")
    stamp = utc_stamp()
    dev = describe_device("cuda")
    RowLog.doc = {"what": f"scripts/gluon_launch_probe.py {args.what}", "device": dev, "timestamp": stamp}
    path = Path(args.out) / dev["slug"] / f"{re.sub(r'[^0-9TZ]', '', stamp)}-gluon-{args.what}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x") as fh:  # never overwrite an earlier run
        json.dump({**RowLog.doc, "rows": []}, fh, indent=1)
    RowLog.path = path
    {"tiles": tiles, "crossover": crossover, "groups": groups, "mha": mha, "wide": wide,
     "wide-crossover": lambda: crossover(WIDE, WIDE_CROSSOVER)}[args.what]()
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
