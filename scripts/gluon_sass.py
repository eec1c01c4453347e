"""The Gluon decode kernel as a GPU would run it, built on any machine (``fp8kv.ops.decode.gluon_build``):

    python scripts/gluon_sass.py 32/8/128                  # the default launch at B = 64 x 16k on an H200
    python scripts/gluon_sass.py 8/1/256 --batch 4 --block-n 64 --stages 3 --sass /tmp/k.sass

Prints the launch's tile, ring depth and programs per KV head, what ptxas allocated for it (registers,
spilled bytes, shared memory) and where the tile loop first waits for its block-table loads; ``--sass``
writes its SASS, which is where a profile's hot instructions are read. The launch is the one
``fp8kv.ops.gluon_launch`` plans for ``--batch`` sequences of ``--context`` tokens on a GPU of ``--sms`` SMs
with room for its ring (an H200's); on a GPU with 99 KiB a program (sm89, sm120) ``gluon_launch`` makes the
ring shallower, which ``--stages`` reproduces. Run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fp8kv.ops.decode.gluon_build import block_table_summary, build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout", help="Hq/Hkv/D, e.g. 32/8/128")
    p.add_argument("--batch", type=int, default=64, help="sequences (64)")
    p.add_argument("--context", type=int, default=16384, help="tokens per sequence (16384)")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SMs (132: an H200)")
    p.add_argument("--block-n", type=int, help="tokens per tile (default: fp8kv.ops.gluon_tile)")
    p.add_argument("--stages", type=int, help="ring depth (default: fp8kv.ops.gluon_tile)")
    p.add_argument("--heads-per-program", type=int)
    p.add_argument("--kv-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--q-dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--arch", type=int, default=90, help="the sm version to build for (90: Hopper)")
    p.add_argument("--sass", type=Path, help="write the SASS here")
    a = p.parse_args()
    hq, hkv, d = (int(x) for x in a.layout.split("/"))
    kernel, cfg = build(hq, hkv, d, batch=a.batch, context=a.context, num_sms=a.sms, block_n=a.block_n,
                        num_stages=a.stages, heads_per_program=a.heads_per_program, kv_dtype=a.kv_dtype,
                        q_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[a.q_dtype], arch=a.arch)
    print(f"{a.layout}: block_n {cfg['block_n']}, {cfg['num_stages']} stages, {cfg['num_splits']} split(s), "
          f"{cfg['head_tiles']} program(s) of {cfg['heads_per_program']} heads per KV head | sm{a.arch}: "
          f"{kernel.registers} registers, {kernel.spilled_bytes} bytes spilled, {kernel.shared_bytes} bytes of "
          f"shared memory, {kernel.programs_per_sm} programs an SM")
    waits = block_table_summary(kernel.sass)
    same = waits["waited_in_the_loading_tile"]
    print(f"{waits['loads']} block-table loads in the tile loop ({waits['never_waited_for']} never waited for); "
          + (f"waited for in the tile that loads them: {'; '.join(same)}" if same else
             "first waited for in the next tile"))
    if a.sass:
        a.sass.write_text(kernel.sass)
        print(f"SASS: {a.sass}")


if __name__ == "__main__":
    main()
