"""transformers' docstring-generator notes, printed while some releases define model classes, stay out of a model's
load (and so out of the rendered pages); every other line it prints comes through, also when the load fails."""

import pytest

from fp8kv.models import loading


def test_docstring_notes_are_dropped_and_other_lines_kept(capsys):
    with loading._without_docstring_notes():
        print("[ERROR] Config not found for transformers. You can manually add it to HARDCODED_CONFIG_FOR_MODELS")
        print("[ERROR] No checkpoint found for GenericForTokenClassification.forward. Please add a `checkpoint`")
        print("[ERROR] something else went wrong")
        print("loaded")
    assert capsys.readouterr().out == "[ERROR] something else went wrong\nloaded\n"
    with pytest.raises(RuntimeError), loading._without_docstring_notes():
        print("before the failure")
        raise RuntimeError("load failed")
    assert capsys.readouterr().out == "before the failure\n"


def test_load_model_runs_inside_the_filter(monkeypatch, capsys):
    def fake(name, dtype, device, attn_implementation):
        print("[ERROR] Config not found for transformers. You can manually add it")
        return "model", "tokenizer"

    monkeypatch.setattr(loading, "_load_model", fake)
    assert loading.load_model("smollm2-135m") == ("model", "tokenizer")
    assert capsys.readouterr().out == ""
