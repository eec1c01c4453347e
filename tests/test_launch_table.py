"""The measured launch table (fp8kv.launch_table), its use by the decode launch, the tuning command that
writes it (fp8kv.bench.tune), and the option table (fp8kv.launch_options) every list of launch options comes from."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from fp8kv import launch_table, ops
from fp8kv.bench import tune
from fp8kv.cache import PagedKVCache
from fp8kv.launch_options import OPTIONS


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(launch_table, "TABLE_DIR", tmp_path)
    launch_table._load.cache_clear()
    yield tmp_path
    launch_table._load.cache_clear()


def test_write_merges_and_lookup_reads(table_dir):
    key = launch_table.entry_key(True, "dequant", 80, 16)
    assert key == "fp8/dequant/d80/m16"
    assert launch_table.lookup("gpu-a", True, "dequant", 80, 16) is None  # no table yet
    launch_table.write("gpu-a", {key: dict(block_n=256, num_warps=8, num_stages=3, us=1.0)}, {"written": "t0"})
    other = launch_table.entry_key(False, "dequant", 128, 64)
    launch_table.write("gpu-a", {other: dict(block_n=64, num_warps=4, num_stages=3)}, {"written": "t1"})
    assert launch_table.lookup("gpu-a", True, "dequant", 80, 16) == dict(block_n=256, num_warps=8, num_stages=3)
    assert launch_table.lookup("gpu-a", False, "dequant", 128, 64) == dict(block_n=64, num_warps=4, num_stages=3)
    assert launch_table.lookup("gpu-a", True, "dequant", 80, 32) is None  # another shape
    assert launch_table.lookup("gpu-b", True, "dequant", 80, 16) is None  # another GPU's table is its own
    assert launch_table.lookup(None, True, "dequant", 80, 16) is None
    doc = json.loads((table_dir / "launch_gpu-a.json").read_text())
    assert doc["gpu"] == "gpu-a" and doc["written"] == "t1" and set(doc["entries"]) == {key, other}
    assert not list(table_dir.glob("*.tmp"))


def test_a_broken_entry_is_refused_by_name(table_dir):
    (table_dir / "launch_gpu-a.json").write_text(json.dumps({"gpu": "gpu-a",
                                                             "entries": {"fp8/dequant/d64/m16": {"block_n": 0}}}))
    with pytest.raises(ValueError, match="fp8/dequant/d64/m16"):
        launch_table.lookup("gpu-a", True, "dequant", 64, 16)


KEY = "fp8/dequant/d128/m16"
GOOD = dict(block_n=64, num_warps=4, num_stages=2)


@pytest.mark.parametrize("text, match", [
    ('{"gpu": "gpu-a", "entries": {', "not valid JSON"),
    ("[]", "holds a JSON list"),
    ('{"gpu": "gpu-a"}', "'entries' is None; expected an object"),
    ('{"gpu": "gpu-a", "entries": []}', r"'entries' is \[\]; expected an object"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: 5}}), rf"entry '{KEY}' is 5 \(int\); expected an object"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "num_warps": True}}}), "num_warps=True"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "num_stages": 2.0}}}), "num_stages=2.0"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {"block_n": 64}}}), "num_warps=None, num_stages=None"),
    (json.dumps({"gpu": "nvidia-a100", "entries": {KEY: GOOD}}), "its gpu is 'nvidia-a100', but it was looked "
                                                                 "up for gpu 'gpu-a'"),
    (json.dumps({"entries": {KEY: GOOD}}), "its gpu is None"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "num_warps": 3}}}), r"num_warps=3; expected one of \(1, 2"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "block_n": 100}}}), "block_n=100; expected a power of two"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "block_n": 512}}}), "block_n=512; expected a power of two"),
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "num_stages": 99}}}), "num_stages=99; expected 1 to 8"),
    # tiles the tensor-core kernel refuses, and keys no lookup asks for: refused as the table is read
    (json.dumps({"gpu": "gpu-a", "entries": {KEY: {**GOOD, "block_n": 8}}}),
     rf"entry '{KEY}' has block_n=8; expected a power of two in \[16, 256\]"),
    (json.dumps({"gpu": "gpu-a", "entries": {"fp8/fp8/d128/m16": {**GOOD, "block_n": 16}}}),
     r"entry 'fp8/fp8/d128/m16' has block_n=16; expected a power of two in \[32, 256\]"),
    (json.dumps({"gpu": "gpu-a", "entries": {"FP8/dequant/d128/m16": GOOD, KEY: GOOD}}),
     r"entry 'FP8/dequant/d128/m16' is no shape key; expected one such as 'fp8/dequant/d128/m16'"),
    (json.dumps({"gpu": "gpu-a", "entries": {"fp8/dequant/d128/m24": GOOD}}), "'fp8/dequant/d128/m24' is no shape key"),
])
def test_a_corrupt_or_foreign_table_is_refused_naming_the_file(table_dir, text, match):
    path = table_dir / "launch_gpu-a.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        launch_table.lookup("gpu-a", True, "dequant", 128, 16)
    assert str(e.value).startswith(f"{path}: ")


def test_an_edited_table_is_read_again(table_dir):
    """The cache is keyed by the file's inode, mtime and size: an edit takes effect without write()."""
    import os

    path = table_dir / "launch_gpu-a.json"
    path.write_text(json.dumps({"gpu": "gpu-a", "entries": {KEY: GOOD}}))
    assert launch_table.lookup("gpu-a", True, "dequant", 128, 16) == GOOD
    edited = dict(block_n=32, num_warps=8, num_stages=3)  # same length of text: only the mtime tells
    path.write_text(json.dumps({"gpu": "gpu-a", "entries": {KEY: edited}}))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later edit, whatever the clock's tick
    assert launch_table.lookup("gpu-a", True, "dequant", 128, 16) == edited
    path.unlink()
    assert launch_table.lookup("gpu-a", True, "dequant", 128, 16) is None


