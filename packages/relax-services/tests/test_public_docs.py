"""Every public function and method of relax-services' public modules has a docstring (the issue's "public methods
documented"): private modules (``_name.py``), private names and dunder methods are exempt."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "relax_services"


def undocumented(source: str) -> list[str]:
    """Public top-level functions and public methods of public classes in ``source`` without a docstring."""
    out: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if not node.name.startswith("_") and ast.get_docstring(node) is None:
                out.append(node.name)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                is_function = isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_function and not sub.name.startswith("_") and ast.get_docstring(sub) is None:
                    out.append(f"{node.name}.{sub.name}")
    return out


def test_the_checker_finds_an_undocumented_public_method() -> None:
    source = '''
def f(): ...
def _g(): ...
class C:
    def m(self): ...
    def n(self):
        """Documented."""
    def __init__(self): ...
class _D:
    def m(self): ...
'''
    assert undocumented(source) == ["f", "C.m"]


def test_public_functions_and_methods_are_documented() -> None:
    missing = [
        f"{path.relative_to(SRC)}:{name}"
        for path in sorted(SRC.rglob("*.py"))
        if not any(part.startswith("_") and part != "__init__.py" for part in path.relative_to(SRC).parts)
        for name in undocumented(path.read_text(encoding="utf-8"))
    ]
    assert not missing, f"public functions/methods without a docstring: {missing}"
