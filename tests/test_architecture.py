"""The import graph of fp8kv (scripts/import_graph.py): layered, without cycles, drawn in the README; every
module of fp8kv small and using only the public names of the others; one home for the interpreter switch and the
default softmax scale; and the op package fp8kv.ops: small modules, private names kept private, each public name defined once."""

from __future__ import annotations

import ast
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


# ---------------------------------------------------------------------------- the op package, fp8kv.ops
OPS = REPO / "fp8kv" / "ops"
MAX_OPS_MODULE_LINES = 500  # one job a module: a module that outgrows this holds two


def _ops_modules(graph) -> dict[str, Path]:
    return {name: path for name, path in graph.modules().items() if name == "fp8kv.ops" or name.startswith("fp8kv.ops.")}


MAX_MODULE_LINES = 500  # the same limit for every module of fp8kv


def _package_modules() -> dict[str, Path]:
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.modules()


def test_every_module_of_fp8kv_stays_small():
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _package_modules().items()}
    assert len(sizes) > 50, sorted(sizes)  # the package was found
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_every_ops_module_stays_small(graph):
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in _ops_modules(graph).items()}
    assert len(sizes) > 10, sorted(sizes)  # the package was found
    assert {name: n for name, n in sizes.items() if n > MAX_OPS_MODULE_LINES} == {}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _within(module: str, scope: str) -> bool:
    return module == scope or module.startswith(scope + ".")


def private_reach(path: Path, importer: str, known: set[str], scope: str = "fp8kv") -> list[str]:
    """Where the file at ``path`` (module ``importer``; "" outside the package) uses a private name of a
    module under ``scope`` other than its own: imported by name, read as an attribute of the module, or set on
    it by ``setattr`` / ``monkeypatch.setattr``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    aliases: dict[str, str] = {}  # a local name -> the fp8kv module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fp8kv":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "fp8kv"
        elif isinstance(node, ast.ImportFrom):
            module = _module_of(importer, is_package, node)
            if not module.startswith("fp8kv"):
                continue
            for a in node.names:
                if f"{module}.{a.name}" in known:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
                elif _is_private(a.name) and _within(module, scope) and module != importer:
                    found.append(f"{path.name}:{node.lineno} imports {a.name} from {module}")

    def module_and_rest(expr) -> tuple[str, list[str]] | None:
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in aliases:
            return None
        module, rest = aliases[expr.id], parts[::-1]
        while rest and f"{module}.{rest[0]}" in known:
            module = f"{module}.{rest.pop(0)}"
        return module, rest

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            hit = module_and_rest(node)
            if hit and _within(hit[0], scope) and hit[0] != importer and hit[1] == [node.attr]:
                found.append(f"{path.name}:{node.lineno} reads {hit[0]}.{node.attr}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                isinstance(node.args[1].value, str) and _is_private(node.args[1].value) and \
                (getattr(node.func, "id", None) == "setattr" or getattr(node.func, "attr", None) == "setattr"):
            hit = module_and_rest(node.args[0])
            if hit and _within(hit[0], scope) and not hit[1] and hit[0] != importer:
                found.append(f"{path.name}:{node.lineno} sets {hit[0]}.{node.args[1].value}")
    return sorted(found, key=lambda line: int(line.split(" ")[0].split(":")[1]))


def test_no_module_reaches_a_private_name_of_an_ops_module(graph):
    """A name with a leading underscore is its module's own: the package, the tests and the scripts use the
    public names of fp8kv.ops (a private one reached from outside is a public one to name so)."""
    mods = graph.modules()
    known = set(mods)
    files = {path: name for name, path in mods.items()}
    files.update({p: "" for folder in ("tests", "scripts") for p in sorted((REPO / folder).rglob("*.py"))})
    found = [line for path, name in files.items() for line in private_reach(path, name, known, "fp8kv.ops")]
    assert found == []


def _reached(line: str) -> str:
    """The dotted private name a :func:`private_reach` line names."""
    if " imports " in line:
        name, module = line.split(" imports ", 1)[1].split(" from ")
        return f"{module}.{name}"
    return line.rsplit(" ", 1)[1]


def test_no_module_of_fp8kv_reaches_a_private_name_of_another():
    """Across the whole package: a module uses the public names of the others."""
    mods = _package_modules()
    known = set(mods)
    found = {name: sorted({_reached(line) for line in private_reach(path, name, known)}) for name, path in mods.items()}
    assert {name: reached for name, reached in found.items() if reached} == {}


def test_the_private_reach_check_finds_each_kind_of_reach(graph, tmp_path):
    known = set(graph.modules())
    probe = tmp_path / "probe.py"
    probe.write_text("from fp8kv import ops\nfrom fp8kv.ops.decode import splits\nimport fp8kv\n"
                     "from fp8kv.ops.decode.splits import _bandwidth_splits\n"
                     "ops.decode.splits._RESIDENCY\nsplits._RESIDENCY.clear()\nfp8kv.ops.decode.combine._x\n"
                     "monkeypatch.setattr(ops.decode.splits, '_RESIDENCY', {})\nsetattr(splits, '_y', 1)\n"
                     "ops.decode.splits.sm_count\nops.__all__\n")
    found = private_reach(probe, "", known, "fp8kv.ops")
    assert [line.split(" ", 1)[0] for line in found] == [f"probe.py:{n}" for n in (4, 5, 6, 7, 8, 9)], found
    assert [_reached(line) for line in found] == [
        "fp8kv.ops.decode.splits._bandwidth_splits", "fp8kv.ops.decode.splits._RESIDENCY",
        "fp8kv.ops.decode.splits._RESIDENCY", "fp8kv.ops.decode.combine._x", "fp8kv.ops.decode.splits._RESIDENCY",
        "fp8kv.ops.decode.splits._y"]
    wider = tmp_path / "wider.py"  # the whole package: any module's private name, its own module's excepted
    wider.write_text("from fp8kv.quant import _compute_scale\nfrom fp8kv import checks\nchecks._show(1)\n"
                     "from fp8kv.step import plan\nplan._private\n")
    assert [_reached(line) for line in private_reach(wider, "", known)] == \
        ["fp8kv.quant._compute_scale", "fp8kv.checks._show", "fp8kv.step.plan._private"]
    assert [_reached(line) for line in private_reach(wider, "fp8kv.quant", known)] == \
        ["fp8kv.checks._show", "fp8kv.step.plan._private"]


def _top_level_definitions(path: Path) -> set[str]:
    """The public names a module defines (functions, classes, assignments), not those it imports."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return {n for n in names if not n.startswith("_")}


