"""The package's folders and the directions they may import in, read from the code's own imports (ast).

Every import of a ``relax_services`` module counts, wherever it stands (module level, inside a function, under
``TYPE_CHECKING``): a lazy import is still a dependency. The light rule counts what runs when a module is imported:
module-level imports outside ``TYPE_CHECKING``, followed through the package's own modules (importing
``relax_services.a.b`` runs ``relax_services/a/__init__.py`` too).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "relax_services"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE

FACE = "__init__"
"""The package's ``__init__``: its lazy table names every public module."""
HELPERS = frozenset({"_lazy", "_files", "_malloc"})
"""The root's small private helpers (standard library only): every layer may use them."""

ALLOWED: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "weights": frozenset(),
    "rows": frozenset(),
    "models": frozenset({"config"}),
    "reporting": frozenset({"config"}),
    "data": frozenset({"config", "models", "rows"}),
    "engines": frozenset({"config", "models", "weights"}),
    "faults": frozenset({"config", "reporting"}),
    "hosting": frozenset({"config", "weights", "faults"}),
    "agents": frozenset({"config", "models", "data", "engines"}),
    "services": frozenset({"config", "models", "weights", "data", "engines", "faults", "rows", "agents"}),
}
ALLOWED["control"] = frozenset({*ALLOWED, "reporting", "hosting", "services"})
ALLOWED["bench"] = frozenset({*ALLOWED["control"], "control"})
ALLOWED["cli"] = frozenset({*ALLOWED["bench"], "bench"})
ALLOWED[FACE] = ALLOWED["bench"]
"""Layer → the layers it may import (besides itself and the root's helpers). Only ``cli`` imports ``bench``; only
``cli``, ``bench`` and the face import ``control``."""

TYPE_ONLY_EDGES: frozenset[tuple[str, str]] = frozenset(
    {
        # the health manager restarts the services of a pipeline, hosted alone or together
        ("relax_services.faults.health", "relax_services.control.pipeline"),
        ("relax_services.faults.health", "relax_services.hosting.cohost"),
        # a host process is built from a pipeline's service specs and serves each service's own methods
        ("relax_services.hosting.cohost", "relax_services.control.pipeline"),
        ("relax_services.hosting.service_host", "relax_services.services._base"),
        ("relax_services.hosting.service_host", "relax_services.data.prompts"),
        # the summary formats a run's result
        ("relax_services.reporting.summary", "relax_services.control.run_result"),
        # the row schema types its prompt field
        ("relax_services.rows", "relax_services.models"),
    }
)
"""Imports against :data:`ALLOWED` that only name a type for annotations (under ``TYPE_CHECKING``: they never run,
so they make no import cycle and load nothing). Each is listed; a new one fails the check like any other import."""

HEAVY = frozenset({"torch", "transformers", "vllm"})
LIGHT_LAYERS = frozenset({"config", "data", "hosting", "faults", "reporting", "control", "rows", "cli", FACE})
LIGHT_MODULES = frozenset({"relax_services.engines.registry"})
MODEL_STACK_MODULES = frozenset({"relax_services.control.colocated", "relax_services.control.warmup"})
"""Modules of light layers that are the model stack by design: colocated mode runs every service in the driver's
process, and the format warm-up runs in a Ray task of its own (the driver hands it over by name)."""


@dataclass(frozen=True)
class Import:
    target: str  # the dotted module (or module attribute) imported
    line: int
    runs_at_import: bool  # module level and not under TYPE_CHECKING
    type_only: bool = False  # under TYPE_CHECKING: names a type for annotations, never runs


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[Import]:
    def visit(node: ast.AST, top: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from (Import(i.target, i.line, False, True) for i in visit(child, False))
                continue
            here = top and not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(alias.name, child.lineno, top)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[: len(module.split(".")) - child.level + (1 if is_package else 0)]
                    origin = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    origin = child.module or ""
                for alias in child.names:
                    yield Import(f"{origin}.{alias.name}", child.lineno, top)
            yield from visit(child, here)

    yield from visit(tree, True)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}
