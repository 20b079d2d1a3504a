"""The package's module graph, read from the source with ``ast`` (nothing is imported).

* No import cycle among ``glm53flash_hf``'s modules, counting every import (module level and inside functions).
* The flat modules (the remote code a checkpoint carries) never import the sub-packages ``train`` / ``tools``, and
  use only the ``from .module import name`` form that transformers' remote-code loader follows.
* Per operator family, the ops module (the torch oracle and argument checks) is a leaf below both the module file
  and the fused file.
* The package top exports the public classes.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "glm53flash_hf"
FAMILIES = ("kda", "mhc", "dsa", "moe")


def _modules() -> dict[str, str]:
    """``{dotted module name: path}`` for every ``.py`` file of the package."""
    found = {}
    base = os.path.join(ROOT, PACKAGE)
    for folder, _, files in os.walk(base):
        if "__pycache__" in folder:
            continue
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(folder, name)
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import, known) -> set[str]:
    """The package modules one import statement of ``module`` loads (its targets, and for ``from X import name``
    the submodule ``X.name`` when that is a module)."""
    targets = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                targets.add(alias.name)
        return {t for t in targets if t in known}
    if node.level:
        parts = module.split(".")
        anchor = parts if is_package else parts[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    else:
        base = node.module or ""
        if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
            return set()
    for alias in node.names:
        if f"{base}.{alias.name}" in known:
            targets.add(f"{base}.{alias.name}")
        elif base in known:
            targets.add(base)
    return targets


def import_graph() -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package, from the AST of each file."""
    known = _modules()
    graph = {}
    for module, path in known.items():
        tree = ast.parse(open(path).read(), path)
        is_package = path.endswith("__init__.py")
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _resolve(module, is_package, node, known)
        edges.discard(module)
        # importing a.b.c runs a/__init__ and a/b/__init__ first: those are not edges of interest (the top
        # __init__ re-exports; it is never imported by the package's own modules)
        graph[module] = {e for e in edges if e != PACKAGE}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``None`` (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_cycle_finder_finds_planted_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": set(), "a": {"a2"}, "a2": {"a"}}) == ["a", "a2", "a"]


def test_resolver_sees_lazy_relative_imports():
    graph = import_graph()
    # dispatch-time imports inside functions count too (modeling imports checkpoint.load_pretrained lazily)
    assert f"{PACKAGE}.checkpoint" in graph[f"{PACKAGE}.modeling_glm53flash"]
    assert f"{PACKAGE}.modeling_glm53flash" in graph[f"{PACKAGE}.tools.make_tiny"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_flat_modules_do_not_import_subpackages():
    graph = import_graph()
    flat = [m for m in graph if m.count(".") == 1]
    assert f"{PACKAGE}.modeling_glm53flash" in flat
    for module in flat:
        bad = sorted(t for t in graph[module] if t.count(".") >= 2)
        assert not bad, f"{module} (remote code) imports sub-package modules {bad}"


def test_flat_modules_use_loader_followed_import_forms():
    """transformers' ``get_relative_import_files`` follows ``from .name import ...`` only."""
    for module, path in _modules().items():
        if module.count(".") != 1:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module, f"{path}:{node.lineno}: use 'from .module import name'"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_ops_module_is_a_leaf_below_module_and_fused_file(family):
    graph = import_graph()
    ops, mod, fused = (f"{PACKAGE}.{family}_ops", f"{PACKAGE}.{family}", f"{PACKAGE}.{family}_fused")
    assert {ops, mod, fused} <= set(graph), f"missing module among {ops}, {mod}, {fused}"
    assert ops in graph[mod] and ops in graph[fused]
    assert not graph[ops] & {mod, fused}, f"{ops} imports {sorted(graph[ops] & {mod, fused})}"


def test_package_top_exports_public_classes():
    import glm53flash_hf

    for name in ("Glm53FlashConfig", "Glm53FlashTextConfig", "Glm53FlashVisionConfig", "Glm53FlashModel",
                 "Glm53FlashForCausalLM", "Glm53FlashForConditionalGeneration", "Glm53FlashProcessor",
                 "Glm53FlashPackingCollator"):
        assert name in glm53flash_hf.__all__ and getattr(glm53flash_hf, name).__name__ == name
