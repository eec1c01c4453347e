"""fp8kv's import graph, read from its own source (``ast``): the layers, and any arrow against them.

A unit is a module of ``fp8kv`` (``fp8kv/quant.py`` is ``quant``) or one of its subpackages whole
(``fp8kv/ops/**`` is ``ops``). An arrow ``a -> b`` means a module of ``a`` imports one of
``b``: *module-level* when the import runs as ``a`` is imported, *deferred* when it sits inside a
function (run on first use: optional dependencies, and a few calls upward that would otherwise
close a cycle). ``LAYERS`` lists the units from the bottom up; a unit may import only units of
its own layer and lower ones. The rules, checked by ``tests/test_architecture.py``:

* no cycle between modules, deferred imports included (but for those in ``DEFERRED_UPWARD``);
* no arrow from a lower layer to a higher one, except the deferred ones listed in ``DEFERRED_UPWARD``,
  each with its reason.

Run ``python scripts/import_graph.py`` to print the graph as Mermaid, ``--readme`` to write it into
README.md between its ``import-graph`` markers, ``--check`` to exit 1 on a broken rule.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "fp8kv"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
README = ROOT.parent / "README.md"
START, END = "<!-- import-graph:start -->", "<!-- import-graph:end -->"
COMMAND = "python scripts/import_graph.py --readme"

# Bottom up. Each unit imports only from its own layer and the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("formats", "checks", "interrupts", "launch_options", "launch_table", "rope"),  # facts, argument checks,
    # signal handling, the decode kernels' launch options and their measured values, RoPE: torch / stdlib only
    ("quant", "device", "kv_formats"),  # the quantizer; what machine this is; INT8 / INT4 / FP4 / block-scaled
    # KV storage formats beside FP8 (built on the quantizer)
    ("capability", "capability_attend", "capability_formats", "cache", "attend_checks"),  # what runs where (FP8 and
    # 16-bit; the attend's kernels per count of new tokens; the formats beside them); the paged cache; the
    # multi-token query checks
    ("reference", "synthetic"),  # the fp32 oracle; synthetic K/V and caches
    ("ops", "capacity", "capacity_registry"),  # fp8kv's kernels and their launchers (plan, run); the capacity
    # planner and the models and GPUs it knows
    ("backends",),  # fp8kv.decode and its backends
    ("models", "results", "sweeps", "viz"),  # real models; results IO; what measured sweeps share; figures
    ("bench", "matrix", "step", "analysis", "ui"),  # measurements behind the notebooks
    ("notebooks", "published"),  # the notebook runner; the README's results, generated from their files
    ("cli", "__init__", "__main__"),  # the front ends: the fp8kv command (also python -m fp8kv), the package's public names
)

# Deferred imports that point up a layer, and why each stays deferred rather than moved.
DEFERRED_UPWARD: dict[tuple[str, str], str] = {}


def unit_of(module: str) -> str:
    """``fp8kv.ops.copy`` -> ``ops``; ``fp8kv`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    """The fp8kv modules one import statement reaches."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE and alias.name in known]
    if node.level:
        base = importer.split(".") if is_package else importer.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != PACKAGE:
        return []
    reached = []
    for alias in node.names:  # ``from . import checks`` imports the module checks
        sub = f"{target}.{alias.name}"
        reached.append(sub if sub in known else target)
    return [m for m in dict.fromkeys(reached) if m in known]


def _deferred_lines(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside a function (run on first call, not at import)."""
    lines = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return lines


def module_edges(root: Path = ROOT) -> list[tuple[str, str, bool]]:
    """``(importer, imported, deferred)`` for every fp8kv-to-fp8kv import, between modules."""
    mods = modules(root)
    known = set(mods)
    edges = set()
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deferred = _deferred_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, path.name == "__init__.py", node, known):
                    if target != name:
                        edges.add((name, target, node.lineno in deferred))
    # an import both at module level and deferred counts as module-level
    eager = {(a, b) for a, b, d in edges if not d}
    return sorted((a, b, d) for a, b, d in edges if not (d and (a, b) in eager))


def unit_edges(root: Path = ROOT) -> dict[tuple[str, str], bool]:
    """Arrows between units: ``(a, b) -> deferred`` (False when any import of b by a is module-level)."""
    out: dict[tuple[str, str], bool] = {}
    for a, b, deferred in module_edges(root):
        ua, ub = unit_of(a), unit_of(b)
        if ua != ub:
            out[(ua, ub)] = out.get((ua, ub), True) and deferred
    return dict(sorted(out.items()))


def layer_of() -> dict[str, int]:
    return {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one node (each holds a cycle)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def problems(root: Path = ROOT) -> list[str]:
    """Every broken rule, one line each (empty when the graph is layered)."""
    found = []
    layer = layer_of()
    units = {unit_of(m) for m in modules(root)}
    for unit in sorted(units - set(layer)):
        found.append(f"unit {unit!r} is in no layer: add it to LAYERS in scripts/import_graph.py")
    edges = module_edges(root)
    for comp in cycles([(a, b) for a, b, d in edges if not d]):
        found.append(f"import cycle among {comp} (module-level imports)")
    listed = [(a, b) for a, b, d in edges if not (d and (unit_of(a), unit_of(b)) in DEFERRED_UPWARD)]
    for comp in cycles(listed):
        found.append(f"import cycle among {comp} (counting deferred imports)")
    for (a, b), deferred in unit_edges(root).items():
        if a not in layer or b not in layer or layer[a] >= layer[b]:  # downward, or within a layer
            continue
        if deferred and (a, b) in DEFERRED_UPWARD:
            continue
        kind = "deferred import" if deferred else "import"
        found.append(f"{kind} {a} -> {b} points up: {a} is layer {layer[a]}, {b} layer {layer[b]} (a unit "
                     "imports only its own layer and those below)")
    for a, b in DEFERRED_UPWARD:
        if unit_edges(root).get((a, b)) is not True:
            found.append(f"DEFERRED_UPWARD lists {a} -> {b}, which is no longer a deferred import: remove it")
    return found


def mermaid(root: Path = ROOT) -> str:
    """The unit graph as a Mermaid flowchart, one subgraph per layer (top layer first), deferred arrows dotted."""
    lines = ["flowchart TB"]
    present = {unit_of(m) for m in modules(root)}
    for i in reversed(range(len(LAYERS))):
        lines.append(f'  subgraph L{i}["layer {i}"]')
        lines.append("    direction LR")
        for unit in (u for u in LAYERS[i] if u in present):
            label = "fp8kv/__init__" if unit == "__init__" else unit
            lines.append(f'    {unit.strip("_") or "init"}["{label}"]')
        lines.append("  end")
    for (a, b), deferred in unit_edges(root).items():
        arrow = "-.->" if deferred else "-->"
        lines.append(f"  {a.strip('_')} {arrow} {b.strip('_')}")
    return "\n".join(lines)


def text(root: Path = ROOT) -> str:
    """The layers and each unit's arrows as plain text (deferred ones in parentheses)."""
    edges = unit_edges(root)
    out = []
    for i in reversed(range(len(LAYERS))):
        out.append(f"layer {i}")
        for unit in LAYERS[i]:
            eager = [b for (a, b), d in edges.items() if a == unit and not d]
            late = [b for (a, b), d in edges.items() if a == unit and d]
            arrows = ", ".join(eager) + (f" ({', '.join(late)})" if late else "")
            out.append(f"  {unit:<11} -> {arrows}" if arrows else f"  {unit}")
    return "\n".join(out)


def readme_block(root: Path = ROOT) -> str:
    """What README.md holds between its markers: the Mermaid graph and the command that makes it."""
    return (f"{START}\n```mermaid\n{mermaid(root)}\n```\n\nGenerated from the imports by `{COMMAND}` "
            "(dotted arrows: deferred imports, run on first use).\n" + END)


def write_readme(path: Path = README) -> bool:
    """Replace the block between the markers with :func:`readme_block`; True when it changed."""
    text_now = path.read_text(encoding="utf-8")
    start, end = text_now.index(START), text_now.index(END) + len(END)
    new = text_now[:start] + readme_block() + text_now[end:]
    path.write_text(new, encoding="utf-8")
    return new != text_now


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=("mermaid", "text"), default="mermaid")
    parser.add_argument("--check", action="store_true", help="exit 1 and list the broken rules, if any")
    parser.add_argument("--readme", action="store_true", help="write the Mermaid graph into README.md")
    args = parser.parse_args(argv)
    if args.readme:
        print(f"{README}: {'updated' if write_readme() else 'already current'}")
        return 0
    if args.check:
        broken = problems()
        for line in broken:
            print(line, file=sys.stderr)
        return 1 if broken else 0
    print(mermaid() if args.format == "mermaid" else text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