IMPORTS: dict[str, list[Import]] = {
    name: list(_imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py"))
    for name, path in MODULES.items()
}


def _resolve(target: str) -> str | None:
    """The package module an import names (``relax_services.x.Name`` → ``relax_services.x``), else None."""
    parts = target.split(".")
    if parts[0] != PACKAGE:
        return None
    while parts and ".".join(parts) not in MODULES:
        parts.pop()
    return ".".join(parts) or None


def layer_of(module: str) -> str:
    """``relax_services.engines.fsdp.train`` → ``engines``; the root modules are their own layers."""
    parts = module.split(".")
    return FACE if len(parts) == 1 else parts[1]


def layer_violations(imports: dict[str, list[Import]]) -> list[str]:
    """Each import whose direction the table does not allow, as ``module:line imports target (a → b)``."""
    found = []
    for module, entries in imports.items():
        source = layer_of(module)
        for entry in entries:
            target = _resolve(entry.target)
            if target is None:
                continue
            dest = layer_of(target)
            if dest in (source, *HELPERS) or dest in ALLOWED[source]:
                continue
            if entry.type_only and (module, target) in TYPE_ONLY_EDGES:
                continue
            found.append(f"{module}:{entry.line} imports {target} ({source} → {dest})")
    return found


def _is_light(module: str) -> bool:
    if module in MODEL_STACK_MODULES:
        return False
    return layer_of(module) in LIGHT_LAYERS or module in LIGHT_MODULES


def _runs_on_import(module: str, imports: dict[str, list[Import]]) -> set[str]:
    """The package modules that importing ``module`` runs: its parents' ``__init__`` and what they import at
    module level, transitively."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        parts = current.split(".")
        for name in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
            if name in seen or name not in MODULES:
                continue
            seen.add(name)
            todo.extend(t for e in imports[name] if e.runs_at_import and (t := _resolve(e.target)) is not None)
    return seen


def light_violations(imports: dict[str, list[Import]]) -> list[str]:
    """Each light module that imports torch, transformers or vllm when imported, directly or through a package
    module it imports at module level, as ``module imports heavy (via module:line)``."""
    found = []
    for module in imports:
        if not _is_light(module):
            continue
        for runs in sorted(_runs_on_import(module, imports)):
            for entry in imports[runs]:
                top = entry.target.split(".")[0]
                if entry.runs_at_import and top in HEAVY:
                    found.append(f"{module} imports {top} (via {runs}:{entry.line})")
    return found


def test_every_import_follows_the_layers() -> None:
    assert set(ALLOWED) >= {layer_of(m) for m in MODULES} - HELPERS, "a folder has no row in ALLOWED"
    violations = layer_violations(IMPORTS)
    assert not violations, "imports against the layers:\n" + "\n".join(violations)


def test_light_modules_import_no_model_stack() -> None:
    violations = light_violations(IMPORTS)
    assert not violations, "light modules that import the model stack:\n" + "\n".join(violations)


def test_the_root_holds_only_the_face() -> None:
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert root == ["__init__.py", "_files.py", "_lazy.py", "_malloc.py", "cli.py", "rows.py"]
    for helper in HELPERS:
        assert all(_resolve(e.target) is None for e in IMPORTS[f"{PACKAGE}.{helper}"]), helper


@pytest.mark.parametrize(
    ("module", "statement", "expected"),
    [
        ("relax_services.engines.scoring", "from relax_services.data.feeder import Ledger", "(engines → data)"),
        ("relax_services.services.reward", "import relax_services.control.pipeline", "(services → control)"),
        ("relax_services.config.sizes", "from relax_services.models import families", "(config → models)"),
        ("relax_services.control.preflight", "from relax_services.bench import chaos", "(control → bench)"),
    ],
)
def test_a_wrong_import_is_named(module: str, statement: str, expected: str) -> None:
    """The check fails on a deliberately added wrong import, even one inside a function, naming the edge."""
    source = MODULES[module].read_text(encoding="utf-8") + f"\n\ndef _added() -> None:\n    {statement}\n"
    imports = {**IMPORTS, module: list(_imports(ast.parse(source), module, False))}
    violations = sorted(set(layer_violations(imports)) - set(layer_violations(IMPORTS)))
    assert len(violations) == 1 and violations[0].startswith(module) and violations[0].endswith(expected), violations


def test_a_heavy_import_in_a_light_module_is_named() -> None:
    """torch imported at module level by a light module, or by a package module it imports, is named."""
    module = "relax_services.faults.restart_counts"
    source = "import torch\n" + MODULES[module].read_text(encoding="utf-8")
    imports = {**IMPORTS, module: list(_imports(ast.parse(source), module, False))}
    violations = light_violations(imports)
    assert f"{module} imports torch (via {module}:1)" in violations
    # faults.health imports faults.restart_counts: it carries torch in as well
    assert f"relax_services.faults.health imports torch (via {module}:1)" in violations
