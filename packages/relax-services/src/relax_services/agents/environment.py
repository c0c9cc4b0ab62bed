"""The environment a user writes (``rollout.env``): a class loaded from ``path/file.py:Class`` or ``module:Class``,
read once into an :class:`EnvironmentSpec` that names its tools and their JSON schemas.

The class's interface (one instance per episode; every method may be ``def`` or ``async def``):

- ``reset(self, row) -> messages``: the first observation, chat messages (``{"role": ..., "content": ...}``; the
  content a string or a list of parts such as ``{"type": "text", "text": ...}``).
- every other public method with type hints and a Google-style docstring is a **tool**: its JSON schema (the
  OpenAI/Qwen tools format ``tokenizer.apply_chat_template(..., tools=...)`` takes) is inferred from the signature,
  the parameters' descriptions from the docstring's ``Args:`` section. It returns a string or a JSON-able value.
- ``step(self, assistant_message) -> (messages, reward | None, done)`` (optional): an environment that is not a
  tool set answers each assistant turn itself.
- ``reward(self) -> float`` (optional): the episode's reward; without it the run's ``reward.fn`` scores the final
  conversation.
- ``close(self)`` (optional): called once when the episode ends.
- ``modalities`` (optional class attribute, e.g. ``("image",)``): the media kinds its messages and tools may return
  (:mod:`~relax_services.agents.media`); a family that cannot take one is refused before anything runs.

A message's content parts are ``{"type": "text", "text": ...}`` and media parts in a dataset row's form:
``{"type": "image", "image": path_or_bytes}`` (likewise ``audio`` and ``video``; the item may also be under
``"path"`` or ``"bytes"``). A tool returns a string, a JSON-able value, or content parts (one part, or a list of
parts with at least one media part) when it shows the model an image, a sound or a video.

Every problem with the class is an :class:`EnvironmentSpecError` when it is loaded, naming the file and the method.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from relax_core import import_file

__all__ = [
    "LIFECYCLE_METHODS",
    "EnvironmentSpec",
    "EnvironmentSpecError",
    "Message",
    "ToolSpec",
    "load_environment",
]

Message = dict[str, object]
"""One chat message: ``role`` and ``content`` (a string, or a list of typed parts: ``{"type": "text", "text": ...}``
and image/audio/video parts as a dataset row's media, ``{"type": "image", "image": path_or_bytes}``), and for tool
results the tool's ``name``."""

LIFECYCLE_METHODS: tuple[str, ...] = ("reset", "step", "reward", "close")
"""Public methods that are the environment's own interface, never tools."""

_JSON_TYPES: dict[object, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


class EnvironmentSpecError(ValueError):
    """An environment spec that cannot be used: the module does not import, the class lacks ``reset``, a tool
    lacks type hints or a docstring, or a parameter's type has no JSON schema. The message names the file (or
    module) and the method."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool: a public method of the environment class.

    Attributes:
        name: The method's name, which the model calls.
        description: The docstring's summary (the text before its sections).
        parameters: JSON schema of the arguments (``{"type": "object", "properties": ..., "required": ...}``).
        is_async: The method is a coroutine function.
    """

    name: str
    description: str
    parameters: dict[str, object]
    is_async: bool

    @property
    def required(self) -> tuple[str, ...]:
        """Names of the arguments without a default."""
        required = self.parameters.get("required", [])
        return tuple(str(r) for r in required) if isinstance(required, list) else ()

    @property
    def argument_names(self) -> tuple[str, ...]:
        """Names of every argument."""
        props = self.parameters.get("properties", {})
        return tuple(props) if isinstance(props, dict) else ()

    def schema(self) -> dict[str, object]:
        """The tool in the OpenAI/Qwen tools format (``{"type": "function", "function": {...}}``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class EnvironmentSpec:
    """A loaded environment class and what it offers.

    Attributes:
        spec: The ``rollout.env`` string it was loaded from.
        cls: The class; one instance is made per episode (no constructor arguments).
        tools: Tool name → its spec, in definition order.
        has_step: The class answers assistant turns itself (``step``).
        has_reward: The class scores its episodes (``reward``).
        has_close: The class releases something when an episode ends (``close``).
        modalities: The media kinds its messages and tools may carry (the class's ``modalities``; empty: text).
    """

    spec: str
    cls: type
    tools: dict[str, ToolSpec]
    has_step: bool
    has_reward: bool
    has_close: bool
    modalities: tuple[str, ...] = ()

    def schemas(self) -> list[dict[str, object]]:
        """Every tool in the OpenAI/Qwen tools format, for the chat template's ``tools``."""
        return [tool.schema() for tool in self.tools.values()]

    def new(self) -> object:
        """A fresh instance for one episode."""
        return self.cls()


def load_module_of(
    spec: str, field: str, kind: str, prefix: str, error: type[EnvironmentSpecError]
) -> tuple[types.ModuleType, str, str]:
    """The module a ``path/to/file.py:name`` or ``module:name`` spec points into, where it was found (the file or
    module, for messages) and the attribute name; the file is imported by :func:`relax_core.import_file` (one
    module per file, named by its path's hash with ``prefix``, so two env.py files coexist).

    Args:
        spec: The config value.
        field: The config field (``rollout.env``), first in every message.
        kind: What the attribute is (``Class``, ``function``), for the format message.
        prefix: The module name's prefix for a file.
        error: The error raised (naming ``field`` and ``spec``).
    """
    where_part, sep, attr = spec.rpartition(":")
    if not sep or not where_part or not attr:
        raise error(f"{field} {spec!r}: expected 'path/to/file.py:{kind}' or 'module:{kind}'")
    if where_part.endswith(".py"):
        path = Path(where_part).resolve()
        if not path.is_file():
            raise error(f"{field} {spec!r}: file {str(path)!r} does not exist")
        try:
            return import_file(path, prefix, f"{field} {spec!r}"), str(path), attr
        except ValueError as exc:
            raise error(str(exc)) from exc
    try:
        return importlib.import_module(where_part), where_part, attr
    except Exception as exc:
        raise error(f"{field} {spec!r}: importing module {where_part!r} failed: {type(exc).__name__}: {exc}") from exc


def _load_class(spec: str) -> tuple[type, str]:
    """The class ``spec`` names and where it was found (the file or module, for messages)."""
    module, where, attr = load_module_of(spec, "rollout.env", "Class", "relax_user_env", EnvironmentSpecError)
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EnvironmentSpecError(f"rollout.env {spec!r}: {where!r} has no class {attr!r}")
    return cls, where


def _docstring_args(doc: str) -> tuple[str, dict[str, str]]:
    """A Google-style docstring → (summary, argument name → description)."""
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    args: dict[str, str] = {}
    section = None
    current = None
    for line in lines:
        header = re.fullmatch(r"(\w[\w ]*):\s*", line)
        if header and not line.startswith(" "):
            section, current = header.group(1).lower(), None
            continue
        if section is None:
            summary.append(line)
        elif section in ("args", "arguments", "parameters"):
            entry = re.fullmatch(r"\s{1,8}(\*{0,2}\w+)(?:\s*\(.*?\))?:\s*(.*)", line)
            if entry and (current is None or len(line) - len(line.lstrip()) <= 8):
                current = entry.group(1).lstrip("*")
                args[current] = entry.group(2).strip()
            elif current is not None and line.strip():
                args[current] = f"{args[current]} {line.strip()}".strip()
    return " ".join(s.strip() for s in summary if s.strip()), args


def _json_schema(tp: object, where: str) -> dict[str, object]:
    """JSON schema of a parameter's annotation, or an error naming ``where``."""
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        if not kinds <= {str, int, float, bool}:
            raise EnvironmentSpecError(f"{where}: Literal values must be str, int, float or bool, got {args}")
        schema: dict[str, object] = {"enum": list(args)}
        if len(kinds) == 1:
            schema["type"] = _JSON_TYPES[kinds.pop()]
        return schema
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        items = [a for a in args if a is not Ellipsis]
        out: dict[str, object] = {"type": "array"}
        if len(items) == 1:
            out["items"] = _json_schema(items[0], where)
        elif items:
            raise EnvironmentSpecError(f"{where}: a fixed-length tuple has no JSON schema; use tuple[X, ...] or list")
        return out
    if origin is dict or tp is dict:
        if args and args[0] is not str:
            raise EnvironmentSpecError(f"{where}: dict keys must be str in JSON, got {args[0]!r}")
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = _json_schema(args[1], where)
        return out
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _json_schema(rest[0], where)
        return {"anyOf": [_json_schema(a, where) for a in rest]}
    raise EnvironmentSpecError(
        f"{where}: type {tp!r} has no JSON schema (use str, int, float, bool, Literal, an Enum, list, dict, or "
        "X | None of them)"
    )


def _tool(cls: type, name: str, fn: Callable[..., object], where: str) -> ToolSpec:
    at = f"rollout.env: {where}: method {cls.__name__}.{name}"
    doc = inspect.getdoc(fn)
    if not doc:
        raise EnvironmentSpecError(f"{at} is public, so it is a tool, and has no docstring (prefix it with _ if not)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise EnvironmentSpecError(f"{at}: its type hints do not resolve: {type(exc).__name__}: {exc}") from exc
    summary, described = _docstring_args(doc)
    properties: dict[str, object] = {}
    required: list[str] = []
    for param in list(inspect.signature(fn).parameters.values())[1:]:  # past self
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise EnvironmentSpecError(f"{at}: *args and **kwargs cannot be tool arguments ({param.name!r})")
        if param.name not in hints:
            raise EnvironmentSpecError(f"{at}: parameter {param.name!r} has no type hint")
        schema = _json_schema(hints[param.name], f"{at}, parameter {param.name!r}")
        if param.name in described:
            schema["description"] = described[param.name]
        properties[param.name] = schema
        if param.default is param.empty:
            required.append(param.name)
    if "return" not in hints:
        raise EnvironmentSpecError(f"{at}: no return type hint")
    parameters: dict[str, object] = {"type": "object", "properties": properties, "required": required}
    return ToolSpec(name, summary or name, parameters, inspect.iscoroutinefunction(fn))


def load_environment(spec: str) -> EnvironmentSpec:
    """Loads ``rollout.env`` and reads its tools.

    Args:
        spec: ``path/to/file.py:Class`` (relative to the working directory) or ``module:Class``.

    Raises:
        EnvironmentSpecError: naming the file or module, and the method where one is at fault.
    """
    cls, where = _load_class(spec)
    methods: Mapping[str, object] = {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and not hasattr(object, name)
    }
    if "reset" not in methods:
        raise EnvironmentSpecError(f"rollout.env: {where}: class {cls.__name__} has no method reset(self, row)")
    tools: dict[str, ToolSpec] = {}
    order = {name: i for i, name in enumerate(vars(cls))}  # definition order of the class's own methods first
    for name in sorted(methods, key=lambda n: (order.get(n, len(order)), n)):
        fn = methods[name]
        if name in LIFECYCLE_METHODS or not callable(fn):
            continue
        tools[name] = _tool(cls, name, fn, where)
    has_step = "step" in methods
    if not tools and not has_step:
        raise EnvironmentSpecError(
            f"rollout.env: {where}: class {cls.__name__} has neither tools (public typed, documented methods) nor "
            "step(self, assistant_message)"
        )
    try:
        inspect.signature(cls).bind()
    except TypeError as exc:
        raise EnvironmentSpecError(
            f"rollout.env: {where}: class {cls.__name__} must be constructible without arguments ({exc})"
        ) from exc
    declared = getattr(cls, "modalities", ())
    if not isinstance(declared, tuple | list) or not all(isinstance(k, str) for k in declared):
        raise EnvironmentSpecError(
            f"rollout.env: {where}: {cls.__name__}.modalities must be a tuple of modality names, got {declared!r}"
        )
    has_reward, has_close = "reward" in methods, "close" in methods
    return EnvironmentSpec(spec, cls, tools, has_step, has_reward, has_close, tuple(declared))
