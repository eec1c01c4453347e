"""The README's issue-budget paragraph: the Gluon decode's tile loop built for sm90 on a CPU
(``scripts/issue_budget.py``), its warp instructions per token against what an SM issues while it streams the H200's
copy rate, and, at the formats' B 64 x 32k point, the share of the H200's issue slots each format's measured time
implies."""

from __future__ import annotations

import pandas as pd

from ..ops.decode.gluon_launcher import GLUON_MIN_PACKED_SPLIT_TOKENS, GLUON_MIN_SPLIT_TOKENS
from ..ops.offline_build import ISSUE_PER_CLOCK
from .decode import claim
from .fmt import num, pct, span, times
from .formats import FORMATS_H200, INT4_GOAL_X_FP8
from .sources import Sources, ok_rows

__all__ = ["issue", "residency", "int4_tiles", "int4_grid", "ISSUE", "INT4_TILES", "INT4_GRID"]

# python scripts/issue_budget.py --copy-from results/bench/nvidia-h200/20261206T100317Z.csv
ISSUE = "results/sass/sm90/20261207T071213Z.csv"
_KEY = ["num_q_heads", "num_kv_heads", "head_dim", "batch", "context"]
_POINT = (32, 8, 128, 64, 32768)  # _KEY's values at the formats' point both files hold
_NAMES = {("fp8_e4m3", "tensor"): "FP8", ("fp8_e4m3", "token_head"): "FP8 token-head",
          ("int8_token_head", "tensor"): "INT8", ("int4_token_head", "tensor"): "INT4"}


def _name(r) -> str:
    return _NAMES[r["kv_dtype"], r["granularity"]] + (f", window {int(r['window'])}" if r["window"] == r["window"] else "")


def _at_point(rows: pd.DataFrame) -> pd.Series:
    """Which rows are at the README's point (_POINT: 32/8/128, B 64 x 32k)."""
    return (rows[_KEY] == pd.Series(_POINT, index=_KEY)).all(axis=1)


