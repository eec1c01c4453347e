"""The quantized-page decode's default launch per format (fp8kv.ops.quant_decode.launcher.QUANT_LAUNCH_DEFAULTS)
is what the benchmark measured fastest, read again from the results file the table cites; and the defaults
are what a launch takes where no option is given (under the interpreter: no inline assembly, one stage)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.ops.quant_decode.launcher import QUANT_LAUNCH_DEFAULTS, quant_decode_launch, quant_launch_defaults

ROOT = Path(__file__).resolve().parents[1]
TUNE = ROOT / "results/bench/nvidia-h100-80gb-hbm3/20261205T180924Z.csv"  # the file the table's comment cites


def test_the_table_cites_the_file_read_here():
    source = (ROOT / "fp8kv/ops/quant_decode/launcher.py").read_text()
    assert str(TUNE.relative_to(ROOT)) in source


def _launch(row) -> tuple:
    return (row["kernel"].removeprefix("triton-quantized-"), int(row["block_n"]), int(row["num_warps"]),
            int(row["num_stages"]))


@pytest.mark.parametrize("fmt", list(QUANT_LAUNCH_DEFAULTS))
def test_each_default_is_the_fastest_launch_measured(fmt):
    """Fastest on average over the head layouts measured, each launch's time taken relative to the fastest row of
    its layout (where the layouts disagree on the fastest, no launch is the fastest of both)."""
    rows = pd.read_csv(TUNE)
    rows = rows[rows["kv_dtype"] == fmt]
    assert len(rows) and (rows["status"] == "ok").all() and rows["check_passed"].all()
    assert rows["num_q_heads"].nunique() == 2
    relative = rows["time_us"] / rows.groupby("num_q_heads")["time_us"].transform("min")
    launches = rows.apply(_launch, axis=1)
    per_launch = relative.groupby(launches).mean()
    assert (rows["num_q_heads"].groupby(launches).nunique() == 2).all()  # each launch measured at both layouts
    d = QUANT_LAUNCH_DEFAULTS[fmt]
    assert per_launch.idxmin() == (d["convert"], d["block_n"], d["num_warps"], d["num_stages"]), per_launch.sort_values()


@pytest.mark.parametrize("fmt", list(QUANT_LAUNCH_DEFAULTS))
@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_launch_without_options_takes_the_defaults(fmt, head_dim):
    scale = {"k_tensor_scale": 1.0, "v_tensor_scale": 1.0} if fmt == "nvfp4" else {}
    cache = QuantizedPagedKVCache.empty(fmt, 1, 256, 2, head_dim, **scale)
    launch = quant_decode_launch(cache, batch=1, num_q_heads=4, q_dtype=torch.float16, device=torch.device("cpu"),
                                 sm_scale=0.1, out_dtype=torch.float16, num_splits=None, block_n=None)
    defaults = quant_launch_defaults(cache)
    assert launch.convert == defaults["convert"] and launch.block_n == defaults["block_n"]
    assert launch.constexprs["num_warps"] == defaults["num_warps"]
    assert launch.constexprs["num_stages"] == defaults["num_stages"]
    table = QUANT_LAUNCH_DEFAULTS[fmt]
    assert defaults["block_n"] == (table["block_n"] // 2 if head_dim > 128 else table["block_n"])
    given = quant_decode_launch(cache, batch=1, num_q_heads=4, q_dtype=torch.float16, device=torch.device("cpu"),
                                sm_scale=0.1, out_dtype=torch.float16, num_splits=None, block_n=32, convert="cast",
                                num_warps=8, num_stages=3)
    assert (given.convert, given.block_n, given.constexprs["num_warps"], given.constexprs["num_stages"]) == (
        "cast", 32, 8, 3)


def test_the_interpreter_runs_software_for_ptx_and_one_stage(monkeypatch):
    from fp8kv.ops.quant_decode import launcher

    cache = QuantizedPagedKVCache.empty("int4_token_head", 1, 64, 2, 64)
    monkeypatch.setattr(launcher, "interpreter_on", lambda: False)
    assert quant_launch_defaults(cache) == QUANT_LAUNCH_DEFAULTS["int4_token_head"]
    monkeypatch.setattr(launcher, "interpreter_on", lambda: True)
    assert quant_launch_defaults(cache) == dict(QUANT_LAUNCH_DEFAULTS["int4_token_head"], convert="software",
                                                num_stages=1)
