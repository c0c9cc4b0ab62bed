"""The documentation site's generated pages (``docs/gen_config_reference.py``): the configuration reference names
every key a run config takes, and the algorithm table every entry of relax-core's table. ``.ci/run`` builds the
site with ``mkdocs build --strict`` (broken links, pages missing from the navigation)."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pydantic

import relax_core
from relax_core import import_file
from relax_services.config import RunConfig

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
gen = import_file(DOCS / "gen_config_reference.py", "relax_docs", "docs/gen_config_reference.py")


def dotted_keys(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """Every key of ``model`` as a YAML file spells it (aliases; list items as ``key[].sub``, dict values as
    ``key.<name>.sub``), walked here
    independently of the generator."""
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        keys.append(key)
        union = typing.get_origin(field.annotation) in (typing.Union, types.UnionType)
        for member in typing.get_args(field.annotation) if union else (field.annotation,):
            if typing.get_origin(member) in (list, dict):
                item = typing.get_args(member)[-1]
                if isinstance(item, type) and issubclass(item, pydantic.BaseModel):
                    keys += dotted_keys(item, key + ("[]." if typing.get_origin(member) is list else ".<name>."))
            elif isinstance(member, type) and issubclass(member, pydantic.BaseModel):
                keys += dotted_keys(member, key + ".")
    return keys


def test_every_run_config_key_is_in_the_reference() -> None:
    page = gen.config_reference()
    rows = set(re.findall(r"^\| `([^`]+)` \|", page, flags=re.MULTILINE))
    keys = dotted_keys(RunConfig)
    assert len(keys) > 150  # the sections' keys, not only the 16 top-level ones
    assert set(keys) == rows, (sorted(set(keys) - rows), sorted(rows - set(keys)))
    for section in RunConfig.model_fields:
        assert f"## `{section}`" in page


def test_a_reference_row_states_type_default_bounds_and_docstring() -> None:
    page = gen.config_reference()
    gamma = next(line for line in page.splitlines() if line.startswith("| `algorithm.gamma` |"))
    # AlgorithmConfig: gamma: float = Field(default=1.0, ge=0.0, le=1.0), docstring "Discount factor γ ..."
    assert gamma.split(" | ")[1:4] == ["`float`", "`1.0`", "≥ 0.0; ≤ 1.0"]
    assert "Discount factor γ" in gamma
    kind = next(line for line in page.splitlines() if line.startswith("| `faults[].kind` |"))
    assert "`kill`, `raise`, `hang`, `break`, `kill_rank`" in kind and "| `kill` |" in kind
    estimator = next(line for line in page.splitlines() if line.startswith("| `algorithm.advantage_estimator` |"))
    assert all(f"`{name}`" in estimator for name in relax_core.estimator_names())


def test_the_algorithm_table_lists_every_estimator_and_loss() -> None:
    table = gen.algorithm_table()
    rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.MULTILINE)
    assert rows == ["advantage_estimator", *relax_core.estimator_names()]  # the header, then one row per entry
    gae = next(line for line in table.splitlines() if line.startswith("| `gae` |"))
    assert gae.count("| yes |") == 2  # needs a critic, on-policy only
    assert all(f"`{name}`" in table for name in relax_core.POLICY_LOSSES)


def test_the_pages_hold_the_markers_the_hook_fills() -> None:
    for marker, name in gen.MARKERS.items():
        pages = [p.name for p in DOCS.glob("*.md") if marker in p.read_text(encoding="utf-8")]
        assert pages, f"no page holds {marker}"
        assert marker not in gen.on_page_markdown(marker)
        assert gen.on_page_markdown(marker) == getattr(gen, name)()
