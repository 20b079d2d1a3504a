"""The package's module graph, read from the source with ``ast`` (nothing is imported).

* No import cycle among ``glm53flash_hf``'s modules, counting every import (module level and inside functions).
* The flat modules (the remote code a checkpoint carries) never import the sub-packages ``train`` / ``tools``, and
  use only the ``from .module import name`` form that transformers' remote-code loader follows.
* Checkpoint I/O below the checks below the loader; no ``train`` module imports a ``tools`` one for FP8.
* The flat modules name nothing of sequence parallelism, expert parallelism or FSDP (:data:`PARALLEL_NAMES`).
* Per operator family, the ops module (the torch oracle and argument checks) is a leaf below both the module file
  and the fused file.
* The package top exports the public classes.
* fla-core's names that are not in its public API (no package ``__all__`` of fla lists them, or they start with an
  underscore) are imported only by the compatibility module ``glm53flash_hf/fla_compat.py``, which is the only package
  module importing fla at all; ``setup.cfg`` requires the fla-core range that module states.
* The scripts do not import from ``tests/`` (shared helpers live in ``scripts/_common.py`` and
  ``scripts/gpu_modules.py``, which the tests import).
"""

from __future__ import annotations

import ast
import configparser
import importlib.machinery
import importlib.metadata
import os

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "glm53flash_hf"
FAMILIES = ("kda", "mhc", "dsa", "moe")
FLA_COMPAT = os.path.join(ROOT, PACKAGE, "fla_compat.py")
SCRIPTS = os.path.join(ROOT, "scripts")
TESTS = os.path.join(ROOT, "tests")


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


# Names of sequence parallelism, expert parallelism and FSDP: none may appear in the flat modules (they are applied
# from outside, by glm53flash_hf.train). ``_is_expert_parallel`` is transformers' attribute on its experts interface,
# read, never set.
PARALLEL_NAMES = ("sequence_parallel", "SequenceParallel", "set_sequence_parallel", "sp_", "expert_parallel",
                  "ExpertParallel", "ExpertDispatcher", "fsdp", "FSDP", "fully_shard", "all_to_all", "all_gather",
                  "reduce_scatter", "all_reduce", "context_parallel", "fla_cp", "cp_context")
# names the flat modules may hold: transformers' own attribute (set by its ``use_experts_implementation``, read by the
# experts forward), and, in fla_compat.py only (the one module that imports fla), the binding of fla's
# context-parallel entry points that glm53flash_hf.train.sequence_parallel calls (fla's keyword ``cp_context``, None
# in the single-device calls)
ALLOWED_NAMES = {None: ("_is_expert_parallel",), "fla_compat.py": ("chunk_context_parallel", "cp_context")}


def parallel_names(source: str, module: str | None = None) -> list[str]:
    """``PARALLEL_NAMES`` found in ``source`` (as substrings of identifiers, strings and comments alike), without the
    ``ALLOWED_NAMES`` of every module and of ``module`` (a file name)."""
    text = source
    for allowed in ALLOWED_NAMES[None] + ALLOWED_NAMES.get(module, ()):
        text = text.replace(allowed, "")
    return sorted({name for name in PARALLEL_NAMES if name in text})


def test_parallel_name_finder_flags_planted_names():
    assert parallel_names("x = layout.sequence_parallel\nmoe.expert_parallel = d") == ["expert_parallel",
                                                                                       "sequence_parallel"]
    assert parallel_names("dist.all_gather(out, t)  # sp_chunk") == ["all_gather", "sp_"]
    assert parallel_names("from torch.distributed.fsdp import FSDPModule") == ["FSDP", "fsdp"]
    assert parallel_names("drop = getattr(self, '_is_expert_parallel', False)") == []
    assert parallel_names("fla(q=q, cp_context=None)") == ["cp_context"]
    assert parallel_names("fla(q=q, cp_context=None)", "fla_compat.py") == []
    assert parallel_names("def fla_cp_refusal(sp, device):", "fla_compat.py") == ["fla_cp"]


def test_flat_modules_carry_no_sequence_expert_or_fsdp_code():
    """The remote code a checkpoint carries knows nothing of SP, EP or FSDP: its layers expose extension points
    (``layout_builder``, ``DocumentLayout.shard``, ``token_dispatch``) that ``glm53flash_hf.train`` fills, and the VL
    forward asks only whether the tower's parameters are distributed tensors."""
    flat = [path for path in _modules().values() if os.path.dirname(path) == os.path.join(ROOT, PACKAGE)]
    assert os.path.join(ROOT, PACKAGE, "modeling_glm53flash.py") in flat
    for path in flat:
        found = parallel_names(open(path).read(), os.path.basename(path))
        assert not found, f"{path} (remote code) names {found}"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_ops_module_is_a_leaf_below_module_and_fused_file(family):
    graph = import_graph()
    ops, mod, fused = (f"{PACKAGE}.{family}_ops", f"{PACKAGE}.{family}", f"{PACKAGE}.{family}_fused")
    assert {ops, mod, fused} <= set(graph), f"missing module among {ops}, {mod}, {fused}"
    assert ops in graph[mod] and ops in graph[fused]
    assert not graph[ops] & {mod, fused}, f"{ops} imports {sorted(graph[ops] & {mod, fused})}"


