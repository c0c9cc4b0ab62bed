"""Tool calls read per family: Qwen's ``<tool_call>`` JSON, and every family naming a known parser."""

from __future__ import annotations

import pytest

from relax_services.agents import TOOL_PARSERS, ToolCall, parse_qwen_tool_calls, tool_parser
from relax_services.models import FAMILIES


def test_qwen_calls() -> None:
    text = (
        'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>'
        '<tool_call>[{"name": "f"}, {"name": "g", "parameters": {"y": [1]}}]</tool_call>'
    )
    assert parse_qwen_tool_calls(text) == [
        ToolCall("add", {"a": 1, "b": 2}),
        ToolCall("neg", {"x": 3}),  # arguments written as a JSON string
        ToolCall("f", {}),
        ToolCall("g", {"y": [1]}),
    ]
    assert parse_qwen_tool_calls("no calls here") == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{bad</tool_call>", "the tool call is not valid JSON: Expecting property name"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', None),  # unclosed last tag: read to the end
        ('<tool_call>{"arguments": {}}</tool_call>', "a tool call needs a string 'name'"),
        ('<tool_call>"add"</tool_call>', "a tool call must be a JSON object, got str"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "arguments of 'add' must be a JSON object"),
    ],
)
def test_unreadable_calls_carry_their_error(text: str, error: str | None) -> None:
    (found,) = parse_qwen_tool_calls(text)
    if error is None:
        assert found == ToolCall("add", {"a": 1})
    else:
        assert found.error is not None and found.error.startswith(error)


def test_every_family_names_a_known_parser() -> None:
    for family in FAMILIES.values():
        assert tool_parser(family.tool_parser, family.name) is TOOL_PARSERS[family.tool_parser]
    with pytest.raises(ValueError, match="family 'x' names tool parser 'hermes'"):
        tool_parser("hermes", "x")