def test_write_replaces_a_corrupt_or_foreign_table_with_a_warning(table_dir):
    path = table_dir / "launch_gpu-a.json"
    for text in ("{", json.dumps({"gpu": "gpu-b", "entries": {"old": GOOD}}), '{"gpu": "gpu-a", "entries": 3}'):
        path.write_text(text)
        with pytest.warns(UserWarning, match=f"{path}: .*replacing it with the new entries"):
            launch_table.write("gpu-a", {KEY: GOOD}, {})
        assert json.loads(path.read_text())["entries"] == {KEY: GOOD}
        assert launch_table.lookup("gpu-a", True, "dequant", 128, 16) == GOOD


def test_write_drops_invalid_old_entries_and_keeps_valid_ones(table_dir):
    path = table_dir / "launch_gpu-a.json"
    other = "16bit/dequant/d64/m16"
    path.write_text(json.dumps({"gpu": "gpu-a", "entries": {"junk": {"block_n": -1}, other: GOOD}}))
    with pytest.warns(UserWarning, match="dropping invalid entry 'junk'"):
        launch_table.write("gpu-a", {KEY: GOOD}, {})
    assert set(json.loads(path.read_text())["entries"]) == {KEY, other}


def test_write_refuses_an_invalid_new_entry_and_keeps_its_gpu(table_dir):
    with pytest.raises(ValueError, match=rf"entries\['{KEY}'\] needs positive ints .*num_warps=True"):
        launch_table.write("gpu-a", {KEY: {**GOOD, "num_warps": True}}, {})
    assert not (table_dir / "launch_gpu-a.json").exists()
    launch_table.write("gpu-a", {KEY: GOOD}, {"gpu": "gpu-b", "entries": {}, "written": "t0"})
    doc = json.loads((table_dir / "launch_gpu-a.json").read_text())
    assert doc["gpu"] == "gpu-a" and doc["entries"] == {KEY: GOOD} and doc["written"] == "t0"