def test_checkpoint_layers():
    """Checkpoint I/O is a leaf, the checks import it (and the config), and neither imports the conversions and
    loader above them; the FP8 quantizer is a flat module that the tools and ``train`` import, not a tool that
    ``train`` reaches up to."""
    graph = import_graph()
    io, checks, loader = (f"{PACKAGE}.checkpoint_io", f"{PACKAGE}.checkpoint_checks", f"{PACKAGE}.checkpoint")
    assert graph[io] == set(), sorted(graph[io])
    assert io in graph[checks] and loader not in graph[checks], sorted(graph[checks])
    assert {io, checks} <= graph[loader]
    assert f"{PACKAGE}.fp8_blockwise" in graph[f"{PACKAGE}.train.fp8_lora"]
    assert not {m for m in graph[f"{PACKAGE}.train.fp8_lora"] if m.startswith(f"{PACKAGE}.tools")}


def test_package_top_exports_public_classes():
    import glm53flash_hf

    for name in ("Glm53FlashConfig", "Glm53FlashTextConfig", "Glm53FlashVisionConfig", "Glm53FlashModel",
                 "Glm53FlashForCausalLM", "Glm53FlashForConditionalGeneration", "Glm53FlashProcessor",
                 "Glm53FlashPackingCollator"):
        assert name in glm53flash_hf.__all__ and getattr(glm53flash_hf, name).__name__ == name


# ------------------------------------------------------------------------------------------------------ fla-core use
def fla_public_api() -> dict[str, set[str]]:
    """``{fla package: the names of its __all__}`` for every package of the installed fla-core that lists a literal
    ``__all__`` (read from the source; fla is not imported)."""
    spec = importlib.machinery.PathFinder.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (its public API is read from its source)")
    root = list(spec.submodule_search_locations)[0]
    api = {"fla": set()}
    for folder, _, files in os.walk(root):
        if "__init__.py" not in files:
            continue
        package = ".".join(["fla"] + os.path.relpath(folder, root).split(os.sep)).removesuffix(".")
        tree = ast.parse(open(os.path.join(folder, "__init__.py")).read())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else getattr(
                node, "target", None)
            if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
                try:
                    api[package] = set(ast.literal_eval(node.value))
                except ValueError:
                    pass
    return api


def private_fla_imports(source: str, api: dict[str, set[str]]) -> list[str]:
    """The imports in ``source`` of fla modules or names outside ``api`` (:func:`fla_public_api`): ``import X`` of an
    fla module that is not a public package, ``from X import n`` where ``n`` is not in package ``X``'s ``__all__``,
    or any underscore name."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.name == "fla" or alias.name.startswith("fla.")) and alias.name not in api:
                    bad.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module == "fla" or node.module.startswith("fla."):
                for alias in node.names:
                    public = api.get(node.module, set())
                    if alias.name.startswith("_") or "._" in node.module or alias.name not in public:
                        bad.append(f"line {node.lineno}: from {node.module} import {alias.name}")
    return bad


def imports_fla(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "fla" or n.startswith("fla.") for n in names):
            return True
    return False


def _python_files(*folders: str) -> list[str]:
    return sorted(os.path.join(folder, name) for base in folders for folder, _, files in os.walk(base)
                  if "__pycache__" not in folder for name in files if name.endswith(".py"))


def test_private_fla_import_finder_flags_planted_imports():
    api = {"fla": set(), "fla.ops.kda": {"chunk_kda", "fused_recurrent_kda"}, "fla.ops.cp": {"build_cp_context"}}
    source = """
from fla.ops.kda import chunk_kda
from fla.ops.kda.chunk_fwd import chunk_kda_fwd
from fla.ops.cp import context, build_cp_context
import fla.ops.kda
import fla.ops.kda.chunk_intra
def f():
    from fla.ops.kda import _private
