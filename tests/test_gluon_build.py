"""The Gluon decode kernel compiled for sm90 on this machine (no GPU needed: Triton's bundled ptxas assembles
it): every default tile of the H200 builds with the Triton installed here, without spilling, within the shared
memory that fp8kv.ops reserves for it (what decides whether a ring fits a smaller GPU). Its numbers are tested
on a GPU (tests/test_ops.py)."""

import json
import os
import subprocess
import sys

import pytest

from fp8kv import ops

gluon_kernel = pytest.importorskip("fp8kv.kernels.paged_decode_gluon")  # a Triton with the Gluon dialect
from fp8kv.kernels.gluon_build import build  # noqa: E402

H200_SMS = 132
# (Hq, Hkv, D, B): a layout at B x 16k; the launch is fp8kv's default there (tile and ring depth for an H200).
DEFAULT_LAUNCHES = [(32, 8, 128, 64),  # 64-token tiles, 4 deep, 16 rows
                    (32, 32, 128, 64),  # MHA whose sequences fill 8 waves: 128-token tiles, 3 deep
                    (12, 4, 64, 64),  # a 64-wide tile, 3 deep
                    (71, 1, 64, 64),  # a group cut into 3 programs of 24 heads in 32 rows
                    (32, 32, 80, 4),  # a padded head dim, 64-token tiles
                    (8, 1, 256, 64)]  # two parts of 128 columns, 128-token tiles 2 deep

# Run in a process without the interpreter (build() refuses it): every launch above, one JSON line each.
_BUILD_ALL = """
import json, sys, torch
from fp8kv import ops
from fp8kv.bench import synthetic_cache
from fp8kv.kernels.gluon_build import build
for hq, hkv, d, b, block_n, stages in json.loads(sys.argv[1]):
    group = hq // hkv
    cache = synthetic_cache(1, 300, hkv, d, kv_dtype="fp8_e4m3", device="cpu")
    cfg = ops.gluon_launch(1, cache, group, block_n=block_n, num_stages=stages, device=torch.device("cpu"))
    k = build(cfg, group, d)
    print(json.dumps(dict(registers=k.registers, spilled_bytes=k.spilled_bytes, shared_bytes=k.shared_bytes,
                          hmma="HMMA.16816.F32" in k.sass, unpack="F2FP.F16.E4M3.UNPACK_B" in k.sass)), flush=True)
"""


def _tile(hq, hkv, d, b):
    return ops.gluon_tile(hq // hkv, d, b * hkv, H200_SMS)


@pytest.fixture(scope="module")
def builds():
    launches = [[*layout, *_tile(*layout)] for layout in DEFAULT_LAUNCHES]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _BUILD_ALL, json.dumps(launches)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return dict(zip(DEFAULT_LAUNCHES, rows, strict=True))


@pytest.mark.parametrize("layout", DEFAULT_LAUNCHES, ids=lambda t: "/".join(map(str, t[:3])) + f"-B{t[3]}")
def test_default_gluon_launches_build_for_sm90_without_spills(builds, layout):
    kernel = builds[layout]
    assert kernel["spilled_bytes"] == 0, kernel
    assert kernel["registers"] <= 255
    block_n, stages = _tile(*layout)
    d = layout[2]
    rings = (gluon_kernel.head_parts(d) + 1) * stages * block_n * gluon_kernel.head_pad(d)  # K in each part's width, V in the program's part
    assert rings < kernel["shared_bytes"] <= ops.gluon_smem_bytes(block_n, stages, d)
    assert kernel["hmma"] and kernel["unpack"]  # fp16 tensor-core MMAs over FP8 codes unpacked in registers


def test_the_build_refuses_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        build({}, 4, 128)