def test_default_config_takes_the_table_on_its_gpu_only(table_dir, monkeypatch):
    rule = ops.default_config("dequant", True, 96)
    launch_table.write("gpu-a", {"fp8/dequant/d96/m16": dict(block_n=256, num_warps=8, num_stages=3)}, {})
    monkeypatch.setattr(ops.decode.splits, "interpreter_on", lambda: False)  # as on a GPU
    assert ops.default_config("dequant", True, 96, gpu="gpu-a") == dict(block_n=256, num_warps=8, num_stages=3)
    assert ops.default_config("dequant", True, 96, gpu="gpu-a", group_pad=64) == {**rule, "num_stages": 2}
    assert ops.default_config("dequant", True, 96) == {**rule, "num_stages": 2}  # no GPU named: the rule
    assert ops.default_config("dequant", True, 96, gpu="gpu-a", use_tensor_cores=False)["block_n"] == 32
    monkeypatch.setattr(ops.decode.splits, "interpreter_on", lambda: True)  # the interpreter keeps its one stage
    assert ops.default_config("dequant", True, 96, gpu="gpu-a") == ops.default_config("dequant", True, 96)
    assert ops.default_config("dequant", True, 96, gpu="gpu-a")["num_stages"] == 1


def test_launch_config_looks_up_the_launch_of_its_programs(table_dir, monkeypatch):
    """launch_config asks for the GPU of the cache and the padded rows the kernel will run with."""
    from fp8kv.synthetic import random_paged_cache

    seen = []
    monkeypatch.setattr(ops.decode.splits, "table_gpu", lambda device: "gpu-a")
    monkeypatch.setattr(launch_table, "lookup", lambda *a: seen.append(a) or None)
    monkeypatch.setattr(ops.decode.splits, "interpreter_on", lambda: False)
    cache = random_paged_cache(batch=1, context=40, num_kv_heads=1, head_dim=32, kv_dtype="fp8_e4m3", device="cpu")
    ops.launch_config(1, cache, group=71)  # latency-bound: two programs of 36 heads, 64 rows (128 asked first:
    ops.launch_config(1, cache, group=4)  # the tile one program of 71 would take decides whether it streams)
    ops.launch_config(1, cache, group=71, heads_per_program=24)  # three programs of 24: 32 rows
    assert seen == [("gpu-a", True, "dequant", 32, 128), ("gpu-a", True, "dequant", 32, 64),
                    ("gpu-a", True, "dequant", 32, 16), ("gpu-a", True, "dequant", 32, 32)]


def test_group_pad_matches_the_kernels_rows():
    assert [tune.group_pad(hq, hkv) for hq, hkv in ((32, 8), (32, 32), (71, 1), (48, 1), (40, 2))] == [16, 16, 64, 64,
                                                                                                      32]
    # at the tuning point (B = 64 x 16k, bandwidth-bound) Falcon's 71 heads at D = 64 are one program; at D = 128,
    # or latency-bound, two
    assert tune.group_pad(71, 1, 64) == 128
    assert tune.group_pad(71, 1, 64, (2, 4096)) == 64


def test_candidates_hold_the_rule_and_stay_in_range():
    for fp8, d in ((True, 64), (True, 256), (False, 128), (False, 64)):
        rule = ops.default_config("dequant", fp8, d)
        cands = tune.candidates(fp8, "dequant", d)
        assert rule in cands and len(cands) == len({tuple(c.values()) for c in cands})
        assert all(16 <= c["block_n"] <= ops.MAX_BLOCK_N and c["num_warps"] in (4, 8) for c in cands)
    assert min(c["block_n"] for c in tune.candidates(True, "fp8", 256)) >= 32


def _rows(times, statuses=None):
    launches = [(128, 4, 2), (256, 4, 2), (64, 8, 3)]
    return pd.DataFrame([dict(block_n=n, num_warps=w, num_stages=s, time_us=t, status=st, check_passed=st == "ok")
                         for (n, w, s), t, st in zip(launches, times, statuses or ["ok"] * 3, strict=True)])


def test_choose_replaces_the_rule_only_by_a_margin():
    rule = dict(block_n=128, num_warps=4, num_stages=2)
    assert tune.choose(_rows([100.0, 98.0, 99.0]), rule) is None  # 2 %: noise, the rule stays
    won = tune.choose(_rows([100.0, 90.0, 95.0]), rule)
    assert won == dict(block_n=256, num_warps=4, num_stages=2, us=90.0, rule_us=100.0)
    # a faster row that errored or failed its check is not a candidate
    assert tune.choose(_rows([100.0, 90.0, 80.0], ["ok", "error", "ok"]), rule)["block_n"] == 64
    failed = _rows([100.0, 90.0, 80.0])
    failed.loc[2, "check_passed"] = False
    assert tune.choose(failed, rule)["block_n"] == 256
    assert tune.choose(_rows([100.0, 90.0, 80.0], ["error", "ok", "ok"]), rule) is None  # nothing to compare


