"""The Gluon section's prose numbers: its profile, the launch probes (``scripts/gluon_launch_probe.py``
tiles / mha / groups / crossover / wide-crossover, the block-table clamp), the ``gluon`` preset at
B = 1 × 4k and the previous kernel's console tables."""

from __future__ import annotations

import pandas as pd

from .decode import claim
from .fmt import num, pct, span, times
from .gluon import WIDE, WIDE_2
from .layout_probes import DECODE_PROFILE
from .layouts import shape_of
from .sources import Sources, ok_rows
from .textfiles import console_table, profile_section, profile_sections

__all__ = ["gluon_probes"]

PAGE_CLAMP = "results/bench/nvidia-h200/20261204T164000Z-gluon-page-clamp.json"
MHA = "results/bench/nvidia-h200/20261203T234329Z-gluon-mha.json"
GROUPS = "results/bench/nvidia-h200/20261203T234329Z-gluon-groups.json"
PROBE = "results/bench/nvidia-h200/20261203T210039Z-gluon-probe.json"
CROSSOVER = "results/bench/nvidia-h200/20261203T211700Z-gluon-crossover.json"
WIDE_CROSS = ("results/bench/nvidia-h200/20261204T144946Z-gluon-wide-crossover.json",
              "results/bench/nvidia-h200/20261204T145432Z-gluon-wide-crossover.json")
LAYOUTS_256 = "results/bench/nvidia-h200/20261204T120343Z.csv"
GLUON_1 = "results/bench/nvidia-h200/20261203T210857Z.csv"
CONSOLE = "results/bench/nvidia-h200/20261203T181041Z-console.txt"
CONSOLE_SHAPES = ["32/8/128", "28/4/128", "32/32/128"]  # the gluon preset's order then (the file's header says so)


def _profile(src: Sources) -> dict[str, str]:
    secs = profile_sections(src.text(DECODE_PROFILE), DECODE_PROFILE)
    top = profile_section(secs, "32/8/128 FP8 e4m3, gluon", DECODE_PROFILE)["samples"][0]
    claim(top[1].startswith("VIMNMX"), "the 32/8/128 Gluon kernel's hottest instruction is the block-table clamp",
          DECODE_PROFILE)
    wide = [profile_section(secs, s, DECODE_PROFILE)["samples"][0] for s in ("8/1/256 FP8", "16/16/256 FP8")]
    claim(all(w[1].startswith("F2FP") for w in wide), "at D = 256 the hottest instruction is an FP8 conversion",
          DECODE_PROFILE)
    return {"gprof.clamp_pct": num(top[0], 0), "gprof.f2fp_pct": span([w[0] for w in wide], 0)}


def _clamp(src: Sources) -> dict[str, str]:
    runs = src.json(PAGE_CLAMP).get("runs")
    if not isinstance(runs, dict) or len(runs) != 3:
        raise ValueError(f"{PAGE_CLAMP}: expected 'runs' holding its three calls; it has {type(runs).__name__}")
    calls = [pd.DataFrame(r["rows"]) for r in runs.values()]
    two = calls[1].assign(variant=calls[1]["variant"].astype(str))
    t = two.pivot_table(index="shape", columns="variant", values="time_us")
    x = t["default"] / t["{}"]  # clamped as loaded over clamped where used
    claim((x > 1).all(), "the clamp where used faster at every layout of the run that timed both", PAGE_CLAMP)
    three = calls[2].assign(variant=calls[2]["variant"].astype(str))
    c3 = three.pivot_table(index="shape", columns="variant", values="time_us")
    return {"clamp.x": span(x), "clamp.layouts": str(len(x)),
            "clamp.32_8_128": f"{num(t.loc['32/8/128', 'default'])} → {num(t.loc['32/8/128', '{}'])}",
            "clamp.16_16_256": f"{num(t.loc['16/16/256', 'default'])} → {num(t.loc['16/16/256', '{}'])}",
            "clamp.16_16_256_us": num(t.loc["16/16/256", "{}"]),
            "clamp.71": f"{num(c3.loc['71/1/64', 'default'])} against {num(c3.loc['71/1/64', 'triton'])}",
            "clamp.71_pct": pct(1 - c3.loc["71/1/64", "default"] / c3.loc["71/1/64", "triton"]),
            "clamp.48": f"{num(c3.loc['48/1/128', 'default'])} against {num(c3.loc['48/1/128', 'triton'])}"}


