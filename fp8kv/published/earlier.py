"""The README's earlier B = 1 measurements: which points FP8 led every peer at, counted by the rule
that a point whose peers errored or did not run is left out (and said so), never counted as a lead."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..bench.report import layout_table
from ..viz import tokens_label
from .decode import claim
from .fmt import num, pct, span
from .layout_probes import SPLIT_RULE_ODD
from .layouts import shape_of
from .probes import arrow, point_label, rule_ratios, shape_col
from .sources import Sources, ok_rows

__all__ = ["earlier", "later", "lead_points", "EARLIER_B1"]

EARLIER_B1 = "results/bench/nvidia-h200/20261203T125917Z.csv"


def lead_points(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(ahead, behind, no_peer)`` rows of a :func:`~fp8kv.bench.layout_table`: FP8 faster than the best
    peer that ran, not faster, and points where no peer ran (errored or unsupported: never a lead)."""
    no_peer = table[table["peer_us"].isna() | table["fp8_us"].isna()]
    rated = table.drop(no_peer.index)
    return rated[rated["fp8_x_peer"] > 1], rated[rated["fp8_x_peer"] <= 1], no_peer


def _point(r) -> str:
    return f"{shape_of(r)} × {tokens_label(int(r['context']))}"


def earlier(src: Sources) -> dict[str, str]:
    """The ``earlier.*`` values: the B = 1 points of the run FP8 led, trailed, and could not be compared at."""
    df = src.csv(EARLIER_B1, ["status", "check_passed", "batch", "time_us"])
    table = layout_table(df[df["batch"] == 1])
    ahead, behind, no_peer = lead_points(table)
    claim(len(behind) == 1 and _point(behind.iloc[0]) == "8/1/256 × 16k",
          "FP8 trailed the best peer at B = 1 only at 8/1/256 × 16k", EARLIER_B1)
    r = behind.iloc[0]
    return {"earlier.ahead": f"{len(ahead)} of the {len(ahead) + len(behind)}",
            "earlier.no_peer": f"{len(no_peer)} ({', '.join(_point(x) for _, x in no_peer.iterrows())})",
            "earlier.behind_us": f"{num(r['fp8_us'])} µs in that run against FlashInfer's {num(r['peer_us'])} µs"}


# ------------------------------------------------------------------ the split rules and launches since
FORCED_64 = "results/bench/nvidia-h200/20261203T153858Z.csv"
FORCED_128 = "results/bench/nvidia-h200/20261203T153923Z.csv"
SPLIT_RULE = "results/bench/nvidia-h200/20261204T103759Z-split-rule.csv"
FILL_WAVES = "results/bench/nvidia-h200/20261204T184750Z-fill-waves.json"
FILL_VARIANTS = "results/bench/nvidia-h200/20261204T183700Z-fill-waves-variants.json"
PDL_FIRST = "results/bench/nvidia-h200/20261204T145216Z-pdl.csv"
PDL_FINAL = "results/bench/nvidia-h200/20261204T145958Z-pdl.csv"
ONE_LAUNCH = "results/bench/nvidia-h200/20261203T153539Z.csv"
LAUNCH_TABLE = "fp8kv/data/launch_nvidia-h200.json"
HALF_THE_SMS = 66  # the H200's 132 SMs: below half, a dependent launch's early start has SMs to run on


def _fp8(df: pd.DataFrame, rel: str) -> pd.DataFrame:
    ok = ok_rows(df, rel)
    ok = ok[(ok["kv_dtype"] == "fp8_e4m3") & (ok["mode"] == "dequant")]
    return ok.assign(shape=shape_col(ok))


def _forced(src: Sources) -> dict[str, str]:
    """8/1/256, 8/1/128 and 32/8/256 at 1 × 16k with the split count forced to 64 and to 128."""
    at = {}
    for n, rel in ((64, FORCED_64), (128, FORCED_128)):
        ok = _fp8(src.csv(rel, ["time_us", "num_splits"]), rel)
        at[n] = ok[(ok["batch"] == 1) & (ok["context"] == 16384)].set_index("shape")["time_us"]
    for s in ("8/1/256", "8/1/128"):
        claim(at[128][s] < at[64][s], f"128 splits faster than 64 at {s}, 1 × 16k", FORCED_128)
    claim(at[128]["32/8/256"] > at[64]["32/8/256"], "128 splits slower than 64 at 32/8/256, 1 × 16k", FORCED_128)
    return {f"forced.{s.replace('/', '_')}": f"{num(at[128][s])} against {num(at[64][s])}"
            for s in ("8/1/256", "8/1/128", "32/8/256")}


