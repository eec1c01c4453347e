"""The quantized-page decode kernel compiled for sm90 on this machine (no GPU needed: Triton's bundled ptxas
assembles it, fp8kv.ops.quant_decode.build): at one launch of 32/8/128 for every conversion (the one the
formats were tuned from: 64-token INT8 and 128-token 4-bit tiles, 4 warps, 2 stages), every format and code
conversion builds, "software" and "ptx" without spilling (cast's NVFP4 spills), the "software" and
"ptx" tile loops hold no per-code conversion instruction where "cast" holds one per code, and "ptx" issues the
fewest instructions per token. Counts, not times: the GPU's numbers come from ``--preset formats-tune``."""

import json
import os
import subprocess
import sys

import pytest

from fp8kv.ops.quant_decode import QUANT_CONVERTS, QUANT_DECODE_FORMATS

_BUILD_ALL = """
import json
from fp8kv.ops.quant_decode.build import build_quant_decode, loop_mix
from fp8kv.ops.quant_decode import QUANT_CONVERTS, QUANT_DECODE_FORMATS
for fmt in QUANT_DECODE_FORMATS:
    for conv in QUANT_CONVERTS:
        k, launch = build_quant_decode(fmt, 32, 8, 128, convert=conv, block_n=64 if fmt == "int8_token_head" else 128,
                                       num_warps=4, num_stages=2)
        print(json.dumps(dict(fmt=fmt, conversion=conv, spilled_bytes=k.spilled_bytes, **loop_mix(k, launch))), flush=True)
"""


@pytest.fixture(scope="module")
def builds():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _BUILD_ALL], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {(r["fmt"], r["conversion"]): r for r in rows}


def _codes_per_warp(row) -> int:
    """Codes a warp decodes per tile: block_n tokens x 128 channels x (K, V) over the program's threads x 32."""
    return row["block_n"] * 128 * 2 // (row["num_warps"] * 32) * 32


@pytest.mark.parametrize("fmt", QUANT_DECODE_FORMATS)
def test_every_conversion_builds_and_only_cast_converts_per_code(builds, fmt):
    assert set(builds) == {(f, c) for f in QUANT_DECODE_FORMATS for c in QUANT_CONVERTS}
    cast, software, ptx = (builds[fmt, c] for c in ("cast", "software", "ptx"))
    per_thread = _codes_per_warp(cast) // 32
    assert cast["convert"] >= per_thread  # an integer-to-float conversion per code, at least
    for row in (software, ptx):
        assert row["spilled_bytes"] == 0, row
        assert row["convert"] <= per_thread // 8, row  # the probabilities' and the scales' conversions only
        assert row["tensor core"] == cast["tensor core"]  # the same dots


@pytest.mark.parametrize("fmt", QUANT_DECODE_FORMATS)
def test_ptx_issues_the_fewest_instructions_per_token(builds, fmt):
    cast, software, ptx = (builds[fmt, c]["issue_per_token"] for c in ("cast", "software", "ptx"))
    assert ptx < software and ptx < cast
    if fmt != "int8_token_head":  # INT8's cast is one instruction a code, as its bits are; the 4-bit codes' are not
        assert software < 0.9 * cast