def test_the_command_writes_a_table_under_the_interpreter(tmp_path, monkeypatch):
    from fp8kv.capability import interpreter_on

    if not interpreter_on():
        pytest.skip("the command's CPU check runs under the Triton interpreter")
    launch_table._load.cache_clear()
    assert tune.main(["--interpret", "--table-dir", str(tmp_path), "--out", str(tmp_path / "rows"), "--quiet",
                      "--rep", "1"]) == 0
    doc = json.loads((tmp_path / "launch_cpu.json").read_text())
    (key, entry), = doc["entries"].items()
    assert key == "fp8/dequant/d32/m16" and entry["kept"] in ("rule", "measured") and entry["us"] > 0
    rows = pd.read_csv(next((tmp_path / "rows" / "cpu").glob("*.csv")))
    assert (rows["status"] == "ok").all() and rows["check_passed"].all()
    assert entry["rows"].endswith(".csv") and entry["torch"] == torch.__version__
    assert entry["command"].startswith("python -m fp8kv.bench.tune --interpret")
    # a 16-bit table too: a bf16 cache is timed with the bf16 queries it takes (not sweep's CPU default, fp16)
    assert tune.main(["--interpret", "--kv-dtypes", "bf16", "--table-dir", str(tmp_path), "--out", str(tmp_path / "rows"),
                      "--quiet", "--rep", "1"]) == 0
    assert "16bit/dequant/d32/m16" in json.loads((tmp_path / "launch_cpu.json").read_text())["entries"]


@pytest.mark.parametrize("argv,match", [(["--rep", "0"], "--rep"), (["--head-dims", "72"], "--head-dims"),
                                        (["--interpret"], "--table-dir")])
def test_the_command_refuses_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        tune.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_every_shipped_table_entry_is_its_saved_measurement():
    """Each entry of fp8kv/data/launch_<gpu>.json names the benchmark rows it was chosen from; the
    launch it holds was timed there, checked against the oracle, at the time it records."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tables = sorted(launch_table.TABLE_DIR.glob("launch_*.json"))
    assert tables, "the package ships at least one measured table"
    for path in tables:
        launch_table._load.cache_clear()
        gpu = path.stem.removeprefix("launch_")
        for key, e in json.loads(path.read_text())["entries"].items():
            kind, mode, d, m = key.split("/")
            assert launch_table.lookup(gpu, kind == "fp8", mode, int(d[1:]), int(m[1:])) == {
                k: e[k] for k in launch_table.LAUNCH_KEYS}
            rows = pd.read_csv(root / e["rows"])
            hq, hkv, d_ = e["shape"]
            mine = rows[(rows["block_n"] == e["block_n"]) & (rows["num_warps"] == e["num_warps"])
                        & (rows["num_stages"] == e["num_stages"]) & (rows["batch"] == e["batch"])
                        & (rows["context"] == e["context"]) & (rows["num_q_heads"] == hq)
                        & (rows["num_kv_heads"] == hkv) & (rows["head_dim"] == d_) & (rows["status"] == "ok")]
            assert mine["check_passed"].all() and len(mine), (path.name, key)
            assert round(float(mine["time_us"].min()), 2) == e["us"], (path.name, key)
            kv = "fp8_e4m3" if kind == "fp8" else "bf16"
            assert tune.group_pad(hq, hkv, d_, (e["batch"], e["context"]), kv_dtype=kv, mode=mode) == int(m[1:])
            assert d_ == int(d[1:])


def test_tune_refuses_two_formats_of_one_kind():
    with pytest.raises(ValueError, match="one FP8 format"):
        tune.tune(kv_dtypes=("fp8_e4m3", "fp8_e5m2"))


def test_tune_cli_refuses_two_formats_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        tune.main(["--interpret", "--kv-dtypes", "fp8_e4m3", "fp8_e5m2", "--table-dir", "/tmp"])
    assert exc.value.code == 2 and "--kv-dtypes=['fp8_e4m3', 'fp8_e5m2']: tune one FP8 format" in capsys.readouterr().err


def test_tune_writes_no_entry_where_nothing_ran(monkeypatch):
    """A shape where not even the rule's row ran and passed has no evidence: no "kept": "rule" entry."""
    def nothing_ran(cases, **kw):
        cases = list(cases)
        return pd.DataFrame([dict(block_n=c.options.get("block_n"), num_warps=c.options.get("num_warps"),
                                  num_stages=c.options.get("num_stages"), status="unsupported", check_passed=None,
                                  time_us=float("nan"), reason="not here") for c in cases])

    monkeypatch.setattr(tune, "run", nothing_ran)
    monkeypatch.setattr(tune, "choose", lambda rows, rule, margin: None)
    entries, rows = tune.tune([(4, 2, 32)], ("fp8_e4m3",), point=(2, 64), confirm=())
    assert entries == {} and (rows["status"] == "unsupported").all()


