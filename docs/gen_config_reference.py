"""Pages of the documentation site generated from the code, so that they cannot drift from it.

Two generators, both pure functions of the installed packages:

- :func:`config_reference`: every key of a run config (``RunConfig`` and its sections, relax-core's
  ``AlgorithmConfig`` under ``algorithm``), dotted, with its type, default, allowed values and docstring. The
  fields' docstrings are the attribute docstrings under each field, which pydantic reads into
  ``FieldInfo.description`` (relax-core's ``ConfigModel`` sets ``use_attribute_docstrings``).
- :func:`algorithm_table`: relax-core's algorithm table (``ALGORITHMS``) and its policy losses (``POLICY_LOSSES``).

mkdocs runs :func:`on_page_markdown` as a hook (``mkdocs.yml``: ``hooks``): a page's marker comment
``<!-- generated: config-reference -->`` or ``<!-- generated: algorithm-table -->`` is replaced by the
generated Markdown. ``python docs/gen_config_reference.py`` prints the configuration reference.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from typing import Any

import pydantic
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKERS = {
    "<!-- generated: config-reference -->": "config_reference",
    "<!-- generated: algorithm-table -->": "algorithm_table",
}


def _models_in(annotation: object) -> list[type[pydantic.BaseModel]]:
    """The pydantic models an annotation holds: itself, or the members of a union / list / dict."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _type_name(annotation: object) -> str:
    """A short, readable spelling of a field's type (module prefixes dropped, Literals as ``str``/``int``)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        kinds = sorted({type(a).__name__ for a in args})
        return " | ".join(kinds)
    if origin in (typing.Union, types.UnionType):
        parts: list[str] = []
        for arg in args:
            name = "None" if arg is type(None) else _type_name(arg)
            if name not in parts:
                parts.append(name)
        return " | ".join(parts)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if isinstance(annotation, type):
        return annotation.__name__
    return re.sub(r"\b(?:[a-z_][a-z0-9_]*\.)+", "", str(annotation))


def _literals(annotation: object) -> list[object]:
    """The values of every ``Literal`` in an annotation (through unions and aliases)."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    return [v for arg in typing.get_args(annotation) for v in _literals(arg)]


def _bounds(field: FieldInfo) -> list[str]:
    """The numeric and length bounds a field's metadata states (``ge``, ``gt``, ``le``, ``lt``, ``min_length``)."""
    symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}
    out = []
    for meta in field.metadata:
        for attr, symbol in symbols.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{symbol} {value}")
    return out


def _allowed(field: FieldInfo) -> str:
    """Allowed values: the Literal choices, else the bounds, else empty."""
    choices = _literals(field.annotation)
    parts = [", ".join(f"`{_plain(c)}`" for c in choices)] if choices else []
    parts += _bounds(field)
    return "; ".join(parts)


def _plain(value: object) -> str:
    """A value as YAML would spell it (``null``, ``true``, lists and dicts inline)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, pydantic.BaseModel):
        return "(section)"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(field: FieldInfo) -> str:
    """The field's default as a cell: the value, ``(section)`` for a nested model, or *required*."""
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        return "*required*"
    text = _plain(value)
    return text if text == "(section)" else f"`{text}`"


def _doc(field: FieldInfo) -> str:
    """The field's docstring as one Markdown table cell (reST roles and literals turned into code spans)."""
    return _markdown(field.description or "")


def _markdown(text: str) -> str:
    """A docstring as one line of Markdown: reST roles and double-backtick literals become code spans."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    text = " ".join(text.split())
    return text.replace("|", "\\|")


def iter_fields(model: type[pydantic.BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every field of ``model`` and its nested sections, depth first, as (dotted key, field).

    A list of models (``faults``) documents its items' keys as ``faults[].key``, a dict of models
    (``reward.routes``) its values' keys as ``reward.routes.<name>.key``; an optional section (``model.lora``)
    documents its keys under its own name.
    """
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"  # the name a YAML file spells (``data.schema``, not ``schema_``)
        yield key, field
        kinds = {typing.get_origin(a) for a in (field.annotation, *typing.get_args(field.annotation))}
        step = "[]." if list in kinds else ".<name>." if dict in kinds else "."
        for sub in _models_in(field.annotation):
            yield from iter_fields(sub, key + step)


def _section_of(key: str) -> str:
    return key.split(".", 1)[0].split("[", 1)[0]


def config_reference() -> str:
    """The configuration reference: one table per top-level section of ``RunConfig``."""
    from relax_services.config import RunConfig

    lines: list[str] = []
    section = None
    header = ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
    top_docs = {name: _doc(field) for name, field in RunConfig.model_fields.items()}
    for key, field in iter_fields(RunConfig):
        top = _section_of(key)
        if top != section:
            section = top
            model_doc = _models_in(RunConfig.model_fields[top].annotation)
            intro = top_docs[top] or (_markdown(model_doc[0].__doc__ or "") if model_doc else "")
            lines += ["", f"## `{top}`", "", intro, "", *header]
        lines.append(_row(key, field))
    return "\n".join(lines).strip() + "\n"


def _table_checked() -> dict[str, tuple[str, ...]]:
    """Keys typed ``str`` whose values are checked at load against relax-core's algorithm table."""
    import relax_core

    return {
        "algorithm.advantage_estimator": relax_core.estimator_names(),
        "algorithm.preset": relax_core.preset_names(),
    }


def _row(key: str, field: FieldInfo) -> str:
    allowed = _allowed(field)
    if key in _table_checked():
        allowed = ", ".join(f"`{name}`" for name in _table_checked()[key])
    return f"| `{key}` | `{_type_name(field.annotation)}` | {_default(field)} | {allowed} | {_doc(field)} |"


def algorithm_table() -> str:
    """relax-core's algorithm table as Markdown: each advantage estimator, what it needs, its presets; then the
    policy losses."""
    import relax_core

    def yes(flag: bool) -> str:
        return "yes" if flag else ""

    lines = [
        "| `advantage_estimator` | summary | groups | critic | reference | on-policy only | presets |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in relax_core.estimator_names():
        spec: Any = relax_core.ALGORITHMS[name]
        presets = ", ".join(f"`{p}`" for p in spec.presets)
        summary = " ".join(spec.summary.split()).replace("|", "\\|")
        lines.append(
            f"| `{name}` | {summary} | {yes(spec.needs_groups)} | {yes(spec.needs_critic)} "
            f"| {yes(spec.needs_reference)} | {yes(spec.on_policy_only)} | {presets} |"
        )
    losses = ", ".join(f"`{name}`" for name in relax_core.POLICY_LOSSES)
    lines += ["", f"`algorithm.policy_loss` takes one of: {losses}."]
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    """mkdocs hook: replace each generated-content marker of a page by its generated Markdown."""
    for marker, name in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, globals()[name]())
    return markdown


if __name__ == "__main__":
    print(config_reference())