def test_each_public_name_of_the_ops_package_is_defined_once(graph):
    """fp8kv.ops re-exports its names; each is defined in one module (a second definition is a second
    home, which drifts from the first)."""
    homes: dict[str, list[str]] = {}
    for name, path in _ops_modules(graph).items():
        for defined in _top_level_definitions(path):
            homes.setdefault(defined, []).append(name)
    assert {n: m for n, m in homes.items() if len(m) > 1} == {}
    import fp8kv.ops

    everywhere = set().union(*(_top_level_definitions(p) for p in _ops_modules(graph).values()))
    assert set(fp8kv.ops.__all__) <= everywhere | {"WARP_COUNTS", "MAX_BLOCK_N"}  # those two: fp8kv.launch_options


# ---------------------------------------------------------------------------- one home for a rule
PACKAGE_FILES = sorted((REPO / "fp8kv").rglob("*.py"))


def _constant(node):
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    return node.value if isinstance(node, ast.Constant) else None


def interpreter_switches(path: Path) -> list[int]:
    """The lines of ``path`` that set the Triton interpreter's variable (TRITON_INTERPRET, or the name
    INTERPRETER_ENV that holds it): an item assigned, a ``setdefault`` / ``putenv`` / ``setenv`` call, a
    dict literal's key or a ``dict(...)`` keyword."""
    def names_it(node) -> bool:
        return _constant(node) == "TRITON_INTERPRET" or getattr(node, "id", None) == "INTERPRETER_ENV" or \
            getattr(node, "attr", None) == "INTERPRETER_ENV"

    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Subscript) and names_it(t.slice) for t in targets):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in \
                ("setdefault", "putenv", "setenv") and node.args and names_it(node.args[0]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and names_it(k) for k in node.keys):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and any(k.arg == "TRITON_INTERPRET" for k in node.keywords):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_interpreter_is_switched_on_in_one_place():
    """fp8kv.capability.use_interpreter sets TRITON_INTERPRET, for this process or a child's environment;
    the commands, the notebooks, their runner and the root conftest call it."""
    found = {str(p.relative_to(REPO)): lines for p in [*PACKAGE_FILES, REPO / "conftest.py"]
             if (lines := interpreter_switches(p))}
    assert set(found) == {"fp8kv/capability.py"}, found