"""
    assert private_fla_imports(source, api) == [
        "line 3: from fla.ops.kda.chunk_fwd import chunk_kda_fwd", "line 4: from fla.ops.cp import context",
        "line 6: import fla.ops.kda.chunk_intra", "line 8: from fla.ops.kda import _private"]
    assert imports_fla(source) and not imports_fla("import flask\nfrom .fla_compat import load")


def test_private_fla_names_only_in_the_compatibility_module():
    """Every module of the package and every script: no import of fla internals outside ``fla_compat.py``, and no
    package module but ``fla_compat.py`` imports fla at all. ``fla_compat.py`` itself does import fla internals."""
    api = fla_public_api()
    assert {"chunk_kda", "fused_recurrent_kda"} <= api["fla.ops.kda"], "fla's public API was not read"
    compat_source = open(FLA_COMPAT).read()
    assert private_fla_imports(compat_source, api), "fla_compat.py imports no fla internals: the check reads nothing"
    for path in _python_files(os.path.join(ROOT, PACKAGE), SCRIPTS):
        if path == FLA_COMPAT:
            continue
        source = open(path).read()
        assert not private_fla_imports(source, api), (path, private_fla_imports(source, api))
        if path.startswith(os.path.join(ROOT, PACKAGE) + os.sep):
            assert not imports_fla(source), f"{path} imports fla; import it through {PACKAGE}.fla_compat"


def test_setup_cfg_requires_the_checked_fla_range():
    """``setup.cfg``'s ``gpu`` and ``test`` extras require ``fla-core`` in ``fla_compat.FLA_REQUIREMENT``; the
    releases in ``FLA_CHECKED`` lie in it, and the installed fla-core (which the interpreter tests run) is one of
    them."""
    from glm53flash_hf import fla_compat

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    for extra in ("gpu", "test"):
        lines = [line for line in cfg["options.extras_require"][extra].splitlines() if line.startswith("fla-core")]
        assert len(lines) == 1, (extra, lines)
        assert Requirement(lines[0]).specifier == SpecifierSet(fla_compat.FLA_REQUIREMENT), (extra, lines[0])
    wanted = SpecifierSet(fla_compat.FLA_REQUIREMENT)
    assert fla_compat.FLA_CHECKED and all(v in wanted for v in fla_compat.FLA_CHECKED)
    try:
        installed = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("fla-core is not installed")
    assert installed in fla_compat.FLA_CHECKED, (
        f"installed fla-core {installed} is not in fla_compat.FLA_CHECKED {fla_compat.FLA_CHECKED}: run the "
        "interpreter tests (tests/test_kda_fused_numerics.py) against it, then add it")


def test_importing_the_compatibility_module_does_not_import_fla():
    """``fla_compat`` imports fla only inside ``try`` blocks of functions (transformers' remote-code import check skips
    ``try`` blocks; CPU runs never import fla)."""
    tree = ast.parse(open(FLA_COMPAT).read())
    assert imports_fla(ast.unparse(tree))
    inside_try = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and imports_fla(ast.unparse(node)):
            assert id(node) in inside_try, f"fla_compat.py:{node.lineno}: fla imported outside a try block"


# ------------------------------------------------------------------------------------------------------------ scripts
def test_scripts_do_not_import_tests():
    """No script puts ``tests/`` on ``sys.path`` or imports a module that exists only in ``tests/``."""
    test_modules = {name[:-3] for name in os.listdir(TESTS) if name.endswith(".py")}
    script_modules = {name[:-3] for name in os.listdir(SCRIPTS) if name.endswith(".py")}
    only_tests = test_modules - script_modules
    assert {"tiny", "ckpt_fixtures", "interp"} <= only_tests
    for path in _python_files(SCRIPTS):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and "sys.path" in ast.unparse(
                    node.func.value):
                consts = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                assert "tests" not in consts, f"{path}:{node.lineno}: puts tests/ on sys.path"
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for name in names:
                assert name.split(".")[0] not in only_tests | {"tests"}, f"{path}:{node.lineno}: imports {name}"


# test files whose code runs in child processes that start from a bare sys.path (workers, scripts passed to python -c)
CHILD_PROCESS_FILES = ("sp_worker.py", "ep_worker.py", "fsdp2_worker.py", "mp_launch.py", "test_checkpoint_save.py",
                       "test_processing.py")


def _path_inserts(path: str) -> list[int]:
    """Line numbers of ``sys.path.insert`` / ``sys.path.append`` / ``sys.path[...] =`` in the file at ``path``."""
    lines = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ast.unparse(
                node.func.value) == "sys.path":
            lines.append(node.lineno)
        elif isinstance(node, ast.Assign) and any("sys.path" in ast.unparse(t) for t in node.targets):
            lines.append(node.lineno)
    return lines


def test_shared_helpers_are_found_without_path_edits():
    """Tests and scripts find the shared helpers (``scripts/_common.py``, ``scripts/gpu_modules.py``) and the package
    without editing ``sys.path``: a script's own folder is ``sys.path[0]``, pytest adds ``scripts/`` from
    ``pythonpath`` in pyproject.toml, the package is installed. The exceptions: the one-off investigations under
    ``scripts/investigations/`` (one line each, to reach the benchmarks' helpers one folder up), the code the tests
    run in child processes (:data:`CHILD_PROCESS_FILES`) and transformers' own test folder (``test_hf_common.py``)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'pythonpath = ["scripts", "scripts/investigations"]' in f.read()
    files = [os.path.join(folder, n) for folder in (SCRIPTS, TESTS) for n in sorted(os.listdir(folder))
             if n.endswith(".py") and n not in CHILD_PROCESS_FILES + ("test_hf_common.py",)]
    edits = {path: lines for path in files if (lines := _path_inserts(path))}
    assert not edits, edits
    for path in _python_files(os.path.join(SCRIPTS, "investigations")):
        assert len(_path_inserts(path)) <= 1, path
