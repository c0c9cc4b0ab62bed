"""Generic typed-config machinery: base model, YAML loading, dotted overrides, dumping.

Any package composes its own run config from ``ConfigModel`` subclasses (including the component
configs of relax-core) and loads it with :func:`load_config`. Validation failures become a single
:class:`ConfigError` whose message names each offending dotted field, the bad value and what is
allowed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from pydantic.fields import FieldInfo

__all__ = [
    "ConfigError",
    "ConfigIssue",
    "ConfigModel",
    "apply_overrides",
    "config_error_from",
    "dump_config",
    "load_config",
    "parse_override",
    "read_yaml_mapping",
]

ConfigT = TypeVar("ConfigT", bound="ConfigModel")


class ConfigModel(pydantic.BaseModel):
    """Base of every relax config: unknown keys are errors, assignments are validated.

    Each field is documented by the docstring written under it (``use_attribute_docstrings``), so
    ``Model.model_fields[name].description`` always holds the field's documentation.
    """

    model_config = pydantic.ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


@dataclass(frozen=True)
class ConfigIssue:
    """One validation problem.

    Attributes:
        path: Dotted path of the offending field, e.g. ``"algorithm.clip_eps_high"``.
        value: The rejected value (``None`` when the field was missing).
        message: What went wrong.
        allowed: What the field accepts, when known (e.g. ``"'ppo', 'gspo'"`` or ``"> 0"``).
        show_value: Whether the message quotes ``value``; off for a check across several fields, whose message
            names the fields and values involved (the value would be the whole section).
    """

    path: str
    value: Any
    message: str
    allowed: str | None = None
    show_value: bool = True

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.show_value:
            text += f" (got {self.value!r})"
        if self.allowed:
            text += f"; allowed: {self.allowed}"
        return text


class ConfigError(ValueError):
    """A config failed to load or validate.

    Attributes:
        issues: Every problem found, each naming its dotted field path.
        path: Dotted path of the first problem (convenience for the common single-issue case).
    """

    def __init__(self, issues: Sequence[ConfigIssue], source: str | None = None) -> None:
        self.issues = list(issues)
        self.path = self.issues[0].path if self.issues else ""
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {issue}" for issue in self.issues)
        super().__init__(f"invalid config{where}:\n{lines}")


_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _allowed_from_error(
    err: Mapping[str, Any], loc: Sequence[str], model: type[pydantic.BaseModel] | None
) -> str | None:
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        return str(ctx["expected"])
    if any(key in ctx for key in _BOUND_WORDS):
        # Report every bound of the field, not only the one that was violated.
        field = _field_at(model, loc) if model is not None else None
        bounds = _bounds(field) or {key: ctx[key] for key in _BOUND_WORDS if key in ctx}
        return ", ".join(f"{_BOUND_WORDS[key]} {value}" for key, value in bounds.items())
    if err["type"] == "extra_forbidden" and model is not None:
        parent = _field_at(model, loc[:-1]) if loc[:-1] else None
        owner = parent.annotation if parent is not None else (model if not loc[:-1] else None)
        if isinstance(owner, type) and issubclass(owner, pydantic.BaseModel):
            return ", ".join(sorted(owner.model_fields))
    return None


def _bounds(field: FieldInfo | None) -> dict[str, Any]:
    """The numeric bounds (gt/ge/lt/le) declared on a field, in that order."""
    found = {key: getattr(m, key) for m in (field.metadata if field else []) for key in _BOUND_WORDS if hasattr(m, key)}
    return {key: found[key] for key in _BOUND_WORDS if key in found}


def _field_at(model: type[pydantic.BaseModel], loc: Sequence[str]) -> FieldInfo | None:
    """The field found by walking ``loc`` through nested models, or None if it cannot be resolved."""
    current: Any = model
    field: FieldInfo | None = None
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, pydantic.BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = field.annotation
    return field


def _issues_from_validation(
    exc: pydantic.ValidationError, model: type[pydantic.BaseModel] | None, prefix: str = ""
) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors():
        # Literal/union errors carry the branch name in loc (e.g. 'literal[...]'); keep field names only.
        loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal[", "constrained-"))]
        path = ".".join(([prefix] if prefix else []) + loc)
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key"
        elif err["type"] == "literal_error":
            message = "not one of the allowed values"
        value = None if err["type"] == "missing" else err.get("input")
        show_value = True
        if err["type"] == "value_error":  # raised by a validator: its own words, without pydantic's prefix
            message = str((err.get("ctx") or {}).get("error", message))
            # A check across fields (a model validator) gets the whole section as its input: the message
            # names the fields involved, the section itself would only bury it.
            show_value = not isinstance(value, Mapping)
        issues.append(ConfigIssue(path, value, message, _allowed_from_error(err, loc, model), show_value))
    return issues


def parse_override(override: str) -> tuple[list[str], Any]:
    """Split ``"a.b.c=value"`` into its key path and a YAML-parsed value.

    The value is parsed as YAML, so ``0.28`` is a float, ``null`` is None, ``[1, 2]`` a list and
    ``true`` a bool; anything else stays a string.

    Raises:
        ConfigError: If there is no ``=`` or the key is empty.
    """
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([ConfigIssue(key, override, "override must look like 'dotted.key=value'")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a deep copy of ``data`` with each ``dotted.key=value`` override applied in order.

    Intermediate mappings are created as needed; unknown keys are left for validation to reject
    (with their full dotted path).

    Raises:
        ConfigError: If an override is malformed or descends into a non-mapping value.
    """
    result: dict[str, Any] = copy.deepcopy(dict(data))
    for override in overrides:
        keys, value = parse_override(override)
        node = result
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                path = ".".join(keys[: depth + 1])
                raise ConfigError(
                    [ConfigIssue(path, child, f"cannot set '{'.'.join(keys)}': '{path}' is not a mapping")]
                )
            node = child
        node[keys[-1]] = value
    return result


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping ({} when empty); ConfigError naming the file when unreadable or not a mapping."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([ConfigIssue("", str(path), f"cannot read config file: {exc.strerror}")], str(path)) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigIssue("", str(path), f"invalid YAML: {exc}")], str(path)) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("", type(data).__name__, "top level must be a mapping")], str(path))
    return data


