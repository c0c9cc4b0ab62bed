"""relax_services' public face: every exported name resolves from the module its table names, and importing
the package stays light (the ``relax`` command starts without torch)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import relax_services


def test_all_matches_the_export_table() -> None:
    assert relax_services.__all__ == list(relax_services._EXPORTS)
    assert len(set(relax_services.__all__)) == len(relax_services.__all__)


@pytest.mark.parametrize("name", relax_services.__all__)
def test_every_export_resolves_to_its_module_object(name: str) -> None:
    module = importlib.import_module(relax_services._EXPORTS[name])
    assert getattr(relax_services, name) is getattr(module, name)


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = relax_services.no_such_name  # type: ignore[attr-defined]


def test_importing_the_package_imports_no_heavy_dependency() -> None:
    code = "import sys, relax_services; print(sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
