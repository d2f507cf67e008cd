"""The package's import structure: the layers (folders) that fedrod_ray/__init__.py states, read from its
docstring, checked against every import of every module (module level, function level and
``TYPE_CHECKING`` alike), parsed with ``ast`` so that nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fedrod_ray"
ROOT = "fedrod_ray"
# api/, tune/ and flower/ as they install, and as the repository's folders
SERVICES = ("fedrod_ray_api", "fedrod_ray_tune", "fedrod_ray_flower", "api", "tune", "flower")

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The fedrod_ray modules that module ``name`` imports anywhere in its body."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import name`` imports the module pkg.name when there is one, else pkg itself.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names)
    return {m for m in found if m == ROOT or m.startswith(ROOT + ".") or m.split(".")[0] in SERVICES}


GRAPH = {name: _imports(name) for name in MODULES}


def _layers() -> dict[str, tuple[int, str]]:
    """Each name in the docstring's numbered list -> (its layer's number, the layer's title)."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    layers = {}
    for number, title, names in re.findall(r"^(\d+)\. ([^:\n]+): (.+)$", doc, re.MULTILINE):
        for item in names.split(","):
            layers[item.strip()] = (int(number), title)
    return layers


LAYERS = _layers()


def layer_of(module: str) -> tuple[int, str] | None:
    """A module's layer: that of its own name, or of the package it belongs to."""
    parts = module.split(".")[1:]
    for depth in range(len(parts), 0, -1):
        if ".".join(parts[:depth]) in LAYERS:
            return LAYERS[".".join(parts[:depth])]
    return None


def test_the_docstring_states_the_layers():
    numbers = [n for n, _ in sorted(set(LAYERS.values()))]
    assert len(numbers) > 1 and numbers == list(range(1, len(numbers) + 1)), LAYERS
    named = {f"{ROOT}.{n}" for n in LAYERS}
    assert not named - set(MODULES), f"layers name modules that do not exist: {sorted(named - set(MODULES))}"


TOP_LEVEL_MODULES = {"cli"}  # the one module outside a layer's folder: the command line


def test_the_layers_are_folders():
    """The layer list names folders (subpackages), and no module sits at the top but the few named here."""
    modules = {name for name in LAYERS if not (PACKAGE / name / "__init__.py").is_file()}
    assert modules == TOP_LEVEL_MODULES, f"the layer list names modules, not folders: {sorted(modules)}"
    flat = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert flat == TOP_LEVEL_MODULES, f"modules outside a layer's folder: {sorted(flat - TOP_LEVEL_MODULES)}"


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if m != ROOT and layer_of(m) is None]
    assert not missing, f"place these modules in a layer of fedrod_ray/__init__.py's docstring: {missing}"


def test_the_package_root_imports_nothing():
    assert GRAPH[ROOT] == set()


def test_the_library_never_imports_api_or_tune():
    bad = {m: sorted(t for t in targets if t.split(".")[0] in SERVICES) for m, targets in GRAPH.items()}
    assert not {m: t for m, t in bad.items() if t}


def test_imports_only_go_down():
    upward = []
    for module, targets in GRAPH.items():
        for target in targets:
            if module == ROOT or target == ROOT or target.split(".")[0] != ROOT:
                continue
            # A module without a layer fails test_every_module_has_a_layer.
            if None not in (layer_of(module), layer_of(target)) and layer_of(target) > layer_of(module):
                upward.append(f"{module} ({layer_of(module)[1]}) imports {target} ({layer_of(target)[1]})")
    assert not upward, "\n".join(upward)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_circle():
    circle = _cycle(GRAPH)
    assert circle is None, " -> ".join(circle)


def test_the_cycle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


ROUND_LOOP = sorted(name for name in MODULES if name.startswith("fedrod_ray.round_loop."))


@pytest.mark.parametrize("module", ROUND_LOOP)
def test_the_round_loop_knows_only_the_executor_protocol(module):
    executors = {t for t in GRAPH[module] if t.startswith("fedrod_ray.executors")}
    assert executors <= {"fedrod_ray.executors.base"}


def _protocol() -> set[str]:
    """The members ``Executor`` declares in executors/base.py: its methods and its capabilities."""
    tree = ast.parse(MODULES["fedrod_ray.executors.base"].read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Executor"]
    return ({n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            | {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)})


def _executor_calls(source: str) -> set[str]:
    """What ``source`` reads of an executor: every ``executor.X`` and ``self.executor.X``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "executor") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "executor"):
                found.add(node.attr)
    return found


@pytest.mark.parametrize("module", ROUND_LOOP)
def test_the_round_loop_calls_only_what_the_protocol_declares(module):
    source = MODULES[module].read_text()
    assert _executor_calls(source) <= _protocol(), sorted(_executor_calls(source) - _protocol())
    # It never asks which runtime it has (the runtimes say what they do by the protocol's capabilities).
    assert "at_sites" not in source and "sites" not in _executor_calls(source)


def test_the_protocol_check_finds_an_undeclared_call():
    calls = _executor_calls("def f(self, executor):\n    executor.site_evaluate(1)\n    self.executor.train(2)\n")
    assert calls == {"site_evaluate", "train"} and calls - _protocol() == {"site_evaluate"}


def test_the_executor_protocol_imports_no_executor():
    assert not {t for t in GRAPH["fedrod_ray.executors.base"] if t.startswith("fedrod_ray.executors")}
    assert GRAPH["fedrod_ray.executors"] == set()