def _interrupted_at_the_second_run(monkeypatch):
    """tune's runs return ok rows; the second is cut by an interrupt (with keep_partial: rows marked so)."""
    calls = []

    def run(cases, keep_partial=False, **kw):
        cases = list(cases)
        calls.append(len(cases))
        if len(calls) == 2 and not keep_partial:
            raise KeyboardInterrupt
        rows = pd.DataFrame([dict(block_n=c.options.get("block_n"), num_warps=c.options.get("num_warps"),
                                  num_stages=c.options.get("num_stages"), status="ok", check_passed=True,
                                  time_us=100.0, reason="", timestamp="20261205T000000Z", gpu_slug="cpu", torch="t",
                                  triton="t")
                             for c in cases])
        rows.attrs["bench"] = {"interrupted": len(calls) == 2}
        return rows

    monkeypatch.setattr(tune, "run", run)
    monkeypatch.setattr(tune, "choose", lambda rows, rule, margin: None)
    return calls


def test_an_interrupted_tune_keeps_its_rows_and_the_shapes_it_finished(monkeypatch):
    calls = _interrupted_at_the_second_run(monkeypatch)
    with pytest.raises(KeyboardInterrupt):  # by default an interrupt stops the caller
        tune.tune([(4, 2, 32), (4, 2, 64), (4, 2, 128)], ("fp8_e4m3",), point=(2, 64), confirm=())
    calls.clear()
    entries, rows = tune.tune([(4, 2, 32), (4, 2, 64), (4, 2, 128)], ("fp8_e4m3",), point=(2, 64), confirm=(),
                              keep_partial=True)
    assert rows.attrs["tune"]["interrupted"] is True and len(calls) == 2  # nothing ran after the interrupt
    assert list(entries) == ["fp8/dequant/d32/m16"]  # the finished shape; none for the one cut short
    assert len(rows) == sum(calls)
    calls.clear()
    entries, rows = tune.tune([(4, 2, 32)], ("fp8_e4m3",), point=(2, 64), confirm=(), keep_partial=True)
    assert rows.attrs["tune"]["interrupted"] is False


def test_an_interrupt_between_runs_keeps_the_rows_too(monkeypatch):
    """Ctrl-C outside a run's measuring loop (choosing the winner, a copy-bandwidth timing): the rows timed
    before it come back all the same; with nothing timed yet, an empty table marked interrupted."""
    _interrupted_at_the_second_run(monkeypatch)

    def stopped(rows, rule, margin):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "choose", stopped)
    entries, rows = tune.tune([(4, 2, 32), (4, 2, 64)], ("fp8_e4m3",), point=(2, 64), confirm=(), keep_partial=True)
    assert rows.attrs["tune"]["interrupted"] is True and entries == {}
    assert len(rows) == len(tune.candidates(True, "dequant", 32)) and (rows["status"] == "ok").all()

    def stopped_at_once(cases, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "run", stopped_at_once)
    entries, rows = tune.tune([(4, 2, 32)], ("fp8_e4m3",), point=(2, 64), confirm=(), keep_partial=True)
    assert rows.empty and rows.attrs["tune"]["interrupted"] is True and entries == {}


