"""The multi-token attend kernel built for sm90 on this machine (scripts/attend_sass.py; Triton's bundled ptxas, no
GPU): at the chunk launch, fp8 mode's probabilities rounded by the GPU's conversion (F2FP, two values an
instruction) instead of bit arithmetic shorten the tile loop to about the 16-bit kernel's length; every build
without spills, the FP8 dots on FP8 tensor cores (QGMMA). Its numbers are tested on a GPU (tests/test_attend*.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]


def _build(tmp_path_factory, *args):
    out = tmp_path_factory.mktemp("sass")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "attend_sass.py"), "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (csv,) = (out / "sm90").glob("*-attend.csv")
    return pd.read_csv(csv).set_index(["kv_dtype", "mode", "round_hw"])


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """64-key tiles two deep: the launch the rounding was measured at (README, results/sass/sm90/*-attend.csv)."""
    return _build(tmp_path_factory, "--block-n", "64", "--stages", "2")


@pytest.fixture(scope="module")
def chunk_builds(tmp_path_factory):
    """The chunk's own tiles on sm90 (fp8kv.ops.attend.planning.CHUNK_TILES: 128 keys, three deep)."""
    return _build(tmp_path_factory)


def test_fp8_mode_rounds_probabilities_by_the_conversion_instruction(builds):
    soft, hard = builds.loc[("fp8_e4m3", "fp8", False)], builds.loc[("fp8_e4m3", "fp8", True)]
    base = builds.loc[("bf16", "dequant", False)]
    assert (builds["spilled_bytes"] == 0).all()
    assert soft["F2FP"] == 0 and hard["F2FP"] > 0  # bit arithmetic has no conversion; the GPU's packs two a time
    assert hard["loop_instructions"] < 0.7 * soft["loop_instructions"]
    assert hard["loop_instructions"] <= 1.05 * base["loop_instructions"]
    assert hard["QGMMA"] > 0 and hard["HGMMA"] == 0 and base["HGMMA"] > 0 and base["QGMMA"] == 0


def test_the_chunk_tiles_fit_and_barely_spill(chunk_builds):
    """128-key tiles three deep fit an sm90 program's shared memory (227 KiB, as chunk_smem_bytes counts them),
    the FP8 builds a GPU runs do not spill, and BF16's spills at most a few registers (24 bytes with Triton 3.9),
    a build that still ran 1.15-1.23x faster on an H100 (README, "Several new tokens per sequence on an H100")."""
    from fp8kv.ops.attend.planning import CHUNK_TILES, chunk_smem_bytes

    assert set(chunk_builds["block_n"]) == {CHUNK_TILES[0][0]} and set(chunk_builds["num_stages"]) == {CHUNK_TILES[0][1]}
    for (kv_dtype, _, _), row in chunk_builds.iterrows():
        elem = 2 if kv_dtype == "bf16" else 1
        assert row["shared_bytes"] <= chunk_smem_bytes(*CHUNK_TILES[0], 128, elem) <= 232448
    assert chunk_builds.loc[("fp8_e4m3", "dequant", False), "spilled_bytes"] == 0
    assert chunk_builds.loc[("fp8_e4m3", "fp8", True), "spilled_bytes"] == 0
    assert chunk_builds.loc[("bf16", "dequant", False), "spilled_bytes"] <= 32