def issue(src: Sources) -> dict[str, str]:
    every = src.csv(ISSUE, [*_KEY, "kv_dtype", "granularity", "window", "block_n", "max_registers", "registers",
                            "spilled_bytes", "programs_per_sm", "total", "issue_per_token", "budget", "budget_share"])
    meta = src.json(ISSUE.replace(".csv", ".json"))
    claim(meta["copy_from"] == FORMATS_H200, "the budget is the H200 formats run's copy rate", ISSUE)
    capped = every[every["max_registers"].notna()]  # what-ifs of the build: registers capped
    rows = every[every["max_registers"].isna()]  # the launches fp8kv makes
    claim((rows["spilled_bytes"] == 0).all(), "no launch fp8kv makes spilled", ISSUE)
    head = ["Hq/Hkv/D", "pages", "B × ctx", "tile", "programs an SM", "registers (spilled bytes)",
            "loop instructions (a warp)", "warp instructions a token", "budget a token", "share of the budget"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in every.iterrows():
        regs = f"{r['registers']}" if r["max_registers"] != r["max_registers"] else \
            f"{r['registers']}, capped ({r['spilled_bytes']})"
        lines.append(f"| {r['num_q_heads']}/{r['num_kv_heads']}/{r['head_dim']} | {_name(r)} | {r['batch']} × "
                     f"{r['context'] // 1024}k | {r['block_n']} | {r['programs_per_sm']} | {regs} | "
                     f"{r['total']} | {num(r['issue_per_token'], 1)} | {num(r['budget'], 1)} | "
                     f"{pct(r['budget_share'])} % |")
    claim(len(capped) == 1 and _name(capped.iloc[0]) == "INT4" and capped.iloc[0]["block_n"] == 128,
          "one what-if: INT4's 128-token tiles with its registers capped", ISSUE)
    cap = capped.iloc[0]
    at = rows[_at_point(rows)].assign(name=lambda d: [_name(r) for _, r in d.iterrows()])
    default = at.drop_duplicates(subset="name", keep="first").set_index("name")  # each format's default tile first
    wide = at[(at["name"] == "INT4") & (at["block_n"] == 128)]
    claim(len(wide) == 1 and default.loc["INT4", "block_n"] == 64, "INT4 at its default 64-token tile, and at 128",
          ISSUE)
    # The measured side: each format's µs at the same point on the H200 -> the share of the SMs' issue slots that its
    # instructions took in that time (four a clock an SM, at the clock the budget takes)
    timed = ok_rows(src.csv(FORMATS_H200, [*_KEY, "kv_dtype", "granularity", "variant", "time_us"]), FORMATS_H200)
    timed = timed[_at_point(timed) & timed["variant"].isna()]
    tokens = _POINT[1] * _POINT[3] * _POINT[4]  # KV heads x sequences x context
    used, us_of = {}, {}
    for (kv_dtype, gran), name in _NAMES.items():
        us = timed[(timed["kv_dtype"] == kv_dtype) & (timed["granularity"] == gran)]["time_us"]
        claim(len(us) == 1, f"one timed {name} row at the point", FORMATS_H200)
        slots = us.iloc[0] * 1e-6 * meta["num_sms"] * meta["clock_ghz"] * 1e9 * ISSUE_PER_CLOCK
        used[name] = default.loc[name, "issue_per_token"] * tokens / slots
        us_of[name] = us.iloc[0]
    # INT4 at its goal's time (FP8's / INT4_GOAL_X_FP8) with the instructions it issues now: the share it would fill
    at_goal = used["INT4"] * us_of["INT4"] / (us_of["FP8"] / INT4_GOAL_X_FP8)
    mqa = rows[rows["num_q_heads"] == 71].iloc[0]
    fp8 = rows[(rows["kv_dtype"] == "fp8_e4m3") & (rows["granularity"] == "tensor") & (rows["num_q_heads"] != 71)]
    return {"issue.table": "\n".join(lines), "issue.copy_tbs": num(meta["copy_gbps"] / 1e3, 1),
            "issue.clock": num(meta["clock_ghz"], 2), "issue.sms": str(meta["num_sms"]), "issue.triton": meta["triton"],
            "issue.fp8": num(default.loc["FP8", "issue_per_token"], 1),
            "issue.int4": num(default.loc["INT4", "issue_per_token"], 1),
            "issue.int4_share": pct(default.loc["INT4", "budget_share"]),
            "issue.int4_128_share": pct(wide["budget_share"].iloc[0]),
            "issue.fp8_share": pct(default.loc["FP8", "budget_share"]),
            "issue.fp8_layout_shares": span(100 * fp8["budget_share"], 0),
            "issue.mqa_share": pct(mqa["budget_share"]), "issue.mqa_programs": str(mqa["programs_per_head"]),
            "issue.used": ", ".join(f"{name} {pct(x)} %" for name, x in used.items()),
            "issue.int4_used": pct(used["INT4"]), "issue.int4_at_goal": pct(at_goal),
            "issue.cap": str(int(cap["max_registers"])), "issue.cap_spilled": str(int(cap["spilled_bytes"])),
            "issue.cap_programs": str(cap["programs_per_sm"]), "issue.cap_share": pct(cap["budget_share"]),
            "issue.cap_x": times(default.loc["INT4", "issue_per_token"] / cap["issue_per_token"]),
            "issue.goal": num(INT4_GOAL_X_FP8, 1)}


def residency(src: Sources) -> dict[str, str]:
    """The programs an SM holds (``programs_per_sm``, from each build's registers and shared memory) that the
    split rule's and the Gluon launch's paragraphs quote: FP8 with one tensor scale, no window, in the sm90 builds."""
    rows = src.csv(ISSUE, ["num_q_heads", "num_kv_heads", "head_dim", "kv_dtype", "granularity", "window", "block_n",
                           "programs_per_sm"])
    fp8 = rows[(rows["kv_dtype"] == "fp8_e4m3") & (rows["granularity"] == "tensor") & rows["window"].isna()]

    def at(hq: int, hkv: int, d: int, block_n: int) -> int:
        r = fp8[(fp8["num_q_heads"] == hq) & (fp8["num_kv_heads"] == hkv) & (fp8["head_dim"] == d)]
        claim(len(r) == 1 and int(r["block_n"].iloc[0]) == block_n, f"{hq}/{hkv}/{d} built once, in {block_n}-token "
              "tiles", ISSUE)
        return int(r["programs_per_sm"].iloc[0])

    mha = fp8[(fp8["num_q_heads"] == fp8["num_kv_heads"]) & (fp8["head_dim"] >= 80)]
    claim(len(mha) >= 2 and (mha["block_n"] == 128).all() and mha["programs_per_sm"].nunique() == 1,
          "MHA from D = 80 runs 128-token tiles, all at one residency", ISSUE)
    wide = at(8, 1, 256, 128)
    claim(int(mha["programs_per_sm"].iloc[0]) == wide, "128-token tiles hold as many programs at MHA as at D = 256",
          ISSUE)
    return {"residency.span": span(fp8["programs_per_sm"], 0), "residency.d256": str(wide),
            "residency.d128": str(at(32, 8, 128, 64)), "residency.d64": str(at(14, 2, 64, 64)),
            "residency.mha64": str(at(32, 32, 64, 128))}


# python -m fp8kv.bench --preset formats --batches 64 --contexts 32768 on one H100, three runs a minute apart: FP8's
# defaults (--kv-dtypes fp8_e4m3), INT4 through the Gluon kernel at its default tile (--kv-dtypes int4_token_head
# --triton-opt gluon=1), and the same with --triton-opt block_n=128 --triton-opt num_stages=3
INT4_TILES = {"fp8": "results/bench/nvidia-h100-80gb-hbm3/20261207T083932Z.csv",
              "default": "results/bench/nvidia-h100-80gb-hbm3/20261207T083949Z.csv",
              "wide": "results/bench/nvidia-h100-80gb-hbm3/20261207T084002Z.csv"}


# The same H100, later (python -m fp8kv.bench --preset formats ..., the formats grid: 32/8/128 and 8/1/128, B 1/16/64 x
# 4k/16k/32k): INT4 through the Gluon kernel at 64-token tiles 4 deep (--kv-dtypes int4_token_head --triton-opt gluon=1
# --triton-opt block_n=64 --triton-opt num_stages=4), at 128 three deep (--triton-opt gluon=1), and the preset's
# defaults (where short splits ran the Triton quantized kernel; a run cut short after its B 64 x 16k rows)
INT4_GRID = {"narrow": "results/bench/nvidia-h100-80gb-hbm3/20261207T093537Z.csv",
             "wide": "results/bench/nvidia-h100-80gb-hbm3/20261207T093604Z.csv",
             "defaults": "results/bench/nvidia-h100-80gb-hbm3/20261207T093218Z.csv"}
_GRID_KEY = ["num_q_heads", "num_kv_heads", "head_dim", "batch", "context"]


def int4_grid(src: Sources) -> dict[str, str]:
    """INT4's tiles across the formats grid, and the Gluon kernel against the Triton quantized kernel where the
    splits are short, by tokens per split."""
    cols = [*_GRID_KEY, "kv_dtype", "kernel", "block_n", "num_stages", "num_splits", "time_us"]
    at = {}
    for name, rel in INT4_GRID.items():
        rows = ok_rows(src.csv(rel, [*cols, "variant"]), rel)
        rows = rows[rows["kv_dtype"] == "int4_token_head"]
        rows = rows[rows["variant"].isna()] if name == "defaults" else rows
        at[name] = rows.set_index(_GRID_KEY)
    narrow, wide = at["narrow"], at["wide"]
    claim(len(narrow) == len(wide) == 18 and set(narrow.index) == set(wide.index)
          and (narrow["block_n"] == 64).all() and (wide["block_n"] == 128).all() and (wide["num_stages"] == 3).all(),
          "the 18 points of the grid, 64-token tiles against 128 three deep", INT4_GRID["wide"])
    x = narrow["time_us"] / wide["time_us"].reindex(narrow.index)
    triton = at["defaults"][at["defaults"]["kernel"].str.startswith("triton")]
    vs = wide.reindex(triton.index)
    per_split = (vs.index.get_level_values("context") / vs["num_splits"]).astype(int)
    ratio = vs["time_us"] / triton["time_us"]
    bound = GLUON_MIN_PACKED_SPLIT_TOKENS
    claim(((per_split >= bound) == (ratio < 1)).all(), "the Gluon kernel faster exactly where its splits hold "
          "GLUON_MIN_PACKED_SPLIT_TOKENS or more", INT4_GRID["defaults"])
    return {"int4_grid.faster": str(int((x > 1).sum())), "int4_grid.points": str(len(x)),
            "int4_grid.best": times(x.max()), "int4_grid.worst": times(x.min()),
            "int4_grid.long_x": span(ratio[per_split >= bound]), "int4_grid.long_n": str(int((per_split >= bound).sum())),
            "int4_grid.short_x": span(ratio[per_split < bound]), "int4_grid.short_n": str(int((per_split < bound).sum())),
            "int4_grid.short_tokens": span(per_split[per_split < bound], 0), "int4_grid.bound": str(bound),
            "int4_grid.decode_bound": str(GLUON_MIN_SPLIT_TOKENS[1])}


def int4_tiles(src: Sources) -> dict[str, str]:
    """INT4's 128-token tiles three deep against its default tile and FP8, timed at 32/8/128, B 64 x 32k."""
    cols = [*_KEY, "kv_dtype", "granularity", "variant", "kernel", "block_n", "num_stages", "time_us", "pct_copy_bw"]
    at = {}
    for name, rel in INT4_TILES.items():
        rows = ok_rows(src.csv(rel, cols), rel)
        rows = rows[_at_point(rows) & (rows["granularity"] == "tensor")]
        rows = rows[(rows["kv_dtype"] == "fp8_e4m3") & rows["variant"].isna()] if name == "fp8" else rows
        claim(len(rows) == 1, f"one {name} row at 32/8/128, B 64 x 32k", rel)
        at[name] = rows.iloc[0]
    claim(at["fp8"]["kernel"] == "gluon" and {at["default"]["kernel"], at["wide"]["kernel"]} == {"gluon-quantized"},
          "every row ran the Gluon kernel", ", ".join(INT4_TILES.values()))
    claim((at["default"]["block_n"], at["wide"]["block_n"], at["wide"]["num_stages"]) == (64, 128, 3),
          "INT4 at its default 64-token tile, then at 128 three deep", INT4_TILES["wide"])
    us = {name: float(r["time_us"]) for name, r in at.items()}
    return {"int4_tiles.fp8_us": num(us["fp8"], 0), "int4_tiles.default_us": num(us["default"], 0),
            "int4_tiles.wide_us": num(us["wide"], 0), "int4_tiles.gain": times(us["default"] / us["wide"]),
            "int4_tiles.x_fp8_default": times(us["fp8"] / us["default"]),
            "int4_tiles.x_fp8_wide": times(us["fp8"] / us["wide"]),
            "int4_tiles.pct_default": num(at["default"]["pct_copy_bw"], 0),
            "int4_tiles.pct_wide": num(at["wide"]["pct_copy_bw"], 0)}
