"""The import graph of fp8kv (scripts/import_graph.py): layered, without cycles, drawn in the README."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fp8kv_imports_form_layers_without_cycles(graph):
    assert graph.problems() == []


def test_every_unit_has_one_layer(graph):
    units = [u for layer in graph.LAYERS for u in layer]
    assert len(units) == len(set(units))
    assert {graph.unit_of(m) for m in graph.modules()} <= set(units)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "fp8kv"
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root


def test_a_cycle_through_a_deferred_import_is_caught(graph, tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "notebooks.py": "def main():\n    from .cli import main\n",
        "cli.py": "from . import notebooks\n",
    })
    found = graph.problems(root)
    assert "import cycle among ['fp8kv.cli', 'fp8kv.notebooks'] (counting deferred imports)" in found
    assert any(line.startswith("deferred import notebooks -> cli points up") for line in found)


def test_a_module_level_cycle_and_an_upward_import_are_caught(graph, tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "formats.py": "from fp8kv.ops.copy import copy_kernel\n",
        "ops/__init__.py": "",
        "ops/copy.py": "from ..formats import FORMATS\n",
        "mystery.py": "import fp8kv.formats\n",
    })
    found = graph.problems(root)
    assert "import cycle among ['fp8kv.formats', 'fp8kv.ops.copy'] (module-level imports)" in found
    assert any(line.startswith("import formats -> ops points up") for line in found)
    assert any("unit 'mystery' is in no layer" in line for line in found)
    assert graph.unit_edges(root) == {("formats", "ops"): False, ("ops", "formats"): False,
                                      ("mystery", "formats"): False}


def test_readme_holds_the_current_graph(graph):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert graph.readme_block() in readme, f"README's import graph is stale: run {graph.COMMAND}"
