"""Tool calls in an assistant turn's text, parsed in the format of the model's family.

A family names its parser in the families table (:attr:`~relax_services.models.ModelFamily.tool_parser`);
:data:`TOOL_PARSERS` maps that name to the function. A call the parser cannot read is kept as a
:class:`ToolCall` with its ``error`` set: the episode answers it with an error message the model sees.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "TOOL_PARSERS",
    "TOOL_TEXT",
    "ToolCall",
    "ToolParser",
    "parse_qwen_tool_calls",
    "qwen_text_outside_calls",
    "tool_parser",
    "tool_text",
]


@dataclass(frozen=True)
class ToolCall:
    """One tool call the model made.

    Attributes:
        name: The tool's name ("" when the call could not be read).
        arguments: The call's arguments.
        error: Why the call cannot be run (bad JSON, no name, arguments not an object); None when it can.
    """

    name: str
    arguments: dict[str, object] = field(default_factory=dict)
    error: str | None = None


ToolParser = Callable[[str], list[ToolCall]]
"""An assistant turn's text → its tool calls in order (empty: the turn is a final answer)."""

_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _qwen_call(payload: object) -> ToolCall:
    if not isinstance(payload, dict):
        return ToolCall("", error=f"a tool call must be a JSON object, got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", error="a tool call needs a string 'name'")
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return ToolCall(name, error=f"arguments of {name!r} are not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f"arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, {str(k): v for k, v in arguments.items()})


def parse_qwen_tool_calls(text: str) -> list[ToolCall]:
    """Qwen2.5/3's tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per tag (a tag
    holding a JSON list gives one call per element; an unclosed last tag is read to the end of the text)."""
    calls: list[ToolCall] = []
    for match in _QWEN_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON: {exc}"))
            continue
        calls.extend(_qwen_call(p) for p in (payload if isinstance(payload, list) else [payload]))
    return calls


def qwen_text_outside_calls(text: str) -> str:
    """An assistant turn's text without its ``<tool_call>`` blocks (the message content an OpenAI-compatible
    server returns beside the parsed ``tool_calls``), stripped."""
    return _QWEN_CALL.sub("", text).strip()


TOOL_PARSERS: dict[str, ToolParser] = {
    "qwen": parse_qwen_tool_calls,
}
"""Parser name (the families table's ``tool_parser`` column) → parser."""

TOOL_TEXT: dict[str, Callable[[str], str]] = {
    "qwen": qwen_text_outside_calls,
}
"""Parser name → the function that keeps an assistant turn's text outside its tool calls."""


def tool_parser(name: str, family: str) -> ToolParser:
    """The parser ``family`` names.

    Raises:
        ValueError: no parser of that name, naming the family and the known parsers.
    """
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"family {family!r} names tool parser {name!r}, which is not one of {sorted(TOOL_PARSERS)}"
        ) from None


def tool_text(name: str, family: str) -> Callable[[str], str]:
    """The function that keeps the text outside the tool calls of the parser ``family`` names.

    Raises:
        ValueError: no parser of that name, naming the family and the known parsers.
    """
    tool_parser(name, family)
    return TOOL_TEXT[name]