def _wide_more(src: Sources, v: dict[str, str]) -> dict[str, str]:
    """The wide probes beyond their table: deeper 128-token rings, B = 4 × 16k, and FlashInfer at 16/16/256."""
    second = src.rows(WIDE_2, columns=["shape", "batch", "kernel", "launch", "block_n", "num_stages", "time_us"])
    at64 = second[second["batch"] == 64]
    default = at64[at64["launch"] == "{'gluon': True}"].set_index("shape")["time_us"]
    deep = at64[at64["launch"].str.contains("'num_stages': 3") & (at64["block_n"] == 128)].set_index("shape")["time_us"]
    at4 = second[(second["batch"] == 4) & second["launch"].isin(["{'gluon': True}", "{'gluon': False}"])]
    t4 = at4.pivot_table(index="shape", columns="kernel", values="time_us")
    split = ["16/8/256", "16/16/256", "32/8/256"]
    first = src.rows(WIDE, columns=["shape", "batch", "block_n", "num_stages", "time_us"])
    ours = [first[(first["shape"] == "16/16/256") & (first["batch"] == 64) & (first["block_n"] == 128)
                  & (first["num_stages"] == 2)]["time_us"].iloc[0], default["16/16/256"]]
    lay = ok_rows(src.csv(LAYOUTS_256, ["label", "kernel", "time_us"]), LAYOUTS_256)
    lay = lay[(lay["num_q_heads"] == 16) & (lay["num_kv_heads"] == 16) & (lay["batch"] == 64)].set_index("label")["time_us"]
    fi = lay["flashinfer-no-tc fp8_e4m3 dequant"]
    clamped = float(v["clamp.16_16_256_us"])
    return {"gwide.deep_x": span(deep / default[deep.index]), "gwide.b4_x": span(t4.loc[split, "triton"] / t4.loc[split, "gluon"]),
            "gwide.fi_mha_us": num(fi, 0), "gwide.own_64_us": num(lay["triton fp8_e4m3 dequant"], 0),
            "gwide.own_128_us": span(ours, 0), "gwide.own_x_fi": span([fi / o for o in ours]),
            "gwide.clamped_x_fi": times(fi / clamped)}


def _launch(src: Sources) -> dict[str, str]:
    mha = src.rows(MHA, columns=["shape", "batch", "context", "launch", "num_splits", "time_us"])
    m = mha[(mha["shape"] == "32/32/128") & (mha["batch"] == 4) & (mha["context"] == 16384) & (mha["num_splits"] == 9)]
    m = m.set_index("launch")["time_us"]
    small, big = m["{'gluon': True, 'block_n': 64, 'num_stages': 4}"], m["{'gluon': True}"]
    claim(small < big, "64-token tiles faster than 128-token ones at MHA, B = 4 × 16k", MHA)
    probe = src.rows(PROBE, columns=["shape", "kernel", "grid", "block_n", "num_stages", "time_us"])
    g = probe[probe["kernel"] == "gluon"].pivot_table(index=["shape", "block_n", "num_stages"], columns="grid",
                                                     values="time_us")
    gain = g["batch-first"] / g["heads-first"] - 1
    claim((gain > 0).all(), "heads first never slower than batch first", PROBE)
    return {"glaunch.mha": f"{num(small)} against {num(big)}", "glaunch.grid_pct": pct(gain.max())}


def _groups(src: Sources) -> dict[str, str]:
    rows = src.rows(GROUPS, columns=["shape", "batch", "kernel", "heads_per_program", "head_tiles", "time_us"])
    r = rows[rows["batch"] == 64]

    def pair(shape, tiles):
        s = r[r["shape"] == shape]
        gl = s[(s["kernel"] == "gluon") & (s["head_tiles"] == tiles)]["time_us"].mean()
        return gl, s[s["kernel"] == "triton"]["time_us"].iloc[0]

    g48, g71, g40 = pair("48/1/128", 3), pair("71/1/64", 3), pair("40/2/64", 1)
    claim(g40[0] < g40[1], "the Gluon kernel wins at 40/2/64 in one program", GROUPS)
    return {"groups.48": f"{num(g48[0])} µs in three programs against {num(g48[1])}",
            "groups.71": f"{num(g71[0])} µs in three programs against {num(g71[1])}",
            "groups.40": f"{num(g40[0])} against {num(g40[1])}"}


def _pairs(rows: pd.DataFrame) -> pd.DataFrame:
    """Gluon against Triton per point: ``x`` (Triton's time over Gluon's) and Gluon's tokens per split."""
    keys = ["shape", "batch", "context"]
    gl = rows[rows["kernel"] == "gluon"].drop_duplicates(keys, keep="last").set_index(keys)
    tr = rows[rows["kernel"] == "triton"].drop_duplicates(keys, keep="last").set_index(keys)
    both = gl.index.intersection(tr.index)
    return pd.DataFrame({"x": tr.loc[both, "time_us"] / gl.loc[both, "time_us"], "gluon_us": gl.loc[both, "time_us"],
                         "triton_us": tr.loc[both, "time_us"], "tokens": gl.loc[both, "tokens_per_split"]})


