"""The head-layout section's probes: the page-layout profile, the head dim cut into register pieces,
the 71/1/64 profile and the two-wave rule at head dims that are not powers of two (the † rows)."""

from __future__ import annotations

from .decode import claim
from .fmt import num, span, times
from .layouts import LAYOUTS_1, table_of
from .probes import rule_ratios, shape_col
from .sources import Sources, ok_rows
from .textfiles import profile_section, profile_sections

__all__ = ["layout_probes", "PAGE_PROFILE", "DECODE_PROFILE", "SPLIT_RULE_ODD"]

PAGE_PROFILE = "results/bench/nvidia-h200/20261204T201200Z-page-layout-profile.txt"
DECODE_PROFILE = "results/bench/nvidia-h200/20261204T163000Z-decode-profile.txt"
HEAD_PIECES = "results/bench/nvidia-h200/20261204T200230Z-head-pieces.json"
HEAD_PIECES_TILES = "results/bench/nvidia-h200/20261204T201132Z-head-pieces-tiles.json"
SPLIT_RULE_ODD = "results/bench/nvidia-h200/20261204T151534Z-split-rule.csv"


def _page_profile(src: Sources) -> dict[str, str]:
    secs = profile_sections(src.text(PAGE_PROFILE), PAGE_PROFILE)
    odd, pow2 = profile_section(secs, "32/32/80 ", PAGE_PROFILE), profile_section(secs, "32/32/128 ", PAGE_PROFILE)
    claim(odd["bytes_x"] > pow2["bytes_x"], "DRAM moved more than the K and V bytes at 32/32/80 than at 32/32/128",
          PAGE_PROFILE)
    return {"prof.page.bytes_x_80": times(odd["bytes_x"]), "prof.page.l2_80": num(odd["L2 throughput"], 0),
            "prof.page.bytes_x_128": times(pow2["bytes_x"])}


def _head_pieces(src: Sources) -> dict[str, str]:
    rows = src.rows(HEAD_PIECES, columns=["shape", "batch", "context", "ragged", "rule", "time_us"])
    r = rule_ratios(rows, ["shape", "batch", "context", "ragged"], "rule", "after", "before", HEAD_PIECES)
    v = {"pieces.x": span(r["x"]), "pieces.points": str(len(r)), "pieces.layouts": str(r["shape"].nunique()),
         "pieces.slower": str(int((r["x"] > 1.01).sum()))}
    tiles = src.rows(HEAD_PIECES_TILES, columns=["shape", "variant", "block_n", "stages", "time_us"])
    for shape in ("32/32/80", "32/8/80"):
        t = tiles[tiles["shape"] == shape]
        first = t.iloc[0]  # the padded tile at its default launch, timed first and last
        default = t[(t["variant"] == "padded") & (t["block_n"] == first["block_n"]) & (t["stages"] == first["stages"])]
        claim(t[t["variant"] == "pieces"]["time_us"].min() > default["time_us"].max(),
              f"no tile or ring depth of the pieces made {shape} faster than the padded tile", HEAD_PIECES_TILES)
    return v


def _profile_71(src: Sources) -> dict[str, str]:
    sec = profile_section(profile_sections(src.text(DECODE_PROFILE), DECODE_PROFILE), "71/1/64 FP8 e4m3, triton",
                          DECODE_PROFILE)
    return {"prof.71.issue": num(sec["issue active"], 0), "prof.71.tensor": num(sec["tensor pipe"], 0),
            "prof.71.dram": num(sec["DRAM"], 0), "prof.71.warps": num(sec["warps an SM"], 0)}


def _two_waves(src: Sources) -> dict[str, str]:
    """The † rows: 32/32/80 and /96 at 1 × 4k under two waves (8 splits) and four (16)."""
    raw = ok_rows(src.csv(SPLIT_RULE_ODD, ["min_waves", "num_splits", "time_us"]), SPLIT_RULE_ODD)
    raw = raw.assign(shape=shape_col(raw))
    r = rule_ratios(raw, ["shape", "batch", "context"], "min_waves", 4.0, 2.0, SPLIT_RULE_ODD,
                    extra=("num_splits",)).set_index(["shape", "batch", "context"])
    dag = [(s, 1, 4096) for s in ("32/32/80", "32/32/96")]
    claim((r.loc[dag, "num_splits_old"] == 8).all() and (r.loc[dag, "num_splits_new"] == 16).all(),
          "two waves give 8 splits and four give 16 at 32/32/80 and /96, 1 × 4k", SPLIT_RULE_ODD)
    bf16 = table_of(src, LAYOUTS_1)["bf16_us"]
    x_bf16 = [bf16[s] / r.loc[(s, b, c), "old_us"] for s, b, c in dag]
    claim(max(x_bf16) < 1, "at 8 splits FP8 is still slower than fp8kv's BF16 at 32/32/80 and /96", SPLIT_RULE_ODD)
    return {"dagger.two_waves_us": " and ".join(num(r.loc[p, "old_us"]) for p in dag),
            "dagger.four_waves_us": " and ".join(num(r.loc[p, "new_us"]) for p in dag),
            "dagger.x_bf16": f"{times(x_bf16[0])}× and {times(x_bf16[1])}×"}


def layout_probes(src: Sources) -> dict[str, str]:
    """The ``prof.*``, ``pieces.*`` and ``dagger.*`` values of the head-layout section."""
    v: dict[str, str] = {}
    for part in (_page_profile, _head_pieces, _profile_71, _two_waves):
        v.update(part(src))
    return v

