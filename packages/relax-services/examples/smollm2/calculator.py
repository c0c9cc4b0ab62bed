"""The SmolLM2 calculator example: multiplication of two-digit numbers with a ``multiply`` tool, over several turns.

    rollout.env=packages/relax-services/examples/smollm2/calculator.py:Calculator
    reward.fn=packages/relax-services/examples/smollm2/calculator.py:score

A row asks ``What is 47*86?``; the model may call ``multiply`` (``<tool_call>[{"name": "multiply", "arguments":
{"a": 47, "b": 86}}]</tool_call>``), reads the tool's reply (a ``tool`` message, masked out of the loss) and answers
in a later turn. The reward is 1 when the final assistant turn's answer is the product, else 0: a 135 M model
cannot multiply two-digit numbers in its head, so the reward is near 0 without the tool and the tool call is what
RL can reinforce.

SmolLM2's chat template ignores ``tools`` (it renders only role and content), so the tool is described in the
system prompt of every row (:func:`system_prompt`, written by ``prepare.py --task calculator``), in the format
SmolLM2-Instruct was tuned on for function calling: a ``<tools>`` JSON list, and calls as a JSON list inside
``<tool_call>``; the family's ``qwen`` parser reads both a JSON object and a list inside the tag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

_INTEGER = re.compile(r"-?\d+")
_EXPRESSION = re.compile(r"^\s*-?\d+\s*[*x×]\s*-?\d+")  # "47 * 86" opening "47 * 86 = 4042"
_TURN = "\nassistant\n"  # how a later assistant turn opens in the decoded response (special tokens removed)


class Calculator:
    """A calculator the model may call; the episode's messages are the row's prompt."""

    def reset(self, row: Mapping[str, object]) -> list[dict[str, object]]:
        """The row's chat prompt (system prompt with the tool, then the question)."""
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"calculator: row {row.get('id')!r} has no chat prompt ('messages')")
        return list(messages)

    def multiply(self, a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return int(a) * int(b)


def system_prompt(tools: list[dict[str, object]]) -> str:
    """The system prompt that shows SmolLM2 the tools (its template does not) and the call format."""
    listing = json.dumps([t["function"] for t in tools])
    return (
        "You are an expert in composing functions. You are given a question and a set of possible functions. "
        "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n\n"
        f"You have access to the following tools:\n<tools>{listing}</tools>\n\n"
        "The output MUST strictly adhere to the following format, and NO other text MUST be included.\n"
        '<tool_call>[\n{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}}'
        "\n]</tool_call>"
        "\nAfter the tool's result, reply with only the final number."
    )


QUESTION = "What is {a}*{b}? Use the multiply tool."
DEMO = (17, 32)  # the one worked exchange every prompt shows


def prompt(a: int, b: int, tools: list[dict[str, object]]) -> list[dict[str, object]]:
    """A row's chat prompt: the system prompt, one worked exchange (question, call, tool result, answer) and the
    question. Without the worked exchange SmolLM2-135M (Q4_1) called the tool in 0 of 16 greedy episodes; with it,
    about a third (measured in the example's README section)."""
    x, y = DEMO
    call = json.dumps([{"name": "multiply", "arguments": {"a": x, "b": y}}])
    return [
        {"role": "system", "content": system_prompt(tools)},
        {"role": "user", "content": QUESTION.format(a=x, b=y)},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(x * y)},
        {"role": "assistant", "content": str(x * y)},
        {"role": "user", "content": QUESTION.format(a=a, b=b)},
    ]


def final_turn(response: str) -> str:
    """The last assistant turn of a decoded episode (its text after the last tool result)."""
    return response.rsplit(_TURN, 1)[-1]


def answer(response: str) -> str | None:
    """The integer the final assistant turn gives as its answer: the first one after an optional restated
    ``a * b``; None when the turn has none or is itself a tool call.

    ``4042`` gives ``4042``; ``47 * 86 = 4042`` ``4042``; ``The answer is 4042.`` ``4042``; a turn that is a
    ``<tool_call>`` (the episode ran out of turns) None.
    """
    turn = final_turn(response)
    if "<tool_call>" in turn:
        return None
    numbers = _INTEGER.findall(_EXPRESSION.sub("", turn, count=1))
    return numbers[0] if numbers else None


def score(response: str, ground_truth: str, metadata: Mapping[str, object]) -> float:
    """1.0 when :func:`answer` of the decoded episode is ``ground_truth`` (whitespace stripped), else 0.0."""
    return 1.0 if answer(response) == ground_truth.strip() else 0.0