def _crossover(src: Sources) -> dict[str, str]:
    cols = ["shape", "batch", "context", "kernel", "tokens_per_split", "time_us"]
    p = _pairs(src.rows(CROSSOVER, columns=cols))
    short, long_ = p[p["tokens"] <= 512], p[p["tokens"] >= 1024]
    lost, won = short[short["x"] < 1], short[short["x"] >= 1]
    claim((long_["x"] > 1).all(), "Gluon faster at every point with 1024 or more tokens per split", CROSSOVER)
    ex = p.loc[("32/8/128", 1, 4096)]
    v = {"cross.lost": f"{len(lost)} of {len(short)}", "cross.lost_x": span(lost["x"]),
         "cross.example": f"{num(ex['gluon_us'])} against {num(ex['triton_us'])}",
         "cross.won_pct": num((won["x"].max() - 1) * 100, 1) if len(won) else "0",
         "cross.won_n": {0: "none of the others", 1: "the other one", 2: "the other two"}.get(len(won), f"the other {len(won)}"),
         "cross.long_n": str(len(long_)), "cross.long_x": span(long_["x"])}
    w = _pairs(pd.concat([src.rows(rel, columns=cols) for rel in WIDE_CROSS], ignore_index=True))
    five, short = w[w["tokens"] == 512], w[w["tokens"] <= 256]
    claim((five["x"] > 1).all() and (short["x"] < 1).all(),
          "at D = 256 Gluon faster at every point with 512-token splits and slower at every one with 256 or fewer",
          WIDE_CROSS[0])
    a, b = w.loc[("16/8/256", 1, 16384)], w.loc[("8/1/256", 4, 16384)]
    v.update({"wcross.n512": str(len(five)), "wcross.x512": span(five["x"]), "wcross.n256": str(len(short)),
              "wcross.ex512": f"{num(a['gluon_us'])} against {num(a['triton_us'])}",
              "wcross.ex256": f"{num(b['gluon_us'])} against {num(b['triton_us'])}"})
    return v


def _b1(src: Sources) -> dict[str, str]:
    """The gluon preset at B = 1 × 4k, run with ``gluon=True`` beside ``gluon=False``."""
    ok = ok_rows(src.csv(GLUON_1, ["label", "time_us"]), GLUON_1)
    ok = ok.assign(shape=[shape_of(r) for _, r in ok.iterrows()])
    fp8 = ok[ok["kv_dtype"] == "fp8_e4m3"]
    t = fp8.pivot_table(index="shape", columns="label", values="time_us")
    gl, tr = t["triton fp8_e4m3 dequant"], t["triton-gluon=False fp8_e4m3 dequant"]
    fi = ok[ok["backend"] == "flashinfer"].pivot_table(index="shape", columns="label", values="time_us").min(axis=1)
    gqa = [s for s in t.index if s.split("/")[0] != s.split("/")[1]]
    mha = [s for s in t.index if s not in gqa]
    x = tr / gl
    claim((x[gqa] < 1).all(), "the Gluon kernel slower than the Triton kernel on every GQA layout at 1 × 4k", GLUON_1)
    claim(((x[mha] - 1).abs() < 0.06).all(), "the two kernels level on MHA at 1 × 4k", GLUON_1)
    has_fi = fi.index.intersection(t.index)
    return {"gb1.x_gqa": span(x[gqa]), "gb1.32_8_128": f"{num(gl['32/8/128'])} against {num(tr['32/8/128'])}",
            "gb1.mha": f"{num(gl['32/32/128'])} against {num(tr['32/32/128'])}",
            "gb1.triton_x_fi": span(fi[has_fi] / tr[has_fi]), "gb1.gluon_x_fi": span(fi[has_fi] / gl[has_fi])}


def _previous(src: Sources) -> dict[str, str]:
    """The previous Gluon kernel (warps sharing each tile): the console tables of its gluon-preset run."""
    c = console_table(src.text(CONSOLE), CONSOLE_SHAPES, CONSOLE)
    c = c[(c["case"] == "triton-gluon=True fp8_e4m3 dequant") & c["check_passed"]].set_index(["shape", "batch", "context"])
    at = c["time_us"]
    return {"prev.32_8_128": num(at[("32/8/128", 64, 16384)], 0), "prev.mha": num(at[("32/32/128", 64, 16384)], 0)}


def gluon_probes(src: Sources) -> dict[str, str]:
    """Every ``gprof.*``, ``clamp.*``, ``gwide.*``, ``glaunch.*``, ``groups.*``, ``cross.*``, ``wcross.*``,
    ``gb1.*`` and ``prev.*`` value."""
    v: dict[str, str] = {}
    for part in (_profile, _clamp, _launch, _groups, _crossover, _b1, _previous):
        v.update(part(src))
    v.update(_wide_more(src, v))
    return v