def _split_rules(src: Sources) -> dict[str, str]:
    """Four waves against two (``min_waves``): the points whose split count changed."""
    ok = ok_rows(src.csv(SPLIT_RULE, ["min_waves", "num_splits", "time_us"]), SPLIT_RULE)
    r = rule_ratios(ok.assign(shape=shape_col(ok)), ["shape", "batch", "context"], "min_waves", 4.0, 2.0, SPLIT_RULE,
                    extra=("num_splits",))
    changed = r[r["num_splits_old"] != r["num_splits_new"]]
    lines = [f"  - {point_label(p['shape'], p['batch'], p['context'])}: {arrow(p['old_us'], p['new_us'])} µs "
             f"({int(p['num_splits_old'])} → {int(p['num_splits_new'])} splits);" for _, p in changed.iterrows()]
    v = {"split_rule.changed": f"{len(changed)} of the {len(r)}", "split_rule.list": "\n".join(lines)}
    ok = ok_rows(src.csv(SPLIT_RULE_ODD, ["min_waves", "num_splits", "time_us"]), SPLIT_RULE_ODD)
    r = rule_ratios(ok.assign(shape=shape_col(ok)), ["shape", "batch", "context"], "min_waves", 4.0, 2.0,
                    SPLIT_RULE_ODD, extra=("num_splits",))
    changed = r[r["num_splits_old"] != r["num_splits_new"]]
    odd = changed[changed["shape"] != "32/32/128"]
    claim((odd["x"] > 1).all(), "four waves slower at every changed point of the head dims not powers of two",
          SPLIT_RULE_ODD)
    mha = changed[changed["shape"] == "32/32/128"].iloc[0]
    v.update({"split_rule.odd_points": str(len(odd)), "split_rule.odd_x": span(odd["x"]),
              "split_rule.odd_128": f"{point_label('32/32/128', mha['batch'], mha['context'])} "
                                    f"{arrow(mha['old_us'], mha['new_us'])} µs"})
    return v


def _fill_waves(src: Sources) -> dict[str, str]:
    rows = src.rows(FILL_WAVES, columns=["shape", "batch", "context", "ragged", "rule", "splits", "time_us"])
    r = rule_ratios(rows, ["shape", "batch", "context", "ragged"], "rule", "after", "before", FILL_WAVES,
                    extra=("splits",))
    full, drawn = r[~r["ragged"].astype(bool)], r[r["ragged"].astype(bool)]
    moved = full[full["splits_old"] != full["splits_new"]]
    best = moved.sort_values("x").iloc[0]
    claim(r["x"].max() < 1.005, "no point slower by half a per cent or more under the rule that fills the waves",
          FILL_WAVES)
    v = {"fill.moved_x": span(moved["x"]), "fill.moved_points": str(len(moved)),
         "fill.best": (f"{point_label(best['shape'], best['batch'], best['context'])} "
                       f"{arrow(best['old_us'], best['new_us'])} µs, {int(best['splits_old'])} → {int(best['splits_new'])} splits"),
         "fill.drawn_x": span(drawn["x"]), "fill.worst_pct": num(max(0.0, (r["x"].max() - 1) * 100), 1)}
    var = src.rows(FILL_VARIANTS, columns=["shape", "batch", "context", "ragged", "rule", "splits", "time_us"])
    var = var[(var["shape"] == "14/2/64") & (var["batch"] == 64) & (var["context"] == 16384)]
    one = rule_ratios(var, ["ragged"], "rule", "new4", "old", FILL_VARIANTS, extra=("splits",)).set_index("ragged")
    claim(one.loc[False, "x"] < 1 < one.loc[True, "x"], "one wave faster at full lengths, slower at drawn ones",
          FILL_VARIANTS)
    v.update({"fill.one_wave_splits": str(int(one.loc[False, "splits_new"])),
              "fill.one_wave_full": f"{num(one.loc[False, 'new_us'])} against {num(one.loc[False, 'old_us'])}",
              "fill.one_wave_drawn": f"{num(one.loc[True, 'new_us'])} against {num(one.loc[True, 'old_us'])}",
              "fill.one_wave_kept": str(int(one.loc[False, "splits_old"]))})
    return v


def _pdl(src: Sources) -> dict[str, str]:
    """The early-starting combine (``pdl``) against a plain launch, by the decode's program count."""
    v = {}
    runs = {}
    for rel, on in ((PDL_FIRST, "start"), (PDL_FINAL, "True")):
        ok = ok_rows(src.csv(rel, ["pdl", "num_splits", "heads_per_program", "time_us"]), rel)
        ok = ok.assign(shape=shape_col(ok), pdl=ok["pdl"].astype(str),
                       programs=ok["batch"] * ok["num_kv_heads"] * ok["num_splits"]
                       * np.ceil(ok["num_q_heads"] / ok["num_kv_heads"] / ok["heads_per_program"]))
        t = ok.pivot_table(index=["shape", "batch", "context", "programs"], columns="pdl", values="time_us")
        runs[rel] = (t, t[on] - t["False"])
    (t1, d1), (t2, d2) = runs[PDL_FIRST], runs[PDL_FINAL]
    small = d1.index.get_level_values("programs") <= HALF_THE_SMS
    claim((d1[small] < 0).all() and (d2[small] < 0).all(),
          f"the early start faster at every point of at most {HALF_THE_SMS} programs, in both runs", PDL_FINAL)
    v["pdl.small_points"] = str(int(small.sum()))
    v["pdl.saved_us"] = span(-d2[small], 2)
    ex = t2.xs(("32/8/128", 1, 1000), level=("shape", "batch", "context")).iloc[0]
    v["pdl.example"] = f"32/8/128 at 1 × 1000 {arrow(ex['False'], ex['True'], 2)} µs"
    big = d1[~small]
    worst = big.idxmax()
    v["pdl.big_slower"] = f"{int((big > 0).sum())} of the {len(big)}"
    v["pdl.worst"] = (f"{num(big.max(), 1)} µs slower at {point_label(*worst[:3])}, "
                      f"{num(t1.loc[worst, 'start'], 2)} against {num(t1.loc[worst, 'False'], 2)} µs")
    late = {k: t1[k] - t1["False"] for k in ("end", "exit")}
    v["pdl.late"] = (f"{int((late['end'] > 0).sum())} (trigger after the stores) and {int((late['exit'] > 0).sum())} "
                     f"(no trigger) of the {len(t1)}")
    v["pdl.late_median"] = f"+{num(late['end'].median(), 2)} and +{num(late['exit'].median(), 2)}"
    return v


