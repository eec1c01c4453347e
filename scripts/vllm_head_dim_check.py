#!/usr/bin/env python
"""Does vLLM's Triton unified-attention kernel decode an FP8 e4m3 per-tensor NHD cache correctly
at each head_dim, on its 2D and its 3D (split-KV) path?

One subprocess per (head_dim, path), so a CUDA context crash (illegal address, ...) in one cannot
hide the others. Each child builds a ``PagedKVCache`` (B=4 ragged lengths, page 16, Hq=32,
Hkv=8, V five times larger than K), decodes with
``fp8kv.backends.vllm.VllmDecode(cache, num_q_heads=Hq, trusted=True).run(q)`` -- ``trusted``
skips fp8kv's capability table (``VLLM_HEAD_DIMS``, which this check is the evidence for) -- and compares with
``fp8kv.reference.decode`` against ``fp8kv.reference.output_tolerance("vllm", "dequant", q.dtype)``.

Paths: "2d" runs the child with VLLM_BATCH_INVARIANT=1 (fp8kv passes no split buffers and the
kernel's launcher takes 2D); "3d" with it unset (B=4 <= 128 // Hkv = 16 takes the split path).
The child checks which path fp8kv planned and says so.

Prints one line per (head_dim, path): PASS / FAIL / CRASH, the relative error, the tolerance.
Exit status 0 only if every line is PASS.

Usage (repo root; ``vllm`` importable: installed, or a package providing its kernel on PYTHONPATH):
    python scripts/vllm_head_dim_check.py                      # GPU: head dims 64 80 96 112 128 256, bf16 query
    python scripts/vllm_head_dim_check.py --head-dims 96 112   # a subset
    python scripts/vllm_head_dim_check.py --cpu                # CPU smoke test under TRITON_INTERPRET=1:
                                                   # head dims 64 96, lengths 1 5 37 70, fp16 query
Options: --lens, --q-dtype {bf16,fp16}, --timeout (s per child), --seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HEAD_DIMS = (64, 80, 96, 112, 128, 256)
LENS = (1, 37, 300, 1000)
CPU_HEAD_DIMS = (64, 96)
CPU_LENS = (1, 5, 37, 70)
HQ, HKV, BLOCK = 32, 8, 16
RESULT_TAG = "VLLM_CHECK_RESULT "


# ------------------------------------------------------------------------------------------- child
def child(head_dim: int, path: str, lens: list[int], q_dtype: str, device: str, seed: int) -> None:
    import torch

    import fp8kv
    import fp8kv.backends.vllm as vb
    from fp8kv.cache import PagedKVCache
    from fp8kv.quant import relative_error

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[q_dtype]
    g = torch.Generator().manual_seed(seed)
    shape = (len(lens), max(lens), HKV, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g) * 5.0
    cache = PagedKVCache.from_dense(k.to(device), v.to(device), list(lens), block_size=BLOCK,
                                    kv_dtype="fp8_e4m3", granularity="tensor", layout="NHD", seed=seed)
    q = torch.randn(len(lens), HQ, head_dim, generator=g).to(dtype).to(device)

    import vllm
    from vllm.v1.attention.ops import triton_unified_attention as tua

    dec = vb.VllmDecode(cache, num_q_heads=HQ, trusted=True)  # trusted: no capability table (80/96/112)
    planned = "3d" if "num_par_softmax_segments" in dec.args else "2d"
    kernel_path = "2d" if (planned == "2d" or tua.is_batch_invariant) else "3d"
    out, lse = dec.run(q)
    if device != "cpu":
        torch.cuda.synchronize()
    ref, _ = fp8kv.reference.decode(q, cache)
    tol = fp8kv.reference.output_tolerance("vllm", "dequant", dtype)
    err = relative_error(out.float(), ref)
    per_seq = [relative_error(out[i].float(), ref[i]) for i in range(len(lens))]
    finite = bool(torch.isfinite(out.float()).all())
    print(RESULT_TAG + json.dumps({
        "head_dim": head_dim, "path": path, "planned": planned, "kernel_path": kernel_path,
        "err": err, "tol": tol, "per_seq": per_seq, "finite": finite, "lse_none": lse is None,
        "vllm": getattr(vllm, "__version__", "?"), "q_dtype": q_dtype, "lens": lens,
    }), flush=True)


# ------------------------------------------------------------------------------------------ parent
def _env(path: str, cpu: bool) -> dict:
    env = dict(os.environ)
    pp = [str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(pp + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if path == "2d":
        env["VLLM_BATCH_INVARIANT"] = "1"
    else:
        env.pop("VLLM_BATCH_INVARIANT", None)
    if cpu:
        sys.path.insert(0, str(REPO))  # the parent imports fp8kv for this alone
        from fp8kv.capability import use_interpreter

        use_interpreter(env)
    return env


def run_one(head_dim: int, path: str, args) -> tuple[bool, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(head_dim), path,
           "--lens", *map(str, args.lens), "--q-dtype", args.q_dtype, "--seed", str(args.seed)]
    if args.cpu:
        cmd.append("--cpu")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=_env(path, args.cpu),
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return False, f"head_dim={head_dim:<3d} path={path}  CRASH  timeout after {args.timeout} s"
    dt = time.time() - t0
    res = None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            res = json.loads(line[len(RESULT_TAG):])
    if p.returncode != 0 or res is None:
        tail = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["(no output)"])
        why = " | ".join(tail[-3:])
        return False, f"head_dim={head_dim:<3d} path={path}  CRASH  rc={p.returncode}  {why}"
    notes = []
    ok = res["finite"] and res["err"] <= res["tol"] and res["lse_none"]
    if res["kernel_path"] != path:
        ok = False
        notes.append(f"ran the {res['kernel_path']} path, not {path}")
    if not res["finite"]:
        notes.append("non-finite output")
    worst = max(range(len(res["per_seq"])), key=lambda i: res["per_seq"][i])
    notes.append(f"worst seq len={res['lens'][worst]} err={res['per_seq'][worst]:.3e}")
    status = "PASS" if ok else "FAIL"
    return ok, (f"head_dim={head_dim:<3d} path={path}  {status}  rel_err={res['err']:.3e}  tol={res['tol']:.3e}  "
                f"({'; '.join(notes)}; q={res['q_dtype']}, vllm {res['vllm']}, {dt:.1f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU under TRITON_INTERPRET=1, small setting")
    ap.add_argument("--head-dims", type=int, nargs="+", default=None)
    ap.add_argument("--paths", nargs="+", choices=("2d", "3d"), default=("2d", "3d"))
    ap.add_argument("--lens", type=int, nargs="+", default=None, help="ragged lengths, one per sequence")
    ap.add_argument("--q-dtype", choices=("bf16", "fp16"), default=None,
                    help="default bf16 (GPU), fp16 with --cpu (the interpreter's bf16 arithmetic is wrong)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per child (default 300 GPU, 900 CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("HEAD_DIM", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.lens is None:
        args.lens = list(CPU_LENS if args.cpu else LENS)
    if args.q_dtype is None:
        args.q_dtype = "fp16" if args.cpu else "bf16"
    if args.child:
        child(int(args.child[0]), args.child[1], args.lens, args.q_dtype, "cpu" if args.cpu else "cuda", args.seed)
        return 0
    if args.head_dims is None:
        args.head_dims = list(CPU_HEAD_DIMS if args.cpu else HEAD_DIMS)
    if args.timeout is None:
        args.timeout = 900.0 if args.cpu else 300.0
    print(f"vllm_check: FP8 e4m3 per-tensor NHD, B={len(args.lens)} lens={args.lens} page={BLOCK} Hq={HQ} "
          f"Hkv={HKV}, q {args.q_dtype}, {'CPU (TRITON_INTERPRET=1)' if args.cpu else 'GPU'}", flush=True)
    all_ok = True
    for d in args.head_dims:
        for path in args.paths:
            ok, line = run_one(d, path, args)
            all_ok &= ok
            print(line, flush=True)
    print("ALL PASS" if all_ok else "NOT ALL PASS", flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
