"""Exact tokens across turns, as a property over the chat templates of the tiny checkpoints of every family and
Qwen2.5's tool-calling template: for random tool-call conversations, each turn's prompt (previous prompt + sampled
tokens verbatim + the environment's delta) equals the tokenisation of the whole conversation re-rendered, so turn
n+1's prompt starts with turn n's prompt and its sampled tokens, and every environment segment is the template's
own rendering."""

from __future__ import annotations

import copy
import json
import random
import string
from pathlib import Path

import pytest

from relax_services.agents import ChatTemplateError, ChatTokens, Message, PrefixBreakError, parse_qwen_tool_calls
from relax_services.models import open_checkpoint
from relax_services.models.tiny_families import TINY_FAMILIES, write_tiny_checkpoint

TOOLS: list[dict[str, object]] = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        },
    }
]
TINY_TEXT = string.ascii_lowercase + string.digits + " +-*=?.,:!\n"  # characters the default tokenizer holds
CASES = 40


@pytest.fixture(scope="module")
def family_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each family's tiny checkpoint's tokenizer, read back from its folder as a run reads it."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in [*TINY_FAMILIES, "qwen2.5-omni-thinker"]:
        out[family] = open_checkpoint(write_tiny_checkpoint(Path(root) / family, family)).tokenizer
    return out


def _text(rng: random.Random, alphabet: str, longest: int = 12) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, longest)))


def _assistant_text(rng: random.Random, alphabet: str, tool_calls: bool) -> str:
    if not tool_calls or rng.random() < 0.3:
        return _text(rng, alphabet)
    calls = [json.dumps({"name": "add", "arguments": {"a": rng.randint(0, 99)}}) for _ in range(rng.randint(1, 2))]
    return _text(rng, alphabet, 4) + "".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def _check_episodes(chat: ChatTokens, alphabet: str, env_roles: tuple[str, ...], tool_calls: bool, seed: int) -> int:
    """Runs CASES random conversations; returns the number of environment segments checked."""
    rng = random.Random(seed)
    checked = 0
    for _ in range(CASES):
        history: list[Message] = [{"role": "user", "content": _text(rng, alphabet)}]
        if rng.random() < 0.5:
            history.insert(0, {"role": "system", "content": _text(rng, alphabet)})
        prompt = chat.prompt_ids(history)
        for _turn in range(rng.randint(1, 4)):
            sampled = [*chat.encode(_assistant_text(rng, alphabet, tool_calls)), chat.eos_id]
            assistant: Message = {"role": "assistant", "content": chat.decode(sampled[:-1])}
            role = rng.choice(env_roles)
            new: list[Message] = [
                {"role": role, "name": "add", "content": _text(rng, alphabet)}
                for _ in range(rng.randint(1, 3) if role == "tool" else 1)
            ]
            delta = chat.delta_ids(history, assistant, new)
            next_prompt = prompt + sampled + delta
            history += [assistant, *new]
            rerendered = chat.encode(chat.render(history, generation_prompt=True))
            assert next_prompt == rerendered  # the whole conversation re-rendered: the same ids
            assert rerendered[: len(prompt) + len(sampled)] == prompt + sampled
            assert delta == rerendered[len(prompt) + len(sampled) :]  # the template's own rendering of the new turn
            prompt = next_prompt
            checked += 1
    return checked


@pytest.mark.parametrize("family", [*TINY_FAMILIES, "qwen2.5-omni-thinker"])
def test_turns_extend_each_other_exactly_for_every_family(family: str, family_tokenizers: dict[str, object]) -> None:
    tokenizer = family_tokenizers[family]
    chat = ChatTokens(tokenizer, family, tokenizer.eos_token_id, TOOLS)  # type: ignore[arg-type, attr-defined]
    chat.check_prefix_preserving("tool")
    assert _check_episodes(chat, TINY_TEXT, ("tool", "user"), tool_calls=False, seed=sum(map(ord, family))) >= CASES


def test_turns_extend_each_other_exactly_with_qwen_tool_calls(qwen_tokenizer: object) -> None:
    chat = ChatTokens(qwen_tokenizer, "qwen2", qwen_tokenizer.eos_token_id, TOOLS)  # type: ignore[arg-type, attr-defined]
    chat.check_prefix_preserving("tool")
    alphabet = string.ascii_letters + string.digits + ' {}":,<>/_\n'
    assert _check_episodes(chat, alphabet, ("tool",), tool_calls=True, seed=7) >= CASES
    # the delta of two tool results is Qwen's grouped <tool_response> user turn, after the eos's newline
    history: list[Message] = [{"role": "user", "content": "q"}]
    assistant: Message = {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'}
    new: list[Message] = [{"role": "tool", "name": "add", "content": c} for c in ("2", "3")]
    expected = (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chat.delta_text(history, assistant, new) == expected
    assert parse_qwen_tool_calls(str(assistant["content"]))[0].arguments == {"a": 1}


def test_a_template_that_rewrites_past_turns_is_refused_naming_the_family(qwen_tokenizer: object) -> None:
    """A template that renders only the last assistant turn's text (as templates that drop past reasoning do)."""
    template = str(qwen_tokenizer.chat_template).replace(  # type: ignore[attr-defined]
        "'<|im_start|>' + message.role + '\\n' + message.content",
        "'<|im_start|>' + message.role + '\\n' + (message.content if loop.last or message.role != 'assistant' else '')",
    )
    assert template != qwen_tokenizer.chat_template  # type: ignore[attr-defined]
    copy = _copy(qwen_tokenizer, template)
    with pytest.raises(ChatTemplateError, match="family qwen3-like"):
        ChatTokens(copy, "qwen3-like", copy.eos_token_id, TOOLS).check_prefix_preserving("tool")  # type: ignore[attr-defined]


def test_a_content_dependent_rewrite_is_found_at_its_turn(qwen_tokenizer: object) -> None:
    """A template that strips reasoning from every assistant turn passes the probe, and breaks at the turn whose
    sampled text has reasoning."""
    template = str(qwen_tokenizer.chat_template).replace(  # type: ignore[attr-defined]
        "'<|im_start|>' + message.role + '\\n' + message.content",
        "'<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1]",
    )
    copy = _copy(qwen_tokenizer, template)
    chat = ChatTokens(copy, "qwen3-like", copy.eos_token_id, TOOLS)  # type: ignore[attr-defined]
    chat.check_prefix_preserving("tool")
    history: list[Message] = [{"role": "user", "content": "q"}]
    tool: list[Message] = [{"role": "tool", "name": "add", "content": "2"}]
    chat.delta_text(history, {"role": "assistant", "content": "plain"}, tool)
    with pytest.raises(PrefixBreakError, match="qwen3-like"):
        chat.delta_text(history, {"role": "assistant", "content": "<think>r</think>a"}, tool)


def _copy(tokenizer: object, template: str) -> object:
    """A copy of the (session-shared) tokenizer with another template."""
    out = copy.deepcopy(tokenizer)
    out.chat_template = template  # type: ignore[attr-defined]
    return out
