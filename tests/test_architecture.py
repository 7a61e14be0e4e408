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
    ("pretrain.atomic_io", "pretrain.config", "pretrain.compat", "pretrain.notices", "pretrain.exit_signals"),
    ("parallel", "data_pipeline"),
    ("pretrain.model",),
    ("pretrain.optim",),
    ("pretrain.training",),
    ("pretrain.convert",),
    ("pretrain.tools", "pretrain.layout", "pretrain.train", "pretrain.curriculum", "pretrain.ablate", "pretrain.eval",
     "benchmarks"),
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


PRODUCT = ("pretrain", "parallel", "data_pipeline")


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_bindings(tree: ast.AST) -> Dict[str, str]:
    """Names a file binds to project modules: `import a.b as x` (x), `import a.b` (a), `from a import b` (b, when
    a.b is a module)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    out[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if _is_module(f"{node.module}.{a.name}"):
                    out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, bound: Dict[str, str]):
    """The module path an expression names (`x`, `x.y` through the file's module bindings), else None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, bound)
        if base is not None and _is_module(f"{base}.{node.attr}"):
            return f"{base}.{node.attr}"
    return None


def _product(module) -> bool:
    return module is not None and module.split(".")[0] in PRODUCT


def product_global_assignments(path: Path) -> List[str]:
    """`module.NAME = ...` (and augmented / tuple targets), `setattr(module, ...)` and `monkeypatch.setattr(module,
    "UPPER_NAME", ...)` where module is a product module (pretrain, parallel, data_pipeline): a knob set from outside
    the module that reads it. (monkeypatch.setattr of a function, a test's spy, is not a knob.)"""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = _module_bindings(tree)
    found = []

    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                yield from targets(elt)
        elif isinstance(node, ast.Attribute):
            yield node

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            attrs = [a for t in node.targets for a in targets(t)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            attrs = list(targets(node.target))
        else:
            attrs = []
        for a in attrs:
            module = _dotted(a.value, bound)
            if _product(module):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} assigns {module}.{a.attr}")
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            plain = isinstance(fn, ast.Name) and fn.id == "setattr"
            patch = isinstance(fn, ast.Attribute) and fn.attr == "setattr" and not plain
            module = _dotted(node.args[0], bound)
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else None
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) and patch:
                module, _, name = node.args[0].value.rpartition(".")  # monkeypatch.setattr("pkg.mod.NAME", value)
            knob = isinstance(name, str) and name.isupper()
            if _product(module) and (plain or (patch and knob)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} sets {module}.{name} through setattr")
    return found


# Globals that tests outside the DSA kernels still set on a product module (knobs, and functions swapped for fakes);
# each is to become an argument or a monkeypatch of a function, then leave this list. The test fails on any other
# assignment, and on an entry here that no longer occurs.
KNOWN_GLOBAL_ASSIGNMENTS = {
    "tests/test_checkpoint_files.py": {"pretrain.training.checkpoint.save_config"},
    "tests/test_context_parallel.py": {"parallel.activation_offload.MIN_OFFLOAD_BYTES"},
    "tests/test_curriculum_nodes.py": {"pretrain.curriculum.runner.VERDICT_TIMEOUT_S"},
    "tests/test_dsa_memory.py": {"pretrain.model.core_attention.sdpa_kernel"},
    "tests/test_ep_dispatch.py": {"pretrain.model.ep_dispatch.all_to_all"},
    "tests/test_gpu_ep_dispatch.py": {"pretrain.model.ep_dispatch.all_to_all"},
    "tests/test_gpu_training.py": {"parallel.activation_offload.MIN_OFFLOAD_BYTES"},
    "tests/test_memory_features.py": {"parallel.activation_offload.MIN_OFFLOAD_BYTES"},
    "tests/test_muon_training.py": {"pretrain.optim.roles.tp_group_of"},
}


def test_no_product_module_global_is_assigned_from_outside():
    """benchmarks/, lab/ and tests/ never assign a product module's global (`module.NAME = ...`, `setattr(module,
    ...)`, a test's `monkeypatch.setattr(module, "NAME", ...)` of an UPPER_CASE knob): a script or test that times or
    checks another choice passes it as an argument (for the DSA kernels, a `DSAKernelTuning`)."""
    found: Dict[str, Set[str]] = {}
    lines = []
    for folder in ("benchmarks", "lab", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for hit in product_global_assignments(path):
                rel = str(path.relative_to(ROOT))
                name = hit.split()[-1] if "assigns" in hit else hit.split()[2]
                found.setdefault(rel, set()).add(name)
                if name not in KNOWN_GLOBAL_ASSIGNMENTS.get(rel, set()):
                    lines.append(hit)
    assert not lines, "product module globals assigned from outside (pass an argument instead):\n" + "\n".join(lines)
    stale = {f: n - found.get(f, set()) for f, n in KNOWN_GLOBAL_ASSIGNMENTS.items() if n - found.get(f, set())}
    assert not stale, f"no longer assigned, remove from KNOWN_GLOBAL_ASSIGNMENTS: {stale}"


def test_dsa_kernels_import_nothing_of_dsa_outside_them():
    """pretrain/model/dsa/kernels/ imports only itself from pretrain.model.dsa (the reference, the layer and the
    backend build on the kernels, never the other way)."""
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if not name.startswith("pretrain.model.dsa.kernels"):
            continue
        for target, names, line in _imports(name, path):
            for reached in _resolve(target, names, modules):
                if reached.startswith("pretrain.model.dsa") and not (
                        reached == "pretrain.model.dsa.kernels" or reached.startswith("pretrain.model.dsa.kernels.")):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {reached}")
    assert not wrong, "the DSA kernels import their users:\n" + "\n".join(wrong)


def test_nothing_imports_the_lab():
    """lab/ may import pretrain and benchmarks; nothing imports lab (the library, the benchmarks, the product tests)."""
    wrong = []
    for folder in ("pretrain", "parallel", "data_pipeline", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                if any(n == "lab" or n.startswith("lab.") for n in names):
                    wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, "modules that import lab:\n" + "\n".join(wrong)
