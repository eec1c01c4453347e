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


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "attend_sass.py"), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (csv,) = (out / "sm90").glob("*-attend.csv")
    return pd.read_csv(csv).set_index(["kv_dtype", "mode", "round_hw"])


def test_fp8_mode_rounds_probabilities_by_the_conversion_instruction(builds):
    soft, hard = builds.loc[("fp8_e4m3", "fp8", False)], builds.loc[("fp8_e4m3", "fp8", True)]
    base = builds.loc[("bf16", "dequant", False)]
    assert (builds["spilled_bytes"] == 0).all()
    assert soft["F2FP"] == 0 and hard["F2FP"] > 0  # bit arithmetic has no conversion; the GPU's packs two a time
    assert hard["loop_instructions"] < 0.7 * soft["loop_instructions"]
    assert hard["loop_instructions"] <= 1.05 * base["loop_instructions"]
    assert hard["QGMMA"] > 0 and hard["HGMMA"] == 0 and base["HGMMA"] > 0 and base["QGMMA"] == 0