def load_config(
    cls: type[ConfigT],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> ConfigT:
    """Build a validated config of type ``cls`` from YAML (file or mapping) plus dotted overrides.

    Args:
        cls: The config class, any :class:`ConfigModel` subclass (a component or a whole run).
        source: A YAML file path, an already-parsed mapping, or None for all defaults.
        overrides: ``"dotted.key=value"`` strings applied after the source, in order.

    Returns:
        The validated config.

    Raises:
        ConfigError: On unreadable/invalid YAML, malformed overrides, unknown keys or bad values;
            the message names every offending dotted field, the bad value and what is allowed.
    """
    where = None
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        where = str(source)
        data = read_yaml_mapping(Path(source))
    data = apply_overrides(data, overrides)
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(_issues_from_validation(exc, cls), where) from None


def config_error_from(
    exc: pydantic.ValidationError, model: type[pydantic.BaseModel] | None = None, prefix: str = ""
) -> ConfigError:
    """Convert a pydantic ``ValidationError`` (e.g. from an assignment) into a :class:`ConfigError`.

    Args:
        exc: The pydantic error.
        model: The model that raised it, so unknown-key errors can list the allowed keys.
        prefix: Dotted path of that model inside a larger config (e.g. ``"algorithm"``).
    """
    return ConfigError(_issues_from_validation(exc, model, prefix))


def dump_config(cfg: pydantic.BaseModel) -> str:
    """Render a resolved config as YAML that :func:`load_config` reads back to an equal config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
