"""The folders are the architecture: imports run one way, form no circle, and reach no private name.

Layers, lowest first; a module may import its own layer and the layers below it, never one above:

    0  pretrain.atomic_io, pretrain.config, pretrain.compat, pretrain.notices   (no project imports above them)
    1  parallel, data_pipeline
    2  pretrain.model                                          (the GLM-5 model, DSA, MTP, experts)
    3  pretrain.optim                                          (Muon, roles, ZeRO-2, builder)
    4  pretrain.training                                       (the loop, checkpoints, metrics)
    5  pretrain.convert                                        (Hugging Face <-> ours)
    6  pretrain.tools, pretrain.train, pretrain.curriculum, pretrain.ablate, pretrain.eval, benchmarks   (entry points)

Imports inside functions count too: a lazy import that runs back up is still a dependency. The
import graph is read from the source with `ast`, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pretrain", "parallel", "data_pipeline", "benchmarks")
LAYERS: List[Tuple[str, ...]] = [
    ("pretrain.atomic_io", "pretrain.config", "pretrain.compat", "pretrain.notices"),
    ("parallel", "data_pipeline"),
    ("pretrain.model",),
    ("pretrain.optim",),
    ("pretrain.training",),
    ("pretrain.convert",),
    ("pretrain.tools", "pretrain.train", "pretrain.curriculum", "pretrain.ablate", "pretrain.eval", "benchmarks"),
]


def _modules() -> Dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> List[Tuple[str, List[str], int]]:
    """(imported module, imported names, line) for every import of a project module in `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [a.name for a in node.names], node.lineno))
    return [f for f in found if f[0].split(".")[0] in PACKAGES]


def _layer(module: str) -> int:
    if module == "pretrain":  # the package's own __init__ (a docstring): below everything
        return 0
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")


def _resolve(target: str, names: List[str], modules: Dict[str, Path]) -> List[str]:
    """The project modules an import reaches (a `from pkg import submodule` reaches the submodule)."""
    out = [target] if target in modules else []
    out += [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    return out or [target]


def test_every_module_sits_in_a_layer_and_imports_run_downwards():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        for target, names, line in _imports(name, path):
            for reached in _resolve(target, names, modules):
                if _layer(reached) > _layer(name):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {reached} "
                                 f"(layer {_layer(reached)} > {_layer(name)})")
    assert not wrong, "imports running back up:\n" + "\n".join(wrong)


def test_no_import_circle_between_modules():
    modules = _modules()
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, names, _ in _imports(name, path):
            for reached in _resolve(target, names, modules):
                # A package importing its own submodules (re-exports in __init__) is not a circle.
                if reached in modules and reached != name and not reached.startswith(name + "."):
                    graph[name].add(reached)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        for target, names, line in _imports(name, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private and target != name:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {target}")
    assert not wrong, "private names imported across modules (make them public in one place):\n" + "\n".join(wrong)


def test_library_names_no_benchmark_or_lab_path():
    """pretrain/, parallel/ and data_pipeline/ neither import nor name `benchmarks/` or `lab/`: a docstring cites
    `docs/...` or the paper, and no library code reads a file or knob that lives with a benchmark or a probe."""
    import re

    path_ref = re.compile(r"benchmarks/|(?<![A-Za-z0-9_])lab/")
    import_ref = re.compile(r"^\s*(from|import)\s+(benchmarks|lab)\b")
    wrong = []
    for pkg in ("pretrain", "parallel", "data_pipeline"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if path_ref.search(line) or import_ref.search(line):
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not wrong, "library code names benchmarks/ or lab/ (cite docs/... instead):\n" + "\n".join(wrong)