def test_an_interrupted_tune_command_saves_the_rows_and_writes_no_table(tmp_path, monkeypatch, capsys):
    from fp8kv.capability import interpreter_on

    if not interpreter_on():
        pytest.skip("the command's CPU check runs under the Triton interpreter")
    calls = _interrupted_at_the_second_run(monkeypatch)
    code = tune.main(["--interpret", "--kv-dtypes", "fp8_e4m3", "bf16", "--table-dir", str(tmp_path),
                      "--out", str(tmp_path / "rows"), "--quiet", "--rep", "1"])
    assert code == 130 and "interrupted: the rows measured are in" in capsys.readouterr().err
    assert not (tmp_path / "launch_cpu.json").exists()
    (csv,) = (tmp_path / "rows" / "cpu").glob("*.csv")
    assert len(calls) == 2 and len(pd.read_csv(csv)) == sum(calls)  # both runs' rows, the cut one's too


# ------------------------------------------------------------------------------ the option table
def test_every_list_of_launch_options_is_the_option_tables():
    """The backends' accepted options, the bench's --triton-opt keys, the launch table's keys, the options
    fp8kv.ops.plan takes and those the Gluon kernel takes all come from fp8kv.launch_options.OPTIONS."""
    from fp8kv import launch_options
    from fp8kv.backends import LAUNCH_OPTIONS
    from fp8kv.bench.cli import TRITON_OPTIONS
    from fp8kv.capability import BACKEND_NAMES
    from fp8kv.ops.decode import planning

    table = launch_options.OPTIONS
    names = [o.name for o in table]
    assert len(names) == len(set(names))
    assert LAUNCH_OPTIONS == {b: tuple(o.name for o in table if b in o.backends) for b in BACKEND_NAMES}
    assert all(set(o.backends) <= set(BACKEND_NAMES) and o.backends for o in table)
    assert all(set(o.kernels) <= set(launch_options.KERNELS) and o.kernels for o in table)
    assert all(o.kind in ("int", "bool", "str", "dtype") and o.help for o in table)
    assert TRITON_OPTIONS == tuple(o.name for o in table if o.cli)
    assert all(o.kind in ("int", "bool") and "triton" in o.backends for o in table if o.cli)  # KEY=INT
    assert launch_table.LAUNCH_KEYS == tuple(o.name for o in table if o.tuned)
    assert set(ops.default_config("dequant", True, 128)) == set(launch_table.LAUNCH_KEYS)  # what an entry replaces
    assert planning.PLAN_OPTIONS == (*LAUNCH_OPTIONS["triton"], "window", "soft_cap", "sinks")
    assert planning.GLUON_OPTIONS == tuple(o.name for o in table if "gluon" in o.kernels)
    assert launch_table.check_range is launch_options.check_range and ops.MAX_BLOCK_N is launch_options.MAX_BLOCK_N


@pytest.mark.parametrize("name", [o.name for o in OPTIONS])
def test_each_option_of_the_table_reaches_the_triton_backend(name):
    """fp8kv.decode passes every Triton option of the table on, the plan takes it, and the bench CLI parses the
    CLI ones; a name outside the table is refused by name at both entries."""
    import argparse

    import fp8kv
    from fp8kv.bench.cli import TRITON_OPTIONS, _kv_opt
    from fp8kv.ops.decode import planning

    option = next(o for o in OPTIONS if o.name == name)
    assert name in planning.PLAN_OPTIONS
    if option.cli:
        assert _kv_opt(f"{name}=1")[0] == name
    else:
        assert name not in TRITON_OPTIONS
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=INT"):
            _kv_opt(f"{name}=1")
    cache = PagedKVCache.empty(1, 16, 1, 64)
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    for entry in (lambda: fp8kv.decode(q, cache, backend="triton", **{f"{name}_typo": 1}),
                  lambda: planning.plan(q, cache, **{f"{name}_typo": 1})):
        with pytest.raises(TypeError, match=f"{name}_typo=1 is not an option of the triton backend"):
            entry()


def test_tune_refuses_a_keep_partial_that_is_not_a_bool(monkeypatch):
    def nothing_may_run(cases, **kw):
        raise AssertionError("a run started before keep_partial was checked")

    monkeypatch.setattr(tune, "run", nothing_may_run)
    with pytest.raises(TypeError, match=r"keep_partial=1 \(int\); expected True or False"):
        tune.tune([(4, 2, 32)], ("fp8_e4m3",), point=(2, 64), confirm=(), keep_partial=1)
