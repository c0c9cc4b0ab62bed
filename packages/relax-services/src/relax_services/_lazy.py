"""Package attributes imported on first use: one ``__getattr__`` / ``__dir__`` pair for every lazy package face.

A package whose ``__init__`` would otherwise import heavy modules (torch, transformers) for names a process never
uses lists each public name's module in a dict and binds the pair this returns::

    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` (PEP 562).

    Args:
        package: The package's ``__name__`` (it must be in ``sys.modules``: call this from its ``__init__``).
        exports: Public name → the module it is imported from on first use.

    Returns:
        ``__getattr__``, which imports the name, binds it in the package (later lookups skip the hook) and raises
        AttributeError for a name not in ``exports``; and ``__dir__``, the package's names and its ``__all__``.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value: object = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *namespace.get("__all__", ())])

    return __getattr__, __dir__