def test_the_interpreter_switch_check_finds_each_kind_of_setting(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nos.environ['TRITON_INTERPRET'] = '1'\nos.environ.setdefault('TRITON_INTERPRET', '1')\n"
                     "env = {**os.environ, 'TRITON_INTERPRET': '1'}\nenv = dict(os.environ, TRITON_INTERPRET='1')\n"
                     "os.environ[INTERPRETER_ENV] = '1'\nmonkeypatch.setenv(capability.INTERPRETER_ENV, '1')\n"
                     "os.environ.get('TRITON_INTERPRET')\n")
    assert interpreter_switches(probe) == [2, 3, 4, 5, 6, 7]


def softmax_scale_defaults(path: Path) -> list[int]:
    """The lines of ``path`` that compute a softmax scale's default: ``1 / sqrt(...)`` or ``... ** -0.5``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.BinOp):
            continue
        right = node.right
        is_sqrt = isinstance(right, ast.Call) and "sqrt" in (getattr(right.func, "attr", None),
                                                             getattr(right.func, "id", None))
        if isinstance(node.op, ast.Div) and _constant(node.left) == 1 and is_sqrt or \
                isinstance(node.op, ast.Pow) and _constant(right) == -0.5:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_default_softmax_scale_is_computed_in_one_place():
    """fp8kv.checks.resolved_softmax_scale is the one home of ``1 / sqrt(head_dim)``."""
    found = {str(p.relative_to(REPO)): lines for p in PACKAGE_FILES if (lines := softmax_scale_defaults(p))}
    assert set(found) == {"fp8kv/checks.py"}, found
    assert len(found["fp8kv/checks.py"]) == 1, found


def test_the_softmax_default_check_finds_each_spelling(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import math\nx = 1.0 / math.sqrt(d)\nx = 1 / sqrt(d)\nx = d ** -0.5\nx = 2 / math.sqrt(d)\n"
                     "x = torch.rsqrt(d)\nx = a / math.sqrt(d)\nx = 1 / torch.sqrt(t)\n")
    assert softmax_scale_defaults(probe) == [2, 3, 4, 8]


TESTS = REPO / "tests"


def fixture_names(path: Path = TESTS / "fixtures.py") -> set[str]:
    """The public names the fixture module defines at its top level: functions and constants."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def redefinitions(path: Path, names: set[str]) -> list[str]:
    """``name:line`` for each function (at any depth) or module-level assignment in ``path`` named like one of ``names``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [(n.name, n.lineno) for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names]
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        found += [(t.id, node.lineno) for t in targets if isinstance(t, ast.Name) and t.id in names]
    return [f"{name}:{line}" for name, line in sorted(found, key=lambda f: f[1])]


def test_test_data_has_one_home():
    """tests/fixtures.py is the one home of the tests' caches, queries, seeded generators, device and dequant
    tolerance: no other test module defines a name it defines (they import it)."""
    names = fixture_names()
    assert {"seeded", "make_cache", "make_q", "DEVICE"} <= names
    found = {p.name: lines for p in sorted(TESTS.glob("*.py")) if p.name != "fixtures.py"
             if (lines := redefinitions(p, names))}
    assert found == {}, found


def test_the_one_home_check_finds_each_kind_of_redefinition(tmp_path):
    home = tmp_path / "fixtures.py"
    home.write_text("DEVICE = 'cpu'\nLIMIT: int = 3\n_PRIVATE = 1\ndef make_q(): ...\ndef _inner(): ...\n")
    assert fixture_names(home) == {"DEVICE", "LIMIT", "make_q"}
    probe = tmp_path / "test_probe.py"
    probe.write_text("DEVICE = 'cuda'\nLIMIT: int = 4\ndef make_q(): ...\ndef test_x():\n    def make_q(): ...\n"
                     "def _inner(): ...\nmake_q_too = 1\n")
    assert redefinitions(probe, fixture_names(home)) == ["DEVICE:1", "LIMIT:2", "make_q:3", "make_q:5"]