def _one_launch(src: Sources) -> dict[str, str]:
    ok = _fp8(src.csv(ONE_LAUNCH, ["variant", "time_us"]), ONE_LAUNCH)
    ok = ok[(ok["backend"] == "triton") & (ok["batch"] == 1) & (ok["context"] == 1000)]
    fused = ok[ok["variant"] == "fused_combine=True"].set_index("shape")["time_us"]
    plain = ok[ok["variant"].isna()].set_index("shape")["time_us"]
    x = (fused / plain).dropna()
    claim(len(x) > 0 and (x > 1).all(), "one launch slower at every point measured", ONE_LAUNCH)
    return {"one_launch.points": str(len(x)), "one_launch.x": span(x),
            "one_launch.32_8_128": f"{num(fused['32/8/128'])} against {num(plain['32/8/128'])}"}


def _tune(src: Sources) -> dict[str, str]:
    """The measured launch table: the rule's launch kept at D = 80, 96 and 256, and the candidates it beat."""
    entries = src.json(LAUNCH_TABLE).get("entries")
    if not isinstance(entries, dict):
        raise ValueError(f"{LAUNCH_TABLE}: has no 'entries' object; expected fp8kv.bench.tune's launch table")
    v, kept, nxt = {}, [], []
    for d in (80, 96):
        e = entries[f"fp8/dequant/d{d}/m16"]
        claim(e["kept"] == "rule", f"the rule's launch kept at D = {d}", LAUNCH_TABLE)
        rows = ok_rows(src.csv(e["rows"], ["time_us", "block_n", "num_stages", "num_warps"]), e["rows"])
        rows = rows[(rows["batch"] == e["batch"]) & (rows["context"] == e["context"])].sort_values("time_us")
        claim(abs(rows["time_us"].iloc[0] - e["us"]) < 0.01, f"the kept launch is the fastest row at D = {d}", e["rows"])
        kept.append(f"D = {d} {num(e['us'], 0)} µs")
        nxt.append(num(rows["time_us"].iloc[1], 0))
    v["tune.kept"] = f"{', '.join(kept)}, the next best {' / '.join(nxt)} µs"
    e = entries["fp8/dequant/d256/m16"]
    claim(e["kept"] == "rule", "the rule's launch kept at D = 256", LAUNCH_TABLE)
    rows = ok_rows(src.csv(e["rows"], ["time_us", "block_n", "num_stages", "num_warps"]), e["rows"])
    at = rows[(rows["batch"] == e["batch"]) & (rows["context"] == e["context"])]
    best = at.sort_values("time_us").iloc[0]
    one = rows[(rows["batch"] == 256) & (rows["context"] == 4096)]
    same = (one["block_n"] == best["block_n"]) & (one["num_stages"] == best["num_stages"]) & (one["num_warps"] == best["num_warps"])
    cand, rule = one[same]["time_us"].iloc[0], one[~same]["time_us"].iloc[0]
    claim(best["time_us"] < e["us"] and cand > rule, "the D = 256 candidate faster at 64 × 16k, slower at 256 × 4k",
          e["rows"])
    v["tune.d256"] = (f"{int(best['block_n'])}-token tiles with {int(best['num_stages'])} stages were "
                      f"{pct(1 - best['time_us'] / e['us'])} % faster at 64 × 16k ({num(best['time_us'], 0)} against "
                      f"{num(e['us'], 0)} µs) but slower at 256 × 4k ({num(cand, 0)} against {num(rule, 0)} µs)")
    return v


def later(src: Sources) -> dict[str, str]:
    """The ``forced.*``, ``split_rule.*``, ``fill.*``, ``pdl.*``, ``one_launch.*`` and ``tune.*`` values."""
    v: dict[str, str] = {}
    for part in (_forced, _split_rules, _fill_waves, _pdl, _one_launch, _tune):
        v.update(part(src))
    return v
