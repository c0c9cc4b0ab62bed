"""How much of relax-services' function signatures is ``Any``: a guard that keeps the services typed.

Counts, with ``ast``, the parameter and return annotations of every function and method under
``src/relax_services`` that mention ``Any`` (an annotation counts once however often it names it). Run this file
with python to print the count per file.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "relax_services"
LIMIT = 37  # was 112 before the services were typed against the queue, weight-store, engine and row schemas


def _mentions_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Any":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "Any":
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "Any" in sub.value:
            return True  # a quoted annotation: "dict[str, Any]"
    return False


def count_any(source: str) -> int:
    """Parameter and return annotations mentioning ``Any`` in ``source``."""
    total = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p is not None)]
            total += sum(_mentions_any(p.annotation) for p in params) + _mentions_any(node.returns)
    return total


def per_file() -> dict[str, int]:
    """The count of every source file of relax-services."""
    return {str(p.relative_to(SRC)): count_any(p.read_text(encoding="utf-8")) for p in sorted(SRC.rglob("*.py"))}


def test_the_counter_counts_annotations_not_names() -> None:
    source = """
from typing import Any
import typing

def f(a: Any, b: int, *args: Any, c: "dict[str, Any]", **kw: typing.Any) -> list[Any]: ...

class C:
    async def g(self, x: dict[Any, Any]) -> None:
        y: Any = x  # a local annotation is not a signature
    def h(self, z: object) -> int: ...
"""
    # f: a, *args, c, **kw, return = 5; g: x = 1 (one annotation naming Any twice); h: 0
    assert count_any(source) == 6


def test_services_signatures_stay_typed() -> None:
    counts = per_file()
    total = sum(counts.values())
    worst = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    assert total < LIMIT, f"{total} signature annotations mention Any (limit {LIMIT}); most in {worst}"


if __name__ == "__main__":
    counts = per_file()
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if n:
            print(f"{n:4d}  {name}")
    print(f"{sum(counts.values()):4d}  total (limit {LIMIT})")
    sys.exit(0)
